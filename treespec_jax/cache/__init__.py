"""treespec_jax.cache"""
