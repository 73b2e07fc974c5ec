"""The default GQA cascade against its floors with the GPU in two power states (GPU; logs only).

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/power_state.py [--shapes 64x4096x64,1x32768x64]
        [--dtypes bf16,fp8] [--rounds 2]

The H200 runs at its boost clocks after an idle moment and lowers them at its power cap under
sustained load, and the kernels' times and the matmul ceiling both move with it (results: timer: the
B=64 bf16 cascade reads 0.48 ms traced after idle gaps and 0.53 ms traced under sustained load). A
ratio to a floor means something only when both sides were measured in the same state, so for each
state this measures, traced (`timing.traced_chain`, kernel spans only), both the cascade and the
bf16 matmul the FLOP floor comes from:

- "boost": each traced run starts after IDLE_S seconds of idle device (the state every benchmark
  times kernels and the matmul ceiling in, `timing.traced_time`);
- "sustained": each traced run follows SUSTAIN_S seconds of the same chain run back to back.

Rounds alternate the states (boost, sustained, boost, ...), so drift hits both alike. The byte floor
uses the copy bandwidth measured cold (`timing.measure_copy_bandwidth`); at every issue shape but
B=8 bf16 the FLOP floor is the larger one.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import KV_DTYPES, PAGE, cascade_inputs, kv_bytes, verify_flops  # noqa: E402
from benchmarks.report import log, parse_shapes  # noqa: E402
from benchmarks.timing import (IDLE_S, feed_scalar, measure_ceilings, traced_matmul_flops,  # noqa: E402
                               traced_time)
from treespec_jax.attention.cascade import CascadeConfig, cascade_attention  # noqa: E402

SUSTAIN_S = 2.0
# (idle seconds, seconds of load) before each traced run, per state.
STATES = {"boost": dict(idle_s=IDLE_S, warm_s=0.0), "sustained": dict(idle_s=0.0, warm_s=SUSTAIN_S)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="64x4096x64,1x32768x64")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--inner", type=int, default=60)
    a = ap.parse_args(argv)
    bw, _ = measure_ceilings()  # prints the traced copy and matmul beside the floors' figures
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s (cold)")
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(0)
    cases = []
    for b, p, n in parse_shapes(a.shapes, 3):
        for dt in a.dtypes.split(","):
            args = cascade_inputs(key, rng, b, p, n, KV_DTYPES[dt])
            fn = jax.jit(lambda *x, n=n: cascade_attention(*x, window=n, config=CascadeConfig(page_size=PAGE)))
            cases.append((f"B={b},P={p},N={n} {dt}", fn, args, kv_bytes(b, p, n, KV_DTYPES[dt]) / bw,
                          verify_flops(b, p, n)))
    for r in range(a.rounds):
        for state in ("boost", "sustained"):
            flops = traced_matmul_flops(**STATES[state])
            log(f"round {r} {state}: bf16 matmul {flops / 1e12:.0f} TFLOP/s")
            for label, fn, args, byte_floor, flop in cases:
                t = traced_time(fn, args, feed_scalar(4), inner=a.inner, **STATES[state])
                floor = max(byte_floor, flop / flops)
                log(f"round {r} {state}: {label} cascade {t * 1e3:.4f} ms, floors byte {byte_floor * 1e3:.4f} / "
                    f"FLOP {flop / flops * 1e3:.4f} ms, {t / floor:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
