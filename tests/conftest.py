import os
import warnings

# Several host devices let the tensor-parallel tests build a mesh on the CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)

import faulthandler  # noqa: E402

import pytest  # noqa: E402

# A test running this long is stuck (the slowest takes about a minute on 2 cores): once, with two
# test runs sharing 2 cores, a worker sat idle inside the Mosaic GPU interpreter (session 12). Dump
# every thread's stack and end the worker, so the run fails naming the test instead of hanging.
HUNG_TEST_S = float(os.environ.get("TREESPEC_HUNG_TEST_S", "600"))


@pytest.fixture(autouse=True)
def _end_a_hung_test():
    faulthandler.dump_traceback_later(HUNG_TEST_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()
