"""Where a recurrent tree scan keeps the states its branches come back to.

A tree scan walks nodes in index order carrying one running state (the state after node t - 1).
Node t whose parent p is neither t - 1 nor a root needs the state after p again: p is a *branch
point* (it has a child other than p + 1). Storing that state to memory costs a full state write
and read per branch point, which at large batch is most of the tree's extra cost over a chain.
Most trees have few branch points alive at once (DFS numbering makes them a stack), so a program
can keep them in a handful of on-chip register slots instead.

`branch_slot_plan(parents, num_slots)` decides, once per step for every layer, which branch point
lives in which slot. A branch point s is alive from s until its last non-next child; slots are
handed out in node order to the lowest slot that is free by then (interval colouring in start
order, which never spills while at most `num_slots` branch points are alive at once). A branch
point that finds no free slot is *spilled*: the kernel falls back to its slot-less path for it
(GDN: the shared workspace row; Mamba2: replay of the ancestors).

Plan, all `[B, T]`:
  save_slot  int32  slot that keeps the state after node t, or -1
  load_slot  int32  for a node whose parent p is a branch point (p >= 0, p != t - 1): the slot
                    holding p's state, or -1 when p was spilled; -1 for every other node
  spill      bool   branch point t got no slot (the kernel's fallback store applies to it)
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Register slots a tree kernel keeps by default: none. On the H200 (benchmarks/RESULTS.md, 04:10 and
# 04:15 UTC, B=32, T=16) two slots made both scans slower than their slot-less paths even though
# they cut the spilled branch points from 29% to 8% of nodes: GDN ReplaySSM tree 429 vs 374 us (the
# slot tiles force 32-column tiles and per-node selects), Mamba2 1374 vs 970 us. GDN's slot path was
# removed after a second measurement (B=32, T=64: 2076 vs 1521 us with one slot); Mamba2 keeps slots
# as an option (Mamba2CommitConfig.branch_slots).
DEFAULT_BRANCH_SLOTS = 0
MAX_BRANCH_SLOTS = 4


class BranchSlotPlan(NamedTuple):
    save_slot: jax.Array  # [B, T] int32, -1 = not kept on chip
    load_slot: jax.Array  # [B, T] int32, -1 = parent not in a slot (t - 1, a root, or spilled)
    spill: jax.Array  # [B, T] bool, branch point kept by the fallback path


def branch_points(parents: jax.Array) -> jax.Array:
    """`parents [B, T]` -> `[B, T] bool`: node s has a child c with c != s + 1."""
    t = parents.shape[-1]
    child_of = jax.nn.one_hot(parents, t, dtype=jnp.bool_)  # [B, c, s]; parent -1 -> no bit
    not_next = jnp.arange(t)[:, None] != jnp.arange(t)[None, :] + 1  # c != s + 1
    return jnp.any(child_of & not_next, axis=-2)


def check_num_slots(num_slots: int) -> int:
    if not isinstance(num_slots, int) or not 0 <= num_slots <= MAX_BRANCH_SLOTS:
        raise ValueError(f"branch slots must be an int in [0, {MAX_BRANCH_SLOTS}], got {num_slots!r}")
    return num_slots


def _last_reuse(parents: jax.Array) -> jax.Array:
    """`[B, T]`: the last child c != s + 1 of node s, or -1 (not a branch point)."""
    t = parents.shape[-1]
    child = jnp.arange(t)
    reuse = parents[:, :, None] == child[None, None, :]  # [B, c, s]: parents[b, c] == s
    reuse = reuse & (child[:, None] != jnp.arange(t)[None, :] + 1)[None]
    return jnp.max(jnp.where(reuse, child[None, :, None], -1), axis=1)


@functools.partial(jax.jit, static_argnames=("num_slots",))
def branch_slot_plan(parents: jax.Array, num_slots: int = DEFAULT_BRANCH_SLOTS) -> BranchSlotPlan:
    """`parents [B, T]` (parents[t] < t, -1 for a root) -> `BranchSlotPlan`; see the module doc."""
    check_num_slots(num_slots)
    parents = parents.astype(jnp.int32)
    batch, t = parents.shape
    last = _last_reuse(parents)  # [B, T]
    is_branch = last >= 0
    if num_slots == 0:  # every branch point spills; no scan (a few XLA ops less per step)
        none = jnp.full((batch, t), -1, jnp.int32)
        return BranchSlotPlan(none, none, is_branch)

    def step(free_at, node):
        # free_at [B, S]: the last node that reads the slot's occupant (-1 = never used). A slot
        # whose occupant's last reader is this node is free for this node's own save: the read
        # happens before the node's state is computed.
        free = free_at <= node
        has_free = jnp.any(free, axis=1) if num_slots else jnp.zeros((batch,), bool)
        slot = jnp.argmax(free, axis=1).astype(jnp.int32) if num_slots else jnp.zeros((batch,), jnp.int32)
        take = is_branch[:, node] & has_free
        save = jnp.where(take, slot, -1)
        if num_slots:
            hit = (jnp.arange(num_slots)[None, :] == slot[:, None]) & take[:, None]
            free_at = jnp.where(hit, last[:, node][:, None], free_at)
        return free_at, save

    free0 = jnp.full((batch, num_slots), -1, jnp.int32)
    _, save = lax.scan(step, free0, jnp.arange(t))
    save = save.T  # [B, T]
    p = parents
    from_slot = (p >= 0) & (p != jnp.arange(t)[None, :] - 1)
    load = jnp.where(from_slot, jnp.take_along_axis(save, jnp.maximum(p, 0), axis=1), -1)
    return BranchSlotPlan(save, load, is_branch & (save < 0))


__all__ = ["BranchSlotPlan", "branch_points", "branch_slot_plan", "check_num_slots",
           "DEFAULT_BRANCH_SLOTS", "MAX_BRANCH_SLOTS"]
