"""The engine's decode step compiled on the GPU under each CUDA-graph setting and norm kernel.

`backends.cuda_graphs` changes how XLA launches the step's kernels on the GPU (graphed runs or
one by one), and off the GPU it changes nothing, so only here can it be checked: every setting
must emit the same tokens, plain and speculative, and speculation must equal plain decoding.
Dense attention keeps the step pure XLA, so what differs between settings is the launching alone.
`backends.norm_kernel` "auto" runs the Pallas add + RMSNorm kernel only here; the fp32 forward
with it computes the XLA one's function, so both emit the same tokens, plain and speculative.

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


def test_norm_kernel_settings_emit_the_same_tokens():
    requests = mixed_requests()[:4]

    def with_norm(config, kernel):
        return config.replace(backends=dataclasses.replace(config.backends, norm_kernel=kernel))

    plain = serve_config(attention="dense", slots=2)
    tree = serve_config("EAGLE3", 4, 3, 10, attention="dense", slots=2)
    expected = _tokens(with_norm(plain, "xla"), requests)
    assert _tokens(with_norm(plain, "auto"), requests) == expected, "plain, norm_kernel=auto"
    assert _tokens(with_norm(tree, "auto"), requests) == expected, "tree, norm_kernel=auto"
