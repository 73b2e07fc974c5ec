"""GQA cascade (prefix decode + tree window + merge) against one dense fp32 attention: verify,
draft lanes, sliding-window lanes, FP8; and the dense reference against a per-row numpy loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import attention_triton_calls, fp32_tol, poisoned_paged_pools, verify_case
from tiers import cases, sweep
from trees import random_parents

from pallas_kernels.attention.reference import cascade_dense_reference, sliding_lane_dense_reference
from treespec_jax.attention import (CascadeConfig, cascade_attention, lane_attention, sliding_lane_attention,
                                    verify_attention)
from treespec_jax.attention.cascade import uses_mosaic_prefix
from treespec_jax.tree.masks import ancestor_mask, pack_mask_rows, unpack_mask_rows

FP8 = jnp.float8_e4m3fn


@pytest.mark.parametrize("n,group,page,dtype,tol,covers_tail", cases([
    (64, 4, 16, jnp.bfloat16, 1e-2, False),
    (16, 8, 64, FP8, 6e-2, False),  # the prefix half multiplies an FP8-quantised query
    (64, 4, 16, jnp.bfloat16, 1e-2, True),  # every row's prefix half runs to P
], default=(1,)))
def test_verify_matches_dense_attention(n, group, page, dtype, tol, covers_tail, backend):
    rng = np.random.default_rng(n + group)
    b, hkv, d = 3, 2, 16
    lengths = np.array([0, 70, n // 3], np.int32)  # P = 0, long, P < R
    k, v, table = poisoned_paged_pools(rng, b, 70 + n, hkv, d, page, dtype, lambda bb, pos: pos < lengths[bb] + n)
    q = jnp.asarray(rng.standard_normal((b, n, hkv * group, d)), jnp.float32).astype(jnp.bfloat16)
    mask = ancestor_mask(random_parents(rng, b, n))
    lengths = jnp.asarray(lengths)
    out = verify_attention(q, k, v, table, lengths, mask, config=CascadeConfig(
        page_size=page, backend=backend, prefix_covers_tail=covers_tail))
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    assert out.dtype == q.dtype
    assert rel_err(out, dense) < tol
    composed = verify_attention(q, k, v, table, lengths, mask, config=CascadeConfig(page_size=page, backend="reference"))
    assert rel_err(out, composed) < 1e-2


@pytest.mark.parametrize("dtype,tol,splits,covers_tail,lengths", cases([
    (jnp.bfloat16, 1e-2, None, False, [100, 7]), (FP8, 6e-2, None, False, [100, 7]),
    (jnp.bfloat16, 1e-2, 2, False, [100, 7]), (FP8, 6e-2, 2, True, [128, 74]),
    # P mod page < R - 1 (and a page-aligned P): the flag moves the last whole page's causal tail
    # from the window kernel to the prefix kernel, so a miswired half double-counts or drops it.
    (jnp.bfloat16, 1e-2, 2, True, [128, 74]), (jnp.bfloat16, 1e-2, 2, False, [128, 74])], default=(3, 5)))
def test_verify_through_the_mosaic_gpu_prefix_kernel(dtype, tol, splits, covers_tail, lengths, backend):
    """CascadeConfig(prefix_kernel="mosaic_gpu", fuse_window=False) (Pallas' GPU interpreter here):
    the prefix half over whole pages plus the window over the partial page equals dense attention,
    with the kernel's own key split or a forced one (num_splits reaches the Mosaic kernel), and with
    every row's prefix half run to the whole-page bound (`prefix_covers_tail`). The fused window
    has its own tests (test_fused_window.py)."""
    d, n, page = 64, 32, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(5), lengths, n, 2, 4, d, page,
                                                dtype, q_dtype=jnp.bfloat16)
    cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel="mosaic_gpu", num_splits=splits,
                        prefix_covers_tail=covers_tail, fuse_window=False)
    out = verify_attention(q, k, v, table, lengths, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    assert rel_err(out, dense) < tol


@sweep
def test_forced_key_split_reaches_the_mosaic_prefix(monkeypatch, backend):
    """CascadeConfig.num_splits is passed to the Mosaic prefix kernel, not dropped."""
    from treespec_jax.attention import cascade as cascade_module
    seen = []
    real = cascade_module.prefix_decode_mgpu_row_layout

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_splits"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "prefix_decode_mgpu_row_layout", spy)
    d, n, page = 64, 16, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(11), [150, 70], n, 2, 4, d, page, jnp.bfloat16)
    cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel="mosaic_gpu", num_splits=3)
    out = verify_attention(q, k, v, table, lengths, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    assert seen == [3]
    assert rel_err(out, dense) < 1e-2


@sweep  # the default's resolution; both settings run against dense attention in the default tier
def test_prefix_covers_tail_defaults_to_the_prefix_kernel(monkeypatch, backend):
    """prefix_covers_tail=None (the default) is on under the Mosaic prefix (timed faster there) and
    off under the Triton one; an explicit value wins, and a non-bool is refused by name."""
    from treespec_jax.attention import cascade as cascade_module
    seen = []
    real = cascade_module._cascade_rows

    def spy(*args, **kwargs):
        seen.append((kwargs["mosaic"], kwargs["prefix_covers_tail"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "_cascade_rows", spy)
    d, n, page = 64, 16, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(12), [128, 66], n, 2, 4, d, page, jnp.bfloat16)
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    for kernel, covers in [("triton", None), ("mosaic_gpu", None), ("mosaic_gpu", False), ("triton", True)]:
        cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel=kernel, prefix_covers_tail=covers)
        assert rel_err(verify_attention(q, k, v, table, lengths, mask, config=cfg), dense) < 1e-2
    assert seen == [(False, False), (True, True), (True, False), (False, True)]
    with pytest.raises(ValueError, match="prefix_covers_tail must be None, True or False, got 'yes'"):
        CascadeConfig(page_size=page, prefix_covers_tail="yes")


@pytest.mark.parametrize("kernel,splits", cases([("triton", None), ("triton", 1), ("mosaic_gpu", 1), ("mosaic_gpu", 2)]))
def test_bf16_prefix_partial_matches_dense(kernel, splits, backend):
    """CascadeConfig(prefix_partial_dtype="bfloat16") through either prefix kernel (one CTA per
    key range, or key splits merged in float32) still equals dense attention, the window kernel
    is handed the bf16 partial itself when there is no split, and a float32 query is refused."""
    from treespec_jax.attention import cascade as cascade_module
    d, n, page = 64, 16, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(13), [128, 70], n, 2, 4, d, page, jnp.bfloat16)
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    seen = []
    real = cascade_module.tree_window_row_layout

    def spy(*args, **kwargs):
        seen.append(args[6].dtype)  # the prefix partial
        return real(*args, **kwargs)

    cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel=kernel, num_splits=splits,
                        prefix_partial_dtype="bfloat16")
    import unittest.mock
    with unittest.mock.patch.object(cascade_module, "tree_window_row_layout", spy):
        jax.clear_caches()  # trace _cascade_rows again, so the spy sees the call
        out = verify_attention(q, k, v, table, lengths, mask, config=cfg)
    assert rel_err(out, dense) < 1e-2
    if splits == 1:
        assert seen == [jnp.bfloat16]
    with pytest.raises(ValueError, match="prefix_partial_dtype must be 'float32' or 'bfloat16', got 'float16'"):
        CascadeConfig(page_size=page, prefix_partial_dtype="float16")
    with pytest.raises(ValueError, match="needs a bfloat16 query .* got q float32"):
        verify_attention(q.astype(jnp.float32), k, v, table, lengths, mask, config=cfg)


def test_prefix_kernel_refusals_name_the_value():
    d, n, page = 64, 32, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(5), [100, 7], n, 2, 4, d, page, jnp.bfloat16)
    with pytest.raises(ValueError, match="prefix_kernel must be one of"):
        CascadeConfig(page_size=page, prefix_kernel="cuda")
    with pytest.raises(ValueError, match="page_size must be 64 or 128"):
        verify_attention(q, k, v, table, lengths, mask,
                         config=CascadeConfig(page_size=32, backend="interpret", prefix_kernel="mosaic_gpu"))


def test_auto_prefix_kernel_takes_mosaic_only_where_it_runs_compiled():
    """"auto" (the default) picks the Mosaic GPU prefix only for a compiled GPU run with bf16/fp16 or
    FP8 pools, page 64/128 and rows it tiles (a forced key split goes to it too); everything else falls back
    to Triton, and
    an explicit "mosaic_gpu" raises every blocker at once."""
    sds = jax.ShapeDtypeStruct
    bf, f8 = jnp.bfloat16, jnp.float8_e4m3fn
    q = sds((2, 16, 32, 128), bf)  # R=16, G=4: 64 rows per KV head
    pool = sds((4096, 8, 128), bf)
    auto = CascadeConfig(page_size=64)
    assert auto.prefix_kernel == "auto"
    assert uses_mosaic_prefix(auto, "compiled", q, pool, pool)
    assert not uses_mosaic_prefix(auto, "interpret", q, pool, pool)  # CPU: the Triton kernel, interpreted
    assert not uses_mosaic_prefix(auto, "reference", q, pool, pool)
    assert not uses_mosaic_prefix(CascadeConfig(page_size=32), "compiled", q, pool, pool)
    assert uses_mosaic_prefix(CascadeConfig(page_size=64, num_splits=4), "compiled", q, pool, pool)
    assert not uses_mosaic_prefix(CascadeConfig(page_size=64, prefix_kernel="triton"), "compiled", q, pool, pool)
    fp8_pool = sds(pool.shape, f8)
    assert uses_mosaic_prefix(auto, "compiled", q, fp8_pool, fp8_pool)  # FP8 pools: FP8 scores, V widened
    f32_pool = sds(pool.shape, jnp.float32)
    assert not uses_mosaic_prefix(auto, "compiled", q, f32_pool, f32_pool)
    assert not uses_mosaic_prefix(auto, "compiled", sds((2, 16, 32, 96), bf), sds((4096, 8, 96), bf),
                                  sds((4096, 8, 96), bf))
    # Fewer than 64 rows per KV head (R=4, G=2) are padded to one 64-row tile.
    assert uses_mosaic_prefix(auto, "compiled", sds((2, 4, 16, 128), bf), pool, pool)
    forced = CascadeConfig(page_size=32, prefix_kernel="mosaic_gpu")
    assert uses_mosaic_prefix(CascadeConfig(page_size=64, prefix_kernel="mosaic_gpu"), "interpret", q, pool, pool)
    with pytest.raises(ValueError, match=r"page_size must be 64 or 128.*got float32, float32"):
        uses_mosaic_prefix(forced, "compiled", q, f32_pool, f32_pool)


def test_default_cascade_on_cpu_runs_the_triton_prefix():
    """The default config interprets the Triton prefix on the CPU: its result equals the explicit
    "triton" run bit for bit (so CPU tests of the default cover that kernel)."""
    d, n, page = 64, 16, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(8), [130, 5], n, 2, 4, d, page,
                                                jnp.bfloat16)
    auto = verify_attention(q, k, v, table, lengths, mask, config=CascadeConfig(page_size=page, backend="interpret"))
    triton = verify_attention(q, k, v, table, lengths, mask,
                              config=CascadeConfig(page_size=page, backend="interpret", prefix_kernel="triton"))
    assert bool(jnp.all(jnp.isfinite(auto.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(auto, np.float32), np.asarray(triton, np.float32))


def lane_masks(rng, batch, k, step):
    """Lane masks after draft step `step` (SEMANTICS): seed lane r has bit r; the lane chosen as lane r
    at step s has its parent lane's bits | bit s*K + r."""
    masks = np.zeros((batch, k, 64), bool)
    for r in range(k):
        masks[:, r, r] = True
    for s in range(1, step + 1):
        parents = rng.integers(0, k, size=(batch, k))
        new = np.take_along_axis(masks, parents[:, :, None], axis=1).copy()
        for r in range(k):
            new[:, r, s * k + r] = True
        masks = new
    return masks


@pytest.mark.parametrize("step,covers_tail", [(1, False), (3, False), (3, True)])
def test_lanes_match_dense_attention(step, covers_tail, backend):
    """K = 4 lanes, S = 5 draft steps: window (S-1)K = 16 at the frontier. Lane slots not yet written
    at this step are poisoned."""
    rng = np.random.default_rng(step)
    b, kk, steps, hkv, g, d, page = 2, 4, 5, 2, 1, 16, 16
    w = (steps - 1) * kk
    written = (step + 1) * kk
    frontier = np.array([2, 37], np.int32)
    k, v, table = poisoned_paged_pools(rng, b, 37 + w, hkv, d, page, jnp.float32,
                        lambda bb, pos: pos < frontier[bb] + written)
    q = jnp.asarray(rng.standard_normal((b, kk, hkv * g, d)), jnp.float32)
    bits = lane_masks(rng, b, kk, step)[:, :, :w]
    mask = pack_mask_rows(jnp.asarray(bits))
    frontier = jnp.asarray(frontier)
    out = lane_attention(q, k, v, table, frontier, mask, steps=steps,
                         config=CascadeConfig(page_size=page, backend=backend, prefix_covers_tail=covers_tail))
    dense, _ = cascade_dense_reference(q, k, v, table, frontier, mask, window=w, page_size=page, scale=d ** -0.5)
    assert rel_err(out, dense) < fp32_tol(backend, 1e-5)


@sweep  # lanes through the fused Mosaic kernel stay in the default tier (test_fused_window)
@pytest.mark.parametrize("covers_tail,frontiers", [(False, [70, 200]), (True, [64, 129])])
def test_lanes_through_the_mosaic_gpu_prefix_kernel(covers_tail, frontiers, backend):
    """Draft lanes whose rows fill a 64-row tile (K = 4 lanes x 16 query heads per KV head) through
    the Mosaic GPU prefix (interpreter): the causal prefix over whole pages plus the window kernel
    over the partial page and the lane window equal dense attention, frontiers mid-page included;
    with `prefix_covers_tail` at frontiers where it moves keys (P mod page < K - 1)."""
    rng = np.random.default_rng(21)
    b, kk, steps, hkv, g, d, page = 2, 4, 3, 1, 16, 64, 64
    w = (steps - 1) * kk
    frontier = np.array(frontiers, np.int32)
    k, v, table = poisoned_paged_pools(rng, b, int(frontier.max()) + w, hkv, d, page, jnp.bfloat16,
                                       lambda bb, pos: pos < frontier[bb] + w)
    q = jnp.asarray(rng.standard_normal((b, kk, hkv * g, d)), jnp.bfloat16)
    mask = pack_mask_rows(jnp.asarray(lane_masks(rng, b, kk, steps - 1)[:, :, :w]))
    out = lane_attention(q, k, v, table, jnp.asarray(frontier), mask, steps=steps,
                         config=CascadeConfig(page_size=page, backend=backend, prefix_kernel="mosaic_gpu",
                                              prefix_covers_tail=covers_tail, fuse_window=False))
    dense, _ = cascade_dense_reference(q, k, v, table, jnp.asarray(frontier), mask, window=w, page_size=page,
                                       scale=d ** -0.5)
    assert rel_err(out, dense) < 1e-2


def test_sliding_window_lanes_with_row_page_tables(backend):
    """Each lane row decodes its own table's prefix (last `sliding_window` keys only) and then the tree
    window alone (causal_prefix=False)."""
    rng = np.random.default_rng(9)
    b, kk, hkv, g, d, page, w, sw = 2, 3, 1, 2, 16, 16, 6, 20
    frontier = np.array([10, 50], np.int32)
    row_lengths = np.array([[10, 7, 1], [50, 33, 0]], np.int32)
    k, v, table = poisoned_paged_pools(rng, b, 64, hkv, d, page, jnp.float32, lambda bb, pos: pos < frontier[bb] + w)
    # Row tables: request b's own pages, rotated per row so the rows really read different slots.
    tnp = np.asarray(table)
    row_tables = np.stack([np.stack([np.roll(tnp[bb], -r) for r in range(kk)]) for bb in range(b)])
    # Row r's position x is request position x + r * page; keep every row's keys on live slots.
    for bb in range(b):
        for r in range(1, kk):
            row_lengths[bb, r] = min(row_lengths[bb, r], max(0, int(frontier[bb]) + w - r * page))
    q = jnp.asarray(rng.standard_normal((b, kk, hkv * g, d)), jnp.float32)
    bits = rng.random((b, kk, w)) < 0.5
    bits[:, :, 0] = True
    mask = pack_mask_rows(jnp.asarray(bits))
    args = (q, k, v, jnp.asarray(row_tables, jnp.int32), jnp.asarray(row_lengths), table, jnp.asarray(frontier), mask)
    out = sliding_lane_attention(*args, window=w, config=CascadeConfig(page_size=page, backend=backend),
                                 sliding_window=sw)
    dense, _ = sliding_lane_dense_reference(*args, window=w, page_size=page, scale=d ** -0.5, sliding_window=sw)
    assert rel_err(out, dense) < fp32_tol(backend, 1e-5)
    ref = sliding_lane_attention(*args, window=w, config=CascadeConfig(page_size=page, backend="reference"),
                                 sliding_window=sw)
    assert rel_err(ref, dense) < 1e-5
    with pytest.raises(ValueError, match="prefix_kernel='mosaic_gpu' has no sliding-window"):
        sliding_lane_attention(*args, window=w, sliding_window=sw,
                               config=CascadeConfig(page_size=64, backend=backend, prefix_kernel="mosaic_gpu"))


def test_dense_reference_matches_numpy_loop_and_reference_composition():
    rng = np.random.default_rng(4)
    b, n, hkv, g, d, page = 2, 5, 2, 2, 16, 16
    lengths = np.array([3, 21], np.int32)
    k, v, table = poisoned_paged_pools(rng, b, 21 + n, hkv, d, page, jnp.float32, lambda bb, pos: pos < lengths[bb] + n)
    q = jnp.asarray(rng.standard_normal((b, n, hkv * g, d)), jnp.float32)
    mask = ancestor_mask(random_parents(rng, b, n))
    dense, _ = cascade_dense_reference(q, k, v, table, jnp.asarray(lengths), mask, window=n, page_size=page,
                                       scale=0.25)
    bits = np.asarray(unpack_mask_rows(mask, n))
    kk, vv, tnp = np.asarray(k, np.float64), np.asarray(v, np.float64), np.asarray(table)
    expect = np.zeros(dense.shape)
    for bb in range(b):
        for r in range(n):
            pos = list(range(lengths[bb])) + [lengths[bb] + j for j in range(n) if bits[bb, r, j]]
            slots = [tnp[bb, p // page] * page + p % page for p in pos]
            for h in range(hkv * g):
                s = 0.25 * kk[slots, h // g] @ np.asarray(q[bb, r, h], np.float64)
                wts = np.exp(s - s.max())
                expect[bb, r, h] = wts @ vv[slots, h // g] / wts.sum()
    np.testing.assert_allclose(np.asarray(dense), expect, rtol=1e-5, atol=1e-5)
    composed = cascade_attention(q, k, v, table, jnp.asarray(lengths), mask, window=n,
                                 config=CascadeConfig(page_size=page, scale=0.25, backend="reference"))
    assert rel_err(composed, expect) < 1e-5


def test_cascade_rejects_bad_configuration():
    with pytest.raises(ValueError, match="page_size"):
        CascadeConfig(page_size=48)
    with pytest.raises(ValueError, match="num_splits"):
        CascadeConfig(page_size=16, num_splits=0)
    with pytest.raises(ValueError, match="window_merges_splits must be True or False, got None.*"
                                         "unfused_heads_io must be True or False, got 1"):
        CascadeConfig(page_size=16, window_merges_splits=None, unfused_heads_io=1)
    q = jnp.zeros((1, 4, 2, 16))
    pool = jnp.zeros((64, 1, 16))
    table = jnp.zeros((1, 4), jnp.int32)
    lengths = jnp.zeros((1,), jnp.int32)
    mask = jnp.zeros((1, 4, 2), jnp.uint32)
    cfg = CascadeConfig(page_size=16)
    with pytest.raises(ValueError, match="steps must be >= 2"):
        lane_attention(q, pool, pool, table, lengths, mask, steps=1, config=cfg)
    with pytest.raises(ValueError, match="exceeds 64"):
        lane_attention(q, pool, pool, table, lengths, mask, steps=18, config=cfg)
    with pytest.raises(ValueError, match="mask"):
        cascade_attention(q, pool, pool, table, lengths, mask[:, :2], window=4, config=cfg)


def test_kernels_lower_to_triton_ir(monkeypatch):
    """The compiled path must lower to Triton IR (bf16 and FP8 pools, MLA layout). Lowering runs on
    the CPU once the GPU query is answered with an sm_90 device; compiling the IR to PTX needs the
    GPU (benchmarks/bench_cascade.py)."""
    import types

    import jax
    import jax._src.pallas.triton.pallas_call_registration as registration

    from pallas_kernels.attention.prefix_decode import prefix_decode_row_layout
    from pallas_kernels.attention.tree_window import tree_window_row_layout

    monkeypatch.setattr(registration, "gpu_info_lib", types.SimpleNamespace(
        get_gpu_info=lambda: types.SimpleNamespace(compute_capability=90)))
    sd = jax.ShapeDtypeStruct
    b, r, hkv, g, d, page, pages = 2, 16, 2, 4, 64, 32, 8
    rows = r * g
    for dtype in (jnp.bfloat16, FP8):
        pool = sd((b * pages * page, hkv, d), dtype)
        common = (pool, pool, sd((b, pages), jnp.int32), sd((b,), jnp.int32))
        # pages_per_step 1 and 2 (two pages per online-softmax step), with the launch knobs the
        # GPU benchmark sweeps (block_rows, num_warps, num_stages).
        for pps, br, nw, ns, pf in ((1, None, None, None, False), (2, 32, 8, 3, True), (1, None, None, None, True)):
            pre = lambda qr, *a: prefix_decode_row_layout(
                qr, *a, query_rows=r, group=g, page_size=page, scale=0.1, num_splits=2, interpret=False,
                poison_outputs=True, pages_per_step=pps, block_rows=br, num_warps=nw, num_stages=ns,
                prefetch_page_ids=pf)
            text = jax.jit(pre).trace(sd((b, hkv, rows, d), jnp.bfloat16), *common).lower(
                lowering_platforms=("cuda",)).as_text()
            assert "prefix_decode" in text
        # The window kernel with its default tiles and with smaller row tiles over 8 warps.
        for br, nw in ((None, None), (16, 8)):
            win = lambda qr, kp, vp, pt, ln, m, po, pl_: tree_window_row_layout(
                qr, kp, vp, pt, ln, m, po, pl_, query_rows=r, group=g, window=r, page_size=page, scale=0.1,
                value_dim=d, interpret=False, block_rows=br, num_warps=nw)
            jax.jit(win).trace(sd((b, hkv, rows, d), jnp.bfloat16), *common, sd((b, r, 2), jnp.uint32),
                               sd((b, hkv, rows, d), jnp.float32), sd((b, hkv, rows), jnp.float32)).lower(
                lowering_platforms=("cuda",))
        # Handed three key-split partials unmerged (CascadeConfig.window_merges_splits).
        jax.jit(win).trace(sd((b, hkv, rows, d), jnp.bfloat16), *common, sd((b, r, 2), jnp.uint32),
                           sd((3, b, hkv, rows, d), jnp.float32), sd((3, b, hkv, rows), jnp.float32)).lower(
            lowering_platforms=("cuda",))
    latent = sd((b * pages * page, 1, 80), jnp.bfloat16)
    mla = lambda qr, kp, pt, ln, m, po, pl_: tree_window_row_layout(
        qr, kp, None, pt, ln, m, po, pl_, query_rows=r, group=4, window=r, page_size=page, scale=0.1,
        rope_dim=16, value_dim=64, interpret=False)
    jax.jit(mla).trace(sd((b, 1, 64, 80), jnp.bfloat16), latent, sd((b, pages), jnp.int32), sd((b,), jnp.int32),
                       sd((b, r, 2), jnp.uint32), sd((b, 1, 64, 64), jnp.float32), sd((b, 1, 64), jnp.float32)).lower(
        lowering_platforms=("cuda",))


@pytest.mark.parametrize("pool_dtype,b,n,auto_triton_calls", cases([(jnp.bfloat16, 2, 64, 0), (FP8, 2, 16, 0),
                                                                  (FP8, 2, 64, 1), (FP8, 16, 64, 1)], default=(0, 2)))
def test_verify_lowers_with_the_auto_prefix_kernel_on_a_gpu(monkeypatch, pool_dtype, b, n, auto_triton_calls):
    """On a (pretend) sm_90 GPU the default cascade lowers to the Mosaic GPU kernel with the window
    fused in (bf16 pools, and FP8 ones with 64-row heads, N=16, whose 2 * 8 = 16 prefix programs
    leave SMs idle) or the Mosaic prefix plus the Triton window kernel (FP8 pools at N=64, whose
    unfused prefix widens V in its memory warpgroup; and at B=16: 256 programs, on 132 SMs);
    prefix_kernel="triton" lowers both halves to Triton."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)
    import jax._src.pallas.triton.pallas_call_registration as reg

    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    sds = jax.ShapeDtypeStruct
    hq, hkv, d, page, maxp = 32, 8, 128, 64, 16
    args = (sds((b, n, hq, d), jnp.bfloat16), sds((b * maxp * page, hkv, d), pool_dtype),
            sds((b * maxp * page, hkv, d), pool_dtype), sds((b, maxp), jnp.int32), sds((b,), jnp.int32),
            sds((b, n, 2), jnp.uint32))
    import treespec_jax.attention.cascade as cascade_module

    monkeypatch.setattr(cascade_module, "num_sms", lambda: 132)  # the H200's (fuses_window's wave rule)
    for kernel, triton_calls in (("auto", auto_triton_calls), ("triton", 2)):
        cfg = CascadeConfig(page_size=page, prefix_kernel=kernel)
        text = jax.jit(lambda *a: verify_attention(*a, config=cfg)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert attention_triton_calls(text) == triton_calls, kernel
        assert ("mosaic_gpu" in text) == (kernel == "auto"), kernel


@pytest.mark.parametrize("kernel,splits,dtype,tol", cases([("triton", 3, jnp.bfloat16, 1e-2), ("triton", 2, FP8, 6e-2),
                                                            ("mosaic_gpu", 2, jnp.bfloat16, 1e-2)], default=()))
def test_window_kernel_merges_the_key_splits(monkeypatch, kernel, splits, dtype, tol, backend):
    """CascadeConfig.window_merges_splits (the default): the prefix half hands its key-split partials on unmerged and
    the window kernel merges them (no merge kernel runs); the cascade still equals dense attention
    and the merged form's output."""
    from treespec_jax.attention import cascade as cascade_module
    d, n, page = 64, 16, 64
    q, k, v, table, lengths, mask = verify_case(np.random.default_rng(17), [128, 70], n, 2, 4, d, page, dtype,
                                                q_dtype=jnp.bfloat16)
    dense, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=n, page_size=page, scale=d ** -0.5)
    cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel=kernel, num_splits=splits,
                        fuse_window=False)
    merged_first = verify_attention(q, k, v, table, lengths, mask,  # the merge kernel first
                                    config=dataclasses.replace(cfg, window_merges_splits=False))
    seen = []
    real = cascade_module.tree_window_row_layout

    def spy(*args, **kwargs):
        seen.append(args[6].shape[0])  # the prefix partials' leading (split) axis
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "tree_window_row_layout", spy)
    out = verify_attention(q, k, v, table, lengths, mask, config=cfg)
    assert seen and seen[0] >= splits  # the Mosaic kernel's warpgroup key split may add partials
    assert rel_err(out, dense) < tol and rel_err(out, merged_first) < 1e-2


@pytest.mark.parametrize("dtype,splits,lengths", cases([(jnp.bfloat16, 3, [100, 7]), (FP8, 2, [128, 74]),
                                                        (FP8, None, [0, 190])], default=(2,)))
def test_unfused_mosaic_cascade_keeps_the_head_layout(monkeypatch, dtype, splits, lengths, backend):
    """CascadeConfig.unfused_heads_io (the default): the unfused Mosaic cascade hands q to the prefix kernel
    and the window kernel in head layout (`heads_io` / `heads_in`, no transposes) and still equals
    dense attention and, to the bit, the row-layout form it replaces (P = 0, mid-page and
    page-aligned P, key splits merged by the window kernel)."""
    from treespec_jax.attention import cascade as cascade_module
    d, n, page = 64, 16, 64
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(31), lengths, n, 2, 4, d, page, dtype,
                                             q_dtype=jnp.bfloat16)
    cfg = CascadeConfig(page_size=page, backend=backend, prefix_kernel="mosaic_gpu", num_splits=splits,
                        fuse_window=False)
    seen = []
    real = cascade_module.tree_window_row_layout

    def spy(*args, **kwargs):
        seen.append(kwargs.get("heads_in", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "tree_window_row_layout", spy)
    out = verify_attention(q, k, v, table, lens, mask, config=cfg)
    rows_form = verify_attention(q, k, v, table, lens, mask, config=dataclasses.replace(cfg, unfused_heads_io=False))
    assert seen == [True, False]
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=n, page_size=page, scale=d ** -0.5)
    assert rel_err(out, dense) < (6e-2 if dtype == FP8 else 1e-2)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(rows_form, np.float32))


def test_unfused_head_layout_needs_whole_head_io_tiles():
    """unfused_heads_io: on where both kernels can tile the head layout (R a multiple of 64 / G, the
    window's row tiles whole query rows) with every row's prefix to P and splits merged by the
    window kernel; off otherwise (the row layout, transposed by XLA, still runs there)."""
    from treespec_jax.attention.cascade import unfused_heads_io
    assert unfused_heads_io((64, 64, 32, 128), 8, True, True)  # B=64, N=64: the shape
    assert unfused_heads_io((1, 64, 32, 128), 8, True, True)   # B=1: 16-row window tiles
    assert not unfused_heads_io((2, 12, 8, 64), 2, True, True)  # R=12 is not a multiple of 64 / 4
    assert not unfused_heads_io((2, 16, 24, 64), 8, True, True)  # G = 3
    assert not unfused_heads_io((64, 64, 32, 128), 8, False, True)  # causal prefix: rows' bounds differ
    assert not unfused_heads_io((64, 64, 32, 128), 8, True, False)  # splits merged before the window kernel
