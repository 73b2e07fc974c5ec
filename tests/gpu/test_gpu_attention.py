"""GPU conformance of the attention kernels, compiled, at serving widths: GQA (Hq 32, Hkv 8, D 128,
64-token pages) and MLA (latent 512 + rope 64, 128 heads).

Each op has one test parametrized over the kernels ("backends") that implement it, each compared
with the op's fp32 reference: fresh random inputs, ragged lengths (P = 0, P < N, partial pages),
NaN / inf in every slot no row may read, relative error, any non-finite output fails. Tolerances
are the bench scripts' (bf16 2e-2; FP8 pools 6e-2, where the prefix half multiplies an
FP8-quantised query and the dense reference the unquantised one).

    python -m pytest -m "gpu and not sweep" tests/gpu      # on a CUDA machine
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from paged_fixtures import poisoned_paged_pools
from trees import random_parents

from pallas_kernels.attention.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_reference, quantize_query
from pallas_kernels.attention.mla_decode_mgpu import mla_decode_mgpu
from pallas_kernels.attention.prefix_decode import prefix_decode
from pallas_kernels.attention.reference import cascade_dense_reference, sliding_lane_dense_reference
from pallas_kernels.attention.tree_window import tree_window_attention
from pallas_kernels.row_move import move_rows, move_rows_reference
from treespec_jax.attention import CascadeConfig, cascade_attention, sliding_lane_attention, verify_attention
from treespec_jax.attention.mla import MlaCascadeConfig, mla_verify_attention
from treespec_jax.tree.masks import ancestor_mask, pack_mask_rows

pytestmark = pytest.mark.gpu

FP8 = jnp.float8_e4m3fn
HQ, HKV, D = 32, 8, 128
BF_TOL, FP8_TOL = 2e-2, 6e-2
LENGTHS = [0, 7, 1200, 517]  # P = 0, P < N, long, mid-page


def tol_of(dtype) -> float:
    return FP8_TOL if dtype == FP8 else BF_TOL


def gqa_case(seed, n, page, dtype, hq=HQ, hkv=HKV, lengths=LENGTHS):
    """A verify problem: pools live below P + N (the window the verify forward wrote), NaN / inf
    elsewhere; q bf16 `[B, N, hq, D]`; a random tree's ancestor mask."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    k, v, table = poisoned_paged_pools(rng, len(lengths), int(lengths.max()) + n, hkv, D, page, dtype,
                                       lambda b, pos: pos < lengths[b] + n)
    q = jnp.asarray(rng.standard_normal((len(lengths), n, hq, D)), jnp.bfloat16)
    mask = ancestor_mask(random_parents(rng, len(lengths), n))
    return q, k, v, table, jnp.asarray(lengths), mask


def dense(q, k, v, table, lengths, mask, window, page):
    out, _ = cascade_dense_reference(q, k, v, table, lengths, mask, window=window, page_size=page, scale=D ** -0.5)
    return out


def check_lse(lse, ref, tol=2e-2):
    lse, ref = np.asarray(lse), np.asarray(ref)
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    fin = np.isfinite(ref)
    assert np.max(np.abs(lse[fin] - ref[fin]), initial=0.0) <= tol


# (group, rows, page, pool dtype): the bench's conformance shapes.
SHAPES = [(4, 16, 16, jnp.bfloat16), (1, 64, 64, jnp.bfloat16), (8, 16, 64, FP8), (4, 16, 64, FP8)]
SHAPE_IDS = [f"g{g}-n{n}-page{p}-{jnp.dtype(t).name}" for g, n, p, t in SHAPES]


PREFIX_FORMS = {"splits-auto": (None, False), "splits-3": (3, False), "fp8-dot": (None, True)}


# The FP8 score dot takes FP8 pools: its bf16 combinations are not cases.
@pytest.mark.parametrize("shape,splits,fp8_dot", [
    pytest.param(shape, splits, fp8_dot, id=f"{form}-{sid}")
    for form, (splits, fp8_dot) in PREFIX_FORMS.items() for shape, sid in zip(SHAPES, SHAPE_IDS)
    if not fp8_dot or shape[3] == FP8])
def test_prefix_decode(shape, splits, fp8_dot):
    """The Triton paged prefix decode against the fp32 reference (output and base-2 LSE)."""
    group, n, page, dtype = shape
    q, k, v, table, lengths, _ = gqa_case(1, n, page, dtype, hq=HKV * group)
    out, lse = prefix_decode(q, k, v, table, lengths, page_size=page, num_splits=splits, fp8_score_dot=fp8_dot,
                             poison_outputs=True)
    ref, rlse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    assert rel_err(out, ref) < BF_TOL
    check_lse(lse, rlse)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_tree_window(shape):
    """The tree window kernel (tail + masked window, merged with the reference prefix partial)."""
    group, n, page, dtype = shape
    q, k, v, table, lengths, mask = gqa_case(2, n, page, dtype, hq=HKV * group)
    po, plse = prefix_decode(q, k, v, table, lengths, page_size=page, backend="reference")
    out = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=n, page_size=page,
                                poison_outputs=True)
    ref = tree_window_attention(q, k, v, table, lengths, mask, po, plse, window=n, page_size=page,
                                backend="reference")
    assert rel_err(out, ref) < BF_TOL


# CascadeConfig fields per cascade form; the Mosaic forms need 64- or 128-token pages.
CASCADES = {
    "default": {},
    "triton": dict(prefix_kernel="triton"),
    "triton-fp8-dot": dict(prefix_kernel="triton", fp8_score_dot=True),
    "mosaic-fused": dict(prefix_kernel="mosaic_gpu", fuse_window=True, num_splits=1),
    "mosaic-fused-splits3": dict(prefix_kernel="mosaic_gpu", fuse_window=True, num_splits=3),
    "mosaic-unfused": dict(prefix_kernel="mosaic_gpu", fuse_window=False, num_splits=1),
    "mosaic-unfused-splits3": dict(prefix_kernel="mosaic_gpu", fuse_window=False, num_splits=3),
    "mosaic-causal-split": dict(prefix_kernel="mosaic_gpu", fuse_window=False, prefix_covers_tail=False),
    "bf16-partial-triton": dict(prefix_kernel="triton", num_splits=1, prefix_partial_dtype="bfloat16"),
    "bf16-partial-auto": dict(num_splits=1, prefix_partial_dtype="bfloat16"),
}


def cascade_applies(fields: dict, shape) -> bool:
    """The Mosaic prefix reads 64- or 128-token pages; the FP8 score dot takes FP8 pools."""
    _, _, page, dtype = shape
    return ((fields.get("prefix_kernel") != "mosaic_gpu" or page in (64, 128))
            and (not fields.get("fp8_score_dot") or dtype == FP8))


@pytest.mark.parametrize("shape,form", [
    pytest.param(shape, form, id=f"{form}-{sid}")
    for form, fields in CASCADES.items() for shape, sid in zip(SHAPES, SHAPE_IDS) if cascade_applies(fields, shape)])
def test_verify_cascade(shape, form):
    """`verify_attention` through each cascade form against one dense fp32 attention."""
    group, n, page, dtype = shape
    fields = CASCADES[form]
    q, k, v, table, lengths, mask = gqa_case(3, n, page, dtype, hq=HKV * group)
    out = verify_attention(q, k, v, table, lengths, mask, config=CascadeConfig(page_size=page, **fields))
    assert out.dtype == q.dtype
    assert rel_err(out, dense(q, k, v, table, lengths, mask, n, page)) < tol_of(dtype)


@pytest.mark.parametrize("dtype,form", [(jnp.bfloat16, "default"), (jnp.bfloat16, "triton"),
                                        (jnp.bfloat16, "mosaic-fused"), (FP8, "default"), (FP8, "triton")])
def test_lane_cascade(dtype, form):
    """Draft lanes (K = 8 lanes, S = 3 steps: a 16-key window at the frontier; 8 query heads per KV
    head, so the Mosaic prefix tiles 64 rows); lane slots no row names are poisoned."""
    rng = np.random.default_rng(4)
    b, kk, w, page, group = 3, 8, 16, 64, 8
    frontier = np.asarray([3, 300, 64], np.int32)
    bits = rng.random((b, kk, w)) < 0.4
    k, v, table = poisoned_paged_pools(rng, b, 400, HKV, D, page, dtype, lambda bb, pos: pos < frontier[bb] + w)
    q = jnp.asarray(rng.standard_normal((b, kk, HKV * group, D)), jnp.bfloat16)
    mask = pack_mask_rows(jnp.asarray(bits))
    fields = {"default": {}, "triton": dict(prefix_kernel="triton"),
              "mosaic-fused": dict(prefix_kernel="mosaic_gpu", fuse_window=True)}[form]
    out = cascade_attention(q, k, v, table, jnp.asarray(frontier), mask, window=w,
                            config=CascadeConfig(page_size=page, **fields))
    assert rel_err(out, dense(q, k, v, table, jnp.asarray(frontier), mask, w, page)) < tol_of(dtype)


def test_sliding_lane_cascade():
    """Sliding-window draft lanes: each lane row's own page table and length, the last 128 keys."""
    rng = np.random.default_rng(5)
    b, kk, w, page, sw = 3, 4, 16, 64, 128
    frontier = np.asarray([3, 300, 64], np.int32)
    k, v, table = poisoned_paged_pools(rng, b, 400, HKV, D, page, jnp.bfloat16,
                                       lambda bb, pos: pos < frontier[bb] + w)
    row_tables = jnp.asarray(np.stack([np.stack([np.asarray(table)[bb]] * kk) for bb in range(b)]))
    row_lengths = jnp.asarray(np.minimum(frontier[:, None], 200) * np.ones((1, kk), np.int32), jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, kk, 16, D)), jnp.bfloat16)
    mask = pack_mask_rows(jnp.asarray(rng.random((b, kk, w)) < 0.4))
    args = (q, k, v, row_tables, row_lengths, table, jnp.asarray(frontier), mask)
    out = sliding_lane_attention(*args, window=w, config=CascadeConfig(page_size=page), sliding_window=sw)
    ref, _ = sliding_lane_dense_reference(*args, window=w, page_size=page, scale=D ** -0.5, sliding_window=sw)
    assert rel_err(out, ref) < BF_TOL


# ------------------------------------------------------------------------------------------------
# MLA: latent 512 + rope 64 (DeepSeek-V3 widths), 128 query heads
# ------------------------------------------------------------------------------------------------

LORA, ROPE, PAGE = 512, 64, 64
MLA_SCALE = 192 ** -0.5


def mla_case(seed, n, dtype, lengths=(0, 3, 700, 517)):
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    pool, _, table = poisoned_paged_pools(rng, len(lengths), int(lengths.max()) + n, 1, LORA + ROPE, PAGE, dtype,
                                          lambda b, pos: pos < lengths[b] + n)
    q = jnp.asarray(rng.standard_normal((len(lengths), n, 128, LORA + ROPE)), jnp.bfloat16)
    mask = ancestor_mask(random_parents(rng, len(lengths), n))
    return q, pool[:, 0], table, jnp.asarray(lengths), mask


MLA_DECODES = {
    "triton-default": ("triton", MlaDecodeConfig()),
    "triton-no-prefetch": ("triton", MlaDecodeConfig(prefetch_page_ids=False)),
    "triton-widened-fp8": ("triton", MlaDecodeConfig(fp8_score_dot=False)),
    "mosaic-seesaw": ("mosaic_gpu", "seesaw"),
    "mosaic-split": ("mosaic_gpu", "split"),
}


# The widened FP8 score dot is a form of FP8 caches: it has no bf16 case.
@pytest.mark.parametrize("dtype,form", [
    pytest.param(dtype, form, id=f"{form}-{dname}")
    for form in MLA_DECODES for dtype, dname in ((jnp.bfloat16, "bf16"), (FP8, "fp8"))
    if form != "triton-widened-fp8" or dtype == FP8])
def test_mla_decode(dtype, form):
    """The latent decode (Triton, or the Mosaic GPU kernel over whole pages) against its fp32 reference."""
    kernel, option = MLA_DECODES[form]
    q, pool, table, lengths, _ = mla_case(6, 16, dtype)
    if kernel == "triton":
        out, lse = mla_decode(q, pool, table, lengths, kv_lora_rank=LORA, page_size=PAGE, scale=MLA_SCALE,
                              config=option, poison_outputs=True)
        whole = False
    else:
        q = quantize_query(q, dtype)  # the query the Mosaic decode multiplies (the cascade casts it)
        out, lse = mla_decode_mgpu(q, pool, table, lengths, kv_lora_rank=LORA, page_size=PAGE, scale=MLA_SCALE,
                                   schedule=option)
        whole = True
    ref, rlse = mla_decode_reference(q, pool, table, lengths, kv_lora_rank=LORA, page_size=PAGE, scale=MLA_SCALE,
                                     whole_pages=whole)
    assert rel_err(out, ref) < BF_TOL
    check_lse(lse, rlse)


MLA_CASCADES = {
    "default": {},
    "triton": dict(prefix_kernel="triton"),
    "mosaic-fused": dict(prefix_kernel="mosaic_gpu", fuse_window=True),
    "mosaic-window-kernel": dict(prefix_kernel="mosaic_gpu", fuse_window=False),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("form", list(MLA_CASCADES))
def test_mla_verify_cascade(dtype, form):
    """`mla_verify_attention` through each form against one dense fp32 attention over the latent rows
    (over an FP8 cache the prefix half scores the FP8-quantised query, the reference the unquantised one)."""
    q, pool, table, lengths, mask = mla_case(7, 16, dtype)
    cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=MLA_SCALE, **MLA_CASCADES[form])
    out = mla_verify_attention(q, pool, table, lengths, mask, config=cfg)
    ref, _ = cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lengths, mask, window=16,
                                     page_size=PAGE, scale=MLA_SCALE)
    assert rel_err(out, ref) < tol_of(dtype)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_mla_tree_window(dtype):
    """The window kernel over latent rows (keys and values one row) against its reference."""
    q, pool, table, lengths, mask = mla_case(8, 16, dtype)
    rng = np.random.default_rng(9)
    po = jnp.asarray(rng.standard_normal(q.shape[:3] + (LORA,)), jnp.float32)
    plse = jnp.asarray(rng.standard_normal(q.shape[:3]) + 2.0, jnp.float32)
    kw = dict(window=16, page_size=PAGE, scale=MLA_SCALE, rope_dim=ROPE)
    out = tree_window_attention(q, pool, None, table, lengths, mask, po, plse, poison_outputs=True, **kw)
    ref = tree_window_attention(q, pool, None, table, lengths, mask, po, plse, backend="reference", **kw)
    assert rel_err(out, ref) < BF_TOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, FP8], ids=["bf16", "fp8"])
def test_move_rows(dtype):
    """Compaction's row moves, compiled and donated, equal the reference byte for byte."""
    rng = np.random.default_rng(10)
    slots, b, n = 4096, 32, 16
    buf = jnp.asarray(rng.standard_normal((slots, LORA + ROPE)), jnp.float32).astype(dtype)
    bases = rng.permutation(slots // n)[:b] * n
    path = np.full((b, n), -1, np.int32)  # accepted paths: the root, then ascending window rows
    for row in range(b):
        length = int(rng.integers(1, n + 1))
        path[row, :length] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), length - 1, replace=False))])
    dst = (bases[:, None] + np.arange(n)[None]).astype(np.int32)
    src = np.where(path >= 0, bases[:, None] + path, -1).astype(np.int32)
    ref = move_rows_reference(buf, jnp.asarray(src), jnp.asarray(dst))
    expect = np.asarray(jax.lax.bitcast_convert_type(ref, jnp.uint8))
    out = jax.jit(lambda x, s, d: move_rows(x, s, d), donate_argnums=0)(buf, jnp.asarray(src), jnp.asarray(dst))
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint8)), expect)
