"""Paged KV pool addressing on the cache side: the layout and `slot_of` are the kernels'
(`pallas_kernels.paging`); here the checks that a page table maps every position the kernels read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.paging import slot_of

__all__ = ["check_page_table", "page_table_errors", "slot_of"]


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
