"""The one comparison every numeric test uses."""

import numpy as np


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64 (any dtype in: bf16 and FP8 arrays are widened first).

    A non-finite value fails the check rather than the comparison: in an output it means poison
    leaked or an element was never written, and NaN must never pass.
    """
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert np.all(np.isfinite(out)), "non-finite output: poison leaked or an element was not written"
    assert np.all(np.isfinite(ref)), "non-finite reference"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
