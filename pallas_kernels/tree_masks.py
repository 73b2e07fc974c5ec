"""Ancestor masks of draft trees, in the packed form the attention and linear-attention kernels read.

A tree of N <= MAX_TREE_NODES = 64 nodes is given by `parents [B, N] int32` with parents[:, 0] = -1 and
0 <= parents[b, j] < j. Row i of the ancestor mask has bit j set iff node j is node i or one of
its ancestors. JAX runs with x64 off, so the 64-bit row is packed as two uint32 words:
word 0 holds bits 0..31, word 1 bits 32..63 (`[B, N, 2] uint32`). Attention and linear-attention
kernels read exactly this packed form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Nodes of one draft tree, and bits of one packed mask row (two uint32 words): every kernel's bound.
MAX_TREE_NODES = 64


def _closure(parents: jax.Array) -> jax.Array:
    """Reflexive-transitive closure of the child->parent relation, `[B, N, N] bool`."""
    n = parents.shape[-1]
    if n > MAX_TREE_NODES:
        raise ValueError(f"trees hold at most {MAX_TREE_NODES} nodes, got N={n}")
    eye = jnp.eye(n, dtype=jnp.int32)
    step = jax.nn.one_hot(parents, n, dtype=jnp.int32)  # parent -1 gives an all-zero row
    reach = jnp.broadcast_to(eye, step.shape) | step
    # Path lengths double per squaring; 6 squarings cover depth 63.
    for _ in range(max(1, (n - 1).bit_length())):
        reach = (jnp.einsum("bij,bjk->bik", reach, reach) > 0).astype(jnp.int32)
    return reach.astype(bool)


def ancestor_mask_bool(parents: jax.Array) -> jax.Array:
    """`[B, N] int32 -> [B, N, N] bool`; [b, i, j] iff j is i or an ancestor of i."""
    return _closure(parents)


def pack_mask_rows(rows: jax.Array) -> jax.Array:
    """`[..., W] bool` (W <= 64) -> `[..., 2] uint32` (bit j of the 64-bit row)."""
    w = rows.shape[-1]
    if w > MAX_TREE_NODES:
        raise ValueError(f"mask rows hold at most {MAX_TREE_NODES} bits, got {w}")
    pad = jnp.zeros(rows.shape[:-1] + (MAX_TREE_NODES - w,), bool)
    bits = jnp.concatenate([rows, pad], axis=-1).astype(jnp.uint32)
    bits = bits.reshape(rows.shape[:-1] + (2, 32))
    weights = jnp.left_shift(jnp.uint32(1), jnp.arange(32, dtype=jnp.uint32))
    return jnp.sum(bits * weights, axis=-1, dtype=jnp.uint32)


def unpack_mask_rows(packed: jax.Array, width: int) -> jax.Array:
    """`[..., 2] uint32 -> [..., width] bool`, the inverse of `pack_mask_rows`."""
    shifts = jnp.arange(32, dtype=jnp.uint32)
    bits = (packed[..., :, None] >> shifts) & jnp.uint32(1)
    return bits.reshape(packed.shape[:-1] + (64,))[..., :width].astype(bool)


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """`[B, N] int32 -> [B, N, 2] uint32` packed ancestor-or-self rows."""
    return pack_mask_rows(_closure(parents))


def depths(parents: jax.Array) -> jax.Array:
    """`[B, N] int32 -> [B, N] int32`: number of strict ancestors (root depth 0)."""
    return jnp.sum(_closure(parents), axis=-1, dtype=jnp.int32) - 1


def chain_parents(batch: int, n: int) -> jax.Array:
    """The chain `parents[i] = i - 1` as `[batch, n] int32`."""
    return jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32) - 1, (batch, n))
