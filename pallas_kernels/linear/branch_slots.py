"""Branch points of a draft tree: the nodes whose state a recurrent tree scan needs again.

A tree scan walks nodes in index order carrying one running state (the state after node t - 1).
Node t whose parent p is neither t - 1 nor a root needs the state after p again: p is a *branch
point* (it has a child other than p + 1). GDN's ReplaySSM verify stores exactly these states
(`gdn_tree.gdn_tree_verify(store="branch_points")`); Mamba2's scan replays them from the inputs.

Neither scan keeps branch-point states in on-chip register slots: slots are slower for both
(results: gdn-branch-slots, mamba2-branch-slots). GDN imports `branch_points` from this module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def branch_points(parents: jax.Array) -> jax.Array:
    """`parents [B, T]` -> `[B, T] bool`: node s has a child c with c != s + 1."""
    t = parents.shape[-1]
    child_of = jax.nn.one_hot(parents, t, dtype=jnp.bool_)  # [B, c, s]; parent -1 -> no bit
    not_next = jnp.arange(t)[:, None] != jnp.arange(t)[None, :] + 1  # c != s + 1
    return jnp.any(child_of & not_next, axis=-2)


__all__ = ["branch_points"]
