"""GDN tree verify: recurrent (staged / ReplaySSM), chain, chunked form; Pallas in interpret mode
against an fp64 numpy recurrence along each node's root path."""

import jax.numpy as jnp
import numpy as np
import pytest

from gdn_numpy import B, DK, DV, H, HV, branch_rows, chain, per_path_numpy, random_inputs, random_tree, rel_err
from pallas_kernels.linear.gdn_chunked import gdn_chunked_verify
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_chunked_reference
from pallas_kernels.linear.gdn_tree import GdnKernelConfig, branch_points, gdn_tree_verify
from treespec_jax.linear.gdn import (
    GDN_TREE_VERIFY_CHUNKED_MAX_NODES, GDN_TREE_VERIFY_CHUNKED_MIN_NODES, GdnLayerConfig, GdnTree, gdn_verify,
    parents_from_ancestor_mask, verify_kernel_for)
from treespec_jax.tree.masks import ancestor_mask, ancestor_mask_bool

WIDTH = GdnPayloadLayout(H, HV, DK, DV).width
TOL = 2e-5  # fp32 kernel vs fp64 recurrence


def _args(x):
    return [jnp.asarray(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "state_slots")]


def _nan_states(t):
    return jnp.full((B, t, HV, DK, DV), jnp.nan, jnp.float32)


def _nan_payload(t, dtype=jnp.float32):
    return jnp.full((B, t, WIDTH), jnp.nan, dtype)


def _bits(x):
    return np.asarray(x).view(np.uint32)


@pytest.mark.parametrize("t, l2", [(1, True), (6, False), (14, True), (33, False), (64, True)])
def test_recurrent_tree_staged_and_replay(t, l2):
    rng = np.random.default_rng(100 + t)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    ref_out, ref_states = per_path_numpy(x, parents, use_qk_l2norm=l2)
    args = _args(x)
    pool_before = _bits(x["state_pool"]).copy()

    staged = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="every_node",
                             use_qk_l2norm=l2, backend="interpret")
    assert rel_err(staged.out, ref_out) < TOL
    assert rel_err(staged.node_states, ref_states) < TOL  # every scratch row written (NaN fails)

    # ReplaySSM here runs with dv split into two tiles of 8 columns (one program each).
    replay = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="branch_points",
                             payload=_nan_payload(t), use_qk_l2norm=l2, config=GdnKernelConfig(block_v=8),
                             backend="interpret")
    assert rel_err(replay.out, staged.out) < 1e-6
    # The committed pool is only read.
    np.testing.assert_array_equal(_bits(args[7]), pool_before)
    # The workspace holds exactly the branch points; every other row keeps its NaN poison.
    ws = np.asarray(replay.node_states)
    branch = branch_rows(parents)
    assert np.isnan(ws[~branch]).all()
    if branch.any():
        assert rel_err(ws[branch], ref_states[branch]) < TOL
    np.testing.assert_array_equal(np.asarray(branch_points(jnp.asarray(parents))), branch)
    # Payload rows are the inputs as read.
    np.testing.assert_array_equal(np.asarray(replay.payload), np.asarray(pack_payload(*args[1:5])))


def test_chain_as_parents_equals_chain_kernel():
    t = 16
    rng = np.random.default_rng(7)
    x = random_inputs(rng, B, t)
    args = _args(x)
    ref_out, ref_states = per_path_numpy(x, chain(B, t), use_qk_l2norm=True)
    as_tree = gdn_tree_verify(*args, jnp.asarray(chain(B, t)), _nan_states(t), store="every_node",
                              backend="interpret")
    as_chain = gdn_tree_verify(*args, None, _nan_states(t), store="every_node", backend="interpret")
    np.testing.assert_array_equal(np.asarray(as_tree.out), np.asarray(as_chain.out))
    np.testing.assert_array_equal(np.asarray(as_tree.node_states), np.asarray(as_chain.node_states))
    assert rel_err(as_chain.out, ref_out) < TOL
    assert rel_err(as_chain.node_states, ref_states) < TOL
    # A chain under ReplaySSM stores no state at all.
    replay = gdn_tree_verify(*args, None, _nan_states(t), store="branch_points", backend="interpret")
    assert np.isnan(np.asarray(replay.node_states)).all()
    np.testing.assert_array_equal(np.asarray(replay.out), np.asarray(as_chain.out))


@pytest.mark.parametrize("t, l2, shape", [(8, True, "chain"), (14, False, "tree"), (16, True, "tree")])
def test_chunked_matches_recurrent(t, l2, shape):
    rng = np.random.default_rng(200 + t)
    x = random_inputs(rng, B, t)
    parents = chain(B, t) if shape == "chain" else random_tree(rng, B, t)
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=l2)
    args = _args(x)
    pool_before = _bits(x["state_pool"]).copy()
    out, payload = gdn_chunked_verify(*args, ancestor_mask(jnp.asarray(parents)), _nan_payload(t),
                                      use_qk_l2norm=l2, backend="interpret")
    assert rel_err(out, ref_out) < TOL
    recurrent = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="every_node",
                                use_qk_l2norm=l2, backend="interpret")
    assert rel_err(out, recurrent.out) < TOL
    np.testing.assert_array_equal(np.asarray(payload), np.asarray(pack_payload(*args[1:5])))
    np.testing.assert_array_equal(_bits(args[7]), pool_before)


def test_chunked_reference_states_match_per_path():
    t = 16
    rng = np.random.default_rng(5)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    ref_out, ref_states = per_path_numpy(x, parents, use_qk_l2norm=True)
    out, states = gdn_chunked_reference(*_args(x), ancestor_mask_bool(jnp.asarray(parents)),
                                        use_qk_l2norm=True)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(states, ref_states) < TOL


def test_layer_verify_dispatch_and_modes_agree():
    """With chunked_tree_verify, gdn_verify picks the chunked form for 8..16-node ReplaySSM trees;
    masks alone describe the tree."""
    assert (GDN_TREE_VERIFY_CHUNKED_MIN_NODES, GDN_TREE_VERIFY_CHUNKED_MAX_NODES) == (8, 16)
    assert verify_kernel_for("replay_ssm", 16, True, True) == "chunked"
    assert verify_kernel_for("replay_ssm", 8, True, True) == "chunked"
    assert verify_kernel_for("replay_ssm", 7, True, True) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 17, True, True) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 16, True, False) == "recurrent_tree"
    assert verify_kernel_for("staged", 16, True, True) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 16, False, True) == "recurrent_chain"
    t = 12
    rng = np.random.default_rng(11)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=True)
    mask = ancestor_mask(jnp.asarray(parents))
    replay_cfg = GdnLayerConfig(H, HV, DK, DV, mode="replay_ssm", chunked_tree_verify=True)
    staged_cfg = GdnLayerConfig(H, HV, DK, DV, mode="staged")
    tree = GdnTree.from_ancestor_mask(mask)
    replay = gdn_verify(replay_cfg, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t),
                        tree=tree, backend="interpret")
    staged = gdn_verify(staged_cfg, *_args(x), node_states=_nan_states(t), tree=tree,
                        backend="interpret")
    assert rel_err(replay.out, ref_out) < TOL
    assert rel_err(staged.out, replay.out) < TOL
    assert np.isnan(np.asarray(replay.node_states)).all()  # the chunked form keeps no node states


def test_parents_from_ancestor_mask_64_nodes():
    rng = np.random.default_rng(3)
    parents = random_tree(rng, B, 64)
    got = parents_from_ancestor_mask(ancestor_mask(jnp.asarray(parents)))
    np.testing.assert_array_equal(np.asarray(got), parents)


def test_bf16_inputs():
    t = 6
    rng = np.random.default_rng(9)
    x = random_inputs(rng, B, t, dtype=jnp.bfloat16)
    parents = random_tree(rng, B, t)
    ref_out, _ = per_path_numpy({n: np.asarray(v, np.float32) for n, v in x.items()} | {
        "state_slots": x["state_slots"]}, parents, use_qk_l2norm=True)
    res = gdn_tree_verify(*_args(x), jnp.asarray(parents), _nan_states(t), store="branch_points",
                          payload=_nan_payload(t, jnp.bfloat16), backend="interpret")
    assert res.out.dtype == jnp.bfloat16
    assert rel_err(np.asarray(res.out, np.float32), ref_out) < 1e-2


def test_bad_inputs_are_named():
    t = 4
    rng = np.random.default_rng(1)
    x = random_inputs(rng, B, t)
    args = _args(x)
    parents = jnp.asarray(random_tree(rng, B, t))
    with pytest.raises(ValueError, match="HV=3"):
        bad = list(args)
        bad[2] = bad[2][:, :, :3]
        gdn_tree_verify(*bad, parents, _nan_states(t), store="every_node", backend="interpret")
    with pytest.raises(ValueError, match="head_k_dim dk=8"):
        bad = list(args)
        bad[0], bad[1] = bad[0][..., :8], bad[1][..., :8]
        gdn_tree_verify(*bad, parents, _nan_states(t), store="every_node", backend="interpret")
    with pytest.raises(ValueError, match="store='all'"):
        gdn_tree_verify(*args, parents, _nan_states(t), store="all", backend="interpret")
    with pytest.raises(ValueError, match="at most 16 nodes, got T=17"):
        y = random_inputs(rng, B, 17)
        gdn_chunked_verify(*_args(y), ancestor_mask(jnp.asarray(random_tree(rng, B, 17))),
                           _nan_payload(17), backend="interpret")
    with pytest.raises(ValueError, match="share one dtype"):
        gdn_tree_verify(*args, parents, _nan_states(t), store="branch_points",
                        payload=_nan_payload(t, jnp.bfloat16), backend="interpret")
    with pytest.raises(ValueError, match="block_v=4"):
        gdn_tree_verify(*args, parents, _nan_states(t), store="every_node",
                        config=GdnKernelConfig(block_v=4), backend="interpret")
    with pytest.raises(ValueError, match="block_v=8 must be a power of two >= 16"):
        gdn_chunked_verify(*args, ancestor_mask(parents), _nan_payload(t),
                           config=GdnKernelConfig(block_v=8), backend="interpret")
    with pytest.raises(ValueError, match="block_v=24"):
        gdn_tree_verify(*args, parents, _nan_states(t), store="every_node",
                        config=GdnKernelConfig(block_v=24), backend="interpret")
    with pytest.raises(ValueError, match="needs this layer's payload"):
        gdn_verify(GdnLayerConfig(H, HV, DK, DV), *args, node_states=_nan_states(t),
                   tree=GdnTree.from_parents(parents))
    with pytest.raises(ValueError, match="'eager'"):
        GdnLayerConfig(H, HV, DK, DV, mode="eager")
