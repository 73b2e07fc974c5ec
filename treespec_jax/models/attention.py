"""The attention layer backend every target and draft layer calls: write K/V, then attend.

A forward over the paged pools is one of three kinds (`AttentionBatch.mode`, static):

- "prefill": a chunk of T prompt tokens per request at positions start .. start + T - 1. Row t
  sees every key at a position <= its own (the committed prefix from the pool and the chunk's
  causal part). Masked attention with an online softmax over blocks of the request's pages
  (XLA, fp32), stopping at the chunk's last position (`prefill_attention`), for any T.
- "window": T <= 64 rows written at positions P .. P + T - 1 (P = `prefix_lengths`); row t sees
  the P committed keys and window key j iff bit j of `mask[b, t]`. Plain decoding (T = 1, mask
  bit 0), tree verify (T = N, ancestor masks) and the drafter's step over accepted tokens
  (T = N, chain masks) are all this kind, through `verify_attention`.
- "lanes": T = K draft lanes writing lane-window slots frontier + (s-1)K + r; row r sees the
  frontier's keys and the lane-window slots its lane mask names (`lane_attention`).

`PagedAttention.kind` picks the implementation of "window" and "lanes": "cascade" runs the
cascade kernels (`treespec_jax.attention.cascade`, whose `CascadeConfig.backend` selects compiled
Pallas, interpret mode or the cascade's own jnp reference), "dense" gathers every page of the
request and runs one fp32 masked softmax (`cascade_dense_reference`): the independent reference
the kernel path is tested against. Stateless layers commit by KV compaction
(`treespec_jax.cache.routing`); stateful layers (GDN, Mamba2) will implement the same pair of
calls (attend during verify, commit along the accepted path) in their own backend.

Slots: a request's position p lives in slot `page_table[b, p // page] * page + p % page`
(`treespec_jax.cache.paged`). Page 0 is the scratch page: no request owns it, and no owned row
reads it. Rows that must write nowhere (prefill padding, empty batch slots) map to it, and their
writes are dropped (`NO_SLOT`): hundreds of rows scattering onto the same few slots serialize on
the GPU (a 32-request prefill chunk took 3.7 s on the H100, 2026-12-06).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.attention.reference import cascade_dense_reference, dense_attention_reference
from treespec_jax.attention.cascade import CascadeConfig, lane_attention, verify_attention
from treespec_jax.cache.paged import slot_of

ATTENTION_KINDS = ("cascade", "dense")
MODES = ("prefill", "window", "lanes")
SCRATCH_PAGE = 0
# The write slot of a row that writes nowhere: past every pool, so the scatter drops it.
NO_SLOT = int(jnp.iinfo(jnp.int32).max)


def _write_slots(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """`[B, T]` pool slots of `positions`; those on the scratch page become `NO_SLOT`."""
    pages = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    return jnp.where(pages == SCRATCH_PAGE, NO_SLOT, slot_of(page_table, positions, page_size))


@struct.dataclass
class AttentionBatch:
    """Where one forward's rows sit in the paged cache; shared by every layer of a cache group."""

    positions: jax.Array  # [B, T] int32 RoPE position of each row (vc + depth for tree nodes)
    write_slots: jax.Array  # [B, T] int32 pool slot each row's K/V is written to (NO_SLOT: dropped)
    page_table: jax.Array  # [B, max_pages] int32 the requests' pages (0 = scratch)
    prefix_lengths: jax.Array  # [B] int32 committed keys before the window / chunk / lanes
    mask: jax.Array  # [B, T, 2] uint32 window visibility rows ("window", "lanes"); unused in prefill
    mode: str = struct.field(pytree_node=False, default="window")  # one of MODES
    lane_steps: int = struct.field(pytree_node=False, default=0)  # S for "lanes": window (S-1)K


def window_batch(page_table: jax.Array, start: jax.Array, positions: jax.Array, mask: jax.Array,
                 page_size: int) -> AttentionBatch:
    """A "window" forward: rows at slots start .. start + T - 1, RoPE at `positions [B, T]`."""
    t = positions.shape[1]
    rows = start.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return AttentionBatch(positions=positions.astype(jnp.int32), write_slots=_write_slots(page_table, rows, page_size),
                          page_table=page_table, prefix_lengths=start.astype(jnp.int32), mask=mask, mode="window")


def prefill_batch(page_table: jax.Array, start: jax.Array, valid: jax.Array, chunk: int,
                  page_size: int) -> AttentionBatch:
    """A "prefill" chunk of `chunk` rows at positions start + t; rows t >= valid[b] are padding
    (written to the scratch page, outputs ignored). valid[b] = 0 leaves request b untouched."""
    t = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    live = t < valid[:, None]
    # A padding row sits at the last real position, so it sees no key past the real ones: an
    # unwritten slot may hold anything, and a key any row sees takes part in every row's sums.
    positions = start.astype(jnp.int32)[:, None] + jnp.minimum(t, valid[:, None] - 1)
    slots = jnp.where(live, _write_slots(page_table, jnp.maximum(positions, 0), page_size), NO_SLOT)
    b = page_table.shape[0]
    return AttentionBatch(positions=positions, write_slots=slots, page_table=page_table,
                          prefix_lengths=start.astype(jnp.int32), mask=jnp.zeros((b, chunk, 2), jnp.uint32),
                          mode="prefill")


def lanes_batch(page_table: jax.Array, frontier: jax.Array, positions: jax.Array, lane_mask: jax.Array,
                step: int, num_steps: int, page_size: int) -> AttentionBatch:
    """Draft step `step` (1..S-1): lane r writes slot frontier + (step-1)K + r, RoPE at `positions`."""
    k = positions.shape[1]
    rows = frontier.astype(jnp.int32)[:, None] + (step - 1) * k + jnp.arange(k, dtype=jnp.int32)[None, :]
    return AttentionBatch(positions=positions.astype(jnp.int32), write_slots=_write_slots(page_table, rows, page_size),
                          page_table=page_table, prefix_lengths=frontier.astype(jnp.int32), mask=lane_mask,
                          mode="lanes", lane_steps=num_steps)


def _to_pool(x: jax.Array, dtype) -> jax.Array:
    """K/V rows in the pool's dtype; FP8 (E4M3, no inf) saturates at its largest finite value
    instead of turning large values into NaN."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(jnp.float8_e4m3fn):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def write_kv(k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array):
    """Scatters `k, v [B, T, Hkv, D]` into pools `[S, Hkv, D]` at `slots [B, T]` (in place when
    donated); rows at `NO_SLOT` are dropped."""
    flat = slots.reshape(-1)
    k_pool = k_pool.at[flat].set(_to_pool(k.reshape((-1,) + k.shape[2:]), k_pool.dtype), mode="drop")
    v_pool = v_pool.at[flat].set(_to_pool(v.reshape((-1,) + v.shape[2:]), v_pool.dtype), mode="drop")
    return k_pool, v_pool


@dataclasses.dataclass(frozen=True)
class PagedAttention:
    """One attention implementation for every layer of a cache group (static, hashable)."""

    page_size: int  # tokens per page of the group's pools
    kind: str = "cascade"  # "cascade" (kernels) or "dense" (fp32 reference), see module docstring
    kernel_backend: str | None = None  # CascadeConfig.backend: None/"pallas", "interpret", "reference"
    prefix_kernel: str = "auto"  # CascadeConfig.prefix_kernel
    scale: float | None = None  # softmax scale; None = head_dim^-1/2
    # A jax Mesh with a "tp" axis: attend then runs per device on its local heads under shard_map
    # (the kernels are custom calls the SPMD partitioner cannot split; `treespec_jax.parallel`).
    mesh: Any = None

    def __post_init__(self):
        if self.kind not in ATTENTION_KINDS:
            raise ValueError(f"PagedAttention.kind must be one of {ATTENTION_KINDS}, got {self.kind!r}")

    @property
    def cascade(self) -> CascadeConfig:
        return CascadeConfig(page_size=self.page_size, scale=self.scale, backend=self.kernel_backend,
                             prefix_kernel=self.prefix_kernel)

    def attend(self, q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, batch: AttentionBatch) -> jax.Array:
        """`q [B, T, Hq, D]` over pools that already hold this forward's K/V -> `[B, T, Hq, D]` in q's dtype."""
        if self.mesh is not None:
            from treespec_jax.parallel import attend_sharded

            return attend_sharded(dataclasses.replace(self, mesh=None), self.mesh, q, k_pool, v_pool, batch)
        scale = float(q.shape[-1] ** -0.5 if self.scale is None else self.scale)
        if batch.mode == "prefill":
            return prefill_attention(q, k_pool, v_pool, batch, self.page_size, scale).astype(q.dtype)
        if batch.mode not in ("window", "lanes"):
            raise ValueError(f"AttentionBatch.mode must be one of {MODES}, got {batch.mode!r}")
        window = q.shape[1] if batch.mode == "window" else (batch.lane_steps - 1) * q.shape[1]
        if self.kind == "dense":
            out, _ = cascade_dense_reference(q, k_pool, v_pool, batch.page_table, batch.prefix_lengths, batch.mask,
                                             window=window, page_size=self.page_size, scale=scale)
            return out.astype(q.dtype)
        if batch.mode == "window":
            return verify_attention(q, k_pool, v_pool, batch.page_table, batch.prefix_lengths, batch.mask,
                                    config=self.cascade)
        return lane_attention(q, k_pool, v_pool, batch.page_table, batch.prefix_lengths, batch.mask,
                              steps=batch.lane_steps, config=self.cascade)


def prefill_attention_reference(q, k_pool, v_pool, batch: AttentionBatch, page_size: int, scale: float) -> jax.Array:
    """What `prefill_attention` computes, as one dense fp32 masked attention over every key the
    page table covers (the whole context, whatever the prompt): its tests' reference and its
    benchmark's baseline. `q [B, T, Hq, D]` -> `[B, T, Hq, D]` f32."""
    b = q.shape[0]
    total = batch.page_table.shape[1] * page_size
    key_pos = jnp.arange(total, dtype=jnp.int32)
    slots = slot_of(batch.page_table, jnp.broadcast_to(key_pos, (b, total)), page_size)
    visible = key_pos[None, None, :] <= batch.positions[:, :, None]
    out, _ = dense_attention_reference(q, k_pool[slots], v_pool[slots], visible, scale)
    return out


PREFILL_KEY_BLOCK = 256  # keys per step of the prefill loop (rounded to whole pages)


def prefill_key_blocks(positions: jax.Array, page_size: int, key_block: int = PREFILL_KEY_BLOCK) -> jax.Array:
    """Key blocks `prefill_attention` reads for rows at `positions [B, T]`: through the block
    holding the largest position (blocks of `key_block` keys rounded down to whole pages, at
    least one page). A scalar int32, traced: the loop's trip count."""
    block = max(1, key_block // page_size) * page_size
    return jnp.maximum(jnp.max(positions), 0) // block + 1


def prefill_attention(q, k_pool, v_pool, batch: AttentionBatch, page_size: int, scale: float,
                      key_block: int = PREFILL_KEY_BLOCK) -> jax.Array:
    """Causal attention by absolute position over the request's pages, fp32: `q [B, T, Hq, D]`
    -> `[B, T, Hq, D]` f32, row t seeing every key at a position <= `batch.positions[b, t]`.

    Keys are read a block of whole pages at a time with an online softmax, and the loop stops
    after the block holding the batch's last position: a chunk costs what its prompt covers, not
    the table's width (the whole context), and the program's shape does not depend on the prompt.
    K/V rows no row of the request sees are zeroed before use (an unwritten slot may hold anything).
    """
    b, t, hq, d = q.shape
    hkv = k_pool.shape[-2]
    group = hq // hkv
    pages = max(1, key_block // page_size)
    width = batch.page_table.shape[1]
    table = jnp.pad(batch.page_table, ((0, 0), (0, -width % pages)))  # scratch columns past the end
    block = pages * page_size
    qf = q.astype(jnp.float32).reshape(b, t, hkv, group, d) * scale
    seen_to = jnp.max(batch.positions, axis=1)  # [B] the last key any row of the request sees
    steps = prefill_key_blocks(batch.positions, page_size, key_block)

    def one_block(i, carry):
        m, l, acc = carry  # [B, T, Hkv, G], same, [B, T, Hkv, G, D]
        key_pos = i * block + jnp.arange(block, dtype=jnp.int32)
        slots = slot_of(table, jnp.broadcast_to(key_pos, (b, block)), page_size)
        seen = (key_pos[None, :] <= seen_to[:, None])[:, :, None, None]  # [B, K, 1, 1]
        k = jnp.where(seen, k_pool[slots].astype(jnp.float32), 0.0)
        v = jnp.where(seen, v_pool[slots].astype(jnp.float32), 0.0)
        s = jnp.einsum("btkgd,bskd->btkgs", qf, k, precision=jax.lax.Precision.HIGHEST)
        visible = (key_pos[None, None, :] <= batch.positions[:, :, None])[:, :, None, None, :]
        s = jnp.where(visible, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.where(visible, jnp.exp(s - m_safe[..., None]), 0.0)
        rescale = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
        l = l * rescale + jnp.sum(p, axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum("btkgs,bskd->btkgd", p, v, precision=jax.lax.Precision.HIGHEST)
        return m_new, l, acc

    init = (jnp.full((b, t, hkv, group), -jnp.inf, jnp.float32), jnp.zeros((b, t, hkv, group), jnp.float32),
            jnp.zeros((b, t, hkv, group, d), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, steps, one_block, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(b, t, hq, d)
