"""Per-kernel device times of the default GQA cascade, from a profiler trace (GPU; logs only).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/kernel_profile.py [--shapes 1x32768x64,8x8192x16]
        [--dtypes bf16,fp8] [--splits 0,4] [--merges window,kernel,xla,kernel:1024/8] [--feeds scalar,query]
        [--query-casts kernel,xla] [--fuse auto,off,on] [--heads on,off]

A diagnostic for the small shapes, whose cascade is a few tens of microseconds: the tables' timer
(`timing.traced_time`) gives the whole call, this says where it goes. For each shape, KV dtype and
key-split count (0: the default) it traces chains of `--inner` cascades inside one jit (each fed the
previous output; `timing.traced_chain`) and prints, per call: every device kernel's mean time and
launches, their sum, and the span from the first kernel's start to the last one's end (sum < span:
the device idled between kernels). `--compare` adds the host wall-clock timer `chained_time` before
and after, and a trace of chains a third as long.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import KV_DTYPES, PAGE, cascade_inputs  # noqa: E402
from benchmarks.report import log, parse_shapes  # noqa: E402
from benchmarks.timing import chained_time, feed_output, feed_scalar, median_span, traced_chain  # noqa: E402
from pallas_kernels.attention import prefix_decode_mgpu, split_merge  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, cascade_attention  # noqa: E402


def kernel_table(traces, inner: int):
    """([(us per call, launches per call, kernel)] slowest first, span us per call) of traced chains."""
    calls = inner * len(traces)
    per = defaultdict(lambda: [0, 0.0])
    for events in traces:
        for name, _, dur in events:
            per[name][0] += 1
            per[name][1] += dur
    rows = sorted(((v[1] / calls / 1e3, v[0] / calls, k) for k, v in per.items()), reverse=True)
    return rows, 1e6 * median_span(traces, inner)


# How each chained call is made to depend on the last (--feeds): through P (argument 4) or q (0).
FEEDS = {"scalar": lambda: feed_scalar(4), "query": lambda: feed_output(0)}
def merge_form(merge: str) -> tuple[split_merge.MergeConfig, bool]:
    """(CascadeConfig.merge, CascadeConfig.window_merges_splits) for one --merges entry: xla, kernel,
    kernel:E/W or window (unfused cascades hand the split partials to the window kernel; other
    merges take the Pallas kernel at its default launch)."""
    kind, _, launch = merge.partition(":")
    if kind not in ("xla", "kernel", "window") or (launch and kind != "kernel"):
        raise ValueError(f"--merges: unknown entry {merge!r} (xla, kernel, kernel:E/W or window)")
    config = split_merge.default_config()
    if launch:
        elements, warps = (int(x) for x in launch.split("/"))
        config = dataclasses.replace(config, elements_per_program=elements, num_warps=warps)
    return dataclasses.replace(config, kernel=kind != "xla"), kind == "window"


# Where the FP8 prefix query is cast (--query-casts): in the kernel (fused, from the window's
# unquantised tile, `PrefixMgpuConfig.cast_query_fused`; unfused, from a staged one,
# `PrefixMgpuConfig.cast_query_unfused`), or by XLA before it.
QUERY_CASTS = {"kernel": True, "xla": False}
# Whether the window is fused into the Mosaic prefix kernel (--fuse): `CascadeConfig.fuse_window`.
FUSES = {"auto": None, "off": False, "on": True}
# Whether an unfused Mosaic cascade keeps the head layout (--heads): `CascadeConfig.unfused_heads_io`.
HEADS = {"on": True, "off": False}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768x64,8x8192x16")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--splits", default="0", help="key-split counts (0: the default)")
    ap.add_argument("--inner", type=int, default=60, help="cascades per jitted chain")
    ap.add_argument("--runs", type=int, default=3, help="chains traced")
    ap.add_argument("--merges", default="window",
                    help="comma list of how key splits merge: window (the library's default: unfused cascades hand "
                    "the partials to the window kernel, CascadeConfig.window_merges_splits, fused ones take the Pallas "
                    "merge at its default launch), kernel (the Pallas merge at its default launch for every "
                    "cascade), xla (its reference, `merge_splits_reference`), kernel:E/W (the Pallas merge, E "
                    "elements per program and W warps); with several, each shape also checks every output "
                    "against the first's")
    ap.add_argument("--feeds", default="scalar",
                    help="comma list of how each chained call depends on the last: scalar (a tiny fused op adds "
                    "0 to P, the other benches' feed) or query (the output is the next call's q: no feed kernel, "
                    "and the cascade's work on q runs every call instead of being hoisted out of the chain)")
    ap.add_argument("--compare", action="store_true",
                    help="also chained_time (chains of inner / 3 and inner) before and after, and traces of chains of inner / 3")
    ap.add_argument("--query-casts", default="kernel",
                    help="comma list of where the FP8 prefix query is cast: kernel (the default, fused and unfused) or "
                    "xla; each is a form as the merges are (checked against the first form's output)")
    ap.add_argument("--fuse", default="auto",
                    help="comma list of CascadeConfig.fuse_window settings: auto (None, the default rule), off, "
                    "on; each is a form as the merges are")
    ap.add_argument("--heads", default="on",
                    help="comma list of CascadeConfig.unfused_heads_io settings (on: the unfused Mosaic cascade reads q and "
                    "its partial in head layout, off: the row layout XLA transposes q into); each is a form")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)

    def choices(flag: str, text: str, table: dict) -> list[str]:
        # A comma list of `table`'s keys; an unknown entry is refused by the parser, naming it.
        entries = text.split(",")
        bad = [e for e in entries if e not in table]
        if bad:
            ap.error(f"{flag}: unknown {bad}; choose from {sorted(table)}")
        return entries

    casts = choices("--query-casts", a.query_casts, QUERY_CASTS)
    fuses = choices("--fuse", a.fuse, FUSES)
    heads = choices("--heads", a.heads, HEADS)
    forms = [(m, c, f, h) for m in a.merges.split(",") for c in casts for f in fuses for h in heads]
    failed, outs = False, {}
    for merge in a.merges.split(","):
        merge_form(merge)  # refuses a bad entry before any work
    feeds = choices("--feeds", a.feeds, FEEDS)
    for b, p, n in parse_shapes(a.shapes, 3):
        for dt in a.dtypes.split(","):
            args = cascade_inputs(key, rng, b, p, n, KV_DTYPES[dt])
            for s, (merge, cast, fuse, head) in ((int(x), f) for x in a.splits.split(",") for f in forms):
                merge_config, window_merges = merge_form(merge)
                mgpu_config = dataclasses.replace(prefix_decode_mgpu.default_config(),
                                                  cast_query_fused=QUERY_CASTS[cast],
                                                  cast_query_unfused=QUERY_CASTS[cast])
                cfg = CascadeConfig(page_size=PAGE, num_splits=s or None, fuse_window=FUSES[fuse],
                                    window_merges_splits=window_merges, unfused_heads_io=HEADS[head],
                                    prefix_mgpu=mgpu_config, merge=merge_config)
                fn = jax.jit(lambda *x, cfg=cfg: cascade_attention(*x, window=n, config=cfg))
                label = (f"B={b},P={p},N={n} {dt} splits {s or 'default'}, {merge} merge"
                         + (f", query cast by {cast}" if len(casts) > 1 else "")
                         + (f", fuse {fuse}" if len(fuses) > 1 else "")
                         + (f", heads {head}" if len(heads) > 1 else ""))
                out = np.asarray(fn(*args), np.float32)
                if not np.isfinite(out).all():
                    log(f"{label}: NON-FINITE OUTPUT")
                    failed = True
                if (merge, cast, fuse, head) != forms[0]:
                    err = float(np.linalg.norm(out - outs[s]) / np.linalg.norm(outs[s]))
                    ok = err < 1e-2
                    failed |= not ok
                    log(f"{label}: rel err against the first form {forms[0]} {err:.2e} -> {'PASS' if ok else 'FAIL'}")
                else:
                    outs[s] = out
                if a.compare:
                    # The timer the tables use, then the traced chains, then the timer again: the
                    # two methods in one process, so clock drift shows as a change in either.
                    before = 1e6 * chained_time(fn, args, feed_scalar(4), inner=a.inner // 3)
                for inner, feed in ((i, f) for i in ((a.inner, a.inner // 3) if a.compare else (a.inner,))
                                    for f in feeds):
                    traces = traced_chain(fn, args, FEEDS[feed](), inner=inner, runs=a.runs)
                    if traces is None:
                        raise RuntimeError("the trace holds no device kernels (a GPU with CUPTI is needed)")
                    rows, span = kernel_table(traces, inner)
                    total = sum(r[0] for r in rows)
                    log(f"{label}, chain of {inner} ({feed}-fed): span {span:.1f} us per call, kernels {total:.1f} us "
                        f"({total / span:.0%} busy)")
                    for us, count, name in rows:
                        log(f"    {us:8.2f} us  x{count:g}  {name[:110]}")
                if a.compare:
                    after = 1e6 * chained_time(fn, args, feed_scalar(4), inner=a.inner // 3)
                    log(f"{label}: chained_time {before:.1f} us before the traces, {after:.1f} us after")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
