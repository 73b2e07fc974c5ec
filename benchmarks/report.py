"""What every GPU benchmark module prints and checks with: an elapsed-time log line, the
relative error of a kernel against its reference, its log-sum-exp against the reference's, and the
shape flags."""

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


def lse_agrees(lse, ref_lse, tol: float = 5e-2) -> bool:
    """A kernel's log-sum-exp against its reference: finite in exactly the same rows (a row that saw
    no key is -inf in both), and within `tol` where finite."""
    fin = jnp.isfinite(ref_lse)
    return bool(jnp.all(jnp.isfinite(lse) == fin)) and float(
        jnp.max(jnp.abs(jnp.where(fin, lse - ref_lse, 0.0)))) < tol


def parse_shapes(text: str, dims: int | None = None) -> list[tuple[int, ...]]:
    """`"32x32768x64,8x8192x16"` -> [(32, 32768, 64), (8, 8192, 16)]: the shape flags of every
    benchmark script (B x P x N for attention, B x T for the linear scans); `dims`: each item must
    have exactly that many numbers."""
    out = []
    for item in (i.strip().lower() for i in text.split(",")):
        if not item:
            continue
        try:
            shape = tuple(int(v) for v in item.split("x"))
        except ValueError:
            shape = ()
        if not shape or (dims is not None and len(shape) != dims):
            raise ValueError(f"{item!r} in {text!r} is not {dims or 'some'} integers joined by 'x' (e.g. 32x16)")
        out.append(shape)
    return out
