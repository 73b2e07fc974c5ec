"""Where the GQA cascade's time goes, kernel by kernel, on the GPU (device time, chained).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/cascade_breakdown.py [--shapes 64x4096x64,1x32768x64]
        [--fp8] [--stages 2x2,4x1]

For each shape, the unfused Mosaic path (`CascadeConfig(fuse_window=False)`: the Mosaic prefix with
`prefix_covers_tail`, then the window kernel) cut into its pieces, each timed alone by
`timing.traced_time`: q into the row layout
(`heads_to_rows`), the prefix kernel with its split merge, the split merge alone on arrays of the
kernel's output shape, the window kernel on the row layout, the output back to heads
(`rows_to_heads`), and the whole public cascade; and the window step with and without the kernel writing the head layout
(`heads_out`). The prefix is also timed at P/2 and P/4 (same launch), whose straight-line
fit gives the kernel's cost per key step and its fixed cost (launch, pipeline fill, epilogue, wave
tail). For 16-bit pools the default fuses the window into the prefix kernel (`fuse_window`): the
public cascade is timed both ways, the fused one at P/2 and P/4 too (its fixed cost), and, alone,
the XLA work around the fused kernel: the mask words it reads and its split merge (on arrays of
the kernel's partial shape). `--stages SxP,...` also times the prefix
at other (stages, pages per step). Logs only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import D, FP8, HKV, HQ, PAGE, make_paged, random_parents  # noqa: E402
from benchmarks.report import log, parse_shapes  # noqa: E402
from benchmarks.timing import traced_ms  # noqa: E402
from pallas_kernels.attention.prefix_decode import heads_to_rows, rows_to_heads  # noqa: E402
from pallas_kernels.attention.split_merge import merge_splits  # noqa: E402
from pallas_kernels.attention.prefix_decode_mgpu import (ROWS_PER_CTA, default_mgpu_num_splits,  # noqa: E402
                                                         default_pages_per_step, fused_window_words,
                                                         heads_io_errors, prefix_decode_mgpu_row_layout,
                                                         warpgroup_layout)
from pallas_kernels.attention.tree_window import tree_window_row_layout  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, cascade_attention, fused_rows, mosaic_rows  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402


def breakdown(b, p, n, dtype, stage_forms, rng, key):
    interp = jax.default_backend() != "gpu"
    kp, vp, table = make_paged(key, rng, b, p + n, HKV, D, PAGE, dtype, poison=False)
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, n, HQ, D), jnp.float32).astype(jnp.bfloat16)
    lengths = jnp.full((b,), p, jnp.int32)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    group = HQ // HKV
    total = mosaic_rows(n * group)  # as the cascade lays rows out under the Mosaic prefix
    scale = D ** -0.5
    qr = heads_to_rows(q, HKV, total)
    kw = dict(query_rows=1, group=n * group, page_size=PAGE, scale=scale, interpret=interp)
    pre = jax.jit(lambda *a, **extra: prefix_decode_mgpu_row_layout(*a, **kw, **extra))
    po, plse = pre(qr, kp, vp, table, lengths)
    win = jax.jit(lambda *a: tree_window_row_layout(*a, query_rows=n, group=group, window=n, page_size=PAGE,
                                                    scale=scale, causal_prefix=False, value_dim=D,
                                                    interpret=interp, prefix_whole_pages=True))
    cas = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(page_size=PAGE, fuse_window=False)))
    fused = jnp.dtype(dtype).itemsize == 2  # the 16-bit default fuses the window into the prefix kernel
    cas_fused = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
        page_size=PAGE, prefix_kernel="mosaic_gpu", fuse_window=True)))
    itemsize = jnp.dtype(dtype).itemsize
    wgs, rows_cta, _ = warpgroup_layout(total, None, itemsize)
    pps = default_pages_per_step(total, D, itemsize, PAGE, 2)
    steps = -(-table.shape[1] // pps)
    splits = default_mgpu_num_splits(b, HKV, total // rows_cta, steps)
    parts = splits * (2 if rows_cta < ROWS_PER_CTA and wgs == 2 else 1)
    name = f"B={b},P={p},N={n} {jnp.dtype(dtype).name}"
    t = {}
    t["q to rows"] = traced_ms(jax.jit(lambda x: heads_to_rows(x, HKV, total)), (q,), 0)
    t["prefix (kernel + merge)"] = traced_ms(pre, (qr, kp, vp, table, lengths), 4)
    if parts > 1:
        so = jax.random.normal(key, (parts, b, HKV, total, D), jnp.float32)
        sl = jax.random.normal(jax.random.fold_in(key, 1), (parts, b, HKV, total), jnp.float32)
        t[f"split merge alone ({parts} partials)"] = traced_ms(jax.jit(merge_splits), (so, sl), 1)
    t["window kernel"] = traced_ms(win, (qr, kp, vp, table, lengths, mask, po, plse), 4)
    out_rows = win(qr, kp, vp, table, lengths, mask, po, plse)
    t["out to heads"] = traced_ms(jax.jit(lambda x: rows_to_heads(x, n, HQ)), (out_rows,), 0)
    # The cascade's window step both ways: row layout then an XLA transpose, or the kernel writing
    # [B, R, Hq, D] itself (`heads_out`, the default path where the row tiles allow).
    win_kw = dict(query_rows=n, group=group, window=n, page_size=PAGE, scale=scale, causal_prefix=False,
                  value_dim=D, interpret=interp, prefix_whole_pages=True)
    wargs = (qr, kp, vp, table, lengths, mask, po, plse)
    t["window + XLA transpose"] = traced_ms(
        jax.jit(lambda *a: rows_to_heads(tree_window_row_layout(*a, **win_kw), n, HQ)), wargs, 4)
    t["window writing heads"] = traced_ms(
        jax.jit(lambda *a: tree_window_row_layout(*a, **win_kw, heads_out=True)), wargs, 4)
    t["cascade (public, unfused)"] = traced_ms(cas, (q, kp, vp, table, lengths, mask), 4)
    if fused:
        t["cascade (public, fused)"] = traced_ms(cas_fused, (q, kp, vp, table, lengths, mask), 4)
        # The mask words the fused kernel reads, built by XLA before it (small launches count at B=1).
        heads_io = not heads_io_errors(n, group)
        t["fused words prep alone"] = traced_ms(
            jax.jit(lambda m: fused_window_words(m, group, fused_rows(n, group), heads_io=heads_io)), (mask,), 0)
        if splits > 1:  # the fused kernel's key-split partials, [S, B, R, Hq, D], merged by XLA
            so = jax.random.normal(key, (splits, b, n, HQ, D), jnp.float32)
            sl = jax.random.normal(jax.random.fold_in(key, 1), (splits, b, n, HQ), jnp.float32)
            t[f"fused split merge alone ({splits} partials)"] = traced_ms(jax.jit(merge_splits), (so, sl), 1)
    # The default path's pieces: q in, prefix (with its merge), the window writing the head layout.
    pieces = sum(t[k] for k in ("q to rows", "prefix (kernel + merge)", "window writing heads"))
    log(f"{name}: splits {splits}, partials {parts}, pages/step {pps}; "
        + ", ".join(f"{k} {v:.4f} ms" for k, v in t.items())
        + f"; pieces summed {pieces:.4f} ms")
    # Fixed cost and cost per step of the prefix kernel, from P, P/2 and P/4 on the same launch.
    xs, ys = [], []
    for frac in (1, 2, 4):
        lens = jnp.full((b,), p // frac, jnp.int32)
        xs.append(p // frac)
        ys.append(traced_ms(pre, (qr, kp, vp, table, lens), 4))
    slope, fixed = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    log(f"{name}: prefix at P, P/2, P/4: " + ", ".join(f"{y:.4f}" for y in ys)
        + f" ms; fit {fixed:.4f} ms fixed + {1e3 * slope * 1024:.3f} us per 1024 keys "
        f"(fixed share at P: {fixed / ys[0]:.1%})")
    if fused:
        ys = [traced_ms(cas_fused, (q, kp, vp, table, jnp.full((b,), p // frac, jnp.int32), mask), 4)
              for frac in (1, 2, 4)]
        slope, fixed = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
        log(f"{name}: fused cascade at P, P/2, P/4: " + ", ".join(f"{y:.4f}" for y in ys)
            + f" ms; fit {fixed:.4f} ms fixed + {1e3 * slope * 1024:.3f} us per 1024 keys "
            f"(fixed share at P: {fixed / ys[0]:.1%})")
    for stages, pages in stage_forms:
        try:
            ms = traced_ms(jax.jit(lambda *a, s=stages, pp=pages: prefix_decode_mgpu_row_layout(
                *a, **kw, stages=s, pages_per_step=pp)), (qr, kp, vp, table, lengths), 4)
            log(f"{name}: prefix with stages={stages}, pages_per_step={pages}: {ms:.4f} ms")
        except Exception as e:  # noqa: BLE001 - a form that does not fit is reported, the rest still run
            log(f"{name}: prefix with stages={stages}, pages_per_step={pages}: refused ({str(e)[:200]})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="32x32768x64,64x4096x64,1x32768x64,8x8192x16")
    ap.add_argument("--fp8", action="store_true", help="FP8 pools too")
    ap.add_argument("--stages", default="", help="extra (stages x pages per step) prefix forms, e.g. 4x1,6x1")
    a = ap.parse_args(argv)
    forms = [tuple(int(x) for x in f.split("x")) for f in a.stages.split(",") if f]
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    for dtype in [jnp.bfloat16] + ([FP8] if a.fp8 else []):
        for b, p, n in parse_shapes(a.shapes):
            breakdown(b, p, n, dtype, forms, rng, key)


if __name__ == "__main__":
    main()
