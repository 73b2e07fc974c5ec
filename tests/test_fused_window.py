"""The tree window fused into the Mosaic GPU prefix kernel (`CascadeConfig.fuse_window`), in Pallas'
GPU interpreter against one dense fp32 attention; its row order, refusals and lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import poisoned_paged_pools, verify_case
from test_cascade_gqa import lane_masks
from tiers import cases, sweep

from pallas_kernels.attention.prefix_decode_mgpu import (cluster_split_errors, fused_window_words, head_io_rows,
                                                         heads_io_errors, merge_weights,
                                                         prefix_decode_mgpu_row_layout)
from pallas_kernels.attention.reference import cascade_dense_reference
from treespec_jax.attention import CascadeConfig, lane_attention, verify_attention
from treespec_jax.attention import cascade as cascade_module
from treespec_jax.tree.masks import pack_mask_rows

FP8 = jnp.float8_e4m3fn
PAGE = 64


def spy_on_kernels(monkeypatch):
    """Record the fused kernel's `heads_io` / `window`, its `kept_rows` where set, and any
    window-kernel call."""
    seen = {"prefix": [], "window_kernel": 0}
    real_prefix = cascade_module.prefix_decode_mgpu_row_layout
    real_window = cascade_module.tree_window_row_layout

    def prefix(*args, **kwargs):
        seen["prefix"].append((kwargs.get("window", 0), kwargs.get("heads_io", False)))
        if kwargs.get("kept_rows"):
            seen["kept_rows"] = kwargs["kept_rows"]
        return real_prefix(*args, **kwargs)

    def window(*args, **kwargs):
        seen["window_kernel"] += 1
        return real_window(*args, **kwargs)

    monkeypatch.setattr(cascade_module, "prefix_decode_mgpu_row_layout", prefix)
    monkeypatch.setattr(cascade_module, "tree_window_row_layout", window)
    return seen


@pytest.mark.parametrize("n,group,lengths,splits,heads_io", cases([
    (32, 4, [0, 70, 200], None, True),  # P = 0, mid-page P, two 64-row warpgroups per CTA
    (64, 4, [5, 129], 3, True),  # 64-node trees, three key splits (float32 partials merged)
    (8, 8, [63, 64], None, True),  # group 8: boxes of 8 query rows; P + W crosses a page
    (20, 4, [100, 3], None, False),  # R not a multiple of 64 / G: row layout, padded rows
    (4, 4, [70, 200], None, False),  # 16 real rows padded to one 64-row tile (draft-lane sizes)
    (1, 4, [70, 200], 2, False),  # a plain step: 4 real rows of 64, two key splits merged over those 4 alone
], default=(0, 5)))
def test_fused_window_matches_dense(monkeypatch, n, group, lengths, splits, heads_io, backend):
    """The default cascade under the Mosaic prefix on bf16 pools runs the fused kernel alone (no
    window kernel), in head layout where the group allows it, and equals dense attention; every slot
    past P + N and every spare page holds NaN / inf."""
    seen = spy_on_kernels(monkeypatch)
    d = 64
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(n * group), lengths, n, 2, group, d, PAGE,
                                             jnp.bfloat16)
    cfg = CascadeConfig(page_size=PAGE, backend=backend, prefix_kernel="mosaic_gpu", num_splits=splits)
    out = verify_attention(q, k, v, table, lens, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=n, page_size=PAGE, scale=d ** -0.5)
    assert out.dtype == jnp.bfloat16
    assert rel_err(out, dense) < 1e-2
    # A padded tile hands on only its real rows where they are a power of two (4 of 64 at N = 1).
    real = n * group
    assert seen.pop("kept_rows", 0) == (real if not heads_io and real < 64 and not real & (real - 1) else 0)
    assert seen == {"prefix": [(n, heads_io)], "window_kernel": 0}


@pytest.mark.parametrize("n,lengths,splits,tol", cases([
    (32, [0, 60], None, 5e-3),  # every key is in a window step: bf16-level error, the unquantised query
    (16, [50, 300, 128], 2, 6e-2),  # 64-row heads: the warpgroup key split; FP8 prefix scores
    (16, [50, 300], 1, 6e-2),  # the key split's merged partial is the bf16 output itself (no merge kernel)
], default=(2,)))
def test_fused_window_under_fp8_pools(monkeypatch, n, lengths, splits, tol, backend):
    """FP8 pools, fuse_window=True (opt-in): window steps widen K and score the unquantised query
    (at P < 128 every step is a window step, and an FP8 query would miss 5e-3 several times over:
    1.7e-2 was measured with it), other steps the FP8 query, as the window kernel's split does."""
    seen = spy_on_kernels(monkeypatch)
    d, group = 64, 4
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(n + 7), lengths, n, 2, group, d, PAGE, FP8,
                                             q_dtype=jnp.bfloat16)
    cfg = CascadeConfig(page_size=PAGE, backend=backend, prefix_kernel="mosaic_gpu", num_splits=splits,
                        fuse_window=True)
    out = verify_attention(q, k, v, table, lens, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=n, page_size=PAGE, scale=d ** -0.5)
    assert rel_err(out, dense) < tol
    assert seen == {"prefix": [(n, True)], "window_kernel": 0}


@sweep  # the default FP8 cases against dense fp32 run cast_query=None already
@pytest.mark.parametrize("n,lengths,splits", [
    (16, [50, 300], 2),  # 64-row heads: the warpgroup key split, two key splits
    (32, [0, 190], None),  # two 64-row warpgroups per CTA; P = 0 (window steps only)
])
def test_fused_fp8_kernel_casts_the_query_itself(n, lengths, splits, interpret):
    """Fused over an FP8 pool the kernel casts the window's unquantised query tile to FP8 for the
    prefix steps (`cast_query`, the default): the bits of the query XLA casts before the kernel
    (cast_query=False), both saturating at +-448 (entries here reach +-1600, which a plain cast
    turns into NaN)."""
    d, group = 64, 4
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(n + 3), lengths, n, 2, group, d, PAGE, FP8,
                                             q_dtype=jnp.bfloat16)
    q = q.at[..., :4].multiply(400.0)
    assert np.isnan(np.asarray(q.astype(FP8).astype(jnp.float32))).any()
    total = n * group
    words, union = fused_window_words(mask, group, total, heads_io=True)

    def run(cast_query):
        out, lse = prefix_decode_mgpu_row_layout(
            q, k, v, table, lens, words, union, query_rows=1, group=total, page_size=PAGE, scale=d ** -0.5,
            num_splits=splits, window=n, heads_io=True, cast_query=cast_query, interpret=interpret)
        return np.asarray(out, np.float32), np.asarray(lse)

    (out_in, lse_in), (out_xla, lse_xla) = run(None), run(False)
    assert np.isfinite(out_in).all() and np.isfinite(lse_in).all()
    np.testing.assert_array_equal(out_in, out_xla)
    np.testing.assert_array_equal(lse_in, lse_xla)


def test_cast_query_refuses_all_but_fp8_pools_with_16_bit_queries():
    b, hkv, total, d = 1, 2, 64, 64
    table, lens = jnp.zeros((b, 4), jnp.int32), jnp.zeros((b,), jnp.int32)
    words = (jnp.zeros((b, 2, total), jnp.int32), jnp.zeros((b, 2), jnp.int32))
    for pool_dtype, q_dtype, window in ((jnp.bfloat16, jnp.bfloat16, 8), (jnp.bfloat16, jnp.bfloat16, 0),
                                        (FP8, FP8, 0)):  # an FP8 query is cast already
        pool = jnp.zeros((4 * PAGE, hkv, d), pool_dtype)
        with pytest.raises(ValueError, match=f"cast_query=True takes an FP8 pool and a 16-bit query, got "
                                             f"{jnp.dtype(q_dtype).name} queries over {jnp.dtype(pool_dtype).name}"):
            prefix_decode_mgpu_row_layout(jnp.zeros((b, hkv, total, d), q_dtype), pool, pool, table, lens,
                                          *(words if window else ()), query_rows=1, group=total, page_size=PAGE,
                                          scale=0.1, window=window, cast_query=True, interpret=True)


@sweep
@pytest.mark.parametrize("r,lengths,splits,layout", [
    (16, [50, 300], 2, "rows"),  # 64-row heads: the warpgroup key split, two key splits merged
    # Head layout, two 64-row warpgroups per CTA (B=64's form), 5 items over 2 CTAs, prefetched; P = 0.
    (32, [300, 5, 170, 64, 0], 1, "heads_persistent"),
])
def test_unfused_fp8_kernel_casts_the_query_itself(monkeypatch, r, lengths, splits, layout, interpret):
    """Unfused over an FP8 pool the kernel stages the unquantised query tile and casts it
    (`cast_query`, the default there): the bits of the query XLA casts before it (cast_query=False),
    saturating at +-448 (entries here reach +-1600), in the row layout and in head layout under the
    persistent launch, where each next item's tile is fetched once this one's is cast."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm
    from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows

    monkeypatch.setattr(pdm, "num_sms", lambda: 2)
    d, group = 64, 4
    hkv = 2 if layout == "rows" else 1
    q, k, v, table, lens, _ = verify_case(np.random.default_rng(r + len(lengths)), lengths, r, hkv, group, d, PAGE,
                                          FP8, q_dtype=jnp.bfloat16)
    q = q.at[..., :4].multiply(400.0)
    assert np.isnan(np.asarray(q.astype(FP8).astype(jnp.float32))).any()
    if layout == "rows":
        qin, kw = heads_to_rows(q, hkv, padded_rows(r * group)), dict(query_rows=r, group=group)
    else:
        qin, kw = q, dict(query_rows=1, group=r * group, heads_io=True, merge=False, persistent=True,
                          prefetch_query=True)

    def run(cast_query):
        out, lse = prefix_decode_mgpu_row_layout(qin, k, v, table, lens, page_size=PAGE, scale=d ** -0.5,
                                                 num_splits=splits, cast_query=cast_query, interpret=interpret, **kw)
        return np.asarray(out, np.float32), np.asarray(lse)

    (out_in, lse_in), (out_xla, lse_xla) = run(None), run(False)
    assert (lse_in > -np.inf).any() and np.isfinite(out_in).all()  # rows that saw no key are written 0
    np.testing.assert_array_equal(out_in, out_xla)
    np.testing.assert_array_equal(lse_in, lse_xla)


@sweep
def test_unfused_mosaic_prefix_pads_small_row_counts(backend):
    """Under 64 rows per KV head (R=8, G=2) the two-kernel Mosaic cascade pads q to one 64-row tile
    and the window kernel reads the same padded rows; it equals dense attention."""
    d = 64
    q, k, v, table, lens, mask = verify_case(np.random.default_rng(17), [129, 5], 8, 2, 2, d, PAGE, jnp.bfloat16)
    cfg = CascadeConfig(page_size=PAGE, backend=backend, prefix_kernel="mosaic_gpu", fuse_window=False)
    out = verify_attention(q, k, v, table, lens, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=8, page_size=PAGE, scale=d ** -0.5)
    assert rel_err(out, dense) < 1e-2


def test_fused_lanes_zero_unwritten_lane_slots(monkeypatch, backend):
    """Draft lanes (K = 4, S = 5, at draft step 2: slots 12..15 of the 16-slot lane window not yet
    written and poisoned, as are written slots no lane sees): the fused kernel must zero those V
    rows before P V (a zero weight times NaN is NaN) and still equal dense attention. 16 heads per
    KV head give 64 rows in boxes of 4 query rows, so the row layout runs."""
    seen = spy_on_kernels(monkeypatch)
    rng = np.random.default_rng(31)
    b, kk, steps, step, hkv, g, d = 2, 4, 5, 2, 1, 16, 64
    w = (steps - 1) * kk
    frontier = np.array([70, 129], np.int32)
    bits = lane_masks(rng, b, kk, step)[:, :, :w]
    seen_slots = bits.any(axis=1)  # [B, W]
    k, v, table = poisoned_paged_pools(
        rng, b, int(frontier.max()) + w, hkv, d, PAGE, jnp.bfloat16,
        lambda bb, pos: pos < frontier[bb] or (pos < frontier[bb] + w and seen_slots[bb, pos - frontier[bb]]))
    assert not seen_slots.all()  # some window slot is poisoned, so the test can fail
    q = jnp.asarray(rng.standard_normal((b, kk, hkv * g, d)), jnp.bfloat16)
    mask = pack_mask_rows(jnp.asarray(bits))
    out = lane_attention(q, k, v, table, jnp.asarray(frontier), mask, steps=steps,
                         config=CascadeConfig(page_size=PAGE, backend=backend, prefix_kernel="mosaic_gpu"))
    dense, _ = cascade_dense_reference(q, k, v, table, jnp.asarray(frontier), mask, window=w, page_size=PAGE,
                                       scale=d ** -0.5)
    assert rel_err(out, dense) < 1e-2
    assert seen == {"prefix": [(w, False)], "window_kernel": 0}


def test_fused_window_rows_follow_head_io_rows():
    """Kernel row t = 64 w + g (64 / G) + i is query row w (64 / G) + i of head g; the mask words
    follow the same order, and the inverse restores the head layout."""
    group, r, hkv, b = 4, 32, 2, 2
    per = 64 // group
    x = np.arange(b * r * hkv * group).reshape(b, r, hkv * group)
    kernel = np.asarray(head_io_rows(jnp.asarray(x), group))
    for t in range(r * group):
        w, rest = divmod(t, 64)
        g, i = divmod(rest, per)
        np.testing.assert_array_equal(kernel[:, :, t], x[:, w * per + i, np.arange(hkv) * group + g])
    np.testing.assert_array_equal(np.asarray(head_io_rows(jnp.asarray(kernel), group, inverse=True)), x)
    masks = np.random.default_rng(0).integers(0, 2 ** 32, (b, r, 2), dtype=np.uint32)
    words, union = fused_window_words(jnp.asarray(masks), group, r * group, heads_io=True)
    words = np.asarray(words).view(np.uint32)
    for t in range(r * group):
        w, rest = divmod(t, 64)
        np.testing.assert_array_equal(words[:, :, t], masks[:, w * per + rest % per, :])
    np.testing.assert_array_equal(np.asarray(union).view(np.uint32), np.bitwise_or.reduce(masks, axis=1))


def test_fused_window_config_refusals():
    """fuse_window=True is refused where it cannot run, naming every blocker at once; None fuses only
    under the Mosaic prefix with the default tail and partial, on 16-bit pools and on FP8 ones
    whose prefix programs do not fill the SMs and whose unfused prefix would not widen V in the
    memory warpgroup."""
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    with pytest.raises(ValueError) as err:
        CascadeConfig(page_size=64, fuse_window=True, prefix_covers_tail=False, prefix_partial_dtype="bfloat16")
    for part in ("needs prefix_kernel='mosaic_gpu'", "contradicts prefix_covers_tail=False",
                 "prefix_partial_dtype='bfloat16' does not apply"):
        assert part in str(err.value)
    with pytest.raises(ValueError, match="fuse_window must be None, True or False, got 1"):
        CascadeConfig(page_size=64, fuse_window=1)
    sd = jax.ShapeDtypeStruct
    bf16, fp8 = sd((8, 8, 128), jnp.bfloat16), sd((8, 8, 128), FP8)
    fuses = cascade_module.fuses_window
    sms = cascade_module.num_sms()
    # A query [B, N=64, Hq=32, D=128]: 2 row tiles per KV head, so B * 8 * 2 programs before splits.
    one_wave, full = sd((1, 64, 32, 128), jnp.bfloat16), sd((sms, 64, 32, 128), jnp.bfloat16)
    assert cascade_module.prefix_programs(one_wave.shape, 8, 1) == 16
    cfg = CascadeConfig(page_size=64)
    assert fuses(cfg, True, True, bf16, full) and fuses(cfg, True, True, bf16, one_wave)
    # FP8 pools fuse by default only where the prefix programs leave SMs idle (keys split) and the
    # unfused prefix would keep each warpgroup's own widened V (64-row heads: N=16, G=4), given a
    # 16-bit query; else the window kernel (N=64: the memory warpgroup widens V unfused).
    lanes = sd((1, 16, 32, 128), jnp.bfloat16)
    assert fuses(cfg, True, True, fp8, lanes)
    assert cascade_module.widens_values_by_default(256, 128, 64) == pdm.default_config().memory_widens
    assert not cascade_module.widens_values_by_default(64, 128, 64)
    assert fuses(cfg, True, True, fp8, one_wave) == (not pdm.default_config().memory_widens)
    # The config's switch reaches the rule: without the widening the one-wave FP8 cascade fuses.
    no_widen = CascadeConfig(page_size=64, prefix_mgpu=pdm.PrefixMgpuConfig(memory_widens=False))
    assert fuses(no_widen, True, True, fp8, one_wave)
    assert not fuses(cfg, True, True, fp8, full)
    assert not fuses(cfg, True, True, fp8, sd((1, 64, 32, 128), jnp.float32))
    assert fuses(CascadeConfig(page_size=64, prefix_kernel="mosaic_gpu", fuse_window=True), True, True, fp8, full)
    assert not fuses(cfg, False, False, bf16, full)  # the Triton prefix
    assert not fuses(CascadeConfig(page_size=64, prefix_covers_tail=False), True, False, bf16, full)
    assert not fuses(CascadeConfig(page_size=64, prefix_partial_dtype="bfloat16"), True, True, bf16, full)
    assert not fuses(CascadeConfig(page_size=64, fuse_window=False), True, True, bf16, full)
    assert heads_io_errors(64, 4) == []
    assert "group of 1, 2, 4 or 8 heads, got 16" in heads_io_errors(64, 16)[0]
    assert "R a multiple of 64 / G = 16, got R=20" in heads_io_errors(20, 4)[0]


def test_fused_kernel_refusals_name_the_value():
    sd = jax.ShapeDtypeStruct
    b, hkv, total, d = 2, 2, 64, 64
    q = jnp.zeros((b, hkv, total, d), jnp.bfloat16)
    pool = jnp.zeros((4 * PAGE, hkv, d), jnp.bfloat16)
    table, lens = jnp.zeros((b, 4), jnp.int32), jnp.zeros((b,), jnp.int32)
    words, union = jnp.zeros((b, 2, total), jnp.int32), jnp.zeros((b, 2), jnp.int32)
    with pytest.raises(ValueError, match=r"window_words must be \[B=2, 2, T=64\] int32"):
        prefix_decode_mgpu_row_layout(q, pool, pool, table, lens, words[:, :, :32], union, query_rows=1,
                                      group=total, page_size=PAGE, scale=0.1, window=8, interpret=True)
    with pytest.raises(ValueError, match="window=8 needs window_words and window_union"):
        prefix_decode_mgpu_row_layout(q, pool, pool, table, lens, query_rows=1, group=total, page_size=PAGE,
                                      scale=0.1, window=8, interpret=True)
    with pytest.raises(ValueError, match=r"heads_io without the fused window needs every row bounded by P "
                       r"\(query_rows=1, got 16\) and the partials handed on unmerged \(merge=False, got True\)"):
        prefix_decode_mgpu_row_layout(jnp.zeros((b, 16, 8, d), jnp.bfloat16), pool, pool, table, lens,
                                      query_rows=16, group=4, page_size=PAGE, scale=0.1, heads_io=True,
                                      interpret=True)
    del sd


@pytest.mark.parametrize("r,group,splits,heads_io,pool_dtype", cases([
    (64, 4, 1, True, jnp.bfloat16), (16, 4, 2, True, jnp.bfloat16), (8, 8, 1, True, jnp.bfloat16),
    (64, 4, 1, False, jnp.bfloat16), (64, 4, 1, True, FP8), (16, 4, 2, True, FP8), (16, 4, 1, True, FP8),
    (16, 4, 1, False, FP8)], default=(0, 4, 5)))
def test_fused_kernel_lowers_to_mosaic_gpu(r, group, splits, heads_io, pool_dtype, opts=None):
    """The compiled fused kernel (head-layout boxes or the row layout, with and without key splits)
    passes Mosaic GPU's layout inference on the CPU; the H200 runs it (bench_cascade)."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    b, hkv, d = 2, 8, 128
    total = r * group
    q = sd((b, r, hkv * group, d) if heads_io else (b, hkv, total, d), jnp.bfloat16)
    pool = sd((64 * PAGE, hkv, d), pool_dtype)
    fn = lambda *a: prefix_decode_mgpu_row_layout(  # noqa: E731
        *a, query_rows=1, group=total, page_size=PAGE, scale=0.1, num_splits=splits, window=64,
        partial_dtype=jnp.bfloat16, heads_io=heads_io, **(opts or {}))
    text = jax.jit(fn).trace(q, pool, pool, sd((b, 32), jnp.int32), sd((b,), jnp.int32),
                             sd((b, 2, total), jnp.int32), sd((b, 2), jnp.int32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("r,splits,heads_io,pool_dtype,cluster,pages", cases([
    (16, 2, True, FP8, True, None), (16, 2, True, jnp.bfloat16, True, None), (16, 4, True, FP8, True, 1),
    (16, 2, False, FP8, True, None), (16, 2, True, FP8, False, None), (64, 2, True, jnp.bfloat16, True, 1)]))
def test_cluster_split_forms_lower_to_mosaic_gpu(r, splits, heads_io, pool_dtype, cluster, pages):
    """The fused kernel whose key splits merge inside one cluster (`cluster_splits`: pieces and
    lse2 stored into the other CTAs' shared memory) lowers on the CPU, in head and row layout, with
    one row-owning warpgroup (64-row heads) and with two (R=64, G=4: 128-row CTAs); the H200 checks
    the first kind against the merge-kernel form and dense fp32 (benchmarks/tools/fused_window_cost.py,
    bench_cascade)."""
    # Four FP8 splits' inbox (48 KB), or two row owners' (48 KB), fits beside one page per step only.
    test_fused_kernel_lowers_to_mosaic_gpu(r, 4, splits, heads_io, pool_dtype,
                                           opts=dict(cluster_splits=cluster, pages_per_step=pages))


@sweep
def test_cluster_splits_default_takes_one_row_owner_forms(monkeypatch):
    """`cluster_splits=None` clusters 2 gridded key splits of 64-row heads (one warpgroup writes the
    rows: the forms the H200 ran fast) where the inbox fits, and nothing else; 4 splits cluster only
    when asked (their clusters lost the H200's single wave)."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)
    import pallas_kernels.attention.prefix_decode_mgpu as pdm

    seen = []
    real = pdm.plgpu.kernel
    monkeypatch.setattr(pdm.plgpu, "kernel", lambda *a, **k: seen.append(k.get("cluster", ())) or real(*a, **k))
    sd = jax.ShapeDtypeStruct

    def cluster_of(r, splits, pool_dtype, **opts):
        jax.clear_caches()  # trace the kernel again, whatever ran before
        b, hkv, d = 2, 8, 128
        total = r * 4
        fn = lambda *a: prefix_decode_mgpu_row_layout(  # noqa: E731
            *a, query_rows=1, group=total, page_size=PAGE, scale=0.1, num_splits=splits, window=16,
            partial_dtype=jnp.bfloat16, heads_io=True, **opts)
        jax.jit(fn).trace(sd((b, r, hkv * 4, d), jnp.bfloat16), sd((64 * PAGE, hkv, d), pool_dtype),
                          sd((64 * PAGE, hkv, d), pool_dtype), sd((b, 32), jnp.int32), sd((b,), jnp.int32),
                          sd((b, 2, total), jnp.int32), sd((b, 2), jnp.int32)).lower(lowering_platforms=("cuda",))
        return seen[-1]

    assert cluster_of(16, 2, FP8) == (2,)  # the B=8 FP8 form: key split, one owner
    assert cluster_of(16, 2, jnp.bfloat16) == (2,)  # one compute warpgroup
    # Four FP8 splits' inbox fits beside the default ring of one page per step (FUSED_FP8_SPLIT_RING),
    # not beside two pages per step; by default they are not clustered.
    assert cluster_of(16, 4, FP8) == ()
    assert cluster_of(16, 4, FP8, cluster_splits=True) == (4,)
    with pytest.raises(ValueError, match="inbox"):
        cluster_of(16, 4, FP8, cluster_splits=True, stages=2, pages_per_step=2)
    assert cluster_of(16, 3, FP8) == ()  # three splits are no cluster
    assert cluster_of(64, 2, jnp.bfloat16, pages_per_step=1) == ()  # two row owners: only when asked
    assert cluster_of(16, 2, FP8, cluster_splits=False) == ()


def test_cluster_split_refusals_name_the_value():
    assert cluster_split_errors(True, 2, 128, False) == []
    assert "takes the fused window" in cluster_split_errors(False, 2, 128, False)[0]
    assert "gridded launch, got persistent=True" in cluster_split_errors(True, 2, 128, True)[0]
    assert "takes 2, 4, 8 key splits (a cluster's CTAs), got 3" in cluster_split_errors(True, 3, 128, False)[0]
    assert "head dim 64 to be a multiple of 4 splits x 32 columns" in cluster_split_errors(True, 4, 64, False)[0]
    # Forced on where it cannot run, the kernel refuses with every reason at once.
    b, hkv, total, d = 2, 2, 64, 64
    q = jnp.zeros((b, hkv, total, d), jnp.bfloat16)
    pool = jnp.zeros((64 * PAGE, hkv, d), jnp.bfloat16)
    table, lens = jnp.zeros((b, 64), jnp.int32), jnp.zeros((b,), jnp.int32)
    with pytest.raises(ValueError, match="takes the fused window.*head dim 64 to be a multiple of 4 splits"):
        prefix_decode_mgpu_row_layout(q, pool, pool, table, lens, query_rows=1, group=total, page_size=PAGE,
                                      scale=0.1, num_splits=4, cluster_splits=True, interpret=True)


def test_merge_weights_match_a_float64_lse_merge():
    """`merge_weights` (the clustered splits' and the key-split warpgroups' merge): weights
    2^(lse_s - lse) and the merged lse2 of a float64 merge; rows no partial saw get weights 0 and
    -inf."""
    rng = np.random.default_rng(3)
    for parts in (2, 4):
        lses = rng.normal(0, 20, (parts, 64)).astype(np.float32)
        lses[:, :3] = -np.inf  # unseen by every partial
        lses[1:, 3:6] = -np.inf  # seen by the first only
        weights, merged = merge_weights([jnp.asarray(x) for x in lses])
        seen = np.isfinite(lses).any(axis=0)
        want = np.full(64, -np.inf)
        want[seen] = np.log2(np.exp2(lses[:, seen].astype(np.float64)).sum(axis=0))
        assert np.array_equal(np.isfinite(np.asarray(merged)), seen)
        np.testing.assert_allclose(np.asarray(merged)[seen], want[seen], rtol=0, atol=1e-5)
        for x, w in zip(lses, weights):
            expect = np.where(seen, np.exp2(x.astype(np.float64) - np.where(seen, want, 0.0)), 0.0)
            np.testing.assert_allclose(np.asarray(w), expect, rtol=2e-6, atol=1e-7)
        assert np.isfinite(np.asarray(jnp.stack(weights))).all()


def test_default_ring_of_the_fused_fp8_key_split():
    """stages=None: four stages of one 64-token page (FUSED_FP8_SPLIT_RING, timed faster on the H200)
    for the fused window over an FP8 pool under the warpgroup key split (64-row heads); two stages
    and the given (or default) pages per step everywhere else."""
    from pallas_kernels.attention.prefix_decode_mgpu import FUSED_FP8_SPLIT_RING, default_ring
    assert default_ring(64, 128, FP8, 64, True, None, None) == FUSED_FP8_SPLIT_RING == (4, 1)
    assert default_ring(64, 128, FP8, 64, True, None, 2) == (2, 2)  # pages per step asked for
    assert default_ring(64, 128, FP8, 64, False, None, None) == (2, None)  # unfused
    assert default_ring(128, 128, FP8, 64, True, None, None) == (2, None)  # two row-owning warpgroups
    assert default_ring(64, 128, jnp.bfloat16, 64, True, None, None) == (2, None)  # 16-bit pools
    assert default_ring(64, 128, FP8, 128, True, None, None) == (2, None)  # a page is a whole step
