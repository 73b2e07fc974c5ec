"""How fast could a Mosaic GPU (wgmma + TMA + warp-specialised) prefix kernel be? (GPU only)

    PYTHONPATH=. python3 benchmarks/mgpu_probe.py

Times JAX's own Hopper flash-attention kernel (`jax.experimental.pallas.ops.gpu.attention_mgpu`,
dense contiguous K/V, no paging, no causal staircase) on the prefix half's work: per (request, KV
head) the R x G = 256 query rows of the row layout attend P keys, i.e. q `[B, 256, Hkv, D]` against
k/v `[B, P, Hkv, D]`. Beside it, our Pallas Triton prefix kernel on the same work (paged). The
ratio bounds what porting the prefix half to Mosaic GPU could buy before paging is added.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import log  # noqa: E402
from benchmarks.timing import measure_matmul_flops, median_time  # noqa: E402


def main() -> int:
    from jax.experimental.pallas.ops.gpu import attention_mgpu as am

    from pallas_kernels.attention.prefix_decode import prefix_decode_row_layout

    flops_rate = measure_matmul_flops()
    log(f"bf16 matmul {flops_rate / 1e12:.0f} TFLOP/s")
    hkv, g, n, d, page = 8, 4, 64, 128, 64
    rows = n * g
    for b, p in ((32, 32768), (64, 4096), (1, 32768)):
        key = jax.random.PRNGKey(b)
        # attention_mgpu stages K/V through fp16 shared memory, so it takes fp16 inputs (same speed
        # class as bf16 on the tensor cores); ours runs bf16.
        q = jax.random.normal(key, (b, rows, hkv, d), jnp.float16)
        k = jax.random.normal(jax.random.fold_in(key, 1), (b, p, hkv, d), jnp.float16)
        v = jax.random.normal(jax.random.fold_in(key, 2), (b, p, hkv, d), jnp.float16)
        flop = 4 * b * rows * hkv * p * d
        for bq, bkv, steps in ((64, 128, 2), (64, 64, 4), (128, 128, 2)):
            try:
                cfg = am.TuningConfig(block_q=bq, block_kv=bkv, max_concurrent_steps=steps)
                f = jax.jit(lambda q, k, v, cfg=cfg: am.attention(q, k, v, cfg))
                out = f(q, k, v)
                ref = am.attention_reference(q[:1, :, :2], k[:1, :, :2], v[:1, :, :2])
                err = float(jnp.linalg.norm((out[:1, :, :2] - ref).astype(jnp.float32)) /
                            jnp.linalg.norm(ref.astype(jnp.float32)))
                t = median_time(f, q, k, v, samples=7)
                log(f"B={b} P={p}: attention_mgpu bq{bq}/bkv{bkv}/steps{steps} {t * 1e3:.3f} ms, "
                    f"{flop / t / 1e12:.0f} TFLOP/s ({flop / t / flops_rate:.0%} of matmul), rel err {err:.1e}")
            except Exception as exc:  # noqa: BLE001
                log(f"B={b} P={p}: attention_mgpu bq{bq}/bkv{bkv} FAILED {type(exc).__name__}: {str(exc)[:300]}")
        # Ours on the same work, paged (page 64, random table).
        pages = b * p // page
        rng = np.random.default_rng(0)
        table = jnp.asarray(rng.permutation(pages).reshape(b, p // page), jnp.int32)
        kp = k.reshape(b * p, hkv, d)[jnp.asarray(rng.permutation(b * p))].astype(jnp.bfloat16)
        qr = jnp.transpose(q, (0, 2, 1, 3)).astype(jnp.bfloat16)  # [B, Hkv, rows, D]
        lengths = jnp.full((b,), p + n - 1, jnp.int32)  # every row sees about P keys
        lengths = jnp.minimum(lengths, p)
        g_fn = jax.jit(lambda qr, kp, vp, t, ln: prefix_decode_row_layout(
            qr, kp, vp, t, ln, query_rows=n, group=g, page_size=page, scale=d ** -0.5))
        t = median_time(g_fn, qr, kp, kp, table, lengths, samples=7)
        log(f"B={b} P={p}: ours (Pallas Triton, paged, causal staircase) {t * 1e3:.3f} ms, "
            f"{flop / t / 1e12:.0f} TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
