"""Tree conv update: Pallas (interpret mode) and the fp32 reference against per-path numpy windows;
chain-as-parents vs the parent-less kernel; padded requests; silu on/off; bad inputs; the
precomputed lag-source table (shared per step) vs the in-kernel parent walk; Triton lowering."""

import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from trees import random_parents

from pallas_kernels.linear.conv_tree import conv_lag_sources, conv_tree_update
from treespec_jax.tree.masks import chain_parents

S = 5


def conv_inputs(rng, nb, T, D, W, with_bias=True):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(x=f(nb, T, D), conv_pool=f(S, W - 1, D), weight=f(D, W), bias=f(D) if with_bias else None)


def np_conv(inp, slots, parents, silu):
    """fp64 per-path windows: committed columns, then the inputs along root..t; last W columns."""
    x = np.asarray(inp["x"], np.float64)
    pool = np.asarray(inp["conv_pool"], np.float64)
    w = np.asarray(inp["weight"], np.float64)
    nb, T, D = x.shape
    W = w.shape[1]
    y = np.zeros((nb, T, D))
    rows = np.zeros((nb, T, W - 1, D))
    for b in range(nb):
        if slots[b] < 0:
            continue
        for t in range(T):
            path, s = [], t
            while s >= 0:
                path.append(s)
                s = int(parents[b, s])
            window = np.concatenate([pool[slots[b]], x[b, path[::-1]]], axis=0)[-W:]  # [W, D]
            out = np.einsum("cd,dc->d", window, w)
            if inp["bias"] is not None:
                out = out + inp["bias"]
            y[b, t] = out / (1 + np.exp(-out)) if silu else out
            rows[b, t] = window[1:]
    return y, rows


def run(inp, slots, parents, **kw):
    return conv_tree_update(jnp.asarray(inp["x"]), jnp.asarray(inp["conv_pool"]), jnp.asarray(slots),
                            jnp.asarray(inp["weight"]), None if inp["bias"] is None else jnp.asarray(inp["bias"]),
                            None if parents is None else jnp.asarray(parents), **kw)


# (T, D, W, block_d, silu, bias): every T the issue lists, channel tails (D not a multiple of the
# block), width 2 and 4, silu and bias on and off.
CASES = [(1, 40, 4, 16, True, True), (6, 24, 4, 8, False, True), (8, 32, 2, None, True, False),
         (14, 40, 4, 16, False, False), (16, 24, 4, None, True, True), (33, 40, 4, 32, True, True),
         (64, 16, 4, None, False, True)]


@pytest.mark.parametrize("T,D,W,block_d,silu,with_bias", CASES)
def test_tree_conv_windows_and_rows_match_per_path(T, D, W, block_d, silu, with_bias, backend):
    rng = np.random.default_rng(2000 + T)
    nb = 3
    inp = conv_inputs(rng, nb, T, D, W, with_bias)
    parents = random_parents(rng, nb, T)
    slots = np.array([4, -1, 0], np.int32)
    inp["conv_pool"][1:4] = np.nan  # slots no live request owns: never read
    rows0 = jnp.full((nb, T, W - 1, D), jnp.nan, jnp.float32)
    y, rows = run(inp, slots, parents, silu=silu, node_states=rows0, block_d=block_d, backend=backend)
    y_ref, rows_ref = np_conv(inp, slots, parents, silu)
    live = np.array([0, 2])
    assert rel_err(np.asarray(y)[live], y_ref[live]) < 1e-6
    assert rel_err(np.asarray(rows)[live], rows_ref[live]) == 0.0  # state rows are copies of inputs
    # The padded request writes no state row and outputs zeros.
    assert np.isnan(np.asarray(rows[1])).all()
    assert np.all(np.asarray(y[1]) == 0.0)


def test_chain_as_parents_equals_chain_kernel(backend):
    rng = np.random.default_rng(21)
    nb, T, D, W = 2, 14, 24, 4
    inp = conv_inputs(rng, nb, T, D, W)
    slots = np.array([1, 3], np.int32)
    chain = np.asarray(chain_parents(nb, T))
    y_tree, r_tree = run(inp, slots, chain, silu=True, node_states=jnp.zeros((nb, T, W - 1, D)), backend=backend)
    y_chain, r_chain = run(inp, slots, None, silu=True, node_states=jnp.zeros((nb, T, W - 1, D)), backend=backend)
    np.testing.assert_array_equal(np.asarray(y_tree), np.asarray(y_chain))
    np.testing.assert_array_equal(np.asarray(r_tree), np.asarray(r_chain))
    assert rel_err(y_chain, np_conv(inp, slots, chain, True)[0]) < 1e-6


@pytest.mark.parametrize("walk", ["precomputed", "parents"])
def test_malformed_parents_stay_in_bounds(walk, backend):
    """A self-loop or forward parent pointer ends that path; other nodes stay exact."""
    rng = np.random.default_rng(25)
    nb, T, D, W = 2, 8, 16, 4
    inp = conv_inputs(rng, nb, T, D, W)
    parents = random_parents(rng, nb, T)
    good = parents.copy()
    parents[0, 5] = 5
    parents[1, 3] = 50  # far past the window
    slots = np.array([0, 1], np.int32)
    y, _ = run(inp, slots, parents, walk=walk, backend=backend)
    y_ref, _ = np_conv(inp, slots, good, False)
    assert np.isfinite(np.asarray(y)).all()
    assert rel_err(np.asarray(y)[0, :5], y_ref[0, :5]) < 1e-6
    assert rel_err(np.asarray(y)[1, :3], y_ref[1, :3]) < 1e-6


def np_lag_sources(parents, W):
    """Per node, the source of lags 1..W-1: ancestors up the path, then committed columns -1, -2, ..."""
    nb, T = parents.shape
    out = np.zeros((nb, T, W - 1), np.int32)
    for b in range(nb):
        for t in range(T):
            cur = t
            for j in range(W - 1):
                cur = int(parents[b, cur]) if cur >= 0 else cur - 1
                out[b, t, j] = cur
    return out


def test_lag_sources_match_numpy():
    rng = np.random.default_rng(26)
    parents = np.concatenate([random_parents(rng, 2, 16), random_parents(rng, 1, 16, forest=True),
                              np.asarray(chain_parents(1, 16))])
    for W in (2, 4):
        np.testing.assert_array_equal(np.asarray(conv_lag_sources(jnp.asarray(parents), W)), np_lag_sources(parents, W))
    with pytest.raises(ValueError, match="conv width must be an int >= 2, got 1"):
        conv_lag_sources(jnp.asarray(parents), 1)


def test_shared_lag_table_equals_parent_walk(backend):
    """One precomputed table (as the layer glue shares it) == the in-kernel parent walk, bit for bit,
    padded request and node rows included; a wrong table gives wrong windows."""
    rng = np.random.default_rng(27)
    nb, T, D, W = 3, 16, 24, 4
    inp = conv_inputs(rng, nb, T, D, W)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1, 4], np.int32)
    inp["conv_pool"][[0, 1, 3]] = np.nan  # slots no live request owns
    lags = conv_lag_sources(jnp.asarray(parents), W)
    outs = {}
    for name, kw in (("table", dict(lags=lags, walk="precomputed")), ("parents", dict(walk="parents"))):
        outs[name] = run(inp, slots, parents, silu=True, node_states=jnp.full((nb, T, W - 1, D), jnp.nan),
                         backend=backend, **kw)
    for a, b in zip(outs["table"], outs["parents"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    y_ref, rows_ref = np_conv(inp, slots, parents, True)
    live = slots >= 0
    assert rel_err(np.asarray(outs["table"][0])[live], y_ref[live]) < 1e-6
    assert np.isnan(np.asarray(outs["table"][1])[1]).all() and np.all(np.asarray(outs["table"][0])[1] == 0.0)
    y_bad, _ = run(inp, slots, parents, silu=True, lags=jnp.roll(lags, 1, axis=1), walk="precomputed",
                   backend=backend)
    assert rel_err(np.asarray(y_bad)[live], y_ref[live]) > 1e-2


def test_conv_lowers_to_triton_for_sm90(monkeypatch):
    """Pallas -> Triton IR for sm_90 without a GPU, both walks (PTX and numbers are the GPU bench's)."""
    import jax
    import jax._src.pallas.triton.pallas_call_registration as reg

    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    nb, T, D = 2, 16, 1024
    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (sd((nb, T, D), bf), sd((6, 3, D), bf), sd((nb,), jnp.int32), sd((D, 4), bf), sd((D,), bf),
            sd((nb, T), jnp.int32), sd((nb, T, 3, D), bf))
    for walk in ("precomputed", "parents"):
        def f(x, pool, sl, w, bias, par, rows, walk=walk):
            return conv_tree_update(x, pool, sl, w, bias, par, silu=True, node_states=rows, walk=walk)

        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text, walk


def test_reference_matches_per_path():
    rng = np.random.default_rng(22)
    nb, T, D, W = 2, 16, 24, 4
    inp = conv_inputs(rng, nb, T, D, W)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1], np.int32)
    y, rows = run(inp, slots, parents, silu=True, node_states=jnp.zeros((nb, T, W - 1, D)), backend="reference")
    y_ref, rows_ref = np_conv(inp, slots, parents, True)
    assert rel_err(y, y_ref) < 1e-6 and rel_err(rows, rows_ref) < 1e-6


def test_without_node_states_only_outputs(backend):
    rng = np.random.default_rng(23)
    nb, T, D, W = 2, 6, 16, 4
    inp = conv_inputs(rng, nb, T, D, W)
    parents = random_parents(rng, nb, T)
    slots = np.array([0, 1], np.int32)
    y, rows = run(inp, slots, parents, backend=backend)
    assert rows is None
    assert rel_err(y, np_conv(inp, slots, parents, False)[0]) < 1e-6


def test_bad_inputs_name_the_value():
    rng = np.random.default_rng(24)
    nb, T, D, W = 2, 6, 16, 4
    inp = conv_inputs(rng, nb, T, D, W)
    slots = np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match=r"conv_pool must be \[S, W-1, D\] = \[S, 3, 16\]"):
        run(dict(inp, conv_pool=inp["conv_pool"][:, :2]), slots, None, backend="interpret")
    with pytest.raises(ValueError, match="weight must be"):
        run(dict(inp, weight=inp["weight"][:, :1]), slots, None, backend="interpret")
    with pytest.raises(ValueError, match="node_states must be"):
        run(inp, slots, None, node_states=jnp.zeros((nb, T, W, D)), backend="interpret")
    with pytest.raises(ValueError, match="block_d must be a power of two, got 12"):
        run(inp, slots, None, block_d=12, backend="interpret")
    with pytest.raises(ValueError, match="state_slots must be"):
        run(inp, np.array([0], np.int32), None, backend="interpret")
    parents = random_parents(rng, nb, T)
    with pytest.raises(ValueError, match=r"lags must be \[B, T, W-1\] = \(2, 6, 3\)"):
        run(inp, slots, parents, lags=jnp.zeros((nb, T, W), jnp.int32), backend="interpret")
    with pytest.raises(ValueError, match="lags given without parents"):
        run(inp, slots, None, lags=jnp.zeros((nb, T, W - 1), jnp.int32), backend="interpret")
    with pytest.raises(ValueError, match="walk must be one of"):
        run(inp, slots, parents, walk="hops", backend="interpret")


def test_conv_default_config_rule():
    """`default_config(D)`: min(next_pow2(D), 256) channels per program, 4 warps."""
    from pallas_kernels.linear.conv_tree import ConvTreeConfig, default_config
    assert [default_config(d).block_d for d in (3, 64, 300, 4096)] == [4, 64, 256, 256]
    assert default_config(64) == ConvTreeConfig(block_d=64, num_warps=4)
    with pytest.raises(ValueError, match="block_d must be a power of two, got 12"):
        ConvTreeConfig(block_d=12)
