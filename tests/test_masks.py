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


def test_pallas_kernels_import_nothing_from_treespec_jax():
    """pallas_kernels is a package of its own: every module imports without treespec_jax (mask
    packing, slot addressing and the shared constants live in pallas_kernels; treespec_jax
    re-exports them), and treespec_jax's names are the kernels' objects."""
    import subprocess
    import sys
    from pathlib import Path

    import pallas_kernels
    import pallas_kernels.paging
    import pallas_kernels.tree_masks
    from treespec_jax.cache import paged

    root = Path(pallas_kernels.__file__).parent
    modules = sorted("pallas_kernels." + ".".join(p.relative_to(root).with_suffix("").parts)
                     for p in root.rglob("*.py") if p.name != "__init__.py")
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "leaked = sorted(m for m in sys.modules if m.split('.')[0] == 'treespec_jax')\n"
            "assert not leaked, leaked\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root.parent, timeout=300)
    assert masks.ancestor_mask is pallas_kernels.tree_masks.ancestor_mask
    assert masks.MAX_TREE_NODES is pallas_kernels.tree_masks.MAX_TREE_NODES
    assert paged.slot_of is pallas_kernels.paging.slot_of
