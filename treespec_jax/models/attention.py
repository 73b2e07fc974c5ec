"""The attention layer backend every target and draft layer calls: write K/V, then attend.

A forward over the paged pools is one of three kinds (`AttentionBatch.mode`, static):

- "prefill": a chunk of T prompt tokens per request at positions start .. start + T - 1. Row t
  sees every key at a position <= its own (the committed prefix from the pool and the chunk's
  causal part). Dense masked attention over the request's gathered pages (XLA), for any T.
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
(`treespec_jax.cache.paged`). Page 0 is the scratch page: no request owns it, rows that must
write nowhere (prefill padding, empty batch slots) write there, and no owned row reads it.
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


@struct.dataclass
class AttentionBatch:
    """Where one forward's rows sit in the paged cache; shared by every layer of a cache group."""

    positions: jax.Array  # [B, T] int32 RoPE position of each row (vc + depth for tree nodes)
    write_slots: jax.Array  # [B, T] int32 pool slot each row's K/V is written to
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
    return AttentionBatch(positions=positions.astype(jnp.int32), write_slots=slot_of(page_table, rows, page_size),
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
    slots = jnp.where(live, slot_of(page_table, jnp.maximum(positions, 0), page_size), SCRATCH_PAGE * page_size)
    b = page_table.shape[0]
    return AttentionBatch(positions=positions, write_slots=slots, page_table=page_table,
                          prefix_lengths=start.astype(jnp.int32), mask=jnp.zeros((b, chunk, 2), jnp.uint32),
                          mode="prefill")


def lanes_batch(page_table: jax.Array, frontier: jax.Array, positions: jax.Array, lane_mask: jax.Array,
                step: int, num_steps: int, page_size: int) -> AttentionBatch:
    """Draft step `step` (1..S-1): lane r writes slot frontier + (step-1)K + r, RoPE at `positions`."""
    k = positions.shape[1]
    rows = frontier.astype(jnp.int32)[:, None] + (step - 1) * k + jnp.arange(k, dtype=jnp.int32)[None, :]
    return AttentionBatch(positions=positions.astype(jnp.int32), write_slots=slot_of(page_table, rows, page_size),
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
    """Scatters `k, v [B, T, Hkv, D]` into pools `[S, Hkv, D]` at `slots [B, T]` (in place when donated)."""
    flat = slots.reshape(-1)
    k_pool = k_pool.at[flat].set(_to_pool(k.reshape((-1,) + k.shape[2:]), k_pool.dtype))
    v_pool = v_pool.at[flat].set(_to_pool(v.reshape((-1,) + v.shape[2:]), v_pool.dtype))
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
            return _prefill_attention(q, k_pool, v_pool, batch, self.page_size, scale).astype(q.dtype)
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


def _prefill_attention(q, k_pool, v_pool, batch: AttentionBatch, page_size: int, scale: float) -> jax.Array:
    """Causal attention by absolute position over the request's gathered pages, fp32."""
    b, t = q.shape[:2]
    total = batch.page_table.shape[1] * page_size
    key_pos = jnp.arange(total, dtype=jnp.int32)
    slots = slot_of(batch.page_table, jnp.broadcast_to(key_pos, (b, total)), page_size)
    k = k_pool[slots].astype(jnp.float32)
    v = v_pool[slots].astype(jnp.float32)
    visible = key_pos[None, None, :] <= batch.positions[:, :, None]
    out, _ = dense_attention_reference(q.astype(jnp.float32), k, v, visible, scale)
    return out
