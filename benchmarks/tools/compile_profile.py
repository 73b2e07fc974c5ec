"""Where a new engine's start-up compile goes: each program `Engine.compile` builds, its lowering and
its XLA compile seconds, on a SmolLM2-135M-shaped target with random bf16 weights (no model file).

    PYTHONPATH=. python3 benchmarks/tools/compile_profile.py --head treespec_jax/data/smollm2-eagle3
        [--shape tree-k4s5n16] [--batch 8] [--temperature 0] [--workers 1] [--steps 200] [--inline-layers]
        [--out DIR]

Run one process per setting: XLA keeps its autotuning results for the life of the process, so a
second engine in the same process would compile faster than a user's first. Do not set
JAX_COMPILATION_CACHE_DIR (a cache hit is not a compile). After compiling, the engine serves
`--steps` decode steps of a full batch and times a whole batch's prefill, so a setting that compiles
faster (more `--workers`, other XLA_FLAGS) can be checked for a slower step or prefill. Prints one
JSON document.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import statistics
import time
import zlib
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head", type=Path, required=True, help="an EAGLE-3 head (HF layout) for drafting shapes")
    ap.add_argument("--shape", default="tree-k4s5n16", help="a shape as bench_e2e.shape_spec reads it (e.g. tree-k4s6n24)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--workers", type=int, default=0, help="compiling threads (0: the engine's default)")
    ap.add_argument("--steps", type=int, default=200, help="decode steps timed after the compile")
    ap.add_argument("--inline-layers", action="store_true",
                    help="trace each decoder layer inline instead of calling the jitted `decoder_layer`: "
                         "whether that call changes the compiled step's speed on this device")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        ap.error("unset JAX_COMPILATION_CACHE_DIR: a persistent cache hit is not a compile")

    from benchmarks.bench_e2e import _engine, _random_smollm2, _serve_steps, run_header
    from treespec_jax.engine import Request
    from treespec_jax.models.hf import load_eagle3

    if args.inline_layers:
        from treespec_jax.models import llama

        # The jitted function's Python body: the forward then traces every layer in place.
        llama.decoder_layer = llama.decoder_layer.__wrapped__
    cfg, params = _random_smollm2()
    head = load_eagle3(args.head, "bf16")
    t0 = time.perf_counter()
    engine = _engine(args.shape, args.batch, args.temperature, cfg, params, None, head)
    build_s = time.perf_counter() - t0
    prompts = [[(7 * i + j) % cfg.vocab_size for j in range(100 + i)] for i in range(args.batch)]
    reqs = [Request(prompt=p, max_new_tokens=4096, ignore_eos=True, temperature=args.temperature) for p in prompts]
    compile_s = engine.compile(reqs, workers=args.workers or None)
    programs = sorted(engine.last_compile, key=lambda p: -p.compile_s)
    by_kind = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for p in programs:
        kind = by_kind[p.name.split("[")[0]]
        kind[0] += 1
        kind[1] += p.lower_s
        kind[2] += p.compile_s
    # A whole batch prefilled together (one prefill of `batch` rows), the median of 3 after a warm-up:
    # whether a setting that compiles faster left the prefill slower.
    prefill_s = []
    for _ in range(4):
        engine.decode([dataclasses.replace(r, max_new_tokens=2) for r in reqs])
        prefill_s.append(engine.last_run.prefill_s)
    # The first steps also run what compiles only when it first runs (the host's small eager ops).
    stream = engine.stream(reqs)
    _serve_steps(engine, stream, 20)
    step_s = _serve_steps(engine, stream, args.steps)
    doc = {"shape": args.shape, "batch": args.batch, "temperature": args.temperature,
           "workers": args.workers or "default", "inline_layers": args.inline_layers,
           "build_s": round(build_s, 2), "compile_s": round(compile_s, 2),
           "lower_s_sum": round(sum(p.lower_s for p in programs), 2),
           "xla_s_sum": round(sum(p.compile_s for p in programs), 2),
           "by_kind": {k: {"programs": n, "lower_s": round(lo, 2), "compile_s": round(c, 2)}
                       for k, (n, lo, c) in sorted(by_kind.items(), key=lambda kv: -kv[1][2])},
           "programs": [{"name": p.name, "lower_s": round(p.lower_s, 2), "compile_s": round(p.compile_s, 2)}
                        for p in programs],
           "step_ms": round(step_s * 1e3, 3), "prefill_ms": round(statistics.median(prefill_s[1:]) * 1e3, 3),
           **run_header()}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        inline = "_inline" if args.inline_layers else ""
        tag = f"{args.shape}_b{args.batch}_w{args.workers}{inline}_{zlib.crc32(doc['xla_flags'].encode()):08x}"
        (args.out / f"compile_{tag}.json").write_text(text)


if __name__ == "__main__":
    main()
