"""Linear-attention (GDN, Mamba2, conv) tree scan kernels."""
