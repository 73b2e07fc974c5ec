"""Variants of the Mosaic MLA latent decode, and whether it waits on memory. (GPU only)

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mla_variants.py [--no-shared]
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/mla_variants.py --options '{"cluster_tiles": 1}' \
        '{"cluster_tiles": 2}' [--rounds 2] [--dtypes bf16,fp8]

At DeepSeek-V3 widths (B=32, P=8192, 16 x 128 query rows per request, latent 512 + rope 64) every
64-row tile of a request reads the request's whole latent prefix, so the decode moves about 32x the
pool's bytes from L2 into shared memory. This times the decode (device time, chained calls) with a
random page table (the benchmark's layout) against one where every request maps the same pages (the
working set then stays in L2; a large gain there says the kernel waits on memory), under each
`schedule` of its two compute warpgroups, and under FP8 with three ring stages. On the H200 (2026-12-01) shared pages gained 2% at most.

With `--options`, an A/B of `mla_decode_mgpu` keyword sets instead, on the cascade's form of the
decode (the tree window fused, `window=N`, bf16 output): each set's output must have the first
set's bits (random rows, ragged prefix lengths, random trees), then every set is timed in
interleaved rounds (`timing.traced_time`, device time), so a drift of the device between them
shows up as a drift between rounds rather than as a difference between sets.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import log  # noqa: E402
from benchmarks.timing import chained_time, feed_scalar, measure_matmul_flops, traced_time  # noqa: E402
from pallas_kernels.attention.mla_decode_mgpu import SCHEDULES, mla_decode_mgpu  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402

B, P, N, HQ, LORA, ROPE, PAGE = 32, 8192, 16, 128, 512, 64, 64


def option_ab(option_sets: list[dict], rounds: int, dtypes: list[str]) -> int:
    """The `--options` A/B (module docstring); returns 1 if a set fails to compile or to match."""
    flops = measure_matmul_flops()
    rng = np.random.default_rng(0)
    per_req = -(-(P + N) // PAGE)
    table = jnp.asarray(rng.permutation(B * per_req).reshape(B, per_req), jnp.int32)
    # Ragged for the bit check (the timings run the same lengths): P - 7 * b, so steps differ per request.
    lengths = jnp.asarray(P - 7 * np.arange(B), jnp.int32)
    parents = np.stack([np.r_[-1, rng.integers(0, np.arange(1, N))] for _ in range(B)]).astype(np.int32)
    mask = ancestor_mask(jnp.asarray(parents))
    flop = 2 * B * N * HQ * (P + N) * (2 * LORA + ROPE)
    failed = 0
    for dname in dtypes:
        dtype = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}[dname]
        pool = jax.random.normal(jax.random.PRNGKey(1), (B * per_req * PAGE, LORA + ROPE), jnp.float32).astype(dtype)
        q = jax.random.normal(jax.random.PRNGKey(2), (B, N, HQ, LORA + ROPE), jnp.float32).astype(dtype)
        fns, first = {}, None
        for opts in option_sets:
            label = json.dumps(opts)
            fn = jax.jit(lambda q, pool, t, ln, m, o=opts: mla_decode_mgpu(
                q, pool, t, ln, m, kv_lora_rank=LORA, page_size=PAGE, scale=0.07, window=N, out_dtype=jnp.bfloat16,
                **o))
            try:
                out, lse = jax.block_until_ready(fn(q, pool, table, lengths, mask))
            except Exception as exc:  # noqa: BLE001
                log(f"{dname} {label}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                failed = 1
                continue
            got = (np.asarray(out, np.float32), np.asarray(lse))
            if first is None:
                first = got
                ok = bool(np.isfinite(got[0]).all() and np.isfinite(got[1]).all())
                log(f"{dname} {label}: output finite: {ok}")
            else:
                ok = all(np.array_equal(a, b) for a, b in zip(got, first))
                log(f"{dname} {label}: the first set's bits: {ok}")
            if not ok:
                failed = 1
                continue
            fns[label] = fn
        args = (q, pool, table, lengths, mask)
        for rnd in range(rounds):
            for label, fn in fns.items():
                t = traced_time(fn, args, feed_scalar(3), inner=30)
                log(f"{dname} round {rnd + 1} {label}: {t * 1e3:.3f} ms, {flop / t / 1e12:.0f} TFLOP/s "
                    f"({flop / flops / t:.2f} of the matmul rate)")
    return failed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-shared", action="store_true", help="random pages only")
    ap.add_argument("--options", nargs="+", help="JSON keyword sets of mla_decode_mgpu to A/B (see the docstring)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtypes", default="bf16,fp8")
    a = ap.parse_args(argv)
    shared = not a.no_shared
    if jax.default_backend() != "gpu":
        print("mla_variants: needs a GPU; nothing run", file=sys.stderr)
        return 0
    if a.options:
        return option_ab([json.loads(o) for o in a.options], a.rounds, a.dtypes.split(","))
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
