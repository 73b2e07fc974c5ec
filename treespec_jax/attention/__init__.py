"""treespec_jax.attention: cascade tree attention (prefix decode + tree window + merge)."""

from treespec_jax.attention.cascade import (CascadeConfig, cascade_attention, lane_attention,
                                            sliding_lane_attention, verify_attention)

__all__ = ["CascadeConfig", "cascade_attention", "verify_attention", "lane_attention",
           "sliding_lane_attention"]
