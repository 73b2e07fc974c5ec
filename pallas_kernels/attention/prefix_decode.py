"""Prefix half of cascade tree attention: a causal multi-query paged decode with a base-2 LSE.

    prefix_decode(q [B, R, Hq, D], k_pool, v_pool [S, Hkv, D], page_table [B, maxp] int32,
                  lengths [B] int32, *, page_size, scale, num_splits=None, sliding_window=None,
                  backend=None) -> (out [B, R, Hq, D] f32, lse2 [B, R, Hq] f32)

Request b has R query rows and P = lengths[b] committed keys; row r sees keys [0, P - R + 1 + r)
(clamped at 0, so P < R and P = 0 work: an empty row gives out 0 and lse2 = -inf). With
`sliding_window=w` row r sees only the last w of those keys. `lse2 = log2(sum_j 2^(s_j log2 e))`,
`s = scale * q.k`.

Kernel layout. One program owns every query row of one KV head: the R rows times the G = Hq / Hkv
heads of its group, stacked as row `r * G + g` (no head folding limit: R * G is any size). Rows are
padded to a power of two >= 16 (Triton dot operands) and cut into `block_rows` tiles. The grid is
(row_tiles, splits, Hkv, B), row tiles leading, so the tiles of one (b, head, split) launch close
together and can share its K/V through L2. Each program walks its split's pages, `pages_per_step`
pages (each page_size keys, a power of two) per online-softmax step, loading each page id as a
scalar from the page table, and keeps a base-2 online softmax: the pages of a step get one score
dot each, one shared max/rescale, then one PV dot each. With
more than one split the partials are merged by their LSEs in a small XLA epilogue.

FP8 E4M3 pools (unscaled): the query is cast to FP8 before the kernel (what the prefix half of an FP8
cache multiplies; the reference does the same; unscaled E4M3 holds magnitudes up to 448, so a query
beyond that is not representable, as in any unscaled FP8 decode). K and V are widened after loading to fp16, which
holds every E4M3 value exactly and which Hopper converts to natively (E4M3 -> bf16 is not native),
and both dots run in fp16 with fp32 accumulation. `fp8_score_dot=True` asks for a native FP8 x FP8
score dot instead (compiled GPU path only; off by default, results: triton-fp8).

Steps that every real row of a tile sees entirely run without load or score masks; only the steps
at the edges of a tile's coverage (the causal staircase, the last partial page or step) take the
masked step.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.reference import is_fp8, prefix_decode_reference, quantize_query_for_pool
from pallas_kernels.attention.split_merge import MergeConfig, merge_splits
from pallas_kernels.common import LOG2E, next_pow2, resolve_backend

# The key axis is split only when (B, Hkv, row tiles) gives fewer than two programs per SM; a split
# launch then aims at four per SM so its last wave is not a nearly empty one (B=32, P=32k, N=64: no
# split, 512 programs; B=1, P=32k, N=64: 33 splits on 132 SMs).
_SPLIT_BELOW_PROGRAMS_PER_SM = 2
_SPLIT_TARGET_PROGRAMS_PER_SM = 4
# A split shorter than this many pages costs more in its merge than it saves.
_MIN_PAGES_PER_SPLIT = 4
@dataclasses.dataclass(frozen=True)
class PrefixLaunch:
    """Launch shape of the prefix kernel."""

    pages_per_step: int  # pages per online-softmax step (one max / rescale per step)
    block_rows: int  # query rows per program (power of two >= 16)
    num_warps: int  # Triton warps per program
    num_stages: int  # Triton software-pipelining stages of the key loop
    prefetch_page_ids: bool  # read the next step's page ids while this step computes


# The two launches `default_launch` picks from: a grid that fills the GPU without splitting the key
# axis takes two pages per step, 128-row tiles, 8 warps, 3 stages and page ids read a step ahead (the
# prefetch is what makes the third stage pay); a split launch takes 64-row tiles, 4 warps, 3 stages
# and the prefetch. results: triton-launch.
WIDE_GRID_LAUNCH = PrefixLaunch(pages_per_step=2, block_rows=128, num_warps=8, num_stages=3,
                                prefetch_page_ids=True)
SPLIT_LAUNCH = PrefixLaunch(pages_per_step=1, block_rows=64, num_warps=4, num_stages=3,
                            prefetch_page_ids=True)
DEFAULT_BLOCK_ROWS = WIDE_GRID_LAUNCH.block_rows  # row tiles the split decision is made with
DEFAULT_PAGES_PER_STEP = WIDE_GRID_LAUNCH.pages_per_step
# Most keys one step may hold when it groups pages (the [block_rows, keys] fp32 score tiles live in
# registers). A single page may be larger; it is one step as before.
MAX_KEYS_PER_STEP = 256


# --------------------------------------------------------------------------------------------------
# Query-row layout shared with the window kernel
# --------------------------------------------------------------------------------------------------

def padded_rows(rows: int) -> int:
    """Rows of one KV head padded for Triton: a power of two, at least 16 (dot operand minimum)."""
    return max(16, next_pow2(rows))


def choose_block_rows(total_rows: int, block_rows: int | None) -> int:
    block = DEFAULT_BLOCK_ROWS if block_rows is None else int(block_rows)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block}")
    return min(block, total_rows)


def default_launch(batch: int, kv_heads: int, total_rows: int, max_pages: int, sms: int | None = None
                   ) -> PrefixLaunch:
    """WIDE_GRID_LAUNCH when its row tiles fill the GPU unsplit, else SPLIT_LAUNCH."""
    tiles = total_rows // min(WIDE_GRID_LAUNCH.block_rows, total_rows)
    if default_num_splits(batch, kv_heads, tiles, max_pages, sms) == 1:
        return WIDE_GRID_LAUNCH
    return SPLIT_LAUNCH


def check_pages_per_step(pages_per_step: int, page_size: int, what: str) -> int:
    """Validates the pages grouped into one online-softmax step; returns it as an int."""
    pps = int(pages_per_step)
    if pps < 1 or pps & (pps - 1):
        raise ValueError(f"{what}: pages_per_step must be a power of two >= 1, got {pages_per_step}")
    if pps > 1 and pps * page_size > MAX_KEYS_PER_STEP:
        raise ValueError(f"{what}: pages_per_step={pps} x page_size={page_size} = {pps * page_size} keys "
                         f"per step exceeds {MAX_KEYS_PER_STEP}")
    return pps


def default_pages_per_step(page_size: int, pages_per_step: int = DEFAULT_PAGES_PER_STEP) -> int:
    """A default launch's pages per step, reduced for large pages so the step stays within
    MAX_KEYS_PER_STEP keys (an explicit pages_per_step is validated, never reduced)."""
    pps = pages_per_step
    while pps > 1 and pps * page_size > MAX_KEYS_PER_STEP:
        pps //= 2
    return pps


def heads_to_rows(x: jax.Array, num_kv_heads: int, total_rows: int, fill=0.0) -> jax.Array:
    """`[B, R, Hq, ...]` -> `[B, Hkv, total_rows, ...]`, row `r * G + g` = head `h * G + g`, padded."""
    b, r, hq = x.shape[:3]
    g = hq // num_kv_heads
    rest = x.shape[3:]
    x = x.reshape((b, r, num_kv_heads, g) + rest)
    x = jnp.moveaxis(x, 2, 1).reshape((b, num_kv_heads, r * g) + rest)
    pad = [(0, 0), (0, 0), (0, total_rows - r * g)] + [(0, 0)] * len(rest)
    return jnp.pad(x, pad, constant_values=fill)


def rows_to_heads(x: jax.Array, rows: int, num_q_heads: int) -> jax.Array:
    """Inverse of `heads_to_rows`: `[B, Hkv, total_rows, ...]` -> `[B, R, Hq, ...]`."""
    b, hkv = x.shape[:2]
    rest = x.shape[3:]
    g = num_q_heads // hkv
    x = x[:, :, : rows * g].reshape((b, hkv, rows, g) + rest)
    return jnp.moveaxis(x, 1, 2).reshape((b, rows, num_q_heads) + rest)


def check_paged_inputs(q, k_pool, v_pool, page_table, lengths, page_size: int, what: str):
    """Shape/dtype validation shared by both kernels; raises naming the offending value."""
    if q.ndim != 4:
        raise ValueError(f"{what}: q must be [B, R, Hq, D], got shape {q.shape}")
    if k_pool.ndim != 3:
        raise ValueError(f"{what}: k_pool must be slot-major [S, Hkv, D], got shape {k_pool.shape}")
    if v_pool is not None and (v_pool.ndim != 3 or v_pool.shape[:2] != k_pool.shape[:2]):
        raise ValueError(f"{what}: v_pool shape {v_pool.shape} does not match k_pool {k_pool.shape}")
    if v_pool is not None and v_pool.dtype != k_pool.dtype:
        raise ValueError(f"{what}: v_pool dtype {v_pool.dtype} differs from k_pool dtype {k_pool.dtype}")
    if page_size < 16 or page_size & (page_size - 1):
        raise ValueError(f"{what}: page_size must be a power of two >= 16, got {page_size}")
    if k_pool.shape[0] % page_size:
        raise ValueError(f"{what}: pool slots {k_pool.shape[0]} are not a multiple of page_size {page_size}")
    b, _, hq, _ = q.shape
    hkv = k_pool.shape[1]
    if hq % hkv:
        raise ValueError(f"{what}: query heads Hq={hq} are not a multiple of KV heads Hkv={hkv}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"{what}: page_table must be [B={b}, max_pages], got shape {page_table.shape}")
    if not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"{what}: page_table must be integer, got {page_table.dtype}")
    if lengths.shape != (b,):
        raise ValueError(f"{what}: lengths must be [B={b}], got shape {lengths.shape}")


def num_sms() -> int:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", 0) or 132)


def default_num_splits(batch: int, kv_heads: int, row_tiles: int, max_pages: int, sms: int | None = None) -> int:
    """Split the key axis only when (B, Hkv, row tiles) leaves the GPU underfilled (e.g. B = 1)."""
    sms = sms or num_sms()
    programs = batch * kv_heads * row_tiles
    if programs >= _SPLIT_BELOW_PROGRAMS_PER_SM * sms:
        return 1
    want = -(-_SPLIT_TARGET_PROGRAMS_PER_SM * sms // programs)
    return max(1, min(want, max_pages // _MIN_PAGES_PER_SPLIT))


def split_key_blocks(steps, split, splits: int):
    """[lo, hi): split `split` of `splits`' share of the `steps` key blocks a work item reads.

    The shares follow the request's own length, not the page table's width: a short prefix in a wide
    table still spreads over every split (cdiv(steps, splits) blocks each; trailing splits may get
    none, lse2 = -inf, dropped by the merge); fixed shares of the table would leave a short prefix
    to the first split or two. Shared by the prefix and MLA decodes, Triton and Mosaic."""
    per_split = lax.div(steps + splits - 1, jnp.int32(splits))
    lo = split * per_split
    return lo, jnp.maximum(jnp.minimum(lo + per_split, steps), lo)


# --------------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------------

def _prefix_kernel(lengths_ref, page_table_ref, q_ref, k_ref, v_ref, out_ref, lse_ref, *,
                   query_rows: int, group: int, block_rows: int, page_size: int, pages_per_step: int,
                   splits: int, scale2: float, sliding_window: int | None,
                   dot_dtype, fp8_score_dot: bool, prefetch_page_ids: bool):
    tile = pl.program_id(0)
    split = pl.program_id(1)
    head = pl.program_id(2)
    b = pl.program_id(3)
    length = lengths_ref[b]
    step_keys = page_size * pages_per_step

    rows = tile * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    real_row = rows < query_rows * group
    r = rows // group
    # Row r's keys are [lo_r, hi_r); padded rows see nothing.
    hi = jnp.where(real_row, jnp.maximum(length - query_rows + 1 + r, 0), 0)
    lo = jnp.zeros_like(hi) if sliding_window is None else jnp.maximum(hi - sliding_window, 0)
    tile_hi = jnp.max(hi)
    tile_lo = jnp.min(jnp.where(real_row, lo, tile_hi))
    # Keys every real row of the tile sees: [max lo, min hi). Steps wholly inside it need no masks.
    all_lo = jnp.max(jnp.where(real_row, lo, 0))
    all_hi = jnp.min(jnp.where(real_row, hi, tile_hi))

    # A step is `pages_per_step` consecutive pages; splits hold whole steps of the tile's own range,
    # so no step straddles two.
    tile_first = tile_lo // step_keys
    first_step, end_step = split_key_blocks((tile_hi + step_keys - 1) // step_keys - tile_first, split, splits)
    first_step, end_step = first_step + tile_first, end_step + tile_first
    full_first = jnp.clip((all_lo + step_keys - 1) // step_keys, first_step, end_step)
    full_end = jnp.clip(all_hi // step_keys, full_first, end_step)
    # Pages of an edge step may lie outside the tile's coverage (past the request's last page, or
    # before a sliding window); their loads are fully masked, and their page-table reads are clamped
    # to pages the tile covers so no table entry past the request's own is ever read.
    first_page = tile_lo // page_size
    last_page = jnp.maximum((tile_hi + page_size - 1) // page_size - 1, first_page)

    q = q_ref[...]
    if not fp8_score_dot:
        q = q.astype(dot_dtype)
    d = q.shape[-1]
    key_iota = lax.broadcasted_iota(jnp.int32, (page_size,), 0)

    def step(index, carry, masked: bool, page_ids=None):
        m, l, acc = carry
        # Score every page of the step first (one dot each, no concatenation), then one shared
        # max / rescale, then one PV dot per page.
        scores, values = [], []
        for i in range(pages_per_step):
            page = index * pages_per_step + i
            pos = page * page_size + key_iota  # [page]
            if page_ids is not None:
                page_id = page_ids[i]
            elif masked:
                page_id = page_table_ref[b, jnp.clip(page, first_page, last_page)]
            else:
                page_id = page_table_ref[b, page]
            slots = pl.ds(page_id * page_size, page_size)
            if masked:
                load_ok = ((pos >= tile_lo) & (pos < tile_hi))[:, None]
                k = plgpu.load(k_ref.at[slots, head, :], mask=load_ok, other=0.0)
                v = plgpu.load(v_ref.at[slots, head, :], mask=load_ok, other=0.0)
            else:
                k = k_ref[slots, head, :]
                v = v_ref[slots, head, :]
            if not fp8_score_dot:
                k = k.astype(dot_dtype)
            # Raw scores; the base-2 scale is applied inside exp2's argument (one FMA per score), and
            # to the row max (scale2 > 0, so max commutes with it).
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            if masked:
                vis = (pos[None, :] < hi[:, None]) & (pos[None, :] >= lo[:, None])
                s = jnp.where(vis, s, -jnp.inf)
            scores.append(s)
            values.append(v)
        step_max = functools.reduce(jnp.maximum, [jnp.max(s, axis=1) for s in scores])
        m_new = jnp.maximum(m, step_max * scale2)
        # A masked step may leave a row with no visible key yet (m_new = -inf); every score of a
        # full step is finite.
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m - m_use)
        l = l * alpha
        acc = acc * alpha[:, None]
        for s, v in zip(scores, values):
            p = jnp.exp2(s * scale2 - m_use[:, None])
            l = l + jnp.sum(p, axis=1)
            acc = acc + jnp.dot(p.astype(dot_dtype), v.astype(dot_dtype), preferred_element_type=jnp.float32)
        return m_new, l, acc

    masked_step = functools.partial(step, masked=True)
    carry = (jnp.full((block_rows,), -jnp.inf, jnp.float32), jnp.zeros((block_rows,), jnp.float32),
             jnp.zeros((block_rows, d), jnp.float32))
    carry = lax.fori_loop(first_step, full_first, masked_step, carry)
    if prefetch_page_ids:
        # The next step's page ids are read while this step computes, so no K/V load waits on a
        # page-table read issued in its own iteration. Reads are clamped to the tile's pages.
        def ids_of(index):
            return tuple(page_table_ref[b, jnp.minimum(index * pages_per_step + i, last_page)]
                         for i in range(pages_per_step))

        def full_step(index, carry):
            *mla, ids = carry
            nxt = ids_of(index + 1)
            return (*step(index, tuple(mla), masked=False, page_ids=ids), nxt)

        *carry, _ = lax.fori_loop(full_first, full_end, full_step, (*carry, ids_of(full_first)))
        carry = tuple(carry)
    else:
        carry = lax.fori_loop(full_first, full_end, functools.partial(step, masked=False), carry)
    m, l, acc = lax.fori_loop(full_end, end_step, masked_step, carry)
    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out_ref[...] = jnp.where(seen[:, None], acc / l_safe[:, None], 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, m + jnp.log2(l_safe), -jnp.inf)


# Dtypes a prefix kernel may write its partial output in (`partial_dtype`, both prefix kernels).
PARTIAL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def check_partial_dtype(partial_dtype, what: str) -> jnp.dtype:
    """`partial_dtype` as a dtype; raises naming it unless it is in PARTIAL_DTYPES."""
    partial_dtype = jnp.dtype(partial_dtype)
    if partial_dtype not in PARTIAL_DTYPES:
        raise ValueError(f"{what}: partial_dtype must be float32 or bfloat16, got {partial_dtype.name}")
    return partial_dtype


@functools.partial(jax.jit, static_argnames=("query_rows", "group", "page_size", "scale", "num_splits",
                                             "sliding_window", "block_rows", "num_warps", "num_stages",
                                             "pages_per_step", "interpret", "fp8_score_dot",
                                             "poison_outputs", "prefetch_page_ids", "partial_dtype", "merge",
                                             "merge_config"))
def prefix_decode_row_layout(qr, k_pool, v_pool, page_table, lengths, *, query_rows: int, group: int,
                             page_size: int, scale: float, num_splits=None, sliding_window=None,
                             block_rows=None, num_warps=None, num_stages=None, pages_per_step=None,
                             interpret: bool = False, fp8_score_dot: bool = False,
                             poison_outputs: bool = False, prefetch_page_ids: bool | None = None,
                             partial_dtype=jnp.float32, merge: bool = True,
                             merge_config: MergeConfig | None = None):
    """The kernel on the row layout of `heads_to_rows`: `qr [B, Hkv, T, D]` (row `r * G + g`,
    T = padded_rows(R * G)) -> (out `[B, Hkv, T, D]` f32 (`partial_dtype` without key splits),
    lse2 `[B, Hkv, T]` f32). The cascade keeps this layout between its two halves, so q is
    transposed once on the way in and the final output at most once on the way out.
    `partial_dtype` (float32 or bfloat16): the dtype the kernel writes `out` in (key splits are
    merged in float32 either way). `merge=False` hands key-split partials on unmerged (S > 1 only:
    out `[S, B, Hkv, T, D]`, lse2 `[S, B, Hkv, T]`) for the window kernel to merge
    (`tree_window_row_layout`); `merge_config`: the merge's launch (None:
    `split_merge.default_config()`). Inputs are assumed validated by the public entry points
    (pages_per_step is checked here too, since the benchmarks call this directly)."""
    b, hkv, total, d = qr.shape
    max_pages = page_table.shape[1]
    launch = default_launch(b, hkv, total, max_pages)
    block = choose_block_rows(total, launch.block_rows if block_rows is None else block_rows)
    tiles = total // block
    pps = check_pages_per_step(default_pages_per_step(page_size, launch.pages_per_step)
                               if pages_per_step is None else pages_per_step, page_size, "prefix_decode")
    splits = num_splits or default_num_splits(b, hkv, tiles, max_pages)

    fp8 = is_fp8(k_pool.dtype)
    qr = quantize_query_for_pool(qr, k_pool.dtype)
    # FP8 E4M3 widens exactly (and natively on Hopper) to fp16; softmax weights in [0, 1] keep more
    # mantissa in fp16 than in bf16.
    dot_dtype = jnp.float16 if fp8 else (qr.dtype if qr.dtype == k_pool.dtype else jnp.float32)

    kernel = functools.partial(
        _prefix_kernel, query_rows=query_rows, group=group, block_rows=block, page_size=page_size,
        pages_per_step=pps, splits=splits, scale2=float(scale) * LOG2E, sliding_window=sliding_window,
        dot_dtype=dot_dtype, fp8_score_dot=fp8_score_dot and fp8 and not interpret,
        prefetch_page_ids=launch.prefetch_page_ids if prefetch_page_ids is None else bool(prefetch_page_ids))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out_shape = (jax.ShapeDtypeStruct((splits, b, hkv, total, d), check_partial_dtype(partial_dtype, "prefix_decode")),
                 jax.ShapeDtypeStruct((splits, b, hkv, total), jnp.float32))
    in_specs = [any_spec, any_spec,
                pl.BlockSpec((None, None, block, d), lambda t, s, h, bb: (bb, h, t, 0)),
                any_spec, any_spec]
    args = [lengths.astype(jnp.int32), page_table.astype(jnp.int32), qr, k_pool, v_pool]
    aliases = {}
    if poison_outputs:
        # Outputs start as NaN so a test proves the kernel writes every element.
        in_specs += [any_spec, any_spec]
        args += [jnp.full(o.shape, jnp.nan, o.dtype) for o in out_shape]
        aliases = {5: 0, 6: 1}
        kernel = _drop_alias_inputs(kernel, 2)
    out, lse = pl.pallas_call(
        kernel,
        grid=(tiles, splits, hkv, b),
        in_specs=in_specs,
        out_specs=(pl.BlockSpec((None, None, None, block, d), lambda t, s, h, bb: (s, bb, h, t, 0)),
                   pl.BlockSpec((None, None, None, block), lambda t, s, h, bb: (s, bb, h, t))),
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or launch.num_warps,
                                             num_stages=num_stages or launch.num_stages),
        name="prefix_decode",
    )(*args)
    if splits > 1:
        if not merge:
            return out, lse
        return merge_splits(out, lse, backend="interpret" if interpret else None, config=merge_config)
    return out[0], lse[0]


@functools.partial(jax.jit, static_argnames=("page_size", "scale", "num_splits", "sliding_window",
                                             "block_rows", "num_warps", "num_stages", "pages_per_step",
                                             "interpret", "fp8_score_dot", "poison_outputs",
                                             "prefetch_page_ids"))
def _prefix_decode_pallas(q, k_pool, v_pool, page_table, lengths, *, page_size, scale, num_splits,
                          sliding_window, block_rows, num_warps, num_stages, pages_per_step, interpret,
                          fp8_score_dot, poison_outputs, prefetch_page_ids):
    b, r, hq, d = q.shape
    hkv = k_pool.shape[1]
    qr = heads_to_rows(q, hkv, padded_rows(r * (hq // hkv)))
    out, lse = prefix_decode_row_layout(
        qr, k_pool, v_pool, page_table, lengths, query_rows=r, group=hq // hkv, page_size=page_size,
        scale=scale, num_splits=num_splits, sliding_window=sliding_window, block_rows=block_rows,
        num_warps=num_warps, num_stages=num_stages, pages_per_step=pages_per_step, interpret=interpret,
        fp8_score_dot=fp8_score_dot, poison_outputs=poison_outputs, prefetch_page_ids=prefetch_page_ids)
    return rows_to_heads(out, r, hq), rows_to_heads(lse, r, hq)


def _drop_alias_inputs(kernel, count: int):
    """Wraps a kernel so `count` aliased input refs (placed before the outputs) are ignored."""
    def wrapped(*refs):
        n_in = len(refs) - count * 2
        return kernel(*refs[:n_in], *refs[n_in + count:])
    return wrapped


def prefix_decode(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array, page_table: jax.Array,
                  lengths: jax.Array, *, page_size: int, scale: float | None = None,
                  num_splits: int | None = None, sliding_window: int | None = None,
                  block_rows: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, pages_per_step: int | None = None,
                  fp8_score_dot: bool = False, poison_outputs: bool = False,
                  prefetch_page_ids: bool | None = None, backend: str | None = None):
    """Causal multi-query paged decode; see the module docstring.

    Shapes: `q [B, R, Hq, D]`, `k_pool/v_pool [S, Hkv, D]`, `page_table [B, maxp] int32`,
    `lengths [B] int32` -> `(out [B, R, Hq, D] f32, lse2 [B, R, Hq] f32)`.
    `scale` defaults to D^-1/2. `num_splits=None` picks a split of the key axis that fills the GPU.
    `block_rows`, `num_warps`, `num_stages` tune the compiled kernel; `pages_per_step` (a power of
    two, at most MAX_KEYS_PER_STEP keys when > 1) groups pages into one
    online-softmax step; `poison_outputs` fills the
    kernel's output buffers with NaN first (tests); `fp8_score_dot` uses an FP8 x FP8 score dot on GPU;
    `prefetch_page_ids` reads each unmasked step's page ids one step ahead. Every launch knob left
    None comes from `default_launch` (WIDE_GRID_LAUNCH, or SPLIT_LAUNCH when the key axis is split).
    """
    check_paged_inputs(q, k_pool, v_pool, page_table, lengths, page_size, "prefix_decode")
    if v_pool.shape[-1] != q.shape[-1] or k_pool.shape[-1] != q.shape[-1]:
        raise ValueError(f"prefix_decode: head dim mismatch q {q.shape[-1]}, k {k_pool.shape[-1]}, "
                         f"v {v_pool.shape[-1]}")
    d = q.shape[-1]
    if d < 16 or d & (d - 1):
        raise ValueError(f"prefix_decode: head dim must be a power of two >= 16, got {d}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"prefix_decode: num_splits must be >= 1, got {num_splits}")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"prefix_decode: sliding_window must be >= 1, got {sliding_window}")
    if pages_per_step is not None:
        check_pages_per_step(pages_per_step, page_size, "prefix_decode")
    scale = float(d ** -0.5 if scale is None else scale)
    kind = resolve_backend(backend)
    if kind == "reference":
        return prefix_decode_reference(q, k_pool, v_pool, page_table, lengths, page_size=page_size,
                                       scale=scale, sliding_window=sliding_window)
    return _prefix_decode_pallas(
        q, k_pool, v_pool, page_table, lengths, page_size=page_size, scale=scale,
        num_splits=num_splits, sliding_window=sliding_window, block_rows=block_rows,
        num_warps=num_warps, num_stages=num_stages, pages_per_step=pages_per_step,
        interpret=kind == "interpret", fp8_score_dot=fp8_score_dot, poison_outputs=poison_outputs,
        prefetch_page_ids=prefetch_page_ids)


__all__ = ["prefix_decode", "prefix_decode_row_layout", "default_num_splits", "default_launch",
           "PrefixLaunch", "WIDE_GRID_LAUNCH", "SPLIT_LAUNCH"]
