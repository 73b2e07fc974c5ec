"""MLA latent prefix decode and the MLA cascade (CPU, Pallas interpret mode, fp32 references).

Shapes are DeepSeek-V3's scaled down (8 heads, latent 64, rope 16; the GPU suite runs 128/512/64).
Every slot a row may not read (past P for the decode; past the written window, and window slots
outside the row's mask, for the cascade) holds NaN or inf, and the kernels' outputs start as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import TF32_LSE_TOL, attention_triton_calls, fp32_tol
from tiers import cases

from pallas_kernels.attention.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_reference
from pallas_kernels.attention.reference import cascade_dense_reference
from treespec_jax.attention.mla import MlaCascadeConfig, mla_lane_attention, mla_verify_attention
from treespec_jax.cache.pools import disjoint_page_table
from treespec_jax.tree.masks import ancestor_mask, pack_mask_rows

H, LORA, ROPE, PAGE = 8, 64, 16, 16
SCALE = 0.11
FP8 = jnp.float8_e4m3fn


def make_pool(rng, table: np.ndarray, readable: np.ndarray, dtype, num_slots: int) -> jax.Array:
    """Latent pool with random rows at the readable positions of each request, poison elsewhere.

    `table [B, maxp]`, `readable [B, maxp * PAGE] bool` (positions whose slot holds real data).
    """
    pool = np.where(rng.random((num_slots, LORA + ROPE)) < 0.5, np.nan, np.inf).astype(np.float32)
    for b in range(table.shape[0]):
        pos = np.nonzero(readable[b])[0]
        slots = table[b, pos // PAGE] * PAGE + pos % PAGE
        pool[slots] = rng.standard_normal((len(pos), LORA + ROPE))
    return jnp.asarray(pool).astype(dtype)


def numpy_decode(q, pool, table, plen, scale):
    """Independent per-row float64 softmax over each row's visible keys (value = leading channels)."""
    q = np.asarray(q.astype(jnp.float32), np.float64)
    pool = np.asarray(pool.astype(jnp.float32), np.float64)
    b_, r_, h_, _ = q.shape
    out = np.zeros((b_, r_, h_, LORA))
    lse = np.full((b_, r_, h_), -np.inf)
    for b in range(b_):
        for r in range(r_):
            n = max(0, plen[b] - r_ + 1 + r)
            if n == 0:
                continue
            pos = np.arange(n)
            rows = pool[table[b, pos // PAGE] * PAGE + pos % PAGE]
            s = q[b, r] @ rows.T * scale  # [H, n]
            m = s.max(-1, keepdims=True)
            w = np.exp(s - m)
            out[b, r] = (w @ rows[:, :LORA]) / w.sum(-1, keepdims=True)
            lse[b, r] = (m[:, 0] + np.log(w.sum(-1))) / np.log(2)
    return out, lse


@pytest.mark.parametrize("dtype,config", [
    (jnp.bfloat16, MlaDecodeConfig(block_q=16, block_k=16, num_splits=1)),
    (jnp.bfloat16, MlaDecodeConfig(block_q=32, block_k=16, num_splits=3)),
    (FP8, MlaDecodeConfig(block_q=32, block_k=16, num_splits=2, fp8_score_dot=True)),
    (FP8, MlaDecodeConfig(block_q=16, block_k=16, num_splits=1, fp8_score_dot=False)),
    # Unmasked leading blocks with page ids read one block ahead (split and unsplit).
    (jnp.bfloat16, MlaDecodeConfig(block_q=16, block_k=16, num_splits=2, prefetch_page_ids=True)),
    (FP8, MlaDecodeConfig(block_q=32, block_k=16, num_splits=1, fp8_score_dot=True, prefetch_page_ids=True)),
])
def test_mla_decode_matches_reference(dtype, config, backend):
    rng = np.random.default_rng(3)
    b, r, maxp = 4, 4, 4
    plen = np.array([0, 2, 37, 64], np.int32)  # P = 0, P < R, ragged, a full table
    table = disjoint_page_table(int(rng.integers(1 << 30)), b, maxp, b * maxp + 2)
    readable = np.arange(maxp * PAGE)[None, :] < plen[:, None]
    pool = make_pool(rng, table, readable, dtype, (b * maxp + 2) * PAGE)
    q = jnp.asarray(rng.standard_normal((b, r, H, LORA + ROPE))).astype(jnp.bfloat16)
    out, lse = mla_decode(q, pool, jnp.asarray(table), jnp.asarray(plen), kv_lora_rank=LORA, page_size=PAGE,
                          scale=SCALE, backend=backend, config=config, poison_outputs=True)
    ref_out, ref_lse = mla_decode_reference(q, pool, jnp.asarray(table), jnp.asarray(plen), kv_lora_rank=LORA,
                                            page_size=PAGE, scale=SCALE)
    assert out.shape == (b, r, H, LORA) and lse.shape == (b, r, H) and out.dtype == jnp.float32
    assert rel_err(out, ref_out) < 1e-2
    empty = np.asarray(ref_lse) == -np.inf
    assert empty[0].all() and empty[1, :2].all() and not empty[1, 2:].any()  # P - R + 1 + r <= 0 rows
    np.testing.assert_array_equal(np.asarray(lse) == -np.inf, empty)
    np.testing.assert_allclose(np.asarray(lse)[~empty], np.asarray(ref_lse)[~empty], atol=2e-2)
    np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)


def test_mla_decode_without_rope_channels(backend):
    """rope_dim = 0 (kv_lora_rank = every channel), fp32 cache: the rope term drops out."""
    rng = np.random.default_rng(13)
    b, r, maxp = 2, 2, 2
    plen = np.array([5, 30], np.int32)
    table = disjoint_page_table(4, b, maxp, 5)
    pool = np.full((5 * PAGE, LORA), np.nan, np.float32)
    for i in range(b):
        pos = np.arange(plen[i])
        pool[table[i, pos // PAGE] * PAGE + pos % PAGE] = rng.standard_normal((plen[i], LORA))
    pool = jnp.asarray(pool)
    q = jnp.asarray(rng.standard_normal((b, r, H, LORA)), jnp.float32)
    args = (q, pool, jnp.asarray(table), jnp.asarray(plen))
    out, lse = mla_decode(*args, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE, backend=backend,
                          poison_outputs=True)
    ref_out, ref_lse = mla_decode_reference(*args, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE)
    assert rel_err(out, ref_out) < fp32_tol(backend, 1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=fp32_tol(backend, 1e-4, TF32_LSE_TOL))


def test_mla_decode_reference_matches_numpy_loop():
    rng = np.random.default_rng(4)
    b, r, maxp = 3, 3, 3
    plen = np.array([1, 20, 48], np.int32)
    table = disjoint_page_table(9, b, maxp, 10)
    pool = make_pool(rng, table, np.arange(maxp * PAGE)[None, :] < plen[:, None], jnp.float32, 10 * PAGE)
    q = jnp.asarray(rng.standard_normal((b, r, H, LORA + ROPE)), jnp.float32)
    out, lse = mla_decode_reference(q, pool, jnp.asarray(table), jnp.asarray(plen), kv_lora_rank=LORA,
                                    page_size=PAGE, scale=SCALE)
    ref_out, ref_lse = numpy_decode(q, pool, table, plen, SCALE)
    assert rel_err(out, ref_out) < 1e-5
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=1e-4)


def random_tree_masks(rng, b: int, n: int) -> jax.Array:
    parents = np.full((b, n), -1, np.int32)
    for i in range(1, n):
        parents[:, i] = rng.integers(0, i, size=b)
    return ancestor_mask(jnp.asarray(parents))


def lane_masks(rng, b: int, k: int, step: int) -> jax.Array:
    """Masks of the K lanes chosen at draft step `step` (seed lanes are step 0): parent | own bit."""
    bits = np.zeros((b, k, 64), bool)
    bits[:, np.arange(k), np.arange(k)] = True
    for s in range(1, step + 1):
        parent = rng.integers(0, k, size=(b, k))
        new = np.take_along_axis(bits, parent[:, :, None], axis=1).copy()
        new[:, np.arange(k), s * k + np.arange(k)] = True
        bits = new
    return pack_mask_rows(jnp.asarray(bits))


def dense_mla(q, pool, table, plen, mask, window):
    """One dense fp32 attention over the gathered latent rows (value = leading channels)."""
    qf = q.astype(jnp.float32) if q.dtype != FP8 else q.astype(jnp.float32)
    return cascade_dense_reference(qf, pool[:, None, :], pool[:, None, :LORA], jnp.asarray(table),
                                   jnp.asarray(plen), mask, window=window, page_size=PAGE, scale=SCALE)[0]


@pytest.mark.parametrize("dtype,covers_tail", [(jnp.bfloat16, False), (FP8, False), (jnp.bfloat16, True)])
def test_mla_cascade_verify_matches_dense(dtype, covers_tail, backend):
    rng = np.random.default_rng(5 if dtype == jnp.bfloat16 else 6)
    b, n, maxp = 3, 8, 4
    plen = np.array([0, 3, 45], np.int32)  # P = 0, P < N, a window crossing a page
    table = disjoint_page_table(int(rng.integers(1 << 30)), b, maxp, b * maxp + 1)
    readable = np.arange(maxp * PAGE)[None, :] < (plen + n)[:, None]  # prefix + the written window
    pool = make_pool(rng, table, readable, dtype, (b * maxp + 1) * PAGE)
    q = jnp.asarray(rng.standard_normal((b, n, H, LORA + ROPE))).astype(jnp.bfloat16)
    mask = random_tree_masks(rng, b, n)
    config = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                              decode=MlaDecodeConfig(block_q=32, block_k=16, num_splits=2),
                              prefix_covers_tail=covers_tail)
    out = mla_verify_attention(q, pool, jnp.asarray(table), jnp.asarray(plen), mask, config=config)
    assert out.shape == (b, n, H, LORA) and out.dtype == jnp.bfloat16
    # Under an FP8 cache both halves score the FP8-quantised query: that is the exact target.
    q_eff = q.astype(FP8) if dtype == FP8 else q
    ref = dense_mla(q_eff, pool, table, plen, mask, n)
    assert rel_err(out.astype(jnp.float32), ref) < 1e-2
    if dtype == FP8:
        # A prologue that already returns the FP8 query gives the very same result.
        out8 = mla_verify_attention(q.astype(FP8), pool, jnp.asarray(table), jnp.asarray(plen), mask, config=config)
        np.testing.assert_array_equal(np.asarray(out8.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))


def test_mla_cascade_lanes_match_dense(backend):
    """Draft lanes mid-round: K = 2 lanes at step 1 over a 6-key lane window whose last 2 slots are
    not written yet (poisoned)."""
    rng = np.random.default_rng(8)
    b, k, steps, maxp = 2, 2, 4, 4
    window = (steps - 1) * k
    frontier = np.array([9, 30], np.int32)
    table = disjoint_page_table(21, b, maxp, b * maxp)
    written = frontier + 2 * k  # lanes of steps 0 and 1
    readable = np.arange(maxp * PAGE)[None, :] < written[:, None]
    pool = make_pool(rng, table, readable, jnp.bfloat16, b * maxp * PAGE)
    q = jnp.asarray(rng.standard_normal((b, k, H, LORA + ROPE))).astype(jnp.bfloat16)
    mask = lane_masks(rng, b, k, step=1)
    config = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend=backend,
                              decode=MlaDecodeConfig(block_q=16, block_k=16))
    out = mla_lane_attention(q, pool, jnp.asarray(table), jnp.asarray(frontier), mask, steps=steps, config=config)
    ref = dense_mla(q, pool, table, frontier, mask, window)
    assert rel_err(out.astype(jnp.float32), ref) < 1e-2


# "auto" (the default) takes the Mosaic GPU latent decode on a GPU (16-bit and FP8 caches) and the
# tree window with it (fuse_window=None), so no Triton kernel is left; "triton" runs the Triton
# decode and the Triton window kernel.
@pytest.mark.parametrize("dtype,kernel,triton_calls", cases([(jnp.bfloat16, "triton", 2), (FP8, "triton", 2),
                                                             (jnp.bfloat16, "auto", 0), (FP8, "auto", 0)],
                                                            default=(1, 2)))
def test_mla_kernels_lower_to_triton_for_sm90(monkeypatch, dtype, kernel, triton_calls):
    """DeepSeek-V3 shapes lower Pallas -> Triton IR / Mosaic GPU (the GPU suite compiles and runs them)."""
    import jax._src.pallas.triton.pallas_call_registration as reg
    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    b, n, hq, lora, rope, page, maxp = 4, 16, 128, 512, 64, 64, 8
    import jax._src.pallas.mosaic_gpu.pallas_call_registration  # noqa: F401  (registers the Mosaic lowering)

    config = MlaCascadeConfig(kv_lora_rank=lora, rope_dim=rope, page_size=page, scale=0.07,
                              decode=MlaDecodeConfig(fp8_score_dot=True, prefetch_page_ids=dtype == FP8),
                              prefix_kernel=kernel)
    args = (jax.ShapeDtypeStruct((b, n, hq, lora + rope), jnp.bfloat16),
            jax.ShapeDtypeStruct((b * maxp * page, lora + rope), dtype),
            jax.ShapeDtypeStruct((b, maxp), jnp.int32), jax.ShapeDtypeStruct((b,), jnp.int32),
            jax.ShapeDtypeStruct((b, n, 2), jnp.uint32))
    text = jax.jit(lambda *a: mla_verify_attention(*a, config=config)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    assert attention_triton_calls(text) == triton_calls
    assert ("mosaic_gpu" in text) == (kernel == "auto")


def test_fp8_query_quantisation_survives_jit():
    """Under jit, q -> FP8 -> wider must still round (XLA may drop a narrow/widen convert pair)."""
    from pallas_kernels.attention.mla_decode import quantize_query
    from treespec_jax.attention.mla import quantize_absorbed_query

    q = jnp.asarray(np.random.default_rng(1).standard_normal((4, 64)), jnp.float32)
    expect = np.asarray(q.astype(FP8).astype(jnp.float32))  # eager: one op at a time
    assert not np.array_equal(expect, np.asarray(q))
    got = jax.jit(lambda x: quantize_query(x, FP8).astype(jnp.float32))(q)
    np.testing.assert_array_equal(np.asarray(got), expect)
    got = jax.jit(lambda x: quantize_absorbed_query(x, FP8).astype(jnp.bfloat16).astype(jnp.float32))(q)
    np.testing.assert_array_equal(np.asarray(got), expect)


def test_fp8_queries_saturate_at_448():
    """Both FP8 query casts (GQA's `quantize_query_for_pool`, MLA's `quantize_query`) saturate at
    +-448 as the GPU's satfinite convert does (a kernel casting q itself gives the same bits), where a
    plain cast turns |q| > 464 into NaN; NaN stays NaN and in-range values round as before."""
    from pallas_kernels.attention.mla_decode import quantize_query
    from pallas_kernels.attention.reference import quantize_query_for_pool

    q = jnp.asarray([[500.0, -1000.0, 448.0, 100.3, -0.7, jnp.nan, 3e4, -465.0]], jnp.bfloat16)
    assert np.isnan(np.asarray(q[:, :2].astype(FP8).astype(jnp.float32))).all()  # the plain cast: NaN
    expect = [448.0, -448.0, 448.0, float(jnp.asarray(100.3, jnp.bfloat16).astype(FP8).astype(jnp.float32)),
              float(jnp.asarray(-0.7, jnp.bfloat16).astype(FP8).astype(jnp.float32)), np.nan, 448.0, -448.0]
    for cast in (quantize_query_for_pool, quantize_query):
        got = jax.jit(lambda x: cast(x, FP8).astype(jnp.float32))(q)
        np.testing.assert_array_equal(np.asarray(got)[0], np.asarray(expect, np.float32))


def test_mla_rejects_bad_input():
    q = jnp.ones((1, 2, H, LORA + ROPE), jnp.bfloat16)
    pool = jnp.ones((64, LORA + ROPE), jnp.bfloat16)
    table = jnp.zeros((1, 4), jnp.int32)
    plen = jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match=r"latent_pool must be \[S, 80\]"):
        mla_decode(q, pool[:, :LORA], table, plen, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE)
    with pytest.raises(ValueError, match="kv_lora_rank 96"):
        mla_decode(q, pool, table, plen, kv_lora_rank=96, page_size=PAGE, scale=SCALE)
    with pytest.raises(ValueError, match="page_table must be"):
        mla_decode(q, pool, table.astype(jnp.float32), plen, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE)
    with pytest.raises(ValueError, match="block_q must be a power of two >= 16, got 24"):
        MlaDecodeConfig(block_q=24)
    with pytest.raises(ValueError, match="num_splits must be >= 1, got 0"):
        MlaDecodeConfig(num_splits=0)
    with pytest.raises(ValueError, match="num_warps"):
        MlaDecodeConfig(num_warps=3)
    # Default key step: a 64-key page step for 16-bit caches, 32 for FP8, never past a page.
    assert MlaDecodeConfig().key_block(jnp.bfloat16, 64) == 64
    assert MlaDecodeConfig().key_block(FP8, 64) == 32
    assert MlaDecodeConfig().key_block(jnp.bfloat16, 16) == 16
    with pytest.raises(ValueError, match="rope_dim must be a power of two >= 16, got 12"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=12, page_size=PAGE, scale=SCALE)
    config = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE)
    with pytest.raises(ValueError, match="N=65"):
        mla_verify_attention(jnp.ones((1, 65, H, LORA + ROPE)), pool, table, plen,
                             jnp.zeros((1, 65, 2), jnp.uint32), config=config)
    lane_mask = jnp.zeros((1, 2, 2), jnp.uint32)
    with pytest.raises(ValueError, match="mla_lane_attention: .*steps must be >= 2, got 1"):
        mla_lane_attention(q, pool, table, plen, lane_mask, steps=1, config=config)
    with pytest.raises(ValueError, match=r"mla_lane_attention: lane window \(steps-1\)\*K = 66 exceeds 64"):
        mla_lane_attention(q, pool, table, plen, lane_mask, steps=34, config=config)
