"""Building an `Engine` from checkpoints: an HF directory or a GGUF file, and an EAGLE-3 head.

The configuration is checked first (rules and tree-capability blockers, `support.check_startup`),
so a refused run reads no weights. A target given as a `.gguf` file is read with its own tokenizer
(`models.gguf.load_gguf`); an HF directory takes `tokenizer.json` / `tokenizer_config.json` when
present (without them prompts must be token ids).
"""

from __future__ import annotations

from pathlib import Path

from treespec_jax.config import ServeConfig, SpeculativeConfig
from treespec_jax.models.attention import PagedAttention

DEFAULT_TREE = SpeculativeConfig(algorithm="EAGLE3", topk=4, num_steps=5, num_draft_tokens=16)


def attention_kind(config: ServeConfig) -> str:
    """The attention a run's layers take (`PagedAttention.kind`): "cascade" (the Pallas kernels)
    or "dense" (XLA over the gathered pages, fp32 softmax). `attention_backend = "auto"` takes the
    kernels on a GPU, where they compile, and XLA elsewhere: off the GPU the kernels run in Pallas'
    interpreter, exact but far too slow to serve a real model (a CPU test asks for "cascade", or
    for an "interpret" / "reference" kernel backend, to run them there)."""
    choice = config.backends.attention_backend
    if choice == "auto":
        from pallas_kernels.common import on_gpu

        return "cascade" if on_gpu() or config.backends.kernel_backend != "pallas" else "dense"
    return "dense" if choice == "dense" else "cascade"


def attention_for(config: ServeConfig) -> PagedAttention:
    """The attention every layer of a run uses (target and drafter share it)."""
    kind = attention_kind(config)
    backend = None if config.backends.kernel_backend == "pallas" else config.backends.kernel_backend
    return PagedAttention(config.kv_cache.page_size, kind=kind, kernel_backend=backend,
                          prefix_kernel=config.backends.prefix_kernel)


def load_target(path, dtype: str):
    """-> (LlamaConfig, params, Tokenizer or None) from a `.gguf` file or an HF directory."""
    path = Path(path)
    if path.suffix == ".gguf":
        from treespec_jax.models.gguf import load_gguf

        return load_gguf(path, dtype)
    from treespec_jax.models.hf import load_target as load_hf
    from treespec_jax.tokenizer import Tokenizer

    cfg, params = load_hf(path, dtype)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return cfg, params, tokenizer


def load_pair(engine_cls, target_dir, draft_dir=None, config: ServeConfig | None = None):
    """`Engine.from_pretrained`: config defaults to EAGLE-3 K=4, S=5, N=16 with a draft
    directory and to plain decoding without one."""
    from treespec_jax.support import check_startup

    if config is None:
        config = ServeConfig(speculative=DEFAULT_TREE) if draft_dir is not None else ServeConfig()
    draft_dir = draft_dir if draft_dir is not None else config.speculative.draft_model_path
    target_dir = target_dir if target_dir is not None else config.model.path
    if target_dir is None:
        raise ValueError("no target model: pass a directory / .gguf file or set model.path")
    check_startup(config)
    cfg, params, tokenizer = load_target(target_dir, config.model.dtype)
    drafter = draft_params = None
    if draft_dir is not None and config.speculative.enabled:
        from treespec_jax.drafter.eagle3 import Eagle3Drafter
        from treespec_jax.models.hf import load_eagle3

        head_cfg, head = load_eagle3(draft_dir, config.model.dtype)
        drafter = Eagle3Drafter(head_cfg, cfg, attention_for(config))
        draft_params = {**head, "embed": params["embed"]}
    return engine_cls(config, cfg, params, drafter, draft_params, tokenizer)
