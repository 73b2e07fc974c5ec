"""What every drafter provides, the one scorer, and the round's tree drafting.

A drafter keeps its own paged cache (one or more layers, the target's page table and page size)
holding draft positions [0, frontier) of each request, and answers three calls:

- `prefill(params, pools, tokens, next_tokens, features, page_table, start, valid)`: a prompt
  chunk. `tokens [B, C]` are the chunk's tokens, `next_tokens [B, C]` the token after each (the
  prompt shifted by one, ending with the first sampled token), `features [B, C, F]` the target's
  features of the chunk's rows (`feature_layers`). After the whole prompt the cache holds
  positions [0, P).
- `step0(params, pools, accepted: AcceptedRows)`: the chain's draft step over the tokens the
  round just accepted (rows d < accept_len of the compacted window), then returns the scores of
  the root's children (`root_logits [B, V']`), the feature its lanes continue from
  (`root_feature [B, Fd]`) and the lane frontier (where the lane window starts).
- `lanes(params, pools, tokens, features, lane_mask, frontier, step, num_steps, page_table)`:
  draft step `step` >= 1 over K lane rows per request (`lane_attention`): lane r writes slot
  frontier + (step-1)K + r at RoPE position frontier + step - 1 and sees the frontier plus its
  lane ancestors; returns each lane's child scores `[B, K, V']` and its output feature.

`score_candidates` is the only place candidates are scored: the log-probability top-K over the
drafter's vocabulary, mapped to target ids. `draft_tree` runs steps 1..S-1 and `select_tree`.
"""

from __future__ import annotations

import abc

import jax
import jax.numpy as jnp
from flax import struct

from treespec_jax.models.attention import AttentionBatch, window_batch
from treespec_jax.tree.draft_tree import (CandidateRecord, DraftTree, expand_lanes, seed_lanes, select_tree,
                                          step_offset)
from treespec_jax.tree.masks import ancestor_mask, chain_parents


@struct.dataclass
class AcceptedRows:
    """The round's accepted path as the drafter's step 0 reads it (rows d < accept_len valid)."""

    path_tokens: jax.Array  # [B, N] int32 token of path node d (d = 0 is the old root); 0 past the path
    predicts: jax.Array  # [B, N] int32 the target's token after path node d (AcceptedPath.predicts)
    features: jax.Array  # [B, N, F] target features of the path nodes, compacted (row d = depth d)
    start: jax.Array  # [B] int32 vc before the round: position of the old root
    accept_len: jax.Array  # [B] int32 accepted rows (1..N)
    page_table: jax.Array  # [B, max_pages] int32

    def chain_window(self, page_size: int) -> AttentionBatch:
        """Step 0's attention over the path: window row d at position start + d, seeing the rows
        before it (a chain) and the drafter's cache below start."""
        b, n = self.path_tokens.shape
        positions = self.start[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        return window_batch(self.page_table, self.start, positions, ancestor_mask(chain_parents(b, n)), page_size)


def score_candidates(logits: jax.Array, topk: int, draft_to_target: jax.Array | None = None):
    """Log-probability top-K: `logits [..., V']` -> (logprobs `[..., K]` f32, target ids `[..., K]` int32).

    Ties go to the lower draft id (`lax.top_k`). `draft_to_target [V']` int32 (EAGLE-3's d2t
    offsets, already added to the ids) maps a reduced draft vocabulary to target ids.
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    vals, ids = jax.lax.top_k(logp, topk)
    if draft_to_target is not None:
        ids = draft_to_target[ids]
    return vals, ids.astype(jnp.int32)


class Drafter(abc.ABC):
    """Interface of a drafter (see module docstring). Instances are static (jit closes over them)."""

    #: target layers whose inputs the drafter reads as features (index L = last layer's output)
    feature_layers: tuple[int, ...] = ()
    #: width of the recurrent feature the lanes carry
    feature_width: int = 1

    @abc.abstractmethod
    def pool_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """`{buffer name: (row shape, role)}` of the draft cache (one pool per buffer)."""

    @abc.abstractmethod
    def prefill(self, params, pools, tokens, next_tokens, features, page_table, start, valid):
        """-> pools."""

    @abc.abstractmethod
    def step0(self, params, pools, accepted: AcceptedRows):
        """-> (pools, root_logits [B, V'], root_feature [B, Fd], frontier [B])."""

    @abc.abstractmethod
    def lanes(self, params, pools, tokens, features, lane_mask, frontier, step: int, num_steps: int, page_table):
        """-> (pools, logits [B, K, V'], features [B, K, Fd])."""

    def score(self, params, logits, topk: int):
        """`score_candidates` with this drafter's vocabulary map."""
        return score_candidates(logits, topk)

    def serving_params(self, params):
        """`params` as the engine serves them (a drafter may fuse or re-lay its weights; the
        function it computes stays the same). Default: as given."""
        return params


def draft_tree(drafter: Drafter, params, pools, root_logits, root_feature, frontier, root_tokens, page_table, *,
               topk: int, num_steps: int, num_nodes: int) -> tuple[dict, DraftTree]:
    """Steps 0..S-1 of one round from step 0's outputs, then `select_tree`.

    `root_logits [B, V']`, `root_feature [B, Fd]`, `frontier [B]`, `root_tokens [B]` (the new
    roots: the round's bonus tokens) -> (pools, DraftTree `[B, N]`).
    """
    b = root_tokens.shape[0]
    logp, toks = drafter.score(params, root_logits, topk)
    lanes, cands = seed_lanes(logp, toks)
    record = CandidateRecord.empty(b, topk, num_steps).write(0, cands)
    feats = jnp.broadcast_to(root_feature[:, None, :], (b, topk) + root_feature.shape[1:])
    for step in range(1, num_steps):
        pools, logits, out_feats = drafter.lanes(params, pools, lanes.tokens, feats, lanes.masks, frontier, step,
                                                 num_steps, page_table)
        logp, toks = drafter.score(params, logits, topk)
        lanes, cands = expand_lanes(lanes, logp, toks, step, num_steps=num_steps)
        record = record.write(step, cands)
        # A lane continues from the feature its parent lane's row produced.
        parent_lane = (lanes.entries - step_offset(topk, step)) // topk
        feats = jnp.take_along_axis(out_feats, parent_lane[:, :, None], axis=1)
    return pools, select_tree(record, root_tokens, num_nodes)
