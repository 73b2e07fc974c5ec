"""treespec_jax.attention"""
