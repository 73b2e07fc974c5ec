"""Where a served batch's time goes on the GPU, on a SmolLM2-135M-shaped target with random bf16
weights (no model file needed): one prefill batch by its row count, and a whole `Engine.decode`
call split into prefill, decode steps and the rest, for each prefill token budget given.

    PYTHONPATH=. python benchmarks/tools/engine_probe.py [--slots 256] [--context 960]
        [--budgets 256,8192] [--requests 256] [--new-tokens 128] [--out DIR]

A budget of 256 (one chunk) prefills each admitted request alone; 8192 prefills up to 32 together.
Times are medians of repeated calls after a warm-up, in one process; prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                    num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    max_position_embeddings=8192)


def engine_for(cfg, params, slots: int, context: int, budget: int):
    from treespec_jax.config import (KVCacheConfig, ModelConfig, SamplingConfig, SchedulerConfig, ServeConfig)
    from treespec_jax.engine import Engine

    config = ServeConfig(model=ModelConfig(dtype="bf16", context_length=context),
                         kv_cache=KVCacheConfig(page_size=64),
                         scheduler=SchedulerConfig(max_running_requests=slots, chunked_prefill_size=budget),
                         sampling=SamplingConfig(backend="gumbel", temperature=0.0), seed=0)
    return Engine(config, cfg, params)


def prefill_ms(engine, rows: int, reps: int = 5) -> float:
    """Median ms of one `[rows, chunk]` prefill call (full chunks, fresh pages per row)."""
    c, w = engine.chunk, engine.table_width
    rng = np.random.default_rng(rows)
    toks = jnp.asarray(rng.integers(0, 1000, (rows, c)), jnp.int32)
    table = jnp.asarray(1 + np.arange(rows * w, dtype=np.int32).reshape(rows, w) % (engine.num_pages - 1))
    start = jnp.zeros((rows,), jnp.int32)
    valid = jnp.full((rows,), c, jnp.int32)
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        engine.state, logits, _ = engine._prefill(engine.params, engine.state, toks, table, start, valid)
        jax.block_until_ready(logits)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def main():
    from benchmarks.bench_e2e import _run_each_prefill_size
    from treespec_jax.engine import Request
    from treespec_jax.models.config import LlamaConfig
    from treespec_jax.models.llama import init_params

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--context", type=int, default=960)
    ap.add_argument("--budgets", default="256,8192")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    cfg = LlamaConfig(**SMOLLM2_135M)
    params = jax.jit(lambda k: init_params(cfg, k, "bf16"))(jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(n)).tolist() for n in rng.integers(100, 400, args.requests)]
    reqs = [Request(prompt=p, max_new_tokens=args.new_tokens, temperature=0.0 if i % 2 else 0.8, seed=i,
                    ignore_eos=True) for i, p in enumerate(prompts)]
    rows_out = []
    for budget in [int(b) for b in args.budgets.split(",")]:
        engine = engine_for(cfg, params, args.slots, args.context, budget)
        for rows in sorted({1, 8, engine.prefill_rows} & set(range(1, engine.prefill_rows + 1))):
            ms = prefill_ms(engine, rows)
            rows_out.append({"budget": budget, "prefill_rows": rows, "chunk": engine.chunk, "prefill_ms": ms,
                             "ms_per_row": ms / rows})
            print(json.dumps(rows_out[-1]), flush=True)
        engine.state = engine._fresh_state()
        _run_each_prefill_size(engine, reqs)
        t0 = time.perf_counter()
        engine.decode(reqs)
        wall = time.perf_counter() - t0
        run = engine.last_run
        rows_out.append({"budget": budget, "requests": len(reqs), "steps": run.steps, "prefill_s": run.prefill_s,
                         "decode_s": run.decode_s, "wall_s": wall, "other_s": wall - run.prefill_s - run.decode_s,
                         "ms_per_step": 1e3 * run.decode_s / max(run.steps, 1),
                         "generated": run.generated_tokens, "tok_s": run.generated_tokens / wall})
        print(json.dumps(rows_out[-1]), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "engine_probe.json").write_text(json.dumps(rows_out, indent=1) + "\n")


if __name__ == "__main__":
    main()
