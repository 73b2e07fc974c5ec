"""Paged causal multi-query decode (prefix half): Pallas interpret mode vs the fp32 reference, and the
reference vs an independent per-row numpy loop."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import TF32_LSE_TOL, fp32_tol, poisoned_paged_pools

from pallas_kernels.attention.prefix_decode import default_num_splits, prefix_decode

FP8 = jnp.float8_e4m3fn


def make_pools(rng, batch, max_len, hkv, d, page, dtype, owned_len):
    """Poisoned pools where request b owns positions below owned_len[b]."""
    return poisoned_paged_pools(rng, batch, max_len, hkv, d, page, dtype,
                                lambda b, pos: pos < int(owned_len[b]), spare_pages=3)


def check_lse(lse, ref, tol):
    lse, ref = np.asarray(lse), np.asarray(ref)
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.max(np.abs(lse[fin] - ref[fin]), initial=0.0) <= tol


def numpy_prefix(q, k_pool, v_pool, table, lengths, page, scale, sliding_window=None):
    """Per (request, row, head) loop over explicit key lists, float64."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    kp = np.asarray(jnp.asarray(k_pool, jnp.float32), np.float64)
    vp = np.asarray(jnp.asarray(v_pool, jnp.float32), np.float64)
    table = np.asarray(table)
    b_, r_, hq, d = q.shape
    g = hq // kp.shape[1]
    out = np.zeros((b_, r_, hq, d))
    lse = np.full((b_, r_, hq), -np.inf)
    for b in range(b_):
        p = int(lengths[b])
        for r in range(r_):
            hi = max(0, p - r_ + 1 + r)
            lo = 0 if sliding_window is None else max(0, hi - sliding_window)
            slots = [table[b, pos // page] * page + pos % page for pos in range(lo, hi)]
            if not slots:
                continue
            for h in range(hq):
                s = scale * kp[slots, h // g] @ q[b, r, h]
                m = s.max()
                w = np.exp(s - m)
                out[b, r, h] = w @ vp[slots, h // g] / w.sum()
                lse[b, r, h] = (m + math.log(w.sum())) / math.log(2)
    return out, lse


@pytest.mark.parametrize("group,page,dtype,splits,rows", [
    (1, 16, jnp.float32, None, 5),
    (4, 32, jnp.bfloat16, 3, 5),
    (8, 64, FP8, 2, 3),
])
def test_prefix_decode_matches_reference(group, page, dtype, splits, rows, backend):
    rng = np.random.default_rng(group * 100 + page)
    hkv, d = 2, 16
    hq = group * hkv
    lengths = np.array([0, rows - 2, 150, 77], np.int32)  # P = 0, P < R, ragged
    k, v, table = make_pools(rng, 4, 160, hkv, d, page, dtype, lengths)
    q = jnp.asarray(rng.standard_normal((4, rows, hq, d)), jnp.float32).astype(
        jnp.bfloat16 if dtype != jnp.float32 else jnp.float32)
    lengths = jnp.asarray(lengths)
    out, lse = prefix_decode(q, k, v, table, lengths, page_size=page, num_splits=splits,
                             poison_outputs=True, backend=backend)
    ref, rlse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    assert out.shape == (4, rows, hq, d) and lse.shape == (4, rows, hq)
    assert rel_err(out, ref) < (fp32_tol(backend, 1e-5) if dtype == jnp.float32 else 1e-2)
    check_lse(lse, rlse, fp32_tol(backend, 1e-3, TF32_LSE_TOL) if dtype == jnp.float32 else 2e-2)
    # P = 0 sees nothing at all; P < R leaves the first rows empty.
    assert np.all(np.isneginf(np.asarray(lse[0])))
    assert np.all(np.asarray(out[0]) == 0)
    empty_rows = rows - 1 - int(lengths[1])  # row r sees [0, P - R + 1 + r)
    assert np.all(np.isneginf(np.asarray(lse[1, : empty_rows + 1])))
    assert np.all(np.isfinite(np.asarray(lse[1, empty_rows + 1:])))


def test_prefix_reference_matches_numpy_loop_with_sliding_window(backend):
    rng = np.random.default_rng(7)
    page, hkv, g, d, rows = 16, 2, 2, 16, 4
    lengths = np.array([40, 2, 0], np.int32)
    k, v, table = make_pools(rng, 3, 48, hkv, d, page, jnp.float32, lengths)
    q = jnp.asarray(rng.standard_normal((3, rows, hkv * g, d)), jnp.float32)
    for sw in (None, 9):
        ref, rlse = prefix_decode(q, k, v, table, jnp.asarray(lengths), page_size=page, scale=0.3,
                                  sliding_window=sw, backend="reference")
        nout, nlse = numpy_prefix(q, k, v, table, lengths, page, 0.3, sw)
        np.testing.assert_allclose(np.asarray(ref), nout, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(rlse), nlse, rtol=1e-5, atol=1e-5)
    out, lse = prefix_decode(q, k, v, table, jnp.asarray(lengths), page_size=page, scale=0.3,
                             sliding_window=9, poison_outputs=True, backend=backend)
    assert rel_err(out, nout) < fp32_tol(backend, 1e-5)
    check_lse(lse, nlse, fp32_tol(backend, 1e-4, TF32_LSE_TOL))


def test_prefix_decode_rejects_bad_inputs():
    q = jnp.zeros((1, 2, 4, 16))
    pool = jnp.zeros((64, 2, 16))
    table = jnp.zeros((1, 4), jnp.int32)
    lengths = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="page_size"):
        prefix_decode(q, pool, pool, table, lengths, page_size=24)
    with pytest.raises(ValueError, match="Hq=4.*Hkv=3"):
        prefix_decode(q, jnp.zeros((64, 3, 16)), jnp.zeros((64, 3, 16)), table, lengths, page_size=16)
    with pytest.raises(ValueError, match="lengths"):
        prefix_decode(q, pool, pool, table, jnp.zeros((2,), jnp.int32), page_size=16)
    with pytest.raises(ValueError, match="num_splits"):
        prefix_decode(q, pool, pool, table, lengths, page_size=16, num_splits=0)
    with pytest.raises(ValueError, match="backend"):
        prefix_decode(q, pool, pool, table, lengths, page_size=16, backend="cuda")


def test_default_num_splits_fills_the_gpu_only_when_needed():
    # B=32, Hkv=8, two row tiles: 512 programs already fill 132 SMs twice -> no split.
    assert default_num_splits(32, 8, 2, 513, sms=132) == 1
    # B=1: 16 programs -> split toward four programs per SM (33 splits of 16 pages).
    assert default_num_splits(1, 8, 2, 513, sms=132) == 33
    # Short prefixes never split below four pages per split.
    assert default_num_splits(1, 8, 2, 8, sms=132) == 2
    assert default_num_splits(1, 1, 1, 3, sms=132) == 1


def test_prefix_decode_row_tiles_and_sliding_window(backend):
    """block_rows=16 cuts 20 query rows (R=5, G=4) into two tiles, the second mostly padding; the
    causal staircase then crosses tile and page edges differently per tile."""
    rng = np.random.default_rng(21)
    page, hkv, g, d, rows = 16, 2, 4, 16, 5
    lengths = np.array([67, 4], np.int32)
    k, v, table = make_pools(rng, 2, 80, hkv, d, page, jnp.float32, lengths)
    q = jnp.asarray(rng.standard_normal((2, rows, hkv * g, d)), jnp.float32)
    for sw in (None, 23):
        out, lse = prefix_decode(q, k, v, table, jnp.asarray(lengths), page_size=page, block_rows=16,
                                 sliding_window=sw, num_splits=2, poison_outputs=True, backend=backend)
        nout, nlse = numpy_prefix(q, k, v, table, lengths, page, d ** -0.5, sw)
        assert rel_err(out, nout) < fp32_tol(backend, 1e-5)
        check_lse(lse, nlse, fp32_tol(backend, 1e-4, TF32_LSE_TOL))


@pytest.mark.parametrize("pages_per_step,splits,sw,prefetch", [(2, 3, None, False), (4, None, 21, True),
                                                               (1, 3, None, True)])
def test_prefix_decode_pages_per_step(pages_per_step, splits, sw, prefetch, backend):
    """Several pages per online-softmax step: ragged lengths end mid-step (and mid-page), the
    max_pages = 7 table is not a multiple of the step so the last step runs past it, three splits
    round to whole steps (one split may be empty), and block_rows=16 makes two row tiles whose causal
    staircases cross step edges differently; `prefetch` reads page ids one step ahead. Checked
    against the per-row numpy loop."""
    rng = np.random.default_rng(40 + pages_per_step)
    page, hkv, g, d, rows = 16, 2, 4, 16, 5
    lengths = np.array([0, 3, 101, 44, 33], np.int32)  # P = 0, P < R, mid-page/step ends
    k, v, table = make_pools(rng, 5, 7 * page, hkv, d, page, jnp.float32, lengths)
    assert table.shape[1] == 7
    q = jnp.asarray(rng.standard_normal((5, rows, hkv * g, d)), jnp.float32)
    out, lse = prefix_decode(q, k, v, table, jnp.asarray(lengths), page_size=page, block_rows=16,
                             pages_per_step=pages_per_step, num_splits=splits, sliding_window=sw,
                             poison_outputs=True, prefetch_page_ids=prefetch, backend=backend)
    nout, nlse = numpy_prefix(q, k, v, table, lengths, page, d ** -0.5, sw)
    assert rel_err(out, nout) < fp32_tol(backend, 1e-5)
    check_lse(lse, nlse, fp32_tol(backend, 1e-4, TF32_LSE_TOL))


def test_prefix_decode_rejects_bad_pages_per_step():
    q = jnp.zeros((1, 2, 4, 16))
    pool = jnp.zeros((256, 2, 16))
    table = jnp.zeros((1, 4), jnp.int32)
    lengths = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="pages_per_step must be a power of two >= 1, got 3"):
        prefix_decode(q, pool, pool, table, lengths, page_size=16, pages_per_step=3)
    with pytest.raises(ValueError, match="pages_per_step must be a power of two >= 1, got 0"):
        prefix_decode(q, pool, pool, table, lengths, page_size=16, pages_per_step=0)
    with pytest.raises(ValueError, match="pages_per_step=8 x page_size=64 = 512 keys"):
        prefix_decode(q, pool, pool, table, lengths, page_size=64, pages_per_step=8)


def test_default_pages_per_step_respects_the_key_bound():
    from pallas_kernels.attention import prefix_decode as pd
    assert pd.default_pages_per_step(16, 4) == 4
    assert pd.default_pages_per_step(128, 4) == 2
    assert pd.default_pages_per_step(512, 4) == 1  # one large page is still one step


def test_default_launch_follows_the_split_decision():
    from pallas_kernels.attention.prefix_decode import SPLIT_LAUNCH, WIDE_GRID_LAUNCH, default_launch
    # B=32, Hkv=8, 256 rows: 512 programs of 128 rows fill 132 SMs unsplit.
    assert default_launch(32, 8, 256, 513, sms=132) == WIDE_GRID_LAUNCH
    # B=1: 16 programs, the key axis is split, and the split launch's smaller tiles apply.
    assert default_launch(1, 8, 256, 513, sms=132) == SPLIT_LAUNCH
    # A table too short to split keeps the wide launch.
    assert default_launch(1, 1, 16, 3, sms=132) == WIDE_GRID_LAUNCH
