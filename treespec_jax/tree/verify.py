"""Verify walks: which root path of each draft tree the target accepts.

All walks return an `AcceptedPath`, the one description of the accepted path every consumer reads
(KV compaction, TreeSpec.compact_rows, recurrent-state commit, the output processor):

- path `[B, N]` int32: path[d] = node index at depth d of the accepted path (path[0] = 0), -1 past
  the last accepted node. Node indices increase strictly along the path (parents[j] < j), so
  path[d] >= d, which makes in-place compaction in increasing d safe.
- accept_len `[B]` int32: accepted draft tokens + 1 (the bonus token), so 1 <= accept_len <= N.
- predicts `[B, N]` int32: predicts[d] = the target's token after path[d]; for d < accept_len - 1
  it equals the token of path[d + 1], predicts[accept_len - 1] is the bonus. Padded with -1.

Trees are `node_tokens [B, N]` and `parents [B, N]` (parents[:, 0] = -1, 0 <= parents[j] < j).
Node 0 is the root (the last committed token) and its token is never compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from treespec_jax.sampling.keyed import SamplingParams, sample_at
from treespec_jax.sampling.rejection import tree_rejection_sample
from treespec_jax.tree import masks


@struct.dataclass
class AcceptedPath:
    """The accepted root path of each request's tree (see module docstring)."""

    path: jax.Array  # [B, N] int32: node at depth d, -1 padded past accept_len - 1
    accept_len: jax.Array  # [B] int32: accepted draft tokens + the bonus token
    predicts: jax.Array  # [B, N] int32: target token after path[d], -1 padded


def _check_tree(node_tokens: jax.Array, parents: jax.Array, target_tokens: jax.Array | None = None):
    if node_tokens.ndim != 2 or parents.shape != node_tokens.shape:
        raise ValueError(f"node_tokens {node_tokens.shape} and parents {parents.shape} must both be [B, N]")
    if target_tokens is not None and target_tokens.shape != node_tokens.shape:
        raise ValueError(f"target_tokens has shape {target_tokens.shape}; expected {node_tokens.shape}")
    if node_tokens.shape[1] > masks.MAX_TREE_NODES:
        raise ValueError(f"trees hold at most {masks.MAX_TREE_NODES} nodes, got N={node_tokens.shape[1]}")


def greedy_walk(node_tokens: jax.Array, parents: jax.Array, target_tokens: jax.Array) -> AcceptedPath:
    """Greedy tree walk. `node_tokens, parents, target_tokens [B, N]` -> AcceptedPath.

    target_tokens[b, i] is the target's pick after node i. From node 0: find the smallest-index
    child of the current node whose token equals the pick there; accept it and continue from it,
    or stop. The pick at the last accepted node is the bonus token.
    """
    _check_tree(node_tokens, parents, target_tokens)
    b, n = node_tokens.shape
    rows = jnp.arange(b)
    idx = jnp.arange(n, dtype=jnp.int32)

    def step(d, carry):
        cur, depth, done, path, predicts = carry
        pick = target_tokens[rows, cur]
        match = (parents == cur[:, None]) & (node_tokens == pick[:, None])
        found = jnp.any(match, axis=-1) & ~done
        child = jnp.min(jnp.where(match, idx[None, :], n), axis=-1).astype(jnp.int32)
        predicts = predicts.at[rows, depth].set(jnp.where(found, pick, predicts[rows, depth]))
        depth = jnp.where(found, depth + 1, depth)
        path = path.at[rows, depth].set(jnp.where(found, child, path[rows, depth]))
        cur = jnp.where(found, child, cur)
        return cur, depth, done | ~found, path, predicts

    carry = (
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        jnp.zeros((b,), bool),
        jnp.full((b, n), -1, jnp.int32).at[:, 0].set(0),
        jnp.full((b, n), -1, jnp.int32),
    )
    # At most N - 1 draft tokens can be accepted; the path index strictly increases.
    cur, depth, _, path, predicts = jax.lax.fori_loop(0, n - 1, step, carry)
    predicts = predicts.at[rows, depth].set(target_tokens[rows, cur])
    return AcceptedPath(path=path, accept_len=depth + 1, predicts=predicts)


def node_sample_positions(parents: jax.Array, verified_len: jax.Array, depths: jax.Array | None = None) -> jax.Array:
    """`[B, N]` absolute position each node's output predicts: vc + depth + 1.

    verified_len `[B]` int32 is vc, the committed length before this step's forward (the root,
    node 0, sits at position vc). `depths [B, N]` (e.g. `TreeSpec.depths`) skips recomputing them
    from `parents`.
    """
    if depths is None:
        depths = masks.depths(parents)
    elif depths.shape != parents.shape:
        raise ValueError(f"depths has shape {depths.shape}; expected the tree's {parents.shape}")
    return verified_len.astype(jnp.int32)[:, None] + depths.astype(jnp.int32) + 1


def keyed_targets(node_logits: jax.Array, parents: jax.Array, seeds: jax.Array, verified_len: jax.Array,
                  params: SamplingParams, depths: jax.Array | None = None, draw: str = "auto") -> jax.Array:
    """Target draw after every node: `node_logits [B, N, V]` -> `[B, N]` int32.

    Node i draws with its request's seed and parameters at position vc + depth[i] + 1, i.e. exactly
    what plain decoding would draw for that position given the same logits. `draw`: `sample_at`'s.
    """
    return sample_at(node_logits, seeds, node_sample_positions(parents, verified_len, depths), params, draw)


def keyed_sample_walk(node_logits: jax.Array, node_tokens: jax.Array, parents: jax.Array, seeds: jax.Array,
                      verified_len: jax.Array, params: SamplingParams,
                      depths: jax.Array | None = None, draw: str = "auto") -> AcceptedPath:
    """Sampled verify: keyed draws at every node (`keyed_targets`), then the greedy walk over them.

    node_logits `[B, N, V]`, node_tokens / parents `[B, N]`, seeds / verified_len `[B]`, params per
    request `[B]`, optional depths `[B, N]`, `draw` as in `sample_at`. Temperature-0 requests
    reduce to `greedy_walk` over the argmax.
    """
    _check_tree(node_tokens, parents)
    targets = keyed_targets(node_logits, parents, seeds, verified_len, params, depths, draw)
    return greedy_walk(node_tokens, parents, targets)


def rejection_walk(target_probs: jax.Array, node_tokens: jax.Array, parents: jax.Array, keys: jax.Array,
                   draft_probs: jax.Array | None = None) -> AcceptedPath:
    """Recursive rejection sampling over the tree (exact in distribution); see
    `treespec_jax.sampling.rejection`. target_probs `[B, N, V]`, keys `[B]` typed PRNG keys,
    draft_probs `[B, N, V]` (children sampled without replacement, in index order) or None
    (children are point-mass top-K picks)."""
    _check_tree(node_tokens, parents)
    path, accept_len, predicts = tree_rejection_sample(target_probs, node_tokens, parents, keys, draft_probs)
    return AcceptedPath(path=path, accept_len=accept_len, predicts=predicts)
