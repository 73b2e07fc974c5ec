"""Verify walks: greedy and keyed walks against plain decoding, rejection sampling in distribution."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from chi_square import P_MIN, chi_square_p
from trees import random_parents

from treespec_jax.sampling.keyed import SamplingParams, sample_at
from treespec_jax.sampling.rejection import walk_keys
from treespec_jax.tree import verify
from treespec_jax.tree.masks import chain_parents, depths


def python_greedy_walk(tokens, parents, target):
    """Per request, straight from the rule: smallest-index child whose token is the pick."""
    n = len(tokens)
    path, predicts, cur = [0], [], 0
    while True:
        pick = int(target[cur])
        kids = [j for j in range(n) if parents[j] == cur and tokens[j] == pick]
        if not kids:
            predicts.append(pick)
            break
        predicts.append(pick)
        cur = kids[0]
        path.append(cur)
    pad = lambda x: x + [-1] * (n - len(x))
    return pad(path), len(path), pad(predicts)


def check_path(got, want_path, want_len, want_predicts):
    np.testing.assert_array_equal(np.asarray(got.path), want_path)
    np.testing.assert_array_equal(np.asarray(got.accept_len), want_len)
    np.testing.assert_array_equal(np.asarray(got.predicts), want_predicts)


class WalkTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_greedy_walk_matches_python(self):
        rng = np.random.default_rng(0)
        b, n = 6, 24
        parents = random_parents(rng, b, n)
        parents[0] = np.arange(n) - 1  # one chain-shaped request
        tokens = rng.integers(0, 3, (b, n)).astype(np.int32)  # vocab 3: plenty of matches and duplicates
        target = rng.integers(0, 3, (b, n)).astype(np.int32)
        got = self.variant(verify.greedy_walk)(jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(target))
        want = [python_greedy_walk(tokens[i], parents[i], target[i]) for i in range(b)]
        check_path(got, [w[0] for w in want], [w[1] for w in want], [w[2] for w in want])
        assert np.asarray(got.accept_len).max() >= 3, "test tree too shallow to mean anything"
        path = np.asarray(got.path)
        for i in range(b):  # path strictly increases and follows parent links
            a = int(got.accept_len[i])
            assert (np.diff(path[i, :a]) > 0).all()
            assert all(parents[i, path[i, d]] == path[i, d - 1] for d in range(1, a))

    @chex.variants(with_jit=True, without_jit=True)
    def test_chain_shaped_tree_verifies_like_the_chain(self):
        rng = np.random.default_rng(1)
        b, n = 5, 8
        target = rng.integers(0, 50, (b, n)).astype(np.int32)
        tokens = rng.integers(0, 50, (b, n)).astype(np.int32)
        accept = [0, 3, 7, 1, 5]  # draft tokens matching the chain's targets
        for i, a in enumerate(accept):
            tokens[i, 1:a + 1] = target[i, :a]
            if a + 1 < n:
                tokens[i, a + 1] = (target[i, a] + 1) % 50
        got = self.variant(verify.greedy_walk)(jnp.asarray(tokens), chain_parents(b, n), jnp.asarray(target))
        for i, a in enumerate(accept):
            assert int(got.accept_len[i]) == a + 1
            np.testing.assert_array_equal(np.asarray(got.path[i]), [d if d <= a else -1 for d in range(n)])
            np.testing.assert_array_equal(np.asarray(got.predicts[i]), [target[i, d] if d <= a else -1 for d in range(n)])

    @chex.variants(with_jit=True)  # eager keyed draws are covered in test_sampling.py
    def test_every_node_draws_the_plain_decoding_draw_at_its_depth(self):
        rng = np.random.default_rng(2)
        b, n, v = 3, 12, 32
        parents = random_parents(rng, b, n)
        logits = rng.normal(0, 2, (b, n, v)).astype(np.float32)
        seeds = np.array([5, 6, 7], np.int32)
        vc = np.array([10, 200, 3000], np.int32)
        params = SamplingParams.create([1.0, 0.6, 0.0], [0, 8, 0], [1.0, 0.9, 1.0])
        draws = np.asarray(self.variant(verify.keyed_targets)(
            jnp.asarray(logits), jnp.asarray(parents), jnp.asarray(seeds), jnp.asarray(vc), params))
        # Passing precomputed depths (TreeSpec.depths) gives the same draws.
        with_depths = verify.keyed_targets(jnp.asarray(logits), jnp.asarray(parents), jnp.asarray(seeds),
                                           jnp.asarray(vc), params, depths(jnp.asarray(parents)))
        np.testing.assert_array_equal(np.asarray(with_depths), draws)
        plain = jax.jit(sample_at)
        for i in range(b):
            one = SamplingParams.create(params.temperature[i:i + 1], params.top_k[i:i + 1], params.top_p[i:i + 1])
            for j in range(n):
                d, cur = 0, j
                while parents[i, cur] >= 0:
                    cur, d = parents[i, cur], d + 1
                want = plain(jnp.asarray(logits[i, j][None]), jnp.asarray(seeds[i:i + 1]),
                             jnp.asarray([vc[i] + d + 1]), one)
                assert draws[i, j] == int(want[0]), (i, j)

    @chex.variants(with_jit=True)  # eager keyed draws are covered in test_sampling.py
    def test_keyed_walk_accepts_what_plain_decoding_draws(self):
        # Plain decoding draws t_d from logits L_d at position vc + d + 1. A tree that contains the
        # draft t_0, t_1, ... on one root path (with L_d at the depth-d path node and decoy siblings)
        # and the chain-shaped tree with the same draft both accept exactly t_0 .. t_A.
        rng = np.random.default_rng(3)
        v, depth_len = 16, 4
        seeds, vc = np.array([42, 43], np.int32), np.array([100, 7], np.int32)
        params = SamplingParams.create([0.9, 1.1], [0, 10], [0.95, 1.0])
        chain_logits = rng.normal(0, 1.5, (2, depth_len + 1, v)).astype(np.float32)
        plain = np.asarray(jax.jit(sample_at)(jnp.asarray(chain_logits), jnp.asarray(seeds),
                                              jnp.asarray(vc[:, None] + 1 + np.arange(depth_len + 1)), params))
        # Tree: path nodes 0, 2, 4, 6, 8 at depths 0..4; decoys 1, 3, 5, 7 are earlier-index siblings.
        n = 2 * depth_len + 1
        parents = np.zeros((2, n), np.int32)
        parents[:, 0] = -1
        tokens = np.zeros((2, n), np.int32)
        logits = rng.normal(0, 1.5, (2, n, v)).astype(np.float32)
        for d in range(depth_len + 1):
            node = 2 * d
            logits[:, node] = chain_logits[:, d]
            if d > 0:
                parents[:, node] = 2 * (d - 1)
                parents[:, node - 1] = 2 * (d - 1)
                tokens[:, node] = plain[:, d - 1]
                tokens[:, node - 1] = (plain[:, d - 1] + 1) % v  # decoy never matches
        # Request 1 diverges after depth 2: its depth-3 path token is wrong.
        tokens[1, 6] = (plain[1, 2] + 2) % v
        walk = self.variant(verify.keyed_sample_walk)
        tree = walk(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(seeds),
                    jnp.asarray(vc), params)
        chain_tokens = np.concatenate([np.zeros((2, 1), np.int32), plain[:, :depth_len]], axis=1)
        chain_tokens[1, 3] = tokens[1, 6]
        chain = walk(jnp.asarray(chain_logits), jnp.asarray(chain_tokens), chain_parents(2, depth_len + 1),
                     jnp.asarray(seeds), jnp.asarray(vc), params)
        np.testing.assert_array_equal(np.asarray(tree.accept_len), [depth_len + 1, 3])
        np.testing.assert_array_equal(np.asarray(chain.accept_len), [depth_len + 1, 3])
        for i, a in enumerate([depth_len + 1, 3]):
            np.testing.assert_array_equal(np.asarray(tree.predicts[i, :a]), plain[i, :a])
            np.testing.assert_array_equal(np.asarray(chain.predicts[i, :a]), plain[i, :a])
            np.testing.assert_array_equal(np.asarray(tree.path[i, :a]), 2 * np.arange(a))

    def test_temperature_zero_is_the_greedy_walk(self):
        rng = np.random.default_rng(4)
        b, n, v = 4, 10, 4
        parents = random_parents(rng, b, n)
        logits = rng.normal(0, 1, (b, n, v)).astype(np.float32)
        tokens = rng.integers(0, v, (b, n)).astype(np.int32)
        got = jax.jit(verify.keyed_sample_walk)(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents),
                                                jnp.arange(b), jnp.zeros((b,), jnp.int32), SamplingParams.greedy(b))
        want = verify.greedy_walk(jnp.asarray(tokens), jnp.asarray(parents), jnp.argmax(jnp.asarray(logits), -1))
        for field in ("path", "accept_len", "predicts"):
            np.testing.assert_array_equal(np.asarray(getattr(got, field)), np.asarray(getattr(want, field)))


# ---------------------------------------------------------------- rejection sampling, in distribution

DRAWS = 200_000
V = 5


def _dirichlet(rng, shape):
    return rng.dirichlet(np.ones(V) * 0.8, size=shape).astype(np.float32)


def _check_first_two_tokens(out, p_root, p_next, label):
    """predicts[0] ~ p_root; given an accepted first token x, predicts[1] ~ p_next[x]."""
    predicts, accept_len = np.asarray(out.predicts), np.asarray(out.accept_len)
    p = chi_square_p(np.bincount(predicts[:, 0], minlength=V), p_root)
    assert p > P_MIN, (label, "first token", p)
    tested = 0
    for x in range(V):
        sel = (predicts[:, 0] == x) & (accept_len >= 2)
        if sel.sum() < 2000:
            continue
        p = chi_square_p(np.bincount(predicts[sel, 1], minlength=V), p_next[x])
        assert p > P_MIN, (label, "second token after", x, p)
        tested += 1
    assert tested >= 2, f"{label}: too few accepted first tokens to test the second level"


def test_rejection_walk_point_mass_children_is_exact():
    # Fixed tree: root children 1, 2, 3 (tokens 0, 2, 0: a duplicate is never accepted twice),
    # node 1 has children 4, 5 (tokens 1, 3), node 2 has child 6 (token 4). The target at a node
    # depends on its token path: p_root at the root, p_next[x] after token x.
    rng = np.random.default_rng(10)
    p_root, p_next = _dirichlet(rng, ()), _dirichlet(rng, (V,))
    parents = np.array([-1, 0, 0, 0, 1, 1, 2], np.int32)
    tokens = np.array([9, 0, 2, 0, 1, 3, 4], np.int32)
    node_probs = np.stack([p_root, p_next[0], p_next[2], p_next[0], _dirichlet(rng, ()), _dirichlet(rng, ()),
                           _dirichlet(rng, ())])
    b, n = DRAWS, len(parents)
    out = jax.jit(verify.rejection_walk)(
        jnp.broadcast_to(jnp.asarray(node_probs), (b, n, V)), jnp.broadcast_to(jnp.asarray(tokens), (b, n)),
        jnp.broadcast_to(jnp.asarray(parents), (b, n)), jax.random.split(jax.random.key(0), b))
    _check_first_two_tokens(out, p_root, p_next, "point mass")
    path = np.asarray(out.path)
    assert not (path[:, 1] == 3).any(), "a duplicate child was accepted after its twin was rejected"
    accepted_first = np.isin(path[:, 1], [1, 2])
    np.testing.assert_allclose(accepted_first.mean(), p_root[0] + p_root[2], atol=5e-3)


def test_rejection_walk_sampled_children_is_exact():
    # Children drawn without replacement from the draft q (Gumbel top-k = sequential draws in
    # draw order): 3 under the root (nodes 1..3), 2 under node 1 (nodes 4, 5), 1 under node 2 (6).
    rng = np.random.default_rng(11)
    p_root, p_next = _dirichlet(rng, ()), _dirichlet(rng, (V,))
    q_root, q_next = _dirichlet(rng, ()), _dirichlet(rng, (V,))
    b, n = DRAWS, 7
    parents = np.broadcast_to(np.array([-1, 0, 0, 0, 1, 1, 2], np.int32), (b, n))

    def draw_without_replacement(q, count):
        keys = np.log(q) + rng.gumbel(size=q.shape)
        return np.argsort(-keys, axis=-1)[:, :count].astype(np.int32)

    tokens = np.zeros((b, n), np.int32)
    tokens[:, 1:4] = draw_without_replacement(np.broadcast_to(q_root, (b, V)), 3)
    tokens[:, 4:6] = draw_without_replacement(q_next[tokens[:, 1]], 2)
    tokens[:, 6:7] = draw_without_replacement(q_next[tokens[:, 2]], 1)
    target = np.zeros((b, n, V), np.float32)
    draft = np.zeros((b, n, V), np.float32)
    target[:, 0], draft[:, 0] = p_root, q_root
    for j in (1, 2, 3):
        target[:, j], draft[:, j] = p_next[tokens[:, j]], q_next[tokens[:, j]]
    for j in (4, 5, 6):  # deeper targets: any fixed distributions (only bonus draws read them)
        target[:, j] = p_root[::-1]
        draft[:, j] = q_root
    keys = walk_keys(jnp.arange(b), jnp.full((b,), 77))  # per-request (seed, position) keys
    out = jax.jit(verify.rejection_walk)(jnp.asarray(target), jnp.asarray(tokens), jnp.asarray(parents),
                                         keys, jnp.asarray(draft))
    _check_first_two_tokens(out, p_root, p_next, "sampled q")
    # The accepted path follows parent links and its tokens are what predicts reports.
    path, alen, predicts = np.asarray(out.path), np.asarray(out.accept_len), np.asarray(out.predicts)
    two = alen >= 2
    np.testing.assert_array_equal(tokens[two, path[two, 1]], predicts[two, 0])
    assert (parents[two, path[two, 1]] == 0).all()


def test_rejection_walk_does_not_depend_on_batch_slot():
    # Keys come from (seed, position), so permuting the batch permutes the results.
    rng = np.random.default_rng(12)
    b, n = 16, 9
    parents = random_parents(rng, b, n)
    tokens = rng.integers(0, V, (b, n)).astype(np.int32)
    target, draft = _dirichlet(rng, (b, n)), _dirichlet(rng, (b, n))
    seeds, vc = np.arange(b) * 7 + 1, rng.integers(0, 1000, b)
    walk = jax.jit(verify.rejection_walk)
    out = walk(jnp.asarray(target), jnp.asarray(tokens), jnp.asarray(parents), walk_keys(seeds, vc), jnp.asarray(draft))
    perm = rng.permutation(b)
    out_p = walk(jnp.asarray(target[perm]), jnp.asarray(tokens[perm]), jnp.asarray(parents[perm]),
                 walk_keys(seeds[perm], vc[perm]), jnp.asarray(draft[perm]))
    for field in ("path", "accept_len", "predicts"):
        np.testing.assert_array_equal(np.asarray(getattr(out_p, field)), np.asarray(getattr(out, field))[perm])
    other = walk(jnp.asarray(target), jnp.asarray(tokens), jnp.asarray(parents), walk_keys(seeds + 1, vc),
                 jnp.asarray(draft))
    assert (np.asarray(other.predicts) != np.asarray(out.predicts)).any()


def test_rejection_walk_rejects_bad_shapes():
    b, n = 2, 3
    probs = jnp.full((b, n, V), 1.0 / V)
    tokens, parents = jnp.zeros((b, n), jnp.int32), chain_parents(b, n)
    with pytest.raises(ValueError, match="keys"):
        verify.rejection_walk(probs, tokens, parents, jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError, match="draft_probs"):
        verify.rejection_walk(probs, tokens, parents, jax.random.split(jax.random.key(0), b), probs[:, :, :2])
    with pytest.raises(ValueError, match="parents"):
        verify.greedy_walk(tokens, parents[:, :2], tokens)
