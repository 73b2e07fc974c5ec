"""What every GPU benchmark module prints and checks with: an elapsed-time log line and the
relative error of a kernel against its reference."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

_T0 = time.time()


def log(*parts) -> None:
    """One line, prefixed with the seconds since the suite started (unbuffered)."""
    print(f"[{time.time() - _T0:6.1f}s]", *parts, flush=True)


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when the output has a NaN or inf (never passes)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    if not np.isfinite(out).all():
        return float("inf")
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    return float(err) if np.isfinite(err) else float("inf")
