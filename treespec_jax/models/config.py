"""Architecture configs of the target family and the draft heads, read from HF `config.json`.

One GQA decoder family covers Llama-2/3 (RoPE, optionally with llama3 frequency scaling),
SmolLM2 (a Llama with tied embeddings), Qwen2 (q/k/v biases) and Qwen3 (per-head q/k RMSNorm).
`LlamaConfig.from_hf` reads the fields that decide the math and refuses, in one error listing
every problem, any value this implementation would otherwise get silently wrong (an unknown
architecture or activation, a RoPE scaling kind we do not implement, ...).

Parameter layout (`treespec_jax.models.llama`): weights are stored `[in, out]` (x @ w), one
dict per decoder layer under `layers_{i}`:

    embed [V, H]; layers_{i}: attn_norm [H], wq [H, Hq*D], wk [H, Hkv*D], wv [H, Hkv*D],
    wo [Hq*D, H], bq/bk/bv (Qwen2), q_norm/k_norm [D] (Qwen3), mlp_norm [H], w_gate [H, F],
    w_up [H, F], w_down [F, H]; norm [H]; lm_head [H, V] (absent when tied to embed).

Loaders produce this layout. The engine serves `fuse_projections` of it: per layer one
`wqkv [H, Hkv*(Hq/Hkv + 2)*D]` (with `bqkv`) and one `w_gate_up [H, 2F]` in place of the five
separate weights (column order: `treespec_jax.models.llama`); the forward reads either.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "llama",
}
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


class ModelConfigError(ValueError):
    """A checkpoint config this implementation cannot serve; lists every problem at once."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{source}: {len(self.problems)} problem(s):\n{lines}")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 frequency scaling of RoPE (`rope_scaling.rope_type == "llama3"`)."""

    factor: float  # how much longer the extended context is than the original
    low_freq_factor: float  # wavelengths above original / low_freq_factor are scaled by 1/factor
    high_freq_factor: float  # wavelengths below original / high_freq_factor are kept
    original_max_position_embeddings: int  # the pre-extension context length


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Static architecture of a GQA decoder (hashable: it is a static jit argument)."""

    vocab_size: int  # V
    hidden_size: int  # H
    intermediate_size: int  # F, SwiGLU width
    num_layers: int  # L
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv (Hq % Hkv == 0)
    head_dim: int  # D
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # llama3 scaling, or None for plain RoPE
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    tie_word_embeddings: bool = False  # lm_head is embed^T
    attention_bias: bool = False  # q/k/v projections carry biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    max_position_embeddings: int = 4096  # the model's context length
    bos_token_id: int | None = None  # prepended by the tokenizer where the model expects it
    eos_token_ids: tuple[int, ...] = ()  # tokens that end a reply
    family: str = "llama"  # "llama", "qwen2" or "qwen3" (what from_hf recognised)

    def __post_init__(self):
        problems = self.problems()
        if problems:
            raise ModelConfigError("LlamaConfig", problems)

    def problems(self) -> list[str]:
        out = []
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                out.append(f"{name} must be a positive integer, got {value!r}")
        if not out and self.num_heads % self.num_kv_heads:
            out.append(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if isinstance(self.head_dim, int) and self.head_dim % 2:
            out.append(f"head_dim {self.head_dim} must be even (RoPE rotates halves)")
        if not self.rope_theta > 0:
            out.append(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            out.append(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        return out

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def eagle3_feature_layers(self) -> tuple[int, int, int]:
        """Layers whose inputs EAGLE-3 reads (HF `hidden_states` indices 2, L//2, L-3)."""
        n = self.num_layers
        return (2, n // 2, n - 3)

    @classmethod
    def from_hf(cls, data: Mapping[str, Any], source: str = "config.json") -> "LlamaConfig":
        """Reads an HF `config.json` mapping; raises ModelConfigError listing every problem."""
        problems: list[str] = []
        archs = list(data.get("architectures") or [])
        family = None
        for a in archs:
            family = SUPPORTED_ARCHITECTURES.get(a)
            if family:
                break
        if family is None:
            problems.append(f"architectures {archs} names none of {sorted(SUPPORTED_ARCHITECTURES)}")
            family = "llama"
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for key in required:
            if key not in data:
                problems.append(f"missing field {key!r}")
        act = data.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            problems.append(f"hidden_act {act!r} is not supported (SwiGLU with silu only)")
        if data.get("mlp_bias"):
            problems.append("mlp_bias=true is not supported")
        if family == "llama" and data.get("attention_bias"):
            problems.append("attention_bias=true is not supported for Llama checkpoints")
        if family == "qwen3" and data.get("attention_bias"):
            problems.append("attention_bias=true is not supported for Qwen3 checkpoints")
        sw = data.get("sliding_window")
        # Qwen2 configs carry a sliding_window that only applies when use_sliding_window is set.
        if sw is not None and (family != "qwen2" or data.get("use_sliding_window")):
            problems.append(f"sliding_window={sw} in target layers is not supported (full attention only)")
        scaling = None
        rs = data.get("rope_scaling")
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                try:
                    scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                          float(rs["high_freq_factor"]),
                                          int(rs["original_max_position_embeddings"]))
                except KeyError as err:
                    problems.append(f"rope_scaling of type llama3 lacks {err.args[0]!r}")
            elif kind != "default":
                problems.append(f"rope_scaling type {kind!r} is not supported (only llama3)")
        if problems:
            raise ModelConfigError(source, problems)
        heads = int(data["num_attention_heads"])
        hidden = int(data["hidden_size"])
        eos = data.get("eos_token_id")
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [] if eos is None else [eos]))
        try:
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(data["intermediate_size"]),
                num_layers=int(data["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(data.get("num_key_value_heads") or heads),
                head_dim=int(data.get("head_dim") or hidden // heads),
                rope_theta=float(data.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                attention_bias=family == "qwen2" or bool(data.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
                bos_token_id=data.get("bos_token_id"),
                eos_token_ids=eos_ids,
                family=family,
            )
        except ModelConfigError as err:
            raise ModelConfigError(source, err.problems) from None

    def to_hf(self) -> dict[str, Any]:
        """The config.json mapping `from_hf` reads back to this config (tests write checkpoints)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[self.family]
        out: dict[str, Any] = {
            "architectures": [arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_ids:
            out["eos_token_id"] = list(self.eos_token_ids)
        return out


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    """An EAGLE-3 draft head: one decoder layer over [embed(token) ; fc(target features)].

    Parameter layout (`treespec_jax.drafter.eagle3`), weights `[in, out]`:

        fc [3*Ht, H]; input_norm [H] (of the token embedding); hidden_norm [H] (of the feature);
        layer: wq [2H, Hq*D], wk [2H, Hkv*D], wv [2H, Hkv*D], wo [Hq*D, H], mlp_norm [H],
               w_gate [H, F], w_up [H, F], w_down [F, H];
        norm [H]; lm_head [H, Vd]; d2t [Vd] int32 (target id = draft id + d2t[draft id]).

    The token embedding is the target's; a head whose hidden size differs from the target's
    cannot share it and is refused at load time.
    """

    hidden_size: int  # H
    intermediate_size: int  # F
    num_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    vocab_size: int  # the target's vocabulary V
    draft_vocab_size: int  # Vd, the head's output vocabulary
    target_hidden_size: int  # Ht, width of each of the three target features
    rope_theta: float = 10000.0  # RoPE base
    rope_scaling: RopeScaling | None = None  # llama3 scaling or None
    rms_norm_eps: float = 1e-6  # epsilon inside every RMSNorm
    max_position_embeddings: int = 4096  # context length the head was trained for

    @classmethod
    def from_hf(cls, data: Mapping[str, Any], source: str = "config.json") -> "Eagle3Config":
        problems: list[str] = []
        archs = list(data.get("architectures") or [])
        if not any(a in EAGLE3_ARCHITECTURES for a in archs):
            problems.append(f"architectures {archs} names none of {list(EAGLE3_ARCHITECTURES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "draft_vocab_size"):
            if key not in data:
                problems.append(f"missing field {key!r}")
        layers = data.get("num_hidden_layers", 1)
        if layers != 1:
            problems.append(f"num_hidden_layers={layers}: an EAGLE-3 head has exactly one decoder layer")
        if data.get("hidden_act", "silu") not in ("silu", "swish"):
            problems.append(f"hidden_act {data.get('hidden_act')!r} is not supported")
        if data.get("attention_bias") or data.get("bias") or data.get("mlp_bias"):
            problems.append("biases (attention_bias / bias / mlp_bias) are not supported in EAGLE-3 heads")
        scaling = None
        rs = data.get("rope_scaling")
        if rs:
            kind = rs.get("rope_type", rs.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(float(rs["factor"]), float(rs["low_freq_factor"]),
                                      float(rs["high_freq_factor"]), int(rs["original_max_position_embeddings"]))
            elif kind != "default":
                problems.append(f"rope_scaling type {kind!r} is not supported (only llama3)")
        if problems:
            raise ModelConfigError(source, problems)
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        return cls(
            hidden_size=hidden,
            intermediate_size=int(data["intermediate_size"]),
            num_heads=heads,
            num_kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            vocab_size=int(data["vocab_size"]),
            draft_vocab_size=int(data["draft_vocab_size"]),
            target_hidden_size=int(data.get("target_hidden_size") or hidden),
            rope_theta=float(data.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(data.get("max_position_embeddings", 4096)),
        )

    def target_problems(self, target: LlamaConfig) -> list[str]:
        """Why this head cannot draft for `target`: it embeds tokens with the target's table and
        reads three of its hidden states (layers 2, L//2 and L-3), so vocabularies and widths must
        agree and the target needs at least 4 layers."""
        problems = []
        if self.vocab_size != target.vocab_size:
            problems.append(f"head vocab_size {self.vocab_size} differs from the target's {target.vocab_size}")
        if self.hidden_size != target.hidden_size:
            problems.append(f"head hidden_size {self.hidden_size} differs from the target's {target.hidden_size} "
                            "(the head embeds tokens with the target's embedding)")
        if self.target_hidden_size != target.hidden_size:
            problems.append(f"head target_hidden_size {self.target_hidden_size} differs from the target's "
                            f"hidden_size {target.hidden_size}")
        if target.num_layers < 4:
            problems.append(f"the head reads target layers 2, L//2 and L-3; the target has only {target.num_layers}")
        return problems

    def to_hf(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(self.rope_scaling)}
        return out

    def as_layer_config(self) -> LlamaConfig:
        """The head's decoder layer in target-family terms (RoPE, heads, MLP)."""
        return LlamaConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rope_theta=self.rope_theta,
                           rope_scaling=self.rope_scaling, rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings)
