"""GPU conformance of the linear-attention kernels (Gated DeltaNet, Mamba-2), compiled, at model
widths: the bench scripts' conformance cases (benchmarks/bench_gdn.py, bench_mamba2.py) as tests,
each check of a case an assertion (every kernel form against the fp32 references, payload and
pool bits, the replay commit).

    python -m pytest -m "gpu and not sweep" tests/gpu      # on a CUDA machine
"""

import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.gpu

# bench_gdn.conformance's cases: (dims, B, T, dtype) as indices into its list.
GDN_CASES = ["small-B2-T14-f32", "qwen-B2-T8-f32", "qwen-B2-T16-bf16", "qwen-B3-T33-f32", "qwen-B2-T64-bf16"]


def gdn_case(i):
    from benchmarks import bench_gdn as bench
    cases = [(bench.SMALL, 2, 14, jnp.float32), (bench.QWEN, 2, 8, jnp.float32), (bench.QWEN, 2, 16, jnp.bfloat16),
             (bench.QWEN, 3, 33, jnp.float32), (bench.QWEN, 2, 64, jnp.bfloat16)]
    return bench, cases[i]


@pytest.mark.parametrize("index", range(len(GDN_CASES)), ids=GDN_CASES)
def test_gdn_kernels(index):
    """Staged and replay tree verify, the chain kernel, every chunked form (fp32 and tf32x3 products,
    input-dtype grams) and the replay commit, compiled, against the references."""
    import numpy as np

    bench, case = gdn_case(index)
    tol = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}[case[3]]
    failed = []

    def check(name, cond, detail=""):
        if not cond:
            failed.append(f"{name} {detail}".strip())

    bench.conformance_case(index, *case, tol, np.random.default_rng(index), check)
    assert not failed, "; ".join(failed)


def test_mamba2_kernels():
    """The Mamba-2 tree scan's staged and replay forms, the chunked form and the commits, compiled,
    against the references (bench_mamba2's full conformance)."""
    from benchmarks import bench_mamba2 as bench

    results = []
    bench.conformance(quick=False, results=results)
    assert results, "no conformance check ran"
    failed = [name for name, good in results if not good]
    assert not failed, "; ".join(failed)
