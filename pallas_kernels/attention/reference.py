"""Pure-jnp fp32 references for the cascade tree attention kernels.

Every function here computes in float32 from gathered rows, with no paging tricks and no online
softmax, so the Pallas kernels have an independent check. Unseen slots are removed with `where`
before any arithmetic touches them: a NaN/inf in a slot a row cannot see never reaches its output.

Conventions shared with the kernels:
- pools are slot-major `[S, Hkv, D]` (see `pallas_kernels/paging.py`); position `pos` of request b
  lives in slot `page_table[b, pos // page_size] * page_size + pos % page_size`;
- query head `hq` reads KV head `hq // (Hq // Hkv)` (GQA groups are contiguous);
- scores are `s = scale * q.k`; log-sum-exps are base 2: `lse2 = log2(sum_j 2^(s_j * log2(e)))`;
  a row that sees no key has `lse2 = -inf` and output 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import LOG2E
from pallas_kernels.paging import slot_of
from pallas_kernels.tree_masks import unpack_mask_rows

FP8_DTYPES = (jnp.float8_e4m3fn,)


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in [jnp.dtype(d) for d in FP8_DTYPES]


def quantize_query_for_pool(q: jax.Array, pool_dtype) -> jax.Array:
    """The query the prefix half actually multiplies: cast to FP8 (E4M3, unscaled) under an FP8 pool,
    saturating at +-448 (E4M3's largest finite value) as the GPU's satfinite convert does, so a
    kernel that casts q itself (`prefix_decode_mgpu`'s `cast_query`) gives these bits; a plain
    `astype` would turn |q| > 464 into NaN.

    The barrier keeps the rounding under jit: XLA on the GPU may fold a narrowing convert followed
    by a widening one into nothing (excess precision), which would skip the FP8 quantisation.
    """
    if not is_fp8(pool_dtype):
        return q
    top = float(jnp.finfo(pool_dtype).max)
    return jax.lax.optimization_barrier(jnp.clip(q, -top, top).astype(pool_dtype))


def _gather_positions(pool: jax.Array, page_table: jax.Array, positions: jax.Array, page_size: int):
    """`pool [S, ...]`, `positions [B, T]` (any int, out-of-range allowed) -> rows `[B, T, ...]` f32.

    Positions outside the table are clamped for the gather only; callers mask them out.
    """
    max_pos = page_table.shape[1] * page_size - 1
    pos = jnp.clip(positions, 0, max_pos)
    return pool[slot_of(page_table, pos, page_size)].astype(jnp.float32)


def _masked_softmax_parts(scores: jax.Array, visible: jax.Array):
    """`scores, visible [..., T]` -> (weights normalised, lse2) in f32; empty rows give (0, -inf)."""
    s2 = jnp.where(visible, scores * LOG2E, -jnp.inf)
    m = jnp.max(s2, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(visible, jnp.exp2(s2 - m_safe), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    weights = jnp.where(l > 0, p / jnp.where(l > 0, l, 1.0), 0.0)
    lse2 = jnp.where(l[..., 0] > 0, m_safe[..., 0] + jnp.log2(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return weights, lse2


def dense_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, scale: float):
    """One dense fp32 masked attention.

    `q [B, R, Hq, Dk]`, `k [B, T, Hkv, Dk]`, `v [B, T, Hkv, Dv]`, `visible [B, R, T] bool`
    -> (out `[B, R, Hq, Dv]` f32, lse2 `[B, R, Hq]` f32). Invisible K/V rows are zeroed first.
    """
    b, r, hq, _ = q.shape
    hkv = k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} are not a multiple of KV heads {hkv}")
    group = hq // hkv
    seen_by_any = jnp.any(visible, axis=1)[:, :, None, None]  # [B, T, 1, 1]
    k = jnp.where(seen_by_any, k.astype(jnp.float32), 0.0)
    v = jnp.where(seen_by_any, v.astype(jnp.float32), 0.0)
    kh = jnp.repeat(k, group, axis=2)  # [B, T, Hq, Dk]
    vh = jnp.repeat(v, group, axis=2)
    scores = scale * jnp.einsum("brhd,bthd->bhrt", q.astype(jnp.float32), kh,
                                precision=jax.lax.Precision.HIGHEST)
    weights, lse2 = _masked_softmax_parts(scores, visible[:, None, :, :])
    out = jnp.einsum("bhrt,bthd->brhd", weights, vh, precision=jax.lax.Precision.HIGHEST)
    return out, jnp.transpose(lse2, (0, 2, 1))


def prefix_decode_reference(q, k_pool, v_pool, page_table, lengths, *, page_size: int, scale: float,
                            sliding_window: int | None = None, whole_pages: bool = False):
    """fp32 causal multi-query paged decode.

    `q [B, R, Hq, D]`, pools `[S, Hkv, D]`, `page_table [B, maxp] int32`, `lengths [B] int32`
    -> (out `[B, R, Hq, D]` f32, lse2 `[B, R, Hq]` f32). Row r sees keys
    `[max(0, lim - sliding_window), lim)` with `lim = max(0, P - R + 1 + r)`, capped at
    (P // page_size) * page_size with `whole_pages` (the Mosaic GPU prefix half's contract). Under
    an FP8 pool the query is quantised to FP8 first, exactly as the kernel does.
    """
    q = quantize_query_for_pool(q, k_pool.dtype)
    b, r = q.shape[:2]
    t = page_table.shape[1] * page_size
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k = _gather_positions(k_pool, page_table, pos, page_size)
    v = _gather_positions(v_pool, page_table, pos, page_size)
    lim = lengths[:, None] - r + 1 + jnp.arange(r)[None, :]  # [B, R]
    if whole_pages:
        lim = jnp.minimum(lim, ((lengths // page_size) * page_size)[:, None])
    visible = pos[:, None, :] < lim[:, :, None]
    if sliding_window is not None:
        visible &= pos[:, None, :] >= (lim - sliding_window)[:, :, None]
    return dense_attention_reference(q, k, v, visible, scale)


def window_lead(rows: int, whole_pages_of: int | None = None) -> int:
    """Prefix positions before P the window half may read: R - 1, or (prefix half on whole pages
    of `whole_pages_of` keys) up to page - 1 more of the last partial page."""
    return rows - 1 if whole_pages_of is None else max(rows - 1, whole_pages_of - 1)


def window_positions(prefix_lengths: jax.Array, rows: int, window: int, lead: int | None = None):
    """Positions the window half may read: `[B, lead + window]`, tail first then window."""
    lead = rows - 1 if lead is None else lead
    offs = jnp.arange(-lead, window, dtype=jnp.int32)
    return prefix_lengths[:, None] + offs[None, :]


def window_visibility(prefix_lengths, mask, *, rows: int, window: int, causal_prefix: bool,
                      whole_pages_of: int | None = None):
    """`[B, R, lead + W] bool` over `window_positions`: the missed prefix tail, then mask bits.

    `whole_pages_of=page`: the prefix half covered only whole pages below P, so row r's tail starts
    at min(P - R + 1 + r, (P // page) * page); with `causal_prefix=False` at (P // page) * page
    (every row's prefix half ran to the same bound, the window half takes the rest below P)."""
    b = prefix_lengths.shape[0]
    lead = window_lead(rows, whole_pages_of)
    pos = window_positions(prefix_lengths, rows, window, lead)  # [B, T]
    p = prefix_lengths[:, None, None]
    r_idx = jnp.arange(rows)[None, :, None]
    posb = pos[:, None, :]
    start = p - rows + 1 + r_idx if causal_prefix else jnp.broadcast_to(p, (b, rows, 1))
    if whole_pages_of is not None:
        start = jnp.minimum(start, (p // whole_pages_of) * whole_pages_of)
    tail = (posb < p) & (posb >= start) & (posb >= 0)
    bits = unpack_mask_rows(mask, window)  # [B, R, W]
    win = jnp.concatenate([jnp.zeros((b, rows, lead), bool), bits], axis=-1)
    return tail | win


def tree_window_reference(q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2, *,
                          window: int, page_size: int, scale: float, causal_prefix: bool = True,
                          rope_dim: int = 0, value_dim: int | None = None, prefix_whole_pages: bool = False):
    """fp32 window half + merge with the prefix partial (`prefix_whole_pages`: see window_visibility).

    `q [B, R, Hq, Dk]`, `k_pool [S, Hkv, Dk]`, `v_pool [S, Hkv, Dv]` or None (MLA: the value is the
    first `value_dim` channels of the key row), `mask [B, R, 2] uint32`, `prefix_out [B, R, Hq, Dv]`,
    `prefix_lse2 [B, R, Hq]` -> out `[B, R, Hq, Dv]` f32. Under an FP8 pool the query stays
    unquantised and K/V are widened.
    """
    del rope_dim  # the rope channels are simply part of the key row for a dense dot
    b, r = q.shape[:2]
    whole = page_size if prefix_whole_pages else None
    pos = window_positions(prefix_lengths, r, window, window_lead(r, whole))
    k = _gather_positions(k_pool, page_table, pos, page_size)
    if v_pool is None:
        if value_dim is None:
            raise ValueError("a shared (MLA) pool needs value_dim")
        v = k[..., :value_dim]
    else:
        v = _gather_positions(v_pool, page_table, pos, page_size)
    visible = window_visibility(prefix_lengths, mask, rows=r, window=window, causal_prefix=causal_prefix,
                                whole_pages_of=whole)
    w_out, w_lse = dense_attention_reference(q, k, v, visible, scale)
    return merge_partials_reference(prefix_out, prefix_lse2, w_out, w_lse)[0]


def merge_partials_reference(out_a, lse_a, out_b, lse_b):
    """Merges two normalised partials by their base-2 LSEs; -inf partials drop out exactly."""
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.where(jnp.isfinite(lse_a), jnp.exp2(lse_a - m_safe), 0.0)
    wb = jnp.where(jnp.isfinite(lse_b), jnp.exp2(lse_b - m_safe), 0.0)
    tot = wa + wb
    safe = jnp.where(tot > 0, tot, 1.0)
    oa = jnp.where(wa[..., None] > 0, out_a.astype(jnp.float32), 0.0)
    ob = jnp.where(wb[..., None] > 0, out_b.astype(jnp.float32), 0.0)
    out = (wa[..., None] * oa + wb[..., None] * ob) / safe[..., None]
    lse = jnp.where(tot > 0, m_safe + jnp.log2(safe), -jnp.inf)
    return out, lse


def cascade_dense_reference(q, k_pool, v_pool, page_table, prefix_lengths, mask, *, window: int,
                            page_size: int, scale: float):
    """The whole verify/lane attention as one dense fp32 masked attention over gathered K/V.

    Row r sees every committed key [0, P) and window key j (position P + j) iff bit j of `mask[b, r]`.
    `q [B, R, Hq, D]`, pools `[S, Hkv, D]` -> (out `[B, R, Hq, D]` f32, lse2 `[B, R, Hq]` f32).
    FP8 pools are widened; the query is used unquantised (the exact-math target).
    """
    b, r = q.shape[:2]
    t = page_table.shape[1] * page_size
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    k = _gather_positions(k_pool, page_table, pos, page_size)
    v = _gather_positions(v_pool, page_table, pos, page_size)
    visible = dense_tree_visibility(prefix_lengths, mask, t, window)
    return dense_attention_reference(q, k, v, visible, scale)


def dense_tree_visibility(prefix_lengths, mask, total_positions: int, window: int):
    """`[B, R, T] bool`: position < P, or P <= position < P + window with its mask bit set."""
    pos = jnp.arange(total_positions, dtype=jnp.int32)[None, None, :]
    p = prefix_lengths[:, None, None]
    j = pos - p
    bits = unpack_mask_rows(mask, 64)  # [B, R, 64]
    jc = jnp.clip(j, 0, 63)
    bit = jnp.take_along_axis(bits, jnp.broadcast_to(jc, bits.shape[:2] + (total_positions,)), axis=-1)
    return (pos < p) | ((j >= 0) & (j < window) & bit)


def sliding_lane_dense_reference(q, k_pool, v_pool, row_page_table, row_lengths, page_table, frontier,
                                 mask, *, window: int, page_size: int, scale: float,
                                 sliding_window: int | None):
    """Dense fp32 reference of sliding-window lanes with per-row page tables.

    Row r of request b sees its own table's keys [max(0, L - sliding_window), L) with
    L = row_lengths[b, r], plus window key j at position frontier[b] + j of `page_table` iff its mask
    bit is set. `row_page_table [B, R, maxp]`, `row_lengths [B, R]` -> (out `[B, R, Hq, D]`, lse2) f32.
    """
    b, r = q.shape[:2]
    tr = row_page_table.shape[2] * page_size
    rpos = jnp.broadcast_to(jnp.arange(tr, dtype=jnp.int32), (b * r, tr))
    flat_pt = row_page_table.reshape(b * r, -1)
    kr = _gather_positions(k_pool, flat_pt, rpos, page_size).reshape((b, r * tr) + k_pool.shape[1:])
    vr = _gather_positions(v_pool, flat_pt, rpos, page_size).reshape((b, r * tr) + v_pool.shape[1:])
    lim = row_lengths[:, :, None]
    own = (rpos.reshape(b, r, tr) < lim)
    if sliding_window is not None:
        own &= rpos.reshape(b, r, tr) >= lim - sliding_window
    # Row r's prefix keys occupy block r of the concatenated key axis.
    eye = jnp.eye(r, dtype=bool)[None, :, :, None]
    prefix_vis = (eye & own[:, None, :, :]).reshape(b, r, r * tr)
    wpos = frontier[:, None] + jnp.arange(window, dtype=jnp.int32)[None, :]
    kw = _gather_positions(k_pool, page_table, wpos, page_size)
    vw = _gather_positions(v_pool, page_table, wpos, page_size)
    win_vis = unpack_mask_rows(mask, window)
    k = jnp.concatenate([kr, kw], axis=1)
    v = jnp.concatenate([vr, vw], axis=1)
    visible = jnp.concatenate([prefix_vis, win_vis], axis=-1)
    return dense_attention_reference(q, k, v, visible, scale)
