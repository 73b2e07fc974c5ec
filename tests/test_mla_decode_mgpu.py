"""The Mosaic GPU MLA latent decode (experimental) in Pallas' GPU interpreter, against fp32 references.

As for the GQA prefix half: the interpreter checks indexing, page-table reads, masking and the
barrier protocol on the CPU; the compiled kernel runs only in benchmarks/tools/mgpu_prefix_check.py --mla.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import poisoned_paged_pools, schedule_options
from tiers import cases, sweep
from trees import random_parents

from pallas_kernels.attention.mla_decode import mla_decode_reference, quantize_query
from pallas_kernels.attention.mla_decode_mgpu import check_mla_mgpu_inputs, mla_decode_mgpu
from pallas_kernels.attention.reference import cascade_dense_reference
from pallas_kernels.attention.tree_window import tree_window_attention
from treespec_jax.tree.masks import ancestor_mask

LORA, ROPE, PAGE, SCALE = 128, 64, 64, 0.09


FP8 = jnp.float8_e4m3fn


# Default tier: the default schedule ("seesaw") over bf16 and FP8 caches, and "split" over 32 rows padded
# to one tile; the other schedules and options in the sweep.
@pytest.mark.parametrize("r,hq,lengths,block_k,splits,schedule,dtype", cases([
    (4, 8, [0, 70, 200], 64, 1, "together", jnp.bfloat16),  # P = 0, partial last pages; 32 rows padded to one tile
    # Two row tiles, the first ending mid-page below the last whole page; the warpgroups take turns.
    (16, 8, [260, 20], 64, 2, "turns", jnp.bfloat16),
    # Each warpgroup scores half of every step's keys; maxima and P meet in shared memory.
    (16, 8, [260, 0, 90], 64, 2, "split", jnp.bfloat16),
    (4, 8, [0, 70, 200], 64, 1, "split", jnp.bfloat16),
    # The warpgroups score alternate steps whole and hand P over (by default in each step's rope
    # columns, read from there by both warpgroups' P V): odd and even step counts per split, a split
    # with no step, P = 0, a range ending on a partly visible step.
    (16, 8, [260, 0, 90], 64, 2, "seesaw", jnp.bfloat16),
    (4, 8, [0, 70, 200, 400], 64, 1, "seesaw", jnp.bfloat16),
    # P handed over in a shared-memory buffer of its own and loaded into registers for P V.
    (16, 8, [260, 0, 90], 64, 2, "seesaw+no_p_in_ring", jnp.bfloat16),
    # The pair's wgmma operands at fixed addresses (the form `loop_descriptors` replaces: by default
    # they are indexed at a loop-variant zero so their descriptors are built in the loop).
    (16, 8, [260, 0, 90], 64, 2, "seesaw+no_loop_descriptors", jnp.bfloat16),
    (16, 8, [330, 20], 64, 1, "seesaw+no_loop_descriptors", FP8),
    # FP8 cache: FP8 query x FP8 rows for the scores, value channels widened to fp16 per warpgroup.
    (16, 8, [260, 20], 64, 2, "turns", FP8),
    (16, 8, [330, 20], 64, 1, "seesaw", FP8),
    (16, 8, [260, 0, 90], 64, 2, "split", FP8),
    (16, 8, [260, 20], 64, 1, "together", FP8),
], default=(4, 10)))
def test_mgpu_mla_decode_and_cascade_match_references(r, hq, lengths, block_k, splits, schedule, dtype, backend):
    rng = np.random.default_rng(r * hq + block_k)
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    pool, _, table = poisoned_paged_pools(rng, b, int(lengths.max()) + r, 1, LORA + ROPE, PAGE, dtype,
                                          lambda bb, pos: pos < lengths[bb] + r)
    pool = pool[:, 0]  # [S, L + Dr]: one latent row per slot
    # The absorbed query the decode multiplies: quantised to FP8 under an FP8 cache (as the cascade does).
    q = quantize_query(jnp.asarray(rng.standard_normal((b, r, hq, LORA + ROPE)), jnp.bfloat16), dtype)
    lens = jnp.asarray(lengths)
    schedule, options = schedule_options(schedule)
    out, lse = mla_decode_mgpu(q, pool, table, lens, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                               block_k=block_k, num_splits=splits, schedule=schedule,
                               interpret=backend == "interpret", **options)
    ref_out, ref_lse = mla_decode_reference(q, pool, table, lens, kv_lora_rank=LORA, page_size=PAGE,
                                            scale=SCALE, whole_pages=True)
    assert out.shape == (b, r, hq, LORA) and lse.shape == (b, r, hq)
    assert rel_err(out, ref_out) < 1e-2
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-3)
    # With the window kernel covering the partial page and the tree window: one dense attention.
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, r)))
    got = tree_window_attention(q.astype(jnp.bfloat16), pool, None, table, lens, mask, out, lse, window=r, page_size=PAGE,
                                scale=SCALE, rope_dim=ROPE, value_dim=LORA, prefix_whole_pages=True,
                                backend=backend)
    dense, _ = cascade_dense_reference(q.astype(jnp.bfloat16), pool[:, None, :], pool[:, None, :LORA], table, lens,
                                       mask, window=r, page_size=PAGE, scale=SCALE)
    assert rel_err(got, dense) < 1e-2


def test_mgpu_mla_refuses_unsupported_shapes():
    bf = jnp.bfloat16
    q = jnp.zeros((1, 2, 4, 192), bf)
    with pytest.raises(ValueError, match="latent_pool must be"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 128), bf), 128, 64, 64)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), bf), 96, 64, 64)
    with pytest.raises(ValueError, match="block_k must be a multiple of 64"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), bf), 128, 64, 32)
    with pytest.raises(ValueError, match="more than 232448"):  # three 64-key buffers at DeepSeek widths
        mla_decode_mgpu(jnp.zeros((1, 2, 4, 576), bf), jnp.zeros((64 * 64, 576), bf), jnp.zeros((1, 64), jnp.int32),
                        jnp.zeros((1,), jnp.int32), kv_lora_rank=512, page_size=64, scale=0.1, stages=3)
    with pytest.raises(ValueError, match="got bfloat16, float32"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), jnp.float32), 128, 64, 64)


@pytest.mark.parametrize("dtype,tol,covers_tail,lengths,fuse", cases([
    (jnp.bfloat16, 1e-2, False, [150, 3], False), (FP8, 6e-2, False, [150, 3], False),
    # P mod page < N - 1 (one page-aligned): the flag moves keys between the halves.
    (jnp.bfloat16, 1e-2, True, [128, 130], False),
    # The default with the prefix covering every row's tail: the window fused into the decode.
    (jnp.bfloat16, 1e-2, None, [128, 130], True), (FP8, 6e-2, None, [150, 3], True)], default=(1, 3, 4)))
def test_mla_verify_through_the_mosaic_gpu_decode(dtype, tol, covers_tail, lengths, fuse, backend):
    """MlaCascadeConfig(prefix_kernel="mosaic_gpu") end to end (interpreter) equals dense attention,
    with a bf16 and an FP8 latent cache (whose prefix half scores the FP8-quantised query), with
    the decode run to the whole-page bound for every row (`prefix_covers_tail`), and with the
    window fused into the decode where the default does that (covering the tail)."""
    from treespec_jax.attention.mla import MlaCascadeConfig, fuses_window, mla_verify_attention

    rng = np.random.default_rng(9)
    n, hq = 8, 4
    lengths = np.array(lengths, np.int32)
    b = len(lengths)
    pool, _, table = poisoned_paged_pools(rng, b, int(lengths.max()) + n, 1, LORA + ROPE, PAGE, dtype,
                                          lambda bb, pos: pos < lengths[bb] + n)
    pool = pool[:, 0]
    q = jnp.asarray(rng.standard_normal((b, n, hq, LORA + ROPE)), jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    lens = jnp.asarray(lengths)
    cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                           prefix_kernel="mosaic_gpu", prefix_covers_tail=covers_tail,
                           fuse_window=None if fuse else False)
    assert fuses_window(cfg, True, dtype) == fuse
    got = mla_verify_attention(q, pool, table, lens, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lens, mask, window=n,
                                       page_size=PAGE, scale=SCALE)
    assert rel_err(got, dense) < tol
    with pytest.raises(ValueError, match="prefix_kernel"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, prefix_kernel="x")


def test_auto_latent_decode_takes_mosaic_only_where_it_runs_compiled():
    """"auto" (the default) takes the Mosaic GPU latent decode only compiled, page a multiple
    of 64 (16-bit or FP8 caches); an explicit "mosaic_gpu" raises every blocker at once."""
    from treespec_jax.attention.mla import MlaCascadeConfig, uses_mosaic_latent_decode

    sds = jax.ShapeDtypeStruct
    q, pool = sds((2, 16, 8, 576), jnp.bfloat16), sds((4096, 576), jnp.bfloat16)
    cfg = dict(kv_lora_rank=512, rope_dim=64, scale=0.1)
    auto = MlaCascadeConfig(page_size=64, **cfg)
    assert auto.prefix_kernel == "auto"
    assert uses_mosaic_latent_decode(auto, "compiled", q, pool)
    assert not uses_mosaic_latent_decode(auto, "interpret", q, pool)
    assert not uses_mosaic_latent_decode(auto, "reference", q, pool)
    assert not uses_mosaic_latent_decode(MlaCascadeConfig(page_size=32, **cfg), "compiled", q, pool)
    fp8_q, fp8_pool = sds(q.shape, jnp.float8_e4m3fn), sds(pool.shape, jnp.float8_e4m3fn)
    assert uses_mosaic_latent_decode(auto, "compiled", fp8_q, fp8_pool)
    assert not uses_mosaic_latent_decode(auto, "interpret", fp8_q, fp8_pool)
    forced_ok = MlaCascadeConfig(page_size=64, prefix_kernel="mosaic_gpu", **cfg)
    assert uses_mosaic_latent_decode(forced_ok, "compiled", fp8_q, fp8_pool)
    assert not uses_mosaic_latent_decode(MlaCascadeConfig(page_size=64, prefix_kernel="triton", **cfg), "compiled",
                                         q, pool)
    forced = MlaCascadeConfig(page_size=32, prefix_kernel="mosaic_gpu", **cfg)
    f32_q, f32_pool = sds(q.shape, jnp.float32), sds(pool.shape, jnp.float32)
    with pytest.raises(ValueError, match=r"block_k must be a multiple of 64.*got float32, float32"):
        uses_mosaic_latent_decode(forced, "compiled", f32_q, f32_pool)


@pytest.mark.parametrize("schedule,dtype", cases([(s, d) for s in ("split", "seesaw", "turns", "together")
                                                  for d in (jnp.bfloat16, FP8)]
                                                 + [("seesaw+no_p_in_ring", jnp.bfloat16),
                                                    ("seesaw+no_loop_descriptors", jnp.bfloat16)], default=(0, 2, 3)))
def test_mgpu_mla_decode_lowers_to_mosaic_gpu(schedule, dtype):
    """The compiled path lowers to a Mosaic GPU module on the CPU, including Mosaic's layout
    inference and its shared-memory check (the cubin is built on the GPU machine): DeepSeek-V3
    widths (latent 512 + rope 64, 128 heads; bf16 and FP8) under every schedule (the split's
    exchange buffers fit beside the ring only without reduction scratch)."""
    import jax

    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    lora, rope = 512, 64
    c = lora + rope
    schedule, options = schedule_options(schedule)
    fn = lambda q, pool, t, ln: mla_decode_mgpu(q, pool, t, ln, kv_lora_rank=lora, page_size=64, scale=0.07,  # noqa: E731
                                                schedule=schedule, num_splits=2, **options)
    text = jax.jit(fn).trace(sd((2, 16, 128, c), dtype), sd((64 * 64, c), dtype),
                             sd((2, 32), jnp.int32), sd((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@sweep  # out_dtype: the fused window's final output; test_mla_fused_window checks it against dense
@pytest.mark.parametrize("schedule,splits", [("seesaw", 1), ("turns", 1), ("seesaw", 2)])
def test_out_dtype_is_the_float32_output_rounded_once(schedule, splits, interpret):
    """out_dtype=bf16: the kernel writes the float32 output rounded to bf16 itself (no split: the
    exchange schedules' whole staging tile, the others' 16-column pieces), the same bits as casting
    the float32 output; with splits the float32 partials are merged, then cast."""
    rng = np.random.default_rng(11)
    lengths = np.asarray([200, 70], np.int32)
    pool, _, table = poisoned_paged_pools(rng, 2, 200 + 4, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + 4)
    q = jnp.asarray(rng.standard_normal((2, 4, 8, LORA + ROPE)), jnp.bfloat16)
    kw = dict(kv_lora_rank=LORA, page_size=PAGE, scale=SCALE, num_splits=splits, schedule=schedule, interpret=interpret)
    wide, lse_wide = mla_decode_mgpu(q, pool[:, 0], table, jnp.asarray(lengths), **kw)
    narrow, lse = mla_decode_mgpu(q, pool[:, 0], table, jnp.asarray(lengths), out_dtype=jnp.bfloat16, **kw)
    assert wide.dtype == jnp.float32 and narrow.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
    assert np.isfinite(np.asarray(wide)).all()
    np.testing.assert_array_equal(np.asarray(narrow, np.float32), np.asarray(wide.astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_wide))
    with pytest.raises(ValueError, match="out_dtype must be one of .* got int32"):
        mla_decode_mgpu(q, pool[:, 0], table, jnp.asarray(lengths), out_dtype=jnp.int32, **kw)


def test_p_in_ring_refusals_list_every_blocker():
    """p_in_ring needs "seesaw", a 16-bit cache and rope channels >= block_k; every blocker is named
    at once, and None resolves to off wherever one applies."""
    from pallas_kernels.attention.mla_decode_mgpu import p_in_ring_errors

    q16 = jnp.zeros((1, 2, 4, 160), jnp.bfloat16)  # 128 latent + 32 rope channels
    errors = p_in_ring_errors(q16, 128, 64, "split")
    assert len(errors) == 2 and "'split'" in errors[0] and "rope channels (32) >= block_k (64)" in errors[1]
    assert "float8_e4m3fn" in p_in_ring_errors(jnp.zeros((1, 2, 4, 192), FP8), 128, 64, "seesaw")[0]
    assert not p_in_ring_errors(jnp.zeros((1, 2, 4, 192), jnp.bfloat16), 128, 64, "seesaw")
    args = (jnp.zeros((64 * 4, 160), jnp.bfloat16), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="got 'split'.*rope channels"):
        mla_decode_mgpu(q16, *args, kv_lora_rank=128, page_size=64, scale=0.1, schedule="split", p_in_ring=True)
    with pytest.raises(ValueError, match="p_in_ring must be None, True or False, got 'yes'"):
        mla_decode_mgpu(q16, *args, kv_lora_rank=128, page_size=64, scale=0.1, p_in_ring="yes")


@sweep
def test_mla_register_budgets_default():
    """registers=None lowers to MLA_REGISTERS (240, 24) in both default forms (bf16 with the window
    fused, FP8); an explicit pair wins; a pair that does not fit the launch is refused by value."""
    import jax
    from test_prefix_decode_mgpu import setmaxnreg_budgets

    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    c = 512 + 64

    def budgets(dtype, window=0, **opts):
        fn = lambda q, pool, t, ln, *m: mla_decode_mgpu(  # noqa: E731
            q, pool, t, ln, *m, kv_lora_rank=512, page_size=64, scale=0.07, num_splits=1, window=window, **opts)
        args = [sd((2, 16, 128, c), dtype), sd((64 * 64, c), dtype), sd((2, 32), jnp.int32), sd((2,), jnp.int32)]
        if window:
            args.append(sd((2, 16, 2), jnp.uint32))
        return setmaxnreg_budgets(jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text())

    assert budgets(jnp.bfloat16, window=16) == ({240}, {24})
    assert budgets(FP8) == ({240}, {24})
    assert budgets(jnp.bfloat16, registers=(232, 40)) == ({232}, {40})
    with pytest.raises(ValueError, match=r"registers .* got \(248, 24\)"):
        budgets(jnp.bfloat16, registers=(248, 24))


@sweep
def test_mla_grid_order_changes_no_result(interpret):
    """Grid axes of three different sizes (1 request, 2 key splits, 3 row tiles of 64 of the 16 x 12
    rows): launching a request's tiles apart (the old order) gives the same bits as side by side
    (the default), so no axis is read under another's name."""
    rng = np.random.default_rng(3)
    lengths = np.asarray([260], np.int32)
    pool, _, table = poisoned_paged_pools(rng, 1, 260 + 16, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + 16)
    q = jnp.asarray(rng.standard_normal((1, 16, 12, LORA + ROPE)), jnp.bfloat16)
    kw = dict(kv_lora_rank=LORA, page_size=PAGE, scale=SCALE, num_splits=2, interpret=interpret)
    old = mla_decode_mgpu(q, pool[:, 0], table, jnp.asarray(lengths), tiles_adjacent=False, **kw)
    new = mla_decode_mgpu(q, pool[:, 0], table, jnp.asarray(lengths), **kw)
    for a, b in zip(new, old):
        assert not np.any(np.isnan(np.asarray(a)))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@sweep
def test_mla_decode_with_tiles_apart_lowers():
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    fn = lambda q, pool, t, ln: mla_decode_mgpu(q, pool, t, ln, kv_lora_rank=512, page_size=64, scale=0.07,  # noqa: E731
                                                num_splits=2, tiles_adjacent=False)
    text = jax.jit(fn).trace(sd((2, 16, 128, 576), jnp.bfloat16), sd((64 * 64, 576), jnp.bfloat16),
                             sd((2, 32), jnp.int32), sd((2,), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@sweep
def test_mla_prefix_covers_tail_defaults_to_the_latent_decode(monkeypatch, backend):
    """MlaCascadeConfig.prefix_covers_tail=None is on under the Mosaic latent decode (the window
    kernel then runs without the causal tail) and off under the Triton one; an explicit value wins.
    (The window kernel is kept: the 16-bit default would fuse the window into the Mosaic decode.)"""
    from treespec_jax.attention import mla as mla_module
    from treespec_jax.attention.mla import MlaCascadeConfig, mla_verify_attention

    seen = []
    real = mla_module.tree_window_attention

    def spy(*args, **kwargs):
        seen.append(kwargs["causal_prefix"])
        return real(*args, **kwargs)

    monkeypatch.setattr(mla_module, "tree_window_attention", spy)
    rng = np.random.default_rng(10)
    n, hq = 8, 4
    lengths = np.array([128, 66], np.int32)
    pool, _, table = poisoned_paged_pools(rng, 2, int(lengths.max()) + n, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + n)
    pool = pool[:, 0]
    q = jnp.asarray(rng.standard_normal((2, n, hq, LORA + ROPE)), jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, 2, n)))
    lens = jnp.asarray(lengths)
    dense, _ = cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lens, mask, window=n,
                                       page_size=PAGE, scale=SCALE)
    for kernel, covers in [("triton", None), ("mosaic_gpu", None), ("mosaic_gpu", False), ("triton", True)]:
        cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                               prefix_kernel=kernel, prefix_covers_tail=covers, fuse_window=False)
        assert rel_err(mla_verify_attention(q, pool, table, lens, mask, config=cfg), dense) < 1e-2
    assert seen == [True, False, True, False]  # causal_prefix = not covers
    with pytest.raises(ValueError, match="prefix_covers_tail must be None, True or False, got 1"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, prefix_covers_tail=1)


def test_mla_schedule_defaults_and_refusals():
    """None takes the per-dtype default (seesaw for 16-bit and FP8 caches, from the H200); an unknown
    schedule is refused by the kernel and by MlaCascadeConfig, naming the value."""
    from pallas_kernels.attention.mla_decode_mgpu import default_schedule
    from treespec_jax.attention.mla import MlaCascadeConfig

    assert default_schedule(jnp.bfloat16) == "seesaw" and default_schedule(FP8) == "seesaw"
    bf = jnp.bfloat16
    with pytest.raises(ValueError, match="'sideways'"):
        mla_decode_mgpu(jnp.zeros((1, 2, 4, 192), bf), jnp.zeros((64 * 4, 192), bf), jnp.zeros((1, 4), jnp.int32),
                        jnp.zeros((1,), jnp.int32), kv_lora_rank=128, page_size=64, scale=0.1, schedule="sideways")
    with pytest.raises(ValueError, match="schedule must be None or one of"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, schedule="sideways")


@sweep  # cluster_tiles is off by default (MLA_CLUSTER_TILES = 1)
def test_cluster_tiles_step_through_the_clusters_keys(interpret):
    """cluster_tiles=2: a cluster's row tiles step through the keys of its last tile's rows (compiled,
    one multicast copy feeds them all); an earlier tile masks the steps past its own rows' bounds,
    so every output has the bits of cluster_tiles=1. 128 rows of one head: tile 0 (rows 0-63) of
    the P = 128 request sees 64 keys at most, tile 1 the 128 whole-page ones; P = 0 sees none."""
    rng = np.random.default_rng(41)
    lengths = np.asarray([128, 250, 0], np.int32)
    r, hq = 128, 1
    pool, _, table = poisoned_paged_pools(rng, 3, int(lengths.max()) + r, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + r)
    q = jnp.asarray(rng.standard_normal((3, r, hq, LORA + ROPE)), jnp.bfloat16)
    lens = jnp.asarray(lengths)
    kw = dict(kv_lora_rank=LORA, page_size=PAGE, scale=SCALE, num_splits=1, interpret=interpret)
    one = mla_decode_mgpu(q, pool[:, 0], table, lens, cluster_tiles=1, **kw)
    two = mla_decode_mgpu(q, pool[:, 0], table, lens, cluster_tiles=2, **kw)
    ref_out, _ = mla_decode_reference(q, pool[:, 0], table, lens, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                                      whole_pages=True)
    assert not np.isnan(np.asarray(two[0])).any() and rel_err(two[0], ref_out) < 1e-2
    for a, b in zip(two, one):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_cluster_tiles_refusals_and_default():
    """cluster_tiles must be 1, 2 or 4, divide a request's row tiles and launch them adjacent; every
    blocker is named at once. None takes MLA_CLUSTER_TILES where it groups the tiles, else 1."""
    from pallas_kernels.attention import mla_decode_mgpu as module

    assert module.cluster_tiles_errors(3, 4, True)[0].endswith("got 3")
    errors = module.cluster_tiles_errors(2, 3, False)
    assert len(errors) == 2 and "divide the 3 row tiles" in errors[0] and "tiles_adjacent=True" in errors[1]
    assert not module.cluster_tiles_errors(4, 32, True)
    assert module.default_cluster_tiles(32, True) == module.MLA_CLUSTER_TILES
    assert module.default_cluster_tiles(3, True) == 1 and module.default_cluster_tiles(32, False) == 1
    q = jnp.zeros((1, 2, 4, 192), jnp.bfloat16)  # 8 rows: one tile
    args = (jnp.zeros((64 * 4, 192), jnp.bfloat16), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32))
    with pytest.raises(ValueError, match="cluster_tiles=2 must divide the 1 row tiles"):
        mla_decode_mgpu(q, *args, kv_lora_rank=128, page_size=64, scale=0.1, cluster_tiles=2)


@sweep
@pytest.mark.parametrize("dtype,window", [(jnp.bfloat16, 16), (FP8, 0)])
def test_clustered_mla_decode_lowers(dtype, window):
    """cluster_tiles=2 lowers (cluster launch, multicast latent copies, cluster release barriers):
    the bf16 cascade's fused form and the unfused FP8 decode at DeepSeek-V3 widths."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    fn = lambda q, pool, t, ln, *m: mla_decode_mgpu(q, pool, t, ln, *m, kv_lora_rank=512, page_size=64,  # noqa: E731
                                                    scale=0.07, num_splits=1, window=window, cluster_tiles=2)
    args = [sd((2, 16, 128, 576), dtype), sd((64 * 64, 576), dtype), sd((2, 32), jnp.int32), sd((2,), jnp.int32)]
    if window:
        args.append(sd((2, 16, 2), jnp.uint32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_loop_descriptors_default_and_refusals(monkeypatch):
    """None builds the seesaw pair's descriptors in the loop (`MlaMgpuConfig.loop_descriptors`) and
    leaves the other schedules as they are; a config turns the default off; True under another
    schedule, or a non-bool, is refused by value, with every other blocker."""
    from pallas_kernels.attention import mla_decode_mgpu as module

    assert module.default_config() == module.MlaMgpuConfig(p_in_ring=True, loop_descriptors=True)
    with pytest.raises(ValueError, match="loop_descriptors must be True or False"):
        module.MlaMgpuConfig(loop_descriptors=None)
    bf = jnp.bfloat16
    q = jnp.zeros((1, 2, 4, 192), bf)
    args = (jnp.zeros((64 * 4, 192), bf), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32))
    kw = dict(kv_lora_rank=128, page_size=64, scale=0.1)
    with pytest.raises(ValueError, match="under schedule 'seesaw' only, got 'turns'.*registers"):
        mla_decode_mgpu(q, *args, schedule="turns", loop_descriptors=True, registers=(248, 24), **kw)
    with pytest.raises(ValueError, match="loop_descriptors must be None, True or False, got 1"):
        mla_decode_mgpu(q, *args, loop_descriptors=1, **kw)
    # What the knobs left None resolve to, under the default rules and with both switched off.
    monkeypatch.setattr(module, "_mla_decode_mgpu", lambda *a, **k: k)
    resolved = module.mla_decode_mgpu(q, *args, **kw)
    assert resolved["loop_descriptors"] is True and resolved["schedule"] == "seesaw"
    off = module.mla_decode_mgpu(q, *args, config=module.MlaMgpuConfig(p_in_ring=False, loop_descriptors=False), **kw)
    assert off["loop_descriptors"] is False and off["p_in_ring"] is False
