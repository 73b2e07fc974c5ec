"""The EAGLE-3 training recipe's knobs: `configs/train/eagle3.toml` read into frozen dataclasses.

One `TrainConfig` holds four sections, each a frozen dataclass whose fields are the TOML keys:
`[data]` (self-distillation replies from the engine), `[vocab]` (the draft vocabulary), `[head]`
(the head's shape) and `[train]` (optimiser, unrolled training-time test, checkpoints), plus the
top-level `target` and `prompts`. `load_config` refuses an unknown section or key, a value of the
wrong type and every value outside its range, all in one `TrainConfigError` that names each.
Output directories are not part of the config: the command line names them, so one config serves
any number of runs.
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from treespec_jax.config import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "train" / "eagle3.toml"
DEFAULT_PROMPTS = "treespec_jax/data/train_prompts.jsonl"
DTYPES = ("bf16", "fp32")
ATTENTION_BACKENDS = ("auto", "cascade", "dense")


class TrainConfigError(ConfigError):
    """Every problem of a training config, one line each."""

    subject = "training config"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Self-distillation: the target's own replies to the training prompts, from the engine."""

    max_requests: int = 16384  # requests generated at most (prompts cycle with fresh seeds past the set's end)
    shard_size: int = 1024  # requests per .npz shard (the unit of resumption)
    first_shard: int = 0  # shards before it are not generated: a later run starts on requests (prompts) not yet used
    max_new_tokens: int = 512  # reply length cap
    max_prompt_tokens: int = 448  # prompts longer than this (after the chat template) are skipped
    greedy_fraction: float = 0.5  # share of first-pass requests decoded greedily; the rest sampled
    # The second pass decodes greedily the prompts that the first pass sampled, so every prompt has
    # one greedy reply within two passes (off: every pass after the first samples).
    greedy_second_pass: bool = False
    temperature: float = 0.8  # sampling temperature of the sampled replies
    top_p: float = 1.0  # nucleus mass of the sampled replies (1 = off)
    batch: int = 256  # engine decode batch (max_running_requests)
    dtype: str = "bf16"  # target dtype in the engine (serving runs bf16)
    attention_backend: str = "auto"  # engine attention: auto/cascade (GPU kernels) or dense (fp32 reference)
    page_size: int = 64  # engine KV page size
    heldout_every: int = 50  # every n-th prompt (by index) is held out of training for the held-out loss
    seed: int = 0  # base seed of the sampled replies and the greedy/sampled split

    @property
    def num_shards(self) -> int:
        """Shards of the whole request set (the last one may be short): ceil(max_requests / shard_size)."""
        return -(-self.max_requests // self.shard_size)

    def problems(self) -> list[str]:
        out = _positive(self, "max_requests", "shard_size", "max_new_tokens", "max_prompt_tokens", "batch",
                        "page_size", "heldout_every")
        if self.shard_size > 0 and not 0 <= self.first_shard < self.num_shards:
            out.append(f"data.first_shard = {self.first_shard} must lie in [0, ceil(max_requests / shard_size)) "
                       f"= [0, {self.num_shards})")
        elif self.first_shard < 0:
            out.append(f"data.first_shard = {self.first_shard} must be >= 0")
        if not 0.0 <= self.greedy_fraction <= 1.0:
            out.append(f"data.greedy_fraction = {self.greedy_fraction} must lie in [0, 1]")
        if not self.temperature > 0:
            out.append(f"data.temperature = {self.temperature} must be > 0 (greedy replies come from greedy_fraction)")
        if not 0.0 < self.top_p <= 1.0:
            out.append(f"data.top_p = {self.top_p} must lie in (0, 1]")
        out += _choice(self, "dtype", DTYPES) + _choice(self, "attention_backend", ATTENTION_BACKENDS)
        if self.page_size & (self.page_size - 1):
            out.append(f"data.page_size = {self.page_size} must be a power of two")
        if not 0 <= self.seed < 2**31:
            out.append(f"data.seed = {self.seed} must lie in [0, 2^31)")
        return out


@dataclasses.dataclass(frozen=True)
class VocabConfig:
    """The draft vocabulary: the most frequent target tokens of the training replies."""

    draft_vocab_size: int = 16384  # Vd; 0 or >= the target vocabulary keeps the full vocabulary

    def problems(self) -> list[str]:
        if self.draft_vocab_size < 0:
            return [f"vocab.draft_vocab_size = {self.draft_vocab_size} must be >= 0"]
        return []


INIT_VOCABS = ("inherit", "data")


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """The head's decoder layer; widths and RoPE follow the target where left at 0."""

    intermediate_size: int = 0  # SwiGLU width F; 0 = the target's
    num_heads: int = 0  # query heads; 0 = the target's
    num_kv_heads: int = 0  # KV heads; 0 = the target's
    # An exported head directory (config.json + safetensors; relative to the repo root) whose weights
    # a new run starts from, so training goes on from a shipped head; "" = fresh.
    init_from: str = ""
    # The draft vocabulary of a run started from `init_from`: "inherit" keeps the start head's;
    # "data" draws it from this run's replies (`vocab.draft_vocab_size` tokens), carrying over the
    # start head's lm_head column of every token the two share (`train.eagle3.carry_lm_head`).
    init_vocab: str = "inherit"

    def problems(self) -> list[str]:
        out = [f"head.{n} = {getattr(self, n)} must be >= 0 (0 = the target's)"
               for n in ("intermediate_size", "num_heads", "num_kv_heads") if getattr(self, n) < 0]
        if self.init_from and not (self.init_path() / "config.json").is_file():
            out.append(f"head.init_from = {self.init_from!r}: no config.json in {self.init_path()}")
        if self.init_vocab not in INIT_VOCABS:
            out.append(f"head.init_vocab = {self.init_vocab!r} must be one of {INIT_VOCABS}")
        return out

    def init_path(self) -> Path:
        p = Path(self.init_from)
        return p if p.is_absolute() else REPO_ROOT / p


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The training run: batches, the unrolled training-time test, AdamW, checkpoints, logging."""

    seq_len: int = 1024  # tokens per packed row (sequences are packed whole, longer ones truncated)
    batch_rows: int = 16  # packed rows per step (tokens per step = batch_rows * seq_len)
    steps: int = 3000  # total optimiser steps (the cosine decay ends here)
    lr: float = 6e-4  # peak learning rate
    warmup_steps: int = 150  # linear warmup from 0 to lr
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.01  # AdamW decoupled weight decay on matrices (norms are not decayed)
    b1: float = 0.9  # Adam first-moment decay
    b2: float = 0.95  # Adam second-moment decay
    grad_clip: float = 1.0  # global gradient-norm clip
    ttt_steps: int = 7  # unrolled draft steps per position (training-time test)
    ttt_decay: float = 0.8  # loss weight of step i is ttt_decay ** i
    compute_dtype: str = "bf16"  # head activations / matmul inputs; master weights stay fp32
    target_dtype: str = "bf16"  # the frozen target's weights and activations (serving runs bf16)
    remat: bool = True  # recompute each unrolled step in the backward pass instead of storing it
    seed: int = 0  # head initialisation and epoch shuffles
    log_every: int = 10  # steps between loss-CSV rows
    checkpoint_every: int = 500  # steps between checkpoints (and one at the deadline)
    keep_checkpoints: int = 2  # newest checkpoints kept
    eval_batches: int = 8  # held-out batches for the held-out loss

    def problems(self) -> list[str]:
        out = _positive(self, "seq_len", "batch_rows", "steps", "ttt_steps", "log_every", "checkpoint_every",
                        "keep_checkpoints", "eval_batches")
        if not self.lr > 0:
            out.append(f"train.lr = {self.lr} must be > 0")
        if self.warmup_steps < 0 or self.warmup_steps >= max(self.steps, 1):
            out.append(f"train.warmup_steps = {self.warmup_steps} must lie in [0, steps = {self.steps})")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            out.append(f"train.min_lr_ratio = {self.min_lr_ratio} must lie in [0, 1]")
        if self.weight_decay < 0:
            out.append(f"train.weight_decay = {self.weight_decay} must be >= 0")
        for n in ("b1", "b2"):
            if not 0.0 <= getattr(self, n) < 1.0:
                out.append(f"train.{n} = {getattr(self, n)} must lie in [0, 1)")
        if not self.grad_clip > 0:
            out.append(f"train.grad_clip = {self.grad_clip} must be > 0")
        if not 0.0 < self.ttt_decay <= 1.0:
            out.append(f"train.ttt_decay = {self.ttt_decay} must lie in (0, 1]")
        if self.ttt_steps >= self.seq_len - 1:
            out.append(f"train.ttt_steps = {self.ttt_steps} must be < seq_len - 1 = {self.seq_len - 1}")
        out += _choice(self, "compute_dtype", DTYPES, "train") + _choice(self, "target_dtype", DTYPES, "train")
        return out


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The whole recipe. `target`: "default" (the cached SmolLM2 GGUF), a .gguf file or an HF
    directory; `prompts`: the training prompt set (JSONL), relative paths from the repo root."""

    target: str = "default"
    prompts: str = DEFAULT_PROMPTS
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    vocab: VocabConfig = dataclasses.field(default_factory=VocabConfig)
    head: HeadConfig = dataclasses.field(default_factory=HeadConfig)
    train: OptimConfig = dataclasses.field(default_factory=OptimConfig)

    def __post_init__(self):
        problems = []
        for section in SECTIONS:
            problems += getattr(self, section).problems()
        if not self.target:
            problems.append("target must name 'default', a .gguf file or an HF directory")
        if problems:
            raise TrainConfigError(problems)

    def prompts_path(self) -> Path:
        p = Path(self.prompts)
        return p if p.is_absolute() else REPO_ROOT / p

    def replace(self, **sections: Any) -> "TrainConfig":
        """Copy with sections replaced, each either a dataclass or a mapping of field overrides."""
        kw = {}
        for name, value in sections.items():
            if name in SECTIONS and isinstance(value, Mapping):
                value = dataclasses.replace(getattr(self, name), **value)
            kw[name] = value
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {"data": DataConfig, "vocab": VocabConfig, "head": HeadConfig, "train": OptimConfig}


def _positive(section, *names: str) -> list[str]:
    label = {DataConfig: "data", OptimConfig: "train"}.get(type(section), "?")
    return [f"{label}.{n} = {getattr(section, n)} must be a positive integer" for n in names
            if getattr(section, n) < 1]


def _choice(section, name: str, choices: tuple, label: str = "data") -> list[str]:
    value = getattr(section, name)
    return [] if value in choices else [f"{label}.{name} = {value!r} must be one of {list(choices)}"]


def _coerce(kind: type, value: Any, where: str, problems: list[str]) -> Any:
    """`value` as `kind` (an int is a fine float); a wrong type is a problem naming `where`."""
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    problems.append(f"{where} = {value!r} must be of type {kind.__name__}")
    return None


def from_dict(data: Mapping[str, Any], source: str = "config") -> TrainConfig:
    """A TrainConfig from a TOML-shaped mapping; every unknown key and bad type in one error."""
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key in SECTIONS:
            if not isinstance(value, Mapping):
                problems.append(f"{source}: [{key}] must be a table")
                continue
            cls = SECTIONS[key]
            hints = typing.get_type_hints(cls)
            fields = {}
            for name, v in value.items():
                if name not in hints:
                    problems.append(f"{source}: unknown key {key}.{name} (known: {sorted(hints)})")
                    continue
                before = len(problems)
                coerced = _coerce(hints[name], v, f"{source}: {key}.{name}", problems)
                if len(problems) == before:
                    fields[name] = coerced
            kwargs[key] = cls(**fields)
        elif key in ("target", "prompts"):
            kwargs[key] = _coerce(str, value, f"{source}: {key}", problems)
        else:
            problems.append(f"{source}: unknown key {key!r} (known: target, prompts and tables {sorted(SECTIONS)})")
    # Sections validate only inside TrainConfig, so the range problems of the well-typed values
    # are reported together with the type problems.
    for key in SECTIONS:
        if key in kwargs:
            problems += [f"{source}: {p}" for p in kwargs[key].problems()]
    if problems:
        raise TrainConfigError(problems)
    return TrainConfig(**kwargs)


def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> TrainConfig:
    """Reads the TOML at `path` (default configs/train/eagle3.toml); `overrides` maps dotted keys
    ("train.steps") to values applied on top, as the command line's --set does."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return from_dict(data, source=str(path))


def parse_override(text: str) -> tuple[str, Any]:
    """`key=value` from the command line, the value read as a TOML value (bare words as strings)."""
    if "=" not in text:
        raise TrainConfigError([f"--set {text!r} must look like section.key=value"])
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key.strip(), value
