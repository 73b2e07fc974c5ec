"""Row moves inside a buffer: the primitive behind KV-row compaction and ReplaySSM payload packing.

`move_rows(buf, src_rows, dst_rows)` sets `buf[dst_rows[m]] = buf[src_rows[m]]` for every pair m
whose source is >= 0 and differs from its destination. The pairs come from an accepted path
(dst = depth d, src = path[d] >= d), so a sequential in-place pass in increasing d never reads a
row it already overwrote; the result equals "gather all sources, then scatter". Rows are moved as
raw words, so every dtype (bf16, FP8, fp32, int) moves the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import resolve_backend


def move_rows_reference(buf: jax.Array, src_rows: jax.Array, dst_rows: jax.Array) -> jax.Array:
    """Pure-jnp reference. `buf [S, ...]`, `src_rows/dst_rows [M] int32` -> `buf [S, ...]`."""
    live = (src_rows >= 0) & (src_rows != dst_rows)
    rows = buf[jnp.where(live, src_rows, 0)]
    # Dead pairs scatter out of bounds, which `mode="drop"` discards.
    dst = jnp.where(live, dst_rows, buf.shape[0])
    return buf.at[dst].set(rows, mode="drop")


def move_rows(buf: jax.Array, src_rows: jax.Array, dst_rows: jax.Array, *, backend: str | None = None) -> jax.Array:
    """Entry point; see module docstring. Shapes: `buf [S, ...]`, `src_rows/dst_rows [M] int32`."""
    kind = resolve_backend(backend)
    if kind == "reference":
        return move_rows_reference(buf, src_rows, dst_rows)
    # The Pallas kernel lands with the KV-compaction work; until then every backend is the reference.
    return move_rows_reference(buf, src_rows, dst_rows)
