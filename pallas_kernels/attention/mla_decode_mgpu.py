"""The MLA latent prefix decode on Mosaic GPU (wgmma + TMA): the default on GPUs.

Status (2026-11-30): compiled and run on the H200. Compiled conformance passes
(`benchmarks/mgpu_prefix_check.py --mla`); at DeepSeek-V3 widths (B=32, P=8192, N=16, 128 heads)
it took 2.54 ms against the Triton latent decode's 4.26 ms, and its cascade 3.01 ms against 4.53
ms (XLA's dense einsum over gathered rows: 3.69 ms), so `MlaCascadeConfig(prefix_kernel="auto")`
takes it wherever `mla_mgpu_input_errors` is empty. On the CPU its logic runs in Pallas' GPU
interpreter against the fp32 reference (`tests/test_mla_decode_mgpu.py`); interpreted runs add P V
with a plain dot where the compiled kernel uses wgmma (the interpreter has no rule for the
accumulator `run_state` idiom). The compiled path also lowers on the CPU (layout inference and the
shared-memory check; that lowering caught a 32-key step, below wgmma's K of 64, and an over-budget
output tile).

FP8 E4M3 caches (compiled conformance passes on the H200, and the cascade's "auto" takes this
kernel for them: 3.00 ms against 12.31 ms through the Triton decode at B=32, P=8k, N=16): q arrives quantised to FP8 (the cascade's
`quantize_absorbed_query`) and the scores are an FP8 x FP8 wgmma (the latent rows are its K-major
operand). The value channels are the MN-major operand of P V, which 8-bit wgmma cannot take, so
each warpgroup widens its half of them to an fp16 tile of its own (exact), releases the FP8 ring
buffer, and runs P V in fp16. `share_scores` is refused with FP8.

Why: the Pallas Triton latent decode runs at about 35% of the H200's bf16 rate and its cascade
(4.5 ms at B=32, P=8192, N=16, 128 heads) is slower than XLA's dense einsum over gathered rows
(3.7 ms, benchmarks/RESULTS.md). A 64-row fp32 accumulator over all 512 latent value channels does
not fit one warpgroup's registers, which caps the Triton tiles.

Contract (as `mla_decode.mla_decode`, whole pages only, like `prefix_decode_mgpu`):
    q [B, R, Hq, L + Dr] (16-bit; flat row r * Hq + h), latent_pool [S, L + Dr] (same dtype),
    page_table [B, maxp] int32, prefix_len [B] int32 (P)
    -> out [B, R, Hq, L] f32, lse2 [B, R, Hq] f32 (base 2)
Row r sees keys [0, min(P - R + 1 + r, (P // page_size) * page_size)); the tree window kernel
(`prefix_whole_pages=True`) covers the rest of the prefix. The value is each key row's first L
channels.

One CTA per (64-row tile, key split, request): the memory warpgroup TMA-copies the query tile once
and `block_k` latent rows per step (a page slice found through the page table) into a ring of
`stages` buffers. Both compute warpgroups score the same 64 rows against the whole row (latent +
rope) and run the same online softmax, and each accumulates half of the L value channels, so an
accumulator is [64, L / 2] fp32. By default the score matmul is done twice (1.5x the useful
FLOPs at L = 512, Dr = 64) in exchange for no exchange between warpgroups; `share_scores=True`
lets warpgroup 0 alone score and hand P and the rescale factors to warpgroup 1 through shared
memory (double-buffered), so the tensor cores do only the useful work. Which is faster is for
the GPU check to say.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.prefix_decode import default_num_splits, merge_splits
from pallas_kernels.attention.prefix_decode_mgpu import (_smem_transforms, cta_key_blocks, grid_in_order,
                                                         online_softmax_update, whole_page_bound)

LOG2E = math.log2(math.e)
F8 = jnp.dtype(jnp.float8_e4m3fn)
ROWS = 64  # query rows per CTA (one wgmma M tile)
OUT_CHUNK = 16  # value columns per output copy (the fp32 staging tile is [ROWS, OUT_CHUNK])
# Dynamic shared memory per block on Hopper (H100/H200), and what Mosaic GPU adds to our buffers
# (swizzle alignment, barriers): at L + Dr = 576 it reported 2.9 KB over the buffers' sum.
MAX_SMEM_BYTES = 232448
SMEM_OVERHEAD = 4096


def smem_bytes(width: int, itemsize: int, block_k: int, stages: int, share_scores: bool,
               kv_lora_rank: int = 0) -> int:
    """Shared memory the kernel allocates: query tile, latent ring, output staging, P exchange; with
    1-byte (FP8) rows also the fp16 value rows both warpgroups widen (`kv_lora_rank` channels)."""
    total = (ROWS * width * itemsize + stages * block_k * width * itemsize + ROWS * OUT_CHUNK * 4 + ROWS * 4
             + SMEM_OVERHEAD)
    if itemsize == 1:
        total += block_k * kv_lora_rank * 2
    if share_scores:
        total += 2 * ROWS * block_k * itemsize + 2 * ROWS * 4 + ROWS * 4
    return total


def mla_mgpu_input_errors(q, latent_pool, kv_lora_rank: int, page_size: int, block_k: int) -> list[str]:
    """Every reason this kernel cannot take these inputs (empty: it can). Arrays or ShapeDtypeStructs."""
    c = q.shape[-1]
    errors = []
    if latent_pool.ndim != 2 or latent_pool.shape[1] != c:
        errors.append(f"mla_decode_mgpu: latent_pool must be [S, {c}], got {latent_pool.shape}")
    if c % 64 or kv_lora_rank % 128 or not 0 < kv_lora_rank < c:
        errors.append(f"mla_decode_mgpu: row width {c} must be a multiple of 64 and kv_lora_rank "
                      f"{kv_lora_rank} a multiple of 128 below it")
    if block_k % 64 or page_size % block_k:
        # The P V product's contraction runs over the step's keys: a wgmma K of 64 at least.
        errors.append(f"mla_decode_mgpu: block_k must be a multiple of 64 dividing page_size {page_size}, "
                      f"got {block_k}")
    dtypes = {jnp.dtype(q.dtype), jnp.dtype(latent_pool.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), F8):
        errors.append(f"mla_decode_mgpu: q and the latent pool must share one dtype of bfloat16, float16 or "
                      f"float8_e4m3fn (an FP8 cache takes the query quantised to FP8), got "
                      f"{q.dtype}, {latent_pool.dtype}")
    return errors


def check_mla_mgpu_inputs(q, latent_pool, kv_lora_rank: int, page_size: int, block_k: int):
    """Shapes this kernel takes; raises naming every unsupported value."""
    errors = mla_mgpu_input_errors(q, latent_pool, kv_lora_rank, page_size, block_k)
    if errors:
        raise ValueError("; ".join(errors))


@functools.partial(jax.jit, static_argnames=("kv_lora_rank", "page_size", "scale", "block_k", "stages",
                                             "num_splits", "share_scores", "tiles_adjacent", "interpret"))
def mla_decode_mgpu(q, latent_pool, page_table, prefix_len, *, kv_lora_rank: int, page_size: int, scale: float,
                    block_k: int = 64, stages: int = 2, num_splits: int | None = None,
                    share_scores: bool = False, tiles_adjacent: bool = True, interpret: bool = False):
    """See the module docstring. `block_k` keys per step (a multiple of 64: the P V contraction).
    At L + Dr = 576 the query tile and two 64-key latent buffers take 216 KiB of the 227 KiB of
    shared memory, so the output leaves in [64, 16] fp32 pieces and `share_scores` does not fit. `share_scores`: warpgroup 0
    alone scores and runs the softmax and hands P and the rescale factors to warpgroup 1 through
    shared memory (no duplicated score matmul; warpgroup 1 waits on warpgroup 0 each step).
    `tiles_adjacent`: launch the row tiles of one (request, split), which read the same latent
    pages, next to each other (Mosaic GPU runs the grid's last axis fastest; the grid in the order
    (tiles, splits, batch) puts them B CTAs apart, so each latent page is read from HBM once per
    tile). On the H200 at B=32, P=8192, N=16, 128 heads, side by side took 2.677 vs 2.819 ms (bf16)
    and 2.667 vs 2.705 ms (FP8) (session 11, benchmarks/RESULTS.md), so it is the default."""
    check_mla_mgpu_inputs(q, latent_pool, kv_lora_rank, page_size, block_k)
    if stages < 2:
        raise ValueError(f"mla_decode_mgpu: stages must be >= 2, got {stages}")
    # Under an FP8 cache the scores are an FP8 x FP8 wgmma (the latent rows are its K-major
    # operand); the value channels are the MN-major operand of P V, which 8-bit wgmma cannot take,
    # so each warpgroup widens its half of the step's value channels to fp16 in shared memory.
    fp8 = jnp.dtype(q.dtype) == F8
    if fp8 and share_scores:
        raise ValueError("mla_decode_mgpu: share_scores takes 16-bit caches only, got float8_e4m3fn")
    b, r, hq, c = q.shape
    need = smem_bytes(c, q.dtype.itemsize, block_k, stages, share_scores, kv_lora_rank)
    if need > MAX_SMEM_BYTES:
        raise ValueError(f"mla_decode_mgpu: block_k={block_k}, stages={stages}, share_scores={share_scores} at "
                         f"row width {c} need {need} bytes of shared memory, more than {MAX_SMEM_BYTES}")
    dtype = q.dtype
    pv_dtype = jnp.float16 if fp8 else dtype  # P V operands: FP8 rows widen exactly to fp16
    half = kv_lora_rank // 2
    rows = r * hq
    rows_pad = -(-rows // ROWS) * ROWS
    tiles = rows_pad // ROWS
    max_blocks = page_table.shape[1] * (page_size // block_k)
    splits = num_splits or default_num_splits(b, 1, tiles, max_blocks)
    blocks_per_split = -(-max_blocks // splits)
    scale2 = float(scale) * LOG2E
    qf = jnp.pad(q.reshape(b, rows, c), ((0, 0), (0, rows_pad - rows), (0, 0)))

    def body(q_gmem, lat_gmem, pt_gmem, len_gmem, out_gmem, lse_gmem, scoped):
        (q_smem, kv_smem, o_smem, lse_smem, p_smem, alpha_smem, l_smem, wide_smem), \
            (q_ready, kv_ready, kv_free, o_free, p_ready, p_free, l_ready) = scoped
        tile = lax.axis_index("tiles")
        split = lax.axis_index("splits")
        bi = lax.axis_index("batch")
        wg = lax.axis_index("wg")
        length = len_gmem[bi]
        row0 = tile * ROWS
        whole, lo, hi = cta_key_blocks(length, page_size, r, hq, row0, ROWS, block_k, split, blocks_per_split)

        def compute(w: int):
            plgpu.set_max_registers(232, action="increase")
            plgpu.barrier_wait(q_ready)
            shape = (ROWS, block_k)
            row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + row0
            col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
            row_hi = whole_page_bound(length, r, hq, row, whole)
            first_hi = jnp.maximum(whole_page_bound(length, r, hq, row0, whole), 0)
            open_end = jnp.clip(lax.div(first_hi, jnp.int32(block_k)), lo, hi)
            cols = pl.ds(w * half, half)  # this warpgroup's value channels (static)

            def value_tile(slot):
                """This warpgroup's value channels of the step: the latent rows themselves, or
                under FP8 their fp16 copy (widened here; the FP8 buffer may be released after)."""
                if not fp8:
                    return kv_smem.at[slot].at[:, cols]
                wide = wide_smem[w]
                wide[...] = kv_smem.at[slot].at[:, cols][...].astype(pv_dtype)
                plgpu.commit_smem()
                return wide

            def add_values(acc, p_operand, v_tile):
                """acc + P V[:, this warpgroup's half]; P in registers or a shared-memory ref."""
                if interpret:
                    # No interpreter rule for run_state: same acc + P V through a plain dot.
                    pv = p_operand if isinstance(p_operand, jax.Array) else p_operand[...]
                    return acc + jnp.dot(pv.astype(pv_dtype), v_tile[...], preferred_element_type=jnp.float32)

                def values(acc_ref):
                    plgpu.wgmma(acc_ref, p_operand, v_tile)

                return pl.run_state(values)(plgpu.ACC.init(acc))

            def step(i, carry, masked: bool):
                acc, m, l = carry
                slot = lax.rem(i - lo, jnp.int32(stages))
                plgpu.barrier_wait(kv_ready.at[slot])

                def scores(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, kv_smem.at[slot].transpose((1, 0)))
                    return acc_ref[...]

                s = pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))
                p, alpha, m_new, l, acc = online_softmax_update(
                    s, m, l, acc, scale2, (col + i * block_k < row_hi) if masked else None)
                p16 = p.astype(pv_dtype)
                if share_scores:  # hand P and alpha to warpgroup 1 (two buffers, alternating)
                    pslot = lax.rem(i - lo, jnp.int32(2))

                    @pl.when(i - lo >= 2)
                    def _():
                        plgpu.barrier_wait(p_free.at[pslot])

                    p_smem.at[pslot][...] = p16
                    alpha_smem.at[pslot][...] = alpha
                    plgpu.commit_smem()
                    plgpu.barrier_arrive(p_ready.at[pslot])
                v_tile = value_tile(slot)
                if fp8:
                    plgpu.barrier_arrive(kv_free.at[slot])  # both matmul operands are copied out
                acc = add_values(acc, p16, v_tile)
                if not fp8:
                    plgpu.barrier_arrive(kv_free.at[slot])
                return acc, m_new, l

            def follow(i, acc):
                """Warpgroup 1 under share_scores: rescale, then add P V from warpgroup 0's P."""
                slot = lax.rem(i - lo, jnp.int32(stages))
                pslot = lax.rem(i - lo, jnp.int32(2))
                plgpu.barrier_wait(kv_ready.at[slot])
                plgpu.barrier_wait(p_ready.at[pslot])
                alpha = plgpu.load(alpha_smem.at[pslot], layout=plgpu.Layout.WGMMA.reduce(1))
                acc = add_values(acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), p_smem.at[pslot], value_tile(slot))
                plgpu.barrier_arrive(p_free.at[pslot])
                plgpu.barrier_arrive(kv_free.at[slot])
                return acc

            m = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.zeros((ROWS, half), jnp.float32), plgpu.Layout.WGMMA)
            if share_scores and w == 1:
                acc = lax.fori_loop(lo, hi, follow, acc)
                plgpu.barrier_wait(l_ready)
                l = plgpu.load(l_smem, layout=plgpu.Layout.WGMMA.reduce(1))
            else:
                carry = lax.fori_loop(lo, open_end, functools.partial(step, masked=False), (acc, m, l))
                acc, m, l = lax.fori_loop(open_end, hi, functools.partial(step, masked=True), carry)
            if share_scores and w == 0:
                l_smem[...] = l
                plgpu.commit_smem()
                plgpu.barrier_arrive(l_ready)

                @pl.loop(jnp.maximum(hi - 2, lo), hi)  # observe warpgroup 1's last P releases
                def _(i):
                    plgpu.barrier_wait(p_free.at[lax.rem(i - lo, jnp.int32(2))])
            seen = l > 0
            l_safe = jnp.where(seen, l, 1.0)
            out = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]),
                            acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), 0.0)
            # One small staging tile for both halves, piece by piece: warpgroup 1 starts after
            # warpgroup 0's last copy has left shared memory.
            if w == 1:
                plgpu.barrier_wait(o_free)
            if w == 0:
                lse_smem[...] = jnp.where(seen, m + jnp.log(l_safe) * (1.0 / math.log(2.0)), -jnp.inf)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[split, bi, pl.ds(row0, ROWS)])
            for j in range(half // OUT_CHUNK):
                plgpu.wait_smem_to_gmem(0)  # the previous piece has been read out
                o_smem[...] = out[:, j * OUT_CHUNK:(j + 1) * OUT_CHUNK]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, out_gmem.at[split, bi, pl.ds(row0, ROWS), pl.ds(w * half + j * OUT_CHUNK, OUT_CHUNK)])
            plgpu.wait_smem_to_gmem(0)
            if w == 0:
                plgpu.barrier_arrive(o_free)

        pl.when(wg == 0)(lambda: compute(0))
        pl.when(wg == 1)(lambda: compute(1))

        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            plgpu.copy_gmem_to_smem(q_gmem.at[bi, pl.ds(row0, ROWS)], q_smem, q_ready)

            @pl.loop(lo, hi)
            def _fetch(i):
                slot = lax.rem(i - lo, jnp.int32(stages))
                key0 = i * block_k
                start = pt_gmem[bi, lax.div(key0, jnp.int32(page_size))] * page_size + lax.rem(key0, jnp.int32(page_size))

                @pl.when(i - lo >= stages)
                def _():
                    plgpu.barrier_wait(kv_free.at[slot])

                plgpu.copy_gmem_to_smem(lat_gmem.at[pl.ds(start, block_k)], kv_smem.at[slot], kv_ready.at[slot])

            @pl.loop(jnp.maximum(hi - stages, lo), hi)
            def _drain(i):
                plgpu.barrier_wait(kv_free.at[lax.rem(i - lo, jnp.int32(stages))])

    def entry(q_gmem, lat_gmem, pt_gmem, len_gmem, out_gmem, lse_gmem):
        pl.run_scoped(
            lambda *scoped: body(q_gmem, lat_gmem, pt_gmem, len_gmem, out_gmem, lse_gmem, scoped),
            (plgpu.SMEM((ROWS, c), dtype, transforms=_smem_transforms(c, dtype)),
             plgpu.SMEM((stages, block_k, c), dtype, transforms=_smem_transforms(c, dtype)),
             plgpu.SMEM((ROWS, OUT_CHUNK), jnp.float32, transforms=_smem_transforms(OUT_CHUNK, jnp.float32)),
             plgpu.SMEM((ROWS,), jnp.float32),
             # P / alpha / l exchange between the warpgroups (share_scores only).
             plgpu.SMEM((2, ROWS, block_k), dtype, transforms=_smem_transforms(block_k, dtype)) if share_scores else None,
             plgpu.SMEM((2, ROWS), jnp.float32) if share_scores else None,
             plgpu.SMEM((ROWS,), jnp.float32) if share_scores else None,
             # Each warpgroup's fp16 copy of its value channels (FP8 caches only).
             # (Two buffers: a wgmma operand indexed by the static warpgroup number did not lower.)
             tuple(plgpu.SMEM((block_k, half), pv_dtype, transforms=_smem_transforms(half, pv_dtype))
                   for _ in range(2)) if fp8 else None),
            (plgpu.Barrier(), plgpu.Barrier(num_barriers=stages),
             plgpu.Barrier(num_arrivals=2, num_barriers=stages), plgpu.Barrier(),
             plgpu.Barrier(num_barriers=2), plgpu.Barrier(num_barriers=2), plgpu.Barrier()),
            collective_axes="wg",
        )

    grid, grid_names = grid_in_order(dict(batch=b, tiles=tiles, splits=splits), tiles_adjacent)
    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((splits, b, rows_pad, kv_lora_rank), jnp.float32),
                  jax.ShapeDtypeStruct((splits, b, rows_pad), jnp.float32)),
        grid=grid,
        grid_names=grid_names,
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(qf, latent_pool, page_table.astype(jnp.int32), prefix_len.astype(jnp.int32))
    if splits > 1:
        out, lse = merge_splits(out, lse)
    else:
        out, lse = out[0], lse[0]
    return (out[:, :rows].reshape(b, r, hq, kv_lora_rank), lse[:, :rows].reshape(b, r, hq))


__all__ = ["mla_decode_mgpu", "check_mla_mgpu_inputs", "mla_mgpu_input_errors"]
