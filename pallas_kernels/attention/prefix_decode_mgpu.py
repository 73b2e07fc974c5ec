"""The prefix half on Mosaic GPU (Hopper wgmma + TMA, warp-specialised): the default on GPUs.

It runs compiled on Hopper over bf16 and FP8 E4M3 pools, one and two pages per step (compiled
conformance: `benchmarks/tools/mgpu_prefix_check.py`). Its cascade is faster than the Triton one, so
`CascadeConfig(prefix_kernel="auto")` takes it wherever `mgpu_input_errors` is empty (results:
prefix-kernel). A KV head's row tiles launch side by side (`tiles_adjacent`;
results: grid-order). On the CPU its logic (page-table TMA copies, the buffer ring and its
barriers, masking, the online softmax) runs in Pallas' GPU interpreter against dense fp32 attention
(`tests/test_prefix_decode_mgpu.py`); the interpreter has no rule for the accumulator `run_state`
idiom, so interpreted runs add P V with a plain dot where the compiled kernel uses wgmma. The
compiled path also lowers on the CPU (layout inference and the shared-memory check).

FP8 E4M3 pools (unscaled): the query is cast to FP8 (`quantize_query_for_pool`, as the Triton
kernel does, saturating at +-448; the kernel can cast it itself, `cast_query`) and the scores are
an FP8 x FP8 wgmma (K is the K-major operand 8-bit wgmma requires). V is the MN-major operand of
P V, which 8-bit wgmma cannot take, so it is widened to fp16 in shared memory (exact) and P V runs
in fp16: by default (`memory_widens_values`) the memory warpgroup widens each page once into a
16-bit ring the compute warpgroups read; under a warpgroup key split (where that is slower;
results: memory-widens) each compute warpgroup widens the step's page into its own tile while the
other holds the tensor cores.

Why: wgmma + TMA with warp-specialised loads is the class of kernel issue #3's 1.5x-of-floor target
needs; the Pallas Triton prefix kernel is slower at every timed shape (results: prefix-kernel).

Contract (same row layout as `prefix_decode.prefix_decode_row_layout`, one difference):
    qr [B, Hkv, T, D] (row r * G + g; T a multiple of 64), k_pool / v_pool [S, Hkv, D],
    page_table [B, maxp] int32, lengths [B] int32 (P)
    -> out [B, Hkv, T, D] f32 (or `partial_dtype`), lse2 [B, Hkv, T] f32 (base 2)
Row r sees keys [0, min(P - R + 1 + r, whole)) with whole = (P // page_size) * page_size: only
*whole pages*. TMA cannot mask a load, and the slots of the last, partial page past P may hold
anything (NaN included), which a zero softmax weight would still turn into NaN. The window kernel
covers the rest of each row's prefix (`tree_window_attention(..., prefix_whole_pages=True)`).

Layout of one CTA (grid (row tiles, key splits, Hkv, B)): two compute warpgroups each own 64 query
rows and run the online softmax with wgmma (QK^T and PV from shared memory, fp32 accumulators in
registers), taking turns on the tensor cores (`pingpong`) so one's softmax overlaps the other's
matmuls. Where a KV head has only 64 rows (e.g. N=16 with G=4) one compute warpgroup runs, or,
by default for FP8 pools, both take those rows and alternate key steps (`key_split`), so the tensor
cores still have a second warpgroup to turn to, and at the end warpgroup 1 hands its (out, lse2)
through shared memory to warpgroup 0, which merges the two by LSE and writes one partial; the last warpgroup only issues
TMA copies of one or two pages (`pages_per_step`) of K and of V per step into a ring of `stages`
buffers, reading each page id from the table, and waits until every compute warpgroup that reads
a buffer (both, or under a key split the step's owner) released it before refilling it. Steps whose keys every row of a warpgroup sees run without masks. A
small grid splits the key axis; the partials merge by LSE (`split_merge.merge_splits`), or, under
the fused window with 2 gridded splits (4 or 8 when asked), inside one thread-block cluster of
the splits' CTAs (`cluster_splits`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.attention.prefix_decode import check_partial_dtype, num_sms, split_key_blocks
from pallas_kernels.attention.reference import quantize_query_for_pool
from pallas_kernels.attention.split_merge import (HEAD_IO_TILE, MergeConfig, head_io_rows, head_io_rows_errors,
                                                  merge_splits, split_weights)
from pallas_kernels.common import LOG2E, MAX_SMEM_BYTES, require_bool_fields

F8 = jnp.dtype(jnp.float8_e4m3fn)
F8_MAX = float(jnp.finfo(F8).max)  # 448: the FP8 query saturates here (`quantize_query_for_pool`)
_POOL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), F8)
ROWS_PER_WG = HEAD_IO_TILE  # 64 query rows per warpgroup, the tile of heads_io's row order (`head_io_rows`)
COMPUTE_WGS = 2
ROWS_PER_CTA = ROWS_PER_WG * COMPUTE_WGS
OUT_CHUNK = 32  # output columns per fp32 staging tile (64 per bf16 one: the same bytes)
# The fused window's mask words of one warpgroup's rows (two int32 words per row); counted always.
FUSED_WINDOW_WORDS = 2 * 64 * 4
# What Mosaic GPU adds to our buffers within MAX_SMEM_BYTES (swizzle alignment, barriers; about 3 KB
# measured by lowering).
SMEM_OVERHEAD = 4096
# Keys per step the default aims for: two 64-token pages per step (128-key matmuls) rather than one.
# results: pages-per-step.
STEP_KEYS = 128
# Key steps of the page table per split the default count allows (the shares themselves follow each
# request's length, `split_key_blocks`). At B=1 over a 1k prefix (9 steps) the decode cascade took
# 15 us at the 2 splits a four-step minimum gave, 13 at 4 splits (three steps each), 11 at 8 (five
# splits of two steps, three empty) and 13 at 16 (one step each); two steps a split gives 5 there,
# the 8-split shares without the empty CTAs (results: mgpu-short-splits).
MIN_STEPS_PER_SPLIT = 2


def default_mgpu_num_splits(batch: int, kv_heads: int, tiles: int, steps: int, sms: int | None = None) -> int:
    """Key splits of the Mosaic prefix: the most that still fit one wave (one CTA per SM; a CTA
    holds most of an SM's shared memory), at most one per MIN_STEPS_PER_SPLIT of the table's `steps`,
    and 1 once (B, Hkv, row tiles) fills the SMs.

    A CTA pays a fixed pipeline fill and output write, so a second wave of half-length splits loses.
    results: mgpu-num-splits.
    """
    sms = sms or num_sms()
    programs = batch * kv_heads * tiles
    return max(1, min(sms // programs, -(-steps // MIN_STEPS_PER_SPLIT)))


# Key splits one cluster may hold: a power of two up to the portable cluster size (8).
CLUSTER_SPLIT_SIZES = (2, 4, 8)
# The cluster sizes `cluster_splits=None` takes: two-CTA clusters gain, four-CTA ones lose their
# one wave (a cluster must find four free SMs of one GPC; results: cluster-splits). Larger clusters
# stay available when asked.
CLUSTER_SPLIT_DEFAULT_SIZES = (2,)

# The K/V ring (stages, pages per step) that `stages=None` gives the fused window over an FP8 pool
# under the warpgroup key split (64-row heads) on 64-token pages, instead of two stages of two pages:
# faster at the same error (results: fused-fp8-ring).
FUSED_FP8_SPLIT_RING = (4, 1)

# Rows of V the memory warpgroup widens per piece under `memory_widens_values`: one WGMMA-layout
# tile (the smallest a warpgroup loads from the swizzled ring; 64 x 128 FP8 values are 64 per thread
# of the warpgroup).
WIDEN_ROWS = 64
# Register budgets per thread (`setmaxnreg`) of a compute warpgroup and of the memory warpgroup: the
# CTA is launched with 168 per thread (ptxas, `benchmarks/tools/ptxas_report.py`), and two compute
# warpgroups plus the memory one must fit in that (2 * 232 + 40 = 3 * 168).
REGISTERS = (232, 40)
LAUNCH_REGISTERS = 168
# The budgets where the memory warpgroup widens FP8 V (`memory_widens_values`): its widening is
# register-starved at 40 (ptxas spills); these run the widened FP8 prefix faster (results:
# registers).
REGISTERS_MEMORY_WIDENS = (224, 56)


def cluster_split_errors(fused: bool, splits: int, width: int, persistent: bool) -> list[str]:
    """Every reason a kernel's `splits` key splits of width-`width` heads cannot merge inside one
    cluster (`cluster_splits`): the fused window, a gridded launch, 2, 4 or 8 splits, and a column
    block of whole OUT_CHUNK-wide pieces per split."""
    errors = []
    if not fused:
        errors.append("prefix_decode_mgpu: cluster_splits takes the fused window (window > 0); unfused "
                      "partials merge in the window kernel")
    if persistent:
        errors.append("prefix_decode_mgpu: cluster_splits needs the gridded launch, got persistent=True")
    if splits not in CLUSTER_SPLIT_SIZES:
        errors.append(f"prefix_decode_mgpu: cluster_splits takes {', '.join(map(str, CLUSTER_SPLIT_SIZES))} key "
                      f"splits (a cluster's CTAs), got {splits}")
    elif width % (splits * OUT_CHUNK):
        errors.append(f"prefix_decode_mgpu: cluster_splits needs head dim {width} to be a multiple of "
                      f"{splits} splits x {OUT_CHUNK} columns")
    return errors


def default_registers(memory_widens_values: bool) -> tuple[int, int]:
    """The (compute, memory) budgets `registers=None` stands for."""
    return REGISTERS_MEMORY_WIDENS if memory_widens_values else REGISTERS


def register_budget_errors(registers: tuple[int, int], compute_warpgroups: int) -> list[str]:
    """Why (compute, memory) `setmaxnreg` budgets cannot run beside `compute_warpgroups` compute
    warpgroups and one memory warpgroup in a CTA launched at LAUNCH_REGISTERS (empty: they can)."""
    compute, memory = registers
    limit = (compute_warpgroups + 1) * LAUNCH_REGISTERS
    if any(r % 8 or not 24 <= r <= 256 for r in registers) or compute_warpgroups * compute + memory > limit:
        return [f"registers (compute, memory) must be multiples of 8 in [24, 256] with {compute_warpgroups} * "
                f"compute + memory <= {limit}, got {tuple(registers)}"]
    return []


@dataclasses.dataclass(frozen=True)
class PrefixMgpuConfig:
    """The default rules of `prefix_decode_mgpu_row_layout`: which optional forms a knob left None
    takes. Each field switches one form on or off wherever its shape rule (the `runs_*` function
    named) allows it; an explicit knob on the entry point overrides both. `default_config()` gives
    the library's rules; the entry point takes `config=` (None: `default_config()`), part of the
    traced program (a static argument)."""
    # Persistent CTAs where the work items outnumber the SMs (`runs_persistent`), over 16-bit pools,
    # and over FP8 pools whose V the memory warpgroup widens; FP8 pools whose compute warpgroups
    # widen V stay gridded. results: persistent-prefix.
    persistent_16bit: bool = True
    persistent_fp8_widened: bool = True
    # A persistent CTA loads its next query tile (and mask words) during the current item, where the
    # second tile fits shared memory (`runs_prefetch_query`); the same bits. results: prefetch-query.
    prefetch_query: bool = True
    # A fused kernel's key splits of one (request, KV head, row tile) run as one thread-block
    # cluster that merges their partials itself (`cluster_split_errors` empty, the split count in
    # CLUSTER_SPLIT_DEFAULT_SIZES, one row-owning warpgroup, the inbox fits), so no merge kernel
    # runs and no float32 partial goes through memory. results: cluster-splits.
    cluster_splits: bool = True
    # The fused kernel over an FP8 pool derives the prefix's FP8 query tile from the unquantised
    # tile it loads for the window steps (saturated to E4M3's +-448, as `quantize_query_for_pool`)
    # instead of reading a query XLA cast to FP8 before it (one kernel fewer). results: cast-query.
    cast_query_fused: bool = True
    # The same for an unfused kernel over an FP8 pool given a 16-bit query: each compute warpgroup
    # stages the unquantised tile in shared memory and casts it (where that tile fits,
    # `smem_bytes(wide_query=True)`), so no XLA cast of the whole query runs before the kernel.
    # Under `prefetch_query` the next item's tile is fetched into the staging tile once this item's
    # is cast. results: unfused-heads-io.
    cast_query_unfused: bool = True
    # The memory warpgroup widens each FP8 V page once (`runs_memory_widens`) over FP8 pools without
    # a warpgroup key split, where its ring fits at the given (or default) pages per step (the key
    # split keeps its own copies: faster there). results: memory-widens.
    memory_widens: bool = True
    # The same under the fused window, whose widened K then needs its own tile (two pages per step
    # no longer fit; one page per step is the default there). results: memory-widens.
    memory_widens_fused: bool = False

    def __post_init__(self):
        require_bool_fields(self)


def default_config() -> PrefixMgpuConfig:
    """The default rules for every shape and pool dtype (each field's rule reads the shapes and
    dtypes where it is applied): every field at its documented default."""
    return PrefixMgpuConfig()


def runs_persistent(items: int, persistent: bool | None, itemsize: int, memory_widens: bool = False,
                    config: PrefixMgpuConfig | None = None) -> bool:
    """Whether the prefix kernel's launch over `itemsize`-byte pools is persistent for `items`
    work items (see `prefix_decode_mgpu_row_layout`; `memory_widens`: FP8 V widened by the memory
    warpgroup); an explicit setting wins, None follows `config` (None: `default_config()`)."""
    if persistent is None:
        config = config or default_config()
        on = config.persistent_16bit if itemsize == 2 else memory_widens and config.persistent_fp8_widened
        return on and items > num_sms()
    return bool(persistent)


def runs_prefetch_query(prefetch_query: bool | None, persistent: bool, smem_with_two_tiles: int,
                        config: PrefixMgpuConfig | None = None) -> bool:
    """Whether the prefix kernel loads each next item's query tile during the current one (see
    `prefix_decode_mgpu_row_layout`): None turns it on (`config.prefetch_query`) under the persistent
    launch where the kernel's shared memory with two query tiles fits; an explicit setting wins (and
    is checked there)."""
    if prefetch_query is None:
        return (config or default_config()).prefetch_query and persistent and smem_with_two_tiles <= MAX_SMEM_BYTES
    return bool(prefetch_query)


def runs_memory_widens(memory_widens: bool | None, itemsize: int, key_split: bool, fused: bool, fits: bool,
                       config: PrefixMgpuConfig | None = None) -> bool:
    """Whether the memory warpgroup widens each FP8 V page once (`memory_widens_values`): None
    turns it on (`config.memory_widens`; fused window: `config.memory_widens_fused`) over FP8 pools
    without a warpgroup key split where its ring `fits`; an explicit setting wins (and is checked
    there)."""
    if memory_widens is None:
        config = config or default_config()
        on = config.memory_widens_fused if fused else config.memory_widens
        return on and itemsize == 1 and not key_split and fits
    return bool(memory_widens)


def warpgroup_layout(total_rows: int, key_split: bool | None = None, itemsize: int = 2) -> tuple[int, int, bool]:
    """(compute warpgroups, query rows per CTA, key split) for `total_rows` padded rows per KV head
    of a pool with `itemsize`-byte elements.

    Rows that fill 128-row CTAs give each compute warpgroup its own 64 rows. A 64-row head (e.g.
    N=16, G=4) leaves one compute warpgroup alone, its QK^T -> softmax -> PV chain serial; under
    `key_split` both warpgroups take the same 64 rows and alternate key steps, taking turns on the
    tensor cores, and their two partials of the same rows merge by LSE inside the CTA (one partial
    per CTA, merged with the other key splits').
    None: on for 64-row heads of FP8 pools only, where it runs the cascade faster; bf16 runs
    slower with it (results: key-split). `key_split=True` forces it on 128-row heads too (64-row CTAs)."""
    fills_two = total_rows % ROWS_PER_CTA == 0
    if key_split is None:
        key_split = not fills_two and itemsize == 1
    if key_split:
        return COMPUTE_WGS, ROWS_PER_WG, True
    return (COMPUTE_WGS, ROWS_PER_CTA, False) if fills_two else (1, ROWS_PER_WG, False)


def smem_bytes(total_rows: int, width: int, itemsize: int, block: int, stages: int,
               key_split: bool | None = None, fused_fp8: bool = False, query_tiles: int = 1,
               memory_widens_values: bool = False, cluster_splits: int = 1, wide_query: bool = False) -> int:
    """Shared memory of one CTA (`block` keys per step): query tiles (`query_tiles` per compute
    warpgroup, with as many sets of the fused window's mask words: two under `prefetch_query`), the
    K and V rings, output staging, LSE; with 1-byte (FP8) items also each compute warpgroup's 16-bit
    copy of the step's V (`memory_widens_values`: one 16-bit V ring of `stages` steps instead), and
    (`fused_fp8`) its unquantised query tile (and, beside the V ring, its own tile of widened K,
    which otherwise shares its copy of V's memory); unfused, with `wide_query` (the in-kernel query
    cast) each compute warpgroup's unquantised query tile; with `cluster_splits` S > 1, each
    row-owning warpgroup's inbox for the other S - 1 splits' pieces of its column block and their
    LSEs."""
    wgs, _, split = warpgroup_layout(total_rows, key_split, itemsize)
    widened = (stages if memory_widens_values else wgs) * block * width * 2 if itemsize == 1 else 0
    widened += wgs * ROWS_PER_WG * width * 2 if fused_fp8 or wide_query else 0
    widened += wgs * block * width * 2 if fused_fp8 and memory_widens_values else 0
    owners = 1 if split else wgs
    inbox = owners * (cluster_splits - 1) * ROWS_PER_WG * (width // cluster_splits + OUT_CHUNK) * 4
    return (query_tiles * wgs * (ROWS_PER_WG * width * itemsize + FUSED_WINDOW_WORDS)
            + 2 * stages * block * width * itemsize + widened
            + wgs * ROWS_PER_WG * (OUT_CHUNK + 1) * 4 + inbox + SMEM_OVERHEAD)


def _smem_transforms(minor: int, dtype):
    bits = jnp.dtype(dtype).itemsize * 8
    swizzle = plgpu.find_swizzle(minor * bits)
    return (plgpu.TilingTransform((8, swizzle * 8 // bits)), plgpu.SwizzleTransform(swizzle))


def whole_page_bound(length, query_rows: int, group: int, row, whole):
    """Keys [0, bound) row `row` (= r * group + g; a scalar or a warpgroup array) sees under the
    whole-pages contract: min(P - R + 1 + r, whole). May be negative (the row sees nothing).
    Rows are non-negative, so truncating lax.div is floor division."""
    return jnp.minimum(length - query_rows + 1 + lax.div(row, jnp.int32(group)), whole)


def grid_in_order(sizes: dict[str, int], tiles_adjacent: bool) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(grid, grid_names) for `plgpu.kernel` from named axis sizes (keys "tiles", "splits", any
    others in launch order before them). Mosaic GPU launches the last grid axis fastest: with the
    tiles last, the CTAs that share pages (a head's or a request's row tiles) start together;
    otherwise the tiles axis first, so a head's tiles launch far apart. Kernel bodies read axes by
    name, so only the order changes. Shared by the GQA prefix and the MLA latent decode."""
    others = tuple(name for name in sizes if name not in ("tiles", "splits"))
    order = others + ("splits", "tiles") if tiles_adjacent else ("tiles", "splits") + others[::-1]
    return tuple(sizes[name] for name in order), order


def cta_key_blocks(length, page_size: int, query_rows: int, group: int, row0, rows_per_cta: int,
                   block: int, split, splits: int):
    """(whole, lo, hi) for a CTA owning rows [row0, row0 + rows_per_cta) of the R * G real ones:
    `whole` = (P // page_size) * page_size, and [lo, hi) this split's `block`-key blocks of the
    cdiv(cta_hi, block) the CTA reads (`split_key_blocks`), cta_hi being its last real row's
    whole-page bound (per-row bounds are masked in the loop). Every page below cta_hi <= whole
    holds finite keys (a multi-page block straddling it is the caller's to fill; see
    prefix_decode_mgpu). Shared by the GQA prefix and the MLA latent decode."""
    whole = lax.div(length, jnp.int32(page_size)) * page_size
    last_real = jnp.minimum(row0 + rows_per_cta - 1, query_rows * group - 1)
    cta_hi = jnp.maximum(whole_page_bound(length, query_rows, group, last_real, whole), 0)
    return (whole, *split_key_blocks(lax.div(cta_hi + block - 1, jnp.int32(block)), split, splits))


def fused_key_blocks(length, window: int, block: int, split, splits: int):
    """(lo, hi): this split's `block`-key steps (`split_key_blocks`) under a fused window, where
    every row reads [0, P + window), i.e. cdiv(P + window, block) steps in all. Shared by the GQA
    prefix and the MLA latent decode."""
    return split_key_blocks(lax.div(length + window + block - 1, jnp.int32(block)), split, splits)


def window_visible(key, length, window: int, words):
    """Whether key position `key` is seen under the fused window: a committed key (< P), or window
    key j = key - P < window whose bit j is set in `words` (word 0 bits 0..31, word 1 bits 32..63;
    int32 arrays broadcast to `key`'s shape, or scalars)."""
    j = key - length
    jc = jnp.clip(j, 0, 63)
    word = jnp.where(jc < 32, words[0], words[1])
    bit = lax.shift_right_logical(word, jc & 31) & 1
    return (key < length) | ((j >= 0) & (j < window) & (bit == 1))


def fused_window_words(mask, group: int, total_rows: int, heads_io: bool = False):
    """`mask [B, R, 2] uint32` (packed ancestor rows) -> (`words [B, 2, total_rows] int32`: row
    r * G + g (with `heads_io`, the rows of `head_io_rows`) gets request row r's words, padding
    rows none; `union [B, 2] int32`: the OR over the rows, i.e. the window slots some row sees,
    whose V rows are kept)."""
    words = lax.bitcast_convert_type(mask, jnp.int32)
    union = lax.reduce(words, jnp.int32(0), lax.bitwise_or, (1,))
    if heads_io:
        per_head = jnp.broadcast_to(jnp.swapaxes(words, 1, 2)[..., None], words.shape[:1] + (2, words.shape[1], group))
        return head_io_rows(per_head, group)[:, :, 0], union
    rows = jnp.repeat(words, group, axis=1)
    rows = jnp.pad(rows, ((0, 0), (0, total_rows - rows.shape[1]), (0, 0)))
    return jnp.swapaxes(rows, 1, 2), union


def check_fused_window_inputs(qr, words, union, window: int, overlap_softmax: bool):
    """The fused window's inputs agree with `window`; raises naming every bad value."""
    b, _, total, _ = qr.shape
    errors = []
    if not 0 <= window <= 64:
        errors.append(f"prefix_decode_mgpu: window must be in [0, 64], got {window}")
    if window and (words is None or union is None):
        errors.append(f"prefix_decode_mgpu: window={window} needs window_words and window_union")
    if not window and (words is not None or union is not None):
        errors.append("prefix_decode_mgpu: window_words / window_union given without a window")
    if window and words is not None and (words.shape != (b, 2, total) or words.dtype != jnp.int32):
        errors.append(f"prefix_decode_mgpu: window_words must be [B={b}, 2, T={total}] int32, "
                      f"got {words.shape} {words.dtype}")
    if window and union is not None and (union.shape != (b, 2) or union.dtype != jnp.int32):
        errors.append(f"prefix_decode_mgpu: window_union must be [B={b}, 2] int32, got {union.shape} {union.dtype}")
    if window and overlap_softmax:
        errors.append("prefix_decode_mgpu: the fused window runs the turn-taking loop, not overlap_softmax")
    if errors:
        raise ValueError("; ".join(errors))


def merge_weights(lses):
    """(each partial's weight normalised over all of them, the merged lse2) for partials of the
    same rows with base-2 LSEs `lses` (each [rows], fp32), as `merge_splits` merges: rows no
    partial saw get weights 0 and lse2 -inf."""
    _, top, weights, total = split_weights(lses)
    total_safe = jnp.where(total > 0, total, 1.0)
    return [w / total_safe for w in weights], jnp.where(total > 0, top + log2_of(total_safe), -jnp.inf)


def log2_of(x):
    """log2 of a warpgroup array, as the kernels' base-2 LSEs take it (natural log times 1 / ln 2;
    shared by the Mosaic GPU kernels)."""
    return jnp.log(x) * (1.0 / math.log(2.0))


def online_softmax_update(s, m, l, acc, scale2: float, visible=None):
    """One base-2 online-softmax step on warpgroup arrays (shared by the Mosaic GPU kernels).

    `s [rows, keys]` raw scores (fp32, WGMMA layout), `m`/`l [rows]` running max (scaled) and sum,
    `acc [rows, D]` the running output (None: not rescaled here), `visible` an optional bool mask
    (None: every key seen). Returns `(p, alpha, m_new, l_new, acc * alpha)`. A row whose keys are all masked so far keeps
    m = -inf, which is why the masked path shifts by 0 there instead.
    """
    if visible is not None:
        s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1) * scale2)
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if visible is not None else m_new
    alpha = jnp.exp2(m - m_use)
    p = jnp.exp2(s * scale2 - lax.broadcast_in_dim(m_use, s.shape, [0]))
    scaled = None if acc is None else acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return p, alpha, m_new, l * alpha + p.sum(axis=1), scaled


def default_pages_per_step(total_rows: int, width: int, itemsize: int, page_size: int, stages: int,
                           key_split: bool | None = None, fused_fp8: bool = False,
                           memory_widens_values: bool = False) -> int:
    """Pages per key step: as many as make STEP_KEYS keys (at most 2) while shared memory holds them
    (with the fused FP8 window's and `memory_widens_values`' buffers where those are on)."""
    pps = 2 if 2 * page_size <= STEP_KEYS else 1
    if pps == 2 and smem_bytes(total_rows, width, itemsize, 2 * page_size, stages, key_split, fused_fp8=fused_fp8,
                               memory_widens_values=memory_widens_values) > MAX_SMEM_BYTES:
        pps = 1
    return pps


def widens_values_by_default(total_rows: int, width: int, page_size: int, stages: int = 2,
                             fused: bool = False, pages_per_step: int | None = None,
                             key_split: bool | None = None, config: PrefixMgpuConfig | None = None) -> bool:
    """Whether the kernel over an FP8 pool, `memory_widens_values=None`, has the memory warpgroup
    widen V (`runs_memory_widens`; `fused`: with the fused window, which then takes one page per
    step where two no longer fit), for `total_rows` padded rows per KV head at the given (None:
    default) pages per step and warpgroup key split, under `config` (None: `default_config()`)."""
    _, _, key_split = warpgroup_layout(total_rows, key_split, 1)
    pps = pages_per_step or default_pages_per_step(total_rows, width, 1, page_size, stages, key_split, fused,
                                                   memory_widens_values=fused)
    fits = smem_bytes(total_rows, width, 1, pps * page_size, stages, key_split, fused_fp8=fused,
                      memory_widens_values=True) <= MAX_SMEM_BYTES
    return runs_memory_widens(None, 1, key_split, fused, fits, config)


def fused_fp8_fits(total_rows: int, width: int, page_size: int, stages: int = 2) -> bool:
    """Whether the fused window over an FP8 pool (its unquantised query tiles and widened K beside
    the ring) fits shared memory at the default pages per step."""
    pps = default_pages_per_step(total_rows, width, 1, page_size, stages)
    return smem_bytes(total_rows, width, 1, pps * page_size, stages, fused_fp8=True) <= MAX_SMEM_BYTES


def default_ring(total_rows: int, width: int, pool_dtype, page_size: int, fused: bool, key_split: bool | None,
                 pages_per_step: int | None) -> tuple[int, int | None]:
    """(stages, pages_per_step) for `stages=None`: FUSED_FP8_SPLIT_RING for the fused window over an
    FP8 pool under a warpgroup key split on pages shorter than a step, where pages per step are not
    given and the ring fits; else 2 stages and `pages_per_step` as given."""
    itemsize = jnp.dtype(pool_dtype).itemsize
    stages, pps = FUSED_FP8_SPLIT_RING
    if (fused and itemsize == 1 and pages_per_step is None and page_size < STEP_KEYS
            and warpgroup_layout(total_rows, key_split, itemsize)[2]
            and smem_bytes(total_rows, width, 1, pps * page_size, stages, key_split, fused_fp8=True) <= MAX_SMEM_BYTES):
        return stages, pps
    return 2, pages_per_step


def mgpu_input_errors(qr, k_pool, v_pool, page_size: int, stages: int = 2,
                      pages_per_step: int | None = None, key_split: bool | None = None) -> list[str]:
    """Every reason this kernel cannot take these inputs (empty: it can). Arrays or ShapeDtypeStructs;
    `pages_per_step` None: `default_pages_per_step`."""
    b, hkv, total, d = qr.shape
    errors = []
    if pages_per_step is None:
        pages_per_step = default_pages_per_step(total, d, jnp.dtype(k_pool.dtype).itemsize, page_size, stages,
                                                key_split)
    if total % ROWS_PER_WG:
        errors.append(f"prefix_decode_mgpu: padded rows per KV head must be a multiple of {ROWS_PER_WG}, got {total}")
    if page_size not in (64, 128):
        errors.append(f"prefix_decode_mgpu: page_size must be 64 or 128 (whole pages per TMA copy), got {page_size}")
    if d % 64 or d > 256:
        errors.append(f"prefix_decode_mgpu: head dim must be a multiple of 64 up to 256, got {d}")
    pool = jnp.dtype(k_pool.dtype)
    if pool != jnp.dtype(v_pool.dtype) or pool not in _POOL_DTYPES:
        errors.append(f"prefix_decode_mgpu: K and V must share one dtype of bfloat16, float16 or float8_e4m3fn, "
                      f"got {k_pool.dtype}, {v_pool.dtype}")
    elif pool.itemsize == 2 and jnp.dtype(qr.dtype) != pool:
        errors.append(f"prefix_decode_mgpu: q must have the pools' dtype {pool}, got {qr.dtype}")
    elif pool.itemsize == 1 and jnp.dtype(qr.dtype) not in _POOL_DTYPES:
        errors.append(f"prefix_decode_mgpu: q must be bfloat16, float16 or float8_e4m3fn (cast to FP8 here), "
                      f"got {qr.dtype}")
    if stages < 2:
        errors.append(f"prefix_decode_mgpu: stages must be >= 2, got {stages}")
    elif stages % 2 and warpgroup_layout(total, key_split, jnp.dtype(k_pool.dtype).itemsize)[2]:
        errors.append(f"prefix_decode_mgpu: a warpgroup key split needs an even number of stages (each "
                      f"warpgroup owns half of the K/V ring), got {stages}")
    if pages_per_step not in (1, 2):
        errors.append(f"prefix_decode_mgpu: pages_per_step must be 1 or 2, got {pages_per_step}")
    if not errors:
        need = smem_bytes(total, d, pool.itemsize, page_size * pages_per_step, stages, key_split)
        if need > MAX_SMEM_BYTES:
            errors.append(f"prefix_decode_mgpu: page_size={page_size}, pages_per_step={pages_per_step}, "
                          f"stages={stages}, head dim {d} need {need} bytes of shared memory, "
                          f"more than {MAX_SMEM_BYTES}")
    return errors


def check_mgpu_inputs(qr, k_pool, v_pool, page_size: int, stages: int = 2, pages_per_step: int | None = None,
                      key_split: bool | None = None):
    """Shapes this kernel takes; raises naming every unsupported value."""
    errors = mgpu_input_errors(qr, k_pool, v_pool, page_size, stages, pages_per_step, key_split)
    if errors:
        raise ValueError("; ".join(errors))


@functools.partial(jax.jit, static_argnames=("query_rows", "group", "page_size", "scale", "stages", "num_splits",
                                             "pingpong", "pages_per_step", "key_split", "fence_softmax",
                                             "tiles_adjacent", "overlap_softmax", "partial_dtype", "window",
                                             "heads_io", "persistent", "prefetch_query", "memory_widens_values",
                                             "widen_rows", "registers", "merge", "kept_rows", "cast_query",
                                             "cluster_splits", "interpret", "config", "merge_config"))
def prefix_decode_mgpu_row_layout(qr, k_pool, v_pool, page_table, lengths, window_words=None, window_union=None,
                                  *, query_rows: int, group: int,
                                  page_size: int, scale: float, stages: int | None = None,
                                  num_splits: int | None = None,
                                  pingpong: bool = True, pages_per_step: int | None = None,
                                  key_split: bool | None = None, fence_softmax: bool = False,
                                  tiles_adjacent: bool = True, overlap_softmax: bool = False,
                                  partial_dtype=jnp.float32, window: int = 0, heads_io: bool = False,
                                  persistent: bool | None = None, prefetch_query: bool | None = None,
                                  memory_widens_values: bool | None = None, widen_rows: int | None = None,
                                  registers: tuple[int, int] | None = None, merge: bool = True,
                                  kept_rows: int = 0, cast_query: bool | None = None,
                                  cluster_splits: bool | None = None,
                                  interpret: bool = False, config: PrefixMgpuConfig | None = None,
                                  merge_config: MergeConfig | None = None):
    """See the module docstring. `stages`: K/V page buffers in flight (>= 2; None: `default_ring`,
    which also picks `pages_per_step` for the fused FP8 window under a key split); `num_splits`: CTAs
    per (row tile, KV head, request) along the key axis, merged by LSE (None:
    `default_mgpu_num_splits`, one wave of CTAs); `pingpong`: the two compute
    warpgroups take turns on the tensor cores (one's softmax overlaps the other's matmuls);
    `pages_per_step`: pages (one TMA copy each) per key step, so a step's matmuls are
    [64, pages_per_step * page_size] wide (None: `default_pages_per_step`, 2 for 64-token pages);
    `key_split`: both compute warpgroups on the same 64 rows, alternating key steps (None: on
    where a KV head of an FP8 pool has 64 rows; see `warpgroup_layout`); `fence_softmax`: finish
    the softmax (the rescaled accumulator, the row sums and P in the matmul dtype) behind an
    optimization barrier before handing the tensor cores over, so the compiler cannot sink that
    work past the turn, as JAX's Mosaic GPU flash attention orders its step (off by default: it
    is slower at long context; results: fence-softmax);
    `tiles_adjacent`: launch the row tiles of one (request, KV head, split) next to each other, so
    they run at the same time and the second read of each K/V page hits L2 (Mosaic GPU launches the
    grid's last axis fastest; False: the grid (tiles, splits, heads, batch), whose tiles of one head
    are B * Hkv CTAs apart and read every page from HBM again; results: grid-order);
    `overlap_softmax`: each compute warpgroup overlaps its own softmax with its tensor-core work
    instead of taking turns (`pingpong` is then off): step i's scores Q K_i^T and step i - 1's
    P V are issued together, the softmax of step i runs once the scores are in while P V is still
    in flight, and the accumulator is rescaled after it lands (FlashAttention-3's intra-warpgroup
    pipelining). 16-bit pools without a key split only; it conforms but is slower than the
    turn-taking default, so it is off (results: overlap-softmax);
    `partial_dtype`: the dtype the kernel writes `out` in, float32 or bfloat16 (half the bytes for
    this kernel to write and, without key splits, for the window kernel to read; the normalised
    partial is rounded once more, to bf16, before the merge); key-split partials (`num_splits`) are
    merged by `merge_splits` into float32 (fused: `partial_dtype`); a warpgroup key split's two
    merge in the kernel, in fp32, before the CTA's partial is written in `partial_dtype`;
    `window` > 0 fuses the tree window (`window_words [B, 2, T] int32`, `window_union [B, 2] int32`;
    see `fused_window_words`): every row then sees the committed keys [0, P) and window key j
    (position P + j, j < window) iff bit j of its own words is set, so the output is the whole
    cascade's (normalised over prefix and window; key splits still merge by LSE, from float32
    partials whatever `partial_dtype`) and `query_rows` / `group` bound nothing;
    `heads_io` (`heads_io_errors` empty): `qr` is the query in head layout `[B, R, Hq, D]` and the
    result `(out [B, R, Hq, D], lse2 [B, R, Hq])`: each warpgroup reads its 64 rows straight from
    it, G boxes of 64 / G query rows, one per head of the group (rows in the order `head_io_rows`;
    `window_words` in that order), and writes its output the same way, so no transpose runs on
    either side. Unfused it takes `query_rows=1` (every row bounded by P) and `merge=False`, and
    hands the window kernel (`tree_window_row_layout(heads_in=True)`) out `[B, Hkv, R * G, D]` and
    lse2 `[B, Hkv, R * G]` (or `[S, ...]` of each) with rows in the kernel's `head_io_rows` order;
    `persistent`: launch at most one CTA per SM, each looping over work items (split, request, KV
    head, row tile) in the gridded launch's order, so an item's epilogue overlaps the memory
    warpgroup's fetch of the next item's first pages and its output copies the next item's work
    (None: `runs_persistent`);
    `prefetch_query` (persistent only): each compute warpgroup keeps two query tiles (and fused,
    two sets of mask words) and loads the next item's while this one runs, so no item waits for
    its query; it costs one more query tile of shared memory (None: on under the persistent launch
    where that tile fits, `PrefixMgpuConfig.prefetch_query`);
    `memory_widens_values` (FP8 pools): the memory warpgroup widens each step's V page to fp16 once,
    into a 16-bit ring of `stages` steps the compute warpgroups read, instead of each compute
    warpgroup widening its own copy on the critical path of its turn (fused, window steps clean
    their rows of it in place; None: `runs_memory_widens`);
    `widen_rows` (FP8): rows of V widened per piece, by whichever warpgroup widens (a multiple of 64
    dividing the step's keys; None: WIDEN_ROWS), which bounds the registers a piece holds;
    `registers`: (compute, memory) warpgroup register budgets (None: `default_registers`, REGISTERS_MEMORY_WIDENS
    where the memory warpgroup widens V, else REGISTERS);
    `cast_query` (an FP8 pool and a 16-bit query): each compute warpgroup casts the unquantised
    query tile to FP8 for the prefix steps (saturating at +-448, `quantize_query_for_pool`'s
    semantics), so no XLA cast runs before the kernel: fused, the tile it loads for the window
    steps (None: `PrefixMgpuConfig.cast_query_fused`; False: q is cast by XLA and read twice);
    unfused, a tile staged for it in shared memory, fetched for the next item as soon as this one's
    is cast under `prefetch_query` (None: `PrefixMgpuConfig.cast_query_unfused` where that tile fits);
    `merge=False` (unfused only): key-split partials (one per CTA split; a warpgroup key split's two
    are merged in the CTA) are handed on unmerged where there is more than one, out `[S, B, Hkv, T, D]` and lse2
    `[S, B, Hkv, T]`, for the window kernel to merge (`tree_window_row_layout`);
    `kept_rows` k > 0 (row layout, merged): the result holds only each KV head's first k rows,
    out `[B, Hkv, k, D]` and lse2 `[B, Hkv, k]` (the real rows of a padded tile; a key-split merge
    then reads and writes only those, `merge_splits(kept_rows=k)`, so no slice runs after it);
    `cluster_splits` (fused, gridded): the key splits of one (request, KV head, row tile) run as
    one thread-block cluster; each split's CTA owns a block of D / S output columns, sends every
    other split its block of its partial (and its lse2) straight into that CTA's shared memory
    (`plgpu.async_store_smem`, completing a barrier there), merges the S partials of its own
    block by LSE in fp32 and writes it in `partial_dtype`: no merge kernel runs and no float32
    partial goes through memory (None: `PrefixMgpuConfig.cluster_splits` where `cluster_split_errors` is
    empty, the split count is in CLUSTER_SPLIT_DEFAULT_SIZES and the inbox fits shared memory;
    Pallas' GPU interpreter has no clusters, so there the splits merge through `merge_splits`
    whatever this says);
    `interpret` runs Pallas' Mosaic GPU interpreter (CPU tests);
    `config`: the default rules the knobs left None follow (`PrefixMgpuConfig`; None:
    `default_config()`); `merge_config`: the launch of `merge_splits` where key splits merge there
    (None: `split_merge.default_config()`)."""
    config = default_config() if config is None else config
    fused = window > 0
    if kept_rows and (heads_io or not merge or kept_rows < 0 or kept_rows > qr.shape[2]):
        raise ValueError(f"prefix_decode_mgpu: kept_rows takes the merged row layout and at most its "
                         f"{qr.shape[2]} rows a KV head, got kept_rows={kept_rows}, heads_io={heads_io}, "
                         f"merge={merge}")
    if fused and not merge:
        raise ValueError("prefix_decode_mgpu: merge=False hands key splits to the window kernel, which a "
                         "fused window (window > 0) does not run")
    q_in = qr
    if heads_io:
        errors = heads_io_errors(qr.shape[1], qr.shape[2] // k_pool.shape[1])
        if not fused and (query_rows != 1 or merge):
            # Unfused, every row must share one key bound (the kernel's rows are in head_io_rows
            # order, not r * G + g) and the partials go to the window kernel, which reads that order.
            errors.append(f"prefix_decode_mgpu: heads_io without the fused window needs every row bounded by P "
                          f"(query_rows=1, got {query_rows}) and the partials handed on unmerged (merge=False, "
                          f"got {merge})")
        if errors:
            raise ValueError("; ".join(errors))
        # The row-layout shape the kernel works in (rows in `head_io_rows` order).
        rq, hq_in = qr.shape[1], qr.shape[2]
        qr = jax.ShapeDtypeStruct((qr.shape[0], k_pool.shape[1], rq * hq_in // k_pool.shape[1], qr.shape[3]),
                                  qr.dtype)
    if stages is None:
        stages, pages_per_step = default_ring(qr.shape[2], qr.shape[3], k_pool.dtype, page_size, fused, key_split,
                                              pages_per_step)
    check_mgpu_inputs(qr, k_pool, v_pool, page_size, stages, pages_per_step, key_split)
    check_fused_window_inputs(qr, window_words, window_union, window, overlap_softmax)
    partial_dtype = check_partial_dtype(partial_dtype, "prefix_decode_mgpu")
    # Under an FP8 pool the scores multiply the FP8 query natively (wgmma e4m3 x e4m3; K is the
    # K-major operand FP8 needs); V is not, so each step's V page is widened to fp16 in shared memory.
    fp8 = jnp.dtype(k_pool.dtype) == F8
    itemsize = jnp.dtype(k_pool.dtype).itemsize
    b, hkv, total, d = qr.shape
    # Fused under an FP8 pool, window steps score the unquantised query against K widened in shared
    # memory (as the window kernel does), so the kernel takes the query twice.
    q_wide = q_in if fused and fp8 else None
    fused_fp8 = q_wide is not None
    if q_wide is not None and jnp.dtype(q_wide.dtype).itemsize != 2:
        raise ValueError(f"prefix_decode_mgpu: the fused window under an FP8 pool needs a bfloat16 or float16 "
                         f"query (its window scores use it unquantised), got {q_wide.dtype}")
    # Unfused, the kernel may cast a 16-bit query itself too (staging it in shared memory).
    unfused_cast = fp8 and not fused and jnp.dtype(q_in.dtype).itemsize == 2
    if cast_query and not (fused_fp8 or unfused_cast):
        raise ValueError(f"prefix_decode_mgpu: cast_query=True takes an FP8 pool and a 16-bit query, got "
                         f"{jnp.dtype(q_in.dtype).name} queries over {jnp.dtype(k_pool.dtype).name} pools")
    group_io = total // q_in.shape[1] if heads_io else 0  # G: heads per KV head
    # Unfused, the partial is written by rows in the kernel's (head_io_rows) order, [B, Hkv, T, D]:
    # whole contiguous boxes, faster to write than G boxes of 64 / G rows strided by Hq
    # rows (the window kernel gathers its rows from that order).
    heads_out = heads_io and fused
    rows_io = ROWS_PER_WG // group_io if heads_io else 0  # query rows per box
    max_pages = page_table.shape[1]
    wgs, rows_per_cta, key_split = warpgroup_layout(total, key_split, itemsize)
    if overlap_softmax and (fp8 or fence_softmax or key_split):
        raise ValueError(f"prefix_decode_mgpu: overlap_softmax takes 16-bit pools without a warpgroup key split or "
                         f"the softmax fence, got {jnp.dtype(k_pool.dtype).name} pools, key_split={key_split}, "
                         f"fence_softmax={fence_softmax}")
    # Under a key split each warpgroup takes every other step of the CTA's range and owns a partial.
    stride = 2 if key_split else 1
    pingpong = pingpong and wgs == 2 and not overlap_softmax  # turns need two warpgroups; overlap replaces them
    tiles = total // rows_per_cta
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"prefix_decode_mgpu: num_splits must be >= 1, got {num_splits}")
    if memory_widens_values is None:
        # On where the ring fits at the pages per step the kernel would take without it (the
        # fused window: with it, one page per step where two no longer fit).
        memory_widens_values = fp8 and widens_values_by_default(total, d, page_size, stages, fused_fp8, pages_per_step,
                                                                key_split, config)
    pps = pages_per_step or default_pages_per_step(total, d, itemsize, page_size, stages, key_split, fused_fp8,
                                                   memory_widens_values)
    if cast_query is None:
        # Unfused, by default only where the staging tile fits beside the rest.
        cast_query = config.cast_query_fused if fused_fp8 else (
            unfused_cast and config.cast_query_unfused
            and smem_bytes(total, d, itemsize, page_size * pps, stages, key_split,
                           memory_widens_values=memory_widens_values, wide_query=True) <= MAX_SMEM_BYTES)
    cast_query = bool(cast_query)
    # Cast here, the query stays unquantised (its shape is all the kernel's layout reads); the kernel's
    # query tiles hold FP8 either way.
    q_in = q_in if cast_query else quantize_query_for_pool(q_in, k_pool.dtype)
    # Each compute warpgroup's shared-memory tile of the unquantised query: the fused FP8 window's
    # (its window steps score it), or the unfused in-kernel cast's staging tile (`wide_query`).
    wide_query = cast_query and not fused
    stages_wide = q_wide is not None or wide_query
    qw_dtype = qr.dtype if stages_wide else None
    steps = -(-max_pages // pps)  # key steps of a full page table
    splits = num_splits or default_mgpu_num_splits(b, hkv, tiles, steps)
    block = page_size * pps
    merged_dtype = partial_dtype if fused else jnp.dtype(jnp.float32)
    items = b * hkv * tiles * splits
    persistent = runs_persistent(items, persistent, itemsize, memory_widens_values, config)
    cluster_errors = cluster_split_errors(fused, splits, d, persistent)
    if cluster_splits and cluster_errors:
        raise ValueError("; ".join(cluster_errors))
    if cluster_splits is None:
        # By default only where one warpgroup writes the CTA's rows (64-row heads: the forms GPU
        # conformance and timings cover); two row-owning warpgroups clustered lower but are unverified
        # on a GPU, so they run only when asked.
        cluster_splits = (config.cluster_splits and not cluster_errors and splits in CLUSTER_SPLIT_DEFAULT_SIZES
                          and (key_split or wgs == 1) and smem_bytes(
                              total, d, itemsize, block, stages, key_split, fused_fp8=fused_fp8,
                              memory_widens_values=memory_widens_values, cluster_splits=splits) <= MAX_SMEM_BYTES)
    # Interpreted, a clustered launch's splits merge through merge_splits (no clusters there).
    clustered = bool(cluster_splits) and not interpret
    # Under a warpgroup key split warpgroup 1 hands its (out, lse2) to warpgroup 0, which merges the
    # two and writes one partial per CTA (`_merge_key_split`), so a CTA split writes one partial; a
    # clustered launch's splits merge among themselves and write the output once.
    parts = 1 if clustered else splits
    if fused and parts > 1:
        # Fused, `partial_dtype` is the output's: key-split partials stay float32 until merged
        # (the merge writes the output in it).
        partial_dtype = jnp.dtype(jnp.float32)
    # The staging tile keeps its bytes: 32 fp32 or 64 bf16 output columns per piece; under a key
    # split 32 columns whatever the dtype, the pieces warpgroup 1 hands over in fp32.
    out_chunk = OUT_CHUNK if key_split or clustered else OUT_CHUNK * 4 // partial_dtype.itemsize
    dtype = jnp.dtype(k_pool.dtype) if cast_query else q_in.dtype
    pv_dtype = jnp.float16 if fp8 else dtype  # P V operands: FP8 V widens exactly to fp16
    # Fused FP8 window steps widen K to the query's dtype (exact for E4M3) in a tile that shares
    # its memory with the widened V (a RefUnion: K's tile is read by the scores before V is written).
    kw_dtype = q_wide.dtype if q_wide is not None else None
    scale2 = float(scale) * LOG2E

    # A clustered launch's splits are its cluster axis "csplit", not a grid axis.
    sizes, order = grid_in_order(dict(batch=b, heads=hkv, tiles=tiles, splits=1 if clustered else splits),
                                 tiles_adjacent)
    ctas = min(items, num_sms())
    grid, grid_names = ((ctas,), ("ctas",)) if persistent else (sizes, order)
    prefetch_query = runs_prefetch_query(prefetch_query, persistent, smem_bytes(
        total, d, itemsize, block, stages, key_split, fused_fp8=fused_fp8, query_tiles=2,
        memory_widens_values=memory_widens_values, wide_query=wide_query), config)
    if prefetch_query and not persistent:
        raise ValueError("prefix_decode_mgpu: prefetch_query needs the persistent launch (persistent=True, or "
                         f"None with more work items than SMs), got persistent={persistent} for {items} items")
    qbufs = 2 if prefetch_query else 1
    if memory_widens_values and not fp8:
        raise ValueError(f"prefix_decode_mgpu: memory_widens_values takes an FP8 pool, got "
                         f"{jnp.dtype(k_pool.dtype).name} pools")
    widen_rows = widen_rows or WIDEN_ROWS
    regs_compute, regs_memory = registers or default_registers(memory_widens_values)
    tuning_errors = []
    if widen_rows % ROWS_PER_WG or block % widen_rows:
        tuning_errors.append(f"widen_rows must be a multiple of {ROWS_PER_WG} dividing the step's {block} keys, "
                             f"got {widen_rows}")
    tuning_errors += register_budget_errors((regs_compute, regs_memory), wgs)
    if tuning_errors:
        raise ValueError("prefix_decode_mgpu: " + "; ".join(tuning_errors))
    # The buffers the kernel's input checks do not size: the fused FP8 window's, prefetch's.
    extras = ((["the fused window under an FP8 pool"] if fused_fp8 else [])
              + (["cast_query's unquantised query tile"] if wide_query else [])
              + (["prefetch_query's second query tile"] if prefetch_query else [])
              + (["memory_widens_values' 16-bit V ring"] if memory_widens_values else [])
              + (["cluster_splits' inbox"] if cluster_splits else []))
    need = smem_bytes(total, d, itemsize, block, stages, key_split, fused_fp8=fused_fp8, query_tiles=qbufs,
                      memory_widens_values=memory_widens_values, cluster_splits=splits if cluster_splits else 1,
                      wide_query=wide_query)
    if extras and need > MAX_SMEM_BYTES:
        raise ValueError(f"prefix_decode_mgpu: {' with '.join(extras)} with pages_per_step={pps}, "
                         f"stages={stages}, head dim {d} needs {need} bytes of shared memory, more than "
                         f"{MAX_SMEM_BYTES}")

    plan = _Plan(
        d=d, page_size=page_size, pps=pps, block=block, stages=stages,
        window=window, query_rows=query_rows, group=group, dtype=dtype, pv_dtype=pv_dtype, kw_dtype=kw_dtype,
        qw_dtype=qw_dtype, partial_dtype=partial_dtype, fp8=fp8, fused=fused, fused_fp8=fused_fp8,
        cast_query=cast_query, wide_query=wide_query, stages_wide=stages_wide,
        memory_widens_values=memory_widens_values, widen_rows=widen_rows, wgs=wgs, rows_per_cta=rows_per_cta,
        key_split=key_split, stride=stride, pingpong=pingpong, overlap_softmax=overlap_softmax,
        fence_softmax=fence_softmax, scale2=scale2, registers=(regs_compute, regs_memory), heads_io=heads_io,
        heads_out=heads_out, group_io=group_io, rows_io=rows_io, persistent=persistent,
        prefetch_query=prefetch_query, qbufs=qbufs, items=items, ctas=ctas, sizes=sizes, order=order,
        splits=splits, clustered=clustered, out_chunk=out_chunk, interpret=interpret)

    def entry(*refs):  # the kernel takes its name from this function
        _kernel(plan, *refs)

    out, lse = plgpu.kernel(
        entry,
        out_type=(jax.ShapeDtypeStruct((parts,) + (q_in.shape if heads_out else (b, hkv, total, d)), partial_dtype),
                  jax.ShapeDtypeStruct((parts, b, hkv, total), jnp.float32)),
        grid=grid,
        grid_names=grid_names,
        cluster=(splits,) if clustered else (),
        cluster_names=("csplit",) if clustered else (),
        num_threads=wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        # Pallas' GPU interpreter simulates shared memory, TMA and barriers on the CPU.
        interpret=plgpu.InterpretGPUParams() if interpret else False,
    )(q_in, k_pool, v_pool, page_table.astype(jnp.int32), lengths.astype(jnp.int32),
      *((window_words, window_union) if fused else ()), *((q_wide,) if q_wide is not None and not cast_query else ()))
    if parts > 1:
        if not merge:
            return out, lse
        return merge_splits(out, lse, out_dtype=merged_dtype, backend="interpret" if interpret else None,
                            heads_group=group_io, kept_rows=kept_rows, config=merge_config)
    if kept_rows:
        return out[0][:, :, :kept_rows], lse[0][:, :, :kept_rows]
    return out[0], head_io_rows(lse[0], group_io, inverse=True) if heads_out else lse[0]


def heads_io_errors(query_rows: int, group: int) -> list[str]:
    """Why the kernel cannot read q and write its output in head layout (empty: it can): each
    warpgroup's 64 rows are one tile of the `head_io_rows` order (`head_io_rows_errors`)."""
    return head_io_rows_errors(query_rows, group, "prefix_decode_mgpu: heads_io")


# The kernel, one function a stage. A CTA runs `_kernel` -> `_kernel_body` -> one `_work_item` per
# (split, request, KV head, row tile) (under a persistent launch, `_persistent_items` loops over
# them). In a work item the memory warpgroup runs `_fetch_pages`; each compute warpgroup runs
# `_compute_item`, whose stages read top to bottom: query tile loads (`_issue_query_loads`), the
# per-step key masks (`_key_masks`), the query tile made ready (`_ready_query`), the key loop
# (`_key_steps`: `_turn_taking_step` = `_step_scores`, the online softmax, `_value_tile`,
# `_add_values`; or `_overlapped_steps`), the normalised partial (`_normalised`) and the epilogue
# (`_epilogue`: `_write_partial`, or first `_merge_key_split` / `_merge_in_cluster`). Python function
# boundaries vanish under tracing: the order of the calls is the order of the kernel's operations.


@dataclasses.dataclass(frozen=True)
class _Plan:
    """The static choices of one launch of the prefix kernel (what `prefix_decode_mgpu_row_layout`
    decided from its shapes, knobs and config), read by every stage."""
    d: int  # head dim D
    page_size: int
    pps: int  # pages per key step
    block: int  # keys per step: pps * page_size
    stages: int  # K/V ring buffers
    window: int  # fused tree window (0: unfused)
    query_rows: int
    group: int
    dtype: object  # the query tile's and the K/V ring's dtype
    pv_dtype: object  # P V operands (fp16 over FP8 pools)
    kw_dtype: object  # the fused FP8 window's widened K (None elsewhere)
    qw_dtype: object  # the unquantised query tile's (None where the kernel stages none)
    partial_dtype: object  # the dtype the kernel writes `out` in
    fp8: bool
    fused: bool
    fused_fp8: bool  # fused over an FP8 pool: window steps score the unquantised query
    cast_query: bool
    wide_query: bool  # unfused in-kernel cast: each compute warpgroup stages the unquantised tile
    stages_wide: bool  # some unquantised query tile is staged (fused_fp8 or wide_query)
    memory_widens_values: bool
    widen_rows: int
    wgs: int  # compute warpgroups
    rows_per_cta: int
    key_split: bool
    stride: int  # a compute warpgroup's key steps are every stride-th of the CTA's
    pingpong: bool
    overlap_softmax: bool
    fence_softmax: bool
    scale2: float  # softmax scale times log2(e)
    registers: tuple[int, int]  # (compute, memory) setmaxnreg budgets
    heads_io: bool
    heads_out: bool  # the output leaves in head layout
    group_io: int  # heads_io: G, heads per KV head (else 0)
    rows_io: int  # heads_io: query rows per box (else 0)
    persistent: bool
    prefetch_query: bool
    qbufs: int  # query tiles per compute warpgroup
    items: int  # work items (split, request, KV head, row tile)
    ctas: int  # persistent launch: CTAs
    sizes: tuple[int, ...]  # the gridded launch's axis sizes, in `order`
    order: tuple[str, ...]
    splits: int
    clustered: bool
    out_chunk: int  # output columns per staging piece
    interpret: bool

    @property
    def inbox_pieces(self) -> int:
        """cluster_splits: OUT_CHUNK-column pieces of one split's column block."""
        return self.d // self.splits // OUT_CHUNK

    @property
    def pieces(self) -> int:
        """out_chunk-column pieces of a [64, D] output tile."""
        return self.d // self.out_chunk


@dataclasses.dataclass(frozen=True)
class _Buffers:
    """The kernel's refs: its inputs and outputs in global memory, its shared-memory buffers and
    barriers (None where the launch has none). Ring buffers are [stages, block, D], a compute
    warpgroup's tiles [64, D] at its index."""
    q: object  # [B, Hkv, T, D] FP8 or 16-bit (heads_io: [B, R, Hq, D]); None under cast_query
    k: object  # [S, Hkv, D]
    v: object
    page_table: object  # [B, maxp] int32
    lengths: object  # [B] int32
    words: object  # fused: [B, 2, T] int32
    union: object  # fused: [B, 2] int32
    q_wide: object  # the unquantised query (fused FP8 or cast_query), shaped as q
    out: object  # [parts, B, Hkv, T, D] (heads_out: [parts, B, R, Hq, D])
    lse: object  # [parts, B, Hkv, T] f32
    q_smem: object  # [qbufs * wgs, 64, D]
    k_smem: object
    v_smem: object
    o_smem: object  # [wgs, 64, out_chunk] output staging in partial_dtype
    x_smem: object  # key split: the same memory as [wgs, 64, OUT_CHUNK] f32 for the hand-over
    lse_smem: object  # [wgs, 64] f32
    v_wide: object  # FP8: widened V, [stages or wgs, block, D] fp16
    k_wide: object  # fused FP8: widened K, [wgs, block, D]
    words_smem: object  # fused: [qbufs * wgs, 2, 64] int32
    qw_smem: object  # [wgs, 64, D] unquantised query tiles
    q_ready: object
    k_ready: object
    v_ready: object
    k_free: object
    v_free: object
    turn: object
    vw_ready: object
    vw_free: object
    x_ready: object
    x_free: object
    words_ready: object
    qw_ready: object
    inbox: object  # clustered: [owners, S - 1, inbox_pieces, 64, OUT_CHUNK] f32
    inbox_lse: object  # clustered: [owners, S - 1, 64, OUT_CHUNK] f32
    inbox_ready: object


@dataclasses.dataclass(frozen=True)
class _Item:
    """One work item (split, request `bi`, KV head, row tile) and its key steps [lo, hi)."""
    split: object
    bi: object
    head: object
    tile: object
    length: object  # P, the request's committed keys
    cta_row0: object  # the CTA's first row of T
    whole: object  # unfused: (P // page_size) * page_size (None fused)
    lo: object
    hi: object
    page_limit: object  # pages from here on are not read (a step's later page repeats its first)


@dataclasses.dataclass(frozen=True)
class _Rows:
    """One compute warpgroup's share of a work item."""
    wg: object  # the warpgroup's index
    row0: object  # its first row of T (the kernel's row layout)
    first: object  # its first key step; it takes every `stride`-th from there
    r0: object  # heads_io: its first query row in head layout (its boxes' start); else None
    qb: object  # its query tile's buffer of the qbufs * wgs


@dataclasses.dataclass(frozen=True)
class _Masks:
    """Which keys a compute warpgroup's rows see in a step."""
    visible: object  # visible(i) -> [64, block] bool for step i
    open_end: object  # steps [lo, open_end) are seen whole by every row (no mask)
    union: object  # fused: (word 0, word 1) of the window slots some row sees; else None


def _scratch(plan: _Plan) -> tuple:
    """The shared-memory buffers and barriers of one CTA, in `_buffers`' order (run_scoped's
    arguments)."""
    d, block, stages, wgs, qbufs = plan.d, plan.block, plan.stages, plan.wgs, plan.qbufs
    in_tf = _smem_transforms(d, plan.dtype)
    readers = 1 if plan.key_split else wgs  # compute warpgroups that read each step's K and V
    # FP8: widened V (the memory warpgroup's ring, or each compute warpgroup's tile); fused, with
    # widened K beside it, or sharing its memory (K's tile is read before V is written).
    wide_smem = ()
    if plan.fp8:
        wide_smem = plgpu.SMEM((stages if plan.memory_widens_values else wgs, block, d), plan.pv_dtype,
                               transforms=_smem_transforms(d, plan.pv_dtype))
        if plan.fused_fp8:
            k_tile = plgpu.SMEM((wgs, block, d), plan.kw_dtype, transforms=_smem_transforms(d, plan.kw_dtype))
            wide_smem = (wide_smem, k_tile) if plan.memory_widens_values else plgpu.RefUnion(wide_smem, k_tile)
        wide_smem = (wide_smem,)

    out_staging = plgpu.SMEM((wgs, ROWS_PER_WG, plan.out_chunk), plan.partial_dtype,
                             transforms=_smem_transforms(plan.out_chunk, plan.partial_dtype))
    x_tf = _smem_transforms(OUT_CHUNK, jnp.float32)  # fp32 pieces handed between warpgroups or CTAs
    owners = 1 if plan.key_split else wgs  # warpgroups that write rows (under a key split warpgroup 0)
    splits, inbox_pieces = plan.splits, plan.inbox_pieces
    return (
        (plgpu.SMEM((qbufs * wgs, ROWS_PER_WG, d), plan.dtype, transforms=in_tf),
         plgpu.SMEM((stages, block, d), plan.dtype, transforms=in_tf),
         plgpu.SMEM((stages, block, d), plan.dtype, transforms=in_tf),
         plgpu.RefUnion(out_staging, plgpu.SMEM((wgs, ROWS_PER_WG, OUT_CHUNK), jnp.float32, transforms=x_tf))
         if plan.key_split else out_staging,
         plgpu.SMEM((wgs, ROWS_PER_WG), jnp.float32))
        + wide_smem
        + ((plgpu.SMEM((qbufs * wgs, 2, ROWS_PER_WG), jnp.int32), plgpu.Barrier(num_barriers=qbufs * wgs))
           if plan.fused else ())
        + ((plgpu.SMEM((wgs, ROWS_PER_WG, d), plan.qw_dtype, transforms=_smem_transforms(d, plan.qw_dtype)),
            plgpu.Barrier(num_arrivals=plan.group_io or 1, num_barriers=wgs)) if plan.stages_wide else ()),
        (plgpu.Barrier(num_arrivals=plan.group_io or 1, num_barriers=qbufs * wgs),
         plgpu.Barrier(num_arrivals=plan.pps, num_barriers=stages),
         plgpu.Barrier(num_arrivals=plan.pps, num_barriers=stages)),
        # A step's buffers are released by every warpgroup that reads them: both, or under a
        # key split the one warpgroup that owns the step (the FP8 V page by the memory warpgroup
        # when it widens it).
        (plgpu.Barrier(num_arrivals=readers, num_barriers=stages),
         plgpu.Barrier(num_arrivals=1 if plan.memory_widens_values else readers, num_barriers=stages)),
        plgpu.Barrier(num_arrivals=wgs),
        # memory_widens_values: the 16-bit V ring's (ready, free) barriers.
        *((plgpu.Barrier(num_arrivals=1, num_barriers=stages),
           plgpu.Barrier(num_arrivals=readers, num_barriers=stages)) if plan.memory_widens_values else ()),
        # Key split: warpgroup 1's hand-over pieces (ready, free).
        *((plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=1)) if plan.key_split else ()),
        # cluster_splits: each row owner's inbox (the other splits' pieces of this CTA's column
        # block, their lse2 broadcast over a piece) and its barrier, which each of those stores
        # completes (one warpgroup arrival per store).
        *(((plgpu.SMEM((owners, splits - 1, inbox_pieces, ROWS_PER_WG, OUT_CHUNK), jnp.float32, transforms=x_tf),
            plgpu.SMEM((owners, splits - 1, ROWS_PER_WG, OUT_CHUNK), jnp.float32, transforms=x_tf),
            plgpu.Barrier(num_arrivals=(splits - 1) * (inbox_pieces + 1), num_barriers=owners)),)
          if plan.clustered else ()),
    )


def _kernel(plan: _Plan, q_gmem, k_gmem, v_gmem, pt_gmem, len_gmem, *rest):
    """The kernel's global-memory refs (inputs, then out and lse2), in `plgpu.kernel`'s order: q
    (or, under cast_query, the unquantised query in its place), the pools, the page table, the
    lengths, fused the mask words and their union, the unquantised query where both are read."""
    words_gmem, union_gmem = rest[:2] if plan.fused else (None, None)
    qw_gmem = rest[2] if plan.fused_fp8 and not plan.cast_query else None
    if plan.cast_query:  # one query input, the unquantised one
        q_gmem, qw_gmem = None, q_gmem
    out_gmem, lse_gmem = rest[-2:]
    gmem = (q_gmem, k_gmem, v_gmem, pt_gmem, len_gmem, words_gmem, union_gmem, qw_gmem, out_gmem, lse_gmem)
    pl.run_scoped(lambda *scoped: _kernel_body(plan, gmem, scoped), *_scratch(plan), collective_axes="wg")


def _buffers(plan: _Plan, gmem: tuple, scoped: tuple) -> _Buffers:
    """Names the global refs `gmem` and the allocations `scoped` (`_scratch`'s order)."""
    inbox = (None, None, None)
    if plan.clustered:  # cluster_splits: each row owner's inbox of the other splits' pieces and LSEs
        *scoped, inbox = scoped
    (q_smem, k_smem, v_smem, o_smem, lse_smem, *extra), (q_ready, k_ready, v_ready), (k_free, v_free), turn, \
        *tail = scoped
    vw_ready, vw_free = tail[:2] if plan.memory_widens_values else (None, None)
    # Key split: the output staging in the partial's dtype and, over the same memory, in fp32 for
    # warpgroup 1's hand-over (each slot is used through one view only); its (ready, free) barriers.
    o_smem, x_smem = o_smem if plan.key_split else (o_smem, None)
    x_ready, x_free = tail[-2:] if plan.key_split else (None, None)
    v_wide = extra[0] if plan.fp8 else None
    k_wide = None
    if plan.fused_fp8:  # (widened V, widened K): one RefUnion, or the V ring and K's own tile
        v_wide, k_wide = extra[0][0], extra[0][1]
    words_smem, words_ready = extra[1 if plan.fp8 else 0:][:2] if plan.fused else (None, None)
    qw_smem, qw_ready = extra[-2:] if plan.stages_wide else (None, None)
    q, k, v, page_table, lengths, words, union, q_wide, out, lse = gmem
    return _Buffers(q=q, k=k, v=v, page_table=page_table, lengths=lengths, words=words, union=union, q_wide=q_wide,
                    out=out, lse=lse, q_smem=q_smem, k_smem=k_smem, v_smem=v_smem, o_smem=o_smem, x_smem=x_smem,
                    lse_smem=lse_smem, v_wide=v_wide, k_wide=k_wide, words_smem=words_smem, qw_smem=qw_smem,
                    q_ready=q_ready, k_ready=k_ready, v_ready=v_ready, k_free=k_free, v_free=v_free, turn=turn,
                    vw_ready=vw_ready, vw_free=vw_free, x_ready=x_ready, x_free=x_free, words_ready=words_ready,
                    qw_ready=qw_ready, inbox=inbox[0], inbox_lse=inbox[1], inbox_ready=inbox[2])


def _kernel_body(plan: _Plan, gmem: tuple, scoped: tuple):
    """One CTA: its work item (gridded), or its share of them (persistent)."""
    bufs = _buffers(plan, gmem, scoped)
    wg = lax.axis_index("wg")
    if not plan.persistent:
        _work_item(plan, bufs, wg, lax.axis_index("csplit" if plan.clustered else "splits"),
                   lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("tiles"), role="cta")
        return
    _persistent_items(plan, bufs, wg)


def _persistent_items(plan: _Plan, bufs: _Buffers, wg):
    """Persistent: CTA c takes work items c, c + ctas, ... in the gridded launch order, so while one
    item's epilogue runs the memory warpgroup already fetches the next item's first pages. Each
    item balances every barrier's arrivals and waits (the memory warpgroup drains its ring), so
    the ring restarts clean at slot 0. Each side loops inside its own register budget (set once,
    in the same branch as the loop, where the register allocator sees it)."""

    def item_axes(t):
        axis = {}
        for name, size in zip(plan.order[::-1], plan.sizes[::-1]):  # the last axis runs fastest
            axis[name] = lax.rem(t, jnp.int32(size))
            t = lax.div(t, jnp.int32(size))
        return axis

    def items_of_this_cta(role: str):
        cta = lax.axis_index("ctas")

        @pl.loop(cta, plan.items, step=plan.ctas)
        def _(t):
            axis = item_axes(t)
            nxt = None
            if plan.prefetch_query and role == "compute":
                following = item_axes(jnp.minimum(t + plan.ctas, plan.items - 1))
                nxt = (lax.div(t - cta, jnp.int32(plan.ctas)), t + plan.ctas < plan.items,
                       (following["batch"], following["heads"], following["tiles"]))
            _work_item(plan, bufs, wg, axis["splits"], axis["batch"], axis["heads"], axis["tiles"], role=role,
                       nxt=nxt)

    @pl.when(wg < plan.wgs)
    def _compute_items():
        plgpu.set_max_registers(plan.registers[0], action="increase")
        items_of_this_cta("compute")
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == plan.wgs)
    def _memory_items():
        plgpu.set_max_registers(plan.registers[1], action="decrease")
        items_of_this_cta("memory")


def _work_item(plan: _Plan, bufs: _Buffers, wg, split, bi, head, tile, role: str, nxt=None):
    """One (split, request, KV head, row tile): the whole CTA program of the gridded launch
    (`role` "cta": every warpgroup, setting its registers), or under a persistent launch one side
    of it, "compute" or "memory", run by warpgroups already on that side. `nxt`
    (`prefetch_query`): (this CTA's item count so far, whether a next item exists, its (request,
    KV head, row tile)), whose query tile is loaded while this item runs."""
    item = _item_keys(plan, bufs, split, bi, head, tile)
    if role == "cta":
        pl.when(wg < plan.wgs)(lambda: _compute_item(plan, bufs, item, wg, role, nxt))
        pl.when(wg == plan.wgs)(lambda: _fetch_pages(plan, bufs, item, role))
    elif role == "compute":
        _compute_item(plan, bufs, item, wg, role, nxt)
    else:
        _fetch_pages(plan, bufs, item, role)


def _item_keys(plan: _Plan, bufs: _Buffers, split, bi, head, tile) -> _Item:
    """The work item's key steps [lo, hi) and the pages its memory warpgroup may read."""
    length = bufs.lengths[bi]
    cta_row0 = tile * plan.rows_per_cta
    whole = None
    if plan.fused:
        # Every row reads [0, P + window): committed keys and the window under its mask bits.
        # Pages from cdiv(P + window, page) on may be unmapped (the memory warpgroup repeats a
        # step's first page there); V rows no row may see are zeroed before P V.
        lo, hi = fused_key_blocks(length, plan.window, plan.block, split, plan.splits)
        page_limit = lax.div(length + plan.window + plan.page_size - 1, jnp.int32(plan.page_size))
    else:
        whole, lo, hi = cta_key_blocks(length, plan.page_size, plan.query_rows, plan.group, cta_row0,
                                       plan.rows_per_cta, plan.block, split, plan.splits)
        page_limit = lax.div(whole, jnp.int32(plan.page_size))
    return _Item(split, bi, head, tile, length, cta_row0, whole, lo, hi, page_limit)


def _slot_of(plan: _Plan, item: _Item, i):
    """The K/V ring buffer of key step i."""
    if not plan.key_split:
        return lax.rem(i - item.lo, jnp.int32(plan.stages))
    # Each warpgroup owns half of the ring: a barrier's phase is tracked by each thread that waits
    # on it, so a buffer waited on by both warpgroups in turn would desynchronise their phases
    # (reads of stale pages, then a hang; the GPU interpreter does not show this).
    rel = i - item.lo
    half = plan.stages // 2
    return lax.rem(rel, jnp.int32(2)) * half + lax.rem(lax.div(rel, jnp.int32(2)), jnp.int32(half))


def _take_turn(bufs: _Buffers):
    """Hands the tensor cores to the other compute warpgroup and waits for them back."""
    plgpu.barrier_arrive(bufs.turn)
    plgpu.barrier_wait(bufs.turn)


def _widen_page(plan: _Plan, bufs: _Buffers, dst, slot, clean=None):
    """The FP8 V page [block, D] in ring `slot` into the 16-bit tile `dst`, widen_rows rows at a
    time (only a piece's registers live at once); `clean(piece, first_row)` zeroes unseen rows."""
    for r in range(0, plan.block, plan.widen_rows):
        rows = pl.ds(r, plan.widen_rows)
        piece = plgpu.load(bufs.v_smem.at[slot, rows], layout=plgpu.Layout.WGMMA).astype(plan.pv_dtype)
        dst.at[rows][...] = piece if clean is None else clean(piece, r)


# The memory warpgroup.

def _fetch_pages(plan: _Plan, bufs: _Buffers, item: _Item, role: str):
    """The memory warpgroup's side of a work item: one TMA copy a page of K and of V per step into
    the ring (waiting until its readers released the buffer), FP8 V widened into the 16-bit ring
    under `memory_widens_values`, then the ring drained."""
    if role == "cta":
        plgpu.set_max_registers(plan.registers[1], action="decrease")
    lo, hi, stages = item.lo, item.hi, plan.stages

    @pl.loop(lo, hi)
    def _fetch(i):
        slot = _slot_of(plan, item, i)

        @pl.when(i - lo >= stages)
        def _():
            plgpu.barrier_wait(bufs.k_free.at[slot])

        for j in range(plan.pps):  # one TMA copy (one arrival on the step's barrier) per page
            plgpu.copy_gmem_to_smem(bufs.k.at[_page_rows(plan, bufs, item, i, j), item.head],
                                    bufs.k_smem.at[slot, pl.ds(j * plan.page_size, plan.page_size)],
                                    bufs.k_ready.at[slot])

        @pl.when(i - lo >= stages)
        def _():
            plgpu.barrier_wait(bufs.v_free.at[slot])

        for j in range(plan.pps):
            plgpu.copy_gmem_to_smem(bufs.v.at[_page_rows(plan, bufs, item, i, j), item.head],
                                    bufs.v_smem.at[slot, pl.ds(j * plan.page_size, plan.page_size)],
                                    bufs.v_ready.at[slot])

        if plan.memory_widens_values:  # the previous step's V, while this step's pages fly
            pl.when(i > lo)(lambda: _widen_ring_values(plan, bufs, item, i - 1))

    if plan.memory_widens_values:
        pl.when(hi > lo)(lambda: _widen_ring_values(plan, bufs, item, hi - 1))

    # Observe the last release of every buffer used, so no barrier phase is left unseen when the
    # scope ends (the GPU interpreter checks this).
    @pl.loop(jnp.maximum(hi - stages, lo), hi)
    def _drain(i):
        slot = _slot_of(plan, item, i)
        plgpu.barrier_wait(bufs.k_free.at[slot])
        plgpu.barrier_wait(bufs.v_free.at[slot])
        if plan.memory_widens_values:
            plgpu.barrier_wait(bufs.vw_free.at[slot])


def _page_rows(plan: _Plan, bufs: _Buffers, item: _Item, i, j):
    """The pool rows of page j of step i. A step's later page past the last one read (the last
    whole page, or fused the last mapped one) repeats the step's first page instead: its keys are
    masked, and (unfused) finite V rows keep the zero softmax weights from turning into NaN (the
    partial page may hold anything)."""
    page = i * plan.pps + j
    page = jnp.where(page < item.page_limit, page, i * plan.pps) if j else page
    return pl.ds(bufs.page_table[item.bi, page] * plan.page_size, plan.page_size)


def _widen_ring_values(plan: _Plan, bufs: _Buffers, item: _Item, i):
    """Step i's FP8 V page into the 16-bit ring (slot i's last readers, step i - stages's P V, have
    released it); then the FP8 buffer is released (to this warpgroup's own next copy into it)."""
    slot = _slot_of(plan, item, i)
    plgpu.barrier_wait(bufs.v_ready.at[slot])

    @pl.when(i - item.lo >= plan.stages)
    def _():
        plgpu.barrier_wait(bufs.vw_free.at[slot])

    _widen_page(plan, bufs, bufs.v_wide.at[slot], slot)
    plgpu.commit_smem()
    plgpu.barrier_arrive(bufs.vw_ready.at[slot])
    plgpu.barrier_arrive(bufs.v_free.at[slot])


# A compute warpgroup, stage by stage.

def _compute_item(plan: _Plan, bufs: _Buffers, item: _Item, wg, role: str, nxt):
    """A compute warpgroup's side of a work item: its 64 query rows' online softmax over the
    item's key steps, written out as a partial (out [64, D], lse2 [64])."""
    if role == "cta":
        plgpu.set_max_registers(plan.registers[0], action="increase")
    row0 = item.cta_row0 if plan.key_split else item.cta_row0 + wg * ROWS_PER_WG
    # This warpgroup's steps: i = first + k * stride for k in [0, n) (`_key_steps`).
    first = item.lo + wg if plan.key_split else item.lo
    # This item's first query row of the warpgroup's boxes in head layout (its output's).
    r0 = lax.div(row0, jnp.int32(ROWS_PER_WG)) * plan.rows_io if plan.heads_io else None
    qb = _issue_query_loads(plan, bufs, item, wg, row0, nxt)
    rows = _Rows(wg, row0, first, r0, qb)
    masks = _key_masks(plan, bufs, item, rows)
    _ready_query(plan, bufs, rows, nxt)
    acc, m, l = _key_steps(plan, bufs, item, rows, masks)
    out, lse = _normalised(acc, m, l)
    _epilogue(plan, bufs, item, rows, out, lse)


def _query_row0(plan: _Plan, wg, tile):
    """Compute warpgroup `wg`'s first row of T in row tile `tile`."""
    return tile * plan.rows_per_cta + (0 if plan.key_split else wg * ROWS_PER_WG)


def _load_query(plan: _Plan, src, dst, ready, bi, head, row0):
    """A warpgroup's 64 query rows from `src` into `dst` [64, D]: under heads_io G boxes of rows_io
    query rows, one per head of this KV head's group. row0 is a multiple of 64: written as
    (row0 / 64) * rows_io, the box start's known divisibility lets Mosaic GPU prove a head-layout
    transfer lands on whole smem tile rows."""
    if plan.heads_io:
        r0 = lax.div(row0, jnp.int32(ROWS_PER_WG)) * plan.rows_io
        for g in range(plan.group_io):
            plgpu.copy_gmem_to_smem(src.at[bi, pl.ds(r0, plan.rows_io), head * plan.group_io + g],
                                    dst.at[pl.ds(g * plan.rows_io, plan.rows_io)], ready)
    else:
        plgpu.copy_gmem_to_smem(src.at[bi, head, pl.ds(row0, ROWS_PER_WG)], dst, ready)


def _issue_query_loads(plan: _Plan, bufs: _Buffers, item: _Item, wg, row0, nxt):
    """Issues the copies of this item's query tile (and fused, its rows' mask words), under
    prefetch_query the next item's, and the unquantised query tile where one is staged; returns
    the buffer this item's tile lands in."""

    def issue_loads(bi_x, head_x, tile_x, buf):
        # An item's query tile (and fused, its rows' mask words) into buffer `buf`.
        row0_x = _query_row0(plan, wg, tile_x)
        if not plan.cast_query:  # else cast from the unquantised tile (`_ready_query`)
            _load_query(plan, bufs.q, bufs.q_smem.at[buf], bufs.q_ready.at[buf], bi_x, head_x, row0_x)
        if plan.fused:
            plgpu.copy_gmem_to_smem(bufs.words.at[bi_x, :, pl.ds(row0_x, ROWS_PER_WG)],
                                    bufs.words_smem.at[buf], bufs.words_ready.at[buf])

    if nxt is None:
        qb = wg
        issue_loads(item.bi, item.head, item.tile, qb)
    else:
        # Prefetching: this item's loads were issued during the previous item (or now, for a CTA's
        # first); the next item's go into the other buffer at once.
        k, has_next, (bi_n, head_n, tile_n) = nxt
        qb = lax.rem(k, jnp.int32(2)) * plan.wgs + wg
        pl.when(k == 0)(lambda: issue_loads(item.bi, item.head, item.tile, qb))
        pl.when(has_next)(lambda: issue_loads(bi_n, head_n, tile_n, lax.rem(k + 1, jnp.int32(2)) * plan.wgs + wg))
    # The unquantised query tile: the fused window's for each item; the unfused cast's under
    # prefetch_query for a CTA's first item here, each next one's once this one's is cast
    # (`_ready_query`).
    if plan.wide_query and nxt is not None:
        pl.when(nxt[0] == 0)(lambda: _load_query(plan, bufs.q_wide, bufs.qw_smem.at[wg], bufs.qw_ready.at[wg],
                                                 item.bi, item.head, row0))
    elif plan.stages_wide:
        _load_query(plan, bufs.q_wide, bufs.qw_smem.at[wg], bufs.qw_ready.at[wg], item.bi, item.head, row0)
    return qb


def _key_masks(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows) -> _Masks:
    """Which keys of each step the warpgroup's rows see: fused, the committed keys and the window
    slots under each row's mask words; unfused, each row's whole-page bound."""
    shape = (ROWS_PER_WG, plan.block)
    col = plgpu.broadcasted_iota(jnp.int32, shape, 1, layout=plgpu.Layout.WGMMA)
    if plan.fused:
        plgpu.barrier_wait(bufs.words_ready.at[rows.qb])
        # [64] per word, broadcast over the keys only inside a masked step (two [64, block] arrays
        # live across the key loop would cost the unmasked steps registers).
        row_words = [plgpu.load(bufs.words_smem.at[rows.qb, w], layout=plgpu.Layout.WGMMA.reduce(1))
                     for w in range(2)]
        union = (bufs.union[item.bi, 0], bufs.union[item.bi, 1])
        # Steps wholly below P are seen by every row.
        open_end = jnp.clip(lax.div(item.length, jnp.int32(plan.block)), item.lo, item.hi)

        def visible(i):
            words = [lax.broadcast_in_dim(w, shape, [0]) for w in row_words]
            return window_visible(col + i * plan.block, item.length, plan.window, words)
        return _Masks(visible, open_end, union)
    row = plgpu.broadcasted_iota(jnp.int32, shape, 0, layout=plgpu.Layout.WGMMA) + rows.row0
    row_hi = whole_page_bound(item.length, plan.query_rows, plan.group, row, item.whole)  # [64, block]
    # Keys below the first row's bound are seen by every row of this warpgroup.
    first_hi = jnp.maximum(whole_page_bound(item.length, plan.query_rows, plan.group, rows.row0, item.whole), 0)
    open_end = jnp.clip(lax.div(first_hi, jnp.int32(plan.block)), item.lo, item.hi)

    def visible(i):
        return col + i * plan.block < row_hi
    return _Masks(visible, open_end, None)


def _ready_query(plan: _Plan, bufs: _Buffers, rows: _Rows, nxt):
    """Waits for the warpgroup's query tile [64, D] (and unquantised tile); under cast_query casts
    the FP8 tile from the unquantised one and, prefetching, fetches the next item's unquantised
    tile into the freed staging tile."""
    wg, qb = rows.wg, rows.qb
    if not plan.cast_query:
        plgpu.barrier_wait(bufs.q_ready.at[qb])
    if plan.stages_wide:
        plgpu.barrier_wait(bufs.qw_ready.at[wg])
    if plan.cast_query:
        # The prefix steps' FP8 query from the unquantised tile (through fp32, whose convert to
        # E4M3 saturates; clipped first so the interpreter agrees). Nothing reads this buffer any
        # more: the last item's scores were waited on.
        wide_q = plgpu.load(bufs.qw_smem.at[wg], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
        bufs.q_smem.at[qb][...] = jnp.clip(wide_q, -F8_MAX, F8_MAX).astype(F8)
        plgpu.commit_smem()  # also: every thread has read the staging tile
        if plan.wide_query and nxt is not None:
            _, has_next, (bi_n, head_n, tile_n) = nxt
            row0_n = _query_row0(plan, wg, tile_n)
            pl.when(has_next)(lambda: _load_query(plan, bufs.q_wide, bufs.qw_smem.at[wg], bufs.qw_ready.at[wg],
                                                  bi_n, head_n, row0_n))


def _key_steps(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, masks: _Masks):
    """The warpgroup's online softmax over its key steps (unmasked steps first, then the masked
    ones); returns the running (acc [64, D], m [64], l [64]), fp32."""
    wg, first, stride, hi = rows.wg, rows.first, plan.stride, item.hi

    def mine(end):  # this warpgroup's steps below step `end`
        return lax.div(jnp.maximum(end - first, 0) + stride - 1, jnp.int32(stride))

    m = plgpu.layout_cast(jnp.full((ROWS_PER_WG,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    acc = plgpu.layout_cast(jnp.zeros((ROWS_PER_WG, plan.d), jnp.float32), plgpu.Layout.WGMMA)

    @pl.when(first < hi)
    def _():
        plgpu.barrier_wait(bufs.k_ready.at[_slot_of(plan, item, first)])  # this warpgroup's first keys

    # One function for both turns taken outside the loop: the two branches share one trace.
    take_turn = functools.partial(_take_turn, bufs)
    if plan.pingpong:
        pl.when(wg == 1)(take_turn)  # start half a step behind warpgroup 0
    n_open, n_all = mine(masks.open_end), mine(hi)
    if plan.overlap_softmax:
        acc, m, l = _overlapped_steps(plan, bufs, item, rows, masks, acc, m, l, n_open, n_all)
    else:
        step = functools.partial(_turn_taking_step, plan, bufs, item, rows, masks)
        carry = lax.fori_loop(0, n_open, functools.partial(step, masked=False), (acc, m, l))
        acc, m, l = lax.fori_loop(n_open, n_all, functools.partial(step, masked=True), carry)
    if plan.pingpong and plan.key_split:
        # An odd step count leaves warpgroup 1 one step short: it still takes that step's two
        # turns, or warpgroup 0 would wait on the turn barrier forever.
        @pl.when(n_all < lax.div(hi - item.lo + 1, jnp.int32(2)))
        def _():
            take_turn()
            take_turn()
    if plan.pingpong:
        pl.when(wg == 0)(take_turn)
    return acc, m, l


def _turn_taking_step(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, masks: _Masks, k, carry,
                      masked: bool):
    """The warpgroup's k-th key step: scores (handing the tensor cores over once issued), the
    online softmax, the step's V tile, P V (taking them back first); carry (acc, m, l)."""
    acc, m, l = carry
    i = rows.first + k * plan.stride
    slot = _slot_of(plan, item, i)
    s = _step_scores(plan, bufs, rows, slot, widens_keys=plan.fused_fp8 and masked)
    plgpu.barrier_arrive(bufs.k_free.at[slot])
    p, _, m_new, l, acc = online_softmax_update(s, m, l, acc, plan.scale2, masks.visible(i) if masked else None)
    p16 = p.astype(plan.pv_dtype)
    if plan.fence_softmax and not plan.interpret:
        acc, l, m_new, p16 = lax.optimization_barrier((acc, l, m_new, p16))
    if plan.pingpong:
        plgpu.barrier_arrive(bufs.turn)  # softmax done
    v_tile = _value_tile(plan, bufs, item, rows, masks, slot, i, cleans=plan.fused and masked)
    if plan.pingpong:
        plgpu.barrier_wait(bufs.turn)  # the tensor cores are ours again

    acc = _add_values(plan, acc, p16, v_tile, lambda: _wait_next_keys(plan, bufs, item, i))
    if plan.memory_widens_values:
        plgpu.barrier_arrive(bufs.vw_free.at[slot])
    elif not plan.fp8:
        plgpu.barrier_arrive(bufs.v_free.at[slot])
    return acc, m_new, l


def _issue_scores(bufs: _Buffers, qb, s_ref, slot):
    """Q K^T of the keys in ring `slot` into the accumulator s_ref [64, block], asynchronous on
    the GPU (wgmma)."""
    plgpu.wgmma(s_ref, bufs.q_smem.at[qb], bufs.k_smem.at[slot].transpose((1, 0)))


def _step_scores(plan: _Plan, bufs: _Buffers, rows: _Rows, slot, widens_keys: bool):
    """The step's raw scores [64, block] fp32; under pingpong the other warpgroup's matmuls go next.
    `widens_keys` (a fused window step under an FP8 pool): the unquantised query against this
    warpgroup's widened copy of K (the tile V is widened into after the scores land)."""
    wg = rows.wg
    if widens_keys:
        # No native E4M3 -> bf16 convert on Hopper: through f32 (one step per CTA).
        bufs.k_wide.at[wg][...] = bufs.k_smem.at[slot][...].astype(jnp.float32).astype(plan.kw_dtype)
        plgpu.commit_smem()

    def scores(acc_ref):
        if widens_keys:
            plgpu.wgmma(acc_ref, bufs.qw_smem.at[wg], bufs.k_wide.at[wg].transpose((1, 0)))
        else:
            _issue_scores(bufs, rows.qb, acc_ref, slot)
        if plan.pingpong:
            _take_turn(bufs)  # the other warpgroup's matmuls go next
        return acc_ref[...]

    return pl.run_scoped(scores, plgpu.ACC((ROWS_PER_WG, plan.block), jnp.float32))


def _value_tile(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, masks: _Masks, slot, i, cleans: bool):
    """The 16-bit V tile [block, D] of step i for P V, waited for: the memory warpgroup's widened
    ring slot, this warpgroup's own widened copy (FP8; the FP8 buffer is released at once), or the
    ring slot itself; `cleans` (fused masked steps): rows no row of the request sees are zeroed."""
    if plan.memory_widens_values:
        # The memory warpgroup widened this step's V page into the 16-bit ring.
        plgpu.barrier_wait(bufs.vw_ready.at[slot])
        v_tile = bufs.v_wide.at[slot]
        if cleans:  # in place, as 16-bit pools do (both warpgroups write the same)
            _clean_in_place(plan, item, masks, v_tile, i)
    elif plan.fp8:
        plgpu.barrier_wait(bufs.v_ready.at[slot])
        # Widen this warpgroup's copy of the V page (CUDA cores, while the other warpgroup holds
        # the tensor cores); the FP8 buffer is free right after.
        v_tile = bufs.v_wide.at[rows.wg]
        _widen_page(plan, bufs, v_tile, slot,
                    (lambda piece, r: _clean_values(plan, item, masks, piece, i, r)) if cleans else None)
        plgpu.commit_smem()
        plgpu.barrier_arrive(bufs.v_free.at[slot])
    else:
        plgpu.barrier_wait(bufs.v_ready.at[slot])
        v_tile = bufs.v_smem.at[slot]
        if cleans:
            # In place: both warpgroups may clean the same buffer, but each writes exactly what the
            # other does (kept rows unchanged, the others zero), so whichever order the writes land
            # in, a reader sees clean rows.
            _clean_in_place(plan, item, masks, v_tile, i)
    return v_tile


def _clean_values(plan: _Plan, item: _Item, masks: _Masks, v, i, r0=0):
    """`v` [rows, D], V rows of step i from its row r0, with the rows no row of the request may see
    (past P + window, or window slots outside every row's mask) zeroed: they may hold NaN / inf,
    which a zero softmax weight would still spread. Only fused masked steps reach this."""
    key = plgpu.broadcasted_iota(jnp.int32, v.shape, 0, layout=plgpu.Layout.WGMMA) + i * plan.block + r0
    return jnp.where(window_visible(key, item.length, plan.window, masks.union), v, jnp.zeros_like(v))


def _clean_in_place(plan: _Plan, item: _Item, masks: _Masks, v_tile, i):
    """`_clean_values` on the 16-bit V tile [block, D] of step i in shared memory."""
    v_tile[...] = _clean_values(plan, item, masks, plgpu.load(v_tile, layout=plgpu.Layout.WGMMA), i)
    plgpu.commit_smem()


def _add_values(plan: _Plan, acc, p, v_tile, while_in_flight=lambda: None):
    """acc [64, D] + P [64, block] V [block, D] (V in shared memory), waited; `while_in_flight`
    runs after the wgmma is issued and before it is waited on. The GPU interpreter can neither run
    run_state nor store into an accumulator, so interpreted runs add P V with a plain dot on the
    same shared-memory tile."""
    if plan.interpret:
        acc = acc + jnp.dot(p, v_tile[...], preferred_element_type=jnp.float32)
        while_in_flight()
        return acc

    def values(acc_ref):
        plgpu.wgmma(acc_ref, p, v_tile)
        while_in_flight()
    return pl.run_state(values)(plgpu.ACC.init(acc))


def _wait_next_keys(plan: _Plan, bufs: _Buffers, item: _Item, i):
    """Waits for the warpgroup's next K (after step i), taken while step i's P V product runs (the
    first step's before the loop), so a late TMA copy hides behind tensor-core work."""
    @pl.when(i + plan.stride < item.hi)
    def _():
        plgpu.barrier_wait(bufs.k_ready.at[_slot_of(plan, item, i + plan.stride)])


def _overlapped_steps(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, masks: _Masks, acc, m, l,
                      n_open, n_all):
    """`overlap_softmax`'s key loop: step 0's scores alone; then each step k >= 1 issues Q K_k^T
    and step k-1's P V together, runs step k's softmax once the scores land (P V still in flight),
    and rescales the output after P V lands; the last P V closes. Step k = i - first."""
    first = rows.first
    shape = (ROWS_PER_WG, plan.block)

    def slot_of(i):
        return _slot_of(plan, item, i)

    def scores_now(slot):
        def scores(s_ref):
            _issue_scores(bufs, rows.qb, s_ref, slot)
            return s_ref[...]
        return pl.run_scoped(scores, plgpu.ACC(shape, jnp.float32))

    def softmax(s, m, l, i, masked):  # P stays fp32 here (see in_flight)
        p, alpha, m, l, _ = online_softmax_update(s, m, l, None, plan.scale2, masks.visible(i) if masked else None)
        return p, alpha, m, l

    def step(k, carry, masked: bool):
        acc, m, l, p_prev = carry
        i = first + k
        slot_k, slot_v = slot_of(i), slot_of(i - 1)
        if plan.interpret:
            # The interpreter cannot store into an accumulator: the same order of barrier waits and
            # releases, with P V as a plain dot.
            s = scores_now(slot_k)
            plgpu.barrier_wait(bufs.v_ready.at[slot_v])
            plgpu.barrier_arrive(bufs.k_free.at[slot_k])
            p, alpha, m, l = softmax(s, m, l, i, masked)
            _wait_next_keys(plan, bufs, item, i)
            acc = _add_values(plan, acc, p_prev, bufs.v_smem.at[slot_v])  # v_ready already waited
        else:
            def in_flight(o_ref, s_ref):
                o_ref[...] = acc
                _issue_scores(bufs, rows.qb, s_ref, slot_k)
                plgpu.barrier_wait(bufs.v_ready.at[slot_v])
                plgpu.wgmma(o_ref, p_prev, bufs.v_smem.at[slot_v])
                s = plgpu.wgmma_accumulator_load(s_ref, wait_n=1)  # scores in, P V in flight
                plgpu.barrier_arrive(bufs.k_free.at[slot_k])
                p, alpha, m_new, l_new = softmax(s, m, l, i, masked)
                _wait_next_keys(plan, bufs, item, i)
                o = plgpu.wgmma_accumulator_load(o_ref, wait_n=0)
                # P V read p_prev from registers until the wait: passing it through a barrier here
                # keeps those registers from being reused before, and P is narrowed only now, so
                # the new P never overwrites them in flight.
                o, _ = lax.optimization_barrier((o, p_prev))
                return o, p, alpha, m_new, l_new

            acc, p, alpha, m, l = pl.run_scoped(
                in_flight, plgpu.ACC((ROWS_PER_WG, plan.d), jnp.float32), plgpu.ACC(shape, jnp.float32))
        plgpu.barrier_arrive(bufs.v_free.at[slot_v])
        return acc * lax.broadcast_in_dim(alpha, acc.shape, [0]), m, l, p.astype(plan.pv_dtype)

    def run(acc, m, l):
        # Step 0 (masked: it may be the CTA's only, partly visible step).
        s = scores_now(slot_of(first))
        plgpu.barrier_arrive(bufs.k_free.at[slot_of(first)])
        p, _, m, l = softmax(s, m, l, first, True)
        _wait_next_keys(plan, bufs, item, first)
        carry = (acc, m, l, p.astype(plan.pv_dtype))
        carry = lax.fori_loop(1, jnp.maximum(n_open, 1), functools.partial(step, masked=False), carry)
        acc, m, l, p16 = lax.fori_loop(jnp.maximum(n_open, 1), n_all, functools.partial(step, masked=True), carry)
        last = slot_of(first + n_all - 1)
        plgpu.barrier_wait(bufs.v_ready.at[last])
        acc = _add_values(plan, acc, p16, bufs.v_smem.at[last])
        plgpu.barrier_arrive(bufs.v_free.at[last])
        return acc, m, l

    # No step at all: the running state stays as it is.
    return lax.cond(n_all > 0, run, lambda *c: c, acc, m, l)


def _normalised(acc, m, l):
    """(out [64, D], lse2 [64]) from the running state: acc / l, and rows that saw no key 0 with
    lse2 -inf."""
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = jnp.where(lax.broadcast_in_dim(seen, acc.shape, [0]), acc / lax.broadcast_in_dim(l_safe, acc.shape, [0]), 0.0)
    lse = jnp.where(seen, m + log2_of(l_safe), -jnp.inf)
    return out, lse


def _columns(plan: _Plan, x, j):
    """Output piece j (columns [j * out_chunk, (j + 1) * out_chunk)) of x [64, D]."""
    return x[:, j * plan.out_chunk:(j + 1) * plan.out_chunk]


def _epilogue(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, out, lse):
    """Writes the warpgroup's partial (out [64, D], lse2 [64]): merged first with the other
    warpgroup's under a key split, and clustered with the other splits' of its column block."""
    finish = functools.partial(_merge_in_cluster if plan.clustered else _write_partial, plan, bufs, item, rows)
    if not plan.key_split:
        finish(lse, lambda j: _columns(plan, out, j))
    else:
        _merge_key_split(plan, bufs, rows, out, lse, finish)


def _write_partial(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, lse, piece, first=0, count=None,
                   with_lse=True):
    """This CTA's partial (split; clustered, the merged output), out piece by piece: `piece(j)`
    gives output columns [(first + j) * out_chunk, ...) in fp32 ([64, out_chunk]; `count` pieces,
    None: all). It leaves through a small staging tile (a whole [64, D] fp32 tile per warpgroup
    would cost the K/V ring a stage)."""
    wg, row0, rows_io, group_io = rows.wg, rows.row0, plan.rows_io, plan.group_io
    count = plan.pieces if count is None else count
    part = 0 if plan.clustered else item.split
    if plan.persistent:
        plgpu.wait_smem_to_gmem(0)  # the previous item's last copies have read the staging
    if with_lse:
        bufs.lse_smem.at[wg][...] = lse
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(bufs.lse_smem.at[wg], bufs.lse.at[part, item.bi, item.head, pl.ds(row0, ROWS_PER_WG)])
    for j in range(count):
        chunk = piece(j).astype(plan.partial_dtype)
        plgpu.wait_smem_to_gmem(0)  # the previous piece has been read out
        bufs.o_smem.at[wg][...] = chunk
        plgpu.commit_smem()
        cols = pl.ds((first + j) * plan.out_chunk, plan.out_chunk)
        if plan.heads_out:
            for g in range(group_io):
                plgpu.copy_smem_to_gmem(bufs.o_smem.at[wg, pl.ds(g * rows_io, rows_io)],
                                        bufs.out.at[part, item.bi, pl.ds(rows.r0, rows_io), item.head * group_io + g,
                                                    cols])
        else:
            plgpu.copy_smem_to_gmem(bufs.o_smem.at[wg],
                                    bufs.out.at[part, item.bi, item.head, pl.ds(row0, ROWS_PER_WG), cols])
    if not plan.persistent:  # persistent: the next item's epilogue (or the kernel's end) waits
        plgpu.wait_smem_to_gmem(0)


def _merge_key_split(plan: _Plan, bufs: _Buffers, rows: _Rows, out, lse, finish):
    """Under a warpgroup key split the two warpgroups' partials of the same rows merge here by LSE
    (as merge_splits does, in fp32), so no partial per warpgroup reaches memory: warpgroup 1 hands
    its lse2 and its output, piece by piece, through its own staging slot to warpgroup 0, which
    `finish`es the merged partial."""
    wg = rows.wg

    @pl.when(wg == 1)
    def _hand_over():
        bufs.lse_smem.at[1][...] = lse
        for j in range(plan.pieces):
            if j:
                plgpu.barrier_wait(bufs.x_free)  # warpgroup 0 has read the last piece
            bufs.x_smem.at[1][...] = _columns(plan, out, j)
            plgpu.barrier_arrive(bufs.x_ready)
        plgpu.barrier_wait(bufs.x_free)

    @pl.when(wg == 0)
    def _merge():
        plgpu.barrier_wait(bufs.x_ready)
        other_lse = plgpu.load(bufs.lse_smem.at[1], layout=plgpu.Layout.WGMMA.reduce(1))
        (w_own, w_other), merged = merge_weights([lse, other_lse])  # both unseen: 0, out 0
        shape = (ROWS_PER_WG, plan.out_chunk)
        c_own = lax.broadcast_in_dim(w_own, shape, [0])
        c_other = lax.broadcast_in_dim(w_other, shape, [0])

        def piece(j):
            if j:
                plgpu.barrier_wait(bufs.x_ready)
            theirs = plgpu.load(bufs.x_smem.at[1], layout=plgpu.Layout.WGMMA)
            plgpu.barrier_arrive(bufs.x_free)
            return _columns(plan, out, j) * c_own + theirs * c_other

        finish(merged, piece)


def _merge_in_cluster(plan: _Plan, bufs: _Buffers, item: _Item, rows: _Rows, lse, piece):
    """cluster_splits: the partial of split t (of S, this CTA's "csplit") owns output columns block
    t (`inbox_pieces` pieces). It sends every other split u its pieces of block u and its lse2
    (broadcast over a piece's columns) into u's inbox, at slot t - (t > u), each store completing
    u's inbox barrier; then it waits for the S - 1 partials of its own block, merges them by LSE in
    split order (every CTA weighs the same way) and writes the block; split 0 also writes the
    lse2."""
    splits, inbox_pieces = plan.splits, plan.inbox_pieces
    mine = [piece(j) for j in range(plan.pieces)]  # in order: under a key split they arrive so
    own = 0 if plan.key_split else rows.wg
    lse_piece = lax.broadcast_in_dim(lse, (ROWS_PER_WG, OUT_CHUNK), [0])
    me = lax.axis_index("csplit")
    for t in range(splits):
        @pl.when(me == t)
        def _as_split(t=t):
            for u in (u for u in range(splits) if u != t):
                slot = t - (t > u)
                for jj in range(inbox_pieces):
                    plgpu.async_store_smem(mine[u * inbox_pieces + jj], bufs.inbox.at[own, slot, jj],
                                           bufs.inbox_ready.at[own], cluster_idx=u, cluster_dim="csplit")
                plgpu.async_store_smem(lse_piece, bufs.inbox_lse.at[own, slot], bufs.inbox_ready.at[own],
                                       cluster_idx=u, cluster_dim="csplit")
            plgpu.barrier_wait(bufs.inbox_ready.at[own])
            lses = [lse if u == t else jnp.max(plgpu.load(
                bufs.inbox_lse.at[own, u - (u > t)], layout=plgpu.Layout.WGMMA), axis=1)
                for u in range(splits)]
            weights, merged = merge_weights(lses)
            shape = (ROWS_PER_WG, OUT_CHUNK)
            weights = [lax.broadcast_in_dim(w, shape, [0]) for w in weights]

            def merged_piece(jj):
                terms = [(mine[t * inbox_pieces + jj] if u == t else plgpu.load(
                    bufs.inbox.at[own, u - (u > t), jj], layout=plgpu.Layout.WGMMA)) * weights[u]
                    for u in range(splits)]
                return functools.reduce(lambda a, x: a + x, terms)

            _write_partial(plan, bufs, item, rows, merged, merged_piece, first=t * inbox_pieces, count=inbox_pieces,
                           with_lse=t == 0)
