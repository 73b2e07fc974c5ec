"""Tree window kernel (prefix tail + masked window + merge): Pallas interpret mode against the fp32
reference fed by a reference prefix partial; poison in every slot a row cannot see."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import fp32_tol, poisoned_paged_pools, verify_case
from tiers import cases, sweep
from trees import random_parents

from pallas_kernels.attention.prefix_decode import prefix_decode
from pallas_kernels.attention.reference import merge_partials_reference
from pallas_kernels.attention.tree_window import tree_window_attention
from treespec_jax.tree.masks import ancestor_mask, pack_mask_rows, unpack_mask_rows

FP8 = jnp.float8_e4m3fn


def window_case(rng, lengths, rows, hkv, group, d, page, dtype):
    """A poisoned window problem with a reference prefix partial: every position below P + rows is
    live. Returns `(q [B, rows, Hkv * group, d], k, v, table, lengths, mask, prefix_out, prefix_lse2)`."""
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    k, v, table = poisoned_paged_pools(rng, b, int(lengths.max()) + rows, hkv, d, page, dtype,
                                       lambda bb, pos: pos < lengths[bb] + rows)
    q = jnp.asarray(rng.standard_normal((b, rows, hkv * group, d)), jnp.float32).astype(dtype)
    mask = ancestor_mask(random_parents(rng, b, rows))
    lengths = jnp.asarray(lengths)
    po, plse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    return q, k, v, table, lengths, mask, po, plse


@pytest.mark.parametrize("group,page,dtype,rows", cases([
    (1, 16, jnp.float32, 64),   # 64-node trees: mask bit 63, 9+ pages of tail + window
    (4, 32, jnp.bfloat16, 7),
    (8, 64, FP8, 13),
], default=(0, 2)))
def test_window_matches_reference_on_random_trees(group, page, dtype, rows, backend):
    rng = np.random.default_rng(rows + page)
    hkv, d, b = 2, 16, 4
    lengths = np.array([0, rows // 2, 90, 33], np.int32)  # P = 0, P < R, ragged
    # Every committed key and the window (written by the verify forward) is live; the rest is poison.
    k, v, table = poisoned_paged_pools(rng, b, 90 + rows, hkv, d, page, dtype,
                              lambda bb, pos: pos < lengths[bb] + rows)
    q = jnp.asarray(rng.standard_normal((b, rows, group * hkv, d)), jnp.float32)
    q = q.astype(jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
    mask = ancestor_mask(random_parents(rng, b, rows))
    lengths = jnp.asarray(lengths)
    po, plse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    out = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                poison_outputs=True, backend=backend)
    ref = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                backend="reference")
    assert out.dtype == q.dtype and out.shape == (b, rows, group * hkv, d)
    assert rel_err(out, ref) < (fp32_tol(backend, 1e-5) if dtype == jnp.float32 else 1e-2)


def test_window_lane_mask_hides_unwritten_slots_and_nonfinite_prefix_partial(backend):
    """Lanes: bits name only some window slots; slots no row names are poisoned. A prefix partial
    with lse2 = -inf carries a NaN output that must be ignored."""
    rng = np.random.default_rng(11)
    b, rows, window, hkv, g, d, page = 3, 4, 16, 2, 2, 32, 16
    bits = rng.random((b, rows, window)) < 0.3
    bits[:, :, 0] = False  # column 0 is seen by no row: poisoned, and in the same page as seen ones
    bits[0, 1, :] = False  # a row with no window key at all
    lengths = np.array([5, 0, 40], np.int32)
    named = bits.any(axis=1)
    k, v, table = poisoned_paged_pools(rng, b, 40 + window, hkv, d, page, jnp.float32,
                              lambda bb, pos: pos < lengths[bb] or (0 <= pos - lengths[bb] < window
                                                                     and named[bb, pos - lengths[bb]]))
    q = jnp.asarray(rng.standard_normal((b, rows, hkv * g, d)), jnp.float32)
    mask = pack_mask_rows(jnp.asarray(bits))
    lengths = jnp.asarray(lengths)
    po, plse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    po = jnp.where(jnp.isneginf(plse)[..., None], jnp.nan, po)
    out = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=window, page_size=page,
                                poison_outputs=True, backend=backend)
    ref = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=window, page_size=page,
                                backend="reference")
    assert rel_err(out, ref) < fp32_tol(backend, 1e-5)
    # Request 1 (P = 0), row 1 of request 0 sees its prefix only: the empty request row is exactly 0.
    empty = ~np.asarray(unpack_mask_rows(mask, window)).any(-1) & (np.asarray(lengths) == 0)[:, None]
    assert np.all(np.asarray(out)[empty] == 0)


@sweep  # causal_prefix=False also runs under the sliding lanes and prefix_covers_tail
def test_window_without_causal_prefix_attends_window_only(backend):
    rng = np.random.default_rng(5)
    b, rows, hkv, g, d, page = 2, 8, 1, 4, 16, 16
    lengths = np.array([20, 3], np.int32)
    k, v, table = poisoned_paged_pools(rng, b, 40, hkv, d, page, jnp.float32,
                              lambda bb, pos: lengths[bb] <= pos < lengths[bb] + rows)  # prefix poisoned
    q = jnp.asarray(rng.standard_normal((b, rows, hkv * g, d)), jnp.float32)
    mask = ancestor_mask(random_parents(rng, b, rows))
    po = jnp.asarray(rng.standard_normal((b, rows, hkv * g, d)), jnp.float32)
    plse = jnp.asarray(rng.standard_normal((b, rows, hkv * g)), jnp.float32)
    lengths = jnp.asarray(lengths)
    out = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                causal_prefix=False, poison_outputs=True, backend=backend)
    ref = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                causal_prefix=False, backend="reference")
    assert rel_err(out, ref) < fp32_tol(backend, 1e-5)
    # Independent check: merge of the given partial with a per-row softmax over visible window keys.
    kk = np.asarray(k, np.float64)
    vv = np.asarray(v, np.float64)
    bits = np.asarray(unpack_mask_rows(mask, rows))
    expect = np.zeros(out.shape)
    for bb in range(b):
        for r in range(rows):
            pos = [int(lengths[bb]) + j for j in range(rows) if bits[bb, r, j]]
            slots = [int(table[bb, p // page]) * page + p % page for p in pos]
            for h in range(hkv * g):
                s = np.asarray(q[bb, r, h], np.float64) @ kk[slots, h // g].T * d ** -0.5
                s2 = s / np.log(2)
                lse_w = np.log2(np.sum(np.exp2(s2)))
                o_w = np.exp2(s2 - lse_w) @ vv[slots, h // g]
                lp = float(plse[bb, r, h])
                mx = max(lp, lse_w)
                wp, ww = 2 ** (lp - mx), 2 ** (lse_w - mx)
                expect[bb, r, h] = (wp * np.asarray(po[bb, r, h]) + ww * o_w) / (wp + ww)
    assert rel_err(out, expect) < fp32_tol(backend, 1e-5)


@pytest.mark.parametrize("dtype", cases([jnp.bfloat16, FP8], default=(1,)))
def test_window_mla_latent_layout(dtype, backend):
    """MLA: one latent row [latent | rope] per token is both key (two score terms) and value."""
    rng = np.random.default_rng(3)
    b, rows, hq, lat, rope, page = 2, 6, 4, 64, 16, 16
    lengths = np.array([2, 30], np.int32)
    lp, _, table = poisoned_paged_pools(rng, b, 30 + rows, 1, lat + rope, page, dtype,
                               lambda bb, pos: pos < lengths[bb] + rows)
    latent = lp[:, 0, :]  # the 2-D latent pool [S, latent + rope]
    q = jnp.asarray(rng.standard_normal((b, rows, hq, lat + rope)), jnp.float32).astype(jnp.bfloat16)
    po = jnp.asarray(rng.standard_normal((b, rows, hq, lat)), jnp.float32)
    plse = jnp.asarray(rng.standard_normal((b, rows, hq)) + 3.0, jnp.float32)
    mask = ancestor_mask(random_parents(rng, b, rows))
    lengths = jnp.asarray(lengths)
    kw = dict(window=rows, page_size=page, scale=0.1, rope_dim=rope)
    out = tree_window_attention(q, latent, None, table, lengths, mask, po, plse, poison_outputs=True,
                                backend=backend, **kw)
    ref = tree_window_attention(q, latent, None, table, lengths, mask, po, plse, backend="reference", **kw)
    assert out.shape == (b, rows, hq, lat)
    assert rel_err(out, ref) < 1e-2
    # The rope channels matter: dropping them changes the answer.
    q_norope = q.at[..., lat:].set(0)
    ref2 = tree_window_attention(q_norope, latent, None, table, lengths, mask, po, plse, backend="reference", **kw)
    assert rel_err(ref2, ref) > 1e-2


def test_merge_reference_drops_empty_partials():
    oa = jnp.asarray([[1.0, 2.0], [jnp.nan, jnp.nan]])
    la = jnp.asarray([0.0, -jnp.inf])
    ob = jnp.asarray([[3.0, 4.0], [5.0, 6.0]])
    lb = jnp.asarray([0.0, 1.0])
    out, lse = merge_partials_reference(oa, la, ob, lb)
    np.testing.assert_allclose(np.asarray(out), [[2.0, 3.0], [5.0, 6.0]])
    np.testing.assert_allclose(np.asarray(lse), [1.0, 1.0])


def tiny_window_inputs():
    """Well-formed zero inputs (B=1, R=4, Hq=2, Hkv=1, D=16, page 16) for the refusal tests."""
    return (jnp.zeros((1, 4, 2, 16)), jnp.zeros((64, 1, 16)), jnp.zeros((1, 4), jnp.int32),
            jnp.zeros((1,), jnp.int32), jnp.zeros((1, 4, 2), jnp.uint32), jnp.zeros((1, 4, 2, 16)),
            jnp.zeros((1, 4, 2)))


def test_window_rejects_bad_inputs():
    q, pool, table, lengths, mask, po, plse = tiny_window_inputs()
    with pytest.raises(ValueError, match="window must be in"):
        tree_window_attention(q, pool, pool, table, lengths, mask, po, plse, window=65, page_size=16)
    with pytest.raises(ValueError, match="uint32"):
        tree_window_attention(q, pool, pool, table, lengths, mask.astype(jnp.int32), po, plse, window=4,
                              page_size=16)
    with pytest.raises(ValueError, match="v_pool=None"):
        tree_window_attention(jnp.zeros((1, 4, 2, 32)), jnp.zeros((64, 1, 32)), jnp.zeros((64, 1, 32)) + 1,
                              table, lengths, mask, po, plse, window=4, page_size=16, rope_dim=16)
    with pytest.raises(ValueError, match="rope_dim"):
        tree_window_attention(jnp.zeros((1, 4, 2, 24)), jnp.zeros((64, 1, 24)), None, table, lengths, mask,
                              po, plse, window=4, page_size=16, rope_dim=8)
    with pytest.raises(ValueError, match="prefix_lse2"):
        tree_window_attention(q, pool, pool, table, lengths, mask, po, plse[..., :1], window=4, page_size=16)


@sweep  # explicit row tiles; the default tiles run in every test above
@pytest.mark.parametrize("block_rows,num_warps", [(16, 8), (32, None)])
def test_window_row_tiles(block_rows, num_warps, backend):
    """block_rows splits a KV head's R * G = 36 rows (padded to 64) over several programs; each tile
    finds its own tail coverage and mask words. Checked against the reference."""
    rows, page = 9, 16
    q, k, v, table, lengths, mask, po, plse = window_case(np.random.default_rng(block_rows), [3, 41], rows, 2, 4,
                                                          16, page, jnp.float32)
    out = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                block_rows=block_rows, num_warps=num_warps, poison_outputs=True,
                                backend=backend)
    ref = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=rows, page_size=page,
                                backend="reference")
    assert rel_err(out, ref) < fp32_tol(backend, 1e-5)


@pytest.mark.parametrize("rows,group,block_rows,direct", cases([
    (8, 4, 16, True),     # 32 rows: two 16-row tiles of four query rows each
    (16, 2, 32, True),    # one tile spans 16 query rows
    (16, 1, None, True),  # G = 1: a tile is block query rows of one head
    (12, 4, 16, True),    # 48 real rows of a 64-row layout: the padding tile is not run
    (6, 8, None, True),   # the same with G = 8 and the default tile
    (9, 4, 16, False),    # 36 rows: the last tile would reach past row R
    (8, 3, 16, False),    # G = 3 divides no power-of-two tile
], default=(0, 5)))
def test_window_writes_head_layout_itself_where_tiles_allow(rows, group, block_rows, direct, interpret):
    """heads_out: the kernel stores its tiles straight into [B, R, Hq, Dv] (or the row layout is
    transposed after it); either way every element equals rows_to_heads of the row-layout output,
    and a NaN-poisoned output buffer proves the direct store writes everything."""
    from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows, rows_to_heads
    from pallas_kernels.attention.tree_window import (tree_window_row_layout, window_block_rows,
                                                      writes_head_layout)

    b, hkv, d, page = 2, 2, 16, 16
    q, k, v, table, lengths, mask, po, plse = window_case(np.random.default_rng(rows * group), [5, 37], rows, hkv,
                                                          group, d, page, jnp.bfloat16)
    total = padded_rows(rows * group)
    args = (heads_to_rows(q, hkv, total), k, v, table, lengths, mask,
            heads_to_rows(po.astype(jnp.float32), hkv, total),
            heads_to_rows(plse.astype(jnp.float32), hkv, total, fill=-jnp.inf))
    kw = dict(query_rows=rows, group=group, window=rows, page_size=page, scale=d ** -0.5, value_dim=d,
              block_rows=block_rows, interpret=interpret)
    rows_out = tree_window_row_layout(*args, **kw)
    heads = tree_window_row_layout(*args, **kw, heads_out=True, poison_outputs=True)
    block = window_block_rows(total, d, b * hkv, block_rows)  # the kernel's own choice
    assert writes_head_layout(rows, group, block) == direct
    assert heads.shape == (b, rows, hkv * group, d)
    assert not jnp.isnan(heads.astype(jnp.float32)).any()
    np.testing.assert_array_equal(np.asarray(heads, np.float32),
                                  np.asarray(rows_to_heads(rows_out, rows, hkv * group), np.float32))


def test_window_rejects_bad_launch_options():
    q, pool, table, lengths, mask, po, plse = tiny_window_inputs()
    kw = dict(window=4, page_size=16)
    with pytest.raises(ValueError, match="block_rows must be a power of two >= 16, got 24"):
        tree_window_attention(q, pool, pool, table, lengths, mask, po, plse, block_rows=24, **kw)
    with pytest.raises(ValueError, match="num_warps must be one of 1, 2, 4, 8, 16, got 3"):
        tree_window_attention(q, pool, pool, table, lengths, mask, po, plse, num_warps=3, **kw)
    with pytest.raises(ValueError, match="num_stages must be >= 1, got 0"):
        tree_window_attention(q, pool, pool, table, lengths, mask, po, plse, num_stages=0, **kw)


def test_default_row_tiles_follow_the_grid_size():
    from pallas_kernels.attention.tree_window import default_block_rows
    assert default_block_rows(256, 128, 1 * 8) == 16  # B=1: small grid, many small tiles
    assert default_block_rows(256, 128, 32 * 8) == 64  # B=32: 1024 programs at 64 rows
    assert default_block_rows(256, 128, 16 * 8) == 16  # B=16: 512
    assert default_block_rows(256, 128, 64 * 8) == 64  # B=64: 2048 programs at 64 rows
    assert default_block_rows(256, 512, 64 * 8) == 32  # MLA latent: accumulator cap
    assert default_block_rows(16, 128, 64 * 8) == 16  # never past the rows there are


@pytest.mark.parametrize("r,causal", cases([(5, True), (24, True), (5, False), (24, False)], default=(2,)))
def test_window_covers_the_partial_page_when_the_prefix_took_whole_pages(r, causal, interpret):
    """`prefix_whole_pages=True` (the Mosaic GPU prefix half reads whole pages only): with a prefix
    partial over keys [0, min(P - R + 1 + r, whole)) (causal), or [0, whole) for every row
    (`causal_prefix=False`, the cascade's `prefix_covers_tail`), the window kernel adds the rest of
    the prefix and the tree window; the merge equals one dense attention. R < page and R > page both
    run."""
    from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows, rows_to_heads
    from pallas_kernels.attention.reference import cascade_dense_reference, prefix_decode_reference
    from pallas_kernels.attention.tree_window import tree_window_row_layout

    hkv, g, d, page, w = 2, 2, 16, 16, r
    # P = 0, a partial last page, P < R for r = 24.
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(70 + r), [0, 37, 50], r, hkv, g, d, page,
                                             jnp.float32)
    # Prefix partial over whole pages only; without the causal split each row alone as a one-row
    # decode, whose bound is P.
    if causal:
        p_out, p_lse = prefix_decode_reference(q, k, v, table, lens, page_size=page, scale=d ** -0.5,
                                               whole_pages=True)
    else:
        parts = [prefix_decode_reference(q[:, i:i + 1], k, v, table, lens, page_size=page, scale=d ** -0.5,
                                         whole_pages=True) for i in range(r)]
        p_out = jnp.concatenate([o for o, _ in parts], axis=1)
        p_lse = jnp.concatenate([lse for _, lse in parts], axis=1)
    total = padded_rows(r * g)
    out = tree_window_row_layout(
        heads_to_rows(q, hkv, total), k, v, table, lens, mask, heads_to_rows(p_out, hkv, total),
        heads_to_rows(p_lse, hkv, total, fill=-jnp.inf), query_rows=r, group=g, window=w, page_size=page,
        scale=d ** -0.5, value_dim=d, interpret=interpret, poison_outputs=True, prefix_whole_pages=True,
        causal_prefix=causal)
    got = rows_to_heads(out, r, hkv * g)
    ref, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=w, page_size=page, scale=d ** -0.5)
    assert rel_err(got, ref) < fp32_tol(interpret, 1e-5)
    # The reference half with the same flag agrees too.
    from pallas_kernels.attention.reference import tree_window_reference
    ref2 = tree_window_reference(q, k, v, table, lens, mask, p_out, p_lse, window=w, page_size=page,
                                 scale=d ** -0.5, prefix_whole_pages=True, causal_prefix=causal)
    assert rel_err(ref2, ref) < 1e-5


@pytest.mark.parametrize("splits,group,dtype", cases([(3, 4, jnp.bfloat16), (8, 1, FP8), (2, 8, jnp.float32)],
                                                     default=(1,)))
def test_window_merges_unmerged_key_split_partials(splits, group, dtype, interpret):
    """The window kernel fed the prefix half's S key-split partials (`[S, B, Hkv, T, Dv]`, each
    program merging its rows' splits by lse2) equals it fed their merge (`merge_splits_reference`):
    splits that saw none of a row's keys (lse2 -inf) carry NaN outputs that must not leak, and a row
    no split saw (P = 0) starts from the window alone."""
    from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows
    from pallas_kernels.attention.split_merge import merge_splits_reference
    from pallas_kernels.attention.tree_window import tree_window_row_layout

    rng = np.random.default_rng(splits * 10 + group)
    hkv, d, rows, page = 2, 32, 9, 16
    q, k, v, table, lengths, mask, _, _ = window_case(rng, [0, 40, 77], rows, hkv, group, d, page, dtype)
    q = q.astype(jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
    b, total = q.shape[0], padded_rows(rows * group)
    out_s = rng.standard_normal((splits, b, hkv, total, d)).astype(np.float32)
    lse_s = (rng.standard_normal((splits, b, hkv, total)) * 4 + 3).astype(np.float32)
    empty = rng.random((splits, b, hkv, total)) < 0.3
    lse_s[empty] = -np.inf
    out_s[empty] = np.nan  # an empty split's output is never read
    lse_s[:, 0] = -np.inf  # request 0 has P = 0: no split saw anything
    out_s[:, 0] = np.nan
    merged, merged_lse = merge_splits_reference(jnp.asarray(np.where(np.isnan(out_s), 0, out_s)),
                                                jnp.asarray(lse_s))
    qr = heads_to_rows(q, hkv, total)
    kw = dict(query_rows=rows, group=group, window=rows, page_size=page, scale=d ** -0.5, value_dim=d,
              interpret=interpret, poison_outputs=True, heads_out=True)
    got = tree_window_row_layout(qr, k, v, table, lengths, mask, jnp.asarray(out_s), jnp.asarray(lse_s), **kw)
    want = tree_window_row_layout(qr, k, v, table, lengths, mask, merged, merged_lse, **kw)
    got = np.asarray(got, np.float32)
    assert got.shape == (b, rows, hkv * group, d) and not np.isnan(got).any()
    assert rel_err(got, want) < (fp32_tol(interpret, 1e-5) if dtype == jnp.float32 else 1e-2)


@pytest.mark.parametrize("rows,group,splits,block_rows,dtype", cases([
    (16, 4, 0, None, jnp.bfloat16),  # 64 rows per KV head in 16-row tiles: four query rows each
    (32, 2, 3, 64, FP8),             # three unmerged key splits, 64-row tiles spanning a head_io tile
    (8, 8, 2, 16, jnp.bfloat16),     # G = 8: two query rows per tile
    (64, 1, 0, 32, jnp.float32),     # G = 1: a tile is 32 query rows of one head
], default=(1,)))
def test_window_reads_head_layout_inputs(rows, group, splits, block_rows, dtype, interpret):
    """heads_in: the query in head layout and the prefix partial and lse2 with rows in `head_io_rows`
    order (the unfused Mosaic prefix's heads_io output), the mask words gathered per query row, give
    the row-layout kernel's bits; NaN in empty splits' outputs and in the poisoned output buffer
    never shows."""
    from pallas_kernels.attention.prefix_decode import heads_to_rows
    from pallas_kernels.attention.split_merge import head_io_rows
    from pallas_kernels.attention.tree_window import tree_window_row_layout

    rng = np.random.default_rng(rows * group + splits)
    hkv, d, page = 2, 32, 16
    q, k, v, table, lengths, mask, po, plse = window_case(rng, [0, 40, 77], rows, hkv, group, d, page, dtype)
    q = q.astype(jnp.float32 if dtype == jnp.float32 else jnp.bfloat16)
    b, hq, total = q.shape[0], hkv * group, rows * group
    lead = (splits,) if splits else ()
    out_h = rng.standard_normal(lead + (b, rows, hq, d)).astype(np.float32)
    lse_h = (rng.standard_normal(lead + (b, rows, hq)) * 4 + 3).astype(np.float32)
    if splits:
        empty = rng.random(lse_h.shape) < 0.3
        lse_h[empty] = -np.inf
        out_h[empty] = np.nan  # an empty split's output is never read
    lse_h[..., 0, :, :] = -np.inf  # request 0 has P = 0: the prefix saw nothing
    out_h[..., 0, :, :, :] = np.nan
    out_h, lse_h = jnp.asarray(out_h), jnp.asarray(lse_h)
    kw = dict(query_rows=rows, group=group, window=rows, page_size=page, scale=d ** -0.5, value_dim=d,
              block_rows=block_rows, interpret=interpret, poison_outputs=True)
    to_rows = lambda x, fill=0.0: (jax.vmap(lambda y: heads_to_rows(y, hkv, total, fill))(x) if splits
                                   else heads_to_rows(x, hkv, total, fill))
    out_rows, lse_rows = to_rows(out_h), to_rows(lse_h, -jnp.inf)  # row r * G + g
    # head_io_rows order: row 64 w + g (64 / G) + i holds row-layout row (w (64 / G) + i) G + g.
    t = np.arange(total)
    per = 64 // group
    order = ((t // 64) * per + t % per) * group + (t % 64) // per
    np.testing.assert_array_equal(np.asarray(head_io_rows(lse_h, group)), np.asarray(lse_rows[..., order]))
    got = tree_window_row_layout(q, k, v, table, lengths, mask, out_rows[..., order, :], lse_rows[..., order],
                                 heads_in=True, **kw)
    want = tree_window_row_layout(heads_to_rows(q, hkv, total), k, v, table, lengths, mask, out_rows, lse_rows,
                                  heads_out=True, **kw)
    got = np.asarray(got, np.float32)
    assert got.shape == (b, rows, hq, d) and not np.isnan(got).any()
    np.testing.assert_array_equal(got, np.asarray(want, np.float32))


def test_window_refuses_head_layout_inputs_it_cannot_tile():
    """heads_in names why it cannot run: the partial's head_io_rows order needs R a multiple of 64 / G
    and G a power of two up to 8, tiles of whole query rows, and no MLA layout, every blocker at once."""
    from pallas_kernels.attention.tree_window import heads_in_errors
    assert heads_in_errors(16, 4, 16) == []
    assert "heads_in needs R a multiple of 64 / G = 16, got R=12" in heads_in_errors(12, 4, 16)[0]
    assert "heads_in needs a GQA group of 1, 2, 4 or 8 heads, got 3" in heads_in_errors(64, 3, 16)[0]
    both = heads_in_errors(8, 8, 128, rope_dim=16)
    assert len(both) == 2 and "128-row tiles of whole query rows" in both[0] and "rope_dim=16" in both[1]
