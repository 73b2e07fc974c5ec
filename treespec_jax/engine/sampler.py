"""Acceptance backends: which root path of each verified tree the request keeps.

- "greedy": argmax at every node, then the greedy walk (temperature-0 requests only).
- "gumbel": keyed Gumbel-max draws at every node by (seed, position the node predicts), then the
  greedy walk over the draws: token for token what plain decoding samples (`keyed_sample_walk`).
- "rejection": recursive rejection sampling against the top-K children as point-mass drafts,
  exact in distribution; its uniforms are keyed by (seed, the root's position).

All three verify trees (K > 1) and chains; plain decoding is the same call on a one-node tree.
The first token after a prompt is drawn by `sample_at` under every backend (an exact draw of the
same distribution).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespec_jax.sampling.keyed import SamplingParams, target_probs
from treespec_jax.tree.verify import AcceptedPath, greedy_walk, keyed_sample_walk, rejection_walk

BACKENDS = ("greedy", "gumbel", "rejection")


def accept(backend: str, logits: jax.Array, tokens: jax.Array, parents: jax.Array, depths: jax.Array,
           seeds: jax.Array, lengths: jax.Array, params: SamplingParams, draw: str = "auto") -> AcceptedPath:
    """`logits [B, N, V]` f32 at the tree's nodes, `tokens / parents / depths [B, N]`,
    `seeds / lengths [B]` (lengths = vc, the root's position) -> AcceptedPath. `draw` (static,
    `sampling.keyed.DRAWS`) says what the gumbel backend's draws need computed."""
    if backend == "greedy":
        return greedy_walk(tokens, parents, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    if backend == "gumbel":
        return keyed_sample_walk(logits, tokens, parents, seeds, lengths, params, depths, draw)
    if backend == "rejection":
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, lengths)
        return rejection_walk(target_probs(logits, params), tokens, parents, keys)
    raise ValueError(f"sampling backend {backend!r} is not one of {BACKENDS}")
