"""Llama-architecture GGUF files -> (LlamaConfig, params, Tokenizer).

The tensors are dequantized to float32 with the `gguf` package, renamed to their HF names and
handed to `treespec_jax.models.hf.target_params_from_hf`, so a GGUF and a safetensors checkpoint
of the same weights give identical params. Two things differ from HF on the way:

* llama.cpp's converter reorders the rows of each attention head of attn_q / attn_k from HF's
  rotate-half layout (first half of the head, then second half) into interleaved pairs, which
  its RoPE kernel rotates. `unpermute_rows` restores the HF order, which the JAX model's
  rotate-half RoPE expects. A wrong order changes nothing but the rotation, so only a forward
  pass over two or more positions reveals it (tests/test_gguf_loader.py checks one).
* Metadata replaces config.json: `gguf_config` builds the LlamaConfig from the `llama.*` keys
  and refuses, in one error, every key value this implementation would get wrong.

Tensor types read: GGUF_TENSOR_TYPES (floats, the legacy block quants and the K-quants). The
IQ*, TQ*, MXFP4 / NVFP4 quants and integer tensors are refused by name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.hf import CheckpointError, Tensors, resolve_dtype, target_params_from_hf, target_tensor_specs

GGUF_ARCHITECTURE = "llama"
GGUF_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor name (layer number as {i}) <-> HF name.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}
_HF_TO_GGUF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_GGUF_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor name; None for a name with no HF counterpart."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _GGUF_LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


def hf_to_gguf_name(name: str) -> str:
    """The GGUF name of an HF target tensor name (the inverse of gguf_to_hf_name)."""
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    m = _HF_LAYER_RE.match(name)
    if m and m.group(2) in _HF_TO_GGUF_LAYER:
        return f"blk.{m.group(1)}.{_HF_TO_GGUF_LAYER[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"HF tensor {name!r} has no GGUF name")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's per-head interleaving of attn_q / attn_k rows (n_head: the query heads
    for attn_q, the KV heads for attn_k)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of even size")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --------------------------------------------------------------------------------------------
# Metadata
# --------------------------------------------------------------------------------------------


class GGUFMetadata:
    """Plain Python values of a GGUFReader's key/value fields (strings decoded, arrays as lists).

    Decodes the fields' raw parts itself rather than through ReaderField.contents, which older
    gguf releases lack.
    """

    def __init__(self, reader):
        import gguf

        self._fields = reader.fields
        self._vt = gguf.GGUFValueType

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def keys(self):
        return self._fields.keys()

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        if field is None or not field.types:
            return default
        vt = self._vt
        if field.types[0] == vt.ARRAY:
            elem = field.types[1] if len(field.types) > 1 else None
            if elem == vt.STRING:
                return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
            if elem == vt.ARRAY:
                return None  # nested arrays: no key this module reads has them
            return [field.parts[i][0].item() for i in field.data]
        part = field.parts[field.data[0]]
        if field.types[0] == vt.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        if field.types[0] == vt.FLOAT32:
            # The shortest decimal that round-trips through float32 is the value the converter
            # was given (1e-05 rather than 9.999999747378752e-06), as config.json would hold it.
            return float(str(np.float32(part[0])))
        value = part[0].item()
        return bool(value) if field.types[0] == vt.BOOL else value


def open_gguf(reader_or_path):
    """A GGUFReader of a path (a reader passes through); a clear error for a bad file."""
    if isinstance(reader_or_path, (str, os.PathLike)):
        import gguf

        path = Path(reader_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
        try:
            return gguf.GGUFReader(str(path))
        except Exception as err:  # the reader raises bare ValueErrors and struct errors alike
            raise CheckpointError(str(path), [f"not a readable GGUF file: {err}"]) from None
    return reader_or_path


def gguf_config(reader_or_path) -> LlamaConfig:
    """The LlamaConfig a Llama GGUF's metadata describes; raises CheckpointError listing every
    unsupported or missing value."""
    reader = open_gguf(reader_or_path)
    source = str(getattr(reader, "path", reader_or_path))
    meta = GGUFMetadata(reader)
    arch = meta.get("general.architecture")
    if arch != GGUF_ARCHITECTURE:
        raise CheckpointError(source, [f"general.architecture {arch!r} is not supported (only {GGUF_ARCHITECTURE!r})"])
    p = "llama."
    problems = []
    required = {}
    for key in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count"):
        value = meta.get(p + key)
        if value is None:
            problems.append(f"missing {p + key}")
        elif not isinstance(value, int):
            problems.append(f"{p + key} is {value!r}, expected one integer (per-layer values are not supported)")
        else:
            required[key] = value
    kv = meta.get(p + "attention.head_count_kv", required.get("attention.head_count"))
    if kv is not None and not isinstance(kv, int):
        problems.append(f"{p}attention.head_count_kv is {kv!r}, expected one integer "
                        "(per-layer values are not supported)")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(p + "vocab_size")
    if tokens is None and vocab is None:
        problems.append("neither tokenizer.ggml.tokens nor llama.vocab_size gives the vocabulary size")
    elif tokens is not None and vocab is not None and len(tokens) != vocab:
        problems.append(f"llama.vocab_size {vocab} disagrees with the {len(tokens)} tokens of tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else vocab
    for key in ("expert_count", "attention.sliding_window"):
        value = meta.get(p + key)
        if value:
            problems.append(f"{p + key}={value} is not supported (dense full-attention layers only)")
    scaling = meta.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        problems.append(f"{p}rope.scaling.type {scaling!r} is not supported")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        problems.append("rope_freqs.weight (RoPE frequency factors) is not supported")
    head_dim = None
    heads = required.get("attention.head_count")
    if heads and "embedding_length" in required:
        head_dim = meta.get(p + "attention.key_length", required["embedding_length"] // heads)
        value_dim = meta.get(p + "attention.value_length", head_dim)
        if value_dim != head_dim:
            problems.append(f"{p}attention.value_length {value_dim} differs from key_length {head_dim}")
        rot = meta.get(p + "rope.dimension_count", head_dim)
        if rot != head_dim:
            problems.append(f"{p}rope.dimension_count {rot} differs from the head size {head_dim} "
                            "(partial rotary is not supported)")
    if problems:
        raise CheckpointError(source, problems)
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    try:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=required["embedding_length"],
            intermediate_size=required["feed_forward_length"],
            num_layers=required["block_count"],
            num_heads=heads,
            num_kv_heads=kv,
            head_dim=head_dim,
            rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
            rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in names,
            max_position_embeddings=int(meta.get(p + "context_length", 4096)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            family="llama",
        )
    except ValueError as err:
        raise CheckpointError(source, getattr(err, "problems", [str(err)])) from None


# --------------------------------------------------------------------------------------------
# Tensors
# --------------------------------------------------------------------------------------------


def gguf_tensor_specs(cfg: LlamaConfig, *, optional: bool = False) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> shape as numpy reads it ([out, in], the HF shape) for `cfg`."""
    return {hf_to_gguf_name(k): v for k, v in target_tensor_specs(cfg, optional=optional).items()}


def gguf_tensors(reader_or_path, cfg: LlamaConfig) -> Tensors:
    """The GGUF's tensors under their HF names and in HF row order, dequantized to float32 when
    read. Raises CheckpointError listing every missing, unexpected or misshapen tensor (GGUF
    names) and every tensor type not in GGUF_TENSOR_TYPES."""
    from gguf.quants import dequantize

    reader = open_gguf(reader_or_path)
    source = str(getattr(reader, "path", reader_or_path))
    specs = gguf_tensor_specs(cfg, optional=True)
    required = gguf_tensor_specs(cfg)
    problems, mistyped = [], []
    by_name = {}
    for t in reader.tensors:
        by_name[t.name] = t
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dims innermost first
        if t.name not in specs:
            problems.append(f"unexpected tensor {t.name} (shape {list(shape)}, {t.tensor_type.name})")
        elif shape != specs[t.name]:
            problems.append(f"tensor {t.name} has shape {list(shape)}, expected {list(specs[t.name])}")
        if t.tensor_type.name not in GGUF_TENSOR_TYPES:
            mistyped.append(f"tensor {t.name} has type {t.tensor_type.name}, which is not supported "
                            f"(only {', '.join(GGUF_TENSOR_TYPES)})")
    missing = [f"missing tensor {n} (expected shape {list(s)})" for n, s in required.items() if n not in by_name]
    problems = missing + problems + mistyped
    if problems:
        raise CheckpointError(source, problems)

    permute_heads = {}
    for i in range(cfg.num_layers):
        permute_heads[f"model.layers.{i}.self_attn.q_proj.weight"] = cfg.num_heads
        permute_heads[f"model.layers.{i}.self_attn.k_proj.weight"] = cfg.num_kv_heads
    hf_of = {gguf_to_hf_name(n): n for n in by_name}

    def read(hf_name: str) -> np.ndarray:
        t = by_name[hf_of[hf_name]]
        shape = specs[t.name]
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if hf_name in permute_heads:
            w = unpermute_rows(w, permute_heads[hf_name])
        return w

    names = [gguf_to_hf_name(n) for n in by_name]
    return Tensors({n: specs[hf_to_gguf_name(n)] for n in names}, {n: np.dtype(np.float32) for n in names}, read)


def load_gguf(path: str | os.PathLike, dtype: str = "bf16", *,
              progress: Callable[[str], None] | None = None):
    """(LlamaConfig, params, Tokenizer) of a Llama GGUF, floats cast to `dtype`.

    The config and every tensor are checked before any is dequantized; errors list every problem.
    """
    from treespec_jax.tokenizer import Tokenizer

    resolve_dtype(dtype)
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    tensors = gguf_tensors(reader, cfg)
    if progress is not None:
        progress(f"dequantizing {len(tensors)} tensors of {path}")
    params = target_params_from_hf(cfg, tensors, dtype, source=str(path))
    return cfg, params, tokenizer
