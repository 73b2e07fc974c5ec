"""The GQA decoder family (Llama-3, SmolLM2, Qwen2, Qwen3) over paged KV pools.

flax linen modules whose parameters are the plain dict documented in
`treespec_jax.models.config` (weights `[in, out]`, one dict per layer under `layers_{i}`), so
`jit`, loaders and shardings see an ordinary pytree; the KV pools are explicit inputs and
outputs of every call (`{"k{i}": [S, Hkv, D], "v{i}": ...}`, donated by the engine), never module
state. Layers run as a Python loop: each layer's pools are separate buffers the attention
kernels read whole, with no per-layer slicing copy.

One forward (`Llama.__call__`) serves every kind of call; the kind is the `AttentionBatch`
(`treespec_jax.models.attention`): `prefill` (a prompt chunk), `decode` (one token per request:
plain decoding) and `verify` (the N tree nodes at positions vc + depth under their ancestor
masks). Each writes the K/V of the rows it processes into their slots and returns fp32 logits at
the rows asked for plus the hidden features a drafter reads: the inputs of the layers named by
`feature_layers` (index L = the last layer's output before the final norm), concatenated.
"""

from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.rms_norm import add_rms_norm
from pallas_kernels.rope_kv import kernel_problems as rope_kernel_problems, rope_write_kv
from treespec_jax.models.attention import AttentionBatch, PagedAttention, prefill_batch, window_batch, write_kv
from treespec_jax.models.config import LlamaConfig, RopeScaling

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
# How a layer's RMSNorms (with the residual add before each) run: "auto" = the Pallas kernel on a
# GPU without tensor parallelism, else XLA; "pallas" (interpret mode off the GPU); "xla".
NORM_KERNELS = ("auto", "pallas", "xla")
# How a layer's RoPE and K/V write run: "auto" = the Pallas kernel (`pallas_kernels.rope_kv`) on a
# GPU without a mesh, else XLA; "pallas" (interpret mode off the GPU); "xla". The kernel runs only
# where it applies (fused projections, no q/k norm, power-of-two head_dim, 16/32-bit pools).
ROPE_KERNELS = ("auto", "xla", "pallas")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in fp32, cast back to x's dtype (as HF Llama does)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * xf.astype(x.dtype)


def _kernel_backend(name: str, choice: str, choices: tuple[str, ...], attention: PagedAttention) -> str:
    """"pallas" or "xla" for a `*_kernel` choice. "auto" takes the kernel only on a GPU (elsewhere
    it would run interpreted) and without a mesh (the SPMD partitioner cannot split a custom call,
    and a kernel that writes whole pools would write a shard's)."""
    if choice not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {choice!r}")
    if choice == "auto":
        return "pallas" if jax.default_backend() == "gpu" and attention.mesh is None else "xla"
    return choice


def norm_backend(norm_kernel: str, attention: PagedAttention) -> str:
    """The `add_rms_norm` backend ("pallas" or "reference") for a `NORM_KERNELS` choice."""
    return "pallas" if _kernel_backend("norm_kernel", norm_kernel, NORM_KERNELS, attention) == "pallas" else "reference"


def rope_backend(rope_kernel: str, attention: PagedAttention) -> str:
    """"pallas" or "xla" for a `ROPE_KERNELS` choice."""
    return _kernel_backend("rope_kernel", rope_kernel, ROPE_KERNELS, attention)


@functools.lru_cache(maxsize=None)
def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    """`[D/2]` float32 inverse frequencies; llama3 scaling stretches the long wavelengths."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None:
        old = scaling.original_max_position_embeddings
        low_wavelen = old / scaling.low_freq_factor
        high_wavelen = old / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / scaling.factor, inv)
        smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, blended, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE. `x [B, T, H, D]`, `positions [B, T]` int32 -> x's shape and dtype."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(ang)[:, :, None, :]
    sin = jnp.sin(ang)[:, :, None, :]
    half = x.shape[-1] // 2
    x1 = x[..., :half].astype(jnp.float32)
    x2 = x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def fused_qkv(p: dict, x: jax.Array) -> jax.Array:
    """The fused projections `[B, T, Hkv * (rep + 2) * D]` of `x [B, T, Hin]` (`wqkv`, plus `bqkv`
    where the layer has biases), in `fuse_layer`'s grouped column order."""
    qkv = x @ p["wqkv"]
    return qkv + p["bqkv"] if "bqkv" in p else qkv


def project_qkv(p: dict, x: jax.Array, positions: jax.Array, cfg: LlamaConfig):
    """q `[B, T, Hq, D]`, k / v `[B, T, Hkv, D]` of normed input `x [B, T, Hin]` at `positions
    [B, T]`: separate or fused projections, biases and q/k norms where the config has them, RoPE."""
    b, t, _ = x.shape
    if "wqkv" in p:
        q, k, v = split_qkv(fused_qkv(p, x), cfg)
    else:
        q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
        if "bq" in p:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    if "q_norm" in p:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def attention_block(p: dict, x: jax.Array, k_pool: jax.Array, v_pool: jax.Array, batch: AttentionBatch,
                    attention: PagedAttention, cfg: LlamaConfig,
                    rope_kernel: str = "xla") -> tuple[jax.Array, jax.Array, jax.Array]:
    """Self-attention on normed input `x [B, T, Hin]` (Hin = H, or 2H in an EAGLE-3 head).

    Projects q/k/v (`project_qkv`) at the batch's positions, writes k/v into the pools at the
    batch's slots, attends -> (`[B, T, H]`, pools). `rope_kernel` (ROPE_KERNELS, resolved by
    `rope_backend`) does the rotation and the write in one kernel where it applies
    (`pallas_kernels.rope_kv`); the default keeps XLA's path for callers that do not choose (the
    EAGLE-3 head's layer).
    """
    b, t, _ = x.shape
    if (rope_backend(rope_kernel, attention) == "pallas" and "wqkv" in p and not cfg.qk_norm
            and attention.mesh is None
            and not rope_kernel_problems(p["wqkv"].shape[-1], cfg.num_kv_heads, cfg.head_dim, k_pool.dtype)):
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k_pool, v_pool = rope_write_kv(fused_qkv(p, x), batch.positions, batch.write_slots, k_pool, v_pool,
                                          inv_freq)
    else:
        q, k, v = project_qkv(p, x, batch.positions, cfg)
        k_pool, v_pool = write_kv(k_pool, v_pool, k, v, batch.write_slots)
    out = attention.attend(q, k_pool, v_pool, batch)
    return out.reshape(b, t, cfg.q_width) @ p["wo"], k_pool, v_pool


def mlp_block(p: dict, x: jax.Array) -> jax.Array:
    """SwiGLU: `(silu(x W_gate) * x W_up) W_down`, from `w_gate` / `w_up` or one `w_gate_up`."""
    if "w_gate_up" in p:
        gate_up = (x @ p["w_gate_up"]).reshape(*x.shape[:-1], -1, 2)
        gate, up = gate_up[..., 0], gate_up[..., 1]
    else:
        gate, up = x @ p["w_gate"], x @ p["w_up"]
    return (jax.nn.silu(gate) * up) @ p["w_down"]


# Fused projections. At decode (one row per request) XLA runs each small matmul as its own kernel,
# and the narrow k / v ones as reductions that read well below copy bandwidth: on the H100 the
# 8B-shaped projections alone took 1.31x their weight floor at batch 1 as seven matmuls a layer and
# 1.04x as four (benchmarks/tools/gemv_probe.py, RESULTS.md). The fused columns are grouped so that
# any split of the KV heads (tensor parallelism shards whole groups) and of the MLP width keeps each
# device's q, k, v and gate, up columns together:
#   wqkv [H, Hkv * (rep + 2) * D]: per KV head g, the rep = Hq / Hkv query heads that read it
#     (heads g * rep ... g * rep + rep - 1), then k_g, then v_g; bqkv [Hkv * (rep + 2) * D] alike;
#   w_gate_up [H, 2F]: gate column j then up column j, for j = 0 .. F - 1.


def split_qkv(qkv: jax.Array, cfg: LlamaConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`[B, T, Hkv * (rep + 2) * D]` fused projections -> q `[B, T, Hq, D]`, k and v `[B, T, Hkv, D]`."""
    b, t, _ = qkv.shape
    rep = cfg.num_heads // cfg.num_kv_heads
    grouped = qkv.reshape(b, t, cfg.num_kv_heads, rep + 2, cfg.head_dim)
    q = grouped[:, :, :, :rep].reshape(b, t, cfg.num_heads, cfg.head_dim)
    return q, grouped[:, :, :, rep], grouped[:, :, :, rep + 1]


def fuse_layer(layer: dict, cfg: LlamaConfig) -> dict:
    """One layer's params with wq / wk / wv (and bq / bk / bv) replaced by one `wqkv` (`bqkv`) and
    w_gate / w_up by one `w_gate_up`, in the grouped column order above (`cfg`: the layer's heads);
    every other leaf is the same array, and a layer already fused passes through."""
    rep, d, hkv = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim, cfg.num_kv_heads

    def grouped(q, k, v):  # [..., Hq * D], [..., Hkv * D] x2 -> [..., Hkv * (rep + 2) * D]
        lead = q.shape[:-1]
        parts = [q.reshape(*lead, hkv, rep, d), k.reshape(*lead, hkv, 1, d), v.reshape(*lead, hkv, 1, d)]
        return jnp.concatenate(parts, axis=-2).reshape(*lead, hkv * (rep + 2) * d)

    layer = dict(layer)
    if "wq" in layer:
        layer["wqkv"] = grouped(layer.pop("wq"), layer.pop("wk"), layer.pop("wv"))
    if "bq" in layer:
        layer["bqkv"] = grouped(layer.pop("bq"), layer.pop("bk"), layer.pop("bv"))
    if "w_gate" in layer:
        gate, up = layer.pop("w_gate"), layer.pop("w_up")
        layer["w_gate_up"] = jnp.stack([gate, up], axis=-1).reshape(gate.shape[0], 2 * gate.shape[1])
    return layer


def fuse_projections(params: dict, cfg: LlamaConfig) -> dict:
    """`params` (the documented layout) with every decoder layer fused (`fuse_layer`). The forward
    reads either layout and computes the same function."""
    out = dict(params)
    for i in range(cfg.num_layers):
        out[f"layers_{i}"] = fuse_layer(params[f"layers_{i}"], cfg)
    return out


def projection_params(module: nn.Module, init, attn_in: int, mlp_in: int, f: int, cfg: LlamaConfig) -> dict:
    """The q/k/v (and their biases where `cfg.attention_bias`) and gate/up weights of a layer,
    declared on `module` inside its compact call: fused (`wqkv`, `bqkv`, `w_gate_up`) where the
    params hold them (`fuse_layer`), else separate, the documented layout, which init makes.
    `attn_in` / `mlp_in`: the width q/k/v / gate/up read; `f`: the MLP width."""
    qw, kw = cfg.q_width, cfg.kv_width
    zeros = nn.initializers.zeros
    out = {}
    if module.has_variable("params", "wqkv"):
        out["wqkv"] = module.param("wqkv", init, (attn_in, qw + 2 * kw))
        if cfg.attention_bias:
            out["bqkv"] = module.param("bqkv", zeros, (qw + 2 * kw,))
    else:
        out.update(wq=module.param("wq", init, (attn_in, qw)), wk=module.param("wk", init, (attn_in, kw)),
                   wv=module.param("wv", init, (attn_in, kw)))
        if cfg.attention_bias:
            out.update(bq=module.param("bq", zeros, (qw,)), bk=module.param("bk", zeros, (kw,)),
                       bv=module.param("bv", zeros, (kw,)))
    if module.has_variable("params", "w_gate_up"):
        out["w_gate_up"] = module.param("w_gate_up", init, (mlp_in, 2 * f))
    else:
        out.update(w_gate=module.param("w_gate", init, (mlp_in, f)), w_up=module.param("w_up", init, (mlp_in, f)))
    return out


def _dense_init(scale: float):
    return lambda key, shape, dtype=jnp.float32: scale * jax.random.normal(key, shape, dtype) / np.sqrt(shape[0])


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(.)).

    The layer's input is `x + delta` (`delta` None: `x`), and it returns the last residual add
    undone, `(x_mid, mlp_out, pools)` with output `x_mid + mlp_out`: each add is done by the norm
    that reads its sum (`add_rms_norm`, one kernel for both), so a caller adds the last pair itself
    or hands it to the next layer as its `(x, delta)`.
    """

    cfg: LlamaConfig
    attention: PagedAttention
    norm_kernel: str = "auto"  # NORM_KERNELS
    rope_kernel: str = "auto"  # ROPE_KERNELS

    @nn.compact
    def __call__(self, x, k_pool, v_pool, batch: AttentionBatch, delta=None):
        c = self.cfg
        h, f, qw = c.hidden_size, c.intermediate_size, c.q_width
        ones = nn.initializers.ones
        p = {"attn_norm": self.param("attn_norm", ones, (h,)),
             "wo": self.param("wo", _dense_init(1.0), (qw, h))}
        p.update(projection_params(self, _dense_init(1.0), h, h, f, c))
        if c.qk_norm:
            p.update(q_norm=self.param("q_norm", ones, (c.head_dim,)), k_norm=self.param("k_norm", ones, (c.head_dim,)))
        p.update(mlp_norm=self.param("mlp_norm", ones, (h,)), w_down=self.param("w_down", _dense_init(1.0), (f, h)))
        return decoder_layer(p, x, delta, k_pool, v_pool, batch, cfg=c, attention=self.attention,
                             norm=norm_backend(self.norm_kernel, self.attention), rope_kernel=self.rope_kernel)


@functools.partial(jax.jit, static_argnames=("cfg", "attention", "norm", "rope_kernel"))
def decoder_layer(p: dict, x, delta, k_pool, v_pool, batch: AttentionBatch, *, cfg: LlamaConfig,
                  attention: PagedAttention, norm: str, rope_kernel: str):
    """`DecoderLayer`'s computation on its params `p`. Jitted so that a forward's identical layers
    are traced and lowered once and called from each position: inside an enclosing jit it is one
    call in the program, which XLA inlines before it optimizes, so the compiled step is the same
    while tracing and lowering a 30-layer forward take the time of about one layer."""
    x, normed = add_rms_norm(x, delta, p["attn_norm"], cfg.rms_norm_eps, backend=norm)
    a, k_pool, v_pool = attention_block(p, normed, k_pool, v_pool, batch, attention, cfg, rope_kernel)
    x, normed = add_rms_norm(x, a, p["mlp_norm"], cfg.rms_norm_eps, backend=norm)
    return x, mlp_block(p, normed), k_pool, v_pool


class Llama(nn.Module):
    """The whole decoder over explicit pools. Returns (logits `[B, R, V]` f32 at `logit_rows`,
    features `[B, T, len(feature_layers) * H]` or None, pools)."""

    cfg: LlamaConfig
    attention: PagedAttention
    feature_layers: tuple[int, ...] = ()
    norm_kernel: str = "auto"  # NORM_KERNELS
    rope_kernel: str = "auto"  # ROPE_KERNELS

    @nn.compact
    def __call__(self, tokens, pools, batch: AttentionBatch, logit_rows=None):
        c = self.cfg
        embed = self.param("embed", nn.initializers.normal(1.0), (c.vocab_size, c.hidden_size))
        # The residual stream is x + delta: each layer adds its predecessor's MLP output inside its
        # first norm (DecoderLayer), and a captured feature makes the sum it needs itself.
        x, delta = embed[tokens], None
        pools = dict(pools)
        captured = {}
        for i in range(c.num_layers):
            if i in self.feature_layers:
                captured[i] = x if delta is None else x + delta
            x, delta, pools[f"k{i}"], pools[f"v{i}"] = DecoderLayer(c, self.attention, self.norm_kernel,
                                                                    self.rope_kernel, name=f"layers_{i}")(
                x, pools[f"k{i}"], pools[f"v{i}"], batch, delta)
        if c.num_layers in self.feature_layers:
            captured[c.num_layers] = x + delta
        features = jnp.concatenate([captured[i] for i in self.feature_layers], -1) if self.feature_layers else None
        norm = self.param("norm", nn.initializers.ones, (c.hidden_size,))
        if logit_rows is not None:
            x = jnp.take_along_axis(x, logit_rows[:, :, None], axis=1)
            delta = jnp.take_along_axis(delta, logit_rows[:, :, None], axis=1)
        _, x = add_rms_norm(x, delta, norm, c.rms_norm_eps, backend=norm_backend(self.norm_kernel, self.attention))
        if c.tie_word_embeddings:
            logits = x @ embed.T.astype(x.dtype)
        else:
            logits = x @ self.param("lm_head", _dense_init(1.0), (c.hidden_size, c.vocab_size))
        return logits.astype(jnp.float32), features, pools


def kv_buffer_names(num_layers: int) -> tuple[tuple[str, str], ...]:
    """(key, value) pool names of each layer, as `Llama` reads them."""
    return tuple((f"k{i}", f"v{i}") for i in range(num_layers))


def init_params(cfg: LlamaConfig, key: jax.Array, dtype: str = "fp32", scale: float = 1.0) -> dict:
    """Random parameters in the documented layout (fresh normal weights, norms near 1).

    `scale` multiplies every matrix's 1/sqrt(fan_in) normal draw; norms and biases get small
    random offsets so no test runs on ones and zeros.
    """
    dt = DTYPES[dtype]
    h, f, qw, kw, d = cfg.hidden_size, cfg.intermediate_size, cfg.q_width, cfg.kv_width, cfg.head_dim
    keys = iter(jax.random.split(key, 4 + 16 * cfg.num_layers))

    def mat(shape):
        return (scale * jax.random.normal(next(keys), shape) / np.sqrt(shape[0])).astype(dt)

    def vec(shape, base):
        return (base + 0.1 * jax.random.normal(next(keys), shape)).astype(dt)

    params = {"embed": jax.random.normal(next(keys), (cfg.vocab_size, h)).astype(dt), "norm": vec((h,), 1.0)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = mat((h, cfg.vocab_size))
    for i in range(cfg.num_layers):
        layer = {"attn_norm": vec((h,), 1.0), "wq": mat((h, qw)), "wk": mat((h, kw)), "wv": mat((h, kw)),
                 "wo": mat((qw, h)), "mlp_norm": vec((h,), 1.0), "w_gate": mat((h, f)), "w_up": mat((h, f)),
                 "w_down": mat((f, h))}
        if cfg.attention_bias:
            layer.update(bq=vec((qw,), 0.0), bk=vec((kw,), 0.0), bv=vec((kw,), 0.0))
        if cfg.qk_norm:
            layer.update(q_norm=vec((d,), 1.0), k_norm=vec((d,), 1.0))
        params[f"layers_{i}"] = layer
    return params


class LlamaModel:
    """A target model bound to its static config: `prefill`, `decode`, `verify` over paged pools.

    Each is a pure function of (params, pools, ...) returning (logits, features, pools); the
    engine jits and donates around them.
    """

    def __init__(self, cfg: LlamaConfig, attention: PagedAttention, feature_layers: tuple[int, ...] = (),
                 norm_kernel: str = "auto", rope_kernel: str = "auto"):
        bad = [i for i in feature_layers if not 0 <= i <= cfg.num_layers]
        if bad:
            raise ValueError(f"feature_layers {bad} outside 0..{cfg.num_layers} for a {cfg.num_layers}-layer model")
        norm_backend(norm_kernel, attention)  # refuses an unknown choice here, not at the first trace
        rope_backend(rope_kernel, attention)  # likewise
        self.cfg = cfg
        self.attention = attention
        self.feature_layers = tuple(feature_layers)
        self.norm_kernel = norm_kernel  # NORM_KERNELS
        self.rope_kernel = rope_kernel  # ROPE_KERNELS
        self.module = Llama(cfg, attention, self.feature_layers, norm_kernel, rope_kernel)

    @property
    def page_size(self) -> int:
        return self.attention.page_size

    @property
    def feature_width(self) -> int:
        return len(self.feature_layers) * self.cfg.hidden_size

    def forward(self, params, pools, tokens, batch: AttentionBatch, logit_rows=None):
        return self.module.apply({"params": params}, tokens, pools, batch, logit_rows)

    def prefill(self, params, pools, tokens, page_table, start, valid):
        """A prompt chunk: `tokens [B, C]` at positions start + t, rows t < valid[b] real.
        Logits at each request's last real row `[B, 1, V]`; features of every row."""
        batch = prefill_batch(page_table, start, valid, tokens.shape[1], self.page_size)
        last = jnp.maximum(valid - 1, 0).astype(jnp.int32)[:, None]
        return self.forward(params, pools, tokens, batch, last)

    def decode(self, params, pools, tokens, page_table, lengths):
        """Plain decoding: `tokens [B]` at position lengths[b] (its K/V written there)."""
        b = tokens.shape[0]
        mask = jnp.ones((b, 1, 2), jnp.uint32).at[:, :, 1].set(0)
        batch = window_batch(page_table, lengths, lengths[:, None], mask, self.page_size)
        return self.forward(params, pools, tokens[:, None], batch)

    def verify(self, params, pools, tokens, positions, mask, page_table, lengths):
        """Tree verify: node i of `tokens [B, N]` writes slot lengths + i, RoPE at `positions`
        (vc + depth), sees the committed prefix and its ancestors (`mask [B, N, 2]`)."""
        batch = window_batch(page_table, lengths, positions, mask, self.page_size)
        return self.forward(params, pools, tokens, batch)
