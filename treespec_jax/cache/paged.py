"""Paged KV pool addressing.

Layout (one cache group, one layer): a pool is slot-major, `[num_pages * page_size, ...row]`
(GQA K and V: `[S, Hkv, D]`; MLA latent: `[S, kv_lora_rank + rope_dim]`). A request owns pages
listed in `page_table [B, max_pages] int32`; the token at position `pos` lives in slot
`page_table[b, pos // page_size] * page_size + pos % page_size`. One slot is one contiguous row,
so compaction moves whole rows and kernels view the pool as `[num_pages, page_size, ...]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def slot_of(page_table: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """`page_table [B, P]`, `positions [B, T] int32` -> slots `[B, T] int32`."""
    pages = jnp.take_along_axis(page_table, positions // page_size, axis=1)
    return pages * page_size + positions % page_size


def page_table_errors(page_table: jax.Array, lengths: jax.Array, *, extra: int, page_size: int,
                      num_pages: int) -> jax.Array:
    """`[B] bool`: request b's table fails to map a position below `lengths[b] + extra`.

    The kernels address the pool through `page_table[b, pos // page_size]` for every position
    they read (the committed prefix plus a verify or lane window of `extra` keys) and cannot tell
    a stale or unallocated entry from a real page, so the caller that hands out pages checks them:
    every needed entry must exist (the table is wide enough) and name a page in [0, num_pages).
    Works under jit (no host sync); `check_page_table` is the host-side refusal.
    """
    b, width = page_table.shape
    need = (lengths.astype(jnp.int32) + extra + page_size - 1) // page_size  # [B] pages needed
    cols = jnp.arange(width, dtype=jnp.int32)[None, :]
    used = cols < need[:, None]
    bad_entry = used & ((page_table < 0) | (page_table >= num_pages))
    return jnp.any(bad_entry, axis=1) | (need > width)


def check_page_table(page_table, lengths, *, extra: int, page_size: int, num_pages: int) -> None:
    """Host-side refusal naming every request whose table does not cover `lengths[b] + extra`."""
    import numpy as np

    table = np.asarray(page_table)
    lens = np.asarray(lengths)
    bad = np.flatnonzero(np.asarray(page_table_errors(jnp.asarray(table), jnp.asarray(lens), extra=extra,
                                                      page_size=page_size, num_pages=num_pages)))
    if bad.size == 0:
        return
    problems = []
    for b in bad:
        need = -(-(int(lens[b]) + extra) // page_size)
        if need > table.shape[1]:
            problems.append(f"request {b}: needs {need} pages for {int(lens[b])} + {extra} positions, "
                            f"table has {table.shape[1]} columns")
        else:
            entries = table[b, :need]
            wrong = np.flatnonzero((entries < 0) | (entries >= num_pages))
            problems.append(f"request {b}: entries {[(int(i), int(entries[i])) for i in wrong[:4]]} "
                            f"(column, page) outside [0, {num_pages})")
    raise ValueError("page table does not map every position the kernels read: " + "; ".join(problems))
