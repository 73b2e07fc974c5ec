import os
import warnings

# Several host devices let the tensor-parallel tests build a mesh on the CPU.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
warnings.filterwarnings("ignore", message=".*[Tt]riton.*", category=DeprecationWarning)
