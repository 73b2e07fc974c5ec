"""Window half of cascade tree attention, merged with the prefix partial in the same kernel.

    tree_window_attention(q [B, R, Hq, Dk], k_pool [S, Hkv, Dk], v_pool [S, Hkv, Dv] | None,
                          page_table [B, maxp] int32, prefix_lengths [B] int32,
                          mask [B, R, 2] uint32, prefix_out [B, R, Hq, Dv], prefix_lse2 [B, R, Hq],
                          *, window, page_size, scale=None, causal_prefix=True, rope_dim=0,
                          value_dim=None, backend=None) -> out [B, R, Hq, Dv] (q's dtype)

Row r of request b (P = prefix_lengths[b] committed keys) attends
- the prefix tail the causal prefix half did not cover: positions P - R + 1 + r .. P - 1 (none when
  `causal_prefix=False`, where the prefix half already covered the row's whole prefix; with
  `prefix_whole_pages` the tail starts no later than the last whole page below P either way);
- window key j (position P + j, j < window <= 64) iff bit j of its packed mask row is set
  (word 0 holds bits 0..31, word 1 bits 32..63, see `pallas_kernels.tree_masks`);
and folds them into the prefix partial (out, lse2) with a base-2 online softmax. A partial with
lse2 = -inf (empty prefix coverage) starts the row from (m = -inf, l = 0, acc = 0). The window's K/V
are in the same paged pool at positions P .. P + window - 1; `page_table` must map every position
below P + window.

Invisible slots never reach an output: scores of columns a row cannot see are -inf, and K/V loads
of columns no row of the tile can see are masked to 0 (a NaN value times a zero weight would still
be NaN).

MLA layout (`rope_dim > 0`, or `v_pool=None`): one KV head, each latent row is
`[kv_lora_rank | rope_dim]`; the leading `value_dim = kv_lora_rank` channels are both the key's latent
part and the value, the rope channels add a second score term q_rope . k_rope. The row is read once:
the latent block feeds both dots. `k_pool` may then be `[S, Dk]` or `[S, 1, Dk]`.

FP8 pools: the query stays unquantised; K/V are widened to the query's dtype after loading.

One code path for every size: the kernel walks the pages spanned by positions
[P - R + 1, P + window) one page at a time; the grid is (row_tiles, Hkv, B): the R * G query rows of
a KV head (padded to a power of two >= 16) are cut into `block_rows` tiles, one program each, so a
small batch can still fill the GPU by taking smaller tiles. Where a tile is whole query rows (G a
power of two dividing it, R x G whole tiles: `writes_head_layout`; GQA verify and lanes at the
issue's shapes, not the MLA layout, whose G = Hq exceeds any tile) the kernel stores the output
straight into `[B, R, Hq, Dv]`; otherwise it writes the row layout and XLA transposes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.attention.prefix_decode import (check_paged_inputs, heads_to_rows, padded_rows,
                                                    rows_to_heads)
from pallas_kernels.attention.reference import tree_window_reference
from pallas_kernels.attention.split_merge import HEAD_IO_TILE, head_io_rows_errors, split_weights
from pallas_kernels.common import LOG2E, resolve_backend
from pallas_kernels.tree_masks import MAX_TREE_NODES

# Rows per program are capped so the fp32 accumulator tile stays about 16K elements (registers).
_ACC_ELEMENTS = 16384
# Launch defaults. DEFAULT_BLOCK_ROWS = None picks rows per program by `default_block_rows`; a power
# of two overrides it. 4 warps and 3 stages are what Pallas Triton picks when unset.
DEFAULT_BLOCK_ROWS: int | None = None
DEFAULT_NUM_WARPS = 4
DEFAULT_NUM_STAGES = 3
# Row-tile rule: 16-row tiles win where the grid is small, 64-row tiles (fewer K/V re-reads) once
# they give this many programs (results: window-block-rows).
_WIDE_TILE_PROGRAMS = 1024


def default_block_rows(total_rows: int, widest_dim: int, grid_without_rows: int = 1) -> int:
    """Rows per program: 64 when (B x Hkv) x (total_rows / 64) programs reach _WIDE_TILE_PROGRAMS,
    else 16; capped by the accumulator budget and by `total_rows` (a power of two >= 16)."""
    block = 64 if grid_without_rows * max(1, total_rows // 64) >= _WIDE_TILE_PROGRAMS else 16
    while block > 16 and block * widest_dim > _ACC_ELEMENTS:
        block //= 2
    return min(block, total_rows)


def check_launch(block_rows, num_warps, num_stages, what: str):
    """Launch options: block_rows a power of two >= 16, num_warps one of 1..16 (powers of two),
    num_stages >= 1; None means the module default."""
    if block_rows is not None and (block_rows < 16 or block_rows & (block_rows - 1)):
        raise ValueError(f"{what}: block_rows must be a power of two >= 16, got {block_rows}")
    if num_warps is not None and num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{what}: num_warps must be one of 1, 2, 4, 8, 16, got {num_warps}")
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"{what}: num_stages must be >= 1, got {num_stages}")


def _window_kernel(*refs, query_rows: int, group: int, block_rows: int, page_size: int,
                   window: int, scale2: float, causal_prefix: bool, main_dim: int, rope_dim: int,
                   shared_kv: bool, prefix_whole_pages: bool = False, prefix_splits: int = 0,
                   heads_in: bool = False):
    refs = list(refs)
    plen_ref, pt_ref, q_ref = refs[:3]
    refs = refs[3:]
    qr_ref = refs.pop(0) if rope_dim else None
    k_ref = refs.pop(0)
    v_ref = None if shared_kv else refs.pop(0)
    if heads_in:
        mask_ref, pout_ref, plse_ref, out_ref = refs
    else:
        w0_ref, w1_ref, pout_ref, plse_ref, out_ref = refs

    tile = pl.program_id(0)
    head = pl.program_id(1)
    b = pl.program_id(2)
    length = plen_ref[b]

    rows = tile * block_rows + lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    real_row = rows < query_rows * group
    r = rows // group
    if heads_in:
        # Tile row r * G + g is query row r, head g of this KV head. The prefix's partial and lse2
        # come in `head_io_rows` order (row 64 w + g (64 / G) + i is query row w (64 / G) + i of
        # head g), gathered here by row; the mask rows are gathered per query row (no row-layout
        # copies by XLA).
        per = HEAD_IO_TILE // group
        at = (r // per) * HEAD_IO_TILE + (rows % group) * per + r % per
        w0 = plgpu.load(mask_ref.at[b, r, 0])
        w1 = plgpu.load(mask_ref.at[b, r, 1])
    else:
        w0 = w0_ref[...]
        w1 = w1_ref[...]

    def prefix_lse(s=None):
        if heads_in:
            return plgpu.load(plse_ref.at[b, head, at] if s is None else plse_ref.at[s, b, head, at])
        return plse_ref[...] if s is None else plse_ref[s, :]

    def prefix_out(s=None):
        if heads_in:  # a [block, Dv] gather: row index [block, 1], column index [1, Dv]
            rows_at = at[:, None]
            cols = lax.broadcasted_iota(jnp.int32, (1, pout_ref.shape[-1]), 1)
            return plgpu.load(pout_ref.at[b, head, rows_at, cols] if s is None
                              else pout_ref.at[s, b, head, rows_at, cols])
        return pout_ref[...] if s is None else pout_ref[s]
    if causal_prefix:
        tail_lo = jnp.where(real_row, jnp.maximum(length - query_rows + 1 + r, 0), length)
        lo = jnp.maximum(length - query_rows + 1, 0)
    else:
        tail_lo = jnp.full((block_rows,), length, jnp.int32)
        lo = length
    if prefix_whole_pages:
        # The prefix half stopped at the last whole page below P.
        whole = (length // page_size) * page_size
        tail_lo = jnp.minimum(tail_lo, whole)
        lo = jnp.minimum(lo, whole)
    hi = length + window

    q = q_ref[...]
    if heads_in:  # the head-layout block [block / G, G * Dk] as the tile's rows [block, Dk]
        q = q.reshape(block_rows, main_dim)
    qr = qr_ref[...] if rope_dim else None
    cdt = q.dtype  # K/V (FP8 included) are widened to the query's dtype

    def widen(x):
        # E4M3 -> fp16 is exact and native on Hopper; E4M3 -> bf16 is not, so go through fp16.
        if x.dtype.itemsize == 1 and cdt != jnp.float16:
            x = x.astype(jnp.float16)
        return x.astype(cdt)

    if prefix_splits:
        # The prefix half's key-split partials [S, rows, Dv], merged into the online state by their
        # lse2 (split_merge's weights, not normalised: the state carries the sum l), so no merged
        # partial is written and read between the two kernels.
        m, _, weights, l = split_weights([prefix_lse(s) for s in range(prefix_splits)])
        acc = jnp.zeros((block_rows, pout_ref.shape[-1]), jnp.float32)
        for s, w in enumerate(weights):  # an empty split (w = 0) may hold anything: masked, not multiplied
            acc = acc + jnp.where(w[:, None] > 0, w[:, None] * prefix_out(s).astype(jnp.float32), 0.0)
        started = (l > 0) & real_row
        m = jnp.where(started, m, -jnp.inf)
        l = jnp.where(started, l, 0.0)
        acc = jnp.where(started[:, None], acc, 0.0)
    else:
        lse = prefix_lse()
        started = (lse > -jnp.inf) & real_row
        m = jnp.where(started, lse, -jnp.inf)
        l = jnp.where(started, 1.0, 0.0).astype(jnp.float32)
        acc = jnp.where(started[:, None], prefix_out().astype(jnp.float32), 0.0)

    key_iota = lax.broadcasted_iota(jnp.int32, (page_size,), 0)

    def body(page, carry):
        m, l, acc = carry
        page_id = pt_ref[b, page]
        pos = page * page_size + key_iota
        j = pos - length
        jc = jnp.clip(j, 0, MAX_TREE_NODES - 1)
        word = jnp.where(jc[None, :] < 32, w0[:, None], w1[:, None])
        bit = lax.shift_right_logical(word, (jc & 31)[None, :]) & 1
        in_window = (j >= 0) & (j < window)
        vis = (in_window[None, :] & (bit == 1)) | ((pos[None, :] >= tail_lo[:, None]) & (pos[None, :] < length))
        vis = vis & real_row[:, None]
        col = jnp.max(vis.astype(jnp.int32), axis=0) > 0  # some row of the tile sees this column
        slots = pl.ds(page_id * page_size, page_size)
        k = widen(plgpu.load(k_ref.at[slots, head, pl.ds(0, main_dim)], mask=col[:, None], other=0.0))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if rope_dim:
            kr = widen(plgpu.load(k_ref.at[slots, head, pl.ds(main_dim, rope_dim)], mask=col[:, None],
                                  other=0.0))
            s = s + lax.dot_general(qr, kr, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if shared_kv:
            v = k
        else:
            v = widen(plgpu.load(v_ref.at[slots, head, :], mask=col[:, None], other=0.0))
        s = jnp.where(vis, s * scale2, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - m_use)
        p = jnp.exp2(s - m_use[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(cdt), v, preferred_element_type=jnp.float32)
        return m_new, l, acc

    first_page = lo // page_size
    end_page = (hi + page_size - 1) // page_size
    m, l, acc = lax.fori_loop(first_page, end_page, body, (m, l, acc))
    seen = l > 0
    out = jnp.where(seen[:, None], acc / jnp.where(seen, l, 1.0)[:, None], 0.0).astype(out_ref.dtype)
    # Head layout (`heads_out`): the tile's rows r * G + g are query rows r, heads h * G + g, i.e.
    # [block / G, G * Dv] of the output viewed as [B, R, Hkv, G * Dv].
    out_ref[...] = out.reshape(out_ref.shape)


def heads_in_errors(query_rows: int, group: int, block: int, rope_dim: int = 0) -> list[str]:
    """Why the window kernel cannot read its query in head layout and its prefix partial in
    `head_io_rows` order (`heads_in`; empty: it can): that order must exist (`head_io_rows_errors`),
    its `block`-row tiles must be whole query rows (`writes_head_layout`), and the MLA layout
    (rope_dim > 0, G = Hq) has no such tiles."""
    errors = head_io_rows_errors(query_rows, group, "tree_window_attention: heads_in")
    if not errors and not writes_head_layout(query_rows, group, block):
        errors.append(f"tree_window_attention: heads_in needs {block}-row tiles of whole query rows "
                      f"(R={query_rows}, G={group})")
    if rope_dim:
        errors.append(f"tree_window_attention: heads_in is the GQA layout, got rope_dim={rope_dim}")
    return errors


def window_block_rows(total_rows: int, widest_dim: int, grid_without_rows: int, block_rows=None) -> int:
    """Rows per program the window kernel takes: `block_rows`, else DEFAULT_BLOCK_ROWS, else
    `default_block_rows`; at most `total_rows`."""
    block_rows = DEFAULT_BLOCK_ROWS if block_rows is None else block_rows
    return min(block_rows or default_block_rows(total_rows, widest_dim, grid_without_rows), total_rows)


def writes_head_layout(query_rows: int, group: int, block: int) -> bool:
    """Whether `block`-row tiles can write the output in head layout directly: each tile must be
    whole query rows (G divides it, G a power of two so the tile's [block / G, G * Dv] store has
    power-of-two sides) and the real rows R * G whole tiles (no tile reaches past row R)."""
    return (group & (group - 1) == 0 and block % group == 0 and (query_rows * group) % block == 0)


@functools.partial(jax.jit, static_argnames=("query_rows", "group", "window", "page_size", "scale",
                                             "causal_prefix", "rope_dim", "value_dim", "block_rows",
                                             "num_warps", "num_stages", "interpret", "poison_outputs",
                                             "prefix_whole_pages", "heads_out", "heads_in"))
def tree_window_row_layout(qr, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out_rows,
                           prefix_lse2_rows, *, query_rows: int, group: int, window: int, page_size: int,
                           scale: float, causal_prefix: bool = True, rope_dim: int = 0, value_dim: int,
                           block_rows=None, num_warps=None, num_stages=None, interpret: bool = False,
                           poison_outputs: bool = False, prefix_whole_pages: bool = False,
                           heads_out: bool = False, heads_in: bool = False):
    """The kernel on the row layout of `heads_to_rows`: `qr [B, Hkv, T, Dk]`, `mask [B, R, 2]`,
    `prefix_out_rows [B, Hkv, T, Dv]` f32 or bf16, `prefix_lse2_rows [B, Hkv, T]`, or the prefix
    half's S key-split partials unmerged, `[S, B, Hkv, T, Dv]` and `[S, B, Hkv, T]` (each program
    merges its rows' splits by lse2 as it starts), -> `[B, Hkv, T, Dv]` in qr's dtype, or with
    `heads_out` `[B, R, Hq, Dv]` (`rows_to_heads` of it): written so by the kernel where its row
    tiles allow (`writes_head_layout`), which saves the separate transpose
    (an XLA copy of the whole output), else transposed after it.

    `heads_in` (GQA, `heads_in_errors` empty; implies `heads_out`): `qr` is the query in head layout
    `[B, R, Hq, Dk]`, and the prefix partial `[B, Hkv, R * G, Dv]` and its lse2 `[B, Hkv, R * G]`
    (or `[S, ...]` of each) have their rows in `head_io_rows` order, as the Mosaic prefix writes
    them under `heads_io` unfused; each program reads its rows from them, and its mask words from
    `mask`, so no XLA transpose runs before the kernel. Inputs are assumed validated by
    `tree_window_attention` (or, `heads_in`, by the cascade)."""
    if heads_in:
        b, r, hq, dk = qr.shape
        hkv = hq // group
        total = r * group
    else:
        b, hkv, total, dk = qr.shape
    r = query_rows
    shared = v_pool is None
    main_dim = dk - rope_dim
    dv = value_dim
    check_launch(block_rows, num_warps, num_stages, "tree_window_attention")
    block = window_block_rows(total, max(main_dim, dv), b * hkv, block_rows)
    if heads_in:
        errors = heads_in_errors(r, group, block, rope_dim)
        if errors:
            raise ValueError("; ".join(errors))
    direct = (heads_out or heads_in) and writes_head_layout(r, group, block)
    # Written in head layout, only the tiles of real rows run (padding rows have no place there).
    tiles = r * group // block if direct else total // block

    words = jax.lax.bitcast_convert_type(mask.astype(jnp.uint32), jnp.int32)  # [B, R, 2]
    if not heads_in:
        words = heads_to_rows(jnp.broadcast_to(words[:, :, None, :], (b, r, hkv * group, 2)), hkv, total, fill=0)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)

    def row_spec(width):
        if width is None:
            return pl.BlockSpec((None, None, block), lambda t, h, bb: (bb, h, t))
        if heads_in:  # [B, R, Hq, width] viewed as [B, R, Hkv, G * width]: tile t is rows t * block / G on
            return pl.BlockSpec((None, block // group, None, group * width), lambda t, h, bb: (bb, t, h, 0))
        return pl.BlockSpec((None, None, block, width), lambda t, h, bb: (bb, h, t, 0))

    splits = prefix_out_rows.shape[0] if prefix_out_rows.ndim == 5 else 0

    def partial_spec(width):
        if heads_in:
            return any_spec  # gathered by row in the kernel from head_io_rows order
        if not splits:
            return row_spec(width)
        if width is None:
            return pl.BlockSpec((splits, None, None, block), lambda t, h, bb: (0, bb, h, t))
        return pl.BlockSpec((splits, None, None, block, width), lambda t, h, bb: (0, bb, h, t, 0))

    def head_view(x):
        # [B, R, Hq, D] as [B, R, Hkv, G * D] (a free reshape) for `row_spec` under heads_in.
        return x.reshape(*x.shape[:-2], hkv, group * x.shape[-1]) if heads_in else x

    args = [prefix_lengths.astype(jnp.int32), page_table.astype(jnp.int32), head_view(qr[..., :main_dim])]
    in_specs = [any_spec, any_spec, row_spec(main_dim)]
    if rope_dim:
        args.append(qr[..., main_dim:])
        in_specs.append(row_spec(rope_dim))
    args.append(k_pool)
    in_specs.append(any_spec)
    if not shared:
        args.append(v_pool)
        in_specs.append(any_spec)
    # A bf16 prefix partial is read as it is and widened in the kernel (no XLA convert).
    if prefix_out_rows.dtype != jnp.bfloat16:
        prefix_out_rows = prefix_out_rows.astype(jnp.float32)
    if heads_in:
        args += [words, prefix_out_rows, prefix_lse2_rows.astype(jnp.float32)]
        in_specs += [any_spec, partial_spec(dv), partial_spec(None)]
    else:
        args += [words[..., 0], words[..., 1], prefix_out_rows, prefix_lse2_rows.astype(jnp.float32)]
        in_specs += [row_spec(None), row_spec(None), partial_spec(dv), partial_spec(None)]

    kernel = functools.partial(
        _window_kernel, query_rows=r, group=group, block_rows=block, page_size=page_size,
        window=window, scale2=float(scale) * LOG2E, causal_prefix=causal_prefix, main_dim=main_dim,
        rope_dim=rope_dim, shared_kv=shared, prefix_whole_pages=prefix_whole_pages, prefix_splits=splits,
        heads_in=heads_in)
    if direct:
        # The output [B, R, Hq, Dv] viewed as [B, R, Hkv, G * Dv]; tile t holds rows t * block / G on.
        out_shape = jax.ShapeDtypeStruct((b, r, hkv, group * dv), qr.dtype)
        out_spec = pl.BlockSpec((None, block // group, None, group * dv), lambda t, h, bb: (bb, t, h, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((b, hkv, total, dv), qr.dtype)
        out_spec = row_spec(dv)
    aliases = {}
    if poison_outputs:
        # The output starts as NaN so a test proves every element is written.
        aliases = {len(args): 0}
        args.append(jnp.full(out_shape.shape, jnp.nan, out_shape.dtype))
        in_specs.append(any_spec)
        inner = kernel

        def kernel(*refs):
            return inner(*refs[:-2], refs[-1])
    out = pl.pallas_call(
        kernel,
        grid=(tiles, hkv, b),
        in_specs=in_specs,
        out_specs=out_spec,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or DEFAULT_NUM_WARPS,
                                             num_stages=num_stages or DEFAULT_NUM_STAGES),
        name="tree_window_attention",
    )(*args)
    if direct:
        return out.reshape(b, r, hkv * group, dv)
    return rows_to_heads(out, r, hkv * group) if heads_out else out


@functools.partial(jax.jit, static_argnames=("window", "page_size", "scale", "causal_prefix", "rope_dim",
                                             "value_dim", "block_rows", "num_warps", "num_stages",
                                             "interpret", "poison_outputs", "prefix_whole_pages"))
def _tree_window_pallas(q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2, *,
                        window, page_size, scale, causal_prefix, rope_dim, value_dim, block_rows,
                        num_warps, num_stages, interpret, poison_outputs, prefix_whole_pages=False):
    b, r, hq, dk = q.shape
    hkv = k_pool.shape[1]
    total = padded_rows(r * (hq // hkv))
    return tree_window_row_layout(
        heads_to_rows(q, hkv, total), k_pool, v_pool, page_table, prefix_lengths, mask,
        heads_to_rows(prefix_out.astype(jnp.float32), hkv, total),
        heads_to_rows(prefix_lse2.astype(jnp.float32), hkv, total, fill=-jnp.inf),
        query_rows=r, group=hq // hkv, window=window, page_size=page_size, scale=scale,
        causal_prefix=causal_prefix, rope_dim=rope_dim, value_dim=value_dim, block_rows=block_rows,
        num_warps=num_warps, num_stages=num_stages, interpret=interpret, poison_outputs=poison_outputs,
        prefix_whole_pages=prefix_whole_pages, heads_out=True)


def tree_window_attention(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array | None,
                          page_table: jax.Array, prefix_lengths: jax.Array, mask: jax.Array,
                          prefix_out: jax.Array, prefix_lse2: jax.Array, *, window: int,
                          page_size: int, scale: float | None = None, causal_prefix: bool = True,
                          rope_dim: int = 0, value_dim: int | None = None,
                          block_rows: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None, poison_outputs: bool = False,
                          prefix_whole_pages: bool = False, backend: str | None = None) -> jax.Array:
    """Window half + merge; see the module docstring.

    Shapes: `q [B, R, Hq, Dk]`, `k_pool [S, Hkv, Dk]` (MLA: `[S, Dk]` allowed), `v_pool [S, Hkv, Dv]`
    or None when the value is the key row's leading `value_dim` channels, `page_table [B, maxp]`,
    `prefix_lengths [B]`, `mask [B, R, 2] uint32`, `prefix_out [B, R, Hq, Dv]`,
    `prefix_lse2 [B, R, Hq]` (base 2) -> `[B, R, Hq, Dv]` in q's dtype (f32 for the reference).
    `scale` defaults to Dk^-1/2. `block_rows` (rows per program, a power of two >= 16; smaller
    splits a KV head's rows over more programs), `num_warps` and `num_stages` tune the compiled
    kernel; None takes DEFAULT_BLOCK_ROWS / DEFAULT_NUM_WARPS / DEFAULT_NUM_STAGES.
    `prefix_whole_pages`: the prefix partial covers only whole pages below P (a TMA prefix half), so
    each row's tail starts at min(P - R + 1 + r, (P // page_size) * page_size), or at
    (P // page_size) * page_size under `causal_prefix=False`.
    """
    if k_pool.ndim == 2:
        k_pool = k_pool[:, None, :]
    if rope_dim and v_pool is not None and v_pool is not k_pool:
        raise ValueError("tree_window_attention: rope_dim > 0 is the MLA layout; pass v_pool=None "
                         "(the value is the latent part of the key row)")
    if v_pool is not None and v_pool is k_pool:
        v_pool = None
    check_paged_inputs(q, k_pool, v_pool, page_table, prefix_lengths, page_size, "tree_window_attention")
    b, r, hq, dk = q.shape
    if k_pool.shape[-1] != dk:
        raise ValueError(f"tree_window_attention: q width {dk} != key row width {k_pool.shape[-1]}")
    if rope_dim < 0 or rope_dim >= dk:
        raise ValueError(f"tree_window_attention: rope_dim={rope_dim} must be in [0, {dk})")
    main_dim = dk - rope_dim
    for name, dim in (("key/latent width", main_dim), ("rope_dim", rope_dim)):
        if dim and (dim < 16 or dim & (dim - 1)):
            raise ValueError(f"tree_window_attention: {name} must be 0 or a power of two >= 16, got {dim}")
    if v_pool is None:
        value_dim = main_dim if value_dim is None else value_dim
        if value_dim != main_dim:
            raise ValueError(f"tree_window_attention: shared K/V rows need value_dim == {main_dim} "
                             f"(the latent width), got {value_dim}")
    else:
        if value_dim is not None and value_dim != v_pool.shape[-1]:
            raise ValueError(f"tree_window_attention: value_dim={value_dim} != v_pool width {v_pool.shape[-1]}")
        value_dim = v_pool.shape[-1]
        if value_dim < 16 or value_dim & (value_dim - 1):
            raise ValueError(f"tree_window_attention: value width must be a power of two >= 16, got {value_dim}")
    if not 1 <= window <= MAX_TREE_NODES:
        raise ValueError(f"tree_window_attention: window must be in [1, {MAX_TREE_NODES}], got {window}")
    if mask.shape != (b, r, 2) or mask.dtype != jnp.uint32:
        raise ValueError(f"tree_window_attention: mask must be [B={b}, R={r}, 2] uint32, "
                         f"got {mask.shape} {mask.dtype}")
    if prefix_out.shape != (b, r, hq, value_dim):
        raise ValueError(f"tree_window_attention: prefix_out must be {(b, r, hq, value_dim)}, got {prefix_out.shape}")
    if prefix_lse2.shape != (b, r, hq):
        raise ValueError(f"tree_window_attention: prefix_lse2 must be {(b, r, hq)}, got {prefix_lse2.shape}")
    check_launch(block_rows, num_warps, num_stages, "tree_window_attention")
    scale = float(dk ** -0.5 if scale is None else scale)
    kind = resolve_backend(backend)
    if kind == "reference":
        return tree_window_reference(q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out,
                                     prefix_lse2, window=window, page_size=page_size, scale=scale,
                                     causal_prefix=causal_prefix, rope_dim=rope_dim, value_dim=value_dim,
                                     prefix_whole_pages=prefix_whole_pages)
    return _tree_window_pallas(
        q, k_pool, v_pool, page_table, prefix_lengths, mask, prefix_out, prefix_lse2, window=window,
        page_size=page_size, scale=scale, causal_prefix=causal_prefix, rope_dim=rope_dim,
        value_dim=value_dim, block_rows=block_rows, num_warps=num_warps, num_stages=num_stages,
        interpret=kind == "interpret", poison_outputs=poison_outputs, prefix_whole_pages=prefix_whole_pages)


__all__ = ["tree_window_attention", "tree_window_row_layout", "window_block_rows", "writes_head_layout",
           "heads_in_errors"]
