"""Draft-tree lanes and selection against an independent per-request EAGLE-2 reference in numpy."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

from treespec_jax.tree import draft_tree as dt

F32 = np.float32


# ---------------------------------------------------------------- numpy reference (plain Python)

def _score(x):
    x = F32(x)
    return F32(-np.inf) if np.isnan(x) else x


def _rank_key(scores, e):
    # score descending, entry id ascending; -0.0 == 0.0 in Python comparisons
    return (-float(scores[e]), e)


def np_round(lp0, tok0, child_lps, child_toks):
    """Per request: candidate record (tokens, scores, parents, depths) and the lanes of every step."""
    b, k = lp0.shape
    s_steps = 1 + len(child_lps)
    out = []
    for r in range(b):
        tokens, scores, parents, depths = [], [], [], []
        for j in range(k):
            tokens.append(int(tok0[r, j]))
            scores.append(min(_score(lp0[r, j]), F32(0)))
            parents.append(-1)
            depths.append(1)
        lane_entries = sorted(range(k), key=lambda e: _rank_key(scores, e))
        lanes_per_step = [list(lane_entries)]
        for s in range(1, s_steps):
            base = k + (s - 1) * k * k
            for l in range(k):
                lane = lane_entries[l]
                for j in range(k):
                    child = min(_score(child_lps[s - 1][r, l, j]), F32(0))
                    tokens.append(int(child_toks[s - 1][r, l, j]))
                    scores.append(F32(scores[lane] + child))
                    parents.append(lane)
                    depths.append(s + 1)
            step_ids = list(range(base, base + k * k))
            lane_entries = sorted(step_ids, key=lambda e: _rank_key(scores, e))[:k]
            lanes_per_step.append(list(lane_entries))
        out.append(dict(tokens=tokens, scores=scores, parents=parents, depths=depths, lanes=lanes_per_step))
    return out


def eagle2_select(req, root, n):
    """Kept set = top N-1 by (score desc, id asc); order = pre-order DFS, children by rank."""
    scores, parents = req["scores"], req["parents"]
    kept = sorted(range(len(scores)), key=lambda e: _rank_key(scores, e))[: n - 1]
    kept_set = set(kept)
    assert all(parents[e] == -1 or parents[e] in kept_set for e in kept), "kept set not closed"
    children = {e: [c for c in kept if parents[c] == e] for e in [-1] + kept}
    order = []

    def visit(e):
        order.append(e)
        for c in children[e]:
            visit(c)

    for top in children[-1]:
        visit(top)
    node_of = {e: i + 1 for i, e in enumerate(order)}
    tokens = [int(root)] + [req["tokens"][e] for e in order]
    par = [-1] + [0 if parents[e] == -1 else node_of[parents[e]] for e in order]
    dep = [0] + [req["depths"][e] for e in order]
    return tokens, par, dep, [-1] + order


def expected_lane_masks(req, k, s_steps):
    """Lane-window masks from the record's parent links: slot t*K + r for every lane ancestor.
    Lanes picked at the last step own no slot, except seed lanes, which always own slot r."""
    slot_of = {}
    for t, entries in enumerate(req["lanes"][: max(s_steps - 1, 1)]):
        for r, e in enumerate(entries):
            slot_of[e] = t * k + r
    masks = []
    for entries in req["lanes"]:
        step_masks = []
        for e in entries:
            bits, cur = 0, e
            while cur >= 0:
                if cur in slot_of:
                    bits |= 1 << slot_of[cur]
                cur = req["parents"][cur]
            step_masks.append(bits)
        masks.append(step_masks)
    return masks


# ---------------------------------------------------------------- helpers

def random_round(rng, b, k, s, *, logprob_fn=None):
    def lp(shape):
        if logprob_fn is not None:
            return logprob_fn(shape)
        return np.log(rng.uniform(1e-3, 1.0, shape)).astype(F32)

    lp0 = lp((b, k))
    tok0 = rng.integers(0, 1000, (b, k)).astype(np.int32)
    child_lps = [lp((b, k, k)) for _ in range(s - 1)]
    child_toks = [rng.integers(0, 1000, (b, k, k)).astype(np.int32) for _ in range(s - 1)]
    return lp0, tok0, child_lps, child_toks


def run_round(lp0, tok0, child_lps, child_toks):
    """JAX lanes/record for one round; returns (record, lanes of every step). One jit per shape
    keeps the suite fast; selection itself is tested both jitted and eagerly."""
    return _run_round_jit(jnp.asarray(lp0), jnp.asarray(tok0), [jnp.asarray(c) for c in child_lps],
                          [jnp.asarray(c) for c in child_toks])


@jax.jit
def _run_round_jit(lp0, tok0, child_lps, child_toks):
    k = lp0.shape[1]
    s = 1 + len(child_lps)
    lanes, cands = dt.seed_lanes(jnp.asarray(lp0), jnp.asarray(tok0))
    record = dt.CandidateRecord.empty(lp0.shape[0], k, s).write(0, cands)
    all_lanes = [lanes]
    for step in range(1, s):
        lanes, cands = dt.expand_lanes(lanes, jnp.asarray(child_lps[step - 1]), jnp.asarray(child_toks[step - 1]),
                                       step, num_steps=s)
        record = record.write(step, cands)
        all_lanes.append(lanes)
    return record, all_lanes


def assert_valid_tree(parents, depths):
    parents, depths = np.asarray(parents), np.asarray(depths)
    assert (parents[:, 0] == -1).all()
    j = np.arange(parents.shape[1])
    assert ((parents[:, 1:] >= 0) & (parents[:, 1:] < j[None, 1:])).all(), parents
    parent_depth = np.take_along_axis(depths, np.maximum(parents, 0), axis=1)
    np.testing.assert_array_equal(depths[:, 1:], parent_depth[:, 1:] + 1)


def check_against_reference(tree, ref_reqs, roots, n):
    for r, req in enumerate(ref_reqs):
        tokens, par, dep, entries = eagle2_select(req, roots[r], n)
        np.testing.assert_array_equal(np.asarray(tree.entries[r]), entries, err_msg=f"request {r} entries")
        np.testing.assert_array_equal(np.asarray(tree.tokens[r]), tokens, err_msg=f"request {r} tokens")
        np.testing.assert_array_equal(np.asarray(tree.parents[r]), par, err_msg=f"request {r} parents")
        np.testing.assert_array_equal(np.asarray(tree.depths[r]), dep, err_msg=f"request {r} depths")
    assert_valid_tree(tree.parents, tree.depths)


def check_record_and_lanes(record, all_lanes, ref_reqs, k, s):
    for r, req in enumerate(ref_reqs):
        np.testing.assert_array_equal(np.asarray(record.tokens[r]), req["tokens"])
        np.testing.assert_array_equal(np.asarray(record.parents[r]), req["parents"])
        np.testing.assert_array_equal(np.asarray(record.depths[r]), req["depths"])
        # bit-exact float32 scores (same IEEE ops), -inf where the reference has -inf
        np.testing.assert_array_equal(np.asarray(record.scores[r]), np.asarray(req["scores"], F32))
        want_masks = expected_lane_masks(req, k, s)
        for step, lanes in enumerate(all_lanes):
            np.testing.assert_array_equal(np.asarray(lanes.entries[r]), req["lanes"][step])
            np.testing.assert_array_equal(np.asarray(lanes.tokens[r]), [req["tokens"][e] for e in req["lanes"][step]])
            packed = np.asarray(lanes.masks[r]).astype(np.uint64)
            got = [int(w0) | (int(w1) << 32) for w0, w1 in packed]
            assert got == want_masks[step], (step, got, want_masks[step])


def random_config(rng):
    k = int(rng.integers(1, 17))
    s = int(rng.integers(1, 11))
    e = k + (s - 1) * k * k
    n = int(rng.integers(2, min(64, e + 1) + 1))
    return k, s, n


# Named configs: the accepted examples, the deepest legal round, a seeds-only round (S = 1, every
# seed kept), and random ones over the legal range (K <= 16, S <= 10, N <= min(64, E + 1)).
# The chain (K = 1) has its own test below.
_rng = np.random.default_rng(2026)
CONFIGS = [(4, 5, 16), (16, 5, 64), (8, 9, 64), (2, 10, 30), (3, 1, 4)] + [random_config(_rng) for _ in range(2)]


class SelectTreeTest(chex.TestCase):

    # Jitted over every config (one compile each keeps the suite fast); the eager path runs the
    # same comparison on the first config and in every test below.
    @chex.variants(with_jit=True)
    @parameterized.parameters(*CONFIGS)
    def test_matches_eagle2_reference(self, k, s, n):
        self._check_config(k, s, n)

    @chex.variants(without_jit=True)
    def test_matches_eagle2_reference_eager(self):
        self._check_config(*CONFIGS[0])

    def _check_config(self, k, s, n):
        rng = np.random.default_rng(k * 1000 + s * 100 + n)
        b = 3
        lp0, tok0, child_lps, child_toks = random_round(rng, b, k, s)
        roots = rng.integers(0, 1000, (b,)).astype(np.int32)
        record, all_lanes = run_round(lp0, tok0, child_lps, child_toks)
        ref = np_round(lp0, tok0, child_lps, child_toks)
        check_record_and_lanes(record, all_lanes, ref, k, s)
        tree = self.variant(functools.partial(dt.select_tree, num_nodes=n))(record, jnp.asarray(roots))
        chex.assert_shape([tree.tokens, tree.parents, tree.depths], (b, n))
        check_against_reference(tree, ref, roots, n)

    @chex.variants(with_jit=True, without_jit=True)
    def test_near_ties(self):
        # Scores drawn from a few values one ulp apart, plus exact zeros (child ties its parent)
        # and -0.0, so ranks hinge on the last ulp and on the entry-id tie rule.
        k, s, n = 4, 4, 24
        rng = np.random.default_rng(7)
        base = F32(-0.5)
        pool = np.array([0.0, -0.0, base, np.nextafter(base, F32(0)), np.nextafter(base, F32(-1)),
                         F32(-0.25), np.nextafter(F32(-0.25), F32(0))], F32)
        lp0, tok0, child_lps, child_toks = random_round(rng, 4, k, s, logprob_fn=lambda shape: rng.choice(pool, shape))
        record, all_lanes = run_round(lp0, tok0, child_lps, child_toks)
        ref = np_round(lp0, tok0, child_lps, child_toks)
        check_record_and_lanes(record, all_lanes, ref, k, s)
        roots = np.arange(4, dtype=np.int32)
        tree = self.variant(functools.partial(dt.select_tree, num_nodes=n))(record, jnp.asarray(roots))
        check_against_reference(tree, ref, roots, n)
        scores = np.asarray(record.scores)
        assert len(np.unique(scores)) < scores.size // 2, "the near-tie test lost its ties"

    @chex.variants(with_jit=True, without_jit=True)
    def test_nan_rows_still_give_valid_trees(self):
        # Request 0: fully padded (all NaN). Request 1: NaN seeds and children sprinkled in.
        k, s, n = 3, 4, 20
        rng = np.random.default_rng(11)
        lp0, tok0, child_lps, child_toks = random_round(rng, 3, k, s)
        lp0[0] = np.nan
        for c in child_lps:
            c[0] = np.nan
        lp0[1, 1] = np.nan
        child_lps[0][1, 0, :2] = np.nan
        child_lps[1][1, 2, 1] = np.nan
        record, all_lanes = run_round(lp0, tok0, child_lps, child_toks)
        ref = np_round(lp0, tok0, child_lps, child_toks)
        check_record_and_lanes(record, all_lanes, ref, k, s)
        roots = np.array([5, 6, 7], np.int32)
        tree = self.variant(functools.partial(dt.select_tree, num_nodes=n))(record, jnp.asarray(roots))
        check_against_reference(tree, ref, roots, n)
        assert np.all(np.isneginf(np.asarray(tree.scores[0, 1:])))
        assert np.isfinite(np.asarray(tree.scores[2])).all()

    def test_strided_roots(self):
        # Roots live at stride N in a flat [B * N] verify-token buffer; select_tree takes the
        # strided view, both under jit (slice inside the traced function) and eagerly (numpy view).
        k, s, n, b = 3, 4, 20, 3  # the NaN test's shapes, so compiled pieces are shared
        rng = np.random.default_rng(3)
        lp0, tok0, child_lps, child_toks = random_round(rng, b, k, s)
        record, _ = run_round(lp0, tok0, child_lps, child_toks)
        flat = rng.integers(0, 1000, (b * n,)).astype(np.int32)
        jitted = jax.jit(lambda rec, buf: dt.select_tree(rec, buf[::n], n))(record, jnp.asarray(flat))
        view = flat[::n]
        assert not view.flags["C_CONTIGUOUS"]
        eager = dt.select_tree(record, view, n)
        ref = np_round(lp0, tok0, child_lps, child_toks)
        for tree in (jitted, eager):
            np.testing.assert_array_equal(np.asarray(tree.tokens[:, 0]), flat[::n])
            check_against_reference(tree, ref, flat[::n], n)

    @chex.variants(with_jit=True, without_jit=True)
    def test_k1_is_the_chain(self):
        s, b = 5, 2
        rng = np.random.default_rng(5)
        lp0, tok0, child_lps, child_toks = random_round(rng, b, 1, s)
        record, all_lanes = run_round(lp0, tok0, child_lps, child_toks)
        tree = self.variant(functools.partial(dt.select_tree, num_nodes=s + 1))(record, jnp.array([9, 8]))
        np.testing.assert_array_equal(np.asarray(tree.parents), np.broadcast_to(np.arange(s + 1) - 1, (b, s + 1)))
        np.testing.assert_array_equal(np.asarray(tree.depths), np.broadcast_to(np.arange(s + 1), (b, s + 1)))
        chain_tokens = np.concatenate([tok0] + [c.reshape(b, 1) for c in child_toks], axis=1)
        np.testing.assert_array_equal(np.asarray(tree.tokens[:, 1:]), chain_tokens)
        # Lane masks of a chain: lane of step t sees slots 0..t.
        for t, lanes in enumerate(all_lanes[: s - 1]):
            np.testing.assert_array_equal(np.asarray(lanes.masks[:, 0, 0]), (1 << (t + 1)) - 1)


def test_best_path_is_numbered_first():
    # The most likely root path occupies nodes 0, 1, 2, ...: node d+1 is node d's best kept child.
    k, s, n = 4, 5, 16
    rng = np.random.default_rng(13)
    lp0, tok0, child_lps, child_toks = random_round(rng, 3, k, s)
    record, _ = run_round(lp0, tok0, child_lps, child_toks)
    tree = dt.select_tree(record, jnp.zeros((3,), jnp.int32), n)
    parents, scores = np.asarray(tree.parents), np.asarray(tree.scores)
    for r in range(3):
        node = 0
        while True:
            kids = np.flatnonzero(parents[r] == node)
            if kids.size == 0:
                break
            best = kids[np.argmax(scores[r, kids])]
            assert best == node + 1 == kids.min()
            node = best


@pytest.mark.parametrize("k,s,n,match", [
    (17, 2, 16, "topk K=17"),
    (0, 3, 4, "topk K=0"),
    (4, 11, 16, "num_steps S=11"),
    (4, 0, 16, "num_steps S=0"),
    (4, 5, 65, "num_nodes N=65"),
    (2, 2, 8, "num_nodes N=8"),
    (4, 5, 1, "num_nodes N=1"),
])
def test_tree_shape_refusals(k, s, n, match):
    with pytest.raises(ValueError, match=match):
        dt.TreeShape(k, s, n)


def test_bad_inputs_raise_naming_the_value():
    record = dt.CandidateRecord.empty(2, 2, 3)
    with pytest.raises(ValueError, match="root_tokens"):
        dt.select_tree(record, jnp.zeros((2, 1), jnp.int32), 4)
    with pytest.raises(ValueError, match="num_nodes N=12"):
        dt.select_tree(record, jnp.zeros((2,), jnp.int32), 12)
    lanes, _ = dt.seed_lanes(jnp.zeros((2, 2)) - 1.0, jnp.zeros((2, 2), jnp.int32))
    with pytest.raises(ValueError, match="got 3"):
        dt.expand_lanes(lanes, -jnp.ones((2, 2, 2)), jnp.zeros((2, 2, 2), jnp.int32), 3, num_steps=3)
    with pytest.raises(ValueError, match=r"\(2, 2, 2\)"):
        dt.expand_lanes(lanes, -jnp.ones((2, 2, 3)), jnp.zeros((2, 2, 3), jnp.int32), 1, num_steps=3)
    with pytest.raises(ValueError, match="lane window"):
        lanes16, _ = dt.seed_lanes(-jnp.ones((1, 16)), jnp.zeros((1, 16), jnp.int32))
        dt.expand_lanes(lanes16, -jnp.ones((1, 16, 16)), jnp.zeros((1, 16, 16), jnp.int32), 1, num_steps=6)
    with pytest.raises(ValueError, match="step must be"):
        record.write(3, dt.StepCandidates(tokens=jnp.zeros((2, 4), jnp.int32), scores=jnp.zeros((2, 4)),
                                          parents=jnp.zeros((2, 4), jnp.int32)))
