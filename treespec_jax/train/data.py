"""Self-distillation data for the EAGLE-3 head: the target's own chat replies, from our engine.

    python -m treespec_jax.train.data --out DATA [--config configs/train/eagle3.toml] [--max-minutes 4]
                                      [--set data.max_requests=8192 ...]

Requests. Request j of the run asks prompt j mod P of the prompt set (P prompts), with the chat
template applied; the first pass over the set decodes a `greedy_fraction` of them greedily and
samples the rest at `temperature`, and later passes (when `max_requests` > P) sample with fresh
seeds, so a prompt never repeats a reply. Every `heldout_every`-th prompt (and all its replies) is
held out of training: its replies give the held-out loss.

Shards. Requests are generated through one `Engine.stream` per run (plain decoding, the gumbel
backend, which samples temperature 0 as argmax), fed shard after shard so the batch stays full,
and each shard of `shard_size` requests is saved as `shard_{k:05d}.npz` once its replies are in:
`tokens` (every sequence's prompt + reply ids, concatenated; uint16 where the vocabulary fits),
`offsets [n + 1]`, `prompt_lens [n]` (the reply span of sequence i is [prompt_lens[i], length)),
`request [n]`, `prompt_index [n]`, `temperature [n]`, `heldout [n]`, `finish [n]` (index into
FINISH). A shard is written to a temporary name and renamed, so it is whole or absent; a run
skips the shards that exist and stops starting new ones at its `--max-minutes` deadline: runs of
a few minutes each add up to the whole set. Shards before `first_shard` are not generated: a run
that goes on from an exported head (`head.init_from`) trains on requests its head has not seen.

Draft vocabulary (`build_vocab`): the Vd target tokens most frequent among the training replies,
in increasing id order, as the published heads lay them out: `d2t[i]` = target id of draft id i
minus i, `t2d` a boolean mask over the target vocabulary.

Batches (`PackedBatches`): whole sequences packed back to back into rows of `seq_len` tokens in
a per-epoch shuffled order keyed by (seed, epoch); the cursor (epoch, index) is the whole state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from treespec_jax.train.config import DataConfig, TrainConfig, load_config, parse_override

FINISH = ("length", "stop", "eos", "refused", "skipped")
SHARD_GLOB = "shard_*.npz"


# ---------------------------------------------------------------------------------------------
# Prompts and the request plan
# ---------------------------------------------------------------------------------------------


def load_prompts(path: str | os.PathLike) -> list[dict]:
    """JSONL records with `messages` (a chat) or `prompt` (text)."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "messages" not in rec and "prompt" not in rec:
                raise ValueError(f"{path}:{n}: a prompt record needs 'messages' or 'prompt'")
            out.append(rec)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def is_heldout(prompt_index: int, cfg: DataConfig) -> bool:
    return prompt_index % cfg.heldout_every == cfg.heldout_every - 1


def plan_request(j: int, num_prompts: int, cfg: DataConfig) -> tuple[int, float, int]:
    """Request j -> (prompt index, temperature, seed)."""
    prompt, rnd = j % num_prompts, j // num_prompts
    u = np.random.default_rng([cfg.seed, j]).random()
    greedy = rnd == 0 and u < cfg.greedy_fraction
    if rnd == 1 and cfg.greedy_second_pass:
        # The prompt's first-pass request is request `prompt`: greedy here where it was sampled there.
        greedy = np.random.default_rng([cfg.seed, prompt]).random() >= cfg.greedy_fraction
    seed = (cfg.seed * 1_000_003 + j) % (2**31 - 1)
    return prompt, 0.0 if greedy else cfg.temperature, seed


def prompt_ids(record: dict, tokenizer) -> list[int]:
    if "messages" in record:
        return list(tokenizer.encode_chat(record["messages"], add_generation_prompt=True))
    return list(tokenizer.encode(record["prompt"]))


# ---------------------------------------------------------------------------------------------
# Generation
# ---------------------------------------------------------------------------------------------


def load_target(target: str, dtype: str):
    """(LlamaConfig, params, Tokenizer) of "default" (the cached SmolLM2 GGUF), a .gguf file or
    an HF directory. Imports the loaders lazily: GGUF reading needs the gguf package."""
    if target == "default":
        from treespec_jax.models.default import ensure_default_gguf

        target = str(ensure_default_gguf())
    path = Path(target)
    if path.suffix == ".gguf":
        from treespec_jax.models.gguf import load_gguf

        return load_gguf(path, dtype)
    from treespec_jax.models.hf import load_target as load_hf
    from treespec_jax.tokenizer import Tokenizer

    cfg, params = load_hf(path, dtype)
    return cfg, params, Tokenizer.from_dir(path)


def make_engine(target_cfg, target_params, tokenizer, cfg: DataConfig):
    """A plain-decoding engine for the data run (keyed Gumbel sampling: greedy at temperature 0)."""
    from treespec_jax.config import (BackendsConfig, KVCacheConfig, ModelConfig, SamplingConfig, SchedulerConfig,
                                     ServeConfig)
    from treespec_jax.engine import Engine

    context = min(cfg.max_prompt_tokens + cfg.max_new_tokens, target_cfg.max_position_embeddings)
    config = ServeConfig(
        model=ModelConfig(dtype=cfg.dtype, context_length=context),
        kv_cache=KVCacheConfig(page_size=cfg.page_size),
        sampling=SamplingConfig(backend="gumbel", temperature=0.0),
        scheduler=SchedulerConfig(max_running_requests=cfg.batch),
        backends=BackendsConfig(attention_backend=cfg.attention_backend),
        seed=cfg.seed,
    )
    return Engine(config, target_cfg, target_params, tokenizer=tokenizer)


def shard_path(out: Path, k: int) -> Path:
    return out / f"shard_{k:05d}.npz"


def shard_rows(tokenizer, prompts: Sequence[dict], cfg: DataConfig, k: int) -> list[tuple[int, int, float, int, list[int]]]:
    """Shard k's requests [k * shard_size, (k+1) * shard_size) ∩ [0, max_requests), each as
    (request j, prompt index, temperature, seed, prompt ids)."""
    lo, hi = k * cfg.shard_size, min((k + 1) * cfg.shard_size, cfg.max_requests)
    rows = []
    for j in range(lo, hi):
        p, temp, seed = plan_request(j, len(prompts), cfg)
        rows.append((j, p, temp, seed, prompt_ids(prompts[p], tokenizer)))
    return rows


def shard_arrays(rows, completions: dict, cfg: DataConfig, vocab: int) -> dict:
    """The shard's arrays from its rows and `completions {j: Completion}` (prompts over
    `max_prompt_tokens` have none: they are kept as prompt-only sequences marked skipped)."""
    seqs, meta = [], []
    for j, p, temp, _, ids in rows:
        c = completions.get(j)
        if c is None:
            seqs.append(np.asarray(ids, np.int64))
            meta.append((j, p, temp, len(ids), FINISH.index("skipped")))
        else:
            seqs.append(np.asarray(ids + list(c.tokens), np.int64))
            meta.append((j, p, temp, len(ids), FINISH.index(c.finish_reason)))
    dtype = np.uint16 if vocab <= 2**16 else np.int32
    lens = np.asarray([len(s) for s in seqs], np.int64)
    return {
        "tokens": np.concatenate(seqs).astype(dtype) if seqs else np.zeros((0,), dtype),
        "offsets": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        "prompt_lens": np.asarray([m[3] for m in meta], np.int32),
        "request": np.asarray([m[0] for m in meta], np.int64),
        "prompt_index": np.asarray([m[1] for m in meta], np.int32),
        "temperature": np.asarray([m[2] for m in meta], np.float32),
        "heldout": np.asarray([is_heldout(m[1], cfg) for m in meta], bool),
        "finish": np.asarray([m[4] for m in meta], np.int8),
    }


def write_shard(path: Path, arrays: dict) -> None:
    tmp = path.with_name(path.stem + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)  # a reader never sees half a shard


def generate(engine, tokenizer, prompts: Sequence[dict], cfg: DataConfig, out: str | os.PathLike,
             max_minutes: float | None = None, log=print) -> dict:
    """Writes the missing shards until all exist or the deadline; returns a summary.

    Every missing shard's requests go through one `Engine.stream`, fed lazily shard after shard,
    so the batch stays full across shard boundaries (decoding shard by shard, each shard's longest
    replies ran on a nearly empty batch). A shard is written once its last reply is in. Near the
    deadline no further shard is fed: one is started only while the time so far, one more shard's
    feeding and the longest reply seen still fit; what was fed runs to the end.
    """
    from treespec_jax.engine import Request

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    todo = [k for k in range(cfg.first_shard, cfg.num_shards) if not shard_path(out, k).exists()]
    fed: list[tuple[int, int]] = []  # stream index -> (shard, request j)
    rows_of: dict[int, list] = {}
    waiting: dict[int, int] = {}  # shard -> replies still to come
    done: dict[int, dict] = {}
    admitted: dict[int, float] = {}  # stream index -> when its first token came
    longest = 0.0  # the longest reply so far, admission to finish (seconds)
    stopped = False
    written, gen_tokens = [], 0

    def finish_shard(k):
        nonlocal gen_tokens
        arrays = shard_arrays(rows_of.pop(k), done.pop(k), cfg, engine.target_cfg.vocab_size)
        write_shard(shard_path(out, k), arrays)
        n_new = int((arrays["offsets"][1:] - arrays["offsets"][:-1]).sum() - arrays["prompt_lens"].sum())
        written.append(k)
        gen_tokens += n_new
        dt = time.perf_counter() - t0
        log(f"shard {k}: {len(arrays['prompt_lens'])} requests, {n_new} reply tokens; "
            f"{gen_tokens} in {dt:.1f} s so far ({gen_tokens / dt:.0f} tok/s)")

    def feed():
        nonlocal stopped
        for n, k in enumerate(todo):
            elapsed = time.perf_counter() - t0
            if max_minutes is not None and n > 0:
                tail = longest if longest > 0 else elapsed
                if elapsed + elapsed / n + tail > 60 * max_minutes:
                    log(f"deadline: {elapsed / 60:.1f} of {max_minutes} min used, shard {k} left for the next run")
                    stopped = True
                    return
            rows = shard_rows(tokenizer, prompts, cfg, k)
            rows_of[k], done[k] = rows, {}
            served = [r for r in rows if len(r[4]) <= cfg.max_prompt_tokens]
            waiting[k] = len(served)
            if not served:
                finish_shard(k)
            for j, _, temp, seed, ids in served:
                fed.append((k, j))
                yield Request(prompt=ids, max_new_tokens=cfg.max_new_tokens, temperature=temp, top_p=cfg.top_p,
                              seed=seed)

    for ev in engine.stream(feed()):
        now = time.perf_counter()
        admitted.setdefault(ev.index, now)
        if ev.finished is None:
            continue
        longest = max(longest, now - admitted.pop(ev.index))
        k, j = fed[ev.index]
        done[k][j] = ev.finished
        waiting[k] -= 1
        if waiting[k] == 0:
            finish_shard(k)
    gen_s = time.perf_counter() - t0
    shards = range(cfg.first_shard, cfg.num_shards)
    present = sum(shard_path(out, k).exists() for k in shards)
    return {"shards_written": len(written), "shards_present": present, "shards_total": len(shards),
            "reply_tokens_written": gen_tokens, "generate_s": gen_s if written else 0.0,
            "tokens_per_s": gen_tokens / gen_s if written else None, "complete": present == len(shards),
            "stopped_at_deadline": stopped}


# ---------------------------------------------------------------------------------------------
# Reading, vocabulary, batches
# ---------------------------------------------------------------------------------------------


class Sequences:
    """The sequences of a data directory: `seqs[i]` int32 ids, `prompt_lens[i]`, `heldout[i]`."""

    def __init__(self, seqs: list[np.ndarray], prompt_lens: np.ndarray, heldout: np.ndarray,
                 temperature: np.ndarray, finish: np.ndarray):
        self.seqs = seqs
        self.prompt_lens = prompt_lens
        self.heldout = heldout
        self.temperature = temperature
        self.finish = finish

    def __len__(self):
        return len(self.seqs)

    def select(self, mask: np.ndarray) -> "Sequences":
        idx = np.flatnonzero(mask)
        return Sequences([self.seqs[i] for i in idx], self.prompt_lens[idx], self.heldout[idx],
                         self.temperature[idx], self.finish[idx])

    def usable(self) -> np.ndarray:
        """Sequences with a reply of at least two tokens (a shorter one has no loss term)."""
        lens = np.asarray([len(s) for s in self.seqs])
        return (lens - self.prompt_lens >= 2) & (self.finish != FINISH.index("skipped")) & (
            self.finish != FINISH.index("refused"))

    def split(self) -> tuple["Sequences", "Sequences"]:
        ok = self.usable()
        return self.select(ok & ~self.heldout), self.select(ok & self.heldout)

    def reply_tokens(self) -> np.ndarray:
        parts = [s[p:] for s, p in zip(self.seqs, self.prompt_lens)]
        return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def read_shards(data_dir: str | os.PathLike) -> Sequences:
    paths = sorted(Path(data_dir).glob(SHARD_GLOB))
    paths = [p for p in paths if not p.name.endswith(".tmp.npz")]
    if not paths:
        raise FileNotFoundError(f"no {SHARD_GLOB} in {data_dir}: run python -m treespec_jax.train.data first")
    seqs, pl, held, temp, fin = [], [], [], [], []
    for p in paths:
        with np.load(p) as z:
            tok, off = z["tokens"].astype(np.int32), z["offsets"]
            seqs += [tok[off[i]:off[i + 1]] for i in range(len(off) - 1)]
            pl.append(z["prompt_lens"])
            held.append(z["heldout"])
            temp.append(z["temperature"])
            fin.append(z["finish"])
    return Sequences(seqs, np.concatenate(pl), np.concatenate(held), np.concatenate(temp), np.concatenate(fin))


def build_vocab(reply_tokens: np.ndarray, vocab_size: int, draft_vocab_size: int) -> dict:
    """The draft vocabulary: the most frequent reply tokens (ties to the lower id), in id order.

    Fewer distinct reply tokens than Vd are topped up with the lowest unused ids. Returns
    draft_ids `[Vd]` (target ids, increasing), d2t `[Vd]` int32, t2d `[V]` bool, counts `[V]` and
    coverage (the share of reply tokens inside the draft vocabulary).
    """
    vd = vocab_size if draft_vocab_size <= 0 or draft_vocab_size >= vocab_size else draft_vocab_size
    counts = token_counts(reply_tokens, vocab_size)
    order = np.lexsort((np.arange(vocab_size), -counts))  # count desc, then id asc
    return vocab_of(order[:vd], counts)


def token_counts(reply_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.bincount(reply_tokens, minlength=vocab_size)[:vocab_size].astype(np.int64)


def vocab_of(draft_ids: np.ndarray, counts: np.ndarray) -> dict:
    """The vocabulary dict of `build_vocab` for given draft ids (a head's own, to go on training
    it), with `counts` `[V]` of the training reply tokens."""
    draft_ids = np.sort(np.asarray(draft_ids)).astype(np.int64)
    vocab_size, vd = len(counts), len(draft_ids)
    t2d = np.zeros(vocab_size, bool)
    t2d[draft_ids] = True
    total = int(counts.sum())
    return {"draft_ids": draft_ids, "d2t": (draft_ids - np.arange(vd)).astype(np.int32), "t2d": t2d,
            "counts": counts, "coverage": float(counts[draft_ids].sum() / total) if total else 0.0}


def coverage_table(reply_tokens: np.ndarray, vocab_size: int, sizes=(2048, 4096, 8192, 16384, 32768)) -> dict:
    counts = np.sort(np.bincount(reply_tokens, minlength=vocab_size))[::-1]
    total = max(int(counts.sum()), 1)
    return {int(s): float(counts[:s].sum() / total) for s in sizes if s <= vocab_size}


class PackedBatches:
    """Rows of `seq_len` tokens packing whole sequences in a shuffled order (see module docstring).

    `shuffle=False` keeps the stored order (held-out batches). `next()` -> numpy batch dict:
    tokens / positions / segments (-1 = padding) int32 and reply bool, all `[rows, seq_len]`.
    """

    def __init__(self, data: Sequences, seq_len: int, rows: int, seed: int = 0, shuffle: bool = True,
                 cursor: tuple[int, int] = (0, 0)):
        if not len(data):
            raise ValueError("no sequences to batch")
        self.data, self.seq_len, self.rows, self.seed, self.shuffle = data, seq_len, rows, seed, shuffle
        self.epoch, self.index = cursor
        self._order = self._epoch_order(self.epoch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.data)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def cursor(self) -> tuple[int, int]:
        return self.epoch, self.index

    def next(self) -> dict:
        T, B = self.seq_len, self.rows
        tokens = np.zeros((B, T), np.int32)
        positions = np.zeros((B, T), np.int32)
        segments = np.full((B, T), -1, np.int32)
        reply = np.zeros((B, T), bool)
        row, fill, seg = 0, 0, 0
        while row < B:
            i = self._order[self.index]
            s = self.data.seqs[i][:T]
            n = len(s)
            if fill + n > T:  # this sequence opens the next row
                row, fill, seg = row + 1, 0, 0
                continue
            tokens[row, fill:fill + n] = s
            positions[row, fill:fill + n] = np.arange(n)
            segments[row, fill:fill + n] = seg
            reply[row, fill + min(int(self.data.prompt_lens[i]), n):fill + n] = True
            fill, seg = fill + n, seg + 1
            self.index += 1
            if self.index == len(self.data):
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
                if not self.shuffle:
                    break  # one pass only: the held-out set is read once, in order
        return {"tokens": tokens, "positions": positions, "segments": segments, "reply": reply}


def heldout_batches(data: Sequences, seq_len: int, rows: int, limit: int) -> list[dict]:
    """Up to `limit` batches covering the held-out sequences once, in order."""
    if not len(data):
        return []
    it = PackedBatches(data, seq_len, rows, shuffle=False)
    out = []
    while len(out) < limit and it.epoch == 0:
        out.append(it.next())
    return out


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def summarize(data_dir: str | os.PathLike, cfg: TrainConfig, vocab_size: int) -> dict:
    seqs = read_shards(data_dir)
    train, held = seqs.split()
    replies = train.reply_tokens()
    lens = np.asarray([len(s) - p for s, p in zip(train.seqs, train.prompt_lens)])
    return {
        "sequences": len(seqs), "train_sequences": len(train), "heldout_sequences": len(held),
        "train_reply_tokens": int(replies.size), "train_tokens": int(sum(len(s) for s in train.seqs)),
        "mean_reply_tokens": float(lens.mean()) if lens.size else 0.0,
        "finish": {FINISH[i]: int((seqs.finish == i).sum()) for i in range(len(FINISH))},
        "greedy_share": float((seqs.temperature == 0).mean()) if len(seqs) else 0.0,
        "coverage_by_vd": coverage_table(replies, vocab_size),
        "configured_vd": cfg.vocab.draft_vocab_size,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate the EAGLE-3 self-distillation shards with the engine.")
    ap.add_argument("--out", required=True, type=Path, help="data directory (shards are added to it)")
    ap.add_argument("--config", type=Path, default=None, help="training TOML (default configs/train/eagle3.toml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    ap.add_argument("--max-minutes", type=float, default=None, help="start no shard that would end past this")
    ap.add_argument("--num-prompts", type=int, default=None, help="shorthand for --set data.max_requests=N")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="shorthand for --set data.max_new_tokens=N")
    args = ap.parse_args(argv)
    overrides = dict(parse_override(s) for s in args.set)
    if args.num_prompts is not None:
        overrides["data.max_requests"] = args.num_prompts
    if args.max_new_tokens is not None:
        overrides["data.max_new_tokens"] = args.max_new_tokens
    cfg = load_config(args.config, overrides)
    t0 = time.perf_counter()
    prompts = load_prompts(cfg.prompts_path())
    target_cfg, params, tokenizer = load_target(cfg.target, cfg.data.dtype)
    engine = make_engine(target_cfg, params, tokenizer, cfg.data)
    log = lambda m: print(f"[data {time.perf_counter() - t0:6.1f}s] {m}", flush=True)
    log(f"target loaded ({target_cfg.num_layers} layers, vocab {target_cfg.vocab_size}); {len(prompts)} prompts")
    budget = None if args.max_minutes is None else args.max_minutes - (time.perf_counter() - t0) / 60
    result = generate(engine, tokenizer, prompts, cfg.data, args.out, budget, log)
    result.update(summarize(args.out, cfg, target_cfg.vocab_size))
    (args.out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
