"""GDN tree verify: recurrent (staged / ReplaySSM), chain, chunked form; Pallas in interpret mode
against an fp64 numpy recurrence along each node's root path."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numerics import rel_err

from gdn_numpy import B, DK, DV, H, HV, branch_rows, chain, per_path_numpy, random_inputs, random_tree
from tiers import cases, sweep
from pallas_kernels.linear.gdn_chunked import (MAX_CHUNKED_NODES, _invert_unit_lower, default_two_pass,
                                              gdn_chunked_verify, two_pass_block_v)
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_chunked_reference
from pallas_kernels.linear.gdn_common import GdnDims
from pallas_kernels.linear.gdn_tree import (GdnKernelConfig, branch_points, gdn_tree_verify, pick_launch,
                                            uses_value_major)
from treespec_jax.linear.gdn import (
    GDN_CHAIN_VERIFY_CHUNKED_NODES_64_ROWS, GDN_TREE_VERIFY_CHUNKED_MIN_NODES,
    GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES, GDN_TREE_VERIFY_CHUNKED_NODES_FUSED,
    GDN_TREE_VERIFY_CHUNKED_NODES_SMALL_GRID, GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS,
    GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID, GdnLayerConfig, GdnTree, gdn_verify,
    parents_from_ancestor_mask, verify_kernel_for)
from treespec_jax.tree.masks import ancestor_mask, ancestor_mask_bool

WIDTH = GdnPayloadLayout(H, HV, DK, DV).width
TOL = 2e-5  # fp32 kernel vs fp64 recurrence


def _args(x):
    return [jnp.asarray(x[n]) for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "state_slots")]


def _random_tree_case(seed: int, t: int):
    """Fresh inputs and a random tree of t nodes per request, with the fp64 per-path reference:
    (inputs, parents [B, t], GdnTree, ref_out, ref_states)."""
    rng = np.random.default_rng(seed)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    ref_out, ref_states = per_path_numpy(x, parents, use_qk_l2norm=True)
    return x, parents, GdnTree.from_parents(jnp.asarray(parents)), ref_out, ref_states


def _nan_states(t):
    return jnp.full((B, t, HV, DK, DV), jnp.nan, jnp.float32)


def _nan_payload(t, dtype=jnp.float32):
    return jnp.full((B, t, WIDTH), jnp.nan, dtype)


def _bits(x):
    return np.asarray(x).view(np.uint32)


def _check_replay_workspace(ws, parents, ref_states, staged_states):
    """Workspace rows: the state at exactly the branch points, NaN poison everywhere else."""
    branch = branch_rows(parents)
    assert np.isnan(ws[~branch]).all(), "a non-branch node was stored"
    if branch.any():
        assert rel_err(ws[branch], ref_states[branch]) < TOL
        np.testing.assert_array_equal(_bits(ws[branch]), _bits(np.asarray(staged_states)[branch]))
    return branch


# vm = value-major state tiles in registers.
@pytest.mark.parametrize("t, l2, vm", [(1, True, False), (6, False, True), (14, True, False),
                                       (33, False, True), (64, True, False)])
def test_recurrent_tree_staged_and_replay(t, l2, vm, backend):
    rng = np.random.default_rng(100 + t)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    ref_out, ref_states = per_path_numpy(x, parents, use_qk_l2norm=l2)
    args = _args(x)
    pool_before = _bits(x["state_pool"]).copy()

    staged = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="every_node",
                             use_qk_l2norm=l2, config=GdnKernelConfig(value_major=vm),
                             backend=backend)
    assert rel_err(staged.out, ref_out) < TOL
    assert rel_err(staged.node_states, ref_states) < TOL  # every scratch row written (NaN fails)

    # ReplaySSM here runs with dv split into two tiles of 8 columns (one program each).
    replay = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="branch_points",
                             payload=_nan_payload(t), use_qk_l2norm=l2,
                             config=GdnKernelConfig(block_v=8, value_major=vm), backend=backend)
    assert rel_err(replay.out, ref_out) < TOL
    assert rel_err(replay.out, staged.out) < 1e-6
    # The committed pool is only read.
    np.testing.assert_array_equal(_bits(args[7]), pool_before)
    branch = _check_replay_workspace(np.asarray(replay.node_states), parents, ref_states, staged.node_states)
    if t >= 33:
        assert branch.any() and not branch.all()
    np.testing.assert_array_equal(np.asarray(branch_points(jnp.asarray(parents))), branch_rows(parents))
    # Payload rows are the inputs as read.
    np.testing.assert_array_equal(np.asarray(replay.payload), np.asarray(pack_payload(*args[1:5])))


def test_replay_workspace_of_a_forest_and_the_reference_rows(backend):
    """ReplaySSM on nested branch points and a forest writes exactly the branch-point rows, and the
    reference writes the same rows."""
    t = 14
    rng = np.random.default_rng(21)
    x = random_inputs(rng, B, t)
    # Request 0: branch points 0 (children 1, 6, 12), 1 (2, 4), 6 (7, 9). Request 1, a forest: branch
    # points 0 (1, 5) and 6 (7, 12); node 9 is a second root (reads the committed state).
    parents = np.array([[-1, 0, 1, 2, 1, 4, 0, 6, 7, 6, 9, 10, 0, 12],
                        [-1, 0, 1, 2, 3, 0, 5, 6, 7, -1, 9, 10, 6, 12]], np.int32)
    ref_out, ref_states = per_path_numpy(x, parents, use_qk_l2norm=True)
    args = _args(x)
    p = jnp.asarray(parents)
    staged = gdn_tree_verify(*args, p, _nan_states(t), store="every_node", backend=backend)
    res = gdn_tree_verify(*args, p, _nan_states(t), store="branch_points", backend=backend)
    assert rel_err(res.out, ref_out) < TOL
    branch = _check_replay_workspace(np.asarray(res.node_states), parents, ref_states, staged.node_states)
    assert branch.sum() == 5
    ref = gdn_tree_verify(*args, p, _nan_states(t), store="branch_points", backend="reference")
    np.testing.assert_array_equal(np.isnan(np.asarray(ref.node_states)).any(axis=(2, 3, 4)), ~branch)


def test_chain_as_parents_equals_chain_kernel(backend):
    t = 16
    rng = np.random.default_rng(7)
    x = random_inputs(rng, B, t)
    args = _args(x)
    ref_out, ref_states = per_path_numpy(x, chain(B, t), use_qk_l2norm=True)
    as_tree = gdn_tree_verify(*args, jnp.asarray(chain(B, t)), _nan_states(t), store="every_node",
                              backend=backend)
    as_chain = gdn_tree_verify(*args, None, _nan_states(t), store="every_node", backend=backend)
    np.testing.assert_array_equal(np.asarray(as_tree.out), np.asarray(as_chain.out))
    np.testing.assert_array_equal(np.asarray(as_tree.node_states), np.asarray(as_chain.node_states))
    assert rel_err(as_chain.out, ref_out) < TOL
    assert rel_err(as_chain.node_states, ref_states) < TOL
    # A chain under ReplaySSM stores no state at all.
    replay = gdn_tree_verify(*args, None, _nan_states(t), store="branch_points", backend=backend)
    assert np.isnan(np.asarray(replay.node_states)).all()
    np.testing.assert_array_equal(np.asarray(replay.out), np.asarray(as_chain.out))


def _kernel_names(fn, *args):
    """The chunked Pallas kernels `fn(*args)` traces to (their names appear in the program)."""
    return set(re.findall(r"gdn_chunked_[a-z_]+", str(jax.make_jaxpr(fn)(*args))))


def _form(form):
    """gdn_chunked_verify keywords of a chunked form: "fused", "two_pass" (Q', P) or "keys" (two-pass
    whose apply kernel reads q and k: P and decay only from the first kernel)."""
    forms = dict(fused=dict(two_pass=False), two_pass=dict(two_pass=True, apply_reads_keys=False),
                 keys=dict(two_pass=True, apply_reads_keys=True))
    # "<form>+grams": that form with q k^T and k k^T from the 16-bit rows as loaded.
    name, _, grams = form.partition("+")
    return dict(forms[name], input_dtype_grams=bool(grams))


@pytest.mark.parametrize("t, l2, shape, form", cases([(8, True, "chain", "fused"), (14, False, "tree", "fused"),
                                                       (16, True, "tree", "fused"), (8, True, "chain", "two_pass"),
                                                       (14, False, "tree", "two_pass"), (16, True, "tree", "two_pass"),
                                                       (8, False, "chain", "keys"), (14, True, "tree", "keys")],
                                                      default=(1, 5, 7)))
def test_chunked_matches_recurrent(t, l2, shape, form, backend):
    """The fused kernel and the two-pass forms (factors Q', P per value head, then Q' h0 + P v; or P
    and decay, then decay q h0 + P (v - decay k h0))."""
    rng = np.random.default_rng(200 + t)
    x = random_inputs(rng, B, t)
    parents = chain(B, t) if shape == "chain" else random_tree(rng, B, t)
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=l2)
    args = _args(x)
    pool_before = _bits(x["state_pool"]).copy()
    out, payload = gdn_chunked_verify(*args, ancestor_mask(jnp.asarray(parents)), _nan_payload(t),
                                      use_qk_l2norm=l2, **_form(form), backend=backend)
    assert rel_err(out, ref_out) < TOL
    recurrent = gdn_tree_verify(*args, jnp.asarray(parents), _nan_states(t), store="every_node",
                                use_qk_l2norm=l2, backend=backend)
    assert rel_err(out, recurrent.out) < TOL
    np.testing.assert_array_equal(np.asarray(payload), np.asarray(pack_payload(*args[1:5])))
    np.testing.assert_array_equal(_bits(args[7]), pool_before)


@pytest.mark.parametrize("t, l2, form", cases([(17, False, "fused"), (33, True, "fused"), (64, True, "fused"),
                                               (33, False, "two_pass"), (64, True, "two_pass"), (33, True, "keys"),
                                               (64, False, "keys")], default=(1, 4, 6)))
def test_chunked_up_to_64_nodes(t, l2, form, backend):
    """Trees of 17..64 nodes pad to 32 or 64 rows; from 33 nodes on, ancestor bits of columns 32..63
    come from mask word 1. Request 0 is a random tree (half the nodes extend i - 1, so deep paths
    cross column 32), request 1 the chain (every bit of both words set below the diagonal)."""
    rng = np.random.default_rng(300 + t)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    parents[1] = chain(1, t)[0]
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=l2)
    args = _args(x)
    pool_before = _bits(x["state_pool"]).copy()
    out, payload = gdn_chunked_verify(*args, ancestor_mask(jnp.asarray(parents)), _nan_payload(t),
                                      use_qk_l2norm=l2, **_form(form), backend=backend)
    for req, shape in enumerate(("tree", "chain")):
        assert rel_err(np.asarray(out)[req], ref_out[req]) < TOL, shape
    np.testing.assert_array_equal(np.asarray(payload), np.asarray(pack_payload(*args[1:5])))
    np.testing.assert_array_equal(_bits(args[7]), pool_before)


@pytest.mark.parametrize("t, l2, form", cases([(14, True, "fused+grams"), (33, False, "two_pass+grams"),
                                               (64, True, "keys+grams")], default=(0, 1)))
def test_input_dtype_grams_match_the_reference(t, l2, form, backend):
    """`input_dtype_grams`: with bf16 inputs, q k^T and k k^T from the rows as loaded (exact products)
    and the row factors applied afterwards give the per-path reference's outputs (to the bf16 output
    rounding) and the fp32-row form's; fp32 q and k are refused by name."""
    rng = np.random.default_rng(500 + t)
    x = random_inputs(rng, B, t)
    parents = random_tree(rng, B, t)
    args = [a.astype(jnp.bfloat16) if i < 5 else a for i, a in enumerate(_args(x))]  # q, k, v, a, b
    x16 = dict(x, **{n: np.asarray(args[i].astype(jnp.float32)) for i, n in enumerate("qkvab")})
    ref_out, _ = per_path_numpy(x16, parents, use_qk_l2norm=l2)
    mask = ancestor_mask(jnp.asarray(parents))
    payload = jnp.full((B, t, GdnPayloadLayout(H, HV, DK, DV).width), jnp.nan, jnp.bfloat16)
    out, pay = gdn_chunked_verify(*args, mask, payload, use_qk_l2norm=l2, **_form(form), backend=backend)
    plain, _ = gdn_chunked_verify(*args, mask, payload, use_qk_l2norm=l2, **_form(form.partition("+")[0]),
                                  backend=backend)
    assert rel_err(out, ref_out) < 1e-2 and rel_err(out, plain) < 1e-2
    # input_dtype_grams=None (the default) is on for bf16 q and k: it traces to the grams form's
    # program (bf16 outputs can round both forms alike, so the program tells them apart).
    default_kw = {k: v for k, v in _form(form).items() if k != "input_dtype_grams"}

    def program(**kw):
        return str(jax.make_jaxpr(lambda *a: gdn_chunked_verify(*a, mask, payload, use_qk_l2norm=l2, **kw,
                                                                 backend=backend))(*args))
    with_grams = program(**_form(form))
    assert program(**default_kw) == with_grams != program(**_form(form.partition("+")[0]))
    np.testing.assert_array_equal(np.asarray(pay.astype(jnp.float32)),
                                  np.asarray(pack_payload(*args[1:5]).astype(jnp.float32)))
    with pytest.raises(ValueError, match="input_dtype_grams=True needs q and k of one 16-bit float dtype.*float32"):
        gdn_chunked_verify(*_args(x), mask, _nan_payload(t), input_dtype_grams=True, backend=backend)


@pytest.mark.parametrize("form", cases(["fused", "two_pass", "keys"], default=(1,)))
def test_chunked_forms_over_several_dv_tiles_and_a_group_of_three(form, backend):
    """dv = 64 split into 16- and 32-column tiles, three value heads per key head: every form equals the
    chunked reference and writes the payload bits (the module's small dims have one dv tile)."""
    from pallas_kernels.linear.gdn_tree import GdnKernelConfig as Launch
    rng = np.random.default_rng(77)
    bsz, t, h, hv, dk, dv, slots_n = 2, 13, 2, 6, 16, 64, 5
    f32 = jnp.float32
    q, k = (jnp.asarray(rng.standard_normal((bsz, t, h, dk)), f32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((bsz, t, hv, dv)), f32)
    a, b_ = (jnp.asarray(rng.standard_normal((bsz, t, hv)), f32) for _ in range(2))
    a_log = jnp.asarray(0.5 * rng.standard_normal(hv), f32)
    dt_bias = jnp.asarray(rng.standard_normal(hv), f32)
    pool = jnp.asarray(0.3 * rng.standard_normal((slots_n, hv, dk, dv)), f32)
    slots = jnp.asarray([3, 1], jnp.int32)
    parents = np.stack([random_tree(rng, 1, t)[0], chain(1, t)[0]])
    mask = ancestor_mask(jnp.asarray(parents))
    ref, _ = gdn_chunked_reference(q, k, v, a, b_, a_log, dt_bias, pool, slots, ancestor_mask_bool(jnp.asarray(parents)),
                                   use_qk_l2norm=True)
    width = GdnPayloadLayout(h, hv, dk, dv).width
    for block_v in (16, 32):
        out, payload = gdn_chunked_verify(q, k, v, a, b_, a_log, dt_bias, pool, slots, mask,
                                          jnp.full((bsz, t, width), jnp.nan, f32), config=Launch(block_v=block_v),
                                          **_form(form), backend=backend)
        assert rel_err(out, ref) < TOL, block_v
        np.testing.assert_array_equal(np.asarray(payload), np.asarray(pack_payload(k, v, a, b_)))



def test_two_pass_knobs_select_the_two_pass_form_on_a_small_grid():
    """two_pass=None at 16 padded rows on a small grid picks the fused kernel, unless a two-pass knob
    (apply_reads_keys=True, factor_warps) is set: then the two-pass form it names runs."""
    t = 14
    rng = np.random.default_rng(77)
    x = random_inputs(rng, B, t)
    mask = ancestor_mask(jnp.asarray(random_tree(rng, B, t)))
    assert not default_two_pass(B, HV, 16)

    def names(**kw):
        return _kernel_names(lambda *a: gdn_chunked_verify(*a, mask, _nan_payload(t), backend="interpret", **kw),
                             *_args(x))
    assert names() == names(apply_reads_keys=None) == names(apply_reads_keys=False) == {"gdn_chunked_verify"}
    assert names(apply_reads_keys=True) == {"gdn_chunked_p_factor", "gdn_chunked_apply_keys"}
    assert names(factor_warps=2) == {"gdn_chunked_factor", "gdn_chunked_apply"}


@pytest.mark.parametrize("rows", [16, 32, 64])
def test_block_inversion_equals_the_inverse(rows):
    """`_invert_unit_lower` (the chunked forms' recursive block inversion, first level without dots)
    is (I + m)^-1 for a strictly lower triangular m, with padding rows (all-zero rows and columns of
    m past the live ones) left as identity rows."""
    rng = np.random.default_rng(rows)
    for live in (rows, rows - 5, 1):
        m = np.tril(rng.standard_normal((rows, rows)) * 0.3, -1)
        m[live:, :] = 0.0
        m[:, live:] = 0.0
        got = np.asarray(_invert_unit_lower(jnp.asarray(m, jnp.float32), rows, "highest"))
        want = np.linalg.inv(np.eye(rows) + m)
        assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max()), live
        np.testing.assert_array_equal(got[live:, :], np.eye(rows)[live:, :])

@pytest.mark.parametrize("t, form", cases([(16, "fused"), (32, "fused"), (64, "fused"), (64, "two_pass"), (64, "keys")],
                                          default=(2, 3, 4)))
def test_chunked_is_stable_on_deep_chains_of_correlated_keys(t, form, backend):
    """Keys sharing one direction, beta near 1 and no decay make (I + M)^-1 ill-suited to a
    power series: the sum of (-M)^j has entries near 1e16 at j = 32 that must cancel. The inverse
    must come out as accurate as a substitution would give (fp64 per-path reference)."""
    rng = np.random.default_rng(400 + t)
    x = random_inputs(rng, B, t)
    common = rng.standard_normal(DK).astype(np.float32)
    x["k"] = (0.7 * common + 0.3 * x["k"]).astype(np.float32)
    x["b"] = np.full_like(x["b"], 2.5)  # beta = sigmoid(2.5) ~ 0.92
    x["A_log"] = np.full_like(x["A_log"], -12.0)  # g ~ 0: no decay along the chain
    parents = chain(B, t)
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=True)
    out, _ = gdn_chunked_verify(*_args(x), ancestor_mask(jnp.asarray(parents)), _nan_payload(t),
                                **_form(form), backend=backend)
    assert rel_err(out, ref_out) < TOL


@sweep  # routing rules; every route's kernels are checked against the references above
def test_layer_routes_by_explicit_bounds_knobs_and_dtype(backend):
    """Explicit chunked_min/max_nodes bounds (up to MAX_CHUNKED_NODES) replace the default route and
    its padded-rows minima; the two-pass and keys knobs reach the kernel; on a small grid the default
    keeps a 33-node fp32 tree recurrent and sends the bf16 one to the two-pass keys form with
    input-dtype grams; forced grams are refused by name for non-16-bit q / k on every route;
    out-of-range values are refused by name, all errors in one message."""
    assert MAX_CHUNKED_NODES == 64
    assert GdnLayerConfig(H, HV, DK, DV).chunked_max_nodes is None
    assert not default_two_pass(B, HV)  # the test's batch is a small grid
    assert verify_kernel_for("replay_ssm", 33, True, True, 12, max_nodes=16) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 33, True, True, 12, max_nodes=64) == "chunked"
    assert verify_kernel_for("replay_ssm", 64, True, True, 12, max_nodes=64) == "chunked"
    assert verify_kernel_for("replay_ssm", 33, True, True, 12, max_nodes=32) == "recurrent_tree"
    assert verify_kernel_for("staged", 33, True, True, 12, max_nodes=64) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 33, False, True, 12, max_nodes=64) == "recurrent_chain"
    big_only = GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=20, chunked_max_nodes=64)
    assert big_only.chunked_route(B, jnp.float32) == big_only.chunked_route(4096, jnp.bfloat16) == (20, 64, {})
    lo, hi, padded_min = big_only.chunked_route(B, jnp.float32)
    for n, want in ((19, "recurrent_tree"), (20, "chunked"), (33, "chunked"), (64, "chunked")):
        assert verify_kernel_for("replay_ssm", n, True, True, lo, max_nodes=hi, padded_min_nodes=padded_min) == want, n
    with pytest.raises(ValueError, match=r"chunked_max_nodes=65 must be in \[8, 64\].*chunked_fp32_dots='bf16'"):
        GdnLayerConfig(H, HV, DK, DV, chunked_max_nodes=65, chunked_fp32_dots="bf16")
    with pytest.raises(ValueError, match="chunked_min_nodes=12 must not exceed chunked_max_nodes=10"):
        GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=12, chunked_max_nodes=10)
    with pytest.raises(ValueError, match=r"chunked_min_nodes=65 must be in \[8, 64\]"):
        GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=65, chunked_max_nodes=64)
    with pytest.raises(ValueError, match=r"chunked_two_pass='no' must be None, True or False.*kernel.block_v=8"):
        GdnLayerConfig(H, HV, DK, DV, chunked_two_pass="no", kernel=GdnKernelConfig(block_v=8))
    GdnLayerConfig(H, HV, DK, DV, chunked_tree_verify=False, chunked_chain_verify=False,
                   kernel=GdnKernelConfig(block_v=8))  # recurrent kernels only

    t = 33
    x, parents, tree, ref_out, ref_states = _random_tree_case(13, t)
    raised = GdnLayerConfig(H, HV, DK, DV, chunked_max_nodes=64)
    assert raised.chunked_route(B, jnp.float32) == (12, 64, {})
    chunked = gdn_verify(raised, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=tree,
                         backend=backend)
    assert rel_err(chunked.out, ref_out) < TOL
    assert np.isnan(np.asarray(chunked.node_states)).all()  # the chunked form keeps no node states
    np.testing.assert_array_equal(np.asarray(chunked.payload), np.asarray(pack_payload(*_args(x)[1:5])))
    # chunked_two_pass and chunked_apply_reads_keys reach the kernel: the layer's output is the two-pass
    # variant's, bit for bit; by default (None) the keys variant runs from 64 padded rows (33 nodes pad
    # to 64).
    direct = {}
    for keys in (False, True, None):
        cfg = GdnLayerConfig(H, HV, DK, DV, chunked_max_nodes=64, chunked_two_pass=True, chunked_apply_reads_keys=keys)
        layer = gdn_verify(cfg, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=tree,
                           backend=backend)
        direct[keys], _ = gdn_chunked_verify(*_args(x), tree.ancestor_mask, _nan_payload(t), two_pass=True,
                                             apply_reads_keys=keys, fp32_dots=cfg.chunked_fp32_dots,
                                             backend=backend)
        np.testing.assert_array_equal(np.asarray(layer.out), np.asarray(direct[keys]))
        assert rel_err(layer.out, ref_out) < TOL, keys
    assert not np.array_equal(np.asarray(direct[True]), np.asarray(direct[False]))
    np.testing.assert_array_equal(np.asarray(direct[None]), np.asarray(direct[True]))
    with pytest.raises(ValueError, match="chunked_apply_reads_keys=True is a two-pass form"):
        GdnLayerConfig(H, HV, DK, DV, chunked_two_pass=False, chunked_apply_reads_keys=True)
    with pytest.raises(ValueError, match="chunked_apply_reads_keys='yes' must be None, True or False"):
        GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys="yes")
    with pytest.raises(ValueError, match="chunked_two_pass=0 must be None, True or False.*"
                                         "chunked_apply_reads_keys=1 must be None, True or False"):
        GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=1, chunked_two_pass=0)
    # chunked_input_dtype_grams=True with this test's fp32 q and k is refused by name on every route
    # (here the recurrent one too).
    for routes in (dict(chunked_max_nodes=64), dict(chunked_tree_verify=False)):
        grams_cfg = GdnLayerConfig(H, HV, DK, DV, chunked_input_dtype_grams=True, **routes)
        with pytest.raises(ValueError, match="chunked_input_dtype_grams=True needs q and k of one 16-bit float "
                                             "dtype; got q float32, k float32"):
            gdn_verify(grams_cfg, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=tree,
                       backend=backend)
    with pytest.raises(ValueError, match="chunked_input_dtype_grams='on' must be None, True or False"):
        GdnLayerConfig(H, HV, DK, DV, chunked_input_dtype_grams="on")
    with pytest.raises(ValueError, match="apply_reads_keys=True is a two-pass form"):
        gdn_chunked_verify(*_args(x), tree.ancestor_mask, _nan_payload(t), two_pass=False, apply_reads_keys=True,
                           backend=backend)
    # By default (a small grid, fp32 q and k: two-pass from 48 nodes at 64 rows) the same tree runs
    # the recurrent kernel, which stores exactly its branch points.
    recurrent = gdn_verify(GdnLayerConfig(H, HV, DK, DV), *_args(x), node_states=_nan_states(t),
                           payload=_nan_payload(t), tree=tree, backend=backend)
    assert rel_err(recurrent.out, ref_out) < TOL
    rows = branch_rows(parents)
    ws = np.asarray(recurrent.node_states)
    assert rows.any() and np.isnan(ws[~rows]).all() and rel_err(ws[rows], ref_states[rows]) < TOL
    # With bf16 q and k the default sends it to the two-pass keys form with input-dtype grams, bit for bit.
    bf16 = jnp.bfloat16
    args16 = [a.astype(bf16) if i < 5 else a for i, a in enumerate(_args(x))]
    default16 = gdn_verify(GdnLayerConfig(H, HV, DK, DV), *args16, node_states=_nan_states(t),
                           payload=_nan_payload(t, bf16), tree=tree, backend=backend)
    direct16, _ = gdn_chunked_verify(*args16, tree.ancestor_mask, _nan_payload(t, bf16), two_pass=True,
                                     apply_reads_keys=True, input_dtype_grams=True,
                                     fp32_dots=GdnLayerConfig(H, HV, DK, DV).chunked_fp32_dots, backend=backend)
    np.testing.assert_array_equal(np.asarray(default16.out), np.asarray(direct16))
    assert np.isnan(np.asarray(default16.node_states)).all() and rel_err(default16.out, ref_out) < 2e-2
    # q bf16 with k fp32: no input-dtype grams by default (the fp32 route), refused when forced.
    mixed = [args16[0]] + _args(x)[1:]
    assert not GdnLayerConfig(H, HV, DK, DV).runs_input_dtype_grams(bf16, jnp.float32)
    assert GdnLayerConfig(H, HV, DK, DV).chunked_route(B, bf16, jnp.float32) == (12, 64, {32: 33, 64: 48})
    with pytest.raises(ValueError, match="got q bfloat16, k float32"):
        gdn_verify(GdnLayerConfig(H, HV, DK, DV, chunked_input_dtype_grams=True), *mixed, node_states=_nan_states(t),
                   payload=_nan_payload(t), tree=tree, backend=backend)


def test_default_runs_two_pass_past_16_rows_on_every_grid(backend):
    """With bf16 q and k a 30-node tree (32 padded rows) goes to the chunked form on both grids, and
    past 16 rows the kernel's default is the two-pass form with input-dtype grams on every grid (the
    output is two_pass=True's, bit for bit). With fp32 q and k the small grid keeps it recurrent (no
    two-pass tree at 32 rows without grams). The large grid's config lowers the two-pass threshold so
    the test's small batch counts as a large grid."""
    t = 30
    bf16 = jnp.bfloat16
    x, parents, tree, ref_out, _ = _random_tree_case(17, t)
    args16 = [a.astype(bf16) if i < 5 else a for i, a in enumerate(_args(x))]
    default = GdnLayerConfig(H, HV, DK, DV)
    two, _ = gdn_chunked_verify(*args16, tree.ancestor_mask, _nan_payload(t, bf16), two_pass=True,
                                input_dtype_grams=True, fp32_dots=default.chunked_fp32_dots, backend=backend)
    assert default.chunked_route(B, jnp.float32) == (12, 64, {32: 33, 64: 48})
    assert default.chunked_route(B, bf16) == (8, 64, {32: 17, 64: 33})
    large = GdnLayerConfig(H, HV, DK, DV, kernel=GdnKernelConfig(two_pass_min_programs=B * HV))
    assert large.chunked_route(B, jnp.float32) == (8, 64, {32: 26, 64: 33})
    assert large.chunked_route(B, bf16) == (8, 64, {32: 17, 64: 33})
    for grid, cfg in (("small", default), ("large", large)):
        def layer(*a):
            return gdn_verify(cfg, *a, node_states=_nan_states(t), payload=_nan_payload(t, bf16), tree=tree,
                              backend=backend)
        res = layer(*args16)
        assert np.isnan(np.asarray(res.node_states)).all(), grid  # chunked: no node states
        # bf16 outputs can round the fused and two-pass forms alike: the program names the kernels.
        assert _kernel_names(layer, *args16) == {"gdn_chunked_factor", "gdn_chunked_apply"}, grid
        np.testing.assert_array_equal(np.asarray(res.out), np.asarray(two))
        assert rel_err(res.out, ref_out) < 2e-2


@pytest.mark.parametrize("t, want_chunked", cases([(12, True), (16, True), (8, False), (17, False), (55, False),
                                                   (60, True)], default=(3,)))
def test_chain_ranges_of_the_two_pass_form(t, want_chunked, backend):
    """Under ReplaySSM a chain (tree=None) runs the two-pass chunked form with a chain's ancestor mask
    (bit for bit, no workspace row written, payload as read) over `chain_chunked_ranges`: with fp32
    q and k (this test's) 12..16 nodes, and 56..64 where the apply-reads-keys variant runs at 64 rows,
    on large grids only; with 16-bit q and k 8..64 on large grids (8..32 without the keys variant at
    64 rows) and 8..16 (the fused form) and 48..64 on small ones. Other lengths, chunked_chain_verify=False, chunked_two_pass=False
    and staged run the recurrent chain. Past the small-grid checks the configs lower the two-pass
    threshold (`GdnKernelConfig.two_pass_min_programs`) so the test's batch counts as a large grid."""
    rng = np.random.default_rng(40 + t)
    x = random_inputs(rng, B, t)
    parents = chain(B, t)
    ref_out, _ = per_path_numpy(x, parents, use_qk_l2norm=True)
    f32, bf16 = jnp.float32, jnp.bfloat16
    default = GdnLayerConfig(H, HV, DK, DV)
    assert not default.chain_runs_chunked(t, B, f32)  # small grid, no grams
    assert default.chain_chunked_ranges(B, f32) == ()
    assert default.chain_chunked_ranges(B, bf16) == ((8, 16), (48, 64))
    assert default.chain_chunked_ranges(B, bf16, f32) == ()  # mixed q / k dtypes: no grams
    assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=False).chain_chunked_ranges(B, bf16) == (
        (8, 16),)
    chain_mask = ancestor_mask(jnp.asarray(parents))
    if t <= 16:  # a bf16 chain on the small grid runs the fused form with input-dtype grams
        args16 = [a.astype(bf16) if i < 5 else a for i, a in enumerate(_args(x))]

        def layer(cfg, *a):
            return gdn_verify(cfg, *a, node_states=_nan_states(t), payload=_nan_payload(t, bf16), tree=None,
                              backend=backend)
        res16 = layer(default, *args16)
        assert _kernel_names(functools.partial(layer, default), *args16) == {"gdn_chunked_verify"}
        # chunked_apply_reads_keys=True applies where two-pass runs: the fused form stays.
        keys_cfg = GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=True)
        assert _kernel_names(functools.partial(layer, keys_cfg), *args16) == {"gdn_chunked_verify"}
        # chunked_two_pass=True keeps the range and runs the two-pass form there.
        forced = GdnLayerConfig(H, HV, DK, DV, chunked_two_pass=True)
        assert forced.chain_chunked_ranges(B, bf16) == default.chain_chunked_ranges(B, bf16)
        assert _kernel_names(functools.partial(layer, forced), *args16) == {"gdn_chunked_factor",
                                                                             "gdn_chunked_apply"}
        fused16, _ = gdn_chunked_verify(*args16, chain_mask, _nan_payload(t, bf16), two_pass=False,
                                        input_dtype_grams=True, fp32_dots=default.chunked_fp32_dots, backend=backend)
        np.testing.assert_array_equal(np.asarray(res16.out), np.asarray(fused16))
        assert np.isnan(np.asarray(res16.node_states)).all() and rel_err(res16.out, ref_out) < 1e-2
    large_grid = GdnKernelConfig(two_pass_min_programs=B * HV)
    default = GdnLayerConfig(H, HV, DK, DV, kernel=large_grid)
    assert default.chain_runs_chunked(t, B, f32) == want_chunked
    for off in (dict(chunked_chain_verify=False), dict(chunked_two_pass=False), dict(mode="staged")):
        cfg = GdnLayerConfig(H, HV, DK, DV, kernel=large_grid, **off)
        assert cfg.chain_chunked_ranges(B, f32) == cfg.chain_chunked_ranges(B, bf16) == (), off
    # 56..64 only where the apply-reads-keys variant runs at 64 rows (the default).
    no_keys = GdnLayerConfig(H, HV, DK, DV, kernel=large_grid, chunked_apply_reads_keys=False)
    assert no_keys.chain_runs_chunked(t, B, f32) == (want_chunked and t <= 16)
    assert GDN_CHAIN_VERIFY_CHUNKED_NODES_64_ROWS == (56, 64)
    for cfg_keys in (None, True, False):
        cfg = GdnLayerConfig(H, HV, DK, DV, kernel=large_grid, chunked_apply_reads_keys=cfg_keys)
        assert [n for n in range(17, 65) if cfg.chain_runs_chunked(n, B, f32)] == (
            [] if cfg_keys is False else list(range(56, 65))), cfg_keys
        # 16-bit q and k (input-dtype grams): every chain of 8..64 nodes, 8..32 without keys at 64 rows.
        assert [n for n in range(1, 65) if cfg.chain_runs_chunked(n, B, bf16)] == (
            list(range(8, 33)) if cfg_keys is False else list(range(8, 65))), cfg_keys
        grams_off = GdnLayerConfig(H, HV, DK, DV, kernel=large_grid, chunked_apply_reads_keys=cfg_keys,
                                   chunked_input_dtype_grams=False)
        assert grams_off.chain_chunked_ranges(B, bf16) == cfg.chain_chunked_ranges(B, f32), cfg_keys
    res = gdn_verify(default, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=None,
                     backend=backend)
    assert rel_err(res.out, ref_out) < TOL
    np.testing.assert_array_equal(np.asarray(res.payload), np.asarray(pack_payload(*_args(x)[1:5])))
    assert np.isnan(np.asarray(res.node_states)).all()  # neither form writes workspace rows for a chain
    two, _ = gdn_chunked_verify(*_args(x), chain_mask, _nan_payload(t), two_pass=True,
                                fp32_dots=default.chunked_fp32_dots, backend=backend)
    recurrent = gdn_verify(GdnLayerConfig(H, HV, DK, DV, kernel=large_grid, chunked_chain_verify=False),
                           *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=None, backend=backend)
    assert not np.array_equal(np.asarray(two), np.asarray(recurrent.out))  # the two routes are told apart
    np.testing.assert_array_equal(np.asarray(res.out), np.asarray(two if want_chunked else recurrent.out))


def test_chunked_reference_states_match_per_path():
    t = 16
    x, parents, _, ref_out, ref_states = _random_tree_case(5, t)
    out, states = gdn_chunked_reference(*_args(x), ancestor_mask_bool(jnp.asarray(parents)),
                                        use_qk_l2norm=True)
    assert rel_err(out, ref_out) < TOL
    assert rel_err(states, ref_states) < TOL


def test_layer_verify_dispatch_and_modes_agree(backend):
    """With chunked_tree_verify (the default), gdn_verify picks the chunked form for ReplaySSM trees
    in the layer's chunked route: on large grids 8..64 nodes with padded-rows minima by the two-pass
    variant that runs and whether the grams come from 16-bit rows; on small grids 8..16 (fused) with
    grams, 12..16 without, and past 16 rows from the small grid's minima (by variant and grams);
    12..16 wherever only the fused form runs; at least 8; masks alone describe the tree."""
    assert GDN_TREE_VERIFY_CHUNKED_MIN_NODES == 8
    assert GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS == (8, 64)
    assert GDN_TREE_VERIFY_CHUNKED_NODES_FUSED == (12, 16)
    assert GDN_TREE_VERIFY_CHUNKED_NODES_SMALL_GRID == {False: (12, 64), True: (8, 64)}
    assert GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES == {
        (32, False, False): 26, (32, True, False): 29, (64, False, False): 40, (64, True, False): 33,
        (32, False, True): 17, (32, True, True): 29, (64, False, True): 40, (64, True, True): 33}
    assert GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID == {
        (32, False, False): 33, (32, True, False): 33, (64, False, False): 65, (64, True, False): 48,
        (32, False, True): 17, (32, True, True): 33, (64, False, True): 65, (64, True, True): 33}
    assert verify_kernel_for("replay_ssm", 16, True, True) == "chunked"
    assert verify_kernel_for("replay_ssm", 8, True, True) == "chunked"
    assert verify_kernel_for("replay_ssm", 64, True, True) == "chunked"
    assert verify_kernel_for("replay_ssm", 17, True, True) == "chunked"  # no padded-rows minimum by default
    assert verify_kernel_for("replay_ssm", 7, True, True) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 7, True, True, 4) == "recurrent_tree"  # never below 8
    assert verify_kernel_for("replay_ssm", 16, True, False) == "recurrent_tree"
    assert verify_kernel_for("staged", 16, True, True) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 16, False, True) == "recurrent_chain"
    # The padded-rows minimum: past 16 rows a tree needs that many nodes for its padded 32 or 64 rows.
    chunked_sizes = [n for n in range(1, 65) if verify_kernel_for("replay_ssm", n, True, True, 8, max_nodes=64,
                                                                  padded_min_nodes={32: 26, 64: 40}) == "chunked"]
    assert chunked_sizes == list(range(8, 17)) + list(range(26, 33)) + list(range(40, 65))
    # The layer's default route follows the grid (B * HV against GdnKernelConfig.two_pass_min_programs) and q's dtype.
    default = GdnLayerConfig(H, HV, DK, DV)
    assert (default.chunked_tree_verify, default.chunked_min_nodes, default.chunked_two_pass,
            default.chunked_fp32_dots, default.chunked_input_dtype_grams) == (True, None, None, "tf32x3", None)
    assert default.runs_input_dtype_grams(jnp.bfloat16) and default.runs_input_dtype_grams(jnp.float16)
    assert not default.runs_input_dtype_grams(jnp.float32)
    assert not GdnLayerConfig(H, HV, DK, DV, chunked_input_dtype_grams=False).runs_input_dtype_grams(jnp.bfloat16)
    min_programs = GdnKernelConfig().two_pass_min_programs
    small_b, large_b = min_programs // HV - 1, -(-min_programs // HV)
    assert not default_two_pass(small_b, HV) and default_two_pass(large_b, HV)
    assert default_two_pass(small_b, HV, 32) and default_two_pass(small_b, HV, 64)  # past 16 rows: any grid
    f32, bf16 = jnp.float32, jnp.bfloat16
    small = {f32: (12, 64, {32: 33, 64: 48}), bf16: (8, 64, {32: 17, 64: 33})}
    fill = {32: 26, 64: 33}  # fp32 rows: the plain two-pass form at 32 rows, the apply-reads-keys one at 64
    grams = {32: 17, 64: 33}  # 16-bit rows: every tree past 16 nodes
    for dtype in (f32, bf16):
        assert default.chunked_route(small_b, dtype) == small[dtype]
        # Forcing two-pass on a small grid keeps the small grid's route (two-pass is not timed there at
        # 8..16 with bf16, 12..16 with fp32).
        assert GdnLayerConfig(H, HV, DK, DV, chunked_two_pass=True).chunked_route(small_b, dtype) == small[dtype]
        # Forcing the fused form keeps the fused range on every grid.
        for b in (small_b, large_b):
            assert GdnLayerConfig(H, HV, DK, DV, chunked_two_pass=False).chunked_route(b, dtype) == (12, 16, {})
    assert default.chunked_route(large_b, f32) == (8, 64, fill)
    assert default.chunked_route(large_b, bf16) == default.chunked_route(large_b, jnp.float16) == (8, 64, grams)
    assert GdnLayerConfig(H, HV, DK, DV, chunked_input_dtype_grams=False).chunked_route(large_b, bf16) == (
        8, 64, fill)
    assert GdnLayerConfig(H, HV, DK, DV, chunked_two_pass=True).chunked_route(large_b, f32) == (8, 64, fill)
    # The minimum follows the variant the layer runs at each padding.
    assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=False).chunked_route(large_b, f32) == (
        8, 64, {32: 26, 64: 40})
    assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=True).chunked_route(large_b, f32) == (
        8, 64, {32: 29, 64: 33})
    # On a small grid the minima follow the variant too: plain two-pass at 64 rows and keys at 32 take
    # none (the first lost at B=1 without grams; neither is timed there with them).
    for keys, want in ((False, {f32: {32: 33, 64: 65}, bf16: {32: 17, 64: 65}}),
                       (True, {f32: {32: 33, 64: 48}, bf16: {32: 33, 64: 33}})):
        for dtype in (f32, bf16):
            assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=keys).chunked_route(small_b, dtype)[2] == (
                want[dtype]), (keys, dtype)
    # With grams the variants not run by default keep their minima without them (not timed with grams).
    assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=False).chunked_route(large_b, bf16) == (
        8, 64, {32: 17, 64: 40})
    assert GdnLayerConfig(H, HV, DK, DV, chunked_apply_reads_keys=True).chunked_route(large_b, bf16) == (
        8, 64, {32: 29, 64: 33})
    # One explicit bound keeps the other from the default unless they would cross; an explicit max
    # drops the padded-rows minimum.
    for dtype in (f32, bf16):
        assert GdnLayerConfig(H, HV, DK, DV, chunked_max_nodes=10).chunked_route(small_b, dtype) == (8, 10, {})
        assert GdnLayerConfig(H, HV, DK, DV, chunked_max_nodes=10).chunked_route(large_b, dtype) == (8, 10, {})
        assert GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=20).chunked_route(small_b, dtype) == (
            20, 64, small[dtype][2])
        assert GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=12).chunked_route(small_b, dtype) == (
            12, 64, small[dtype][2])
    assert GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=12).chunked_route(large_b, f32) == (12, 64, fill)
    # The small grid's route: with grams 8..64 (fused to 16 nodes, two-pass past them); without them
    # 12..16 and 48..64.
    for dtype, want in ((bf16, list(range(8, 65))), (f32, list(range(12, 17)) + list(range(48, 65)))):
        lo, hi, padded_min = default.chunked_route(small_b, dtype)
        assert [n for n in range(1, 65) if verify_kernel_for("replay_ssm", n, True, True, lo, max_nodes=hi,
                                                             padded_min_nodes=padded_min) == "chunked"] == want
    lo, hi, padded_min = default.chunked_route(B, f32)
    assert verify_kernel_for("replay_ssm", 8, True, True, lo, max_nodes=hi, padded_min_nodes=padded_min) == "recurrent_tree"
    assert verify_kernel_for("replay_ssm", 12, True, True, lo, max_nodes=hi, padded_min_nodes=padded_min) == "chunked"
    with pytest.raises(ValueError, match=r"chunked_min_nodes=65.*chunked_fp32_dots='bf16'"):
        GdnLayerConfig(H, HV, DK, DV, chunked_min_nodes=65, chunked_fp32_dots="bf16")
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
                        tree=tree, backend=backend)
    staged = gdn_verify(staged_cfg, *_args(x), node_states=_nan_states(t), tree=tree,
                        backend=backend)
    assert rel_err(replay.out, ref_out) < TOL
    assert rel_err(staged.out, replay.out) < TOL
    assert np.isnan(np.asarray(replay.node_states)).all()  # the chunked form keeps no node states
    # On this small grid the default form is the fused kernel, bit for bit (at the layer's fp32 dot
    # algorithm: compiled, the kernel's own default is exact fp32 products and the layer's TF32x3).
    fused, _ = gdn_chunked_verify(*_args(x), mask, _nan_payload(t), two_pass=False,
                                  fp32_dots=replay_cfg.chunked_fp32_dots, backend=backend)
    np.testing.assert_array_equal(np.asarray(replay.out), np.asarray(fused))


def test_layer_glue_shares_the_step_branch_points(backend):
    """`GdnTree` computes the branch points once per step and every layer's verify stores exactly
    the rows that vector names (an all-true vector stores every row)."""
    t = 14
    x, parents, tree, ref_out, ref_states = _random_tree_case(12, t)
    np.testing.assert_array_equal(np.asarray(tree.branch), branch_rows(parents))
    cfg = GdnLayerConfig(H, HV, DK, DV, chunked_tree_verify=False)  # the recurrent kernel's workspace
    for tr, rows in ((tree, branch_rows(parents)), (tree._replace(branch=jnp.ones((B, t), bool)),
                                                   np.ones((B, t), bool))):
        res = gdn_verify(cfg, *_args(x), node_states=_nan_states(t), payload=_nan_payload(t), tree=tr,
                         backend=backend)
        assert rel_err(res.out, ref_out) < TOL
        ws = np.asarray(res.node_states)
        assert np.isnan(ws[~rows]).all() and rel_err(ws[rows], ref_states[rows]) < TOL


def test_parents_from_ancestor_mask_64_nodes():
    rng = np.random.default_rng(3)
    parents = random_tree(rng, B, 64)
    got = parents_from_ancestor_mask(ancestor_mask(jnp.asarray(parents)))
    np.testing.assert_array_equal(np.asarray(got), parents)


def test_bf16_inputs(backend):
    t = 6
    rng = np.random.default_rng(9)
    x = random_inputs(rng, B, t, dtype=jnp.bfloat16)
    parents = random_tree(rng, B, t)
    ref_out, _ = per_path_numpy({n: np.asarray(v, np.float32) for n, v in x.items()} | {
        "state_slots": x["state_slots"]}, parents, use_qk_l2norm=True)
    res = gdn_tree_verify(*_args(x), jnp.asarray(parents), _nan_states(t), store="branch_points",
                          payload=_nan_payload(t, jnp.bfloat16), backend=backend)
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
    with pytest.raises(ValueError, match="at most 64 nodes, got T=65"):
        y = random_inputs(rng, B, 65)  # no 65-node tree mask exists; the node count is refused first
        gdn_chunked_verify(*_args(y), jnp.zeros((B, 65, 2), jnp.uint32), _nan_payload(65), backend="interpret")
    with pytest.raises(ValueError, match="fp32_dots must be one of \\('ieee', 'tf32x3'\\), got 'tf32'"):
        gdn_chunked_verify(*args, ancestor_mask(jnp.asarray(parents)), _nan_payload(t), fp32_dots="tf32",
                           backend="interpret")
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


def test_pick_launch_defaults_and_refusals():
    """By default batches with B * HV >= 512 take value-major 32-column tiles and small ones
    key-major tiles split down to 32 columns; the chunked form ignores value_major but takes
    32-column tiles above 32 nodes; an explicit
    config wins; nonsense values are refused by name."""
    qwen = lambda batch: GdnDims(batch, 16, 16, 32, 128, 128, batch + 1)  # noqa: E731
    key_major, value_major = GdnKernelConfig(value_major=False), GdnKernelConfig(value_major=True)
    assert [uses_value_major(qwen(b), None) for b in (1, 8, 16, 32)] == [False, False, True, True]
    assert not uses_value_major(qwen(32), key_major) and uses_value_major(qwen(1), value_major)
    assert pick_launch(qwen(32), None) == pick_launch(qwen(1), None) == (32, 4, 1)
    assert pick_launch(qwen(8), None) == (64, 8, 1)  # key-major: 8 * 32 * 2 = 512 programs, 128x64 > 64x64
    assert pick_launch(qwen(32), key_major) == (128, 8, 1)
    assert pick_launch(qwen(8), value_major) == (32, 4, 1)
    assert pick_launch(qwen(32), None, chunked=True) == (128, 8, 1)
    wide_tree = GdnDims(32, 33, 16, 32, 128, 128, 33)  # 64 padded rows: narrower tiles (shared memory)
    assert pick_launch(wide_tree, None, chunked=True) == (32, 4, 1)
    assert pick_launch(wide_tree, None) == (32, 4, 1)
    assert pick_launch(wide_tree, GdnKernelConfig(block_v=64), chunked=True) == (64, 8, 1)
    assert pick_launch(qwen(32), GdnKernelConfig(block_v=128, num_warps=2)) == (128, 2, 1)
    for field, bad in (("block_v", 0), ("num_warps", -4), ("num_stages", 0), ("num_warps", 2.0),
                       ("value_major", 1)):
        with pytest.raises(ValueError, match=f"{field}="):
            GdnKernelConfig(**{field: bad})
    with pytest.raises(ValueError, match="GdnKernelConfig.fp32_dots must be one of .*got 'tf32'"):
        GdnKernelConfig(fp32_dots="tf32")
    with pytest.raises(ValueError, match="num_warps=64"):
        pick_launch(qwen(32), GdnKernelConfig(num_warps=64))
    with pytest.raises(ValueError, match="num_warps=3"):
        pick_launch(qwen(32), GdnKernelConfig(num_warps=3))


def test_branch_inputs_are_checked():
    t = 6
    rng = np.random.default_rng(4)
    x = random_inputs(rng, B, t)
    args = _args(x)
    parents = jnp.asarray(random_tree(rng, B, t))
    branch = branch_points(parents)
    with pytest.raises(ValueError, match="branch must be"):
        gdn_tree_verify(*args, parents, _nan_states(t), store="branch_points", branch=branch[:, :3],
                        backend="interpret")
    with pytest.raises(ValueError, match="branch was given for a chain"):
        gdn_tree_verify(*args, None, _nan_states(t), store="branch_points", branch=branch, backend="interpret")


def _fake_sm90(monkeypatch):
    """Makes the Pallas Triton lowering target an sm_90 GPU on this CPU-only machine."""
    import jax._src.pallas.triton.pallas_call_registration as reg

    import pallas_kernels.common as common

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: reg.gpu_info_lib.GpuInfo(
        gpu_version=None, arch_name="sm_90", compute_capability=90))
    monkeypatch.setattr(common, "on_gpu", lambda: True)


def _qwen_specs(bsz, t, h=16, hv=32, dk=128, dv=128):
    """Abstract Qwen3-Next inputs `(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots)` and the
    payload width."""

    sd = jax.ShapeDtypeStruct
    ins = (sd((bsz, t, h, dk), jnp.bfloat16), sd((bsz, t, h, dk), jnp.bfloat16), sd((bsz, t, hv, dv), jnp.bfloat16),
           sd((bsz, t, hv), jnp.bfloat16), sd((bsz, t, hv), jnp.bfloat16), sd((hv,), jnp.float32),
           sd((hv,), jnp.float32), sd((bsz + 1, hv, dk, dv), jnp.float32), sd((bsz,), jnp.int32))
    return ins, GdnPayloadLayout(h, hv, dk, dv).width


def test_tree_kernel_lowers_to_triton_for_sm90(monkeypatch):
    """Qwen3-Next dims lower Pallas -> Triton IR in both store modes and as a chain, key- and
    value-major, and in the chunked forms under both fp32 product modes (set by the config's field
    or by the keyword that overrides it); no GPU needed; compiling to PTX and running is
    benchmarks/bench_gdn.py's conformance."""

    _fake_sm90(monkeypatch)
    sd = jax.ShapeDtypeStruct
    bsz, t, hv, dk, dv = 4, 16, 32, 128, 128
    ins, width = _qwen_specs(bsz, t)
    nodes = sd((bsz, t, hv, dk, dv), jnp.float32)
    for store, tree, vm in (("branch_points", True, False), ("branch_points", True, True),
                            ("every_node", True, True), ("branch_points", False, False),
                            ("branch_points", False, True)):
        cfg = GdnKernelConfig(value_major=vm)

        def fn(*a):
            parents = a[9] if tree else None
            pay = a[11] if store == "branch_points" else None
            return gdn_tree_verify(*a[:9], parents, a[10], store=store, payload=pay, config=cfg)

        text = jax.jit(fn, donate_argnums=(10, 11)).trace(
            *ins, sd((bsz, t), jnp.int32), nodes, sd((bsz, t, width), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text and "gdn_tree_verify" in text, (store, tree, vm)
    # The chunked form, fused and two-pass, with IEEE and with TF32x3 fp32 products.
    for fp32_dots, two_pass, keys in (("ieee", False, False), ("tf32x3", False, False), ("tf32x3", True, False),
                                      ("tf32x3", True, True)):
        def chunked(*a, fp32_dots=fp32_dots, two_pass=two_pass, keys=keys):
            return gdn_chunked_verify(*a, fp32_dots=fp32_dots, two_pass=two_pass, apply_reads_keys=keys)

        text = jax.jit(chunked, donate_argnums=(10,)).trace(
            *ins, sd((bsz, t, 2), jnp.uint32), sd((bsz, t, width), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        names = (("gdn_chunked_p_factor", "gdn_chunked_apply_keys") if keys else
                 ("gdn_chunked_factor", "gdn_chunked_apply") if two_pass else ("gdn_chunked_verify",))
        assert "__gpu$xla.gpu.triton" in text and all(n in text for n in names), (fp32_dots, two_pass, keys)

    # The config's fp32_dots sets the chunked products ("ieee" by default); the keyword overrides it.
    def fused(**kw):
        def chunked(*a):
            return gdn_chunked_verify(*a, two_pass=False, **kw)
        return jax.jit(chunked, donate_argnums=(10,)).trace(
            *ins, sd((bsz, t, 2), jnp.uint32), sd((bsz, t, width), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()

    ieee, tf32 = fused(fp32_dots="ieee"), fused(fp32_dots="tf32x3")
    assert ieee != tf32
    assert fused() == ieee
    assert fused(config=GdnKernelConfig(fp32_dots="tf32x3")) == tf32
    assert fused(config=GdnKernelConfig(fp32_dots="tf32x3"), fp32_dots="ieee") == ieee


def test_default_form_follows_the_grid_in_the_sm90_lowering(monkeypatch):
    """two_pass=None at 16 padded rows lowers to the factor and apply kernels at the threshold grid
    (B * HV == GdnKernelConfig().two_pass_min_programs) and to the fused kernel one request below it; past 16 rows to
    the two-pass kernels on any grid (Qwen3-Next dims, HV=32). The apply kernel's default tile is 64
    columns up to 32 rows and 32 at 64 rows."""
    assert [two_pass_block_v(rows, 128) for rows in (16, 32, 64)] == [64, 64, 32]
    assert two_pass_block_v(32, 16) == 16  # never wider than dv
    sd = jax.ShapeDtypeStruct
    for t, tiles in ((16, 2), (32, 2), (64, 4)):  # the apply kernel's grid (B, HV, dv / block_v), dv=128
        ins, width = _qwen_specs(2, t)
        program = str(jax.make_jaxpr(lambda *a: gdn_chunked_verify(*a, two_pass=True, backend="interpret"))(
            *ins, sd((2, t, 2), jnp.uint32), sd((2, t, width), jnp.bfloat16)))
        assert f"grid=(2, 32, {tiles})" in program, t

    _fake_sm90(monkeypatch)
    sd = jax.ShapeDtypeStruct
    hv = 32
    small = GdnKernelConfig().two_pass_min_programs // hv - 1
    # Past 16 padded rows the two-pass form is the default on every grid.
    for bsz, t, two in ((small + 1, 16, True), (small, 16, False), (small, 17, True), (1, 33, True)):
        ins, width = _qwen_specs(bsz, t)
        assert ins[2].shape[2] == hv
        text = jax.jit(lambda *a: gdn_chunked_verify(*a, fp32_dots="tf32x3"), donate_argnums=(10,)).trace(
            *ins, sd((bsz, t, 2), jnp.uint32), sd((bsz, t, width), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert (("gdn_chunked_factor" in text or "gdn_chunked_p_factor" in text)
                and "gdn_chunked_apply" in text) == two, (bsz, t)
        assert ("gdn_chunked_verify" in text) == (not two), (bsz, t)


@pytest.mark.parametrize("fp32_dots, form", [("ieee", "fused"), ("tf32x3", "fused"), ("tf32x3", "two_pass"),
                                             ("tf32x3", "keys"), ("tf32x3", "fused+grams"),
                                             ("tf32x3", "two_pass+grams"), ("tf32x3", "keys+grams")])
def test_chunked_64_nodes_lowers_to_triton_for_sm90(monkeypatch, fp32_dots, form):
    """At T = 64 the chunked form pads to 64 rows and reads both mask words; it still lowers to
    Triton IR for sm_90 at Qwen3-Next dims (compiling and timing it is benchmarks/bench_gdn.py's)."""

    _fake_sm90(monkeypatch)
    bsz, t = 4, MAX_CHUNKED_NODES
    ins, width = _qwen_specs(bsz, t)

    def chunked(*a):
        return gdn_chunked_verify(*a, fp32_dots=fp32_dots, **_form(form))

    sd = jax.ShapeDtypeStruct
    text = jax.jit(chunked, donate_argnums=(10,)).trace(
        *ins, sd((bsz, t, 2), jnp.uint32), sd((bsz, t, width), jnp.bfloat16)).lower(
        lowering_platforms=("cuda",)).as_text()
    # The first kernel's name tells the two-pass forms apart ("gdn_chunked_apply" is a prefix of the
    # keys form's apply kernel).
    base = form.partition("+")[0]
    name = dict(fused="gdn_chunked_verify", two_pass="gdn_chunked_factor", keys="gdn_chunked_p_factor")[base]
    assert "__gpu$xla.gpu.triton" in text and name in text
    assert ("gdn_chunked_apply_keys" in text) == (base == "keys")


def test_default_config_rule():
    """`default_config(dims)` fixes value_major by the grid (B * HV against MIN_PROGRAMS = 512) and
    leaves the per-launch fields None; two_pass_min_programs steers `default_two_pass` at 16 rows."""
    from pallas_kernels.linear.gdn_tree import default_config
    small, large = GdnDims(1, 8, 4, 8, 16, 16, 2), GdnDims(64, 8, 4, 8, 16, 16, 2)
    assert default_config(small) == GdnKernelConfig(value_major=False)
    assert default_config(large) == GdnKernelConfig(value_major=True)
    for dims in (small, large):
        assert uses_value_major(dims, None) == default_config(dims).value_major
        assert pick_launch(dims, None) == pick_launch(dims, default_config(dims))
    assert GdnKernelConfig().two_pass_min_programs == 256
    assert not default_two_pass(1, 8) and default_two_pass(1, 8, config=GdnKernelConfig(two_pass_min_programs=8))
    with pytest.raises(ValueError, match="two_pass_min_programs"):
        GdnKernelConfig(two_pass_min_programs=0)
