"""Per-kernel device times of the default GQA cascade, from a profiler trace (GPU; logs only).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/kernel_profile.py [--shapes 1x32768x64,8x8192x16]
        [--dtypes bf16,fp8] [--splits 0,4]

A diagnostic for the small shapes, whose cascade is a few tens of microseconds: `chained_time`
gives the whole call, this says where it goes. For each shape, KV dtype and key-split count (0: the
default) it runs a chain of `--inner` cascades inside one jit (each fed the previous output, as
`chained_time` does) under `jax.profiler.trace`, reads the trace back with `jax.profiler.ProfileData`
and prints, per call: every device kernel's mean time and count, their sum, and the span from the
first kernel's start to the last one's end divided by the calls (sum < span: the device idled
between kernels).
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import D, FP8, HKV, HQ, PAGE, make_paged, random_parents  # noqa: E402
from benchmarks.report import log, parse_shapes  # noqa: E402
from benchmarks.timing import _warm, chained_time, feed_scalar  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, cascade_attention  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402


def device_events(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, start_ns, duration_ns) of every event on the trace's device planes' stream lines."""
    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}")
    events, seen = [], []
    for plane in jax.profiler.ProfileData.from_file(paths[0]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            seen.append(f"{plane.name}/{line.name}")
            # Stream lines hold the kernels; XLA's op / module lines repeat them as annotations.
            if "stream" not in line.name.lower() or "xla" in line.name.lower():
                continue
            events.extend((e.name, e.start_ns, e.duration_ns) for e in line.events)
    if not events:
        log(f"no stream events; device lines seen: {seen}")
    return events


def profile_chain(fn, args, inner: int, runs: int, sustain_s: float = 0.0):
    """(per-call [(us, count, kernel)], span us per call, host wall clock us per call) of `runs` runs of a chain of `inner` calls of `fn` (jitted together)."""
    feed = feed_scalar(4)

    def many(*a):
        out = None
        for _ in range(inner):
            out = fn(*a)
            a = feed(a, out)
        return out

    chain = jax.jit(many)
    _warm(lambda _: chain(*args), jax.block_until_ready(chain(*args)))
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < sustain_s:  # load the GPU longer: do its clocks fall?
        jax.block_until_ready(chain(*args))
    d = tempfile.mkdtemp(prefix="kprof")
    walls = []
    with jax.profiler.trace(d):
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(chain(*args))
            walls.append(time.perf_counter() - t0)
    events = device_events(d)
    if not events:
        raise RuntimeError("the trace holds no device kernels (is CUPTI available?)")
    calls = inner * runs
    per = defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        per[name][0] += 1
        per[name][1] += dur
    starts = sorted(events, key=lambda e: e[1])
    # Span per call within each run: runs are separated by host syncs, so split at the largest gaps.
    gaps = sorted(range(1, len(starts)), key=lambda i: starts[i][1] - (starts[i - 1][1] + starts[i - 1][2]))[-(runs - 1):] if runs > 1 else []
    bounds = [0, *sorted(gaps), len(starts)]
    span = sum(max(s + d for _, s, d in starts[a:b]) - starts[a][1] for a, b in zip(bounds, bounds[1:]))
    rows = sorted(((v[1] / calls / 1e3, v[0] / calls, k) for k, v in per.items()), reverse=True)
    return rows, span / calls / 1e3, 1e6 * statistics.median(walls) / inner


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="1x32768x64,8x8192x16")
    ap.add_argument("--dtypes", default="bf16,fp8")
    ap.add_argument("--splits", default="0", help="key-split counts (0: the default)")
    ap.add_argument("--inner", type=int, default=20, help="cascades per jitted chain")
    ap.add_argument("--runs", type=int, default=3, help="chains traced")
    ap.add_argument("--compare", action="store_true",
                    help="also chained_time before and after, and traces of chains of inner and 3 * inner")
    ap.add_argument("--sustain-s", type=float, default=0.0, help="seconds of the chain run before each trace")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    for b, p, n in parse_shapes(a.shapes, 3):
        for dt in a.dtypes.split(","):
            dtype = {"bf16": jnp.bfloat16, "fp8": FP8}[dt]
            kp, vp, table = make_paged(key, rng, b, p + n, HKV, D, PAGE, dtype, poison=False)
            q = jax.random.normal(jax.random.fold_in(key, 7), (b, n, HQ, D), jnp.float32).astype(jnp.bfloat16)
            args = (q, kp, vp, table, jnp.full((b,), p, jnp.int32),
                    ancestor_mask(jnp.asarray(random_parents(rng, b, n))))
            for s in (int(x) for x in a.splits.split(",")):
                fn = jax.jit(lambda *x, s=s: cascade_attention(*x, window=n, config=CascadeConfig(
                    page_size=PAGE, num_splits=s or None)))
                label = f"B={b},P={p},N={n} {dt} splits {s or 'default'}"
                if a.compare:
                    # The timer the tables use, then the traced chains, then the timer again: the
                    # two methods in one process, so clock drift shows as a change in either.
                    before = 1e6 * chained_time(fn, args, feed_scalar(4), inner=a.inner)
                for inner in ((a.inner, 3 * a.inner) if a.compare else (a.inner,)):
                    rows, span, wall = profile_chain(fn, args, inner, a.runs, a.sustain_s)
                    total = sum(r[0] for r in rows)
                    log(f"{label}, chain of {inner}: span {span:.1f} us per call, kernels {total:.1f} us "
                        f"({total / span:.0%} busy); host wall clock {wall:.1f} us per call")
                    for us, count, name in rows:
                        log(f"    {us:8.2f} us  x{count:g}  {name[:110]}")
                if a.compare:
                    after = 1e6 * chained_time(fn, args, feed_scalar(4), inner=a.inner)
                    log(f"{label}: chained_time {before:.1f} us before the traces, {after:.1f} us after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
