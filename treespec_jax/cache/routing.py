"""KV row compaction after verify: the router that moves the accepted path's rows.

After a verify over a window of N rows at positions vc .. vc + N - 1, row d of the accepted path is
the node `path[b, d]` (path[b, 0] = 0, path strictly increasing, -1 past the accepted length).
Compaction makes the window look like a chain: row d <- row path[d] wherever path[d] >= 0 and
path[d] != d, in every attention layer's key and value buffers (MLA: the latent buffer, whose value
is a view of the same row, so the value moves with it).

The router owns each cache group's buffer table: the physical buffers of the group's layers, each
listed once even when several layers (or a layer's key and value view) name it, so every buffer is
moved exactly once per group. Each group addresses its own verify window: the slot of position
vc + d through the group's page table and page size. Moves go through `pallas_kernels.row_move`
(raw words, any dtype, in place via input/output aliasing; donate the pools at the jit boundary).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels.row_move import move_rows
from treespec_jax.cache.paged import slot_of
from treespec_jax.cache.pools import CacheGroupSpec, check_page_table, check_pools, validate_groups


def window_move_pairs(path: jax.Array, window_start: jax.Array, page_table: jax.Array,
                      page_size: int) -> tuple[jax.Array, jax.Array]:
    """Slot pairs of one group's verify window.

    `path [B, N] int32`, `window_start [B] int32` (vc, the position of window row 0),
    `page_table [B, max_pages] int32` -> `(src_slots, dst_slots)`, each `[B, N] int32`; src is -1
    for pairs that do not move (path -1 or path[d] == d), so no page-table lookup of them matters.
    """
    n = path.shape[1]
    depth = jnp.arange(n, dtype=jnp.int32)[None, :]
    live = (path >= 0) & (path != depth)
    vc = window_start.astype(jnp.int32)[:, None]
    # Dead pairs look up position vc (always inside the window's pages) and are then dropped.
    dst = slot_of(page_table, jnp.where(live, vc + depth, vc), page_size)
    src = slot_of(page_table, jnp.where(live, vc + path, vc), page_size)
    return jnp.where(live, src, -1), dst


class CompactionRouter:
    """Per-group buffer tables for `compact_window_rows`; built once from the static group specs."""

    def __init__(self, groups: Sequence[CacheGroupSpec]):
        groups = tuple(groups)
        validate_groups(groups)
        self.groups = groups
        tables = {}
        for g in groups:
            seen: list[str] = []
            for layer in g.layers:
                for buf in layer.buffers:
                    if buf not in seen:
                        seen.append(buf)
            tables[g.name] = tuple(seen)
        self._tables = tables

    def buffer_table(self, group: str) -> tuple[str, ...]:
        """Physical buffers the group's attention layers touch, each once, in first-use order."""
        if group not in self._tables:
            raise KeyError(f"unknown cache group {group!r}; groups: {sorted(self._tables)}")
        return self._tables[group]

    def compact(self, pools: Mapping[str, jax.Array], page_tables: Mapping[str, jax.Array],
                window_start: jax.Array | Mapping[str, jax.Array], path: jax.Array, *,
                backend: str | None = None) -> dict[str, jax.Array]:
        """See `compact_window_rows`."""
        check_pools(self.groups, pools)
        if path.ndim != 2 or not jnp.issubdtype(path.dtype, jnp.integer):
            raise ValueError(f"path must be [B, N] int32, got {path.dtype}{list(path.shape)}")
        batch = path.shape[0]
        out = dict(pools)
        for g in self.groups:
            if g.name not in page_tables:
                raise ValueError(f"no page table for cache group {g.name!r}")
            table = page_tables[g.name]
            check_page_table(table, batch, name=f"page_tables[{g.name!r}]")
            start = window_start[g.name] if isinstance(window_start, Mapping) else window_start
            if start.shape != (batch,):
                raise ValueError(f"window_start for group {g.name!r} must be [B={batch}], got {list(start.shape)}")
            src, dst = window_move_pairs(path.astype(jnp.int32), start, table, g.page_size)
            for name in self.buffer_table(g.name):
                # One group of pairs per request: requests own disjoint pages, so they move in parallel.
                out[name] = move_rows(out[name], src, dst, backend=backend)
        return out


def compact_window_rows(router: CompactionRouter, pools: Mapping[str, jax.Array],
                        page_tables: Mapping[str, jax.Array], window_start: jax.Array | Mapping[str, jax.Array],
                        path: jax.Array, *, backend: str | None = None) -> dict[str, jax.Array]:
    """Moves the accepted path's KV rows to the verify window's leading slots, in every buffer.

    pools: `{name: [S, ...row]}` for every buffer of every group (others pass through untouched).
    page_tables: `{group: [B, max_pages] int32}`. window_start: `[B] int32` shared by all groups,
    or `{group: [B]}` when groups place the window at different positions. path: `[B, N] int32`
    accepted path (path[d] >= d, strictly increasing, -1 padded). Returns the updated pools; every
    slot other than the moved destinations is bitwise unchanged. Jit with the pools donated for an
    in-place update.
    """
    return router.compact(pools, page_tables, window_start, path, backend=backend)
