import os
import warnings

# Several host devices let the tensor-parallel tests build a mesh on the CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# Synchronous CPU dispatch: Pallas' Mosaic GPU interpreter runs the kernel through callbacks that
# dispatch JAX work of their own, and with asynchronous dispatch the test's next eager op (its
# dense reference) raced them; once a worker deadlocked there on 2 cores (session 12 CI: callback
# thread and main thread both blocked in apply_primitive, dumped by the faulthandler timeout). It
# must be set before the CPU client is made, which the first array does.
import jax  # noqa: E402

jax.config.update("jax_cpu_enable_async_dispatch", False)
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
