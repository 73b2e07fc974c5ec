"""Tensor parallelism on the GPUs of one host: same tokens as one GPU, and the target's step latency.

Run on a machine with 2 GPUs (nvidia-h200-x2) from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_tp.py [--layers 32] [--markdown FILE]

1. Same tokens (`--check-layers`, default 2): the engine on a random fp32 target of the
   Llama-3.1-8B shape cut to that many layers (the drafter: the target itself with seeded logit
   noise, so trees branch), compiled Pallas cascade kernels, tree decoding (K=4, S=4, N=16) at
   TP = 1 and TP = 2 over four requests, greedy and keyed Gumbel (temperature 0.8, top-p 0.9).
   The tokens must be identical; the run says so per sampler and exits 1 when they differ.
2. Step latency: a random bf16 target of the Llama-3.1-8B shape (32 layers, hidden 4096, 32 / 8
   heads of 128, MLP 14336, vocabulary 128256) at TP = 1 and TP = 2, batch 1 and 32, a committed
   prefix of `--context` tokens per request: the plain decode step (one token per request) and
   the tree verify (N = 16 nodes under ancestor masks), each the target forward plus its greedy
   argmax (shard-local and reduced at TP = 2), with the pools donated and threaded through the
   calls as the engine does. Reported as milliseconds per step and as ratios within this run:
   TP2 / TP1, and each against its weight-read floor (bf16 weight bytes per device / the copy
   bandwidth measured here, read + write bytes per second). The TP = 2 and TP = 1 greedy predictions of the first step (same
   inputs) are compared as a diagnostic: bf16 partial sums reduced across devices round
   differently from one matmul, so a random model's flat logits may flip a few argmaxes.

`--quick` runs the check at 1 layer and times batch 1 only over 4 layers (a smoke run).
`--tp-sizes 1` runs the TP = 1 half alone on one GPU; on one H200 it took 106 s (both
engines' compiles included), so the whole two-GPU run should take about 4 minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import measure_copy_bandwidth
from treespec_jax import parallel
from treespec_jax.config import (KVCacheConfig, ModelConfig, ParallelConfig, SamplingConfig, SchedulerConfig,
                                 ServeConfig, SpeculativeConfig)
from treespec_jax.drafter.oracle import ModelDrafter
from treespec_jax.engine import Engine, Request
from treespec_jax.engine.loading import attention_for
from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.llama import LlamaModel, init_params, kv_buffer_names
from treespec_jax.tree.spec import TreeSpec

PAGE = 64


def llama8b(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=layers,
                       num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                       max_position_embeddings=8192)


# ---- 1. same tokens ------------------------------------------------------------------------------

def check_tokens(layers: int, tps=(1, 2), dtype: str = "fp32") -> bool:
    cfg = llama8b(layers)
    params = init_params(cfg, jax.random.key(0), dtype=dtype, scale=2.0)
    rng = np.random.default_rng(0)
    requests = [Request(prompt=rng.integers(0, cfg.vocab_size, size=n).tolist(), max_new_tokens=24, seed=10 + i)
                for i, n in enumerate([17, 64, 5, 120])]
    ok = True
    for sampler, temperature, top_p in (("greedy", 0.0, 1.0), ("gumbel", 0.8, 0.9)):
        out = {}
        for tp in tps:
            config = ServeConfig(
                model=ModelConfig(dtype=dtype),
                speculative=SpeculativeConfig(algorithm="EAGLE3", topk=4, num_steps=4, num_draft_tokens=16),
                kv_cache=KVCacheConfig(page_size=PAGE, max_total_tokens=4096),
                scheduler=SchedulerConfig(max_running_requests=4, chunked_prefill_size=64),
                sampling=SamplingConfig(backend=sampler, temperature=temperature, top_p=top_p),
                parallel=ParallelConfig(tp_size=tp))
            drafter = ModelDrafter(LlamaModel(cfg, attention_for(config)), noise=1.0, noise_seed=1)
            t0 = time.perf_counter()
            engine = Engine(config, cfg, params, drafter, params)
            outs = engine.decode(requests)
            out[tp] = [o.tokens for o in outs]
            print(f"  check {sampler} TP={tp}: {time.perf_counter() - t0:.1f} s (with compiles), mean accept "
                  f"{engine.last_run.mean_accept_length:.2f}, first tokens {out[tp][0][:8]}", flush=True)
            del engine
        if len(out) < 2:
            continue
        same = out[1] == out[2]
        ok &= same
        print(f"  check {sampler}: TP=2 tokens {'==' if same else '!='} TP=1 tokens "
              f"({sum(len(t) for t in out[1])} tokens, {cfg.num_layers} layers, {dtype})", flush=True)
    del params
    return ok


# ---- 2. step latency -----------------------------------------------------------------------------

def _tree_parents(b: int, n: int) -> np.ndarray:
    """A bushy tree: node i's parent is (i - 1) // 3 (depth 3 at N = 16)."""
    parents = np.array([-1] + [(i - 1) // 3 for i in range(1, n)], np.int32)
    return np.broadcast_to(parents, (b, n)).copy()


def _inputs(cfg: LlamaConfig, b: int, n: int, context: int, key):
    """Tokens, positions, masks, page table and lengths of a verify window after `context` tokens."""
    pages = -(-(context + n) // PAGE)
    table = (1 + np.arange(b * pages, dtype=np.int32)).reshape(b, pages)  # page 0 is scratch
    lengths = np.full((b,), context, np.int32)
    spec = TreeSpec.from_parents(jnp.asarray(_tree_parents(b, n)))
    rows = jnp.asarray(lengths)[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
    tokens = jax.random.randint(key, (b, n), 0, cfg.vocab_size, jnp.int32)
    return dict(tokens=tokens, positions=spec.load_step(rows), mask=spec.ancestor_mask(),
                page_table=jnp.asarray(table), lengths=jnp.asarray(lengths)), 1 + b * pages


def _pools(cfg: LlamaConfig, num_pages: int, mesh):
    shape = (num_pages * PAGE, cfg.num_kv_heads, cfg.head_dim)
    sharding = parallel.pool_sharding(mesh, shape) if mesh is not None else None
    make = jax.jit(lambda: jnp.zeros(shape, jnp.bfloat16), out_shardings=sharding)
    return {name: make() for kv in kv_buffer_names(cfg.num_layers) for name in kv}


def time_steps(model: LlamaModel, params, pools, inputs, kind: str, mesh, samples: int, inner: int):
    """(median seconds per step, first step's greedy predictions). Pools are donated and threaded."""
    n = inputs["tokens"].shape[1]
    argmax = (lambda lg: jnp.argmax(lg, -1).astype(jnp.int32)) if mesh is None else \
        (lambda lg: parallel.sharded_argmax(lg, mesh))
    keep = (lambda p: p) if mesh is None else \
        (lambda p: {k: jax.lax.with_sharding_constraint(v, parallel.pool_sharding(mesh, v.shape)) for k, v in p.items()})

    def step(params, pools, x):
        if kind == "decode":
            logits, _, pools = model.decode(params, pools, x["tokens"][:, 0], x["page_table"], x["lengths"])
        else:
            logits, _, pools = model.verify(params, pools, x["tokens"], x["positions"], x["mask"],
                                            x["page_table"], x["lengths"])
        return argmax(logits), keep(pools)

    fn = jax.jit(step, donate_argnums=(1,))
    if kind == "decode":
        inputs = dict(inputs, tokens=inputs["tokens"][:, :1])
    first, pools = fn(params, pools, inputs)
    first = np.asarray(first)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 0.3:  # warm the clocks after the compile
        out, pools = fn(params, pools, inputs)
        jax.block_until_ready(out)
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(inner):
            out, pools = fn(params, pools, inputs)
        jax.block_until_ready((out, pools))
        times.append((time.perf_counter() - t0) / inner)
    del pools
    assert first.shape == (inputs["tokens"].shape[0], n if kind == "verify" else 1)
    return statistics.median(times), first


def weight_bytes_per_device(params, tp: int) -> int:
    specs = parallel.param_specs(params, tp)
    total = 0
    for leaf, spec in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))):
        total += leaf.nbytes // (tp if parallel.AXIS in tuple(spec) else 1)
    return total


def bench_latency(layers: int, batches, nodes: int, context: int, samples: int, inner: int, tps=(1, 2)):
    cfg = llama8b(layers)
    t0 = time.perf_counter()
    host = init_params(cfg, jax.random.key(1), dtype="bf16")
    jax.block_until_ready(host)
    print(f"  random bf16 target: {layers} layers, {sum(x.size for x in jax.tree.leaves(host)) / 1e9:.2f} B params "
          f"in {time.perf_counter() - t0:.1f} s", flush=True)
    bandwidth = measure_copy_bandwidth()
    print(f"  copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    results = {}
    firsts = {}
    for tp in tps:
        mesh = parallel.make_mesh(tp) if tp > 1 else None
        base = attention_for(ServeConfig(kv_cache=KVCacheConfig(page_size=PAGE)))
        attention = dataclasses.replace(base, mesh=mesh) if mesh is not None else base
        model = LlamaModel(cfg, attention)
        params = host if mesh is None else jax.device_put(host, parallel.param_shardings(cfg, host, mesh))
        # The copy's rate counts every byte moved (read + write), the traffic a weight read makes.
        floor = weight_bytes_per_device(host, tp) / bandwidth
        for b in batches:
            x, num_pages = _inputs(cfg, b, nodes, context, jax.random.key(b))
            for kind in ("decode", "verify"):
                t0 = time.perf_counter()
                pools = _pools(cfg, num_pages, mesh)
                sec, first = time_steps(model, params, pools, x, kind, mesh, samples, inner)
                results[(tp, b, kind)] = (sec, floor)
                firsts[(tp, b, kind)] = first
                print(f"  TP={tp} B={b:>2} {kind:<6}: {sec * 1e3:7.3f} ms/step ({sec / floor:.2f}x its weight-read floor "
                      f"{floor * 1e3:.3f} ms; {time.perf_counter() - t0:.0f} s with compile)", flush=True)
        if mesh is not None:
            del params
    return results, firsts


def report(results, firsts, batches, nodes, context, layers) -> list[str]:
    lines = [f"Step latency, Llama-3.1-8B shape ({layers} layers) random bf16, prefix {context}, "
             f"verify N = {nodes}, {jax.devices()[0].device_kind}, jax {jax.__version__}", "",
             "| B | step | TP=1 ms | TP=2 ms | TP2 / TP1 | TP=1 / floor | TP=2 / floor | TP2 argmax = TP1 |",
             "|---|---|---|---|---|---|---|---|"]
    for b in batches:
        for kind in ("decode", "verify"):
            if (2, b, kind) not in results:  # a one-GPU run: TP=1 only
                s1, f1 = results[(1, b, kind)]
                lines.append(f"| {b} | {kind} | {s1 * 1e3:.3f} | - | - | {s1 / f1:.2f} | - | - |")
                continue
            (s1, f1), (s2, f2) = results[(1, b, kind)], results[(2, b, kind)]
            agree = float(np.mean(firsts[(1, b, kind)] == firsts[(2, b, kind)]))
            name = "plain decode" if kind == "decode" else f"tree verify N={nodes}"
            lines.append(f"| {b} | {name} | {s1 * 1e3:.3f} | {s2 * 1e3:.3f} | {s2 / s1:.3f} | {s1 / f1:.2f} | "
                         f"{s2 / f2:.2f} | {agree:.1%} |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--check-layers", type=int, default=2, help="layers of the fp32 same-tokens check (0: skip)")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024, help="committed tokens per request before the step")
    ap.add_argument("--samples", type=int, default=7)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--tp-sizes", default="1,2", help="'1' runs the TP=1 half on one GPU")
    ap.add_argument("--check-dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--markdown", help="append the table to this file")
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.check_layers, args.batches, args.samples = 4, 1, "1", 3
    tps = tuple(int(t) for t in args.tp_sizes.split(","))
    if max(tps) > len(jax.devices()):
        print(f"TP sizes {tps} need {max(tps)} devices, found {jax.devices()}", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    t_start = time.perf_counter()
    ok = True
    if args.check_layers:
        print("1. same tokens, TP=2 against TP=1", flush=True)
        ok = check_tokens(args.check_layers, tps, args.check_dtype)
    print("2. step latency", flush=True)
    results, firsts = bench_latency(args.layers, batches, args.nodes, args.context, args.samples, args.inner, tps)
    lines = report(results, firsts, batches, args.nodes, args.context, args.layers)
    print("\n".join(lines))
    print(f"total {time.perf_counter() - t_start:.0f} s; same tokens: {'yes' if ok else 'NO'}")
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
