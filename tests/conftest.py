import os
import warnings

# Several host devices: the CPU client then runs more computations at once. Pallas' Mosaic GPU
# interpreter runs each warpgroup of a CTA as its own computation, blocking in barrier callbacks,
# so with fewer of them than warpgroups a kernel can deadlock: on one core (taskset) a fused-window
# test that passes in 4 s hung until 8 devices were set (session 13).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Synchronous CPU dispatch: Pallas' Mosaic GPU interpreter runs the kernel through callbacks that
# dispatch JAX work of their own, and with asynchronous dispatch the test's next eager op (its
# dense reference) raced them; once a worker deadlocked there on 2 cores (session 12 CI: callback
# thread and main thread both blocked in apply_primitive, dumped by the faulthandler timeout). It
# must be set before the CPU client is made, which the first array does.
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)
# The suite's time goes mostly into XLA compiling the interpreted kernels, not into running them:
# without XLA's optimization passes (semantics unchanged) a sample of the slowest tests ran in 0.74x
# the time (session 20). Every test still runs; speed is measured on the GPU, never here.
jax.config.update("jax_disable_most_optimizations", True)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
