"""The Mosaic GPU MLA latent decode (experimental) in Pallas' GPU interpreter, against fp32 references.

As for the GQA prefix half: the interpreter checks indexing, page-table reads, masking and the
barrier protocol on the CPU; the compiled kernel runs only in benchmarks/mgpu_prefix_check.py --mla.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from paged_fixtures import poisoned_paged_pools, rel_err
from trees import random_parents

from pallas_kernels.attention.mla_decode import mla_decode_reference
from pallas_kernels.attention.mla_decode_mgpu import check_mla_mgpu_inputs, mla_decode_mgpu
from pallas_kernels.attention.reference import cascade_dense_reference
from pallas_kernels.attention.tree_window import tree_window_attention
from treespec_jax.tree.masks import ancestor_mask

LORA, ROPE, PAGE, SCALE = 128, 64, 64, 0.09


@pytest.mark.parametrize("r,hq,lengths,block_k,splits,share", [
    (4, 8, [0, 70, 200], 32, 1, False),  # P = 0, partial last pages; 32 rows padded to one 64-row tile
    (16, 8, [260, 20], 64, 2, False),  # two row tiles, the first ending mid-page below the last whole page
    (16, 8, [260, 0, 90], 32, 2, True),  # warpgroup 0 hands P and alpha to warpgroup 1
])
def test_mgpu_mla_decode_and_cascade_match_references(r, hq, lengths, block_k, splits, share):
    rng = np.random.default_rng(r * hq + block_k)
    lengths = np.asarray(lengths, np.int32)
    b = len(lengths)
    pool, _, table = poisoned_paged_pools(rng, b, int(lengths.max()) + r, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + r)
    pool = pool[:, 0]  # [S, L + Dr]: one latent row per slot
    q = jnp.asarray(rng.standard_normal((b, r, hq, LORA + ROPE)), jnp.bfloat16)
    lens = jnp.asarray(lengths)
    out, lse = mla_decode_mgpu(q, pool, table, lens, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                               block_k=block_k, num_splits=splits, share_scores=share, interpret=True)
    ref_out, ref_lse = mla_decode_reference(q, pool, table, lens, kv_lora_rank=LORA, page_size=PAGE,
                                            scale=SCALE, whole_pages=True)
    assert out.shape == (b, r, hq, LORA) and lse.shape == (b, r, hq)
    assert rel_err(out, ref_out) < 1e-2
    fin = np.isfinite(np.asarray(ref_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], atol=2e-3)
    # With the window kernel covering the partial page and the tree window: one dense attention.
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, r)))
    got = tree_window_attention(q, pool, None, table, lens, mask, out, lse, window=r, page_size=PAGE,
                                scale=SCALE, rope_dim=ROPE, value_dim=LORA, prefix_whole_pages=True,
                                backend="interpret")
    dense, _ = cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lens, mask, window=r,
                                       page_size=PAGE, scale=SCALE)
    assert rel_err(got, dense) < 1e-2


def test_mgpu_mla_refuses_unsupported_shapes():
    bf = jnp.bfloat16
    q = jnp.zeros((1, 2, 4, 192), bf)
    with pytest.raises(ValueError, match="latent_pool must be"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 128), bf), 128, 64, 32)
    with pytest.raises(ValueError, match="kv_lora_rank"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), bf), 96, 64, 32)
    with pytest.raises(ValueError, match="block_k must be 32 or 64"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), bf), 128, 16, 32)
    with pytest.raises(ValueError, match="16-bit dtype"):
        check_mla_mgpu_inputs(q, jnp.zeros((64, 192), jnp.float32), 128, 64, 32)


def test_mla_verify_through_the_mosaic_gpu_decode():
    """MlaCascadeConfig(prefix_kernel="mosaic_gpu") end to end (interpreter) equals dense attention;
    an FP8 cache is refused by name."""
    from treespec_jax.attention.mla import MlaCascadeConfig, mla_verify_attention

    rng = np.random.default_rng(9)
    n, hq = 8, 4
    lengths = np.array([150, 3], np.int32)
    b = len(lengths)
    pool, _, table = poisoned_paged_pools(rng, b, int(lengths.max()) + n, 1, LORA + ROPE, PAGE, jnp.bfloat16,
                                          lambda bb, pos: pos < lengths[bb] + n)
    pool = pool[:, 0]
    q = jnp.asarray(rng.standard_normal((b, n, hq, LORA + ROPE)), jnp.bfloat16)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    lens = jnp.asarray(lengths)
    cfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, backend="interpret",
                           prefix_kernel="mosaic_gpu")
    got = mla_verify_attention(q, pool, table, lens, mask, config=cfg)
    dense, _ = cascade_dense_reference(q, pool[:, None, :], pool[:, None, :LORA], table, lens, mask, window=n,
                                       page_size=PAGE, scale=SCALE)
    assert rel_err(got, dense) < 1e-2
    with pytest.raises(ValueError, match="16-bit dtype"):
        mla_verify_attention(q, pool.astype(jnp.float8_e4m3fn), table, lens, mask, config=cfg)
    with pytest.raises(ValueError, match="prefix_kernel"):
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, prefix_kernel="x")
