"""Mamba2 tree verify scan: Pallas (interpret mode) and the fp32 reference against a per-path fp64
numpy recurrence; chain-as-parents vs the parent-less kernel; staged vs ReplaySSM outputs; padded
requests; bad inputs."""

import jax.numpy as jnp
import numpy as np
import pytest
from trees import random_parents

from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout
from pallas_kernels.linear.mamba2_tree import mamba2_tree_scan
from treespec_jax.tree.masks import chain_parents

H = 4
N = 16
S = 5  # pool slots


def mamba2_inputs(rng, nb, T, P, G, with_z=True, dtype=np.float32):
    f = lambda *s: rng.standard_normal(s).astype(dtype)
    return dict(
        x=f(nb, T, H, P), dt=f(nb, T, H), A_log=rng.uniform(-1.0, 1.0, H).astype(dtype),
        B=f(nb, T, G, N), C=f(nb, T, G, N), D=f(H), dt_bias=(0.5 * f(H)).astype(dtype),
        state_pool=f(S, H, P, N), z=f(nb, T, H, P) if with_z else None,
    )


def _softplus(v):
    return np.where(v > 20, v, np.log1p(np.exp(np.minimum(v, 20))))


def path_to(par_row, t):
    path = []
    while t >= 0:
        path.append(t)
        t = int(par_row[t])
    return path[::-1]


def np_mamba2(inp, slots, parents):
    """Per-path fp64 recurrence: every node walks its own root..t path from the committed state."""
    g = {k: (None if v is None else np.asarray(v, np.float64)) for k, v in inp.items()}
    nb, T, _, P = g["x"].shape
    G = g["B"].shape[2]
    hpg = H // G
    A = -np.exp(g["A_log"])
    y = np.zeros((nb, T, H, P))
    states = np.zeros((nb, T, H, P, N))
    for b in range(nb):
        if slots[b] < 0:
            continue
        for t in range(T):
            h = g["state_pool"][slots[b]].copy()
            for s in path_to(parents[b], t):
                dtp = _softplus(g["dt"][b, s] + g["dt_bias"])
                Bh = g["B"][b, s][np.arange(H) // hpg]  # [H, N]
                h = np.exp(dtp * A)[:, None, None] * h + (dtp[:, None] * g["x"][b, s])[:, :, None] * Bh[:, None, :]
            Ch = g["C"][b, t][np.arange(H) // hpg]
            out = np.einsum("hpn,hn->hp", h, Ch) + g["D"][:, None] * g["x"][b, t]
            if g["z"] is not None:
                zz = g["z"][b, t]
                out = out * zz / (1 + np.exp(-zz))
            y[b, t], states[b, t] = out, h
    return y, states


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    assert not np.isnan(out).any(), "NaN in output"
    return np.linalg.norm(out - ref) / np.linalg.norm(ref)


def _j(inp):
    return {k: (None if v is None else jnp.asarray(v)) for k, v in inp.items()}


def scan(inp, slots, parents, **kw):
    a = _j(inp)
    return mamba2_tree_scan(a["x"], a["dt"], a["A_log"], a["B"], a["C"], a["D"], a["dt_bias"], a["state_pool"],
                            jnp.asarray(slots), None if parents is None else jnp.asarray(parents), z=a["z"], **kw)


# Each case names (T, headdim, block_p, ngroups, z); together they cover every T the issue lists,
# both group counts, z on/off, and a headdim split over two programs.
CASES = [(1, 8, None, 1, False), (6, 16, 8, 2, True), (8, 8, None, 1, True), (14, 16, None, 2, False),
         (16, 16, 8, 1, True), (33, 8, None, 2, True), (64, 16, None, 2, False)]


@pytest.mark.parametrize("T,P,block_p,G,with_z", CASES)
def test_staged_tree_scan_matches_per_path_recurrence(T, P, block_p, G, with_z):
    rng = np.random.default_rng(1000 + T)
    nb = 2
    inp = mamba2_inputs(rng, nb, T, P, G, with_z)
    parents = random_parents(rng, nb, T)
    slots = np.array([3, 1], np.int32)
    scratch = jnp.full((nb, T, H, P, N), jnp.nan, jnp.float32)
    y, states = scan(inp, slots, parents, mode="staged", scratch=scratch, block_p=block_p, backend="interpret")
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    assert rel_err(y, y_ref) < 2e-5
    assert rel_err(states, st_ref) < 2e-5


def test_padded_request_reads_and_writes_nothing():
    rng = np.random.default_rng(7)
    nb, T, P = 2, 6, 8
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([-1, 2], np.int32)
    inp["state_pool"][0] = np.nan  # a padded request must not read any slot (slot 0 included)
    scratch = jnp.full((nb, T, H, P, N), jnp.nan, jnp.float32)
    y, states = scan(inp, slots, parents, mode="staged", scratch=scratch, backend="interpret")
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    assert np.all(np.asarray(y[0]) == 0.0)
    assert np.isnan(np.asarray(states[0])).all(), "padded request's scratch rows were written"
    assert rel_err(y[1], y_ref[1]) < 2e-5 and rel_err(states[1], st_ref[1]) < 2e-5


def test_forest_roots_read_committed_state():
    rng = np.random.default_rng(8)
    nb, T, P = 2, 14, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    parents = random_parents(rng, nb, T, forest=True)
    assert (parents[:, 1:] == -1).any()
    slots = np.array([4, 0], np.int32)
    y, _ = scan(inp, slots, parents, backend="interpret")
    assert rel_err(y, np_mamba2(inp, slots, parents)[0]) < 2e-5


def test_malformed_parents_terminate():
    """A self-loop or forward parent pointer must not hang the walk; earlier nodes stay exact."""
    rng = np.random.default_rng(14)
    nb, T, P = 2, 8, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    parents = random_parents(rng, nb, T)
    good = parents.copy()
    parents[0, 5] = 5  # self-loop
    parents[1, 4] = 7  # points forward
    slots = np.array([0, 1], np.int32)
    y, _ = scan(inp, slots, parents, backend="interpret")
    y_ref, _ = np_mamba2(inp, slots, good)
    assert rel_err(np.asarray(y)[0, :5], y_ref[0, :5]) < 2e-5
    assert rel_err(np.asarray(y)[1, :4], y_ref[1, :4]) < 2e-5


def test_chain_as_parents_equals_chain_kernel():
    rng = np.random.default_rng(9)
    nb, T, P = 2, 14, 16
    inp = mamba2_inputs(rng, nb, T, P, 2)
    slots = np.array([0, 3], np.int32)
    y_tree, s_tree = scan(inp, slots, np.asarray(chain_parents(nb, T)), mode="staged",
                          scratch=jnp.full((nb, T, H, P, N), jnp.nan), backend="interpret")
    y_chain, s_chain = scan(inp, slots, None, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan),
                            backend="interpret")
    # Same arithmetic in the same order: a chain never takes the branch path.
    np.testing.assert_array_equal(np.asarray(y_tree), np.asarray(y_chain))
    np.testing.assert_array_equal(np.asarray(s_tree), np.asarray(s_chain))
    assert rel_err(y_chain, np_mamba2(inp, slots, np.asarray(chain_parents(nb, T)))[0]) < 2e-5


def test_unrolled_node_loop_matches_rolled():
    rng = np.random.default_rng(15)
    nb, T, P = 2, 14, 8
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1], np.int32)
    y, st = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan), backend="interpret")
    yu, stu = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan), unroll=True,
                   backend="interpret")
    assert rel_err(yu, np.asarray(y, np.float64)) < 1e-6
    assert rel_err(stu[0], np.asarray(st[0], np.float64)) < 1e-6
    assert np.isnan(np.asarray(stu[1])).all()


def test_replay_mode_same_outputs_and_payload_rows():
    rng = np.random.default_rng(10)
    nb, T, P, G = 2, 16, 8, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1], np.int32)
    layout = Mamba2PayloadLayout(G, N, H, P)
    y_staged, _ = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan),
                       backend="interpret")
    y_replay, payload = scan(inp, slots, parents, mode="replay",
                             payload=jnp.full((nb, T, layout.width), jnp.nan), backend="interpret")
    np.testing.assert_array_equal(np.asarray(y_replay), np.asarray(y_staged))
    a = _j(inp)
    want = np.asarray(layout.pack(a["B"], a["x"], a["dt"]))
    np.testing.assert_array_equal(np.asarray(payload[0]), want[0])  # every column written, exactly
    assert np.isnan(np.asarray(payload[1])).all(), "padded request's payload rows were written"


@pytest.mark.parametrize("T,G", [(14, 2)])
def test_reference_matches_per_path_recurrence(T, G):
    rng = np.random.default_rng(11 + T)
    nb, P = 2, 8
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = random_parents(rng, nb, T)
    slots = np.array([1, -1], np.int32)
    y, states = scan(inp, slots, parents, mode="staged", scratch=jnp.zeros((nb, T, H, P, N)), backend="reference")
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(states[0], st_ref[0]) < 1e-5


def test_bf16_inputs_within_tolerance():
    rng = np.random.default_rng(12)
    nb, T, P = 2, 8, 16
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([0, 1], np.int32)
    bf = {k: (None if v is None else jnp.asarray(v, jnp.bfloat16)) for k, v in inp.items()}
    bf["state_pool"] = jnp.asarray(inp["state_pool"])  # fp32 pool, bf16 activations
    as_np = {k: (None if v is None else np.asarray(jnp.asarray(v, jnp.float32))) for k, v in bf.items()}
    y, _ = scan(bf, slots, parents, backend="interpret")
    assert y.dtype == jnp.bfloat16
    assert rel_err(np.asarray(y.astype(jnp.float32)), np_mamba2(as_np, slots, parents)[0]) < 1e-2


def test_bad_inputs_name_the_value():
    rng = np.random.default_rng(13)
    nb, T, P = 2, 6, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    slots = np.array([0, 1], np.int32)
    with pytest.raises(ValueError, match="multiple of ngroups 3"):
        bad = dict(inp, B=inp["B"].repeat(3, 2), C=inp["C"].repeat(3, 2))
        scan(bad, slots, None, backend="interpret")
    with pytest.raises(ValueError, match="staged mode needs scratch"):
        scan(inp, slots, None, mode="staged", backend="interpret")
    with pytest.raises(ValueError, match="mode must be one of"):
        scan(inp, slots, None, mode="stage", backend="interpret")
    with pytest.raises(ValueError, match="payload dtype bfloat16"):
        scan(inp, slots, None, mode="replay", payload=jnp.zeros((nb, T, Mamba2PayloadLayout(1, N, H, P).width),
                                                                jnp.bfloat16), backend="interpret")
    with pytest.raises(ValueError, match="parents must be"):
        scan(inp, slots, np.zeros((nb, T + 1), np.int32), backend="interpret")
    with pytest.raises(ValueError, match="block_p must be a power of two, got 6"):
        scan(inp, slots, None, block_p=6, backend="interpret")
    with pytest.raises(ValueError, match="unknown kernel backend 'triton'"):
        scan(inp, slots, None, backend="triton")
