"""Pure, jit-able tree pieces: selection, ancestor masks, verify walks, TreeSpec."""

from treespec_jax.tree.draft_tree import (
    CandidateRecord,
    DraftTree,
    Lanes,
    StepCandidates,
    TreeShape,
    build_record,
    expand_lanes,
    seed_lanes,
    select_tree,
)
from treespec_jax.tree.masks import ancestor_mask, chain_parents, depths
from treespec_jax.tree.spec import TreeSpec
from treespec_jax.tree.verify import (
    AcceptedPath,
    greedy_walk,
    keyed_sample_walk,
    keyed_targets,
    node_sample_positions,
    rejection_walk,
)

__all__ = [
    "AcceptedPath",
    "CandidateRecord",
    "DraftTree",
    "Lanes",
    "StepCandidates",
    "TreeShape",
    "TreeSpec",
    "ancestor_mask",
    "build_record",
    "chain_parents",
    "depths",
    "expand_lanes",
    "greedy_walk",
    "keyed_sample_walk",
    "keyed_targets",
    "node_sample_positions",
    "rejection_walk",
    "seed_lanes",
    "select_tree",
]
