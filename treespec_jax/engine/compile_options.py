"""XLA options of the engine's decode step: how much of it runs as CUDA graphs.

XLA on the GPU records runs of consecutive kernels into CUDA graphs (command buffers), so that a
run costs one launch. By default it only records runs of at least a few kernels. A decode step at
batch 1 is mostly small kernels, and the gaps between their launches are nearly half its time,
so how much is graphed decides its speed. The right setting differs by program, and the options
are passed per program (`jax.jit(..., compiler_options=...)`), so no other program in the process
sees them. Off the GPU, XLA accepts the options and they change nothing.
"""

from __future__ import annotations

from treespec_jax.config import ServeConfig

# XLA's debug options behind each `BackendsConfig.cuda_graphs` setting.
GRAPH_OPTIONS = {
    "xla": {},
    "all": {"xla_gpu_graph_min_graph_size": 1},
    "off": {"xla_gpu_enable_command_buffer": ""},
}


def step_graphs(config: ServeConfig) -> str:
    """The `cuda_graphs` setting of the decode step: "auto" resolved.

    "auto" graphs every run of kernels in the plain step, and keeps XLA's defaults for a
    speculative round. Measured on the H100 at batch 1 (results: cuda-graphs): graphing every run
    took the SmolLM2 plain step from 2.36 to 1.62 ms, but the K4 S5 N16 round from 2.28 to 2.55 ms.
    """
    mode = config.backends.cuda_graphs
    if mode != "auto":
        return mode
    return "xla" if config.speculative.enabled else "all"


def step_compiler_options(config: ServeConfig) -> dict:
    """`compiler_options` for the jitted decode step (`jax.jit`)."""
    return dict(GRAPH_OPTIONS[step_graphs(config)])
