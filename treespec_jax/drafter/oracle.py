"""A whole target-family model as the drafter: the oracle test drafters, and draft-model speculation.

`ModelDrafter` runs a `LlamaModel` over its own paged cache, which mirrors the target's: draft
position p holds token p. Step 0 runs the accepted path's node tokens at vc + d (the rows the
target's verify just committed), then the new root (the round's bonus token) at the new vc as
one more row, so the frontier is vc + accept_len + 1 and a lane fed at step s (a token at depth
s) sits at position frontier + s - 1. Features are not read.

With the target's own weights it drafts the target's distribution (the oracle: greedy paths are
accepted to full depth). `noise > 0` adds seeded Gaussian noise to its logits, keyed by the
request's draft position and the lane, so trees branch and acceptance is partial while every run
stays reproducible (the noisy oracle).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespec_jax.drafter.base import AcceptedRows, Drafter, score_candidates
from treespec_jax.models.attention import lanes_batch
from treespec_jax.models.llama import LlamaModel


class ModelDrafter(Drafter):
    """Drafts with `model` (params: that model's own parameters)."""

    def __init__(self, model: LlamaModel, noise: float = 0.0, noise_seed: int = 0):
        if noise < 0:
            raise ValueError(f"ModelDrafter noise must be >= 0, got {noise}")
        self.model = model
        self.noise = float(noise)
        self.noise_seed = int(noise_seed)
        self.feature_layers = ()
        self.feature_width = 1

    def pool_specs(self):
        row = (self.model.cfg.num_kv_heads, self.model.cfg.head_dim)
        out = {}
        for i in range(self.model.cfg.num_layers):
            out[f"k{i}"] = (row, "key")
            out[f"v{i}"] = (row, "value")
        return out

    def _noisy(self, logits, positions):
        """Adds N(0, noise^2) per (draft position, row, vocab id); positions `[B, T]`."""
        if self.noise == 0:
            return logits
        b, t, v = logits.shape
        base = jax.random.key(self.noise_seed)

        def row_noise(pos, row):
            return jax.random.normal(jax.random.fold_in(jax.random.fold_in(base, pos), row), (v,))

        rows = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
        noise = jax.vmap(jax.vmap(row_noise))(positions, rows)
        return logits + self.noise * noise

    def prefill(self, params, pools, tokens, next_tokens, features, page_table, start, valid):
        _, _, pools = self.model.prefill(params, pools, tokens, page_table, start, valid)
        return pools

    def step0(self, params, pools, accepted: AcceptedRows):
        b = accepted.path_tokens.shape[0]
        _, _, pools = self.model.forward(params, pools, jnp.maximum(accepted.path_tokens, 0),
                                         accepted.chain_window(self.model.page_size))
        new_len = accepted.start + accepted.accept_len
        root = jnp.take_along_axis(accepted.predicts, (accepted.accept_len - 1)[:, None], axis=1)[:, 0]
        logits, _, pools = self.model.decode(params, pools, root, accepted.page_table, new_len)
        logits = self._noisy(logits, new_len[:, None])[:, 0]
        return pools, logits, jnp.zeros((b, 1), jnp.float32), new_len + 1

    def lanes(self, params, pools, tokens, features, lane_mask, frontier, step, num_steps, page_table):
        b, k = tokens.shape
        positions = jnp.broadcast_to((frontier + step - 1)[:, None], (b, k))
        batch = lanes_batch(page_table, frontier, positions, lane_mask, step, num_steps, self.model.page_size)
        logits, _, pools = self.model.forward(params, pools, tokens, batch)
        # The lane's window slot keys the noise: two lanes at one depth see different noise.
        slots = frontier[:, None] + (step - 1) * k + jnp.arange(k, dtype=jnp.int32)[None, :]
        return pools, self._noisy(logits, slots), jnp.zeros((b, k, 1), jnp.float32)

    def score(self, params, logits, topk):
        return score_candidates(logits, topk)
