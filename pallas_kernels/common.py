"""Shared kernel plumbing: backend choice and the deprecation filter for Pallas Triton.

Every kernel module exposes one public entry point `op(..., backend=None)` where backend is
"pallas" (compiled on GPU, interpret mode elsewhere), "interpret" (forced interpret mode) or
"reference" (the pure-jnp fp32 reference). `None` means "pallas". Callers never import a backend
module directly, so a Mosaic GPU or jax-triton backend can slot in here later.
"""

from __future__ import annotations

import warnings

import jax

BACKENDS = ("pallas", "interpret", "reference")

# JAX 0.11 deprecates the Pallas Triton lowering; it is still our GPU path.
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def resolve_backend(backend: str | None) -> str:
    """Returns "compiled", "interpret" or "reference" for a requested backend name."""
    backend = "pallas" if backend is None else backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {BACKENDS}")
    if backend == "reference":
        return "reference"
    if backend == "interpret" or not on_gpu():
        return "interpret"
    return "compiled"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())
