"""The engine's decode step compiled on the GPU under each CUDA-graph setting and norm kernel.

`backends.cuda_graphs` changes how XLA launches the step's kernels on the GPU (graphed runs or
one by one), and off the GPU it changes nothing, so only here can it be checked: every setting
must emit the same tokens, plain and speculative, and speculation must equal plain decoding.
Dense attention keeps the step pure XLA, so what differs between settings is the launching alone.
`backends.norm_kernel` and `rope_kernel` "auto" run the Pallas add + RMSNorm and RoPE + K/V-write
kernels only here; the fp32 forward with them computes the XLA one's function, so both emit the
same tokens, plain and speculative.

    python -m pytest -m gpu tests/gpu/test_gpu_engine.py      # on a CUDA machine
"""

import pytest

import dataclasses

from engine_fixtures import mixed_requests, oracle_engine, serve_config, with_cuda_graphs

pytestmark = pytest.mark.gpu


def _tokens(config, requests):
    outs = oracle_engine(config, noise=1.0).decode(requests)
    assert all(o.finish_reason == "length" for o in outs), [(o.finish_reason, o.error) for o in outs]
    return [o.tokens for o in outs]


def test_cuda_graph_settings_emit_the_same_tokens():
    requests = mixed_requests()[:4]
    plain = serve_config(attention="dense", slots=2)
    tree = serve_config("EAGLE3", 4, 3, 10, attention="dense", slots=2)
    expected = _tokens(with_cuda_graphs(plain, "xla"), requests)
    for mode in ("auto", "all", "off"):
        assert _tokens(with_cuda_graphs(plain, mode), requests) == expected, f"plain, cuda_graphs={mode}"
    for mode in ("auto", "all", "off"):
        assert _tokens(with_cuda_graphs(tree, mode), requests) == expected, f"tree, cuda_graphs={mode}"


@pytest.mark.parametrize("field", ["norm_kernel", "rope_kernel"])
def test_kernel_settings_emit_the_same_tokens(field):
    """`backends.norm_kernel` / `rope_kernel` "auto" (the Pallas kernel here) against "xla"."""
    requests = mixed_requests()[:4]

    def with_kernel(config, kernel):
        return config.replace(backends=dataclasses.replace(config.backends, **{field: kernel}))

    plain = serve_config(attention="dense", slots=2)
    tree = serve_config("EAGLE3", 4, 3, 10, attention="dense", slots=2)
    expected = _tokens(with_kernel(plain, "xla"), requests)
    assert _tokens(with_kernel(plain, "auto"), requests) == expected, f"plain, {field}=auto"
    assert _tokens(with_kernel(tree, "auto"), requests) == expected, f"tree, {field}=auto"
