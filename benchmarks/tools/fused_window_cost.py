"""What the tree window costs inside the fused Mosaic GQA prefix kernel, on the GPU (device time).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/fused_window_cost.py [--shapes 64x4096x64,1x32768x64]

A diagnostic (logs only). For each shape (bf16 pools) it times, each alone and chained:
- the unfused prefix kernel (row layout, every row reads [0, P)) at P and at P + one key step,
  whose difference is what one plain key step costs;
- the fused kernel alone (head layout, mask words prepared outside the timing) at P: its excess
  over the prefix at P is what the window costs, to be compared with one plain step;
- the same fused kernel with the window's per-key work cut down (visibility decided by position
  alone, no mask words; its output is wrong, only its time is read), which bounds what decoding
  the mask words and cleaning V rows cost;
- the public fused cascade at several key-split counts (the default first).

With `--launches` it instead compares the fused kernel's launches at each shape (bf16): gridded,
persistent without `prefetch_query`, and persistent with it (the default, results: prefetch-query), each checked bit for bit against the gridded
one, then timed in `--rounds` interleaved rounds (A, B, C, A, B, C, ...; the median per launch),
so drift within the process hits every launch alike.

With `--fp8-widen` it compares FP8 verify cascades in interleaved rounds: the public unfused
cascade (its prefix now widening V in the memory warpgroup, `memory_widens_values`), and the fused
kernel with each compute warpgroup widening its own V (the fused FP8 form so far) against the
memory warpgroup widening V into its ring (one page per step, two and three stages; gridded and
persistent). Every output is checked against a dense fp32 reference first (the unfused cascade where
the dense weights would pass DENSE_LIMIT_BYTES); one that fails is not
timed. The fused kernel's time leaves out its mask words (a few XLA element-wise ops). `--fused`
names other kernel forms (e.g. "num_splits=2;cluster_splits=true"); each after the first is also
compared with the first (output within 1e-2 relative, lse2 within 1e-3), and `--kv bf16` runs the
same comparison over bf16 pools.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels.attention.prefix_decode_mgpu as pdm  # noqa: E402
from benchmarks.bench_cascade import D, HKV, HQ, PAGE, cascade_inputs  # noqa: E402
from benchmarks.report import log, parse_shapes, rel_err  # noqa: E402
from benchmarks.timing import traced_ms  # noqa: E402
from pallas_kernels.attention.prefix_decode import heads_to_rows, rows_to_heads  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, cascade_attention, fused_rows, mosaic_rows  # noqa: E402


def verify_inputs(b, p, n, rng, key, spare_tokens=0, dtype=jnp.bfloat16):
    """Inputs of one shape over `dtype` pools (`bench_cascade.cascade_inputs`)."""
    return cascade_inputs(key, rng, b, p, n, dtype, spare_tokens)


def fused_kernel(n, **launch):
    """The fused kernel as the cascade runs it for N tree rows (rows per KV head `fused_rows`), bf16
    output (float32 partials merged where it splits keys); its arguments (q in head or row layout,
    pools, table, lengths, words, union)."""
    return jax.jit(lambda *a: pdm.prefix_decode_mgpu_row_layout(
        *a, query_rows=1, group=fused_rows(n, HQ // HKV), page_size=PAGE, scale=D ** -0.5,
        interpret=jax.default_backend() != "gpu", partial_dtype=jnp.bfloat16, window=n,
        heads_io=not pdm.heads_io_errors(n, HQ // HKV), **launch))


def cost(b, p, n, splits, rng, key):
    interp = jax.default_backend() != "gpu"
    q, kp, vp, table, lengths, mask = verify_inputs(b, p, n, rng, key, spare_tokens=2 * PAGE)
    group = HQ // HKV
    total = mosaic_rows(n * group)
    scale = D ** -0.5
    qr = heads_to_rows(q, HKV, total)
    block = PAGE * pdm.default_pages_per_step(total, D, 2, PAGE, 2)
    name = f"B={b},P={p},N={n}"
    t = {}
    pre = jax.jit(lambda *a: pdm.prefix_decode_mgpu_row_layout(
        *a, query_rows=1, group=n * group, page_size=PAGE, scale=scale, interpret=interp))
    t["prefix at P"] = traced_ms(pre, (qr, kp, vp, table, lengths), 4)
    t["prefix at P + step"] = traced_ms(pre, (qr, kp, vp, table, lengths + block), 4)
    heads_io = not pdm.heads_io_errors(n, group)
    words, union = pdm.fused_window_words(mask, group, fused_rows(n, group), heads_io=heads_io)
    fargs = (q if heads_io else heads_to_rows(q, HKV, fused_rows(n, group)), kp, vp, table, lengths, words, union)
    t["fused kernel"] = traced_ms(fused_kernel(n), fargs, 4)
    real = pdm.window_visible
    try:
        pdm.window_visible = lambda k, length, window, words: k < length + window
        jax.clear_caches()
        t["fused kernel, position-only visibility (wrong output)"] = traced_ms(fused_kernel(n), fargs, 4)
    finally:
        pdm.window_visible = real
        jax.clear_caches()
    for s in splits:
        cas = jax.jit(lambda *a, s=s: cascade_attention(*a, window=n, config=CascadeConfig(
            page_size=PAGE, prefix_kernel="mosaic_gpu", fuse_window=True, num_splits=s)))
        t[f"fused cascade, splits {s or 'default'}"] = traced_ms(cas, (q, kp, vp, table, lengths, mask), 4)
    step = t["prefix at P + step"] - t["prefix at P"]
    extra = t["fused kernel"] - t["prefix at P"]
    log(f"{name}: " + ", ".join(f"{k} {v:.4f} ms" for k, v in t.items())
        + f"; one plain step {step:.4f} ms, the window in the fused kernel {extra:.4f} ms "
        f"({extra / step if step > 0 else float('nan'):.2f} plain steps)")


LAUNCHES = {"gridded": dict(persistent=False), "persistent, no prefetch": dict(persistent=True, prefetch_query=False),
            "persistent + prefetch_query (default)": dict(persistent=True)}


def launches(b, p, n, rounds, rng, key):
    """The fused kernel (bf16, head layout, words prepared outside) under each of LAUNCHES."""
    q, kp, vp, table, lengths, mask = verify_inputs(b, p, n, rng, key)
    group = HQ // HKV
    if pdm.heads_io_errors(n, group):
        log(f"B={b},P={p},N={n}: no head-layout fused kernel here; skipped")
        return
    words, union = pdm.fused_window_words(mask, group, n * group, heads_io=True)
    args = (q, kp, vp, table, lengths, words, union)
    fns = {name: fused_kernel(n, **opts) for name, opts in LAUNCHES.items()}
    base = [np.asarray(x, np.float32) for x in fns["gridded"](*args)]
    for name, fn in fns.items():
        same = all(np.array_equal(x, np.asarray(y, np.float32)) for x, y in zip(base, fn(*args)))
        log(f"B={b},P={p},N={n}: {name} {'gives the gridded bits' if same else 'DIFFERS from the gridded launch'}")
    interleaved({name: (fn, args) for name, fn in fns.items()}, rounds, f"B={b},P={p},N={n} fused kernel")


def interleaved(runs: dict, rounds: int, label: str):
    """Times each `name: (fn, args)` of `runs` in `rounds` interleaved rounds (A, B, A, B, ...; each
    fed through argument 4) and logs the median and every round per name."""
    times = {name: [] for name in runs}
    for _ in range(rounds):
        for name, (fn, args) in runs.items():
            times[name].append(traced_ms(fn, args, 4))
    log(f"{label}, {rounds} interleaved rounds: " + "; ".join(
        f"{name} {np.median(t):.4f} ms (" + ", ".join(f"{x:.4f}" for x in t) + ")" for name, t in times.items()))


DENSE_LIMIT_BYTES = 4 << 30

FP8_FUSED = {"fused, own widening": dict(memory_widens_values=False),
             "fused, widened ring, 2 stages": dict(memory_widens_values=True, stages=2),
             "fused, widened ring, 3 stages": dict(memory_widens_values=True, stages=3),
             "fused, widened ring, 2 stages, gridded": dict(memory_widens_values=True, stages=2, persistent=False),
             "fused, widened ring, 2 stages, persistent": dict(memory_widens_values=True, stages=2, persistent=True)}


def parse_forms(text: str) -> dict[str, dict]:
    """`--fused "stages=6,pages_per_step=1;registers=224:56"` -> {label: kernel options} (integers,
    true / false, or a:b tuples)."""
    forms = {}
    for group in filter(None, (g.strip() for g in text.split(";"))):
        opts = {}
        for item in group.split(","):
            name, _, value = item.partition("=")
            low = value.strip().lower()
            opts[name.strip()] = ({"true": True, "false": False}[low] if low in ("true", "false") else
                                  tuple(int(v) for v in value.split(":")) if ":" in value else int(value))
        forms["fused kernel, " + group] = opts
    return forms


def fp8_widen(b, p, n, rounds, rng, key, forms=None, dtype=jnp.float8_e4m3fn):
    """FP8 (or `dtype`) pools: the public (default) cascade against the fused kernel under `forms`
    (FP8_FUSED by default); every kernel form after the first is also compared with the first
    (output and lse2, which differ only in rounding)."""
    from pallas_kernels.attention.reference import cascade_dense_reference

    q, kp, vp, table, lengths, mask = verify_inputs(b, p, n, rng, key, dtype=dtype)
    group = HQ // HKV
    heads_io = not pdm.heads_io_errors(n, group)
    words, union = pdm.fused_window_words(mask, group, fused_rows(n, group), heads_io=heads_io)
    fargs = (q if heads_io else heads_to_rows(q, HKV, fused_rows(n, group)), kp, vp, table, lengths, words, union)
    cargs = (q, kp, vp, table, lengths, mask)
    unfused = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
        page_size=PAGE, prefix_kernel="mosaic_gpu", fuse_window=False)))
    public = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
        page_size=PAGE, prefix_kernel="mosaic_gpu")))
    runs = {"cascade, unfused (default)": (unfused, cargs)}
    if forms:
        runs["cascade (public default)"] = (public, cargs)
    for name, opts in (forms or FP8_FUSED).items():
        if "persistent" in opts and b * HKV * max(fused_rows(n, group) // 128, 1) <= pdm.num_sms():
            continue  # no more items than SMs: the default launch is gridded, and persistent would match it
        runs[name] = (fused_kernel(n, **opts), fargs)
    # The dense fp32 reference holds [B, Hq, N, P + N] weights (16 GiB at B=32, P=32768: out of
    # memory on the H200); past DENSE_LIMIT_BYTES the forms are checked against the unfused cascade,
    # which bench_cascade's conformance checks against dense attention at small shapes.
    if b * HQ * n * (p + n) * 4 <= DENSE_LIMIT_BYTES:
        dense, _ = cascade_dense_reference(q, kp, vp, table, lengths, mask, window=n, page_size=PAGE,
                                           scale=D ** -0.5)
        ref_name = "dense fp32"
    else:
        dense, ref_name = unfused(*cargs), "the unfused cascade"
    name0 = f"{'FP8' if dtype == jnp.float8_e4m3fn else jnp.dtype(dtype).name} B={b},P={p},N={n}"
    ok, first = {}, None
    for name, (fn, args) in list(runs.items()):
        try:
            out = fn(*args)
        except ValueError as exc:  # a form this shape cannot take (e.g. 3 stages under a key split)
            log(f"{name0}: {name}: refused: {str(exc).splitlines()[0][:300]}")
            ok[name] = None
            continue
        lse = out[1] if isinstance(out, tuple) else None
        out = out[0] if isinstance(out, tuple) else out
        if not heads_io and not name.startswith("cascade"):
            out = rows_to_heads(out, n, HQ)
        err = rel_err(out, dense)
        ok[name] = err < 6e-2  # FP8-quantised query on steps wholly below P (as in the tests)
        against_first = ""
        if lse is not None and first is None:
            first = (out, np.asarray(lse))
        elif lse is not None:
            lse = np.asarray(lse)
            same_lse = bool(np.array_equal(np.isfinite(lse), np.isfinite(first[1]))
                            and np.allclose(lse[np.isfinite(lse)], first[1][np.isfinite(lse)], rtol=0, atol=1e-3))
            err_first = rel_err(out, first[0])
            ok[name] = ok[name] and same_lse and err_first < 1e-2
            against_first = f"; against the first kernel form: out rel {err_first:.2e}, lse2 within 1e-3: {same_lse}"
        log(f"{name0}: {name}: rel {err:.2e} against {ref_name}{against_first} -> "
            f"{'ok' if ok[name] else 'FAILED, not timed'}")
    interleaved({name: run for name, run in runs.items() if ok[name]}, rounds, name0)
    return all(v is not False for v in ok.values())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x4096x64,1x32768x64")
    ap.add_argument("--splits", default="0,2,4,16", help="key splits of the fused cascade (0: the default)")
    ap.add_argument("--launches", action="store_true", help="compare the fused kernel's launches instead")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --launches and --fp8-widen")
    ap.add_argument("--fp8-widen", action="store_true", help="compare the FP8 cascade's forms instead")
    ap.add_argument("--kv", choices=("fp8", "bf16"), default="fp8", help="with --fp8-widen: the pools' dtype")
    ap.add_argument("--fused", default=None, help="with --fp8-widen: the fused kernel's forms to time instead of "
                    "FP8_FUSED, e.g. 'stages=6,pages_per_step=1;stages=8,pages_per_step=1'")
    a = ap.parse_args(argv)
    splits = [int(s) or None for s in a.splits.split(",") if s]
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    ok = True
    for b, p, n in parse_shapes(a.shapes):
        if a.fp8_widen:
            ok = fp8_widen(b, p, n, a.rounds, rng, key, parse_forms(a.fused) if a.fused else None,
                           {"fp8": jnp.float8_e4m3fn, "bf16": jnp.bfloat16}[a.kv]) and ok
        elif a.launches:
            launches(b, p, n, a.rounds, rng, key)
        else:
            cost(b, p, n, splits, rng, key)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
