"""Residual add + RMSNorm kernel (`pallas_kernels.rms_norm`) against a float64 numpy norm, and the
model's forward with the kernel against the same forward left to XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numerics import rel_err
from pallas_kernels.rms_norm import add_rms_norm, add_rms_norm_reference
from treespec_jax.models.llama import NORM_KERNELS, LlamaModel, init_params, norm_backend, rms_norm


def numpy_add_rms_norm(x, delta, weight, eps):
    """float64 model: (x + delta, (x + delta) / rms * weight)."""
    s = np.asarray(x, np.float64) + (0.0 if delta is None else np.asarray(delta, np.float64))
    return s, s / np.sqrt(np.mean(s * s, axis=-1, keepdims=True) + eps) * np.asarray(weight, np.float64)


@pytest.mark.parametrize("shape", [(3, 576), (2, 5, 64), (1, 1000), (7, 4096)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_matches_float64(backend, shape, dtype, with_delta):
    rng = np.random.default_rng(hash((shape, str(dtype), with_delta)) % 2**32)
    x = jnp.asarray(rng.standard_normal(shape) * 3.0, dtype)
    delta = jnp.asarray(rng.standard_normal(shape), dtype) if with_delta else None
    weight = jnp.asarray(1.0 + 0.3 * rng.standard_normal(shape[-1:]), dtype)
    eps = 1e-5
    s, y = add_rms_norm(x, delta, weight, eps, backend=backend)
    assert s.shape == y.shape == x.shape and s.dtype == y.dtype == x.dtype
    s64, y64 = numpy_add_rms_norm(x, delta, weight, eps)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2
    assert rel_err(s, s64) < tol
    assert rel_err(y, y64) < tol
    # The model's rounding exactly: the reference is `rms_norm` of the sum rounded to x's dtype.
    ref_s, ref_y = add_rms_norm_reference(x, delta, weight, eps)
    np.testing.assert_array_equal(np.asarray(ref_y, np.float32), np.asarray(rms_norm(ref_s, weight, eps), np.float32))
    assert rel_err(y, ref_y) < (1e-6 if dtype == jnp.float32 else 8e-3)


def test_add_rms_norm_reads_only_its_row(backend):
    # Rows past H in the power-of-two tile are masked: a row whose neighbour (the next row's start,
    # which a 1000-wide row's 1024-tile would reach) is huge or NaN must come out unchanged.
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 1000)).astype(np.float32)
    poisoned = x.copy()
    poisoned[1::2] = np.nan  # rows 1 and 3: every other row poisoned
    weight = jnp.asarray(1.0 + 0.1 * rng.standard_normal(1000), jnp.float32)
    _, clean = add_rms_norm(jnp.asarray(x[0::2]), None, weight, 1e-6, backend=backend)
    _, mixed = add_rms_norm(jnp.asarray(poisoned), None, weight, 1e-6, backend=backend)
    np.testing.assert_array_equal(np.asarray(mixed)[0::2], np.asarray(clean))


def test_add_rms_norm_refuses_mismatched_inputs():
    x = jnp.ones((2, 8), jnp.bfloat16) * 0.5
    with pytest.raises(ValueError, match=r"weight must be \[H\] = \(8,\)"):
        add_rms_norm(x, None, jnp.ones((9,), jnp.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="delta must match x"):
        add_rms_norm(x, jnp.ones((2, 8), jnp.float32), jnp.ones((8,), jnp.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="float array"):
        add_rms_norm(jnp.ones((2, 8), jnp.int32), None, jnp.ones((8,), jnp.int32), 1e-5)


def test_norm_kernel_choice_is_checked(tiny_llama):
    from treespec_jax.config import NORM_KERNELS as CONFIGURED
    from treespec_jax.models.attention import PagedAttention

    assert CONFIGURED == NORM_KERNELS
    attention = PagedAttention(16, kind="dense")
    assert norm_backend("xla", attention) == "reference"
    assert norm_backend("pallas", attention) == "pallas"
    # Off the GPU "auto" leaves the norms to XLA (the kernel would run interpreted).
    assert norm_backend("auto", attention) == ("pallas" if jax.default_backend() == "gpu" else "reference")
    with pytest.raises(ValueError, match="'fused'"):
        LlamaModel(tiny_llama[0], attention, (), norm_kernel="fused")


def test_forward_with_the_norm_kernel_equals_xla(tiny_llama):
    # The deferred residual adds (each layer adds its predecessor's MLP output inside its first
    # norm) and the kernel itself: logits and the captured features of a prefill and a decode step.
    from treespec_jax.models.attention import PagedAttention

    cfg, params = tiny_llama
    attention = PagedAttention(8, kind="dense")
    layers = (0, 1, cfg.num_layers)
    models = {k: LlamaModel(cfg, attention, layers, norm_kernel=k) for k in ("xla", "pallas")}
    pages = 4
    table = jnp.arange(1, 1 + pages, dtype=jnp.int32)[None]
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, 11)), jnp.int32)
    out = {}
    for kind, model in models.items():
        # Slots the step must not read hold large garbage (the same in both runs).
        pools = {n: jnp.asarray(1e4 * np.random.default_rng(5).standard_normal(
                     ((pages + 1) * 8, cfg.num_kv_heads, cfg.head_dim)), jnp.float32)
                 for i in range(cfg.num_layers) for n in (f"k{i}", f"v{i}")}
        logits, feats, pools = model.prefill(params, pools, tokens[:, :10], table, jnp.zeros((1,), jnp.int32),
                                             jnp.full((1,), 10, jnp.int32))
        step_logits, step_feats, _ = model.decode(params, pools, tokens[:, 10], table, jnp.full((1,), 10, jnp.int32))
        out[kind] = (logits, feats, step_logits, step_feats)
    for got, want in zip(out["pallas"], out["xla"]):
        assert rel_err(got, want) < 1e-5


@pytest.fixture
def tiny_llama():
    from treespec_jax.models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=12, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False)
    return cfg, init_params(cfg, jax.random.PRNGKey(11), dtype="fp32")
