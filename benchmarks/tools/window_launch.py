"""Launch sweep of the tree window kernel on the GPU, timed in device time (calls chained in one jit).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/window_launch.py [--shapes BxPxN,...] [--smoke]

For each shape and KV dtype the window kernel runs as the cascade runs it (row layout, the prefix
partial of the default prefix kernel, `prefix_whole_pages` where that is the Mosaic GPU one) with
block_rows {default, 16, 32, 64, 128} x num_warps {4, 8}. Every variant's output is first compared
with the default launch's (compiled; the default is checked against fp32 references by
bench_cascade and mgpu_prefix_check), and a variant that differs is not timed. `--smoke` runs tiny
shapes in interpret mode on the CPU (times meaningless), so a typo cannot waste a GPU call.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import make_paged, random_parents  # noqa: E402
from benchmarks.report import log, parse_shapes, rel_err  # noqa: E402
from benchmarks.timing import chained_time, feed_output  # noqa: E402
from pallas_kernels.attention.prefix_decode import heads_to_rows, padded_rows, prefix_decode_row_layout  # noqa: E402
from pallas_kernels.attention.prefix_decode_mgpu import prefix_decode_mgpu_row_layout  # noqa: E402
from pallas_kernels.attention.tree_window import default_block_rows, tree_window_row_layout  # noqa: E402
from pallas_kernels.common import resolve_backend  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, uses_mosaic_prefix  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402

FULL_SHAPES = [(8, 8192, 16), (64, 4096, 64), (1, 32768, 64), (32, 32768, 64)]
VARIANTS = [(None, None)] + [(br, nw) for br in (16, 32, 64, 128) for nw in (4, 8)]


def sweep(b, p, n, dtype, hq, hkv, d, page, chained, interpret):
    g = hq // hkv
    rng = np.random.default_rng(b * 7 + n)
    key = jax.random.PRNGKey(b)
    kp, vp, table = make_paged(key, rng, b, p + n, hkv, d, page, dtype, poison=False)
    q = jax.random.normal(jax.random.fold_in(key, 3), (b, n, hq, d), jnp.float32).astype(jnp.bfloat16)
    lengths = jnp.full((b,), p, jnp.int32)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    total = padded_rows(n * g)
    qr = heads_to_rows(q, hkv, total)
    kw = dict(page_size=page, scale=d ** -0.5, query_rows=n, group=g, interpret=interpret)
    mosaic = uses_mosaic_prefix(CascadeConfig(page_size=page), resolve_backend(None), q, kp, vp)
    pre = prefix_decode_mgpu_row_layout if mosaic else prefix_decode_row_layout
    po, plse = jax.jit(lambda *a: pre(*a, **kw))(qr, kp, vp, table, lengths)
    args = (qr, kp, vp, table, lengths, mask, po, plse)
    default = default_block_rows(total, d, b * hkv)
    name = f"{jnp.dtype(dtype).name} B={b} P={p} N={n}"
    log(f"{name}: prefix kernel {'mosaic_gpu' if mosaic else 'triton'}, {total} rows per KV head, "
        f"default block_rows {default}")
    ref = None
    res = {}
    for br, nw in VARIANTS:
        if br is not None and br > total:
            continue
        label = f"rows {br or f'default ({default})'} / warps {nw or 'default'}"
        fn = jax.jit(lambda *a, br=br, nw=nw: tree_window_row_layout(
            *a, window=n, value_dim=d, block_rows=br, num_warps=nw, prefix_whole_pages=mosaic, **kw))
        try:
            out = fn(*args)
            if ref is None:
                ref = out
            err = rel_err(out, ref)
            if not err < 1e-3:
                log(f"{name}: {label} DIFFERS from the default launch (rel {err:.2e}); not timed")
                continue
            t = chained_time(fn, args, feed_output(0), inner=chained, reps=1 if interpret else 7)
            res[label] = t
            log(f"{name}: window {label}: {t * 1e3:.4f} ms (rel vs default {err:.1e})")
        except Exception as exc:  # noqa: BLE001
            log(f"{name}: {label} FAILED {type(exc).__name__}: {str(exc)[:300]}")
    if res:
        best = min(res, key=res.get)
        first = next(iter(res))
        log(f"{name}: best {best} {res[best] * 1e3:.4f} ms vs default {res[first] * 1e3:.4f} ms "
            f"({res[first] / res[best]:.2f}x)")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="BxPxN,... (default: the issue's four)")
    ap.add_argument("--dtypes", default="bf16,fp8", help="bf16 and/or fp8")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    a = ap.parse_args(argv)
    shapes = FULL_SHAPES if a.shapes is None else parse_shapes(a.shapes)
    dims = dict(hq=8, hkv=2, d=32, page=16, chained=2, interpret=True) if a.smoke else \
        dict(hq=32, hkv=8, d=128, page=64, chained=20, interpret=False)
    if a.smoke:
        shapes = [(2, 100, 16), (1, 70, 8)]
    dtypes = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
    for dname in a.dtypes.split(","):
        for b, p, n in shapes:
            sweep(b, p, n, dtypes[dname], **dims)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
