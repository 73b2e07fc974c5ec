"""Pearson chi-square goodness of fit, shared by the sampling and rejection-walk tests."""

import numpy as np
from jax.scipy.special import gammaincc

P_MIN = 1e-4  # chi-square p-value floor; seeds are fixed, so a pass is reproducible


def chi_square_p(counts, probs):
    """p-value of `counts` against `probs`; zero-probability bins must be empty."""
    counts, probs = np.asarray(counts, np.float64), np.asarray(probs, np.float64)
    assert counts[probs == 0].sum() == 0, f"drew a zero-probability token: {counts}, {probs}"
    live = probs > 0
    expected = probs[live] * counts.sum()
    stat = ((counts[live] - expected) ** 2 / expected).sum()
    dof = live.sum() - 1
    return float(gammaincc(dof / 2.0, stat / 2.0)) if dof > 0 else 1.0
