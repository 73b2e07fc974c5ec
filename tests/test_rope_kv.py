"""RoPE + K/V write kernel (`pallas_kernels.rope_kv`) against the model's XLA path, and the
model's forward with the kernel against the same forward without it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import rel_err
from pallas_kernels.rope_kv import kernel_problems, rope_write_kv, rope_write_kv_reference
from treespec_jax.models.attention import NO_SLOT, write_kv
from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.llama import LlamaModel, apply_rope, fuse_projections, init_params, rope_inv_freq, split_qkv


def _inputs(rng, b, t, hkv, rep, d, dtype, pool_dtype, slots_in_pool=48):
    qkv = jnp.asarray(rng.standard_normal((b, t, hkv * (rep + 2) * d)) * 2.0, dtype)
    positions = jnp.asarray(rng.integers(0, 8000, (b, t)), jnp.int32)
    slots = rng.permutation(slots_in_pool)[:b * t].reshape(b, t).astype(np.int32)
    if b * t > 1:
        slots[0, -1] = NO_SLOT  # a padding row: writes nothing
    # Every pool row starts as NaN: a row the kernel writes must hold finite values, and a row it
    # must not write stays NaN (compared bit for bit).
    pools = [jnp.full((slots_in_pool, hkv, d), jnp.nan, pool_dtype) for _ in range(2)]
    return qkv, positions, jnp.asarray(slots), pools


@pytest.mark.parametrize("b,t,hkv,rep,d", [(2, 3, 3, 3, 64), (1, 1, 8, 4, 128), (3, 5, 2, 1, 16)])
@pytest.mark.parametrize("dtype,pool_dtype", [(jnp.bfloat16, jnp.bfloat16), (jnp.float32, jnp.float32),
                                              (jnp.float32, jnp.bfloat16)])
def test_rope_write_kv_matches_the_xla_path(backend, b, t, hkv, rep, d, dtype, pool_dtype):
    rng = np.random.default_rng(b * 100 + t * 10 + d)
    qkv, positions, slots, (k_pool, v_pool) = _inputs(rng, b, t, hkv, rep, d, dtype, pool_dtype)
    inv_freq = rope_inv_freq(d, 1e4, None)
    q, k_out, v_out = rope_write_kv(qkv, positions, slots, k_pool, v_pool, inv_freq, backend=backend)
    # The model's XLA path, written out: split, rotate-half RoPE, scatter with NO_SLOT dropped.
    cfg = LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=hkv * rep,
                      num_kv_heads=hkv, head_dim=d)
    rq, rk, rv = split_qkv(qkv, cfg)
    want_q = apply_rope(rq, positions, inv_freq)
    want_k, want_v = write_kv(k_pool, v_pool, apply_rope(rk, positions, inv_freq), rv, slots)
    ref = rope_write_kv_reference(qkv, positions, slots, k_pool, v_pool, inv_freq)
    for got, want, via_ref in zip((q, k_out, v_out), (want_q, want_k, want_v), ref):
        np.testing.assert_array_equal(np.asarray(via_ref, np.float32), np.asarray(want, np.float32))
        written = np.isfinite(np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.isfinite(np.asarray(got, np.float32)), written)
        assert rel_err(np.asarray(got, np.float32)[written], np.asarray(want, np.float32)[written]) < (
            1e-6 if dtype == jnp.float32 and pool_dtype == jnp.float32 else 8e-3)
    # Untouched pool rows are the NaN they were: the padding row and every slot no token owns.
    owned = np.asarray(slots).reshape(-1)
    untouched = np.setdiff1d(np.arange(k_pool.shape[0]), owned[owned != NO_SLOT])
    assert np.isnan(np.asarray(k_out, np.float32)[untouched]).all()
    assert np.isnan(np.asarray(v_out, np.float32)[untouched]).all()


def test_kernel_problems_name_the_values():
    assert kernel_problems(6 * 2 * 64, 2, 64, jnp.bfloat16) == []
    assert "head_dim 96" in " ".join(kernel_problems(6 * 2 * 96, 2, 96, jnp.bfloat16))
    assert "pool dtype float8_e4m3fn" in " ".join(kernel_problems(6 * 2 * 64, 2, 64, jnp.float8_e4m3fn))
    assert "qkv width 100" in " ".join(kernel_problems(100, 2, 64, jnp.bfloat16))
    with pytest.raises(ValueError, match="head_dim 96 is not a power of two"):
        rope_write_kv(jnp.ones((1, 1, 6 * 96)), jnp.zeros((1, 1), jnp.int32), jnp.zeros((1, 1), jnp.int32),
                      jnp.ones((4, 1, 96)), jnp.ones((4, 1, 96)), np.ones(48, np.float32))


def test_forward_with_the_rope_kernel_equals_xla():
    # The served (fused) layout: prefill, then a decode step, with the kernel (interpreted) and
    # without; logits, features and the pools the step leaves.
    from treespec_jax.models.attention import PagedAttention

    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=6,
                      num_kv_heads=2, head_dim=16, rope_theta=1e4, tie_word_embeddings=False)
    params = fuse_projections(init_params(cfg, jax.random.PRNGKey(4), dtype="fp32"), cfg)
    attention = PagedAttention(8, kind="dense")
    pages = 4
    table = jnp.arange(1, 1 + pages, dtype=jnp.int32)[None]
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 11)), jnp.int32)
    out = {}
    for kind in ("xla", "pallas"):
        model = LlamaModel(cfg, attention, (0, cfg.num_layers), rope_kernel=kind)
        pools = {n: jnp.asarray(np.random.default_rng(2).standard_normal(((pages + 1) * 8, 2, 16)), jnp.float32)
                 for i in range(cfg.num_layers) for n in (f"k{i}", f"v{i}")}
        logits, feats, pools = model.prefill(params, pools, tokens[:, :10], table, jnp.zeros((1,), jnp.int32),
                                             jnp.full((1,), 10, jnp.int32))
        step_logits, step_feats, pools = model.decode(params, pools, tokens[:, 10], table,
                                                      jnp.full((1,), 10, jnp.int32))
        out[kind] = (logits, feats, step_logits, step_feats, pools["k1"], pools["v1"])
    for got, want in zip(out["pallas"], out["xla"]):
        assert rel_err(got, want) < 1e-5


def test_rope_kernel_choice_is_resolved():
    from treespec_jax.config import ROPE_KERNELS as CONFIGURED
    from treespec_jax.models.attention import PagedAttention
    from treespec_jax.models.llama import ROPE_KERNELS, rope_backend

    assert CONFIGURED == ROPE_KERNELS
    attention = PagedAttention(16, kind="dense")
    assert rope_backend("xla", attention) == "xla"
    assert rope_backend("pallas", attention) == "pallas"
    # Off the GPU "auto" leaves RoPE and the write to XLA (the kernel would run interpreted).
    assert rope_backend("auto", attention) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    with pytest.raises(ValueError, match="'fused'"):
        rope_backend("fused", attention)


def test_rope_kernel_with_tensor_parallelism_is_refused():
    from treespec_jax.config import BackendsConfig, ParallelConfig, ServeConfig

    problems = ServeConfig(backends=BackendsConfig(rope_kernel="pallas"), parallel=ParallelConfig(tp_size=2)).problems()
    assert any("backends.rope_kernel = 'pallas'" in p and "tp_size 1, got 2" in p for p in problems), problems
    # "auto" (the default) resolves to XLA's path under a mesh instead of refusing.
    problems = ServeConfig(parallel=ParallelConfig(tp_size=2)).problems()
    assert not any("rope_kernel" in p for p in problems), problems
    with pytest.raises(ValueError, match="'fused'"):
        LlamaModel(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                               num_kv_heads=1, head_dim=8), None, (), rope_kernel="fused")
