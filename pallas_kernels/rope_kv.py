"""RoPE of the fused q/k/v projections and the K/V write into the paged pools, in one kernel.

`rope_write_kv(qkv, positions, slots, k_pool, v_pool, inv_freq)` takes a layer's fused projections
`qkv [B, T, Hkv * (rep + 2) * D]` in the grouped column order of `models.llama.fuse_layer` (per KV
head g: its rep query heads, then k_g, then v_g) and returns `(q, k_pool, v_pool)`: the query heads
`[B, T, Hq, D]` rotated (rotate-half RoPE at `positions [B, T]`), and the pools `[S, Hkv, D]` with
row `slots[b, t]` holding that token's rotated key and its value. Rows whose slot is outside the
pool, [0, S) (`models.attention.NO_SLOT`), write nothing. Numerics of `models.llama.apply_rope` and
`models.attention.write_kv`: angles, cos, sin and the rotation in fp32, rounded to the input's
dtype, then to the pool's.

Why a kernel: at decode XLA runs the split, the two rotations and the two scatters as separate
launches of about 1.2-1.9 us each for a few hundred bytes (the 8B-shaped step at batch 1: about
170 us a step; results: norm-kernel). Here one program a (token, KV head) does them all.

Pallas kernel: grid (B * T, Hkv); a program loads its group's heads by halves (rotate-half pairs
column i with i + D/2), so D must be a power of two. The pools are updated in place through
`input_output_aliases`: donate them at the jit boundary. 16- and 32-bit pools only (FP8 pools
saturate on the way in; that path stays in XLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_backend

POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def kernel_problems(qkv_width: int, num_kv_heads: int, head_dim: int, pool_dtype) -> list[str]:
    """Why the kernel cannot take these shapes (empty: it can)."""
    out = []
    if head_dim < 2 or head_dim & (head_dim - 1):
        out.append(f"head_dim {head_dim} is not a power of two >= 2")
    if qkv_width % (num_kv_heads * head_dim) or qkv_width // (num_kv_heads * head_dim) < 3:
        out.append(f"qkv width {qkv_width} is not Hkv={num_kv_heads} groups of (rep + 2) x D={head_dim}")
    if jnp.dtype(pool_dtype) not in POOL_DTYPES:
        out.append(f"pool dtype {jnp.dtype(pool_dtype)} is not 16- or 32-bit float")
    return out


def _check_args(qkv, positions, slots, k_pool, v_pool, inv_freq) -> tuple[int, int]:
    """-> (rep, D)."""
    if qkv.ndim != 3 or positions.shape != qkv.shape[:2] or slots.shape != qkv.shape[:2]:
        raise ValueError(f"qkv must be [B, T, W] with positions and slots [B, T]; got {qkv.shape}, "
                         f"{positions.shape}, {slots.shape}")
    if k_pool.ndim != 3 or k_pool.shape != v_pool.shape or k_pool.dtype != v_pool.dtype:
        raise ValueError(f"k_pool and v_pool must be one [S, Hkv, D] shape and dtype, got {k_pool.shape} "
                         f"{k_pool.dtype}, {v_pool.shape} {v_pool.dtype}")
    _, hkv, d = k_pool.shape
    if np.shape(inv_freq) != (d // 2,):
        raise ValueError(f"inv_freq must be [D/2] = ({d // 2},), got {np.shape(inv_freq)}")
    problems = kernel_problems(qkv.shape[-1], hkv, d, k_pool.dtype)
    if problems:
        raise ValueError("rope_write_kv: " + "; ".join(problems))
    return qkv.shape[-1] // (hkv * d) - 2, d


def rope_write_kv_reference(qkv, positions, slots, k_pool, v_pool, inv_freq):
    """Pure-jnp reference (the model's XLA path): split, rotate, scatter with out-of-pool rows
    dropped. Shapes as `rope_write_kv`."""
    rep, d = _check_args(qkv, positions, slots, k_pool, v_pool, inv_freq)
    b, t, _ = qkv.shape
    hkv = k_pool.shape[1]
    grouped = qkv.reshape(b, t, hkv, rep + 2, d)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]

    def rotate(x):
        x1, x2 = x[..., :d // 2].astype(jnp.float32), x[..., d // 2:].astype(jnp.float32)
        return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)

    q = rotate(grouped[:, :, :, :rep].reshape(b, t, hkv * rep, d))
    k, v = rotate(grouped[:, :, :, rep]), grouped[:, :, :, rep + 1]
    flat = slots.reshape(-1)
    k_pool = k_pool.at[flat].set(k.reshape(-1, hkv, d).astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[flat].set(v.reshape(-1, hkv, d).astype(v_pool.dtype), mode="drop")
    return q, k_pool, v_pool


def _kernel(qkv_ref, pos_ref, slot_ref, freq_ref, k_in, v_in, q_ref, k_ref, v_ref, *, rep: int, d: int,
            slots_in_pool: int):
    """Program (row r of B * T, KV head g). k_ref / v_ref alias k_in / v_in."""
    del k_in, v_in
    r, g = pl.program_id(0), pl.program_id(1)
    half = d // 2
    group = g * (rep + 2) * d
    ang = plgpu.load(pos_ref.at[r]).astype(jnp.float32) * plgpu.load(freq_ref.at[pl.ds(0, half)])
    cos, sin = jnp.cos(ang), jnp.sin(ang)

    def rotated(col):  # the head at column `col` of the row, rotated -> two [D/2] halves
        x1 = plgpu.load(qkv_ref.at[r, pl.ds(col, half)]).astype(jnp.float32)
        x2 = plgpu.load(qkv_ref.at[r, pl.ds(col + half, half)]).astype(jnp.float32)
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    for h in range(rep):  # static: rep query heads share the group's KV head
        lo, hi = rotated(group + h * d)
        plgpu.store(q_ref.at[r, g * rep + h, pl.ds(0, half)], lo.astype(q_ref.dtype))
        plgpu.store(q_ref.at[r, g * rep + h, pl.ds(half, half)], hi.astype(q_ref.dtype))
    # Keys are rounded to the projections' dtype first, as the XLA path rotates in that dtype.
    dtype = qkv_ref.dtype
    lo, hi = rotated(group + rep * d)
    slot = plgpu.load(slot_ref.at[r])
    live = (slot >= 0) & (slot < slots_in_pool)
    row = jnp.where(live, slot, 0)
    keep = jnp.full((half,), live)
    plgpu.store(k_ref.at[row, g, pl.ds(0, half)], lo.astype(dtype).astype(k_ref.dtype), mask=keep)
    plgpu.store(k_ref.at[row, g, pl.ds(half, half)], hi.astype(dtype).astype(k_ref.dtype), mask=keep)
    for part in range(2):
        value = plgpu.load(qkv_ref.at[r, pl.ds(group + (rep + 1) * d + part * half, half)])
        plgpu.store(v_ref.at[row, g, pl.ds(part * half, half)], value.astype(v_ref.dtype), mask=keep)


def _rope_write_kv_pallas(qkv, positions, slots, k_pool, v_pool, inv_freq, *, interpret: bool):
    rep, d = _check_args(qkv, positions, slots, k_pool, v_pool, inv_freq)
    b, t, width = qkv.shape
    s, hkv, _ = k_pool.shape
    rows = qkv.reshape(b * t, width)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    q, k_pool, v_pool = pl.pallas_call(
        functools.partial(_kernel, rep=rep, d=d, slots_in_pool=s),
        out_shape=[jax.ShapeDtypeStruct((b * t, hkv * rep, d), qkv.dtype),
                   jax.ShapeDtypeStruct(k_pool.shape, k_pool.dtype),
                   jax.ShapeDtypeStruct(v_pool.shape, v_pool.dtype)],
        grid=(b * t, hkv),
        in_specs=[any_spec] * 6,
        out_specs=[any_spec] * 3,
        input_output_aliases={4: 1, 5: 2},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        name="rope_write_kv",
    )(rows, positions.reshape(-1).astype(jnp.int32), slots.reshape(-1).astype(jnp.int32),
      jnp.asarray(inv_freq, jnp.float32), k_pool, v_pool)
    return q.reshape(b, t, hkv * rep, d), k_pool, v_pool


def rope_write_kv(qkv: jax.Array, positions: jax.Array, slots: jax.Array, k_pool: jax.Array, v_pool: jax.Array,
                  inv_freq, *, backend: str | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Entry point; see module docstring. `qkv [B, T, Hkv * (rep + 2) * D]`, `positions, slots
    [B, T] int32`, pools `[S, Hkv, D]`, `inv_freq [D/2]` -> (q `[B, T, Hq, D]`, k_pool, v_pool)."""
    kind = resolve_backend(backend)
    if kind == "reference":
        return rope_write_kv_reference(qkv, positions, slots, k_pool, v_pool, inv_freq)
    return _rope_write_kv_pallas(qkv, positions, slots, k_pool, v_pool, inv_freq, interpret=(kind == "interpret"))
