"""GDN chunked tree form: all nodes of a tree (T <= MAX_CHUNKED_NODES = 64) at once, no node states kept.

The ancestor mask replaces the causal mask of the chunked delta rule (see `gdn_chunked_reference`
for the math). Parents precede children, so M (strict ancestors) is strictly lower triangular and
(I + M) is inverted by log2(chunk) doubling products (M is nilpotent), then applied with one dot.
Rows are padded to `chunk = max(16, next power of two >= T)` (16, 32 or 64): Triton block shapes
must be powers of two and dot operands at least 16 wide. Padded rows (t >= T) have an all-zero mask
row: they are nobody's ancestor and are never stored. The packed ancestor row holds bits 0..31 in
word 0 and 32..63 in word 1 (`treespec_jax.tree.masks`); word 1 is read only when chunk > 32.

One program per (request b, value head hv, dv-tile): every dv column of the solve is independent,
so each program recomputes the small `[chunk, chunk]` matrices and handles `block_v` columns. The
program also writes the node's replay payload row pieces `[k | v | a | b]` as it reads them
(v and a/b by every value head, k by the first value head of each key head).

Public entry point: `gdn_chunked_verify(...)` with `backend=None|"pallas"|"interpret"|"reference"`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_backend
from pallas_kernels.linear.gdn_common import default_scale, gates, gdn_dims, l2_normalize
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_chunked_reference
from pallas_kernels.linear.gdn_tree import GdnKernelConfig, check_payload, pick_launch
from treespec_jax.tree.masks import unpack_mask_rows

# Largest tree the chunked form takes: the packed ancestor row is two 32-bit words.
MAX_CHUNKED_NODES = 64
# Fewest padded rows: a Triton dot needs every operand dim >= 16.
MIN_CHUNK = 16

# fp32 products: "ieee" (exact fp32 on the FMA units; the default) or "tf32x3" (three TF32
# tensor-core passes, about fp32 accuracy; compiled runs only, the CPU has no TF32x3).
FP32_DOTS = {"ieee": jax.lax.Precision.HIGHEST, "tf32x3": jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3}


def _dot_t(x, y, precision):
    """x @ y^T for 2-D tiles."""
    return jax.lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _dot(x, y, precision):
    return jnp.dot(x, y, precision=precision, preferred_element_type=jnp.float32)


def _chunked_kernel(mask_ref, slots_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref, dtb_ref,
                    pool_ref, _payload_in_ref, o_ref, payload_ref, *, nodes: int, chunk: int, group: int,
                    block_v: int, use_qk_l2norm: bool, scale: float, layout: GdnPayloadLayout, precision):
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    kh = hv // group
    cols = pl.ds(vt * block_v, block_v)
    rows = jnp.arange(chunk, dtype=jnp.int32)
    live = rows < nodes
    node_rows = pl.ds(0, chunk)

    # Ancestor-or-self bits [t, s]: bit s % 32 of word s // 32. With chunk <= 32 word 0 holds every
    # column, so word 1 is not loaded at all.
    if chunk <= 32:
        words = plgpu.load(mask_ref.at[b, node_rows, jnp.int32(0)], mask=live, other=0)[:, None]
    else:
        both = plgpu.load(mask_ref.at[b, node_rows, pl.ds(0, 2)], mask=live[:, None], other=0)  # [chunk, 2]
        which = jnp.arange(2, dtype=jnp.int32)[None, :]
        word0 = jnp.sum(jnp.where(which == 0, both, 0), axis=1)
        word1 = jnp.sum(jnp.where(which == 1, both, 0), axis=1)
        words = jnp.where(rows[None, :] < 32, word0[:, None], word1[:, None])  # [t, s]
    anc = ((words >> (rows[None, :] % 32).astype(jnp.uint32)) & 1) != 0  # [t, s]
    k_raw = plgpu.load(k_ref.at[b, node_rows, kh, :], mask=live[:, None], other=0)
    q_raw = plgpu.load(q_ref.at[b, node_rows, kh, :], mask=live[:, None], other=0)
    v_raw = plgpu.load(v_ref.at[b, node_rows, hv, cols], mask=live[:, None], other=0)
    a_raw = plgpu.load(a_ref.at[b, node_rows, hv], mask=live, other=0)
    b_raw = plgpu.load(b_ref.at[b, node_rows, hv], mask=live, other=0)

    k = k_raw.astype(jnp.float32)
    q = q_raw.astype(jnp.float32)
    if use_qk_l2norm:
        k, q = l2_normalize(k), l2_normalize(q)
    q = q * scale
    g, beta = gates(a_raw, b_raw, alog_ref[hv], dtb_ref[hv])
    g = jnp.where(live, g, 0.0)
    big_g = jnp.sum(jnp.where(anc, g[None, :], 0.0), axis=1)  # log-decay from the root to t
    # G_t - G_s <= 0 on ancestor pairs (g <= 0); the min keeps masked pairs from overflowing.
    decay_ts = jnp.where(anc, jnp.exp(jnp.minimum(big_g[:, None] - big_g[None, :], 0.0)), 0.0)
    strict = anc & (rows[:, None] != rows[None, :])
    m = jnp.where(strict, beta[:, None] * decay_ts * _dot_t(k, k, precision), 0.0)

    # (I + M)^-1 without a serial substitution: M is strictly lower triangular, so M^chunk = 0 and
    # (I + M)^-1 = sum_{j < chunk} (-M)^j = prod_{i < log2(chunk)} (I + (-M)^(2^i)). That is
    # 2 (log2(chunk) - 1) tensor-core dots instead of `chunk` dependent row reductions.
    eye = (rows[:, None] == rows[None, :]).astype(jnp.float32)
    power = -m
    inv = eye + power
    for _ in range(chunk.bit_length() - 2):
        power = _dot(power, power, precision)
        inv = inv + _dot(inv, power, precision)

    h0 = pool_ref[slots_ref[b], hv, :, cols].astype(jnp.float32)  # [dk, block_v]
    decay = jnp.exp(big_g)[:, None]
    rhs = beta[:, None] * (v_raw.astype(jnp.float32) - decay * _dot(k, h0, precision))
    u = _dot(inv, rhs, precision)
    out = decay * _dot(q, h0, precision) + _dot(decay_ts * _dot_t(q, k, precision), u, precision)
    plgpu.store(o_ref.at[b, node_rows, hv, cols], out.astype(o_ref.dtype), mask=live[:, None])

    dv = v_ref.shape[-1]
    plgpu.store(payload_ref.at[b, node_rows, pl.ds(layout.v_offset + hv * dv + vt * block_v, block_v)],
                v_raw, mask=live[:, None])

    @pl.when(vt == 0)
    def _():
        plgpu.store(payload_ref.at[b, node_rows, layout.a_offset + hv], a_raw, mask=live)
        plgpu.store(payload_ref.at[b, node_rows, layout.b_offset + hv], b_raw, mask=live)

    @pl.when((vt == 0) & (hv % group == 0))
    def _():
        dk = k_ref.shape[-1]
        plgpu.store(payload_ref.at[b, node_rows, pl.ds(kh * dk, dk)], k_raw, mask=live[:, None])


def gdn_chunked_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, ancestor_mask, payload,
                       *, use_qk_l2norm: bool = True, scale: float | None = None,
                       config: GdnKernelConfig | None = None, fp32_dots: str = "ieee",
                       backend: str | None = None):
    """Chunked GDN verify of a tree with T <= MAX_CHUNKED_NODES (64) nodes. Shapes in `gdn_common`.

    ancestor_mask: `[B, T, 2] uint32` packed ancestor-or-self rows (`tree.masks.ancestor_mask`),
    node order with parents before children. payload: `[B, T, width]` buffer for the replay payload
    rows, written in place. Returns `(out [B, T, HV, dv], payload)`. The committed pool is only read.
    `fp32_dots`: "ieee" or "tf32x3" (see FP32_DOTS).
    """
    if fp32_dots not in FP32_DOTS:
        raise ValueError(f"gdn_chunked_verify: fp32_dots must be one of {tuple(FP32_DOTS)}, got {fp32_dots!r}")
    dims = gdn_dims(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots)
    if dims.nodes > MAX_CHUNKED_NODES:
        raise ValueError(f"the chunked GDN form covers at most {MAX_CHUNKED_NODES} nodes, got T={dims.nodes}")
    if ancestor_mask.shape != (dims.batch, dims.nodes, 2) or ancestor_mask.dtype != jnp.uint32:
        raise ValueError(f"ancestor_mask must be uint32 [B, T, 2] = {(dims.batch, dims.nodes, 2)}; got "
                         f"{ancestor_mask.dtype} {ancestor_mask.shape}")
    layout = check_payload(dims, payload, k, v, a, b)
    scale = default_scale(dims.head_k_dim) if scale is None else float(scale)
    kind = resolve_backend(backend)
    if kind == "reference":
        anc = unpack_mask_rows(ancestor_mask, dims.nodes)
        out, _ = gdn_chunked_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, anc,
                                       use_qk_l2norm=use_qk_l2norm, scale=scale)
        return out.astype(v.dtype), pack_payload(k, v, a, b)
    block_v, num_warps, num_stages = pick_launch(dims, config, chunked=True)
    chunk = max(MIN_CHUNK, next_pow2(dims.nodes))
    kernel = functools.partial(_chunked_kernel, nodes=dims.nodes, chunk=chunk, group=dims.group, block_v=block_v,
                               use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout,
                               precision=FP32_DOTS["ieee" if kind == "interpret" else fp32_dots])
    out, payload = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(payload.shape, payload.dtype)),
        grid=(dims.batch, dims.num_v_heads, dims.head_v_dim // block_v),
        input_output_aliases={10: 1},
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_chunked_verify",
    )(ancestor_mask, state_slots.astype(jnp.int32), q, k, v, a, b, A_log.astype(jnp.float32),
      dt_bias.astype(jnp.float32), state_pool, payload)
    return out, payload
