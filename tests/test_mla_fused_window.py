"""The tree window fused into the Mosaic MLA latent decode (`MlaCascadeConfig.fuse_window`), in Pallas'
GPU interpreter against one dense fp32 attention, plus its refusals and its lowering at DeepSeek-V3
widths. The compiled kernel runs in benchmarks/ (bench_mla.py --fuse-window)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import poisoned_paged_pools, schedule_options
from test_cascade_gqa import lane_masks
from tiers import cases
from trees import random_parents

from pallas_kernels.attention import mla_decode_mgpu as mla_mgpu_module
from pallas_kernels.attention.mla_decode_mgpu import mla_decode_mgpu
from pallas_kernels.attention.reference import cascade_dense_reference
from treespec_jax.attention import mla as mla_module
from treespec_jax.attention.mla import MlaCascadeConfig, mla_lane_attention, mla_verify_attention
from treespec_jax.tree.masks import ancestor_mask, pack_mask_rows

LORA, ROPE, PAGE, SCALE = 128, 64, 64, 0.09
# The interpreter scores the NaN-poisoned key rows before the mask replaces those scores.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")


def dense(q, pool, table, lengths, mask, window):
    return cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lengths, mask, window=window,
                                   page_size=PAGE, scale=SCALE)[0]


@pytest.mark.parametrize("n,hq,lengths,splits,schedule", cases([
    (8, 8, [260, 0, 3], 2, "split"),  # P = 0 and P < N; the key axis split in two, merged by LSE
    (16, 4, [130, 64], 1, "split"),  # window straddling a page edge; P a whole page
    (5, 8, [63, 200], 3, "split"),  # 40 rows padded to one tile; a trailing split with no step
    # Alternate steps scored whole by each warpgroup: odd and even step counts, window steps masked.
    (16, 4, [130, 300], 1, "seesaw"),
    (16, 4, [130, 300], 1, "seesaw+no_p_in_ring"),  # P in a buffer of its own, not the rope columns
], default=(3,)))
def test_fused_mla_window_matches_dense(n, hq, lengths, splits, schedule, backend):
    """Every row sees [0, P) and its ancestors in the window; slots past P + N hold NaN (poisoned),
    which the kernel must zero before P V."""
    rng = np.random.default_rng(n * hq)
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    pool, _, table = poisoned_paged_pools(rng, b, int(lengths.max()) + n, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + n)
    pool = pool[:, 0]
    q = jnp.asarray(rng.standard_normal((b, n, hq, LORA + ROPE)), jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    lens = jnp.asarray(lengths)
    schedule, options = schedule_options(schedule)
    out, lse = mla_decode_mgpu(q, pool, table, lens, mask, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                               window=n, num_splits=splits, schedule=schedule,
                               interpret=backend == "interpret", **options)
    assert out.shape == (b, n, hq, LORA) and lse.shape == (b, n, hq)
    assert not np.isnan(np.asarray(out)).any()
    assert rel_err(out, dense(q, pool, table, lens, mask, n)) < 1e-2
    if options:
        return  # a kernel option the cascade's config does not name: the kernel alone
    # The same through the verify cascade, which then runs no window kernel.
    calls = []
    real = mla_module.tree_window_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_module, "tree_window_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                               prefix_kernel="mosaic_gpu", fuse_window=True, schedule=schedule)
        got = mla_verify_attention(q, pool, table, lens, mask, config=cfg)
    assert not calls
    assert rel_err(got, dense(q, pool, table, lens, mask, n)) < 1e-2


def test_fused_mla_lanes_zero_unseen_slots(backend):
    """Draft lanes (K = 4, S = 5, at draft step 2): lane-window slots no lane sees (not yet written,
    or pruned) hold NaN; the fused kernel zeroes their value rows and equals dense attention."""
    rng = np.random.default_rng(7)
    b, kk, steps, step, hq = 2, 4, 5, 2, 16
    w = (steps - 1) * kk
    frontier = np.array([70, 129], np.int32)
    bits = lane_masks(rng, b, kk, step)[:, :, :w]
    seen_slots = bits.any(axis=1)  # [B, W]
    pool, _, table = poisoned_paged_pools(
        rng, b, int(frontier.max()) + w, 1, LORA + ROPE, PAGE, jnp.bfloat16,
        lambda bb, pos: pos < frontier[bb] or (pos < frontier[bb] + w and seen_slots[bb, pos - frontier[bb]]))
    pool = pool[:, 0]
    assert not seen_slots.all()  # some window slot is poisoned, so the test can fail
    q = jnp.asarray(rng.standard_normal((b, kk, hq, LORA + ROPE)), jnp.bfloat16)
    mask = pack_mask_rows(jnp.asarray(bits))
    cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                           prefix_kernel="mosaic_gpu", fuse_window=True)
    out = mla_lane_attention(q, pool, table, jnp.asarray(frontier), mask, steps=steps, config=cfg)
    ref = dense(q, pool, table, jnp.asarray(frontier), mask, w)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    assert rel_err(out.astype(jnp.float32), ref) < 1e-2


def test_fused_mla_window_refusals_list_every_blocker():
    bf, f8 = jnp.bfloat16, jnp.float8_e4m3fn
    pool, table, lens = jnp.zeros((64 * 4, 192), bf), jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32)
    mask = jnp.zeros((1, 2, 2), jnp.uint32)
    kw = dict(kv_lora_rank=128, page_size=64, scale=0.1)
    with pytest.raises(ValueError, match=r"window must be in \[1, 64\].*schedules \('split', 'seesaw'\) only, got 'turns'"):
        mla_decode_mgpu(jnp.zeros((1, 2, 4, 192), bf), pool, table, lens, mask, window=65, schedule="turns", **kw)
    with pytest.raises(ValueError, match=r"needs window_mask \[B=1, R=2, 2\] uint32"):
        mla_decode_mgpu(jnp.zeros((1, 2, 4, 192), bf), pool, table, lens, mask.astype(jnp.int32), window=2, **kw)
    with pytest.raises(ValueError, match=r"needs window_mask \[B=1, R=2, 2\] uint32.*got 'together'"):
        mla_decode_mgpu(jnp.zeros((1, 2, 4, 192), f8), pool.astype(f8), table, lens, None, window=2,
                        schedule="together", **kw)
    with pytest.raises(ValueError, match=r"got 'triton'.*schedules \('split', 'seesaw'\), got 'together'.*contradicts"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, fuse_window=True,
                         prefix_kernel="triton", schedule="together", prefix_covers_tail=False)
    with pytest.raises(ValueError, match="fuse_window must be None, True or False, got 1"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, fuse_window=1)
    # "auto" may resolve to the Triton decode (as in the interpreter): fusing is refused when the
    # config is built, not silently dropped later.
    with pytest.raises(ValueError, match="needs prefix_kernel='mosaic_gpu'.*got 'auto'"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, fuse_window=True)
    # The Mosaic decode's own input checks still name what it cannot take (a 32-token page here).
    cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=32, scale=SCALE, backend="interpret",
                           prefix_kernel="mosaic_gpu", fuse_window=True)
    q = jnp.zeros((1, 2, 4, LORA + ROPE), bf)
    with pytest.raises(ValueError, match="block_k must be a multiple of 64 dividing page_size 32"):
        mla_verify_attention(q, jnp.zeros((32 * 4, LORA + ROPE), bf), table, lens, mask, config=cfg)


def fp8_window_case(seed: int, lora: int, rope: int, n: int = 16, hq: int = 4):
    """An FP8 latent cache (NaN past P + N) for two requests (P = 130, 300), a bf16 query and random
    tree masks: (q, pool, table, lengths, mask)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray([130, 300], np.int32)
    pool, _, table = poisoned_paged_pools(rng, 2, int(lengths.max()) + n, 1, lora + rope, PAGE,
                                          jnp.float8_e4m3fn, lambda bb, pos: pos < lengths[bb] + n)
    q = jnp.asarray(rng.standard_normal((2, n, hq, lora + rope)), jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, 2, n)))
    return q, pool[:, 0], table, jnp.asarray(lengths), mask


def test_fused_mla_window_over_an_fp8_cache_matches_dense(backend):
    """fuse_window=True over an FP8 latent cache: the window keys are scored as the prefix's, FP8
    query x FP8 rows, their value rows widened (unseen ones, NaN-poisoned, zeroed); no window kernel
    runs, and the output equals dense attention with the FP8-quantised query within FP8 tolerance."""
    from pallas_kernels.attention.mla_decode import quantize_query

    n = 16
    q, pool, table, lens, mask = fp8_window_case(21, LORA, ROPE, n)
    calls = []
    real = mla_module.tree_window_attention
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_module, "tree_window_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
        cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                               prefix_kernel="mosaic_gpu", fuse_window=True)
        got = mla_verify_attention(q, pool, table, lens, mask, config=cfg)
    assert not calls and got.dtype == jnp.bfloat16
    q8 = quantize_query(q, jnp.float8_e4m3fn).astype(jnp.bfloat16)  # the query both halves score with
    assert rel_err(got, dense(q8, pool.astype(jnp.bfloat16), table, lens, mask, n)) < 1e-2


@pytest.mark.parametrize("schedule", cases(["seesaw", "split"]))
def test_fp8_values_widen_in_pieces(schedule, interpret):
    """FP8 rows widen `widen_cols` value channels at a time (zeroing the fused window's unseen rows on
    the way): at latent 256 + rope 64 (a 64-channel swizzle, 128 channels per warpgroup) two pieces
    of 64 give the bits of one piece of 128, and both equal dense attention with NaN in every slot
    past P + N."""
    from pallas_kernels.attention.mla_decode import quantize_query

    lora, rope, n = 256, 64, 16
    q, pool, table, lens, mask = fp8_window_case(25, lora, rope, n)
    q8 = quantize_query(q, jnp.float8_e4m3fn)
    assert mla_mgpu_module.default_widen_cols(lora + rope, lora) == 64  # two pieces by default
    outs = [np.asarray(mla_decode_mgpu(q8, pool, table, lens, mask, kv_lora_rank=lora, page_size=PAGE, scale=SCALE,
                                       window=n, num_splits=1, schedule=schedule, widen_cols=cols,
                                       interpret=interpret)[0], np.float32)
            for cols in (64, 128)]
    assert np.isfinite(outs[0]).all()
    np.testing.assert_array_equal(outs[0], outs[1])
    ref = cascade_dense_reference(q8.astype(jnp.bfloat16), pool[:, None, :].astype(jnp.bfloat16),
                                  pool[:, None, :lora].astype(jnp.bfloat16), table, lens, mask, window=n,
                                  page_size=PAGE, scale=SCALE)[0]
    assert rel_err(outs[0], ref) < 1e-2


def test_widen_cols_refusals():
    """widen_cols must cut a warpgroup's FP8 value channels into swizzle-aligned pieces, and only FP8
    rows are widened; each refusal names the value."""
    f8, bf = jnp.float8_e4m3fn, jnp.bfloat16
    table, lens = jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,), jnp.int32)
    kw = dict(kv_lora_rank=512, page_size=64, scale=0.1)
    q, pool = jnp.zeros((1, 2, 4, 576), f8), jnp.zeros((64 * 4, 576), f8)
    for bad in (96, 192, 512, 0, True):  # DeepSeek-V3's 576-channel FP8 rows have a 64-byte swizzle
        with pytest.raises(ValueError, match=rf"widen_cols must be a multiple of 64 .*= 256, got {bad!r}"):
            mla_decode_mgpu(q, pool, table, lens, widen_cols=bad, **kw)
    with pytest.raises(ValueError, match=r"widen_cols applies to FP8 caches only.*got 128 with bfloat16"):
        mla_decode_mgpu(q.astype(bf), pool.astype(bf), table, lens, widen_cols=128, **kw)
    assert mla_mgpu_module.default_widen_cols(576, 512) == mla_mgpu_module.MLA_WIDEN_COLS == 64
    assert mla_mgpu_module.default_widen_cols(192, 128) == 64  # one piece: the half


@pytest.mark.parametrize("splits,out_dtype,dtype,widen", cases([(2, jnp.float32, jnp.bfloat16, None),
                                                                 (1, jnp.bfloat16, jnp.bfloat16, None),
                                                                 (1, jnp.bfloat16, jnp.float8_e4m3fn, None),
                                                                 (1, jnp.bfloat16, jnp.float8_e4m3fn, 256)],
                                                                default=(1,)))
def test_fused_mla_window_lowers_to_mosaic_gpu(splits, out_dtype, dtype, widen):
    """DeepSeek-V3 widths (latent 512 + rope 64, 128 heads, N = 16): layout inference and the
    shared-memory check pass with the window fused (the words are read straight from global memory),
    with float32 split partials, with the bf16 output the cascade asks for without splits, and over
    an FP8 cache (FP8 query; its values widened in the default 64-channel pieces and in one of 256)."""
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the lowering)

    sd = jax.ShapeDtypeStruct
    fn = lambda q, pool, t, ln, mk: mla_decode_mgpu(q, pool, t, ln, mk, kv_lora_rank=512, page_size=64,  # noqa: E731
                                                    scale=0.07, window=16, num_splits=splits, out_dtype=out_dtype,
                                                    widen_cols=widen)
    args = (sd((2, 16, 128, 576), dtype), sd((64 * 64, 576), dtype), sd((2, 32), jnp.int32), sd((2,), jnp.int32),
            sd((2, 16, 2), jnp.uint32))
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
    assert mla_mgpu_module.default_schedule(dtype) == "seesaw"  # the schedule the lowered kernel runs
    assert jax.eval_shape(fn, *args)[0].dtype == out_dtype


def test_fuse_window_default_resolution():
    """fuse_window=None fuses exactly where the fused kernel runs: the Mosaic latent decode (16-bit
    and FP8 caches), schedule "seesaw" or "split" (given or the default) and the prefix covering every
    row's tail; an explicit True or False wins."""
    from treespec_jax.attention.mla import fuses_window

    base = dict(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE)
    auto = MlaCascadeConfig(**base)
    assert auto.fuse_window is None
    assert fuses_window(auto, True, jnp.bfloat16) and fuses_window(auto, True, jnp.float16)
    assert not fuses_window(auto, False, jnp.bfloat16)  # the Triton decode
    assert fuses_window(auto, True, jnp.float8_e4m3fn)  # FP8 fuses too (results: mla-fuse-window)
    assert fuses_window(MlaCascadeConfig(**base, schedule="split"), True, jnp.bfloat16)
    assert fuses_window(MlaCascadeConfig(**base, schedule="seesaw"), True, jnp.bfloat16)
    for schedule in ("turns", "together"):
        assert not fuses_window(MlaCascadeConfig(**base, schedule=schedule), True, jnp.bfloat16)
    assert not fuses_window(MlaCascadeConfig(**base, prefix_covers_tail=False), True, jnp.bfloat16)
    assert fuses_window(MlaCascadeConfig(**base, prefix_covers_tail=True), True, jnp.bfloat16)
    assert not fuses_window(MlaCascadeConfig(**base, fuse_window=False), True, jnp.bfloat16)
    assert not fuses_window(MlaCascadeConfig(**base, fuse_window=False), True, jnp.float8_e4m3fn)
