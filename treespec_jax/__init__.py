"""treespec-jax: draft-tree speculative decoding for LLM serving in JAX."""

__version__ = "0.1.0"
