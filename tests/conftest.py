"""Test set-up shared by every tier (pyproject.toml, [tool.pytest.ini_options], names the commands).

A kernel test that takes an argument `backend` (a kernel backend name) or `interpret` (a bool) is
run once per kernel backend: interpreted (the CPU tiers) and compiled (marked `gpu`, deselected
by default, skipped where no CUDA GPU is present). So `pytest -m gpu` on a GPU machine runs every
such test, default and sweep cases alike, with the kernels compiled against the same references.
"""

import os
import warnings

import pytest

# Several host devices: the CPU client then runs more computations at once. Pallas' Mosaic GPU
# interpreter runs each warpgroup of a CTA as its own computation, blocking in barrier callbacks,
# so with fewer of them than warpgroups a kernel can deadlock: on one core (taskset) a fused-window
# test that passes in 4 s hung until 8 devices were set.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# The CLI turns on JAX's persistent compilation cache (`cli.use_compile_cache`); tests that run it
# must neither write into the user's cache nor find programs a previous run left there.
os.environ["TREESPEC_COMPILE_CACHE"] = "off"
# Synchronous CPU dispatch: Pallas' Mosaic GPU interpreter runs the kernel through callbacks that
# dispatch JAX work of their own, and with asynchronous dispatch the test's next eager op (its
# dense reference) raced them; a worker once deadlocked there on 2 cores (callback thread and main
# thread both blocked in apply_primitive, dumped by the faulthandler timeout). It must be set
# before the CPU client is made, which the first array does.
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)
ON_GPU = jax.default_backend() == "gpu"
if not ON_GPU:
    # The CPU tiers' time goes mostly into XLA compiling the interpreted kernels, not into running
    # them: without XLA's optimization passes (semantics unchanged) a sample of the slowest tests ran
    # in 0.74x the time. Every test still runs; speed is measured on the GPU, never here. Compiled
    # runs keep XLA's optimizations: they test what serving runs.
    jax.config.update("jax_disable_most_optimizations", True)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)

# The kernel backends a kernel test runs under, per argument name: interpreted, and compiled on a GPU.
KERNEL_BACKENDS = {
    "backend": [pytest.param("interpret", id="interpret"),
                pytest.param("pallas", id="compiled", marks=pytest.mark.gpu)],
    "interpret": [pytest.param(True, id="interpret"),
                  pytest.param(False, id="compiled", marks=pytest.mark.gpu)],
}


def _parametrized_names(metafunc) -> set[str]:
    names = set()
    for mark in metafunc.definition.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs["argnames"]
        if isinstance(argnames, str):
            argnames = [n.strip() for n in argnames.split(",")]
        names.update(argnames)
    return names


def pytest_generate_tests(metafunc):
    own = _parametrized_names(metafunc)
    for name, params in KERNEL_BACKENDS.items():
        if name in metafunc.fixturenames and name not in own:
            metafunc.parametrize(name, params)


def pytest_runtest_setup(item):
    if item.get_closest_marker("gpu") is not None and not ON_GPU:
        pytest.skip("runs the kernels compiled: needs a CUDA GPU (jax.default_backend() is "
                    f"{jax.default_backend()!r})")


def pytest_collection_modifyitems(config, items):
    """Without a GPU, a -m expression that does not name `gpu` (`-m sweep`) leaves the compiled
    cases out as deselected rather than skipped: the CPU tiers list only what they run."""
    if ON_GPU or "gpu" in (config.getoption("markexpr") or ""):
        return
    compiled = [item for item in items if item.get_closest_marker("gpu") is not None]
    if compiled:
        config.hook.pytest_deselected(items=compiled)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
