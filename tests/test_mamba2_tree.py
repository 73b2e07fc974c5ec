"""Mamba2 tree verify scan: Pallas (interpret mode) and the fp32 reference against a per-path fp64
numpy recurrence; chain-as-parents vs the parent-less kernel; staged vs ReplaySSM outputs; padded
requests; bad inputs; both replay walks (parent pointers and the precomputed ancestor list), the
per-step plan shared by layers, and the Triton lowering for sm_90."""

import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err
from tiers import sweep
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
def test_staged_tree_scan_matches_per_path_recurrence(T, P, block_p, G, with_z, backend):
    rng = np.random.default_rng(1000 + T)
    nb = 2
    inp = mamba2_inputs(rng, nb, T, P, G, with_z)
    parents = random_parents(rng, nb, T)
    slots = np.array([3, 1], np.int32)
    scratch = jnp.full((nb, T, H, P, N), jnp.nan, jnp.float32)
    y, states = scan(inp, slots, parents, mode="staged", scratch=scratch, block_p=block_p, backend=backend)
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    assert rel_err(y, y_ref) < 2e-5
    assert rel_err(states, st_ref) < 2e-5


def test_padded_request_reads_and_writes_nothing(backend):
    rng = np.random.default_rng(7)
    nb, T, P = 2, 6, 8
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([-1, 2], np.int32)
    inp["state_pool"][0] = np.nan  # a padded request must not read any slot (slot 0 included)
    scratch = jnp.full((nb, T, H, P, N), jnp.nan, jnp.float32)
    y, states = scan(inp, slots, parents, mode="staged", scratch=scratch, backend=backend)
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    assert np.all(np.asarray(y[0]) == 0.0)
    assert np.isnan(np.asarray(states[0])).all(), "padded request's scratch rows were written"
    assert rel_err(y[1], y_ref[1]) < 2e-5 and rel_err(states[1], st_ref[1]) < 2e-5


def test_forest_roots_read_committed_state(backend):
    rng = np.random.default_rng(8)
    nb, T, P = 2, 14, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    parents = random_parents(rng, nb, T, forest=True)
    assert (parents[:, 1:] == -1).any()
    slots = np.array([4, 0], np.int32)
    y, _ = scan(inp, slots, parents, backend=backend)
    assert rel_err(y, np_mamba2(inp, slots, parents)[0]) < 2e-5


def test_chain_as_parents_equals_chain_kernel(backend):
    rng = np.random.default_rng(9)
    nb, T, P = 2, 14, 16
    inp = mamba2_inputs(rng, nb, T, P, 2)
    slots = np.array([0, 3], np.int32)
    y_tree, s_tree = scan(inp, slots, np.asarray(chain_parents(nb, T)), mode="staged",
                          scratch=jnp.full((nb, T, H, P, N), jnp.nan), backend=backend)
    y_chain, s_chain = scan(inp, slots, None, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan),
                            backend=backend)
    # Same arithmetic in the same order: a chain never takes the branch path.
    np.testing.assert_array_equal(np.asarray(y_tree), np.asarray(y_chain))
    np.testing.assert_array_equal(np.asarray(s_tree), np.asarray(s_chain))
    assert rel_err(y_chain, np_mamba2(inp, slots, np.asarray(chain_parents(nb, T)))[0]) < 2e-5


@sweep  # a loop form of the same kernel
def test_unrolled_node_loop_matches_rolled(backend):
    rng = np.random.default_rng(15)
    nb, T, P = 2, 10, 8
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1], np.int32)
    y, st = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan), backend=backend)
    yu, stu = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan), unroll=True,
                   backend=backend)
    assert rel_err(yu, np.asarray(y, np.float64)) < 1e-6
    assert rel_err(stu[0], np.asarray(st[0], np.float64)) < 1e-6
    assert np.isnan(np.asarray(stu[1])).all()


def test_replay_mode_same_outputs_and_payload_rows(backend):
    rng = np.random.default_rng(10)
    nb, T, P, G = 2, 16, 8, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = random_parents(rng, nb, T)
    slots = np.array([2, -1], np.int32)
    layout = Mamba2PayloadLayout(G, N, H, P)
    y_staged, _ = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan),
                       backend=backend)
    y_replay, payload = scan(inp, slots, parents, mode="replay",
                             payload=jnp.full((nb, T, layout.width), jnp.nan), backend=backend)
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


def test_bf16_inputs_within_tolerance(backend):
    rng = np.random.default_rng(12)
    nb, T, P = 2, 8, 16
    inp = mamba2_inputs(rng, nb, T, P, 2)
    parents = random_parents(rng, nb, T)
    slots = np.array([0, 1], np.int32)
    bf = {k: (None if v is None else jnp.asarray(v, jnp.bfloat16)) for k, v in inp.items()}
    bf["state_pool"] = jnp.asarray(inp["state_pool"])  # fp32 pool, bf16 activations
    as_np = {k: (None if v is None else np.asarray(jnp.asarray(v, jnp.float32))) for k, v in bf.items()}
    y, _ = scan(bf, slots, parents, backend=backend)
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


# ----------------------------------------------------------------------------------------------
# The precomputed ancestor walk and the per-step plan
# ----------------------------------------------------------------------------------------------

# Depth-first tree with branch points nested three deep (0 > 1 > 2 and 8 > 9): replays of every depth.
NESTED = np.array([-1, 0, 1, 2, 2, 1, 5, 5, 0, 8, 9, 9, 8, 12, 12, 0], np.int32)


def test_ancestor_paths_and_plan_match_numpy():
    from pallas_kernels.linear.mamba2_tree import ancestor_paths, mamba2_scan_plan

    rng = np.random.default_rng(40)
    parents = np.concatenate([NESTED[None], random_parents(rng, 2, 16, forest=True)])
    parents[2, 5], parents[2, 9] = 9, -7  # malformed pointers read as roots
    clean = np.where((parents >= 0) & (parents < np.arange(16)), parents, -1)
    depth, paths = (np.asarray(a) for a in ancestor_paths(jnp.asarray(parents)))
    for b in range(3):
        for t in range(16):
            want = path_to(clean[b], t)
            assert depth[b, t] == len(want) - 1
            np.testing.assert_array_equal(paths[b, t], want + [-1] * (16 - len(want)))
    plan = mamba2_scan_plan(jnp.asarray(parents))
    np.testing.assert_array_equal(np.asarray(plan.depth), depth)
    np.testing.assert_array_equal(np.asarray(plan.paths), paths)


def _walk_trees(rng, T=16):
    """Request 0: the nested tree; 1: random; 2: a padded request."""
    return np.concatenate([NESTED[None, :T], random_parents(rng, 2, T)])


@pytest.mark.parametrize("walk", ["precomputed", "parents"])
def test_walks_match_per_path(walk, backend):
    """Both walks: y and staged states equal the per-path recurrence; ReplaySSM y is bitwise the
    staged y; payload rows exact; padded rows and the pool untouched."""
    from pallas_kernels.linear.mamba2_tree import mamba2_scan_plan

    rng = np.random.default_rng(41)
    nb, T, P, G = 3, 16, 8, 2
    inp = mamba2_inputs(rng, nb, T, P, G)
    parents = _walk_trees(rng, T)
    slots = np.array([3, 0, -1], np.int32)
    plan = mamba2_scan_plan(jnp.asarray(parents))
    pool_before = inp["state_pool"].copy()
    kw = dict(walk=walk, backend=backend)
    y, states = scan(inp, slots, parents, mode="staged", scratch=jnp.full((nb, T, H, P, N), jnp.nan), plan=plan, **kw)
    layout = Mamba2PayloadLayout(G, N, H, P)
    y_r, payload = scan(inp, slots, parents, mode="replay", payload=jnp.full((nb, T, layout.width), jnp.nan), **kw)
    y_ref, st_ref = np_mamba2(inp, slots, parents)
    live = slots >= 0
    assert rel_err(np.asarray(y)[live], y_ref[live]) < 2e-5
    assert rel_err(np.asarray(states)[live], st_ref[live]) < 2e-5
    np.testing.assert_array_equal(np.asarray(y_r), np.asarray(y))
    a = _j(inp)
    np.testing.assert_array_equal(np.asarray(payload)[live], np.asarray(layout.pack(a["B"], a["x"], a["dt"]))[live])
    assert np.isnan(np.asarray(payload)[~live]).all() and np.isnan(np.asarray(states)[~live]).all()
    assert np.all(np.asarray(y)[~live] == 0.0)
    np.testing.assert_array_equal(inp["state_pool"], pool_before)


def test_precomputed_walk_really_reads_the_plan(backend):
    """A plan of another tree gives wrong branches under walk="precomputed" (so the ancestor list
    is what the replay follows), while the parent walk ignores the plan."""
    from pallas_kernels.linear.mamba2_tree import mamba2_scan_plan

    rng = np.random.default_rng(43)
    nb, T, P = 1, 16, 8
    inp = mamba2_inputs(rng, nb, T, P, 1, with_z=False)
    parents, slots = NESTED[None], np.array([1], np.int32)
    y_ref = np_mamba2(inp, slots, parents)[0]
    other = mamba2_scan_plan(jnp.asarray(random_parents(rng, nb, T)))
    y_bad, _ = scan(inp, slots, parents, walk="precomputed", plan=other, backend=backend)
    assert rel_err(y_bad, y_ref) > 1e-2
    y_par, _ = scan(inp, slots, parents, walk="parents", plan=other, backend=backend)
    assert rel_err(y_par, y_ref) < 2e-5


def test_malformed_parents_terminate_in_every_walk(backend):
    """A self-loop or out-of-range parent must not hang or read out of bounds; earlier nodes exact."""
    rng = np.random.default_rng(44)
    nb, T, P = 2, 8, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    parents = random_parents(rng, nb, T)
    good = parents.copy()
    parents[0, 5] = 5
    parents[1, 4] = 70
    slots = np.array([0, 1], np.int32)
    y_ref, _ = np_mamba2(inp, slots, good)
    for walk in ("precomputed", "parents"):
        y, _ = scan(inp, slots, parents, walk=walk, backend=backend)
        assert np.isfinite(np.asarray(y)).all()
        assert rel_err(np.asarray(y)[0, :5], y_ref[0, :5]) < 2e-5
        assert rel_err(np.asarray(y)[1, :4], y_ref[1, :4]) < 2e-5


def test_layer_shares_one_step_plan(backend):
    """Two layers of a step reuse one plan: same y as each building its own, either walk."""
    import jax
    from test_mamba2_commit import DIMS, _layer_inputs

    from treespec_jax.linear.mamba2 import Mamba2CommitConfig, Mamba2Layer, new_verify_scratch

    rng = np.random.default_rng(45)
    nb, T = 2, 8
    weights, pools, xbc, dt, z = _layer_inputs(rng, nb, T)
    parents = jnp.asarray(random_parents(rng, nb, T))
    slots = jnp.asarray([1, 3], jnp.int32)
    layers = [Mamba2Layer(f"layers.{i}", DIMS, Mamba2CommitConfig(backend=backend, walk=w,
                                                                    verify_form="recurrent"))
              for i, w in enumerate(("precomputed", "parents"))]
    plan = layers[0].step_plan(parents)
    assert plan.conv_lags.shape == (nb, T, DIMS.conv_width - 1) and layers[0].step_plan(None) is None
    assert plan.scan is not None and plan.scan.paths.shape == (nb, T, T)
    assert layers[1].step_plan(parents).scan is None  # the parent walk needs no scan plan
    scratch = jax.tree.map(lambda s: jnp.full_like(s, jnp.nan),
                           new_verify_scratch(DIMS, layers[0].cfg, nb, T, act_dtype=jnp.float32))
    shared = layers[0].verify(weights, pools, slots, xbc, dt, parents, scratch, z, plan=plan)
    own = layers[0].verify(weights, pools, slots, xbc, dt, parents, scratch, z)
    np.testing.assert_array_equal(np.asarray(shared.y), np.asarray(own.y))
    np.testing.assert_array_equal(np.asarray(shared.scratch.ssm), np.asarray(own.scratch.ssm))
    by_parents = layers[1].verify(weights, pools, slots, xbc, dt, parents, scratch, z,
                                  plan=layers[1].step_plan(parents))
    assert rel_err(by_parents.y, np.asarray(shared.y, np.float64)) < 1e-6
    with pytest.raises(ValueError, match="Mamba2CommitConfig.walk must be one of"):
        Mamba2CommitConfig(walk="pointers")


def test_plan_and_walk_arguments_are_checked():
    from pallas_kernels.linear.mamba2_tree import mamba2_scan_plan

    rng = np.random.default_rng(46)
    nb, T, P = 2, 6, 8
    inp = mamba2_inputs(rng, nb, T, P, 1)
    slots = np.array([0, 1], np.int32)
    parents = random_parents(rng, nb, T)
    with pytest.raises(ValueError, match="walk must be one of"):
        scan(inp, slots, parents, walk="pointers", backend="interpret")
    with pytest.raises(ValueError, match=r"plan.depth must be \[2, 6\], got \[2, 7\]"):
        wrong = mamba2_scan_plan(jnp.asarray(random_parents(rng, nb, T + 1)))
        scan(inp, slots, parents, walk="precomputed", plan=wrong, backend="interpret")
    with pytest.raises(ValueError, match="plan given without parents"):
        scan(inp, slots, None, plan=mamba2_scan_plan(jnp.asarray(parents)), backend="interpret")
    with pytest.raises(ValueError, match="num_warps must be a power of two, got 3"):
        scan(inp, slots, parents, num_warps=3, backend="interpret")


def pretend_sm90_with_nemotron_args(monkeypatch):
    """Makes Pallas lower for an sm_90 GPU on the CPU; returns ShapeDtypeStructs of one replay-mode
    scan call at Nemotron-H-like head dims: (x, dt, A_log, B, C, D, dt_bias, pool, slots, parents,
    payload). Shared with the chunked form's lowering test."""
    import jax
    import jax._src.pallas.triton.pallas_call_registration as reg

    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    nb, T, P, G, Nn, Hh = 2, 16, 64, 2, 128, 4
    sd = jax.ShapeDtypeStruct
    bf = jnp.bfloat16
    lay = Mamba2PayloadLayout(G, Nn, Hh, P)
    return (sd((nb, T, Hh, P), bf), sd((nb, T, Hh), bf), sd((Hh,), jnp.float32), sd((nb, T, G, Nn), bf),
            sd((nb, T, G, Nn), bf), sd((Hh,), jnp.float32), sd((Hh,), jnp.float32), sd((6, Hh, P, Nn), jnp.float32),
            sd((nb,), jnp.int32), sd((nb, T), jnp.int32), sd((nb, T, lay.width), bf))


def test_tree_scan_lowers_to_triton_for_sm90(monkeypatch):
    """Pallas -> Triton IR for sm_90 without a GPU, for both walks (the PTX compile and the numbers
    are the GPU bench's)."""
    import jax

    args = pretend_sm90_with_nemotron_args(monkeypatch)
    for kw in (dict(walk="precomputed"), dict(walk="parents", block_p=16, num_warps=2)):
        def f(x, dt, al, B, C, D, dtb, pool, sl, par, pay, kw=kw):
            return mamba2_tree_scan(x, dt, al, B, C, D, dtb, pool, sl, par, z=x, mode="replay", payload=pay, **kw)

        text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text, kw


def test_scan_default_config_rule():
    """`default_config(P, N)`: the widest power-of-two channel tile whose [block_p, next_pow2(N)] fp32
    tile holds at most 2048 elements, never wider than next_pow2(P); loose keywords override it."""
    from pallas_kernels.linear.mamba2_tree import Mamba2ScanConfig, default_config
    assert default_config(64, 128) == Mamba2ScanConfig(block_p=16, num_warps=4, unroll=False)
    assert default_config(8, 16) == Mamba2ScanConfig(block_p=8)
    assert default_config(64, 4096).block_p == 1
    with pytest.raises(ValueError, match="block_p must be a power of two, got 6"):
        Mamba2ScanConfig(block_p=6)
