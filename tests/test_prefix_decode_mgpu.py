"""The Mosaic GPU prefix half in Pallas' GPU interpreter, against dense fp32 attention.

The interpreter simulates shared memory, TMA copies, barriers and wgmma on the CPU, so these tests
check the kernel's indexing, page-table reads, masking and synchronisation. They cannot check the
compiled kernel (benchmarks/tools/mgpu_prefix_check.py does that on the GPU).
"""

import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import verify_case
from tiers import cases, sweep

from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows, rows_to_heads, split_key_blocks
from pallas_kernels.attention.prefix_decode_mgpu import (check_mgpu_inputs, default_mgpu_num_splits,
                                                         default_pages_per_step, prefix_decode_mgpu_row_layout,
                                                         warpgroup_layout)
from pallas_kernels.attention.reference import cascade_dense_reference, prefix_decode_reference
from pallas_kernels.attention.tree_window import tree_window_row_layout

PAGE = 64


FP8 = jnp.float8_e4m3fn


CASES = [
    (32, 4, [0, 70, 200], 1, True, jnp.bfloat16, 1),  # P = 0, partial last pages
    # Two 128-row CTAs per KV head: at P = 260 the first one's bound (P - 32) ends mid-page below
    # the last whole page, so its last block is partly masked. Three key splits (one may be empty).
    (64, 4, [260, 130, 20], 3, True, jnp.bfloat16, 1),
    (16, 8, [20, 128, 300], 2, False, jnp.bfloat16, 1),  # P < R, P a whole number of pages, group 8, no turn-taking
    (16, 4, [50, 300], 1, True, jnp.bfloat16, 1),  # 64 rows per KV head: one compute warpgroup per CTA
    # FP8 E4M3 pools: FP8 query x FP8 K scores, V widened to fp16 per warpgroup (bf16 q cast here).
    (32, 4, [0, 70, 200], 1, True, FP8, 1),
    (16, 4, [50, 300], 2, True, FP8, 1),
    # Two pages per step: 1 and 3 whole pages end mid-step (the step's second page repeats its
    # first, masked); 4 whole pages fill two steps; two key splits.
    (32, 4, [70, 200, 300], 2, True, jnp.bfloat16, 2),
    (16, 4, [200, 130], 1, True, FP8, 2),
]
# Three stages of two pages per step (at D=128 only FP8 rings fit shared memory so).
STAGED = [(*case, 2, None) for case in CASES] + [(32, 4, [70, 200, 300], 2, True, FP8, 2, 3, None)]
# Warpgroup key splits (the default for 64-row heads of FP8 pools, so the 64-row FP8 cases above
# run them too): the one-warpgroup form forced for FP8 (whose warpgroup also widens V); odd step counts (P = 200, 330: 3 and 5 whole pages), where warpgroup 1
# owns one step fewer and must still take its turns; forced on 128-row heads; no
# turn-taking, FP8; four stages (each warpgroup owns two buffers of the ring).
KEY_SPLIT = [
    (16, 4, [200, 330], 1, True, FP8, 1, 2, False),
    (16, 4, [200, 330], 1, True, jnp.bfloat16, 1, 2, True),
    (16, 4, [200, 330, 10], 2, True, FP8, 1, 4, True),
    (32, 4, [70, 200, 330], 2, True, jnp.bfloat16, 2, 2, True),
    (16, 4, [200, 330], 1, False, FP8, 2, 4, True),
]


# Default tier: 64-row bf16 heads, 128-row FP8 heads (V widened by the memory warpgroup), the FP8
# warpgroup key split over four stages, two key splits, two pages per step.
@pytest.mark.parametrize("r,g,lengths,splits,pingpong,dtype,pps,stages,key_split",
                         cases(STAGED + KEY_SPLIT, default=(3, 4, 13)))
def test_mgpu_prefix_and_cascade_match_dense(r, g, lengths, splits, pingpong, dtype, pps, stages, key_split,
                                             interpret):
    check_prefix_and_cascade(r, g, lengths, splits, pingpong, dtype, pps, stages, key_split, interpret=interpret)


def check_prefix_and_cascade(r, g, lengths, splits, pingpong, dtype, pps, stages, key_split, *, interpret, opts=None,
                             d=64):
    """The Mosaic prefix (kernel options `opts`) against the fp32 prefix reference, and the cascade
    through it against dense fp32 attention."""
    hkv = 2
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(r * g), lengths, r, hkv, g, d, PAGE,
                                             dtype, q_dtype=jnp.bfloat16)
    total = padded_rows(r * g)
    qr = heads_to_rows(q, hkv, total)
    out, lse = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, query_rows=r, group=g, page_size=PAGE,
                                             scale=d ** -0.5, num_splits=splits, pingpong=pingpong,
                                             pages_per_step=pps, stages=stages, key_split=key_split,
                                             interpret=interpret, **(opts or {}))
    ref_out, ref_lse = prefix_decode_reference(q, k, v, table, lens, page_size=PAGE, scale=d ** -0.5,
                                               whole_pages=True)
    assert rel_err(rows_to_heads(out, r, hkv * g), ref_out) < 1e-2
    got_lse = np.asarray(rows_to_heads(lse, r, hkv * g))
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(got_lse), fin)  # rows that see no key: -inf, out 0
    np.testing.assert_allclose(got_lse[fin], np.asarray(ref_lse)[fin], atol=2e-3)
    # Whole cascade: the window kernel covers the partial last page and the tree window.
    win = tree_window_row_layout(qr, k, v, table, lens, mask, out, lse, query_rows=r, group=g, window=r,
                                 page_size=PAGE, scale=d ** -0.5, value_dim=d, interpret=interpret,
                                 prefix_whole_pages=True)
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=r, page_size=PAGE, scale=d ** -0.5)
    # Under FP8 the dense reference scores the unquantised query everywhere, the prefix half the FP8 one.
    assert rel_err(rows_to_heads(win, r, hkv * g), dense) < (3e-2 if dtype == FP8 else 1e-2)


@pytest.mark.parametrize("steps", [0, 1, 3, 8, 9, 64])
@pytest.mark.parametrize("splits", [1, 2, 3, 16])
def test_key_split_shares_follow_the_length(steps, splits):
    """The splits' shares partition the request's own key blocks [0, steps), in order, each at most
    cdiv(steps, splits) long: a short prefix in a wide page table still spreads over the splits."""
    shares = [tuple(int(x) for x in split_key_blocks(jnp.int32(steps), jnp.int32(i), splits)) for i in range(splits)]
    covered = [blk for lo, hi in shares for blk in range(lo, hi)]
    assert covered == list(range(steps))
    assert max(hi - lo for lo, hi in shares) == -(-steps // splits)


def test_mgpu_prefix_spreads_a_short_prefix_over_its_splits(interpret):
    """Four key splits over a table sized for 600 keys: the request at P = 200 (3 whole pages) now
    gives one page to each of three splits and none to the fourth, where fixed shares of the table
    put all three in split 0; both requests still match dense attention."""
    check_prefix_and_cascade(16, 4, [600, 200], 4, True, jnp.bfloat16, 1, None, None, interpret=interpret)


def test_mgpu_prefix_refuses_unsupported_shapes():
    bf = jnp.bfloat16
    pool = jnp.zeros((128, 1, 64), bf)
    with pytest.raises(ValueError, match="multiple of 64, got 32"):
        check_mgpu_inputs(jnp.zeros((1, 1, 32, 64), bf), pool, pool, 64)
    with pytest.raises(ValueError, match="page_size must be 64 or 128"):
        check_mgpu_inputs(jnp.zeros((1, 1, 128, 64), bf), pool, pool, 32)
    with pytest.raises(ValueError, match="head dim"):
        check_mgpu_inputs(jnp.zeros((1, 1, 128, 48), bf), jnp.zeros((128, 1, 48), bf), jnp.zeros((128, 1, 48), bf), 64)
    with pytest.raises(ValueError, match="q must have the pools' dtype bfloat16, got float32"):
        check_mgpu_inputs(jnp.zeros((1, 1, 128, 64), jnp.float32), pool, pool, 64)
    with pytest.raises(ValueError, match="K and V must share one dtype.*got float8_e4m3fn, bfloat16"):
        check_mgpu_inputs(jnp.zeros((1, 1, 128, 64), bf), pool.astype(FP8), pool, 64)
    with pytest.raises(ValueError, match="float32, float32"):
        check_mgpu_inputs(jnp.zeros((1, 1, 128, 64), bf), pool.astype(jnp.float32), pool.astype(jnp.float32), 64)
    # Every blocker at once.
    with pytest.raises(ValueError, match="multiple of 64, got 32.*page_size must be 64 or 128"):
        check_mgpu_inputs(jnp.zeros((1, 1, 32, 64), bf), pool, pool, 32)
    big = jnp.zeros((256, 1, 128), bf)
    with pytest.raises(ValueError, match="page_size=64, pages_per_step=2, stages=3, head dim 128 need"):
        check_mgpu_inputs(jnp.zeros((1, 1, 256, 128), bf), big, big, 64, stages=3, pages_per_step=2)
    with pytest.raises(ValueError, match="pages_per_step must be 1 or 2, got 4"):
        check_mgpu_inputs(jnp.zeros((1, 1, 256, 128), bf), big, big, 64, pages_per_step=4)
    with pytest.raises(ValueError, match="page_size=128, pages_per_step=1, stages=3, head dim 128 need"):
        check_mgpu_inputs(jnp.zeros((1, 1, 256, 128), bf), big, big, 128, stages=3)


def test_default_mgpu_num_splits_fills_one_wave():
    """One CTA per SM in one wave: B=1, Hkv=8, two row tiles (16 programs) on 132 SMs take 8 splits;
    a grid that already fills the SMs takes none; a short table gives each split >= 2 of its steps."""
    assert default_mgpu_num_splits(1, 8, 2, 257, sms=132) == 8
    assert default_mgpu_num_splits(8, 8, 1, 65, sms=132) == 2
    assert default_mgpu_num_splits(32, 8, 2, 257, sms=132) == 1
    assert default_mgpu_num_splits(200, 1, 1, 257, sms=132) == 1
    assert default_mgpu_num_splits(1, 8, 2, 13, sms=132) == 7
    assert default_mgpu_num_splits(1, 8, 2, 3, sms=132) == 2
    assert default_mgpu_num_splits(1, 8, 1, 9, sms=132) == 5  # B=1 decode over a 1k prefix
    assert default_mgpu_num_splits(1, 8, 2, 1, sms=132) == 1


def test_warpgroup_layout_splits_keys_of_64_row_heads():
    """Rows per KV head -> (compute warpgroups, rows per CTA, key split)."""
    assert warpgroup_layout(256) == (2, 128, False)  # N=64, G=4: each warpgroup its own 64 rows
    assert warpgroup_layout(256, itemsize=1) == (2, 128, False)
    assert warpgroup_layout(64) == (1, 64, False)  # N=16, G=4, bf16: one warpgroup (measured faster)
    assert warpgroup_layout(64, itemsize=1) == (2, 64, True)  # FP8: both on the rows, alternate steps
    assert warpgroup_layout(64, key_split=True) == (2, 64, True)
    assert warpgroup_layout(64, key_split=False, itemsize=1) == (1, 64, False)
    assert warpgroup_layout(256, key_split=True) == (2, 64, True)
    assert warpgroup_layout(192, itemsize=1) == (2, 64, True)  # 1.5 CTAs of 128 rows: 64-row CTAs


def test_key_split_refuses_an_odd_number_of_stages():
    """Each warpgroup owns half of the ring under a key split: a buffer both warpgroups waited on in
    turn would desynchronise the per-thread barrier phases on the GPU (the interpreter does not
    model that), so odd stage counts are refused, naming the value."""
    bf = jnp.bfloat16
    pool = jnp.zeros((256, 1, 128), FP8)
    with pytest.raises(ValueError, match="even number of stages.*got 3"):
        check_mgpu_inputs(jnp.zeros((1, 1, 64, 128), bf), pool, pool, 64, stages=3)
    with pytest.raises(ValueError, match="even number of stages.*got 3"):
        check_mgpu_inputs(jnp.zeros((1, 1, 256, 128), bf), pool, pool, 64, stages=3, key_split=True)
    check_mgpu_inputs(jnp.zeros((1, 1, 256, 128), bf), pool, pool, 64, stages=3)  # rows mode: any count
    check_mgpu_inputs(jnp.zeros((1, 1, 64, 128), bf), pool, pool, 64, stages=3, key_split=False)
    check_mgpu_inputs(jnp.zeros((1, 1, 64, 128), bf), pool, pool, 64, stages=4)


def test_key_split_warpgroups_merge_into_one_partial_per_cta():
    """Under a key split warpgroup 1 hands its (out, lse2) to warpgroup 0, which merges them, so the
    kernel's raw output has one partial per key split (num_splits), not one per warpgroup (a wrong
    merge is covered by the dense comparisons); here the count, through the traced output shape."""
    import jax
    sd = jax.ShapeDtypeStruct
    fn = lambda qr, k, v, t, ln: prefix_decode_mgpu_row_layout(  # noqa: E731
        qr, k, v, t, ln, query_rows=16, group=4, page_size=64, scale=0.1, num_splits=3, key_split=True,
        interpret=True)
    pool = sd((64 * 64, 2, 64), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(fn)(sd((2, 2, 64, 64), jnp.bfloat16), pool, pool, sd((2, 8), jnp.int32),
                                   sd((2,), jnp.int32)))
    assert "f32[3,2,2,64,64]" in jaxpr and "f32[6,2,2,64,64]" not in jaxpr


def test_default_pages_per_step_makes_128_key_steps_that_fit():
    assert default_pages_per_step(256, 128, 2, 64, 2) == 2  # bf16, 64-token pages: two per step
    assert default_pages_per_step(256, 128, 1, 64, 3) == 2  # FP8 rings are half the size
    assert default_pages_per_step(256, 128, 2, 128, 2) == 1  # a 128-token page is a step already
    assert default_pages_per_step(256, 128, 2, 64, 3) == 1  # three bf16 stages of two pages do not fit


@pytest.mark.parametrize("total,splits,pingpong,page,stages,pool_dtype,pps,key_split", cases([
    (256, 1, True, 64, 2, jnp.bfloat16, 1, None), (64, 3, False, 64, 3, jnp.bfloat16, 1, False),
    (256, 1, True, 128, 2, jnp.bfloat16, 1, None), (256, 1, True, 64, 3, FP8, 1, None),
    (64, 2, True, 128, 2, FP8, 1, None), (256, 1, True, 64, 2, jnp.bfloat16, 2, None),
    (64, 3, True, 64, 2, jnp.bfloat16, 2, None), (256, 2, True, 64, 3, FP8, 2, None),
    (64, 2, True, 64, 2, jnp.bfloat16, 2, False), (256, 1, True, 64, 4, FP8, 1, True),
    (64, 2, True, 64, 2, FP8, 2, False)], default=(0, 1, 7, 9)))
def test_mgpu_prefix_lowers_to_mosaic_gpu(total, splits, pingpong, page, stages, pool_dtype, pps, key_split,
                                          opts=None):
    """The compiled path (wgmma PV through run_state, not the interpreter's dot) lowers to a Mosaic GPU
    module on the CPU; compiling that module to a cubin needs the GPU machine."""
    import jax

    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    b, hkv, d = 2, 8, 128
    fn = lambda qr, k, v, t, ln: prefix_decode_mgpu_row_layout(  # noqa: E731
        qr, k, v, t, ln, query_rows=total // 4, group=4, page_size=page, scale=0.1, num_splits=splits,
        pingpong=pingpong, stages=stages, pages_per_step=pps, key_split=key_split, **(opts or {}))
    pool = sd((64 * page, hkv, d), pool_dtype)
    text = jax.jit(fn).trace(sd((b, hkv, total, d), jnp.bfloat16), pool, pool, sd((b, 32), jnp.int32),
                             sd((b,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def setmaxnreg_budgets(text: str) -> tuple[set[int], set[int]]:
    """The (increased, decreased) `setmaxnreg` budgets in a lowered Mosaic GPU module's text."""
    import re

    budgets = lambda way: {int(v) for v in re.findall(rf"setmaxnreg\.{way}\.sync\.aligned\.u32 (\d+)", text)}  # noqa: E731
    return budgets("inc"), budgets("dec")


def lowered_register_budgets(pool_dtype, **opts) -> tuple[set[int], set[int]]:
    """The (compute, memory) `setmaxnreg` budgets in the lowered kernel of 256-row heads."""
    import jax

    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    fn = lambda qr, k, v, t, ln: prefix_decode_mgpu_row_layout(  # noqa: E731
        qr, k, v, t, ln, query_rows=64, group=4, page_size=PAGE, scale=0.1, num_splits=1, **opts)
    pool = sd((64 * PAGE, 8, 128), pool_dtype)
    text = jax.jit(fn).trace(sd((2, 8, 256, 128), jnp.bfloat16), pool, pool, sd((2, 32), jnp.int32),
                             sd((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    return setmaxnreg_budgets(text)


def test_register_budgets_default_by_widening():
    """registers=None: (224, 56) where the memory warpgroup widens FP8 V, (232, 40) elsewhere; an
    explicit pair wins."""
    assert lowered_register_budgets(FP8) == ({224}, {56})
    assert lowered_register_budgets(FP8, memory_widens_values=False) == ({232}, {40})
    assert lowered_register_budgets(jnp.bfloat16) == ({232}, {40})
    assert lowered_register_budgets(FP8, registers=(216, 72)) == ({216}, {72})


@sweep
def test_mgpu_prefix_with_the_earlier_grid_order_lowers():
    test_mgpu_prefix_lowers_to_mosaic_gpu(256, 2, True, 64, 2, jnp.bfloat16, 2, None, opts=dict(tiles_adjacent=False))


@sweep
def test_grid_order_changes_no_result(interpret):
    """Grid axes of four different sizes (1 request, 3 KV heads, 4 key splits, 2 row tiles): the
    earlier grid order gives the same bits, so no axis is read under another's name."""
    r, g, hkv, d = 64, 4, 3, 64
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(5), [330], r, hkv, g, d, PAGE,
                                          jnp.bfloat16, q_dtype=jnp.bfloat16)
    qr = heads_to_rows(q, hkv, padded_rows(r * g))
    kw = dict(query_rows=r, group=g, page_size=PAGE, scale=d ** -0.5, num_splits=4, interpret=interpret)
    new = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, **kw)
    old = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, tiles_adjacent=False, **kw)
    for a, b in zip(new, old):
        assert np.all(np.isfinite(np.asarray(a)) | np.isneginf(np.asarray(a)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# FlashAttention-3-style overlap of each warpgroup's softmax with its own matmuls: 256-row heads
# (two tiles) with splits (one may hold no step), 64-row heads (one warpgroup), P = 0, two pages
# per step, masked steps; prefix and whole cascade against dense fp32. The interpreter runs the
# same barrier order with P V as a plain dot.
@sweep  # overlap_softmax is an option, off by default
@pytest.mark.parametrize("r,g,lengths,splits,pps", [
    (64, 4, [260, 330, 0], 3, 2), (32, 4, [0, 70, 200], 1, 1), (16, 4, [50, 300], 2, 1)])
def test_overlapped_softmax_matches_dense(r, g, lengths, splits, pps, interpret):
    check_prefix_and_cascade(r, g, lengths, splits, True, jnp.bfloat16, pps, 2, None, interpret=interpret,
                             opts=dict(overlap_softmax=True))


def test_overlapped_softmax_refuses_fp8_and_key_splits():
    bf = jnp.bfloat16
    pool = jnp.zeros((64 * 8, 1, 64), bf)
    args = (jnp.zeros((1, 1, 64, 64), bf), pool, pool, jnp.zeros((1, 8), jnp.int32), jnp.zeros((1,), jnp.int32))
    kw = dict(query_rows=16, group=4, page_size=PAGE, scale=0.1, overlap_softmax=True, interpret=True)
    with pytest.raises(ValueError, match="overlap_softmax takes 16-bit pools.*float8_e4m3fn"):
        prefix_decode_mgpu_row_layout(*args[:1], pool.astype(FP8), pool.astype(FP8), *args[3:], **kw)
    with pytest.raises(ValueError, match="overlap_softmax takes 16-bit pools.*key_split=True"):
        prefix_decode_mgpu_row_layout(*args, key_split=True, **kw)
    with pytest.raises(ValueError, match="overlap_softmax.*fence_softmax=True"):
        prefix_decode_mgpu_row_layout(*args, fence_softmax=True, **kw)


@pytest.mark.parametrize("total,pps", cases([(256, 2), (64, 1)]))
def test_overlapped_softmax_lowers(total, pps):
    test_mgpu_prefix_lowers_to_mosaic_gpu(total, 2, True, 64, 2, jnp.bfloat16, pps, None,
                                          opts=dict(overlap_softmax=True))


@pytest.mark.parametrize("case", cases([CASES[0], CASES[1], CASES[5], CASES[7]], one_arg=True))
def test_bf16_partial_matches_dense(case, interpret):
    """partial_dtype=bfloat16: the prefix and the cascade through it still match dense attention
    (one CTA, three key splits, the FP8 warpgroup key split, two pages per step)."""
    check_prefix_and_cascade(*case, 2, None, interpret=interpret, opts=dict(partial_dtype=jnp.bfloat16))


def test_bf16_partial_leaves_in_several_pieces_at_head_dim_128(interpret):
    """At D = 128 the bf16 partial leaves through the staging tile in two 64-column pieces."""
    check_prefix_and_cascade(16, 4, [50, 300], 1, True, jnp.bfloat16, 2, 2, None, interpret=interpret,
                             opts=dict(partial_dtype=jnp.bfloat16), d=128)


@sweep
def test_bf16_partial_is_written_in_bf16_and_rounds_only_the_output(interpret):
    """Without a key split the partial comes back in bf16, bit for bit the float32 partial rounded
    to bf16 (the same f32 arithmetic; only the cast before the store differs), with the same LSE;
    with splits the merge runs in float32 and returns float32."""
    r, g, hkv, d = 32, 4, 2, 64
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(3), [70, 200], r, hkv, g, d, PAGE, jnp.bfloat16)
    qr = heads_to_rows(q, hkv, padded_rows(r * g))
    kw = dict(query_rows=r, group=g, page_size=PAGE, scale=d ** -0.5, interpret=interpret)
    out32, lse32 = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, num_splits=1, **kw)
    out16, lse16 = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, num_splits=1, partial_dtype=jnp.bfloat16,
                                                 **kw)
    assert out32.dtype == jnp.float32 and out16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out16, np.float32), np.asarray(out32.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(lse16), np.asarray(lse32))
    merged, _ = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, num_splits=2, partial_dtype=jnp.bfloat16,
                                              **kw)
    assert merged.dtype == jnp.float32
    with pytest.raises(ValueError, match="partial_dtype must be float32 or bfloat16, got float16"):
        prefix_decode_mgpu_row_layout(qr, k, v, table, lens, partial_dtype=jnp.float16, **kw)


@pytest.mark.parametrize("form", [(256, 1, True, 64, 2, jnp.bfloat16, 2, None), (64, 2, True, 64, 2, FP8, 2, None)])
def test_bf16_partial_lowers(form):
    test_mgpu_prefix_lowers_to_mosaic_gpu(*form, opts=dict(partial_dtype=jnp.bfloat16))


# Persistent launches (one CTA per SM looping over work items), with the SM count cut to 3 so each
# CTA takes several items: 256-row heads in two tiles with three splits (36 items), an FP8 pool,
# and a warpgroup key split over four stages (FP8, two splits).
# The fourth case overlaps each warpgroup's softmax with its matmuls (`overlap_softmax`); the first
# three load each next item's query tile during the current item (`prefetch_query`, the default where
# it fits), the last two do not.
@pytest.mark.parametrize("case,opts", cases([(STAGED[1], {}), (STAGED[4], {}), (KEY_SPLIT[2], {}),
                                             (STAGED[6], dict(overlap_softmax=True)),
                                             (STAGED[1], dict(prefetch_query=False)),
                                             (KEY_SPLIT[2], dict(prefetch_query=False))], default=()))
def test_persistent_launch_matches_dense(case, opts, monkeypatch, interpret):
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    monkeypatch.setattr(pdm, "num_sms", lambda: 3)
    check_prefix_and_cascade(*case, interpret=interpret, opts=dict(persistent=True, **opts))


@sweep
def test_persistent_launch_gives_the_gridded_bits(monkeypatch, interpret):
    """The persistent launch computes each work item exactly as the gridded one: the same bits,
    for the plain prefix (two tiles, four splits, three KV heads: items of every axis) and for the
    fused window in head layout (5 items over 2 CTAs, one CTA taking 3), also with each next
    item's query tile and mask words loaded during the current item (`prefetch_query`)."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm
    from treespec_jax.tree.masks import ancestor_mask

    monkeypatch.setattr(pdm, "num_sms", lambda: 2)
    r, g, hkv, d = 64, 4, 3, 64
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(6), [330], r, hkv, g, d, PAGE,
                                          jnp.bfloat16, q_dtype=jnp.bfloat16)
    qr = heads_to_rows(q, hkv, padded_rows(r * g))
    kw = dict(query_rows=r, group=g, page_size=PAGE, scale=d ** -0.5, num_splits=4, interpret=interpret)
    launches = [dict(persistent=False), dict(persistent=True, prefetch_query=False), dict(persistent=True)]
    runs = [prefix_decode_mgpu_row_layout(qr, k, v, table, lens, **launch, **kw) for launch in launches]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert np.all(np.isfinite(np.asarray(a)) | np.isneginf(np.asarray(a)))
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    r, hkv = 16, 1
    lengths = [300, 5, 170, 64, 0]
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(7), lengths, r, hkv, g, d, PAGE,
                                          jnp.bfloat16, q_dtype=jnp.bfloat16)
    from trees import random_parents
    mask = ancestor_mask(jnp.asarray(random_parents(np.random.default_rng(8), len(lengths), r)))
    words, union = pdm.fused_window_words(mask, g, r * g, heads_io=True)
    kw = dict(query_rows=1, group=r * g, page_size=PAGE, scale=d ** -0.5, num_splits=1, interpret=interpret,
              window=r, heads_io=True, partial_dtype=jnp.bfloat16)
    runs = [prefix_decode_mgpu_row_layout(q, k, v, table, lens, words, union, **launch, **kw) for launch in launches]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert not np.isnan(np.asarray(a, np.float32)).any()
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(ValueError, match="prefetch_query needs the persistent launch"):
        prefix_decode_mgpu_row_layout(q, k, v, table, lens, words, union, persistent=False, prefetch_query=True,
                                      **kw)


def test_persistent_default_and_lowering():
    """None launches persistent CTAs over 16-bit pools where the items outnumber the SMs (results:
    persistent-prefix), never over FP8 ones whose compute warpgroups widen V; an explicit setting
    wins, and the config's switch turns the default off. The persistent loop lowers
    at D = 128 (bf16 fused in head layout, FP8 with a key split)."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    sms = pdm.num_sms()
    assert pdm.default_config().persistent_16bit
    assert pdm.runs_persistent(sms + 1, None, 2) and not pdm.runs_persistent(sms, None, 2)
    assert not pdm.runs_persistent(sms + 1, None, 2, False, pdm.PrefixMgpuConfig(persistent_16bit=False))
    assert not pdm.runs_persistent(10 * sms, None, 1)
    assert pdm.runs_persistent(1, True, 1) and not pdm.runs_persistent(10 * sms, False, 2)
    # The query prefetch: on under the persistent launch where its second tile fits.
    assert pdm.default_config().prefetch_query
    assert pdm.runs_prefetch_query(None, True, pdm.MAX_SMEM_BYTES)
    assert not pdm.runs_prefetch_query(None, True, 0, pdm.PrefixMgpuConfig(prefetch_query=False))
    assert not pdm.runs_prefetch_query(None, True, pdm.MAX_SMEM_BYTES + 1)
    assert not pdm.runs_prefetch_query(None, False, 0)
    assert pdm.runs_prefetch_query(True, False, 0) and not pdm.runs_prefetch_query(False, True, 0)
    test_mgpu_prefix_lowers_to_mosaic_gpu(256, 1, True, 64, 2, jnp.bfloat16, 2, None, opts=dict(persistent=True))
    test_mgpu_prefix_lowers_to_mosaic_gpu(256, 1, True, 64, 2, jnp.bfloat16, 2, None,
                                          opts=dict(persistent=True, prefetch_query=False))
    test_mgpu_prefix_lowers_to_mosaic_gpu(64, 2, True, 64, 4, FP8, 1, True, opts=dict(persistent=True))


def test_cascade_config_persistent_prefix(monkeypatch, backend):
    """CascadeConfig.persistent_prefix reaches the Mosaic prefix (the fused verify cascade gives the
    same bits either way, 2 SMs for 6 items) and True is refused, naming the value, where it could
    not apply."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm
    from treespec_jax.attention.cascade import CascadeConfig, verify_attention
    from treespec_jax.tree.masks import ancestor_mask
    from trees import random_parents

    monkeypatch.setattr(pdm, "num_sms", lambda: 2)
    seen = []
    real = pdm.runs_persistent
    monkeypatch.setattr(pdm, "runs_persistent", lambda *a: seen.append(a[1]) or real(*a))
    r, g, hkv, d = 16, 4, 2, 64
    lengths = [300, 70, 0]
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(11), lengths, r, hkv, g, d, PAGE,
                                          jnp.bfloat16, q_dtype=jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(np.random.default_rng(12), len(lengths), r)))
    outs = [verify_attention(q, k, v, table, lens, mask, config=CascadeConfig(
        page_size=PAGE, backend=backend, prefix_kernel="mosaic_gpu", persistent_prefix=p)) for p in (False, True)]
    assert seen == [False, True]
    assert not np.isnan(np.asarray(outs[1], np.float32)).any()
    np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(outs[1], np.float32))
    with pytest.raises(ValueError, match="persistent_prefix=True .* needs prefix_kernel='mosaic_gpu', got 'auto'"):
        CascadeConfig(page_size=PAGE, persistent_prefix=True)
    with pytest.raises(ValueError, match="persistent_prefix must be None, True or False, got 1"):
        CascadeConfig(page_size=PAGE, persistent_prefix=1)


# `memory_widens_values`: the memory warpgroup widens each FP8 V page once into a 16-bit ring:
# 128-row heads (both warpgroups read each widened page), a key split over four stages (each
# warpgroup owns half of the ring), three stages of two pages per step, and a persistent launch.
@sweep  # the default FP8 cases of the dense comparison above widen V in the memory warpgroup
@pytest.mark.parametrize("case,persistent", [((32, 4, [0, 70, 200], 1, True, FP8, 1, 2, None), False),
                                             ((16, 4, [200, 330, 10], 2, True, FP8, 1, 4, True), False),
                                             ((32, 4, [70, 200, 300], 2, True, FP8, 2, 3, None), False),
                                             ((64, 4, [260, 130], 3, True, FP8, 1, 2, None), True)])
def test_memory_widened_values_give_the_same_bits(case, persistent, monkeypatch, interpret):
    """The same P V operands as each compute warpgroup widening its own copy, so the same bits;
    and against dense fp32 (the shared test)."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    monkeypatch.setattr(pdm, "num_sms", lambda: 2)  # the persistent case: CTAs loop over items
    r, g, lengths, splits, pingpong, dtype, pps, stages, key_split = case
    hkv, d = 2, 64
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(r + g), lengths, r, hkv, g, d, PAGE, dtype,
                                          q_dtype=jnp.bfloat16)
    qr = heads_to_rows(q, hkv, padded_rows(r * g))
    kw = dict(query_rows=r, group=g, page_size=PAGE, scale=d ** -0.5, num_splits=splits, pingpong=pingpong,
              pages_per_step=pps, stages=stages, key_split=key_split, persistent=persistent,
              interpret=interpret)
    own = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, memory_widens_values=False, **kw)
    shared = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, memory_widens_values=True, **kw)
    for a, b in zip(own, shared):
        assert np.all(np.isfinite(np.asarray(a)) | np.isneginf(np.asarray(a)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    if not persistent:
        check_prefix_and_cascade(*case, interpret=interpret, opts=dict(memory_widens_values=True))


def test_memory_widened_values_refusals_and_lowering():
    """Refused, naming the value, for 16-bit pools; lowers at D = 128 with 128-row heads and with a
    key split."""
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(3), [130], 16, 1, 4, 64, PAGE, jnp.bfloat16,
                                             q_dtype=jnp.bfloat16)
    qr = heads_to_rows(q, 1, padded_rows(64))
    kw = dict(query_rows=16, group=4, page_size=PAGE, scale=0.125, interpret=True, memory_widens_values=True)
    with pytest.raises(ValueError, match="memory_widens_values takes an FP8 pool, got bfloat16 pools"):
        prefix_decode_mgpu_row_layout(qr, k, v, table, lens, **kw)
    test_mgpu_prefix_lowers_to_mosaic_gpu(256, 1, True, 64, 2, FP8, 2, None, opts=dict(memory_widens_values=True))
    test_mgpu_prefix_lowers_to_mosaic_gpu(64, 2, True, 64, 4, FP8, 1, True, opts=dict(memory_widens_values=True))


@sweep
def test_memory_widens_default(monkeypatch):
    """None widens FP8 V in the memory warpgroup over FP8 pools without a warpgroup key split where
    the ring fits (the fused window: under PrefixMgpuConfig.memory_widens_fused), never over 16-bit pools;
    an explicit setting wins. The kernel's default path takes it (and then, with the items
    outnumbering the SMs, the persistent launch)."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    assert pdm.default_config().memory_widens
    assert pdm.runs_memory_widens(None, 1, False, False, True)
    assert not pdm.runs_memory_widens(None, 1, True, False, True)  # the key split keeps its own copies
    assert not pdm.runs_memory_widens(None, 1, False, False, False)  # the ring does not fit
    assert not pdm.runs_memory_widens(None, 2, False, False, True)
    assert pdm.runs_memory_widens(None, 1, False, True, True) == pdm.default_config().memory_widens_fused
    assert pdm.runs_memory_widens(None, 1, False, True, True, pdm.PrefixMgpuConfig(memory_widens_fused=True))
    assert pdm.runs_memory_widens(True, 1, True, True, False) and not pdm.runs_memory_widens(False, 1, False, False, True)
    sms = pdm.num_sms()
    assert pdm.default_config().persistent_fp8_widened
    assert pdm.runs_persistent(sms + 1, None, 1, True) and not pdm.runs_persistent(sms + 1, None, 1, False)
    assert not pdm.runs_persistent(sms, None, 1, True)
    seen = []
    real = pdm.runs_persistent
    monkeypatch.setattr(pdm, "runs_persistent", lambda *a: seen.append(a[3]) or real(*a))
    # 128-row heads; 64-row heads (the key split); 64-row heads with the key split turned off.
    for r, key_split, fp8_widens in ((32, None, True), (16, None, False), (16, False, True)):
        q, k, v, table, lens, _ = verify_case(np.random.default_rng(r), [70, 200], r, 1, 4, 64, PAGE, FP8,
                                              q_dtype=jnp.bfloat16)
        qr = heads_to_rows(q, 1, padded_rows(r * 4))
        prefix_decode_mgpu_row_layout(qr, k, v, table, lens, query_rows=r, group=4, page_size=PAGE, scale=0.125,
                                      key_split=key_split, interpret=True)
        assert seen.pop() is fp8_widens


# Fused window steps over FP8 pools clean their rows of the widened V ring in place (NaN / inf in
# every slot no row sees): the same bits as each warpgroup's own widened copy, at one and two pages
# per step, a three-split key axis and a persistent launch.
@sweep  # off by default (PrefixMgpuConfig.memory_widens_fused)
@pytest.mark.parametrize("n,lengths,splits,pps,persistent", [(32, [0, 70, 200], 1, 1, False),
                                                             (16, [50, 300, 128], 3, 2, False),
                                                             (32, [130, 20], 2, 1, True)])
def test_memory_widened_values_under_the_fused_fp8_window(n, lengths, splits, pps, persistent, monkeypatch,
                                                          interpret):
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    monkeypatch.setattr(pdm, "num_sms", lambda: 2)
    g, hkv, d = 4, 2, 64
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(n + pps), lengths, n, hkv, g, d, PAGE, FP8,
                                             q_dtype=jnp.bfloat16)
    words, union = pdm.fused_window_words(mask, g, n * g, heads_io=True)
    kw = dict(query_rows=1, group=n * g, page_size=PAGE, scale=d ** -0.5, num_splits=splits, window=n,
              heads_io=True, pages_per_step=pps, persistent=persistent, interpret=interpret)
    own = prefix_decode_mgpu_row_layout(q, k, v, table, lens, words, union, memory_widens_values=False, **kw)
    shared = prefix_decode_mgpu_row_layout(q, k, v, table, lens, words, union, memory_widens_values=True, **kw)
    assert np.isfinite(np.asarray(shared[0], np.float32)).all()
    for a, b in zip(own, shared):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=n, page_size=PAGE, scale=d ** -0.5)
    assert rel_err(shared[0], dense) < 6e-2


def test_memory_widened_fused_fp8_window_lowers():
    """At D = 128 the fused FP8 window with the V ring and widened K beside it fits at one page per
    step (the default there) and lowers, gridded and persistent."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    assert pdm.default_pages_per_step(256, 128, 1, PAGE, 2, fused_fp8=True, memory_widens_values=True) == 1
    assert pdm.default_pages_per_step(256, 128, 1, PAGE, 2, fused_fp8=True) == 2
    from test_fused_window import test_fused_kernel_lowers_to_mosaic_gpu
    for persistent in (False, True):
        test_fused_kernel_lowers_to_mosaic_gpu(64, 4, 1, True, FP8, opts=dict(memory_widens_values=True,
                                                                             persistent=persistent))


@sweep
@pytest.mark.parametrize("memory_widens,fused", [(False, False), (True, False), (False, True)])
def test_widen_rows_give_the_same_bits(memory_widens, fused, interpret):
    """V widened in 64-row pieces or in one 128-row piece (two pages per step), by the compute
    warpgroups (fused: cleaning each piece's invisible rows) or by the memory warpgroup: the same
    bits."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    n, g, hkv, d = 32, 4, 2, 64
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(5), [70, 300], n, hkv, g, d, PAGE, FP8,
                                             q_dtype=jnp.bfloat16)
    if fused:
        words, union = pdm.fused_window_words(mask, g, n * g, heads_io=True)
        args = (q, k, v, table, lens, words, union)
        kw = dict(query_rows=1, group=n * g, window=n, heads_io=True)
    else:
        args = (heads_to_rows(q, hkv, padded_rows(n * g)), k, v, table, lens)
        kw = dict(query_rows=n, group=g)
    kw.update(page_size=PAGE, scale=d ** -0.5, pages_per_step=2, memory_widens_values=memory_widens,
              interpret=interpret)
    pieces = prefix_decode_mgpu_row_layout(*args, widen_rows=64, **kw)
    whole = prefix_decode_mgpu_row_layout(*args, widen_rows=128, **kw)
    assert np.isfinite(np.asarray(pieces[0], np.float32)).all()
    for a, b in zip(pieces, whole):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_widen_rows_and_registers_refusals_and_lowering():
    """Bad tuning values are refused together, naming them; other register budgets lower."""
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(6), [130], 32, 1, 4, 64, PAGE, FP8,
                                          q_dtype=jnp.bfloat16)
    qr = heads_to_rows(q, 1, padded_rows(128))
    with pytest.raises(ValueError) as err:
        prefix_decode_mgpu_row_layout(qr, k, v, table, lens, query_rows=32, group=4, page_size=PAGE, scale=0.1,
                                      pages_per_step=2, widen_rows=96, registers=(240, 40), interpret=True)
    assert "widen_rows must be a multiple of 64 dividing the step's 128 keys, got 96" in str(err.value)
    assert "registers (compute, memory) must be multiples of 8 in [24, 256] with 2 * compute + memory <= 504, " \
           "got (240, 40)" in str(err.value)
    test_mgpu_prefix_lowers_to_mosaic_gpu(256, 1, True, 64, 2, FP8, 2, None,
                                          opts=dict(registers=(224, 56), widen_rows=128))
