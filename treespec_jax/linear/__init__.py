"""treespec_jax.linear"""
# GDN verify + commit (ReplaySSM and staged).
from treespec_jax.linear.gdn import (  # noqa: E402,F401
    GDN_TREE_VERIFY_CHUNKED_MIN_NODES, GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES, GDN_TREE_VERIFY_CHUNKED_NODES_FUSED,
    GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS, GDN_TREE_VERIFY_CHUNKED_NODES_SMALL_GRID,
    GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID, FusedChainGdnLayer, GdnLayerConfig,
    GdnTree, GdnTreeLayer, gdn_commit_replay, gdn_commit_staged, gdn_verify)
# Mamba2 verify + commit (ReplaySSM and staged) and the tree conv glue.
from treespec_jax.linear.conv import conv_commit_from_inputs, conv_commit_staged, conv_verify  # noqa: E402,F401
from treespec_jax.linear.mamba2 import (  # noqa: E402,F401
    Mamba2CommitConfig, Mamba2Dims, Mamba2Layer, Mamba2Pools, Mamba2VerifyResult, Mamba2VerifyScratch,
    Mamba2Weights, mamba2_commit, mamba2_verify, new_verify_scratch, pack_path_rows)
