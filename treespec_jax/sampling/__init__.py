"""treespec_jax.sampling"""
