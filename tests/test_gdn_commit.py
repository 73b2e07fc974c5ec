"""GDN commits: staged (copy the last accepted node's scratch row) and ReplaySSM (pack the accepted
payload rows with the row-move entry point, replay them as a chain in place), against an fp64
numpy recurrence along the accepted path."""

import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

from gdn_numpy import B, DK, DV, H, HV, per_path_numpy, random_inputs, random_path, random_tree
from tiers import cases
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_replay import gdn_replay_commit
from pallas_kernels.row_move import pack_path_rows
from treespec_jax.linear.gdn import (
    FusedChainGdnLayer, GdnLayerConfig, GdnTree, GdnTreeLayer, gdn_commit_replay, gdn_commit_staged, gdn_verify)
from treespec_jax.support import BackendGroup, TreeSupportError, resolve_tree_support

WIDTH = GdnPayloadLayout(H, HV, DK, DV).width
TOL = 2e-5


def _args(x):
    return [jnp.asarray(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "state_slots")]


def _nan_states(t):
    return jnp.full((B, t, HV, DK, DV), jnp.nan, jnp.float32)


def _check_pool(new_pool, x, path, accept, ref_states):
    """Committed rows equal the state after the last accepted node; every other pool row is unchanged."""
    new_pool = np.asarray(new_pool)
    old_pool = np.asarray(x["state_pool"])
    committed = set()
    for b in range(B):
        slot = x["state_slots"][b]
        if accept[b] == 0:
            continue
        committed.add(int(slot))
        assert rel_err(new_pool[slot], ref_states[b, path[b, accept[b] - 1]]) < TOL
    for s in range(old_pool.shape[0]):
        if s not in committed:
            np.testing.assert_array_equal(new_pool[s].view(np.uint32), old_pool[s].view(np.uint32))


@pytest.mark.parametrize("t, shape", cases([(16, "tree"), (33, "tree"), (8, "chain")], default=(0, 2)))
def test_replay_and_staged_commits_equal_last_accepted_state(t, shape, backend):
    rng = np.random.default_rng(300 + t)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t) if shape == "tree" else None
    tree_parents = parents if parents is not None else np.broadcast_to(np.arange(t, dtype=np.int32) - 1, (B, t))
    path, accept = random_path(rng, tree_parents)
    _, ref_states = per_path_numpy(x, tree_parents, use_qk_l2norm=True)
    args = _args(x)
    tree = None if parents is None else GdnTree.from_parents(jnp.asarray(parents))

    # T=16 takes the chunked form (payload from the chunked kernel), the others the recurrent one.
    replay_cfg = GdnLayerConfig(H, HV, DK, DV, mode="replay_ssm", chunked_tree_verify=t == 16)
    ver = gdn_verify(replay_cfg, *args, node_states=_nan_states(t),
                     payload=jnp.full((B, t, WIDTH), jnp.nan, jnp.float32), tree=tree, backend=backend)
    pool_replay, packed = gdn_commit_replay(replay_cfg, args[7], args[8], ver.payload, jnp.asarray(path),
                                            jnp.asarray(accept), args[5], args[6], backend=backend)
    _check_pool(pool_replay, x, path, accept, ref_states)
    # The packed window front holds the path's rows in depth order.
    rows = np.asarray(pack_payload(*args[1:5]))
    for b in range(B):
        np.testing.assert_array_equal(np.asarray(packed)[b, : accept[b]], rows[b, path[b, : accept[b]]])

    staged_cfg = GdnLayerConfig(H, HV, DK, DV, mode="staged")
    st = gdn_verify(staged_cfg, *args, node_states=_nan_states(t), tree=tree, backend=backend)
    pool_staged = gdn_commit_staged(args[7], args[8], st.node_states, jnp.asarray(path), jnp.asarray(accept))
    _check_pool(pool_staged, x, path, accept, ref_states)
    assert rel_err(pool_staged, pool_replay) < TOL


def test_padded_request_commits_nothing_and_replay_clips_to_window():
    """accept_len 0 leaves the slot bitwise untouched; accept_len > T replays exactly T rows."""
    t = 6
    rng = np.random.default_rng(21)
    x = random_inputs(rng, B, t)
    args = _args(x)
    parents = np.broadcast_to(np.arange(t, dtype=np.int32) - 1, (B, t)).copy()
    _, ref_states = per_path_numpy(x, parents, use_qk_l2norm=False)
    payload = pack_payload(*args[1:5])
    num_rows = jnp.asarray([0, t + 3], jnp.int32)
    for backend in ("interpret", "reference"):
        pool = gdn_replay_commit(args[7], args[8], payload, num_rows, args[5], args[6], num_k_heads=H,
                                 head_k_dim=DK, use_qk_l2norm=False, backend=backend)
        pool = np.asarray(pool)
        s0, s1 = x["state_slots"]
        np.testing.assert_array_equal(pool[s0].view(np.uint32), x["state_pool"][s0].view(np.uint32))
        assert rel_err(pool[s1], ref_states[1, t - 1]) < TOL
    staged = gdn_commit_staged(args[7], args[8], jnp.asarray(ref_states, jnp.float32),
                               jnp.asarray(parents + 1), jnp.asarray([0, 3], jnp.int32))
    np.testing.assert_array_equal(np.asarray(staged)[s0].view(np.uint32), x["state_pool"][s0].view(np.uint32))
    assert rel_err(np.asarray(staged)[s1], ref_states[1, 2]) < TOL  # chain: path[accept - 1] = 2


def test_pack_path_rows_moves_path_rows_to_front():
    rng = np.random.default_rng(4)
    t = 10
    payload = jnp.asarray(rng.standard_normal((B, t, 7)), jnp.float32)
    path = np.full((B, t), -1, np.int32)
    path[0, :3] = [0, 2, 7]
    path[1, :4] = [0, 1, 5, 9]
    accept = np.array([3, 4], np.int32)
    packed = np.asarray(pack_path_rows(payload, jnp.asarray(path), jnp.asarray(accept)))
    p = np.asarray(payload)
    for b in range(B):
        np.testing.assert_array_equal(packed[b, : accept[b]], p[b, path[b, : accept[b]]])
        np.testing.assert_array_equal(packed[b, accept[b]:], p[b, accept[b]:])


def test_commit_bad_inputs_are_named():
    rng = np.random.default_rng(2)
    x = random_inputs(rng, B, 4)
    args = _args(x)
    payload = pack_payload(*args[1:5])
    with pytest.raises(ValueError, match="num_k_heads=3"):
        gdn_replay_commit(args[7], args[8], payload, jnp.ones(B, jnp.int32), args[5], args[6],
                          num_k_heads=3, head_k_dim=DK)
    with pytest.raises(ValueError, match=rf"payload must be \[B, T, {WIDTH}\]"):
        gdn_replay_commit(args[7], args[8], payload[..., :-1], jnp.ones(B, jnp.int32), args[5], args[6],
                          num_k_heads=H, head_k_dim=DK)
    with pytest.raises(ValueError, match="mode 'replay_ssm'"):
        gdn_commit_replay(GdnLayerConfig(H, HV, DK, DV, mode="staged"), args[7], args[8], payload,
                          jnp.zeros((B, 4), jnp.int32), jnp.ones(B, jnp.int32), args[5], args[6])


def test_tree_support_declarations():
    hybrid = BackendGroup("hybrid", (GdnTreeLayer("layers.0"), GdnTreeLayer("layers.1", mode="staged")))
    assert resolve_tree_support(BackendGroup("target", (hybrid,)), None).tree
    fused = BackendGroup("target", (hybrid, FusedChainGdnLayer("layers.2")))
    with pytest.raises(TreeSupportError, match="target/layers.2: kda_fused_chain follows a chain"):
        resolve_tree_support(fused, None)
    # No recurrent layer can sit in draft lanes.
    with pytest.raises(TreeSupportError, match="lanes drafter/layers.0"):
        resolve_tree_support(BackendGroup("target"), BackendGroup("drafter", (GdnTreeLayer("layers.0"),)))
