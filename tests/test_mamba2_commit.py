"""Commits after a Mamba2 tree verify: ReplaySSM replay (payload packing + replay kernel) and staged
copies, for the SSM and the conv state, against the per-path fp64 recurrence; the layer glue end to
end in both modes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from test_conv_tree import np_conv
from test_mamba2_tree import H, N, S, _j, mamba2_inputs, np_mamba2, path_to, scan
from tiers import cases
from trees import random_parents

from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout
from pallas_kernels.linear.mamba2_replay import mamba2_replay_commit
from treespec_jax.linear.conv import conv_commit_from_inputs, conv_commit_staged
from treespec_jax.linear.mamba2 import (
    Mamba2CommitConfig, Mamba2Dims, Mamba2Layer, Mamba2Pools, Mamba2Weights, mamba2_verify,
    new_verify_scratch, pack_path_rows,
)
from treespec_jax.support import LinearAttentionLayerSpec, TreeSupportError, resolve_tree_support


def random_accepted_paths(rng, parents):
    """For each request: a random node's root path, cut to a random accepted length >= 1."""
    nb, T = parents.shape
    path = np.full((nb, T), -1, np.int32)
    accept_len = np.zeros(nb, np.int32)
    for b in range(nb):
        full = path_to(parents[b], int(rng.integers(0, T)))
        n = int(rng.integers(1, len(full) + 1))
        path[b, :n] = full[:n]
        accept_len[b] = n
    return path, accept_len


@pytest.mark.parametrize("T", [16, 64])
def test_replay_commit_equals_state_at_last_accepted_node(T, backend):
    rng = np.random.default_rng(3000 + T)
    nb, P, G = 3, 8, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = random_parents(rng, nb, T)
    slots = np.array([3, -1, 0], np.int32)
    layout = Mamba2PayloadLayout(G, N, H, P)
    pool_before = np.array(inp["state_pool"])
    _, payload = scan(inp, slots, parents, mode="replay", payload=jnp.full((nb, T, layout.width), jnp.nan),
                      backend=backend)
    np.testing.assert_array_equal(np.asarray(inp["state_pool"]), pool_before)  # verify never writes the pool
    path, accept_len = random_accepted_paths(rng, parents)
    packed = pack_path_rows(payload, jnp.asarray(path), jnp.asarray(accept_len), backend=backend)
    a = _j(inp)
    new_pool = np.asarray(mamba2_replay_commit(packed, jnp.asarray(accept_len), a["state_pool"], jnp.asarray(slots),
                                               a["A_log"], a["dt_bias"], ngroups=G, dstate=N, backend=backend))
    _, states = np_mamba2(inp, slots, parents)
    for b in (0, 2):
        last = path[b, accept_len[b] - 1]
        assert rel_err(new_pool[slots[b]], states[b, last]) < 2e-5
    untouched = [s for s in range(S) if s not in (0, 3)]
    np.testing.assert_array_equal(new_pool[untouched], pool_before[untouched])


def test_replay_commit_reference_and_accept_len_past_window(backend):
    rng = np.random.default_rng(31)
    nb, T, P, G = 2, 6, 8, 1
    inp = mamba2_inputs(rng, nb, T, P, G)
    slots = np.array([1, 2], np.int32)
    layout = Mamba2PayloadLayout(G, N, H, P)
    a = _j(inp)
    payload = layout.pack(a["B"], a["x"], a["dt"])  # a chain window: already packed
    accept_len = jnp.asarray([T + 3, 2], jnp.int32)  # more than T replays T rows
    args = (payload, accept_len, a["state_pool"], jnp.asarray(slots), a["A_log"], a["dt_bias"])
    got = mamba2_replay_commit(*args, ngroups=G, dstate=N, backend=backend)
    ref = mamba2_replay_commit(*args, ngroups=G, dstate=N, backend="reference")
    _, states = np_mamba2(inp, slots, np.tile(np.arange(T, dtype=np.int32) - 1, (nb, 1)))
    assert rel_err(got[1], states[0, T - 1]) < 2e-5 and rel_err(got[2], states[1, 1]) < 2e-5
    assert rel_err(ref, np.asarray(got)) < 2e-6
    with pytest.raises(ValueError, match=r"payload must be \[B, T, 52\]"):
        mamba2_replay_commit(payload[..., :-1], *args[1:], ngroups=G, dstate=N, backend=backend)


def test_pack_path_rows_moves_path_to_front(backend):
    rng = np.random.default_rng(32)
    nb, T = 3, 8
    parents = random_parents(rng, nb, T)
    path, accept_len = random_accepted_paths(rng, parents)
    buf = rng.standard_normal((nb, T, 5)).astype(np.float32)
    got = np.asarray(pack_path_rows(jnp.asarray(buf), jnp.asarray(path), jnp.asarray(accept_len), backend=backend))
    for b in range(nb):
        n = accept_len[b]
        np.testing.assert_array_equal(got[b, :n], buf[b, path[b, :n]])
        np.testing.assert_array_equal(got[b, n:], buf[b, n:])


@pytest.mark.parametrize("T", [1, 2, 7])
def test_conv_commits_staged_and_from_inputs_agree(T):
    rng = np.random.default_rng(33 + T)
    nb, D, W = 3, 8, 4
    x = rng.standard_normal((nb, T, D)).astype(np.float32)
    pool = rng.standard_normal((S, W - 1, D)).astype(np.float32)
    parents = random_parents(rng, nb, T)
    slots = np.array([4, -1, 1], np.int32)
    inp = dict(x=x, conv_pool=pool, weight=np.ones((D, W), np.float32), bias=None)
    _, rows = np_conv(inp, slots, parents, False)
    path, accept_len = random_accepted_paths(rng, parents)
    packed = np.stack([x[b, np.where(path[b] >= 0, path[b], 0)] for b in range(nb)])
    staged = conv_commit_staged(jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(rows, jnp.float32),
                                jnp.asarray(path), jnp.asarray(accept_len))
    rebuilt = conv_commit_from_inputs(jnp.asarray(pool), jnp.asarray(slots), jnp.asarray(packed), jnp.asarray(accept_len))
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(staged[slots[b]]), rows[b, path[b, accept_len[b] - 1]].astype(np.float32))
    np.testing.assert_array_equal(np.asarray(staged), np.asarray(rebuilt))
    np.testing.assert_array_equal(np.asarray(staged)[[0, 2, 3]], pool[[0, 2, 3]])


DIMS = Mamba2Dims(nheads=H, headdim=8, dstate=N, ngroups=2, conv_width=4)


def _layer_inputs(rng, nb, T):
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    weights = Mamba2Weights(A_log=jnp.asarray(rng.uniform(-1, 1, H), jnp.float32), dt_bias=jnp.asarray(0.5 * f(H)),
                            D=jnp.asarray(f(H)), conv_weight=jnp.asarray(0.5 * f(DIMS.conv_dim, 4)),
                            conv_bias=jnp.asarray(f(DIMS.conv_dim)))
    pools = Mamba2Pools(ssm=jnp.asarray(f(S, H, 8, N)), conv=jnp.asarray(f(S, 3, DIMS.conv_dim)))
    return weights, pools, jnp.asarray(f(nb, T, DIMS.conv_dim)), jnp.asarray(f(nb, T, H)), jnp.asarray(f(nb, T, H, 8))


@pytest.mark.parametrize("tree", cases([True, False]))
def test_layer_glue_staged_and_replay_agree_with_per_path(tree, backend):
    rng = np.random.default_rng(34 + tree)
    nb, T = 2, 8
    weights, pools, xbc, dt, z = _layer_inputs(rng, nb, T)
    parents = random_parents(rng, nb, T) if tree else np.tile(np.arange(T, dtype=np.int32) - 1, (nb, 1))
    path, accept_len = random_accepted_paths(rng, parents)
    slots = jnp.asarray([2, 0], jnp.int32)
    outs = {}
    for replay in (True, False):
        # The recurrent form under both modes: bitwise-equal outputs (the chunked form rounds differently).
        layer = Mamba2Layer("layers.0", DIMS, Mamba2CommitConfig(mode="replay_ssm" if replay else "staged",
                                                                 backend=backend, verify_form="recurrent"))
        scratch = new_verify_scratch(DIMS, layer.cfg, nb, T, act_dtype=jnp.float32)
        scratch = jax.tree.map(lambda s: jnp.full_like(s, jnp.nan), scratch)
        res = layer.verify(weights, pools, slots, xbc, dt, jnp.asarray(parents) if tree else None, scratch, z)
        outs[replay] = (res.y, layer.commit(weights, pools, slots, res, jnp.asarray(path), jnp.asarray(accept_len)))
    np.testing.assert_array_equal(np.asarray(outs[True][0]), np.asarray(outs[False][0]))
    np.testing.assert_array_equal(np.asarray(outs[True][1].conv), np.asarray(outs[False][1].conv))
    assert rel_err(outs[True][1].ssm, np.asarray(outs[False][1].ssm)) < 2e-6
    # The chunked (SSD) verify form, the ReplaySSM default: same outputs up to rounding, the same
    # payload, so the same commit.
    assert Mamba2CommitConfig().form_for(T) == "chunked"
    assert Mamba2CommitConfig(mode="staged").form_for(T) == "recurrent"
    assert Mamba2CommitConfig().form_for(65) == "recurrent"
    layer = Mamba2Layer("layers.0", DIMS, Mamba2CommitConfig(backend=backend))
    scratch = jax.tree.map(lambda s: jnp.full_like(s, jnp.nan), new_verify_scratch(DIMS, layer.cfg, nb, T,
                                                                                    act_dtype=jnp.float32))
    res = layer.verify(weights, pools, slots, xbc, dt, jnp.asarray(parents) if tree else None, scratch, z)
    assert rel_err(res.y, np.asarray(outs[True][0], np.float64)) < 2e-5
    chunked_pools = layer.commit(weights, pools, slots, res, jnp.asarray(path), jnp.asarray(accept_len))
    np.testing.assert_array_equal(np.asarray(chunked_pools.ssm), np.asarray(outs[True][1].ssm))
    # Independent fp64 check: conv per path, then the SSM per path on the conv outputs.
    conv_in = dict(x=np.asarray(xbc), conv_pool=np.asarray(pools.conv), weight=np.asarray(weights.conv_weight),
                   bias=np.asarray(weights.conv_bias))
    conv_y, conv_rows = np_conv(conv_in, np.asarray(slots), parents, True)
    hp, gn = H * 8, 2 * N
    inp = dict(x=conv_y[..., :hp].reshape(nb, T, H, 8), dt=np.asarray(dt), A_log=np.asarray(weights.A_log),
               B=conv_y[..., hp:hp + gn].reshape(nb, T, 2, N), C=conv_y[..., hp + gn:].reshape(nb, T, 2, N),
               D=np.asarray(weights.D), dt_bias=np.asarray(weights.dt_bias), state_pool=np.asarray(pools.ssm),
               z=np.asarray(z))
    y_ref, states = np_mamba2(inp, np.asarray(slots), parents)
    assert rel_err(outs[True][0], y_ref) < 2e-5
    for b, slot in enumerate(np.asarray(slots)):
        last = path[b, accept_len[b] - 1]
        assert rel_err(outs[True][1].ssm[slot], states[b, last]) < 2e-5
        assert rel_err(outs[True][1].conv[slot], conv_rows[b, last]) < 1e-6


def test_layer_declares_tree_support_and_checks_scratch():
    with pytest.raises(ValueError, match="verify_form='chunked' forms no node states.*got mode='staged'"):
        Mamba2CommitConfig(mode="staged", verify_form="chunked")
    with pytest.raises(ValueError, match="verify_form must be one of"):
        Mamba2CommitConfig(verify_form="ssd")
    with pytest.raises(ValueError, match="fp32_dots must be one of.*'bf16'"):
        Mamba2CommitConfig(fp32_dots="bf16")
    layer = Mamba2Layer("layers.0", DIMS)
    assert layer.tree_support().verify.supported
    assert not layer.tree_support().lanes.supported
    resolve_tree_support(layer, None)  # verify side accepts a tree
    with pytest.raises(TreeSupportError, match="mamba2 linear-attention layer in draft lanes"):
        resolve_tree_support(LinearAttentionLayerSpec("la", kind="mamba2"), layer)
    with pytest.raises(ValueError, match="multiple of ngroups 3"):
        Mamba2Dims(nheads=4, headdim=8, dstate=16, ngroups=3)
    rng = np.random.default_rng(35)
    weights, pools, xbc, dt, _ = _layer_inputs(rng, 2, 4)
    staged_scratch = new_verify_scratch(DIMS, Mamba2CommitConfig(mode="staged"), 2, 4, act_dtype=jnp.float32)
    with pytest.raises(ValueError, match="scratch does not match mode='replay_ssm'"):
        mamba2_verify(DIMS, Mamba2CommitConfig(backend="interpret"), weights, pools, jnp.asarray([0, 1]), xbc, dt,
                      None, staged_scratch)
