"""XLA options of the engine's decode step: how much of it runs as CUDA graphs.

XLA on the GPU records runs of consecutive kernels into CUDA graphs (command buffers), so that a
run costs one launch. By default it only records runs of at least a few kernels. A decode step at
batch 1 is mostly small kernels, so how much of it is graphed can decide its speed. The options
are passed per program (`jax.jit(..., compiler_options=...)`), so no other program in the process
sees them, and the plain step and a speculative round can each get their own. Off the GPU, XLA
accepts the options and they change nothing.
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

    "auto" keeps XLA's defaults, plain and speculative. Compared in one process on the H100 at
    batch 1 (results: cuda-graphs), graphing every run of kernels made both programs slower: the
    SmolLM2 plain step served in 2.41 ms against 1.84, the K4 S5 N16 round in 2.24 against 2.05
    (a lone kernel launched as a graph costs more than launched alone). It stays a per-program
    rule so that a model or device where another setting wins can get it here.
    """
    mode = config.backends.cuda_graphs
    return "xla" if mode == "auto" else mode


def step_compiler_options(config: ServeConfig) -> dict:
    """`compiler_options` for the jitted decode step (`jax.jit`)."""
    return dict(GRAPH_OPTIONS[step_graphs(config)])
