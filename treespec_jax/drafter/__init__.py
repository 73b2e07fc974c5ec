"""treespec_jax.drafter"""
