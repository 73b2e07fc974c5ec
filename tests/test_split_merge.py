"""The LSE merge of key-split partials (`split_merge.merge_splits`): the Pallas kernel in interpret
mode and the XLA reference against a numpy merge, empty splits and unseen rows, output dtypes,
refusals, and the compiled kernel's Triton lowering (the GPU runs it in benchmarks/)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

from pallas_kernels.attention import split_merge
from pallas_kernels.attention.split_merge import MergeConfig, default_config, head_io_rows, merge_splits, rows_per_program


def numpy_merge(out, lse):
    """out [S, rows, D], lse [S, rows] (base 2) -> merged [rows, D], lse [rows], in float64."""
    lse = lse.astype(np.float64)
    m = np.max(lse, 0)
    m = np.where(np.isneginf(m), 0.0, m)
    w = np.exp2(lse - m)
    total = w.sum(0)
    merged = np.where(total[:, None] > 0, (w[..., None] * out).sum(0) / np.where(total > 0, total, 1)[:, None], 0)
    return merged, np.where(total > 0, m + np.log2(np.where(total > 0, total, 1)), -np.inf)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("splits,lead,rows,d,axis,out_dtype", [
    (3, 1, 40, 16, 0, jnp.float32),  # S not a power of two; 40 rows: 8-row programs
    (8, 1, 64, 32, 0, jnp.bfloat16),  # the bf16 cascade output written by the merge
    (2, 3, 12, 64, 1, jnp.float32),  # splits on axis 1 behind a leading axis (the Triton MLA layout)
    (5, 1, 6, 8, 0, jnp.float16),
])
def test_merge_matches_numpy(backend, splits, lead, rows, d, axis, out_dtype):
    rng = np.random.default_rng(splits * rows + d)
    out = rng.standard_normal((lead, splits, rows, d)).astype(np.float32)
    lse = (rng.standard_normal((lead, splits, rows)) * 6).astype(np.float32)
    lse[:, 1, 0] = -np.inf  # a split that saw no key of row 0
    lse[:, :, rows - 1] = -np.inf  # a row no split saw
    expect = [numpy_merge(out[a], lse[a]) for a in range(lead)]
    if axis == 0:
        args = (jnp.asarray(out[0]), jnp.asarray(lse[0]))
    else:
        args = (jnp.asarray(out), jnp.asarray(lse))
    merged, mlse = merge_splits(*args, axis=axis, out_dtype=out_dtype, backend=backend)
    assert merged.dtype == out_dtype and mlse.dtype == jnp.float32
    merged, mlse = (merged[None], mlse[None]) if axis == 0 else (merged, mlse)
    assert merged.shape == (lead, rows, d) and mlse.shape == (lead, rows)
    tol = 1e-6 if out_dtype == jnp.float32 else 1e-2
    for a, (e_out, e_lse) in enumerate(expect):
        got = np.asarray(merged[a], np.float32)
        assert not np.isnan(got).any()
        assert rel_err(got, e_out) < tol
        assert np.all(got[rows - 1] == 0) and np.isneginf(np.asarray(mlse[a, rows - 1]))
        np.testing.assert_allclose(np.asarray(mlse[a, :rows - 1]), e_lse[:rows - 1], rtol=1e-5, atol=1e-5)


def test_kernel_equals_reference_on_bf16_partials():
    """16-bit partials are widened to float32 before the weighted sum, as the reference does."""
    rng = np.random.default_rng(5)
    out = jnp.asarray(rng.standard_normal((4, 2, 8, 16)), jnp.bfloat16)
    lse = jnp.asarray(rng.standard_normal((4, 2, 8)) * 3, jnp.float32)
    got, glse = merge_splits(out, lse, backend="interpret")
    ref, rlse = merge_splits(out, lse, backend="reference")
    assert rel_err(got, ref) < 1e-6 and rel_err(glse, rlse) < 1e-6


@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("splits,group,r,hq,d,elements,out_dtype", [
    (3, 4, 32, 8, 32, 2048, jnp.float32),  # two 16-row tiles per KV head, one D chunk
    (2, 8, 16, 16, 64, 1024, jnp.bfloat16),  # 8-row boxes, four 16-wide D chunks, bf16 out
    (4, 1, 64, 2, 16, 2048, jnp.float32),  # G = 1: 64-row boxes of one head
])
def test_heads_layout_merge_matches_numpy(backend, splits, group, r, hq, d, elements, out_dtype):
    """heads_group: out in head layout [S, B, R, Hq, D], lse in the fused Mosaic prefix's kernel-row
    order; the merge reads that order itself and returns both in head layout."""
    rng = np.random.default_rng(splits * group + d)
    b = 2
    out = rng.standard_normal((splits, b, r, hq, d)).astype(np.float32)
    lse = (rng.standard_normal((splits, b, r, hq)) * 6).astype(np.float32)
    lse[1, 0, 0, 0] = -np.inf  # a split that saw no key of one row
    lse[:, 1, r - 1, hq - 1] = -np.inf  # a row no split saw
    rows = b * r * hq
    e_out, e_lse = numpy_merge(out.reshape(splits, rows, d), lse.reshape(splits, rows))
    merged, mlse = merge_splits(jnp.asarray(out), head_io_rows(jnp.asarray(lse), group), out_dtype=out_dtype,
                                backend=backend, heads_group=group,
                                config=MergeConfig(elements_per_program=elements))
    assert merged.shape == (b, r, hq, d) and merged.dtype == out_dtype and mlse.shape == (b, r, hq)
    got = np.asarray(merged, np.float32).reshape(rows, d)
    assert not np.isnan(got).any()
    assert rel_err(got, e_out) < (1e-6 if out_dtype == jnp.float32 else 1e-2)
    assert np.all(got[rows - 1] == 0) and np.isneginf(np.asarray(mlse)[1, r - 1, hq - 1])
    np.testing.assert_allclose(np.asarray(mlse).reshape(rows)[:-1], e_lse[:-1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["interpret", "reference"])
@pytest.mark.parametrize("splits,tiles,rows,kept,out_dtype", [
    (4, (1, 8), 64, 4, jnp.bfloat16),  # the 8B plain step: 4 real rows of a 64-row tile per KV head
    (3, (2, 3), 16, 8, jnp.float32),
])
def test_kept_rows_merge_reads_only_the_real_rows(backend, splits, tiles, rows, kept, out_dtype):
    """kept_rows: each tile's first k rows merged, `[..., k, D]`; the padding rows hold NaN and are
    never read."""
    rng = np.random.default_rng(splits * rows + kept)
    d = 32
    n = int(np.prod(tiles))
    out = rng.standard_normal((splits, n, rows, d)).astype(np.float32)
    lse = (rng.standard_normal((splits, n, rows)) * 6).astype(np.float32)
    lse[1, 0, 0] = -np.inf  # a split that saw no key of one row
    out[:, :, kept:] = np.nan
    lse[:, :, kept:] = np.nan
    merged, mlse = merge_splits(jnp.asarray(out.reshape(splits, *tiles, rows, d)),
                                jnp.asarray(lse.reshape(splits, *tiles, rows)), out_dtype=out_dtype,
                                backend=backend, kept_rows=kept)
    assert merged.shape == (*tiles, kept, d) and merged.dtype == out_dtype and mlse.shape == (*tiles, kept)
    got = np.asarray(merged, np.float32).reshape(n, kept, d)
    assert not np.isnan(got).any() and not np.isnan(np.asarray(mlse)).any()
    for t in range(n):
        e_out, e_lse = numpy_merge(out[:, t, :kept], lse[:, t, :kept])
        assert rel_err(got[t], e_out) < (1e-6 if out_dtype == jnp.float32 else 1e-2)
        np.testing.assert_allclose(np.asarray(mlse).reshape(n, kept)[t], e_lse, rtol=1e-5, atol=1e-5)


def test_kept_rows_refusals_name_the_value():
    out, lse = jnp.ones((2, 8, 64, 32)), jnp.ones((2, 8, 64))
    with pytest.raises(ValueError, match="kept_rows must be a power of two .* dividing T=64, got 3"):
        merge_splits(out, lse, kept_rows=3)
    with pytest.raises(ValueError, match="kept_rows takes splits on axis 0 .* got axis 1"):
        merge_splits(out, lse, axis=1, kept_rows=4)


def test_heads_layout_merge_refuses_bad_shapes():
    out, lse = jnp.zeros((2, 1, 16, 8, 32)), jnp.zeros((2, 1, 2, 64))
    with pytest.raises(ValueError, match="heads_group must be a power of two dividing 64, got 3"):
        merge_splits(out, lse, heads_group=3)
    with pytest.raises(ValueError, match=r"heads_group 4: out \(2, 1, 16, 8, 32\) .* lse \(2, 1, 2, 64\) "
                                         r"\(got \(2, 1, 2, 32\)\)"):
        merge_splits(out, lse[..., :32], heads_group=4)
    with pytest.raises(ValueError, match="R \\* G a multiple of 64"):
        merge_splits(out[:, :, :8], lse[..., :32], heads_group=4)


def test_rows_per_program():
    assert rows_per_program(2048, 128) == 16  # B=1, R=64, Hq=32, D=128: 128 programs
    assert rows_per_program(40, 16) == 8
    assert rows_per_program(7, 16) == 1
    assert rows_per_program(64, 512) == 4
    assert rows_per_program(2048, 128, MergeConfig(elements_per_program=1024)) == 8


def test_merge_config_defaults_and_refusals():
    """The default launch (the Pallas kernel, 2,048 elements, 16 warps); bad knobs are refused."""
    assert default_config() == MergeConfig(kernel=True, elements_per_program=2048, num_warps=16)
    with pytest.raises(ValueError, match="kernel must be True or False"):
        MergeConfig(kernel=1)
    with pytest.raises(ValueError, match="num_warps a power of two"):
        MergeConfig(num_warps=6)


def test_merge_refuses_bad_inputs_naming_each():
    out, lse = jnp.zeros((2, 4, 12)), jnp.zeros((2, 5))
    with pytest.raises(ValueError) as err:
        merge_splits(out, lse, axis=2, out_dtype=jnp.int32)
    msg = str(err.value)
    assert "axis must be in [0, 2)" in msg and "out (2, 4, 12) must be lse (2, 5)" in msg
    assert "D must be a power of two" in msg and "got int32" in msg


@pytest.mark.parametrize("splits,d,kernel,kept", [(3, 128, True, 0), (8, 512, True, 0), (3, 128, False, 0),
                                                  (4, 128, True, 4)])
def test_merge_lowers_to_triton(monkeypatch, splits, d, kernel, kept):
    """The compiled kernel lowers for sm_90 on the CPU (a split count that is no power of two, the
    MLA latent width, 4 kept rows of 64); under MergeConfig(kernel=False) a compiled merge is the
    XLA form (no Triton call)."""
    import jax._src.pallas.triton.pallas_call_registration as reg

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(split_merge, "resolve_backend", lambda backend: "compiled")
    sd = jax.ShapeDtypeStruct
    fn = lambda o, l: merge_splits(o, l, out_dtype=jnp.bfloat16, kept_rows=kept,  # noqa: E731
                                   config=MergeConfig(kernel=kernel))
    text = jax.jit(fn).trace(sd((splits, 1, 64, 32, d), jnp.float32),
                             sd((splits, 1, 64, 32), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == int(kernel)


def test_heads_layout_merge_lowers_to_triton(monkeypatch):
    """The heads-layout kernel (7-D blocks, an lse tile transposed in registers) lowers for sm_90:
    the B=1, R=64, Hq=32, G=4 fused bf16 cascade's merge, 8 splits."""
    import jax._src.pallas.triton.pallas_call_registration as reg

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(split_merge, "resolve_backend", lambda backend: "compiled")
    sd = jax.ShapeDtypeStruct
    fn = lambda o, l: merge_splits(o, l, out_dtype=jnp.bfloat16, heads_group=4)  # noqa: E731
    text = jax.jit(fn).trace(sd((8, 1, 64, 32, 128), jnp.float32),
                             sd((8, 1, 8, 256), jnp.float32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "stablehlo.transpose" not in text
