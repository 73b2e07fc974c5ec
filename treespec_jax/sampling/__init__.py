"""Sampling backends: keyed Gumbel-max (greedy at temperature 0) and tree rejection sampling."""

from treespec_jax.sampling.keyed import SamplingParams, filter_logits, greedy_tokens, gumbel_noise, sample_at
from treespec_jax.sampling.rejection import child_tables, tree_rejection_sample, walk_keys

__all__ = [
    "SamplingParams",
    "child_tables",
    "filter_logits",
    "greedy_tokens",
    "gumbel_noise",
    "sample_at",
    "tree_rejection_sample",
    "walk_keys",
]
