"""treespec_jax.linear"""
# GDN verify + commit (ReplaySSM and staged).
from treespec_jax.linear.gdn import (  # noqa: E402,F401
    GDN_TREE_VERIFY_CHUNKED_MAX_NODES, GDN_TREE_VERIFY_CHUNKED_MIN_NODES, FusedChainGdnLayer, GdnLayerConfig,
    GdnTree, GdnTreeLayer, gdn_commit_replay, gdn_commit_staged, gdn_verify)
