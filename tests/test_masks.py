import chex
import numpy as np
import pytest
from trees import random_parents

from treespec_jax.tree import masks


def python_mask(parents_row):
    n = len(parents_row)
    rows = []
    for i in range(n):
        bits, j = 0, int(i)
        while j >= 0:
            bits |= 1 << j
            j = int(parents_row[j])
        rows.append(bits)
    return rows


@pytest.mark.parametrize("n", [1, 2, 7, 33, 64])
def test_ancestor_mask_matches_python(n):
    rng = np.random.default_rng(n)
    parents = random_parents(rng, 3, n)
    packed = np.asarray(masks.ancestor_mask(parents))
    dep = np.asarray(masks.depths(parents))
    chex.assert_shape(packed, (3, n, 2))
    for b in range(3):
        ref = python_mask(parents[b])
        got = [int(packed[b, i, 0]) | (int(packed[b, i, 1]) << 32) for i in range(n)]
        assert got == ref
        assert list(dep[b]) == [bin(r).count("1") - 1 for r in ref]


def test_chain_mask_is_low_bits():
    packed = np.asarray(masks.ancestor_mask(masks.chain_parents(2, 64)))
    got = [int(packed[0, i, 0]) | (int(packed[0, i, 1]) << 32) for i in range(64)]
    assert got == [(1 << (i + 1)) - 1 for i in range(64)]
    np.testing.assert_array_equal(np.asarray(masks.depths(masks.chain_parents(2, 64)))[1], np.arange(64))


def test_pack_unpack_round_trip():
    rng = np.random.default_rng(0)
    rows = rng.random((4, 5, 64)) < 0.5
    back = np.asarray(masks.unpack_mask_rows(masks.pack_mask_rows(rows), 64))
    np.testing.assert_array_equal(back, rows)
