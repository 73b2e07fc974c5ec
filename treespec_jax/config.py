"""Typed serving configuration, its TOML form, and every configuration-time refusal.

A run is described by one `ServeConfig`: sections `model`, `speculative`, `kv_cache`, `sampling`,
`parallel`, `scheduler`, `backends`, plus a top-level `seed`. The same config comes from

- a TOML file (`load_toml`): one `[section]` per dataclass below, keys are the field names;
  an unknown section or key, or a value of the wrong type, is an error naming it;
- command-line flags with SGLang's spelling (`--speculative-eagle-topk 4`, ...): each field's
  metadata names its flag, and `treespec_jax.cli` builds its parser from that table.

`ServeConfig.validate()` checks every rule and raises one `ConfigError` listing every violation
with the offending values. Tree-shape rules (K = topk, S = num_steps, N = num_draft_tokens):

- a tree (K > 1) needs the EAGLE3 or MTP algorithm and an explicit N;
- 1 <= K <= 16, 1 <= S <= 10, (S-1)*K <= N (the draft lanes' slots fit the verify window);
- 2 <= N <= min(64, K + (S-1)*K^2 + 1) (at most every candidate plus the root, and at most 64
  nodes so one ancestor row fits 64 bits);
- a chain (K = 1) verifies exactly S + 1 tokens: N omitted means S + 1, any other N is refused;
- trees refuse structured output, mixed prefill/decode batches, prefill/decode disaggregation,
  pipeline parallelism, attention data parallelism, and a multi-depth MTP drafter.

Defaults: speculation is off (`algorithm = "NONE"`). With an algorithm and nothing else, the run
is a chain with K = 1, S = 3, N = 4. With `NONE`, setting any other speculative field is an error
(it would be silently ignored otherwise).

Backend capability (sliding windows, sinks, KV dtype, linear attention, ...) is resolved
separately by `treespec_jax.support`; `support.check_startup` runs both.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A verify tree has at most as many nodes as one packed ancestor-mask row has bits (64).
from pallas_kernels.tree_masks import MAX_TREE_NODES

# The descriptor nodes and the config share one list of legal values per fact.
from treespec_jax.support import (
    DRAFTER_ALGORITHMS,
    MODEL_DTYPES,
    SAMPLING_BACKENDS,
)
from treespec_jax.support import LINEAR_ATTENTION_KINDS as _LINEAR_KINDS

__all__ = [
    "ConfigError",
    "ModelConfig",
    "SpeculativeConfig",
    "KVCacheConfig",
    "SamplingConfig",
    "ParallelConfig",
    "SchedulerConfig",
    "BackendsConfig",
    "ServeConfig",
    "load_toml",
    "to_toml",
    "MAX_TOPK",
    "MAX_NUM_STEPS",
    "MAX_TREE_NODES",
    "DEFAULT_NUM_STEPS",
]

# Lane bookkeeping ranks siblings with 6 bits per level, and the depth-first key packs S levels
# into 62 bits; K <= 16 and S <= 10 keep both inside their bit budgets.
MAX_TOPK = 16
MAX_NUM_STEPS = 10
# Draft steps when an algorithm is chosen but num_steps is not given.
DEFAULT_NUM_STEPS = 3

# Seeds ride in int32 arrays (DecodeState.seeds) and key jax.random: the engine refuses a request
# seed outside [0, 2^31), so the config's default seed is held to the same range at startup.
MAX_SEED = 2**31 - 1

SPECULATIVE_ALGORITHMS = DRAFTER_ALGORITHMS + ("NONE",)
TREE_ALGORITHMS = DRAFTER_ALGORITHMS
LINEAR_ATTENTION_KINDS = ("none",) + _LINEAR_KINDS
KV_CACHE_DTYPES = ("auto", "bf16", "fp8_e4m3")
# "auto" picks by model: the GQA cascade for softmax-attention targets, the latent cascade for MLA.
ATTENTION_BACKENDS = ("auto", "cascade", "mla_cascade", "dense")
# Kept literal (not imported from pallas_kernels.common) so the CLI starts without importing jax;
# tests/test_config.py checks the two agree.
KERNEL_BACKENDS = ("pallas", "interpret", "reference")
# Prefix-half kernels of the attention cascades (treespec_jax.attention.cascade.PREFIX_KERNELS).
# "auto" takes "mosaic_gpu" where it runs compiled (GPU, page 64/128; MLA: 16-bit KV), else "triton";
# an explicit "mosaic_gpu" also takes FP8 MLA caches (that path is not timed yet).
PREFIX_KERNELS = ("auto", "triton", "mosaic_gpu")
# CUDA graphs of the decode step (treespec_jax.engine.compile_options.GRAPH_OPTIONS): "auto" picks per
# program, "xla" keeps XLA's defaults, "all" graphs runs from one kernel up, "off" graphs nothing.
CUDA_GRAPHS = ("auto", "xla", "all", "off")
# RMSNorm with its residual add (treespec_jax.models.llama.NORM_KERNELS): "auto" = the Pallas kernel
# on a GPU without tensor parallelism, "pallas" forces it, "xla" leaves the norms to XLA's fusions.
NORM_KERNELS = ("auto", "pallas", "xla")
# RoPE of q/k with the K/V write (treespec_jax.models.llama.ROPE_KERNELS): "auto" = the Pallas kernel
# on a GPU without tensor parallelism (faster than XLA's at every 8B-shaped batch timed; results:
# rope-kernel), else XLA; "pallas" forces it (refused with tp_size > 1); "xla". The kernel runs where
# it applies (fused projections, no q/k norm, power-of-two head_dim, 16/32-bit pools).
ROPE_KERNELS = ("auto", "xla", "pallas")
GRAMMAR_BACKENDS = ("none", "xgrammar", "outlines", "llguidance")
DISAGGREGATION_MODES = ("null", "prefill", "decode")


class ConfigError(ValueError):
    """Every configuration problem found at once; `problems` holds one line each."""

    subject = "configuration"  # what the message says is invalid

    def __init__(self, problems: typing.Sequence[str]):
        self.problems = tuple(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid {self.subject}; {len(self.problems)} problem(s):\n{lines}")


def opt(default: Any, flag: str | None, doc: str, choices: tuple | None = None):
    """A config field: its default, its CLI flag (None: TOML only), what it means, legal values.

    The doc string is the field's comment and its `--help` text.
    """
    return field(default=default, metadata={"flag": flag, "doc": doc, "choices": choices})


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The target model. Architecture facts are normally read from the checkpoint's config; here
    they may be declared so that check-config can refuse unsupported models up front."""

    path: str | None = opt(None, "--model-path",
                           "checkpoint directory (HF layout); omitted: the embedded small demo model")
    dtype: str = opt("bf16", "--dtype", "weights and activations dtype", MODEL_DTYPES)
    context_length: int | None = opt(None, "--context-length",
                                     "max tokens per request (prompt + output); omitted: the model's")
    sliding_window: int | None = opt(None, "--sliding-window",
                                     "sliding-window length of the target's attention layers; omitted: full attention")
    attention_sinks: bool = opt(False, "--attention-sinks",
                                "the target's attention layers use learned sink logits")
    linear_attention: str = opt("none", "--linear-attention",
                                "linear-attention kind of a hybrid target's recurrent layers",
                                LINEAR_ATTENTION_KINDS)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: K = topk, S = num_steps, N = num_draft_tokens (verify nodes)."""

    algorithm: str = opt("NONE", "--speculative-algorithm",
                         "drafter algorithm; NONE = plain decoding", SPECULATIVE_ALGORITHMS)
    draft_model_path: str | None = opt(None, "--speculative-draft-model-path",
                                       "drafter checkpoint; omitted: the one paired with the model")
    topk: int = opt(1, "--speculative-eagle-topk",
                    "K: lanes kept per draft step (children per lane); 1 = chain, >1 = tree")
    num_steps: int | None = opt(None, "--speculative-num-steps",
                                f"S: draft steps per round; omitted: {DEFAULT_NUM_STEPS}")
    num_draft_tokens: int | None = opt(None, "--speculative-num-draft-tokens",
                                       "N: verify nodes incl. the root; required for trees, omitted chain: S + 1")
    chain_above_batch: int | None = opt(None, "--speculative-chain-above-batch",
                                        "rounds with more running requests than this verify a chain of S + 1 "
                                        "nodes (K = 1) instead of the tree: wide trees stop paying at large "
                                        "batches; omitted: always the tree")
    mtp_depth: int = opt(1, "--speculative-mtp-depth",
                         "MTP modules the drafter chains, one per depth; 1 = one module re-run every step "
                         "(can branch), >1 = multi-depth MTP (chains only)")
    draft_sliding_window: int | None = opt(None, "--speculative-draft-sliding-window",
                                           "sliding-window length of the drafter's attention; omitted: full")
    draft_attention_sinks: bool = opt(False, "--speculative-draft-attention-sinks",
                                      "the drafter's attention uses learned sink logits")
    draft_linear_attention: str = opt("none", "--speculative-draft-linear-attention",
                                      "linear-attention kind inside the drafter (none for EAGLE heads)",
                                      LINEAR_ATTENTION_KINDS)

    @property
    def enabled(self) -> bool:
        return self.algorithm != "NONE"

    @property
    def steps(self) -> int:
        """S after defaults."""
        return DEFAULT_NUM_STEPS if self.num_steps is None else self.num_steps

    @property
    def is_tree(self) -> bool:
        return self.enabled and self.topk > 1

    @property
    def verify_tokens(self) -> int:
        """N after defaults: 1 without speculation, S + 1 for an omitted chain N."""
        if not self.enabled:
            return 1
        if self.num_draft_tokens is None:
            if self.topk != 1:
                raise ValueError(f"topk = {self.topk} (a tree) has no default num_draft_tokens")
            return self.steps + 1
        return self.num_draft_tokens

    @property
    def max_tree_nodes(self) -> int:
        """Candidates plus the root: K + (S-1)K^2 + 1."""
        k, s = self.topk, self.steps
        return k + (s - 1) * k * k + 1

    @property
    def lane_slots(self) -> int:
        """Draft-window slots the lanes of steps 1..S-1 write: (S-1)K."""
        return (self.steps - 1) * self.topk


@dataclass(frozen=True)
class KVCacheConfig:
    """Paged KV pools."""

    dtype: str = opt("auto", "--kv-cache-dtype", "KV pool dtype; auto = the model dtype", KV_CACHE_DTYPES)
    page_size: int = opt(64, "--page-size", "tokens per page (a power of two; kernels tile by it)")
    mem_fraction_static: float = opt(0.85, "--mem-fraction-static",
                                     "fraction of device memory for weights plus KV pools (where the device "
                                     "reports its memory; a CPU does not)")
    max_total_tokens: int | None = opt(None, "--max-total-tokens",
                                       "KV pool capacity in tokens; omitted: every slot's full context, cut to "
                                       "what mem_fraction_static holds (on a CPU: host_kv_gib)")
    host_kv_gib: float = opt(4.0, "--host-kv-gib",
                             "KV pool budget in GiB where the device reports no memory (a CPU) and "
                             "max_total_tokens is omitted: every slot's full context is cut to it")


@dataclass(frozen=True)
class SamplingConfig:
    """Target-side sampling and acceptance, and the default per-request sampling parameters."""

    # "gumbel" by default: it serves greedy and sampled requests side by side, each token for token
    # what plain decoding with its seed gives, and a batch of greedy requests costs what "greedy"
    # costs (its step draws argmax only, `Engine._draw_of`). "greedy" refuses any temperature > 0.
    backend: str = opt("gumbel", "--sampling-backend",
                       "acceptance: keyed Gumbel-max (gumbel; argmax at temperature 0), greedy argmax only, "
                       "tree rejection sampling", SAMPLING_BACKENDS)
    temperature: float = opt(0.0, "--temperature", "default temperature; 0 = argmax (greedy backend requires 0)")
    top_k: int = opt(-1, "--top-k", "default top-k; -1 = off")
    top_p: float = opt(1.0, "--top-p", "default nucleus mass in (0, 1]; 1 = off")


@dataclass(frozen=True)
class ParallelConfig:
    """Device parallelism."""

    tp_size: int = opt(1, "--tp-size", "tensor-parallel degree (heads sharded across devices)")
    pp_size: int = opt(1, "--pp-size", "pipeline-parallel stages")
    dp_size: int = opt(1, "--dp-size", "data-parallel replicas")
    enable_dp_attention: bool = opt(False, "--enable-dp-attention",
                                    "data-parallel attention with tensor-parallel MLP")


@dataclass(frozen=True)
class SchedulerConfig:
    """Request scheduling and the serving features that interact with speculation."""

    max_running_requests: int = opt(32, "--max-running-requests", "decode batch size B (static shapes)")
    chunked_prefill_size: int = opt(8192, "--chunked-prefill-size",
                                    "prompt tokens per prefill step: chunks of min(this, 256) tokens, "
                                    "this // chunk requests prefilled together (at most B)")
    min_prefill_group: int = opt(0, "--min-prefill-group",
                                 "while requests decode, waiting ones are admitted only once this many slots "
                                 "are free (or all that wait fit): a prefill costs far less per request in a "
                                 "group, and a decode step the same with a few slots idle; 0 = B // 8, at least 1")
    enable_mixed_chunk: bool = opt(False, "--enable-mixed-chunk",
                                   "mix prefill chunks into decode batches")
    grammar_backend: str = opt("none", "--grammar-backend",
                               "structured-output (constrained decoding) engine; none = off", GRAMMAR_BACKENDS)
    disaggregation_mode: str = opt("null", "--disaggregation-mode",
                                   "prefill/decode disaggregation role; null = colocated", DISAGGREGATION_MODES)


@dataclass(frozen=True)
class BackendsConfig:
    """Attention and kernel backends."""

    attention_backend: str = opt("auto", "--attention-backend", "target attention backend", ATTENTION_BACKENDS)
    drafter_attention_backend: str = opt("auto", "--drafter-attention-backend",
                                         "drafter attention backend", ATTENTION_BACKENDS)
    kernel_backend: str = opt("pallas", "--kernel-backend",
                              "kernel path: pallas (compiled on GPU, interpret on CPU), interpret, reference",
                              KERNEL_BACKENDS)
    disable_replay_ssm: bool = opt(False, "--disable-replay-ssm",
                                   "linear-attention commit stages a state per node instead of replaying the path")
    prefix_kernel: str = opt("auto", "--prefix-kernel",
                             "prefix half of the attention cascades: auto (mosaic_gpu where it runs, else "
                             "triton), triton, or mosaic_gpu (page size 64 or 128)",
                             PREFIX_KERNELS)
    cuda_graphs: str = opt("auto", "--cuda-graphs",
                           "CUDA graphs of the decode step: auto (the measured best per program, XLA's default for "
                           "both), xla (XLA's default: runs of a few kernels up), "
                           "all (runs from one kernel up), off (every kernel launched alone)", CUDA_GRAPHS)
    norm_kernel: str = opt("auto", "--norm-kernel",
                           "the target's RMSNorms with their residual adds: auto (the Pallas kernel on a GPU "
                           "without tensor parallelism, else XLA), pallas, xla", NORM_KERNELS)
    rope_kernel: str = opt("auto", "--rope-kernel",
                           "the target's RoPE and K/V write: auto (the Pallas kernel, one program a token and "
                           "KV head, on a GPU without tensor parallelism, else XLA), pallas, xla", ROPE_KERNELS)


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "speculative": SpeculativeConfig,
    "kv_cache": KVCacheConfig,
    "sampling": SamplingConfig,
    "parallel": ParallelConfig,
    "scheduler": SchedulerConfig,
    "backends": BackendsConfig,
}


@dataclass(frozen=True)
class ServeConfig:
    """One serving run. TOML: `seed = ...` at top level, one table per section."""

    model: ModelConfig = field(default_factory=ModelConfig)  # the target model
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)  # drafter and tree shape
    kv_cache: KVCacheConfig = field(default_factory=KVCacheConfig)  # paged KV pools
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # acceptance / sampling
    parallel: ParallelConfig = field(default_factory=ParallelConfig)  # TP / PP / DP
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # batching and features
    backends: BackendsConfig = field(default_factory=BackendsConfig)  # attention / kernel backends
    seed: int = opt(0, "--seed", "base RNG seed; a request's draws depend on (its seed, position) only")

    # ---- construction -----------------------------------------------------------------------

    @classmethod
    def from_dict(cls, data: typing.Mapping[str, Any], *, source: str = "config") -> ServeConfig:
        """Builds from a TOML-shaped mapping; raises ConfigError naming unknown keys / bad types."""
        problems: list[str] = []
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in SECTIONS:
                if not isinstance(value, typing.Mapping):
                    problems.append(f"{source}: [{key}] must be a table, got {value!r}")
                    continue
                kwargs[key] = _build_section(SECTIONS[key], value, f"{source}: {key}", problems)
            elif key == "seed":
                kwargs[key] = _coerce(_field_types(cls)["seed"], value, f"{source}: seed", problems)
            else:
                problems.append(
                    f"{source}: unknown key {key!r} (known: seed and tables {sorted(SECTIONS)})"
                )
        if problems:
            raise ConfigError(problems)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """TOML-shaped mapping; None values are left out (omitted keys mean None)."""
        out: dict[str, Any] = {"seed": self.seed}
        for name in SECTIONS:
            section = getattr(self, name)
            out[name] = {
                f.name: getattr(section, f.name)
                for f in dataclasses.fields(section)
                if getattr(section, f.name) is not None
            }
        return out

    def replace(self, **sections: Any) -> ServeConfig:
        """Copy with whole sections or the seed replaced."""
        return dataclasses.replace(self, **sections)

    # ---- validation -------------------------------------------------------------------------

    def problems(self) -> list[str]:
        """Every violated rule, one line each naming the values; empty when valid."""
        out: list[str] = []
        _check_choices(self, out)
        _check_ranges(self, out)
        _check_speculative(self.speculative, out)
        _check_tree_features(self, out)
        return out

    def validate(self) -> ServeConfig:
        """Returns self, or raises ConfigError listing every violated rule."""
        problems = self.problems()
        if problems:
            raise ConfigError(problems)
        return self

    @property
    def kv_dtype(self) -> str:
        """The KV pool dtype after resolving "auto" to the model dtype."""
        return self.model.dtype if self.kv_cache.dtype == "auto" else self.kv_cache.dtype


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------


def _check_choices(cfg: ServeConfig, out: list[str]) -> None:
    for name in SECTIONS:
        section = getattr(cfg, name)
        for f in dataclasses.fields(section):
            choices = f.metadata.get("choices")
            value = getattr(section, f.name)
            if choices is not None and value not in choices:
                out.append(f"{name}.{f.name} = {value!r} is not one of {list(choices)} ({f.metadata['flag']})")


def _check_ranges(cfg: ServeConfig, out: list[str]) -> None:
    m, kv, smp, par, sch = cfg.model, cfg.kv_cache, cfg.sampling, cfg.parallel, cfg.scheduler

    def at_least(where: str, value, low: int) -> None:
        if value is not None and value < low:
            out.append(f"{where} = {value} must be >= {low}")

    at_least("model.context_length", m.context_length, 1)
    at_least("model.sliding_window", m.sliding_window, 1)
    at_least("speculative.draft_sliding_window", cfg.speculative.draft_sliding_window, 1)
    if kv.page_size < 1 or kv.page_size & (kv.page_size - 1):
        out.append(f"kv_cache.page_size = {kv.page_size} must be a power of two >= 1 (kernel tiles)")
    if not 0.0 < kv.mem_fraction_static < 1.0:
        out.append(f"kv_cache.mem_fraction_static = {kv.mem_fraction_static} must be in (0, 1)")
    at_least("kv_cache.max_total_tokens", kv.max_total_tokens, 1)
    if not (math.isfinite(kv.host_kv_gib) and kv.host_kv_gib > 0):
        out.append(f"kv_cache.host_kv_gib = {kv.host_kv_gib} must be a finite number > 0")
    if smp.temperature < 0 or smp.temperature != smp.temperature:
        out.append(f"sampling.temperature = {smp.temperature} must be >= 0")
    if smp.top_k != -1 and smp.top_k < 1:
        out.append(f"sampling.top_k = {smp.top_k} must be -1 (off) or >= 1")
    if not 0.0 < smp.top_p <= 1.0:
        out.append(f"sampling.top_p = {smp.top_p} must be in (0, 1]")
    if smp.backend == "greedy" and smp.temperature != 0:
        out.append(
            f"sampling.backend = 'greedy' takes argmax but sampling.temperature = {smp.temperature}; "
            f"use gumbel or rejection to sample"
        )
    for where, value in (("parallel.tp_size", par.tp_size), ("parallel.pp_size", par.pp_size),
                         ("parallel.dp_size", par.dp_size)):
        at_least(where, value, 1)
    if par.enable_dp_attention and par.dp_size >= 1 and par.tp_size % par.dp_size:
        out.append(
            f"parallel.enable_dp_attention needs tp_size divisible by dp_size, got "
            f"tp_size = {par.tp_size}, dp_size = {par.dp_size}"
        )
    if cfg.backends.rope_kernel == "pallas" and par.tp_size > 1:
        out.append(f"backends.rope_kernel = 'pallas' writes whole pools, which tensor parallelism shards by KV "
                   f"head; it needs parallel.tp_size 1, got {par.tp_size}")
    if cfg.backends.prefix_kernel == "mosaic_gpu":
        if kv.page_size not in (64, 128):
            out.append(f"backends.prefix_kernel = 'mosaic_gpu' copies whole pages by TMA and needs "
                       f"kv_cache.page_size 64 or 128, got {kv.page_size}")
    at_least("scheduler.max_running_requests", sch.max_running_requests, 1)
    at_least("scheduler.chunked_prefill_size", sch.chunked_prefill_size, 1)
    if not 0 <= sch.min_prefill_group <= sch.max_running_requests:
        out.append(f"scheduler.min_prefill_group = {sch.min_prefill_group} must lie in [0, max_running_requests = "
                   f"{sch.max_running_requests}] (0 = max_running_requests // 8)")
    if not 0 <= cfg.seed <= MAX_SEED:
        out.append(f"seed = {cfg.seed} is outside 0..{MAX_SEED} (2^31 - 1)")


def _check_speculative(sp: SpeculativeConfig, out: list[str]) -> None:
    k, n = sp.topk, sp.num_draft_tokens
    s = sp.steps
    if not sp.enabled:
        # Without an algorithm nothing drafts; a set speculative field would be ignored silently.
        if k > 1:
            out.append(f"speculative.topk = {k} (a tree) needs speculative.algorithm EAGLE3 or MTP, got NONE")
        for f in dataclasses.fields(sp):
            if f.name in ("algorithm", "topk"):
                continue
            value = getattr(sp, f.name)
            if value != f.default:
                out.append(f"speculative.{f.name} = {value!r} is set but speculative.algorithm is NONE")
        if not 1 <= k <= MAX_TOPK:
            out.append(f"speculative.topk = {k} is outside 1..{MAX_TOPK}")
        return
    if k > 1 and sp.algorithm not in TREE_ALGORITHMS:
        out.append(f"speculative.topk = {k} (a tree) needs algorithm EAGLE3 or MTP, got {sp.algorithm!r}")
    if not 1 <= k <= MAX_TOPK:
        out.append(f"speculative.topk = {k} is outside 1..{MAX_TOPK}")
    if not 1 <= s <= MAX_NUM_STEPS:
        out.append(f"speculative.num_steps = {s} is outside 1..{MAX_NUM_STEPS}")
    if sp.mtp_depth < 1:
        out.append(f"speculative.mtp_depth = {sp.mtp_depth} must be >= 1")
    elif sp.mtp_depth != 1 and sp.algorithm != "MTP":
        out.append(f"speculative.mtp_depth = {sp.mtp_depth} applies to MTP only, algorithm is {sp.algorithm!r}")
    if k > 1 and sp.algorithm == "MTP" and sp.mtp_depth > 1:
        out.append(
            f"speculative.topk = {k} with a multi-depth MTP drafter (mtp_depth = {sp.mtp_depth}): "
            f"it drafts chains only; use topk = 1 or mtp_depth = 1"
        )
    if sp.chain_above_batch is not None:
        if sp.chain_above_batch < 1:
            out.append(f"speculative.chain_above_batch = {sp.chain_above_batch} must be >= 1")
        if k == 1:
            out.append(f"speculative.chain_above_batch = {sp.chain_above_batch} applies to trees (topk > 1); "
                       f"topk = 1 is a chain already")
        elif n is not None and n < s + 1:
            out.append(f"speculative.chain_above_batch = {sp.chain_above_batch}: the chain's num_steps + 1 = "
                       f"{s + 1} nodes exceed the tree's num_draft_tokens = {n}")
    if n is None:
        if k > 1:
            out.append(
                f"speculative.topk = {k} (a tree) needs an explicit speculative.num_draft_tokens "
                f"(--speculative-num-draft-tokens)"
            )
        return
    if k == 1 and n != s + 1:
        out.append(
            f"speculative.num_draft_tokens = {n} with topk = 1 (chain) and num_steps = {s} must equal "
            f"num_steps + 1 = {s + 1}"
        )
    if k >= 1 and (s - 1) * k > n:
        out.append(
            f"(num_steps - 1) * topk = ({s} - 1) * {k} = {(s - 1) * k} draft-lane slots exceed "
            f"num_draft_tokens = {n}"
        )
    upper = min(MAX_TREE_NODES, sp.max_tree_nodes) if k >= 1 else MAX_TREE_NODES
    if not 2 <= n <= upper:
        out.append(
            f"speculative.num_draft_tokens = {n} is outside [2, min({MAX_TREE_NODES}, "
            f"K + (S-1)*K^2 + 1 = {sp.max_tree_nodes})] = [2, {upper}] for topk = {k}, num_steps = {s}"
        )


def _check_tree_features(cfg: ServeConfig, out: list[str]) -> None:
    sp = cfg.speculative
    if sp.topk <= 1:
        return
    tree = f"draft trees (topk = {sp.topk})"
    if cfg.scheduler.grammar_backend != "none":
        out.append(f"{tree} refuse structured output (scheduler.grammar_backend = {cfg.scheduler.grammar_backend!r})")
    if cfg.scheduler.enable_mixed_chunk:
        out.append(f"{tree} refuse mixed prefill/decode batches (scheduler.enable_mixed_chunk = true)")
    if cfg.scheduler.disaggregation_mode != "null":
        out.append(
            f"{tree} refuse prefill/decode disaggregation "
            f"(scheduler.disaggregation_mode = {cfg.scheduler.disaggregation_mode!r})"
        )
    if cfg.parallel.pp_size > 1:
        out.append(f"{tree} refuse pipeline parallelism (parallel.pp_size = {cfg.parallel.pp_size})")
    if cfg.parallel.enable_dp_attention:
        out.append(f"{tree} refuse attention data parallelism (parallel.enable_dp_attention = true)")


# --------------------------------------------------------------------------------------------
# Field types and TOML
# --------------------------------------------------------------------------------------------


def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def base_type(annotation: Any) -> tuple[type, bool]:
    """(scalar type, optional?) for `int`, `str | None`, ..."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


def _coerce(annotation: Any, value: Any, where: str, problems: list[str]) -> Any:
    """Checks a TOML value against a field type; int is accepted for float. Never converts
    strings to numbers (a quoted "4" in TOML is a mistake worth naming)."""
    kind, _ = base_type(annotation)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, kind)
    if not ok:
        problems.append(f"{where} = {value!r} must be {kind.__name__}")
    return value


def _build_section(cls: type, data: typing.Mapping[str, Any], where: str, problems: list[str]):
    hints = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        if key not in hints:
            problems.append(f"{where}: unknown key {key!r} (known: {sorted(hints)})")
            continue
        kwargs[key] = _coerce(hints[key], value, f"{where}.{key}", problems)
    return cls(**kwargs)


def load_toml(path: str | Path) -> ServeConfig:
    """Reads a TOML file into a ServeConfig (not yet validated)."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError([f"config file {str(path)!r} does not exist"]) from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError([f"{path}: not valid TOML: {err}"]) from None
    return ServeConfig.from_dict(data, source=str(path))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    raise TypeError(f"cannot write {value!r} to TOML")


def to_toml(cfg: ServeConfig) -> str:
    """TOML text that `load_toml` reads back into an equal config."""
    data = cfg.to_dict()
    lines = [f"seed = {_toml_value(data.pop('seed'))}"]
    for section, values in data.items():
        lines.append("")
        lines.append(f"[{section}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
    return "\n".join(lines) + "\n"
