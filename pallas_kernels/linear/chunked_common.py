"""What the GDN and Mamba2 chunked tree forms share: their fp32 product modes and the in-kernel
unpacking of the packed ancestor rows into a `[rows, rows]` tile."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Largest tree a chunked form takes: the packed ancestor row is two 32-bit words.
MAX_CHUNKED_NODES = 64

# fp32 products: "ieee" (exact fp32 on the FMA units) or "tf32x3" (three TF32 tensor-core passes,
# about fp32 accuracy; compiled runs only, the CPU has no TF32x3, so interpreted runs take "ieee").
FP32_DOTS = {"ieee": lax.Precision.HIGHEST, "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def load_ancestor_tile(mask_ref, b, rows: int, live):
    """Ancestor-or-self bits `[t, s]` of request b's first `rows` nodes from the packed
    `[B, T, 2] uint32` rows (`pallas_kernels.tree_masks`): bit s % 32 of word s // 32. Rows where
    `live [rows]` is False read as all zero. With rows <= 32 word 0 holds every column, so word 1
    is not loaded at all."""
    idx = jnp.arange(rows, dtype=jnp.int32)
    node_rows = pl.ds(0, rows)
    if rows <= 32:
        words = plgpu.load(mask_ref.at[b, node_rows, jnp.int32(0)], mask=live, other=0)[:, None]
    else:
        both = plgpu.load(mask_ref.at[b, node_rows, pl.ds(0, 2)], mask=live[:, None], other=0)  # [rows, 2]
        which = jnp.arange(2, dtype=jnp.int32)[None, :]
        word0 = jnp.sum(jnp.where(which == 0, both, 0), axis=1)
        word1 = jnp.sum(jnp.where(which == 1, both, 0), axis=1)
        words = jnp.where(idx[None, :] < 32, word0[:, None], word1[:, None])
    return ((words >> (idx[None, :] % 32).astype(jnp.uint32)) & 1) != 0


__all__ = ["FP32_DOTS", "MAX_CHUNKED_NODES", "load_ancestor_tile"]
