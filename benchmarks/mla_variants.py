"""Variants of the Mosaic MLA latent decode, and whether it waits on memory. (GPU only)

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mla_variants.py [--no-shared]

At DeepSeek-V3 widths (B=32, P=8192, 16 x 128 query rows per request, latent 512 + rope 64) every
64-row tile of a request reads the request's whole latent prefix, so the decode moves about 32x the
pool's bytes from L2 into shared memory. This times the decode (device time, chained calls) with a
random page table (the benchmark's layout) against one where every request maps the same pages (the
working set then stays in L2; a large gain there says the kernel waits on memory), under each
`schedule` of its two compute warpgroups, and under FP8 with three ring stages. On the H200 (2026-12-01) shared pages gained 2% at most.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import log  # noqa: E402
from benchmarks.timing import chained_time, feed_scalar, measure_matmul_flops  # noqa: E402
from pallas_kernels.attention.mla_decode_mgpu import SCHEDULES, mla_decode_mgpu  # noqa: E402

B, P, N, HQ, LORA, ROPE, PAGE = 32, 8192, 16, 128, 512, 64, 64


def main(argv=None) -> int:
    shared = "--no-shared" not in (sys.argv[1:] if argv is None else argv)
    if jax.default_backend() != "gpu":
        print("mla_variants: needs a GPU; nothing run", file=sys.stderr)
        return 0
    flops = measure_matmul_flops()
    rng = np.random.default_rng(0)
    per_req = P // PAGE
    random_table = rng.permutation(B * per_req).reshape(B, per_req).astype(np.int32)
    shared_table = np.broadcast_to(random_table[:1], (B, per_req)).copy()
    lengths = jnp.full((B,), P, jnp.int32)
    flop = 2 * B * N * HQ * P * (2 * LORA + ROPE)
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn):
        pool = jax.random.normal(jax.random.PRNGKey(1), (B * per_req * PAGE, LORA + ROPE), jnp.float32).astype(dtype)
        q = jax.random.normal(jax.random.PRNGKey(2), (B, 1, N * HQ, LORA + ROPE), jnp.float32).astype(dtype)
        forms = [(s, dict(schedule=s)) for s in SCHEDULES]
        if dtype == jnp.float8_e4m3fn:  # a third 64-key buffer fits beside FP8 rows only
            forms += [("split, 3 stages", dict(schedule="split", stages=3))]
        for label, opts in forms:
            for tname, table in (("random pages", random_table), ("shared pages", shared_table))[:2 if shared else 1]:
                fn = jax.jit(lambda q, pool, t, ln, o=opts: mla_decode_mgpu(
                    q, pool, t, ln, kv_lora_rank=LORA, page_size=PAGE, scale=0.07, **o))
                try:
                    t = chained_time(fn, (q, pool, jnp.asarray(table), lengths), feed_scalar(3))
                    log(f"{jnp.dtype(dtype).name} {label}, {tname}: {t * 1e3:.3f} ms, "
                        f"{flop / t / 1e12:.0f} TFLOP/s ({flop / flops / t:.2f} of the cold matmul rate)")
                except Exception as exc:  # noqa: BLE001
                    log(f"{jnp.dtype(dtype).name} {label}, {tname}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
