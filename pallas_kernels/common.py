"""Shared kernel plumbing: backend choice, the deprecation filter for Pallas Triton, and the facts
every kernel shares (base-2 softmax constant, Hopper's shared-memory budget).

Every kernel module exposes one public entry point `op(..., backend=None)` where backend is
"pallas" (compiled on GPU, interpret mode elsewhere), "interpret" (forced interpret mode) or
"reference" (the pure-jnp fp32 reference). `None` means "pallas". Callers never import a backend
module directly, so a Mosaic GPU or jax-triton backend can slot in here later.
"""

from __future__ import annotations

import dataclasses
import math
import warnings

import jax
# Importing the Pallas fuser adds a flag to JAX's trace context, and JAX imports it lazily on the
# first Pallas lowering. Every program jitted before that import would then miss the jit cache and
# compile again on its next call (mid-serving: a lone admission's prefill recompiled after the
# warm-up had compiled it). Importing it with the kernels fixes the context before anything is traced.
import jax.experimental.pallas.fuser  # noqa: F401

BACKENDS = ("pallas", "interpret", "reference")
# The kernels' softmax runs in base 2 (exp2 of scores scaled by log2(e)); lse2 outputs are base 2.
LOG2E = math.log2(math.e)
# Dynamic shared memory one block may opt into on Hopper (sm_90: H100, H200), the budget every Mosaic
# GPU kernel's buffers are sized against (each kernel adds its own alignment and barrier overhead).
MAX_SMEM_BYTES = 232448

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


def require_bool_fields(config) -> None:
    """Raises naming every field of the dataclass `config` that is not True or False (the
    switch-only kernel configs: a truthy int or string would pick a variant silently)."""
    bad = [f.name for f in dataclasses.fields(config) if not isinstance(getattr(config, f.name), bool)]
    if bad:
        raise ValueError(f"{type(config).__name__}: {', '.join(bad)} must be True or False")


def require_power_of_two(config, name: str, minimum: int = 1) -> None:
    """Raises naming `config`'s field `name` unless it is an int power of two >= `minimum` (launch
    block sizes and warp counts: Triton tiles and warp groups come only in powers of two)."""
    val = getattr(config, name)
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum or val & (val - 1):
        bound = f" >= {minimum}" if minimum > 1 else ""
        raise ValueError(f"{type(config).__name__}.{name} must be a power of two{bound}, got {val}")


def with_overrides(config, **fields):
    """`config` with each field given as not None replaced (the entry points' older loose launch
    keywords override the config they are given or default to)."""
    return dataclasses.replace(config, **{name: val for name, val in fields.items() if val is not None})
