"""Ancestor masks and depths of draft trees: `pallas_kernels.tree_masks`, the packed form the kernels
read, under the names treespec_jax code imports (one implementation, one MAX_TREE_NODES)."""

from pallas_kernels.tree_masks import (MAX_TREE_NODES, ancestor_mask, ancestor_mask_bool, chain_parents, depths,
                                       pack_mask_rows, unpack_mask_rows)

__all__ = ["MAX_TREE_NODES", "ancestor_mask", "ancestor_mask_bool", "chain_parents", "depths", "pack_mask_rows",
           "unpack_mask_rows"]
