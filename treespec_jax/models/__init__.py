"""treespec_jax.models"""
