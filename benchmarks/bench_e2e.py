"""End-to-end speed on the GPU, one process per table (each fits one device call):

    PYTHONPATH=. python benchmarks/bench_e2e.py serve --gguf G --head DIR [--batches 1,8,32,64]
        (a) SmolLM2 + its EAGLE-3 head on the held-out prompts: tokens/s and mean accept length of
            plain, chain (K=1, S=5) and trees (K=4, S=5, N=16; K=8, S=6, N=64), greedy and T=0.8
    PYTHONPATH=. python benchmarks/bench_e2e.py breakdown [--gguf G] --head DIR [--batch 1]
        (b) one round's time by stage: verify, walk, compaction, draft (step 0 + lanes + select),
            the whole jitted step, and the host's share of a served step (no GGUF: random weights)
    PYTHONPATH=. python benchmarks/bench_e2e.py kernels [--gguf G] --head DIR --shapes plain,tree-k4s5n16
        [--batch 1] [--temperatures 0]
        (b') the device kernels of `--steps` served steps, traced: per step the span, the time
            kernels ran (the rest the device idled, waiting for the host or between launches), how
            many, and the `--top` kernels by device time
    PYTHONPATH=. python benchmarks/bench_e2e.py prefill [--batches 1,8,32,64] [--prompt-tokens 160]
        (d) one 256-row prefill chunk of SmolLM2-shaped prompts at batch B: the attention of one layer
            (blocked, reading the prompt's pages, against dense over the whole table) and the
            engine's whole jitted prefill program
    PYTHONPATH=. python benchmarks/bench_e2e.py churn [--batches 1,256] [--temperatures 0,0.8]
        (e) plain decoding as the self-distillation data run serves it (`train.data.make_engine`),
            random SmolLM2-shaped weights: requests of random prompt and reply lengths joining and
            leaving; the served loop's steps, prefill and decode seconds, tok/s, against the jitted
            step alone on full slots; --draws host,device and --min-groups 0,1 compare the step's
            draw picked on the host or on the device, and admission groups; --trace-admission N
            lists the kernels of the N-th admission (the in-flight decode step included)
    PYTHONPATH=. python benchmarks/bench_e2e.py llama8b [--batches 1,8,32,64]
        (c) a Llama-3.1-8B-shaped target with random bf16 weights: plain decode step and tree
            verify at N = 16 and 64 against the floor of the bytes a step reads (every weight but
            the embedding table, whose rows it gathers, and the KV at --context) over the measured
            copy bandwidth; --prefix-kernels auto,triton compares the attention's prefix kernels.
            `ms` is the device time a step of calls launched back to back, as the
            engine launches them (traced); `sync_ms` one call waited on alone, host dispatch
            included. --cuda-graphs auto,xla compares the step's CUDA-graph settings; --profile
            adds each setting's kernels, as the kernels table lists them

Every time is a median of repeated calls after warm-up in the same process; ratios compare
numbers measured in the same run. Results print as JSON (and go to --out/NAME.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

HELDOUT = Path(__file__).resolve().parent.parent / "treespec_jax" / "data" / "heldout_prompts.jsonl"


def _emit(args, row: dict) -> None:
    """Prints a table row as it lands and appends it to OUT/<table>.rows.jsonl: a run killed at
    its time limit keeps every finished row in OUT, whatever became of its stdout."""
    print(json.dumps(row), flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        with open(args.out / f"{args.table}.rows.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")


def _median(fn, reps=20):
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _median_fed_back(fn, carry, reps=20):
    """Median seconds of `carry = fn(carry)`: for a call that donates its input and returns its
    successor (a cache it writes), so every call runs on live buffers."""
    holder = [jax.block_until_ready(fn(carry))]

    def call():
        holder[0] = jax.block_until_ready(fn(holder[0]))

    return _median(call, reps)


def _config(spec, batch, sampler="greedy", temperature=0.0, attention="auto", graphs="auto", prefix="auto",
            dtype="bf16"):
    from treespec_jax.config import (BackendsConfig, KVCacheConfig, ModelConfig, SamplingConfig, SchedulerConfig,
                                     ServeConfig)

    return ServeConfig(model=ModelConfig(dtype=dtype), speculative=spec,
                       kv_cache=KVCacheConfig(page_size=64, max_total_tokens=max(batch, 8) * 2048),
                       scheduler=SchedulerConfig(max_running_requests=batch),
                       sampling=SamplingConfig(backend=sampler, temperature=temperature),
                       backends=BackendsConfig(attention_backend=attention, cuda_graphs=graphs, prefix_kernel=prefix),
                       seed=1)


SHAPE_RE = re.compile(r"(?:plain|chain-s(?P<steps>\d+)|tree-k(?P<k>\d+)s(?P<s>\d+)n(?P<n>\d+))"
                      r"(?:-chain(?P<above>\d+))?")


def shape_spec(name: str) -> dict:
    """`SpeculativeConfig` keywords of a shape named as the tables name it: "plain", "chain-sS" (the
    K=1 chain of S draft steps), "tree-kKsSnN" (K candidates a step, S steps, N nodes verified), any
    of them ending "-chainB" for rounds that switch to the S + 1 chain above B running requests
    (`chain_above_batch`). Any (K, S, N) the engine accepts can be timed without editing a table."""
    m = SHAPE_RE.fullmatch(name)
    if m is None:
        raise ValueError(f"shape {name!r}: expected plain, chain-sS or tree-kKsSnN, optionally ending -chainB")
    if name.startswith("plain"):
        if m["above"]:
            raise ValueError(f"shape {name!r}: plain decoding has no rounds to switch to a chain")
        return dict(algorithm="NONE")
    spec = (dict(algorithm="EAGLE3", topk=1, num_steps=int(m["steps"])) if m["steps"] else
            dict(algorithm="EAGLE3", topk=int(m["k"]), num_steps=int(m["s"]), num_draft_tokens=int(m["n"])))
    if m["above"]:
        spec["chain_above_batch"] = int(m["above"])
    return spec


def _prompts(tok, limit):
    from treespec_jax.decode_cli import BUILTIN_PROMPTS

    if HELDOUT.exists():
        entries = [json.loads(l) for l in HELDOUT.read_text().splitlines() if l.strip()]
    else:
        entries = [{"prompt": p} for p in BUILTIN_PROMPTS]
    out = []
    for e in entries[:limit]:
        msgs = e.get("messages") or [{"role": "user", "content": e["prompt"]}]
        out.append(tok.encode(tok.apply_chat_template(msgs)))
    return out


def serve(args):
    from treespec_jax.config import SpeculativeConfig
    from treespec_jax.engine import Request
    from treespec_jax.engine.loading import load_target

    cfg, params, tok = load_target(args.gguf, args.dtype)
    head = None
    if args.head:
        from treespec_jax.models.hf import load_eagle3

        head = load_eagle3(args.head, args.dtype)
    prompts = _prompts(tok, args.prompts)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for temp in [float(t) for t in args.temperatures.split(",")]:
            for name, graphs in [(n, g) for n in args.shapes.split(",") for g in args.cuda_graphs.split(",")]:
                if SpeculativeConfig(**shape_spec(name)).enabled and head is None:
                    continue
                t0 = time.perf_counter()
                engine = _engine(name, batch, temp, cfg, params, tok, head, graphs, args.dtype)
                # The held-out prompts over and over until the batch fills `--waves` times, so a wide
                # batch's decode is timed over more than one short wave (at T=0 a repeated prompt
                # repeats its reply; seeds differ per request).
                n = max(batch * args.waves, min(len(prompts), args.prompts))
                reqs = [Request(prompt=prompts[i % len(prompts)], max_new_tokens=args.new_tokens, seed=i,
                                temperature=temp) for i in range(n)]
                # Compiles every program the run uses (`Engine.compile`, one at a time on a GPU).
                compile_s = engine.compile(reqs)
                _run_each_prefill_size(engine, reqs)
                engine.decode(reqs[:batch])
                warmup_s = time.perf_counter() - t0  # building and compiling: the seconds a new shape costs
                run, rates = _timed_runs(engine, reqs, args.min_decode_s)
                rows.append({"batch": batch, "temperature": temp, "shape": name,
                             "cuda_graphs": engine_graphs(engine), "mean_accept_length": run.mean_accept_length,
                             "decode_tok_s": run.decode_tokens_per_s, "decode_tok_s_runs": rates,
                             "chain_steps": run.chain_steps,
                             "tok_s": run.tokens_per_s, "per_position": run.per_position_rate[:8], "steps": run.steps,
                             "prefill_s": run.prefill_s, "decode_s": run.decode_s, "wall_s": run.wall_s,
                             "requests": n, "warmup_s": round(warmup_s, 1), "compile_s": round(compile_s, 1)})
                _emit(args, rows[-1])
    return {"table": "serve", "rows": rows}


MIN_TIMED_RUNS, MAX_TIMED_RUNS = 3, 5


def _timed_runs(engine, reqs, min_decode_s: float):
    """Serves `reqs` once, or, when that run's decode took under `min_decode_s`, at least
    MIN_TIMED_RUNS times, an odd count, until the runs' decode time adds up to `min_decode_s` (at
    most MAX_TIMED_RUNS runs; the same seeds give the same tokens each time) -> (the run of median
    decode tok/s, every run's decode tok/s). A wide batch decodes its requests in about a second,
    and the runs of one row differed by up to 13% (H200, b8, RESULTS.md e2e); an odd count keeps
    the median a run's own rate, not the faster of two."""
    def run():
        engine.decode(reqs)
        runs.append(engine.last_run)

    runs = []
    run()
    if runs[0].decode_s < min_decode_s:
        while (len(runs) < MIN_TIMED_RUNS or len(runs) % 2 == 0
               or (sum(r.decode_s for r in runs) < min_decode_s and len(runs) < MAX_TIMED_RUNS)):
            run()
    ordered = sorted(runs, key=lambda r: r.decode_tokens_per_s)
    return ordered[len(ordered) // 2], [round(r.decode_tokens_per_s, 1) for r in runs]


# SmolLM2-135M's shapes: tables that time programs run on random weights when no GGUF is staged.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                     num_kv_heads=3, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                     max_position_embeddings=8192)


def _random_smollm2():
    """A SmolLM2-135M-shaped target with random bf16 weights: (config, params)."""
    from treespec_jax.models.config import LlamaConfig
    from treespec_jax.models.llama import init_params

    cfg = LlamaConfig(**SMOLLM2_SHAPE)
    # Eager, one small program per weight shape: jitted whole, the ~280 draws made one program
    # that XLA's GPU compiler took minutes over on the H100 (2026-12-06).
    t0 = time.perf_counter()
    params = jax.block_until_ready(init_params(cfg, jax.random.key(0), "bf16"))
    print(f"random SmolLM2-shaped weights in {time.perf_counter() - t0:.1f} s", flush=True)
    return cfg, params


def _target_and_prompts(args, count):
    """The target (the GGUF, else random SmolLM2-shaped weights: stage and kernel times do not
    depend on the weights), `count` prompts and `--head` loaded (or None):
    (cfg, params, tokenizer, prompts, head)."""
    from treespec_jax.engine.loading import load_target
    from treespec_jax.models.hf import load_eagle3

    head = load_eagle3(args.head, "bf16") if args.head else None
    if args.gguf:
        cfg, params, tok = load_target(args.gguf, "bf16")
        return cfg, params, tok, _prompts(tok, count), head
    cfg, params = _random_smollm2()
    prompts = [np.random.default_rng(i).integers(0, cfg.vocab_size, args.prompt_tokens).tolist() for i in range(count)]
    return cfg, params, None, prompts, head


def _engine(shape, batch, temperature, cfg, params, tok, head, graphs="auto", dtype="bf16"):
    """An engine of `shape` (`shape_spec`) at `batch` slots for requests at `temperature` (the gumbel
    backend above 0); `head`: a loaded EAGLE-3 head (`models.hf.load_eagle3`), used when the shape
    drafts."""
    from treespec_jax.config import SpeculativeConfig
    from treespec_jax.drafter.eagle3 import Eagle3Drafter
    from treespec_jax.engine import Engine
    from treespec_jax.engine.loading import attention_for

    spec = SpeculativeConfig(**shape_spec(shape))
    config = _config(spec, batch, "gumbel" if temperature > 0 else "greedy", temperature, graphs=graphs, dtype=dtype)
    drafter = dparams = None
    if spec.enabled:
        drafter, dparams = Eagle3Drafter(head[0], cfg, attention_for(config)), {**head[1], "embed": params["embed"]}
    return Engine(config, cfg, params, drafter, dparams, tok)


def _filled_engine(args, shape, cfg, params, tok, prompts, head, temperature=0.0, graphs="auto"):
    """`_engine` at `args.batch` slots, every slot decoding a request that does not end while it is
    measured (at `temperature`), and the unfinished stream serving them: (engine, stream)."""
    from treespec_jax.engine import Request

    engine = _engine(shape, args.batch, temperature, cfg, params, tok, head, graphs)
    # 1,024 new tokens outlast the measured steps, and every request's pages fit the KV budget
    # (`_config`: 2,048 tokens a slot), so all `batch` slots decode.
    reqs = [Request(prompt=prompts[i % len(prompts)], max_new_tokens=1024, ignore_eos=True, temperature=temperature)
            for i in range(args.batch)]
    stream = engine.stream(reqs)
    _serve_steps(engine, stream, 3)
    return engine, stream


def engine_graphs(engine) -> str:
    """The engine's decode-step CUDA-graph setting, "auto" resolved (`engine.compile_options`)."""
    from treespec_jax.engine.compile_options import step_graphs

    return step_graphs(engine.config)


def _run_each_prefill_size(engine, reqs) -> None:
    """Serves the first k of `reqs` for 2 tokens at each prefill row count k the engine can launch
    (requests admitted together prefill together): what compiles only when it first runs (the
    host's small eager ops) then runs before anything is timed."""
    for rows in engine.prefill_row_counts():
        engine.decode([dataclasses.replace(r, max_new_tokens=2) for r in reqs[:rows]])


def run_header() -> dict:
    """What identifies a table's run: the minute, the device, JAX and the XLA_FLAGS it ran under
    (they change what XLA builds, e.g. no Triton GEMMs)."""
    return {"date": time.strftime("%Y-%m-%d %H:%M"), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _serve_steps(engine, stream, steps: int) -> float:
    """Serves `steps` more steps of `stream` (an `Engine.stream` left unfinished), the host's work
    included; returns the seconds a step took. Steps are counted at their launch: one step yields
    an event per running request, so events do not count steps."""
    launched = [0]
    step = engine._step

    def counting_step(*a, **kw):
        launched[0] += 1
        return step(*a, **kw)

    engine._step = counting_step
    try:
        t0 = time.perf_counter()
        while launched[0] < steps:
            next(stream)
        return (time.perf_counter() - t0) / steps
    finally:
        engine._step = step


def breakdown(args):
    cfg, params, tok, prompts, head = _target_and_prompts(args, args.batch)
    engine, stream = _filled_engine(args, args.shape, cfg, params, tok, prompts, head)
    rnd, p = engine.round, engine.params
    state = engine.state

    # Every stage that writes a cache donates it and is fed its own output back, as the served step
    # does; without donation each call would also copy the whole pool, and time that copy.
    copy = lambda tree: jax.tree.map(jnp.copy, tree)  # noqa: E731

    verify = jax.jit(lambda params, pools, state: rnd.verify_stage(params, state.replace(target_pools=pools)),
                     donate_argnums=(1,))
    spec_, logits, features, positions, pools = verify(p, copy(state.target_pools), state)
    walk = jax.jit(lambda logits, state: rnd.walk_stage(spec_, logits, state))
    path = walk(logits, state)
    compact = jax.jit(lambda pools, features, state: rnd.compact_stage(spec_, path, pools, features, positions, state),
                      donate_argnums=(0,))

    def draft_fn(params, draft_pools, state, features):
        _, _, roots = rnd.commit_stage(path, state)
        return rnd.draft_stage(params, state.replace(draft_pools=draft_pools), path, features, roots)

    draft = jax.jit(draft_fn, donate_argnums=(1,))
    step = jax.jit(rnd.step, donate_argnums=(1,))
    t = {
        "verify": _median_fed_back(lambda pools: verify(p, pools, state)[4], copy(state.target_pools)),
        "walk": _median(lambda: jax.block_until_ready(walk(logits, state))),
        "compaction": _median_fed_back(lambda pools: compact(pools, features, state)[0], pools),
        "draft": _median_fed_back(lambda dpools: draft(p, dpools, state, features)[0], copy(state.draft_pools)),
        "step": _median_fed_back(lambda st: step(p, st)[0], copy(state)),
    }
    _serve_steps(engine, stream, 5)
    t["served_step"] = _serve_steps(engine, stream, 20)
    t["host"] = t["served_step"] - t["step"]
    return {"table": "breakdown", "batch": args.batch, "shape": args.shape, "seconds": t}


def _kernel_summary(launch, calls: int, top: int, finish) -> dict:
    """The device kernels of `calls` calls of `launch()`, back to back, then `finish()` (which waits
    for the device), traced: per call the span from the first kernel's start to the last one's end,
    the time kernels ran (the rest the device idled: waiting for the host, or between launches),
    how many ran, and the `top` kernels by device time."""
    import tempfile
    from collections import defaultdict

    from benchmarks.timing import device_events

    trace = tempfile.mkdtemp(prefix="treespec_trace")
    with jax.profiler.trace(trace):
        for _ in range(calls):
            launch()
        finish()
    events = device_events(trace)
    if not events:
        raise RuntimeError(f"the profiler recorded no device kernels on {jax.default_backend()}")
    by_name = defaultdict(lambda: [0, 0.0])
    for name, _, dur in events:
        by_name[name][0] += 1
        by_name[name][1] += dur
    span = max(s + d for _, s, d in events) - min(s for _, s, _ in events)
    busy = sum(d for _, _, d in events)
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"traced_span_ms": span / calls / 1e6, "kernel_busy_ms": busy / calls / 1e6,
            "device_idle_share": 1 - busy / span, "kernels_per_call": len(events) / calls,
            "distinct_kernels": len(by_name),
            "top": [{"name": name[:120], "per_call": c / calls, "us_per_call": d / calls / 1e3}
                    for name, (c, d) in ranked]}


def kernels(args):
    """Where a step's device time goes, traced two ways: `--steps` steps as the engine serves them
    (its host work overlapping the device), and the jitted step alone, launched back to back with
    its state fed back (the device's idle share there is inside the program)."""
    from treespec_jax.sampling.keyed import draw_for

    cfg, params, tok, prompts, head = _target_and_prompts(args, args.batch)
    rows = []
    settings = [(s, float(t), g) for s in args.shapes.split(",") for t in args.temperatures.split(",")
                for g in args.cuda_graphs.split(",")]
    for shape, temp, graphs in settings:
        engine, stream = _filled_engine(args, shape, cfg, params, tok, prompts, head, temp, graphs)
        _serve_steps(engine, stream, 10)
        served_s = _serve_steps(engine, stream, args.steps)
        served = _kernel_summary(lambda: _serve_steps(engine, stream, 1), args.steps, args.top,
                                 lambda: jax.block_until_ready(engine.state))
        holder = [jax.tree.map(jnp.copy, engine.state)]
        draw = draw_for([temp], [0], [1.0], cfg.vocab_size) if temp > 0 else "auto"  # as the engine picks it

        def launch():
            holder[0] = engine._step(engine.params, holder[0], draw=draw)[0]

        launch()
        jax.block_until_ready(holder[0])
        if args.out and args.hlo:  # the compiled step, to map the kernels' fusion names to its ops
            args.out.mkdir(parents=True, exist_ok=True)
            text = engine._step.lower(engine.params, holder[0], draw=draw).compile().as_text()
            (args.out / f"kernels_{shape}_t{temp:g}_b{args.batch}_{graphs}.hlo.txt").write_text(text)
        alone = _kernel_summary(launch, args.steps, args.top, lambda: jax.block_until_ready(holder[0]))
        rows.append({"shape": shape, "batch": args.batch, "temperature": temp, "cuda_graphs": engine_graphs(engine),
                     "steps": args.steps, "served_step_ms": served_s * 1e3, "served": served, "jitted_alone": alone})
        _emit(args, rows[-1])
    return {"table": "kernels", "rows": rows}


def _random_llama(cfg, key, fused: bool) -> dict:
    """Random bf16 weights of `cfg` (`init_params`, scale 0.5), made a layer at a time by one jitted
    program: made whole in one program of some 300 random draws, the 8B-shaped model took 166 s
    on the H100. `fused`: the layout the engine serves (`fuse_layer`);
    else the loaders' separate projections."""
    from treespec_jax.models.llama import fuse_layer, init_params

    one = dataclasses.replace(cfg, num_layers=1)

    def layer(k):
        made = init_params(one, k, "bf16", scale=0.5)["layers_0"]
        return fuse_layer(made, cfg) if fused else made

    params = jax.jit(lambda k: {n: v for n, v in init_params(one, k, "bf16", scale=0.5).items()
                                if n != "layers_0"})(jax.random.fold_in(key, cfg.num_layers))
    make_layer = jax.jit(layer)
    for i in range(cfg.num_layers):
        params[f"layers_{i}"] = make_layer(jax.random.fold_in(key, i))
    return jax.block_until_ready(params)


def llama8b(args):
    from benchmarks.timing import measure_copy_bandwidth
    from treespec_jax.engine.loading import attention_for
    from treespec_jax.models.config import LlamaConfig
    from treespec_jax.models.llama import LlamaModel, kv_buffer_names
    from treespec_jax.tree.masks import ancestor_mask, chain_parents

    cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=5e5, max_position_embeddings=8192)
    t0 = time.perf_counter()
    params = _random_llama(cfg, jax.random.key(0), fused=not args.separate)
    print(f"llama8b: random weights made in {time.perf_counter() - t0:.1f} s", flush=True)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    bw = measure_copy_bandwidth()
    context = args.context

    def floor_s(batch: int, n: int) -> float:
        """The bytes a step must read over the copy bandwidth: every weight but the embedding
        table, of which it gathers only its B x N rows (the lm_head is its own weight), and each
        request's keys and values at `context`."""
        row = params["embed"].dtype.itemsize * cfg.hidden_size
        kv = context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 keys and values
        return (weight_bytes - params["embed"].size * params["embed"].dtype.itemsize + batch * n * row
                + batch * kv) / bw
    from treespec_jax.config import SpeculativeConfig

    # The attention cascade's prefix kernel (`backends.prefix_kernel`): at batch 1 a plain step's
    # few query rows are padded to a Mosaic tile, so the choice may differ from the verify's. The
    # norm and RoPE kernels (`backends.norm_kernel`, `rope_kernel`): a few-row step's norms, rotations
    # and K/V writes are launches more than bytes.
    models = {(p, nk, rk): LlamaModel(cfg, attention_for(_config(SpeculativeConfig(), 1, prefix=p)), norm_kernel=nk,
                                      rope_kernel=rk)
              for p in args.prefix_kernels.split(",") for nk in args.norm_kernels.split(",")
              for rk in args.rope_kernels.split(",")}
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        pages = -(-(context + 128) // 64)
        num_pages = batch * pages + 1
        pools = {n: jnp.zeros((num_pages * 64, 8, 128), jnp.bfloat16) for kv in kv_buffer_names(32) for n in kv}
        table = jnp.asarray(1 + np.arange(batch * pages, dtype=np.int32).reshape(batch, pages))
        lengths = jnp.full((batch,), context, jnp.int32)
        for n in [int(x) for x in args.nodes.split(",")]:
            tokens = jnp.zeros((batch, n), jnp.int32)
            parents = chain_parents(batch, n) if n == 1 else jnp.asarray(
                np.concatenate([[-1], np.arange(n - 1) // 3]).astype(np.int32)[None].repeat(batch, 0))
            mask = ancestor_mask(parents)
            positions = lengths[:, None] + jnp.arange(n)[None]
            for (prefix, norm, rope), model in models.items():
                for graphs in args.cuda_graphs.split(","):
                    pools = _time_verify(args, rows, model, params, pools, (tokens, positions, mask, table, lengths),
                                         batch, n, graphs, floor_s(batch, n), prefix, norm, rope)
        def setting_of(r):
            return r["cuda_graphs"], r["prefix_kernel"], r["norm_kernel"], r["rope_kernel"]

        plain = {setting_of(x): x for x in rows if x["batch"] == batch and x["nodes"] == 1}
        for r in rows:
            setting = setting_of(r)
            if r["batch"] == batch and r["nodes"] > 1 and setting in plain:
                r["x_plain"] = r["ms"] / plain[setting]["ms"]
        del pools
    return {"table": "llama8b", "layout": "separate" if args.separate else "fused", "weight_bytes": weight_bytes,
            "copy_bw": bw, "context": context, "rows": rows}


def _time_verify(args, rows, model, params, pools, inputs, batch, n, graphs, floor, prefix, norm, rope):
    """Times `model.verify` of `n` nodes a request compiled under the CUDA-graph setting `graphs`
    as the engine resolves it (`engine.compile_options`: n = 1 is the plain step, n > 1 a
    speculative round's verify), appends its row and returns the pools it was handed back.
    `prefix`, `norm`, `rope`: the prefix, norm and RoPE kernels `model` runs (`backends.prefix_kernel`,
    `norm_kernel`, `rope_kernel`), for the row."""
    from treespec_jax.config import SpeculativeConfig
    from treespec_jax.engine.compile_options import step_compiler_options, step_graphs

    config = _config(SpeculativeConfig(**shape_spec("plain" if n == 1 else "tree-k4s5n16")), batch, graphs=graphs)
    resolved = step_graphs(config)
    fn = jax.jit(model.verify, donate_argnums=(1,), compiler_options=step_compiler_options(config))
    holder = {"pools": pools}
    if args.out and args.hlo:  # the compiled program, to count its kernels
        args.out.mkdir(parents=True, exist_ok=True)
        text = fn.lower(params, pools, *inputs).compile().as_text()
        (args.out / f"llama8b_b{batch}_n{n}_{resolved}_{prefix}_{norm}_{rope}.hlo.txt").write_text(text)

    def launch():
        holder["pools"] = fn(params, holder["pools"], *inputs)[2]

    def finish():
        jax.block_until_ready(holder["pools"]["k0"])

    def call():
        launch()
        finish()

    t0 = time.perf_counter()
    call()  # compiles: its seconds say where a long run's time goes
    first_s = time.perf_counter() - t0
    sync_s = _median(call, reps=10)
    # The step as the engine runs it: launched while the one before still runs, so the host's
    # dispatch (a few hundred arrays) overlaps the device. Traced over back-to-back calls.
    traced = _kernel_summary(launch, 10, args.top if args.profile else 0, finish)
    ms = traced["traced_span_ms"]
    rows.append({"batch": batch, "nodes": n, "cuda_graphs": graphs, "resolved": resolved, "prefix_kernel": prefix,
                 "norm_kernel": norm, "rope_kernel": rope, "ms": ms, "floor_ms": floor * 1e3,
                 "x_floor": ms / (floor * 1e3), "sync_ms": sync_s * 1e3, "first_call_s": round(first_s, 1)})
    if args.profile:
        rows[-1]["kernels"] = traced
    _emit(args, rows[-1])
    return holder["pools"]


def prefill(args):
    from treespec_jax.config import SpeculativeConfig
    from treespec_jax.engine import Engine
    from treespec_jax.models.attention import prefill_attention, prefill_attention_reference, prefill_batch

    cfg, params = _random_smollm2()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        engine = Engine(_config(SpeculativeConfig(algorithm="NONE"), batch), cfg, params, None, None, None)
        chunk, page, width = engine.chunk, engine.page_size, engine.table_width
        lengths = np.full((batch,), min(args.prompt_tokens, chunk), np.int32)
        per_row = -(-chunk // page)
        table = np.zeros((batch, width), np.int32)
        table[:, :per_row] = 1 + np.arange(batch * per_row).reshape(batch, per_row)
        table, start, valid = jnp.asarray(table), jnp.zeros((batch,), jnp.int32), jnp.asarray(lengths)
        attn = prefill_batch(table, start, valid, chunk, page)
        slots = (1 + batch * per_row) * page
        rng = np.random.default_rng(0)
        hkv, d = cfg.num_kv_heads, cfg.head_dim
        k_pool, v_pool = (jnp.asarray(rng.standard_normal((slots, hkv, d)), jnp.bfloat16) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((batch, chunk, cfg.num_heads, d)), jnp.bfloat16)
        blocked = jax.jit(lambda q, k, v, a: prefill_attention(q, k, v, a, page, d ** -0.5))

        dense = jax.jit(lambda q, k, v, a: prefill_attention_reference(q, k, v, a, page, d ** -0.5))
        # Each time prints as it lands, and the dense baseline takes few calls: on the GPU a call of
        # it can take seconds, and a step killed at its limit should still leave the others.
        t0 = time.perf_counter()
        blocked = blocked.lower(q, k_pool, v_pool, attn).compile()
        print(f"batch {batch}: blocked attention compiled in {time.perf_counter() - t0:.1f} s", flush=True)
        t_blocked = _median(lambda: jax.block_until_ready(blocked(q, k_pool, v_pool, attn)), reps=10)
        print(f"batch {batch}: blocked attention {t_blocked * 1e3:.3f} ms", flush=True)
        toks = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, chunk)), jnp.int32)
        t_program = _median_fed_back(
            lambda state: engine._prefill(engine.params, state, toks, table, start, valid)[0], engine.state, reps=5)
        print(f"batch {batch}: prefill program {t_program * 1e3:.3f} ms", flush=True)
        t_dense = _median(lambda: jax.block_until_ready(dense(q, k_pool, v_pool, attn)), reps=3)
        rows.append({"batch": batch, "chunk": chunk, "table_keys": width * page, "prompt_tokens": int(lengths[0]),
                     "attention_blocked_ms": t_blocked * 1e3, "attention_dense_ms": t_dense * 1e3,
                     "dense_over_blocked": t_dense / t_blocked, "program_ms": t_program * 1e3})
        _emit(args, rows[-1])
    return {"table": "prefill", "rows": rows}


def churn(args):
    from treespec_jax.engine import Request
    from treespec_jax.sampling.keyed import draw_for
    from treespec_jax.train.config import DataConfig
    from treespec_jax.train.data import make_engine

    cfg, params = _random_smollm2()
    rows = []
    settings = [(int(b), float(t), d, int(g)) for b in args.batches.split(",") for t in args.temperatures.split(",")
                for d in args.draws.split(",") for g in args.min_groups.split(",")]
    for batch, temp, draws, min_group in settings:
        data_cfg = DataConfig(batch=batch, max_new_tokens=args.new_tokens)
        engine = make_engine(cfg, params, None, data_cfg)
        engine.min_prefill_group = min_group or engine.min_prefill_group
        if draws == "device":  # the baseline: every step decides its draw with a device-side branch
            engine._draw_of = lambda runs: "auto"
        rng = np.random.default_rng(0)
        n = args.prompts if args.prompts > 0 else max(8, 2 * batch)
        # Reply lengths spread as chat replies do: most short, a tail at the cap.
        reqs = [Request(prompt=rng.integers(0, cfg.vocab_size, int(rng.integers(40, 300))).tolist(),
                        max_new_tokens=int(min(args.new_tokens, 8 + rng.exponential(args.new_tokens / 2))),
                        ignore_eos=True, seed=i, temperature=temp) for i in range(n)]
        t0 = time.perf_counter()
        _run_each_prefill_size(engine, reqs)
        compile_s = time.perf_counter() - t0
        groups, traced = [], {}
        start = engine._start

        def admit(group, stats):
            groups.append(len(group))
            if len(groups) != args.trace_admission:
                return start(group, stats)
            # This admission's kernels, the decode step still in flight when it began included.
            traced.update(group=len(group), **_kernel_summary(lambda: start(group, stats), 1, args.top,
                                                               lambda: jax.block_until_ready(engine.state)))

        engine._start = admit
        engine.decode(reqs)
        engine._start = start
        run = engine.last_run
        # The jitted step alone, every slot decoding (the stream is left unfinished).
        stream = engine.stream([dataclasses.replace(r, max_new_tokens=args.new_tokens) for r in reqs[:batch]])
        for _ in range(batch + 3):
            next(stream)
        draw = "auto" if draws == "device" else draw_for([temp], [0], [1.0], cfg.vocab_size)  # as the run's steps
        t_step = _median_fed_back(lambda st: engine._step(engine.params, st, draw=draw)[0],
                                  jax.tree.map(jnp.copy, engine.state))
        rows.append({"batch": batch, "temperature": temp, "draws": draws, "min_prefill_group": engine.min_prefill_group,
                     "requests": n, "compile_s": compile_s,
                     "generated_tokens": run.generated_tokens, "steps": run.steps,
                     "prefill_groups": len(groups), "mean_group": float(np.mean(groups)),
                     "prefill_s": run.prefill_s, "decode_s": run.decode_s, "wall_s": run.wall_s,
                     "tok_s": run.tokens_per_s, "served_step_ms": run.decode_s / max(run.steps, 1) * 1e3,
                     "jitted_step_ms": t_step * 1e3})
        if traced:
            rows[-1]["admission_trace"] = traced
        _emit(args, rows[-1])
    return {"table": "churn", "rows": rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("table", choices=["serve", "breakdown", "kernels", "prefill", "llama8b", "churn"])
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--head", type=Path)
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--shape", default="tree-k4s5n16")
    ap.add_argument("--nodes", default="1,16,64", help="llama8b: verify widths (1 = the plain decode step)")
    ap.add_argument("--hlo", action="store_true", help="llama8b, kernels: write each compiled program's HLO into --out")
    ap.add_argument("--shapes", default="plain,chain-s5,tree-k4s5n16,tree-k8s6n64")
    ap.add_argument("--temperatures", default="0,0.8")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--waves", type=int, default=4,
                    help="serve: at least this many batches' worth of requests (prompts repeated)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                    help="serve: the target's and the head's dtype (fp32: the accept lengths' numerics "
                         "reference)")
    ap.add_argument("--min-decode-s", type=float, default=3.0,
                    help="serve: a row whose run decodes for less than this runs 3 to 5 times (an odd count) until "
                         "their decode time adds up to this; the median run is reported")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-tokens", type=int, default=160,
                    help="prefill, and breakdown without a GGUF: prompt tokens of each request")
    ap.add_argument("--draws", default="host,device",
                    help="churn: who picks a step's sampling computation (host: the engine; device: lax.cond)")
    ap.add_argument("--min-groups", default="0",
                    help="churn: scheduler.min_prefill_group values to compare (0 = the engine's default)")
    ap.add_argument("--steps", type=int, default=20, help="kernels: served steps traced")
    ap.add_argument("--top", type=int, default=25, help="kernels, llama8b --profile: the kernels listed, by device time")
    ap.add_argument("--prefix-kernels", default="auto",
                    help="llama8b: the attention cascade's prefix kernels to compare, e.g. auto,triton "
                         "(backends.prefix_kernel)")
    ap.add_argument("--norm-kernels", default="auto",
                    help="llama8b: the RMSNorm kernels to compare, e.g. auto,xla (backends.norm_kernel)")
    ap.add_argument("--rope-kernels", default="auto",
                    help="llama8b: the RoPE + K/V write kernels to compare, e.g. xla,auto (backends.rope_kernel)")
    ap.add_argument("--profile", action="store_true",
                    help="llama8b: list each setting's kernels in its row (every row's time is traced)")
    ap.add_argument("--cuda-graphs", default="auto",
                    help="serve, kernels, llama8b: the decode step's CUDA-graph settings to compare, e.g. auto,xla "
                         "(treespec_jax.engine.compile_options; llama8b resolves auto as the engine does)")
    ap.add_argument("--separate", action="store_true",
                    help="llama8b: separate q/k/v and gate/up weights (the loaders' layout), not the served fused one")
    ap.add_argument("--trace-admission", type=int, default=0,
                    help="churn: trace the kernels of the N-th admission group (0: none)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    # Every bad shape at once, before any model loads or compiles: a name that does not parse, or
    # one the engine's own rules refuse (e.g. N past what K and S can draft).
    from treespec_jax.config import ServeConfig, SpeculativeConfig

    bad = []
    for name in dict.fromkeys(args.shapes.split(",") + [args.shape]):
        try:
            spec = SpeculativeConfig(**shape_spec(name))
        except ValueError as e:
            bad.append(str(e))
            continue
        bad += [f"shape {name!r}: {p}" for p in ServeConfig(speculative=spec).problems()]
    if bad:
        ap.error("; ".join(bad))
    tables = {"serve": serve, "breakdown": breakdown, "kernels": kernels, "prefill": prefill, "llama8b": llama8b,
              "churn": churn}
    doc = tables[args.table](args)
    doc.update(run_header())
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{args.table}.json").write_text(text)


if __name__ == "__main__":
    main()
