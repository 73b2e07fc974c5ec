"""treespec_jax.linear"""
