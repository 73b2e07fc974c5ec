"""GPU kernels (Pallas, Triton lowering today), each behind one entry point with a pure-jnp
reference and an interpret-mode path for the CPU."""
