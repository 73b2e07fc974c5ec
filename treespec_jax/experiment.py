"""`treespec run CONFIG.toml`: one experiment, or a sweep over tree shapes and backends.

The file is a serving config (the `ServeConfig` tables) plus an `[experiment]` table:

    [experiment]
    name = "smollm2-sweep"          # names the outputs
    model = ""                      # target dir / .gguf; "" = the embedded default
    draft_model = ""                # EAGLE-3 head dir; "" = the default head
    prompts = "treespec_jax/data/heldout_prompts.jsonl"   # JSONL requests; "" = built-in prompts
    max_new_tokens = 64             # per request unless the file says otherwise
    limit = 16                      # use the first `limit` requests (0 = all)

    [[experiment.settings]]         # one run per entry; each overrides the config above
    label = "chain"
    algorithm = "EAGLE3"
    topk = 1
    num_steps = 5

A setting may name `algorithm`, `topk`, `num_steps`, `num_draft_tokens` (speculative table) and
`attention_backend` (backends table); `algorithm = "NONE"` is plain decoding. Every setting is
validated before the first one runs, so a bad sweep is refused whole. Writes
`<out>/<name>.json` (one row per setting: accept length, per-position acceptance, tokens/s) and
`<out>/<name>.png` (accept length and tokens/s per setting).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tomllib
from pathlib import Path

from treespec_jax.config import ConfigError, ServeConfig

SETTING_KEYS = {"label", "algorithm", "topk", "num_steps", "num_draft_tokens", "attention_backend"}
EXPERIMENT_KEYS = {"name", "model", "draft_model", "prompts", "max_new_tokens", "limit", "settings"}


def add_run_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("run", help="run an experiment TOML (a sweep over tree shapes); writes JSON + PNG")
    p.add_argument("config", type=Path, help="experiment TOML file")
    p.add_argument("--out", type=Path, default=Path("experiments"), help="output directory")
    return p


def load_experiment(path: Path) -> tuple[ServeConfig, dict, list[tuple[str, ServeConfig]]]:
    """-> (base config, experiment table, [(label, config)]); ConfigError lists every problem."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise ConfigError([f"{path}: {err}"]) from None
    exp = data.pop("experiment", {})
    problems = [f"{path}: [experiment] key {k!r} is not one of {sorted(EXPERIMENT_KEYS)}"
                for k in sorted(set(exp) - EXPERIMENT_KEYS)]
    base = ServeConfig.from_dict(data, source=str(path))
    settings = exp.get("settings") or [{"label": "config"}]
    runs = []
    for i, s in enumerate(settings):
        bad = sorted(set(s) - SETTING_KEYS)
        if bad:
            problems.append(f"{path}: setting {i} keys {bad} are not among {sorted(SETTING_KEYS)}")
            continue
        spec = {k: s[k] for k in ("algorithm", "topk", "num_steps", "num_draft_tokens") if k in s}
        cfg = base.replace(speculative=dataclasses.replace(base.speculative, **spec))
        if "attention_backend" in s:
            cfg = cfg.replace(backends=dataclasses.replace(cfg.backends, attention_backend=s["attention_backend"]))
        label = str(s.get("label", f"K{cfg.speculative.topk}-S{cfg.speculative.steps}"))
        problems += [f"setting {label!r}: {p}" for p in cfg.problems()]
        runs.append((label, cfg))
    if problems:
        raise ConfigError(problems)
    return base, exp, runs


def run_experiment(args) -> int:
    from treespec_jax.cli import EXIT_REFUSED
    from treespec_jax.decode_cli import _requests, _resolve, read_entries
    from treespec_jax.engine import Engine

    try:
        _, exp, runs = load_experiment(args.config)
        entries = read_entries(exp.get("prompts") or None, None)  # before any setting runs
    except (ConfigError, ValueError) as err:
        print(f"treespec run: refused: {err}", file=sys.stderr)
        return EXIT_REFUSED
    name = exp.get("name", args.config.stem)
    ns = argparse.Namespace(model_dir=exp.get("model") or None, draft_dir=exp.get("draft_model") or None,
                            prompt=None, prompts_file=exp.get("prompts") or None,
                            max_new_tokens=exp.get("max_new_tokens", 64), raw=False)
    rows = []
    for label, cfg in runs:
        target, draft, cfg, _ = _resolve(ns, cfg, fill_tree=False)
        if not cfg.speculative.enabled:
            draft = None
        engine = Engine.from_pretrained(target, draft, cfg)
        requests = _requests(entries, ns, engine.tokenizer)
        if exp.get("limit"):
            requests = requests[: int(exp["limit"])]
        engine.compile(requests)  # no compile inside the timed run: settings compare by their steps
        outs = engine.decode(requests)
        run = engine.last_run
        rows.append({"label": label, "algorithm": cfg.speculative.algorithm, "topk": cfg.speculative.topk,
                     "num_steps": cfg.speculative.steps if cfg.speculative.enabled else 0,
                     "num_draft_tokens": cfg.speculative.verify_tokens, **run.to_dict()})
        print(f"{label}: accept {run.mean_accept_length:.2f}, {run.decode_tokens_per_s:.1f} tok/s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps({"experiment": name, "rows": rows}, indent=1))
    plot_rows(rows, args.out / f"{name}.png", name)
    print(f"wrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")
    return 0


def plot_rows(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["label"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(labels, [r["mean_accept_length"] for r in rows])
    a.set_ylabel("mean accept length (tokens / round)")
    b.bar(labels, [r["decode_tokens_per_s"] for r in rows], color="tab:orange")
    b.set_ylabel("decode tokens / s")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
