"""Test tiers (pyproject.toml, [tool.pytest.ini_options], names the commands).

- default: every kernel and public entry point has at least one correctness test here (fresh
  random inputs, an fp32 reference, relative error, poisoned unread slots, NaN fails).
- `sweep`: the exhaustive variant sweeps of one kernel (more shapes, options that are not the
  default, bit-equality between two forms of one kernel). Excluded by default.
- `gpu`: compiled kernels against their references; needs a CUDA GPU. Excluded by default.

`cases(values, default=...)` keeps the parametrizations at the `default` indices in the default
tier and marks the others `sweep`, so one parametrize list states both tiers.
"""

from __future__ import annotations

import pytest

sweep = pytest.mark.sweep


def _with_sweep(value, one_arg: bool):
    if isinstance(value, type(pytest.param(None))):  # already a pytest.param: add the mark
        return pytest.param(*value.values, marks=(*value.marks, sweep), id=value.id)
    if isinstance(value, tuple) and not one_arg:
        return pytest.param(*value, marks=sweep)
    return pytest.param(value, marks=sweep)


def cases(values, default=(0,), *, one_arg: bool = False):
    """`values` of a parametrize list, those at indices `default` in the default tier and every
    other one marked `sweep`. A tuple value is one case of several argnames unless `one_arg`
    (the parametrize names one argument whose values are tuples)."""
    values = list(values)
    bad = [i for i in default if not 0 <= i < len(values)]
    if bad:
        raise IndexError(f"cases: default indices {bad} outside the {len(values)} cases")
    return [v if i in default else _with_sweep(v, one_arg) for i, v in enumerate(values)]
