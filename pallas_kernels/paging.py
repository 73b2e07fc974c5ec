"""Paged KV pool addressing, as every kernel and reference here reads it.

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
