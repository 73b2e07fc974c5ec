"""TreeSpec: load_step / compact_rows round trips, row movement, and the fresh spec being the chain."""

import functools

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from trees import random_parents

from treespec_jax.tree import masks
from treespec_jax.tree.spec import TreeSpec


def random_root_path(rng, parents_row):
    """A random accepted path: from the root, step to a random child, stop at random or at a leaf."""
    n = len(parents_row)
    path, cur = [0], 0
    while True:
        kids = [j for j in range(n) if parents_row[j] == cur]
        if not kids or rng.random() < 0.15:
            break
        cur = int(rng.choice(kids))
        path.append(cur)
    return path + [-1] * (n - len(path))


def python_depths(parents_row):
    out = []
    for j in range(len(parents_row)):
        d, cur = 0, j
        while parents_row[cur] >= 0:
            cur, d = parents_row[cur], d + 1
        out.append(d)
    return out


class TreeSpecTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_round_trip_for_random_depths(self):
        rng = np.random.default_rng(0)
        b, n, h = 4, 16, 6
        parents = random_parents(rng, b, n)
        spec = TreeSpec.from_parents(jnp.asarray(parents))
        np.testing.assert_array_equal(np.asarray(spec.depths), [python_depths(p) for p in parents])
        vc = rng.integers(0, 5000, (b,)).astype(np.int32)
        window_positions = vc[:, None] + np.arange(n)[None]
        loaded = np.asarray(self.variant(lambda s, p: s.load_step(p))(spec, jnp.asarray(window_positions)))
        np.testing.assert_array_equal(loaded, vc[:, None] + np.asarray(spec.depths))

        path = np.array([random_root_path(rng, p) for p in parents], np.int32)
        hidden = rng.normal(size=(b, n, h)).astype(np.float32)
        compact = self.variant(functools.partial(TreeSpec.compact_rows, backend="reference"))
        moved, back = compact(spec, jnp.asarray(path), jnp.asarray(hidden), jnp.asarray(loaded))
        np.testing.assert_array_equal(np.asarray(back), window_positions)  # the shifts cancel
        want = hidden.copy()
        for i in range(b):
            for d in range(n):
                if path[i, d] >= 0:
                    want[i, d] = hidden[i, path[i, d]]
        np.testing.assert_array_equal(np.asarray(moved), want)
        # Row d now holds the path node at depth d: its position before compaction was vc + d.
        for i in range(b):
            for d in range(n):
                if path[i, d] >= 0:
                    assert loaded[i, path[i, d]] == vc[i] + d
        assert (path[:, 2] >= 0).sum() >= 2, "random paths too short to exercise row moves"

    @chex.variants(with_jit=True, without_jit=True)
    def test_fresh_spec_is_the_chain(self):
        b, n = 3, 9
        spec = TreeSpec.chain(b, n)
        np.testing.assert_array_equal(np.asarray(spec.parents), np.asarray(masks.chain_parents(b, n)))
        np.testing.assert_array_equal(np.asarray(spec.depths), np.asarray(masks.depths(spec.parents)))
        rng = np.random.default_rng(1)
        positions = jnp.asarray(rng.integers(0, 100, (b, 1)) + np.arange(n)[None], jnp.int32)
        # A warm-up forward that skips load_step sees the chain positions: load_step is a no-op.
        np.testing.assert_array_equal(np.asarray(self.variant(lambda s, p: s.load_step(p))(spec, positions)),
                                      np.asarray(positions))
        accept = np.array([1, 4, 9])
        path = np.where(np.arange(n)[None] < accept[:, None], np.arange(n)[None], -1).astype(np.int32)
        hidden = jnp.asarray(rng.normal(size=(b, n, 2, 3)), jnp.bfloat16)
        moved, back = self.variant(functools.partial(TreeSpec.compact_rows, backend="reference"))(
            spec, jnp.asarray(path), hidden, positions)
        np.testing.assert_array_equal(np.asarray(back), np.asarray(positions))
        np.testing.assert_array_equal(np.asarray(moved, np.float32), np.asarray(hidden, np.float32))


def test_compact_rows_pallas_path_matches_reference():
    # The default backend (Pallas row move; interpret mode on CPU) moves the same rows as the
    # reference (the row-move kernel's own tests cover every dtype). The last row is NaN-poisoned:
    # it must travel as raw bits when a path picks it, and never leak into another row otherwise.
    rng = np.random.default_rng(2)
    b, n, h = 3, 8, 16
    parents = random_parents(rng, b, n)
    spec = TreeSpec.from_parents(jnp.asarray(parents))
    path = jnp.asarray(np.array([random_root_path(rng, p) for p in parents], np.int32))
    hidden = jnp.asarray(rng.normal(size=(b, n, h)), jnp.bfloat16).at[:, -1].set(jnp.nan)
    positions = spec.load_step(jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))
    ref_rows, ref_pos = spec.compact_rows(path, hidden, positions, backend="reference")
    rows, pos = spec.compact_rows(path, hidden, positions)
    np.testing.assert_array_equal(np.asarray(rows, np.float32), np.asarray(ref_rows, np.float32))
    np.testing.assert_array_equal(np.asarray(pos), np.asarray(ref_pos))


def test_shape_errors_name_the_argument():
    spec = TreeSpec.chain(2, 4)
    with pytest.raises(ValueError, match="positions"):
        spec.load_step(jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ValueError, match="hidden"):
        spec.compact_rows(jnp.zeros((2, 4), jnp.int32), jnp.zeros((2, 3, 8)), jnp.zeros((2, 4), jnp.int32))
    with pytest.raises(ValueError, match="N=65"):
        TreeSpec.chain(1, 65)
