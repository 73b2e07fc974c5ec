"""Pure-jnp fp32 references for GDN tree verify, the chunked tree form and the replay commit.

Shapes as in `gdn_common`. Every reference works on fp32 copies of its inputs and returns fp32, and
contracts at HIGHEST precision: XLA's default on a GPU would multiply fp32 operands in TF32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.linear.gdn_common import default_scale, gates, l2_normalize
from pallas_kernels.tree_masks import chain_parents

HIGHEST = jax.lax.Precision.HIGHEST


def _prepare(q, k, v, a, b, A_log, dt_bias, use_qk_l2norm, scale):
    """fp32 q (scaled), k expanded to value heads, v, g, beta: `[B, T, HV, ...]`."""
    hv = v.shape[2]
    group = hv // k.shape[2]
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = default_scale(k.shape[-1]) if scale is None else scale
    # Value head hv reads key head hv // group.
    q = jnp.repeat(q, group, axis=2) * scale
    k = jnp.repeat(k, group, axis=2)
    g, beta = gates(a, b, A_log, dt_bias)
    return q, k, v.astype(jnp.float32), g, beta


def _node_update(h, q, k, v, g, beta):
    """One delta-rule step for every (request, value head). `h [B, HV, dk, dv]`, vectors `[B, HV, *]`."""
    h = h * jnp.exp(g)[..., None, None]
    delta = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", h, k, precision=HIGHEST))
    h = h + k[..., :, None] * delta[..., None, :]
    return h, jnp.einsum("bhkv,bhk->bhv", h, q, precision=HIGHEST)


def gdn_tree_verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents=None,
                              *, use_qk_l2norm: bool = True, scale: float | None = None):
    """Per-node recurrence where node t starts from its parent's state (parents None: a chain).

    Returns `out [B, T, HV, dv]` fp32 and `node_states [B, T, HV, dk, dv]` fp32 (state after node t).
    """
    q, k, v, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, use_qk_l2norm, scale)
    bsz, t = q.shape[:2]
    if parents is None:
        parents = chain_parents(bsz, t)
    h0 = state_pool[state_slots].astype(jnp.float32)
    states = jnp.zeros((bsz, t) + h0.shape[1:], jnp.float32)
    outs = jnp.zeros(v.shape, jnp.float32)
    rows = jnp.arange(bsz)

    def body(i, carry):
        states, outs = carry
        p = parents[:, i]
        h_parent = jnp.where((p < 0)[:, None, None, None], h0, states[rows, jnp.maximum(p, 0)])
        h, o = _node_update(h_parent, q[:, i], k[:, i], v[:, i], g[:, i], beta[:, i])
        return states.at[:, i].set(h), outs.at[:, i].set(o)

    states, outs = jax.lax.fori_loop(0, t, body, (states, outs))
    return outs, states


def gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, ancestors,
                          *, use_qk_l2norm: bool = True, scale: float | None = None):
    """The chunked tree form with dense matrices; `ancestors [B, T, T] bool` (ancestor-or-self).

    G_t = sum of g over ancestors-or-self, D[t,s] = exp(G_t - G_s) on ancestor-or-self pairs,
    (I + M) U = beta (V - exp(G) K h0) with M[t,s] = beta_t D[t,s] k_t.k_s over strict ancestors,
    o_t = exp(G_t) q_t h0 + sum_s D[t,s] (q_t.k_s) U_s, h_t = exp(G_t) h0 + sum_s D[t,s] k_s U_s^T.
    Returns `out [B, T, HV, dv]` and `node_states [B, T, HV, dk, dv]`, fp32.
    """
    q, k, v, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, use_qk_l2norm, scale)
    t = q.shape[1]
    h0 = state_pool[state_slots].astype(jnp.float32)  # [B, HV, dk, dv]
    anc = ancestors.astype(jnp.float32)[:, None]  # [B, 1, T, T]
    # Work head-major: [B, HV, T, ...].
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)
    big_g = jnp.einsum("bhts,bhs->bht", jnp.broadcast_to(anc, anc.shape[:1] + g.shape[1:2] + anc.shape[2:]), g,
                       precision=HIGHEST)
    d = anc * jnp.exp(jnp.minimum(big_g[..., :, None] - big_g[..., None, :], 0.0))
    strict = anc * (1.0 - jnp.eye(t, dtype=jnp.float32))
    m = beta[..., :, None] * strict * d * jnp.einsum("bhtk,bhsk->bhts", k, k, precision=HIGHEST)
    decay = jnp.exp(big_g)[..., None]
    rhs = beta[..., None] * (v - decay * jnp.einsum("bhtk,bhkv->bhtv", k, h0, precision=HIGHEST))
    u = jax.scipy.linalg.solve_triangular(jnp.eye(t, dtype=jnp.float32) + m, rhs, lower=True,
                                          unit_diagonal=True)
    out = decay * jnp.einsum("bhtk,bhkv->bhtv", q, h0, precision=HIGHEST) + jnp.einsum(
        "bhts,bhtk,bhsk,bhsv->bhtv", d, q, k, u, precision=HIGHEST)
    states = decay[..., None] * h0[:, :, None] + jnp.einsum("bhts,bhsk,bhsv->bhtkv", d, k, u, precision=HIGHEST)
    return out.transpose(0, 2, 1, 3), states.transpose(0, 2, 1, 3, 4)


def gdn_replay_reference(state_pool, state_slots, k, v, a, b, A_log, dt_bias, num_rows,
                         *, use_qk_l2norm: bool = True):
    """Replays rows `0 .. min(num_rows[b], T) - 1` of `k, v, a, b` as a chain over each request's
    committed state and writes it back to its pool row (rows with num_rows == 0 are untouched).

    `k [B, T, H, dk]`, `v [B, T, HV, dv]`, `a/b [B, T, HV]`, `num_rows [B] int32` -> new pool.
    """
    q = jnp.zeros_like(k)  # replay produces no output; q only feeds the unused o
    _, kk, vv, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, use_qk_l2norm, 1.0)
    t = kk.shape[1]
    n = jnp.minimum(num_rows, t)
    h = state_pool[state_slots].astype(jnp.float32)

    def body(i, h):
        h_new, _ = _node_update(h, kk[:, i], kk[:, i], vv[:, i], g[:, i], beta[:, i])
        return jnp.where((i < n)[:, None, None, None], h_new, h)

    h = jax.lax.fori_loop(0, t, body, h)
    # Requests that commit nothing scatter out of bounds, which mode="drop" discards.
    dst = jnp.where(n > 0, state_slots, state_pool.shape[0])
    return state_pool.at[dst].set(h, mode="drop")
