"""Chunked (SSD) Mamba2 tree verify: Pallas (interpret mode) against the per-path fp64 recurrence of
test_mamba2_tree; chains and trees up to 64 nodes; grouped B/C; z gating; padded requests; the
ReplaySSM payload rows; refusals; the Triton lowering for sm_90."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from test_mamba2_tree import H, N, _j, mamba2_inputs, np_mamba2, pretend_sm90_with_nemotron_args
from trees import random_parents

from pallas_kernels.linear.mamba2_chunked import MAX_CHUNKED_NODES, mamba2_tree_chunked
from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout
from pallas_kernels.linear.mamba2_tree import mamba2_tree_scan
from treespec_jax.tree.masks import ancestor_mask, chain_parents


def chunked(inp, slots, parents, **kw):
    a = _j(inp)
    return mamba2_tree_chunked(a["x"], a["dt"], a["A_log"], a["B"], a["C"], a["D"], a["dt_bias"], a["state_pool"],
                               jnp.asarray(slots, jnp.int32), None if parents is None else jnp.asarray(parents),
                               z=a["z"], **kw)


@pytest.mark.parametrize("T,P,G,tree,with_z", [
    (1, 16, 1, True, True), (6, 16, 2, True, False), (16, 32, 2, True, True), (33, 16, 4, True, True),
    (64, 16, 1, True, False), (14, 16, 2, False, True),
])
def test_chunked_matches_per_path_recurrence(T, P, G, tree, with_z, backend):
    rng = np.random.default_rng(T * 7 + P + G)
    nb = 3
    inp = mamba2_inputs(rng, nb, T, P, G, with_z=with_z)
    slots = np.array([2, -1, 4], np.int32)  # request 1 is padded
    parents = random_parents(rng, nb, T) if tree else None
    y, side = chunked(inp, slots, parents, backend=backend)
    assert side is None
    ref, _ = np_mamba2(inp, slots, np.asarray(chain_parents(nb, T)) if parents is None else parents)
    assert rel_err(y, ref) < 1e-4
    assert not np.asarray(y)[1].any()  # the padded request's outputs are zero


def test_chunked_replay_payload_and_shared_mask(backend):
    """Replay mode writes each live request's [B | x | dt] rows and leaves a padded request's rows
    (NaN-poisoned) alone; a mask passed in (as attention builds it) gives the same outputs; the
    outputs equal the recurrent kernel's."""
    rng = np.random.default_rng(5)
    nb, T, P, G = 3, 16, 16, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    slots = np.array([0, 3, -1], np.int32)
    parents = random_parents(rng, nb, T)
    lay = Mamba2PayloadLayout(G, N, H, P)
    payload = jnp.full((nb, T, lay.width), jnp.nan, jnp.float32)
    y, side = chunked(inp, slots, parents, mode="replay", payload=payload,
                      mask=ancestor_mask(jnp.asarray(parents)), backend=backend)
    a = _j(inp)
    want = np.asarray(lay.pack(a["B"], a["x"], a["dt"]))
    got = np.asarray(side)
    np.testing.assert_array_equal(got[:2], want[:2])
    assert np.isnan(got[2]).all()
    y_rec, _ = mamba2_tree_scan(a["x"], a["dt"], a["A_log"], a["B"], a["C"], a["D"], a["dt_bias"], a["state_pool"],
                                jnp.asarray(slots), jnp.asarray(parents), z=a["z"], backend=backend)
    assert rel_err(y, np.asarray(y_rec, np.float64)) < 1e-4


def test_chunked_bf16_inputs(backend):
    rng = np.random.default_rng(8)
    nb, T, P, G = 2, 16, 32, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = random_parents(rng, nb, T)
    slots = np.array([1, 2], np.int32)
    ref, _ = np_mamba2({k: None if v is None else np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)
                        for k, v in inp.items()}, slots, parents)
    bf = {k: None if v is None else jnp.asarray(v, jnp.bfloat16) for k, v in inp.items()}
    y, _ = chunked(bf, slots, parents, backend=backend)
    assert y.dtype == jnp.bfloat16
    assert rel_err(np.asarray(y, np.float32), ref) < 2e-2


def test_chunked_refusals_name_the_value():
    rng = np.random.default_rng(1)
    inp = mamba2_inputs(rng, 1, 4, 16, 1)
    with pytest.raises(ValueError, match="keeps no node states.*got 'staged'"):
        chunked(inp, np.array([0]), None, mode="staged")
    with pytest.raises(ValueError, match=r"mask must be \[B=1, T=4, 2\] uint32"):
        chunked(inp, np.array([0]), None, mask=jnp.zeros((1, 4, 2), jnp.int32))
    long = mamba2_inputs(rng, 1, MAX_CHUNKED_NODES + 1, 16, 1, with_z=False)
    with pytest.raises(ValueError, match=f"T must be in \\[1, {MAX_CHUNKED_NODES}\\], got {MAX_CHUNKED_NODES + 1}"):
        chunked(long, np.array([0]), None)
    with pytest.raises(ValueError, match="block_p must be a power of two >= 16, got 8"):
        chunked(inp, np.array([0]), None, block_p=8)
    with pytest.raises(ValueError, match="fp32_dots must be one of \\('ieee', 'tf32x3'\\), got 'tf32'"):
        chunked(inp, np.array([0]), None, fp32_dots="tf32")


def test_chunked_lowers_to_triton_for_sm90(monkeypatch):
    """Pallas -> Triton IR for sm_90 without a GPU at Nemotron-H-like head dims (the PTX compile and
    the numbers are the GPU bench's), for both fp32 product modes, set by the config's field or by
    the keyword that overrides it."""
    import dataclasses

    from pallas_kernels.linear.mamba2_chunked import default_config
    args = pretend_sm90_with_nemotron_args(monkeypatch)

    def lowered(**kw):
        def f(x, dt, al, B, C, D, dtb, pool, sl, par, pay):
            return mamba2_tree_chunked(x, dt, al, B, C, D, dtb, pool, sl, par, z=x, mode="replay", payload=pay, **kw)
        return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()

    texts = {fp32_dots: lowered(fp32_dots=fp32_dots) for fp32_dots in ("ieee", "tf32x3")}
    for fp32_dots, text in texts.items():
        assert "__gpu$xla.gpu.triton" in text, fp32_dots
    assert texts["ieee"] != texts["tf32x3"]
    # The config's field sets the products ("ieee" by default); the keyword overrides it.
    tf32 = dataclasses.replace(default_config(args[0].shape[-1]), fp32_dots="tf32x3")
    assert lowered() == texts["ieee"]
    assert lowered(config=tf32) == texts["tf32x3"]
    assert lowered(config=tf32, fp32_dots="ieee") == texts["ieee"]


def test_chunked_default_config_rule():
    """`default_config(P)`: next_pow2(P) channels per program, clamped to [16, 64], 4 warps, IEEE
    fp32 products."""
    from pallas_kernels.linear.mamba2_chunked import Mamba2ChunkedConfig, default_config
    assert [default_config(p).block_p for p in (4, 16, 24, 64, 128)] == [16, 16, 32, 64, 64]
    assert default_config(64) == Mamba2ChunkedConfig(block_p=64, num_warps=4, fp32_dots="ieee")
    with pytest.raises(ValueError, match="Mamba2ChunkedConfig.fp32_dots must be one of .*got 'bf16'"):
        Mamba2ChunkedConfig(block_p=16, fp32_dots="bf16")
    with pytest.raises(ValueError, match="num_warps must be a power of two, got 3"):
        Mamba2ChunkedConfig(block_p=16, num_warps=3)
