"""GDN shapes, input validation and the per-node gate math shared by kernels and references.

Shapes (one layer, one verify window of T nodes for B requests):

    q, k          [B, T, H, dk]      query / key heads
    v             [B, T, HV, dv]     value heads; value head hv reads key head hv // (HV // H)
    a, b          [B, T, HV]         gate and beta pre-activations
    A_log, dt_bias [HV]              per value head parameters
    state_pool    [S, HV, dk, dv]    committed recurrent states, fp32, one row per request slot
    state_slots   [B] int32          pool row of each request; must be a valid row even for a
                                     padded request (verify reads it; give padded requests a dummy
                                     row and accept_len 0 so the commit writes nothing)

State layout: `[HV, dk, dv]` fp32 per request (key dim major), so `h^T k` is a reduction over the
leading axis of a `[dk, dv]` tile and a dv-tile of the state is a strided 2-D block.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

# eps inside the L2 norm: x / sqrt(sum(x^2) + eps).
L2_NORM_EPS = 1e-6
# softplus(x) == x to fp32 precision beyond this; avoids exp overflow.
SOFTPLUS_LINEAR_ABOVE = 20.0


@dataclass(frozen=True)
class GdnDims:
    """Static sizes of one GDN layer's verify call, read off the inputs."""

    batch: int  # B: requests
    nodes: int  # T: verify nodes per request
    num_k_heads: int  # H
    num_v_heads: int  # HV, a multiple of H
    head_k_dim: int  # dk, a power of two >= 16 (Triton blocks)
    head_v_dim: int  # dv, a power of two >= 16
    pool_rows: int  # S: rows of the committed state pool

    @property
    def group(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads


def _pow2_at_least_16(name: str, n: int) -> None:
    if n < 16 or n & (n - 1):
        raise ValueError(f"{name}={n} must be a power of two >= 16 (Triton block shapes)")


def gdn_dims(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots) -> GdnDims:
    """Checks every shape and dtype; returns the dims. Raises ValueError naming the bad value."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, H, dk]; got q {q.shape}, k {k.shape}")
    bsz, t, h, dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (bsz, t):
        raise ValueError(f"v must be [B={bsz}, T={t}, HV, dv]; got {v.shape}")
    hv, dv = v.shape[2:]
    if t < 1:
        raise ValueError(f"a verify window needs at least one node, got T={t}")
    _pow2_at_least_16("head_k_dim dk", dk)
    _pow2_at_least_16("head_v_dim dv", dv)
    if hv % h:
        raise ValueError(f"value heads HV={hv} must be a multiple of key heads H={h}")
    for name, x in (("a", a), ("b", b)):
        if x.shape != (bsz, t, hv):
            raise ValueError(f"{name} must be [B, T, HV] = {(bsz, t, hv)}; got {x.shape}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (hv,):
            raise ValueError(f"{name} must be [HV] = {(hv,)}; got {x.shape}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state_pool must be [S, HV={hv}, dk={dk}, dv={dv}]; got {state_pool.shape}")
    if state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be float32 (the recurrent state is kept in fp32); got {state_pool.dtype}")
    if state_slots.shape != (bsz,) or not jnp.issubdtype(state_slots.dtype, jnp.integer):
        raise ValueError(f"state_slots must be [B={bsz}] int32; got {state_slots.shape} {state_slots.dtype}")
    return GdnDims(bsz, t, h, hv, dk, dv, state_pool.shape[0])


def softplus(x):
    """softplus written with exp/log1p only (both lower to Triton)."""
    return jnp.where(x > SOFTPLUS_LINEAR_ABOVE, x, jnp.log1p(jnp.exp(jnp.minimum(x, SOFTPLUS_LINEAR_ABOVE))))


def gates(a, b, A_log, dt_bias):
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) (<= 0) and beta = sigmoid(b), in fp32."""
    a = a.astype(jnp.float32)
    b = b.astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * softplus(a + dt_bias.astype(jnp.float32))
    beta = 1.0 / (1.0 + jnp.exp(-b))
    return g, beta


def l2_normalize(x, axis=-1):
    """x / sqrt(sum(x^2) + eps) along `axis`, in fp32."""
    x = x.astype(jnp.float32)
    return x * l2_norm_factor(x, axis, keepdims=True)


def l2_norm_factor(x, axis=-1, keepdims=False):
    """1 / sqrt(sum(x^2) + eps) along `axis`, in fp32: the factor `l2_normalize` multiplies by (a
    `[rows, d]` tile gives `[rows]`; kernels that fold it into a later product take it alone)."""
    x = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.sum(x * x, axis=axis, keepdims=keepdims) + L2_NORM_EPS)


def default_scale(head_k_dim: int) -> float:
    return head_k_dim ** -0.5
