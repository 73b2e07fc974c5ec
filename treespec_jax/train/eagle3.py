"""Training an EAGLE-3 draft head on the frozen target, in resumable runs, and its export.

    python -m treespec_jax.train.eagle3 train  --data DATA --run RUN [--max-minutes 9] [--export] [--set k=v]
    python -m treespec_jax.train.eagle3 export --run RUN [--out RUN/head] [--data DATA]

Per step, on a batch of packed rows (`data.PackedBatches`): the target (`forward.target_forward`,
no gradient) gives the three feature layers' inputs and its logits; the soft targets are its
softmax over the draft vocabulary, renormalised; the head runs the unrolled training-time test
(`forward.ttt_loss`: `ttt_steps` steps, weights `ttt_decay ** i`, reply tokens only) and AdamW
(optax: global-norm clip, linear warmup then cosine decay to `lr * min_lr_ratio`, decoupled
weight decay on matrices) updates fp32 master weights. The head computes in `compute_dtype`
(bf16 by default, as it is served); its state is small (about 10M parameters: weights and both
Adam moments are 120 MB in fp32), so fp32 masters cost nothing, while bf16 weights would stop
moving late in the cosine: an Adam update there is about 1e-3 of a weight, under bf16's 2^-8
resolution.

Initialisation: lm_head is the target's (tied) embedding rows of the draft vocabulary and the
head's final norm the target's final norm, so step 0 starts by reading its hidden state as the
target's last layer would be read; fc and the decoder layer are random, the input norms ones.
With `head.init_from` a new run starts instead from an exported head's weights (bf16, cast to
fp32 masters), so training on fresh data goes on improving it. It keeps the start head's draft
vocabulary, or with `head.init_vocab = "data"` draws a new one from its replies: a token both
vocabularies hold keeps its lm_head column, a new one starts from its target row taken through the
linear map the head's trained columns have made of theirs (`carry_lm_head`).

A run directory holds `config.json` (the config of its first run), `vocab.npz` (the draft
vocabulary, fixed for the run's life), `loss.csv` (one row per `log_every` steps), `eval.csv`
and `ckpt_{step:07d}/` (params, optimiser state, step, data cursor; the only randomness is the
epoch shuffle keyed by (seed, epoch), so seed and cursor are the whole RNG state). A run resumes
from its newest checkpoint, stops before `--max-minutes` with a checkpoint, and at `train.steps`
(or with `--export` / `export`) writes `head/` in the published EAGLE-3 HF layout (bf16
config.json + model.safetensors, via `models.hf.save_eagle3`), `loss.png` and `metrics.json`
with the held-out loss of the exported weights.

Only jax, optax, numpy and safetensors are imported up front; reading the GGUF target needs the
gguf package, imported when the target is loaded.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treespec_jax.models.config import Eagle3Config, LlamaConfig
from treespec_jax.train import data as data_mod
from treespec_jax.train.config import TrainConfig, load_config, parse_override
from treespec_jax.train.forward import HEAD_PARAM_KEYS, target_forward, target_logits, ttt_loss

MAX_HEAD_BYTES = 32 * 2**20
COMPUTE = {"bf16": jnp.bfloat16, "fp32": jnp.float32}


# ---------------------------------------------------------------------------------------------
# Head config, initialisation, optimiser
# ---------------------------------------------------------------------------------------------


def head_config(target_cfg: LlamaConfig, cfg: TrainConfig, draft_vocab_size: int) -> Eagle3Config:
    h = cfg.head
    return Eagle3Config(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=h.intermediate_size or target_cfg.intermediate_size,
        num_heads=h.num_heads or target_cfg.num_heads,
        num_kv_heads=h.num_kv_heads or target_cfg.num_kv_heads,
        head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_cfg.hidden_size,
        rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling,
        rms_norm_eps=target_cfg.rms_norm_eps,
        max_position_embeddings=target_cfg.max_position_embeddings,
    )


def init_head(target_params: dict, target_cfg: LlamaConfig, hc: Eagle3Config, draft_ids: np.ndarray,
              key: jax.Array) -> dict:
    """fp32 head params (module docstring): lm_head and norm from the target, the rest fresh."""
    lc = hc.as_layer_config()
    H, F = hc.hidden_size, hc.intermediate_size
    keys = iter(jax.random.split(key, 8))
    mat = lambda shape: jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])
    ones = lambda n: jnp.ones((n,), jnp.float32)
    lm_head = target_lm_head(target_params, target_cfg, draft_ids)
    return {
        "fc": mat((3 * hc.target_hidden_size, H)), "input_norm": ones(H), "hidden_norm": ones(H),
        "layer": {"wq": mat((2 * H, lc.q_width)), "wk": mat((2 * H, lc.kv_width)), "wv": mat((2 * H, lc.kv_width)),
                  "wo": mat((lc.q_width, H)), "mlp_norm": ones(H), "w_gate": mat((H, F)), "w_up": mat((H, F)),
                  "w_down": mat((F, H))},
        "norm": jnp.array(target_params["norm"], jnp.float32, copy=True),  # a buffer of its own: params are donated
        "lm_head": lm_head,
    }


def target_lm_head(target_params: dict, target_cfg: LlamaConfig, ids: np.ndarray) -> jax.Array:
    """`[H, len(ids)]` fp32: the target's output projection at the token ids `ids` (at the draft
    vocabulary: where a fresh head's lm_head starts)."""
    if target_cfg.tie_word_embeddings:
        return jnp.asarray(target_params["embed"], jnp.float32)[jnp.asarray(ids)].T
    return jnp.asarray(target_params["lm_head"], jnp.float32)[:, jnp.asarray(ids)]


def carry_lm_head(params: dict, old_ids: np.ndarray, new_ids: np.ndarray, target_head: jax.Array) -> dict:
    """`params` with lm_head re-laid for the draft vocabulary `new_ids` (increasing target ids): a
    token the old vocabulary `old_ids` (increasing) holds keeps its column. Any other starts from
    its column of the target's output projection `target_head [H, V]`, mapped by the linear map
    that best takes the old vocabulary's target columns to the head's trained ones (least squares):
    the head's columns have moved away from the target's together, and a new column left where a
    fresh head starts would outscore the trained ones on tokens it has never been trained against."""
    old_ids, new_ids = np.asarray(old_ids), np.asarray(new_ids)
    trained = np.asarray(params["lm_head"], np.float64)  # [H, Vo]
    target = np.asarray(target_head, np.float64)
    to_head, *_ = np.linalg.lstsq(target[:, old_ids].T, trained.T, rcond=None)  # [H, H]
    at = np.minimum(np.searchsorted(old_ids, new_ids), len(old_ids) - 1)
    shared = old_ids[at] == new_ids
    lm_head = np.where(shared[None, :], trained[:, at], (target[:, new_ids].T @ to_head).T)
    return {**params, "lm_head": jnp.asarray(lm_head, jnp.float32)}


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    t = cfg.train
    schedule = optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps, t.lr * t.min_lr_ratio)
    decay_mask = lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params)
    return optax.chain(optax.clip_by_global_norm(t.grad_clip),
                       optax.adamw(schedule, b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=decay_mask))


def lr_at(cfg: TrainConfig, step: int) -> float:
    t = cfg.train
    return float(optax.warmup_cosine_decay_schedule(0.0, t.lr, t.warmup_steps, t.steps, t.lr * t.min_lr_ratio)(step))


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def soft_targets(target_params: dict, target_cfg: LlamaConfig, batch: dict, consts: dict):
    """(features, target probs over the draft vocabulary `[B, T, Vd]` f32, target top-1 as a draft id or -1)."""
    xn, features = target_forward(target_params, target_cfg, batch["tokens"], batch["positions"], batch["segments"],
                                  target_cfg.eagle3_feature_layers, logits=False)
    full = target_logits(target_params, target_cfg, xn)
    top1 = jnp.argmax(full, axis=-1)
    probs = jax.nn.softmax(jnp.take(full, consts["draft_ids"], axis=-1), axis=-1)
    return features, probs, consts["t2d_index"][top1]


def _loss(cfg: TrainConfig, target_cfg: LlamaConfig, hc: Eagle3Config, params, target_params, batch, consts):
    t = cfg.train
    features, probs, top1 = soft_targets(target_params, target_cfg, batch, consts)
    features, probs = jax.lax.stop_gradient(features), jax.lax.stop_gradient(probs)
    cparams = jax.tree_util.tree_map(lambda x: x.astype(COMPUTE[t.compute_dtype]), params)
    full = {**batch, "features": features}
    return ttt_loss(cparams, target_params["embed"], hc, full, probs, top1, t.ttt_steps, t.ttt_decay, t.remat)


@functools.lru_cache(maxsize=8)
def compiled_steps(cfg: TrainConfig, target_cfg: LlamaConfig, hc: Eagle3Config):
    """(train_step, eval_step), jitted once per (config, target, head) in a process (the configs are
    frozen and hashable), so a resumed run in the same process does not compile again."""
    optimizer = make_optimizer(cfg)
    loss = functools.partial(_loss, cfg, target_cfg, hc)

    def train_step(params, opt_state, target_params, batch, consts):
        (total, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, target_params, batch, consts)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {**metrics, "total": total, "grad_norm": optax.tree.norm(grads)}

    def eval_step(params, target_params, batch, consts):
        total, metrics = loss(params, target_params, batch, consts)
        return {**metrics, "total": total}

    return jax.jit(train_step, donate_argnums=(0, 1)), jax.jit(eval_step)


class Trainer:
    """The jitted train / eval steps of one (target, head, config) and the vocabulary constants."""

    def __init__(self, cfg: TrainConfig, target_cfg: LlamaConfig, hc: Eagle3Config, vocab: dict):
        self.cfg, self.target_cfg, self.hc = cfg, target_cfg, hc
        self.optimizer = make_optimizer(cfg)
        t2d_index = np.full(target_cfg.vocab_size, -1, np.int32)
        t2d_index[vocab["draft_ids"]] = np.arange(len(vocab["draft_ids"]), dtype=np.int32)
        self.consts = {"draft_ids": jnp.asarray(vocab["draft_ids"], jnp.int32), "t2d_index": jnp.asarray(t2d_index)}
        self._train, self._eval = compiled_steps(cfg, target_cfg, hc)

    def step(self, params, opt_state, target_params, batch):
        return self._train(params, opt_state, target_params, _device(batch), self.consts)

    def evaluate(self, params, target_params, batches) -> dict:
        """Token-weighted held-out loss and agreement per step over `batches`, and the weighted total."""
        s = self.cfg.train.ttt_steps
        num = {"loss": np.zeros(s), "acc": np.zeros(s)}
        count = np.zeros(s)
        for b in batches:
            m = jax.device_get(self._eval(params, target_params, _device(b), self.consts))
            n = np.asarray(m["count"], np.float64)
            num["loss"] += np.asarray(m["loss"]) * n
            num["acc"] += np.asarray(m["acc"]) * n
            count += n
        loss = num["loss"] / np.maximum(count, 1)
        acc = num["acc"] / np.maximum(count, 1)
        weights = self.cfg.train.ttt_decay ** np.arange(s)
        return {"heldout_loss": float((weights * loss).sum()), "loss": loss.tolist(), "acc": acc.tolist(),
                "tokens": count.tolist()}


def _device(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# Run directory: vocabulary, checkpoints, logs
# ---------------------------------------------------------------------------------------------


def start_head(cfg: TrainConfig, target_cfg: LlamaConfig) -> tuple[dict, np.ndarray] | None:
    """(fp32 params, draft ids `[Vd]`) of the exported head `head.init_from`, or None (fresh weights).

    The head must be the one this config would build: a misfit is refused naming each field."""
    if not cfg.head.init_from:
        return None
    from treespec_jax.models.hf import load_eagle3

    hc, loaded = load_eagle3(cfg.head.init_path(), "fp32", target=target_cfg)
    want = head_config(target_cfg, cfg, hc.draft_vocab_size)
    diff = [f"{f.name} {getattr(hc, f.name)!r} (this config: {getattr(want, f.name)!r})"
            for f in dataclasses.fields(want) if getattr(hc, f.name) != getattr(want, f.name)]
    if cfg.head.init_vocab == "inherit" and cfg.vocab.draft_vocab_size != hc.draft_vocab_size:
        diff.append(f"draft_vocab_size {hc.draft_vocab_size} (this config's vocab.draft_vocab_size: "
                    f"{cfg.vocab.draft_vocab_size})")
    if diff:
        raise ValueError(f"head.init_from = {cfg.head.init_from!r} does not fit this config: " + "; ".join(diff))
    return head_params_of(loaded), np.arange(hc.draft_vocab_size) + np.asarray(loaded["d2t"], np.int64)


def head_params_of(loaded: dict) -> dict:
    """The trainable fp32 params of a loaded head (`models.hf.load_eagle3`'s dict)."""
    return {k: jnp.asarray(loaded[k], jnp.float32) if k != "layer" else
            {n: jnp.asarray(v, jnp.float32) for n, v in loaded["layer"].items()} for k in HEAD_PARAM_KEYS}


def ensure_vocab(run: Path, train_seqs: data_mod.Sequences, vocab_size: int, cfg: TrainConfig, log,
                 draft_ids: np.ndarray | None = None) -> dict:
    """The run's draft vocabulary: as saved, else `draft_ids` (a start head's), else the most
    frequent training reply tokens."""
    path = run / "vocab.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    if draft_ids is not None:
        vocab = data_mod.vocab_of(draft_ids, data_mod.token_counts(train_seqs.reply_tokens(), vocab_size))
    else:
        vocab = data_mod.build_vocab(train_seqs.reply_tokens(), vocab_size, cfg.vocab.draft_vocab_size)
    np.savez(path, **{k: np.asarray(v) for k, v in vocab.items()})
    log(f"draft vocabulary: {len(vocab['draft_ids'])} tokens cover {100 * vocab['coverage']:.2f}% of the "
        f"training reply tokens")
    return vocab


def checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in run.glob("ckpt_*") if p.is_dir() and (p / "meta.json").exists())


def save_checkpoint(run: Path, step: int, params, opt_state, cursor: tuple[int, int], cfg: TrainConfig,
                    keep: int, num_sequences: int = 0) -> Path:
    final = run / f"ckpt_{step:07d}"
    tmp = run / f".tmp_ckpt_{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    p_leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(params))[0]
    o_leaves = jax.tree_util.tree_leaves(jax.device_get(opt_state))
    arrays = {"p:" + jax.tree_util.keystr(k): np.asarray(v) for k, v in p_leaves}
    arrays.update({f"o:{i}": np.asarray(v) for i, v in enumerate(o_leaves)})
    np.savez(tmp / "state.npz", **arrays)
    meta = {"step": step, "cursor": list(cursor), "shuffle_seed": cfg.train.seed, "num_sequences": num_sequences,
            "time": time.time()}
    (tmp / "meta.json").write_text(json.dumps(meta) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)  # whole or absent
    for old in checkpoints(run)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, params_like, opt_like):
    meta = json.loads((path / "meta.json").read_text())
    with np.load(path / "state.npz") as z:
        p_paths, p_def = jax.tree_util.tree_flatten_with_path(params_like)
        params = jax.tree_util.tree_unflatten(p_def, [jnp.asarray(z["p:" + jax.tree_util.keystr(k)])
                                                      for k, _ in p_paths])
        o_leaves, o_def = jax.tree_util.tree_flatten(opt_like)
        opt = jax.tree_util.tree_unflatten(o_def, [jnp.asarray(z[f"o:{i}"]) for i in range(len(o_leaves))])
    return params, opt, meta


class LossLog:
    """loss.csv: rows are appended; a resumed run first drops the rows past its checkpoint."""

    def __init__(self, path: Path, steps: int, resume_step: int):
        self.path = path
        self.fields = (["step", "time_s", "lr", "loss", "grad_norm", "tokens"] + [f"loss_{i}" for i in range(steps)]
                       + [f"acc_{i}" for i in range(steps)])
        rows = []
        if path.exists():
            with open(path) as f:
                rows = [r for r in csv.DictReader(f) if int(r["step"]) <= resume_step]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, self.fields)
            w.writeheader()
            w.writerows(rows)

    def write(self, row: dict) -> None:
        with open(self.path, "a", newline="") as f:
            csv.DictWriter(f, self.fields).writerow(row)


def read_loss_csv(path: Path) -> list[dict]:
    with open(path) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


# ---------------------------------------------------------------------------------------------
# Train / export
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    step: int  # optimiser steps done after this run
    stopped: str  # "done" (reached train.steps), "deadline", "stop_after"
    checkpoint: Path | None
    export: dict | None = None


def _log_to(run: Path):
    t0 = time.perf_counter()

    def log(message: str) -> None:
        line = f"[train {time.perf_counter() - t0:6.1f}s] {message}"
        print(line, flush=True)
        with open(run / "train.log", "a") as f:
            f.write(line + "\n")

    return log


def train(cfg: TrainConfig, data_dir: str | os.PathLike, run_dir: str | os.PathLike, *, max_minutes: float | None = None,
          stop_after: int | None = None, export: bool = False, target=None, log=None) -> RunResult:
    """One resumable run (module docstring). `target`: (LlamaConfig, params) to skip loading
    `cfg.target`; `stop_after`: at most this many steps in this run (tests)."""
    start = time.perf_counter()
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    log = log or _log_to(run)
    if not (run / "config.json").exists():
        (run / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    else:
        changed = _changed_keys(json.loads((run / "config.json").read_text()), cfg.to_dict())
        if changed:
            log(f"config differs from the run's first config at {', '.join(changed)} (this run uses the new values)")
    target_cfg, target_params = target if target is not None else _load_target(cfg)
    seqs = data_mod.read_shards(data_dir)
    train_seqs, held_seqs = seqs.split()
    found = checkpoints(run)
    warm = None if found else start_head(cfg, target_cfg)
    inherit = warm is not None and cfg.head.init_vocab == "inherit"
    vocab = ensure_vocab(run, train_seqs, target_cfg.vocab_size, cfg, log, draft_ids=warm[1] if inherit else None)
    hc = head_config(target_cfg, cfg, len(vocab["draft_ids"]))
    trainer = Trainer(cfg, target_cfg, hc, vocab)
    t = cfg.train
    if warm is not None:
        params = warm[0]
        if not inherit:
            ids = vocab["draft_ids"]
            params = carry_lm_head(params, warm[1], ids,
                                   target_lm_head(target_params, target_cfg, np.arange(target_cfg.vocab_size)))
            log(f"draft vocabulary drawn from the data: {np.isin(ids, warm[1]).sum()} of its {len(ids)} tokens "
                f"keep the start head's lm_head columns")
        log(f"starting from the head in {cfg.head.init_from}")
    else:
        params = init_head(target_params, target_cfg, hc, vocab["draft_ids"], jax.random.key(t.seed))
    opt_state = trainer.optimizer.init(params)
    step, cursor, ckpt = 0, (0, 0), None
    if found:
        params, opt_state, meta = load_checkpoint(found[-1], params, opt_state)
        step, cursor, ckpt = meta["step"], tuple(meta["cursor"]), found[-1]
        log(f"resumed from {found[-1].name}: step {step}, data cursor {cursor}")
        if meta.get("num_sequences", len(train_seqs)) != len(train_seqs):
            # New shards arrived: the cursor's epoch order is drawn over the larger set.
            log(f"training sequences changed {meta['num_sequences']} -> {len(train_seqs)} since the checkpoint")
    batches = data_mod.PackedBatches(train_seqs, t.seq_len, t.batch_rows, t.seed, cursor=cursor)
    losslog = LossLog(run / "loss.csv", t.ttt_steps, step)
    log(f"{len(train_seqs)} training / {len(held_seqs)} held-out sequences; head Vd={hc.draft_vocab_size}; "
        f"step {step} of {t.steps}")
    deadline = None if max_minutes is None else start + 60 * max_minutes
    # Time the end of a run needs: a checkpoint, and the export when due. The export's held-out
    # eval compiles its own program: checkpoint, eval and export took 12 s on a cold compile cache
    # with 368 held-out sequences (H100, 2026-12-07); 30 s leaves room for larger held-out sets.
    reserve = 15.0 + (30.0 if export or step >= t.steps else 0.0)
    done_here, step_times, stopped = 0, [], "done"
    while step < t.steps:
        if stop_after is not None and done_here >= stop_after:
            stopped = "stop_after"
            break
        if deadline is not None and step_times:
            typical = float(np.median(step_times[-20:]))
            if time.perf_counter() + 2 * typical + reserve > deadline:
                stopped = "deadline"
                break
        batch = batches.next()
        ts = time.perf_counter()
        params, opt_state, m = trainer.step(params, opt_state, target_params, batch)
        step += 1
        done_here += 1
        if step % t.log_every == 0 or step == t.steps or done_here == 1:
            m = jax.device_get(m)
            row = {"step": step, "time_s": round(time.perf_counter() - start, 2), "lr": lr_at(cfg, step - 1),
                   "loss": float(m["total"]), "grad_norm": float(m["grad_norm"]), "tokens": int(m["count"][0])}
            row.update({f"loss_{i}": float(v) for i, v in enumerate(m["loss"])})
            row.update({f"acc_{i}": float(v) for i, v in enumerate(m["acc"])})
            losslog.write(row)
            rate = t.batch_rows * t.seq_len / float(np.median(step_times[-20:])) if step_times else 0.0
            log(f"step {step}: loss {row['loss']:.4f} acc0 {row['acc_0']:.3f} acc{t.ttt_steps - 1} "
                f"{row[f'acc_{t.ttt_steps - 1}']:.3f} |g| {row['grad_norm']:.2f} lr {row['lr']:.2e} "
                f"{rate:.0f} tok/s")
        else:
            jax.block_until_ready(m["total"])
        dt = time.perf_counter() - ts
        if done_here > 1:  # the first step carries the compile
            step_times.append(dt)
        if step % t.checkpoint_every == 0 and step < t.steps:
            ckpt = save_checkpoint(run, step, params, opt_state, batches.cursor, cfg, t.keep_checkpoints,
                                   len(train_seqs))
    if ckpt is None or ckpt.name != f"ckpt_{step:07d}":
        ckpt = save_checkpoint(run, step, params, opt_state, batches.cursor, cfg, t.keep_checkpoints, len(train_seqs))
    if step_times:
        per = float(np.median(step_times))
        log(f"{done_here} steps this run, {per * 1000:.0f} ms/step ({t.batch_rows * t.seq_len / per:.0f} tok/s); "
            f"{stopped} at step {step}; checkpoint {ckpt.name}")
    result = RunResult(step, stopped, ckpt)
    left = None if deadline is None else deadline - time.perf_counter()
    if step >= t.steps and not export and left is not None and left < 30:
        log(f"train.steps reached with {left:.0f} s left: run `export` next")
    elif export or step >= t.steps:
        result.export = export_head(cfg, run, held_seqs=held_seqs, target=(target_cfg, target_params), trainer=trainer,
                                    params=params, step=step, log=log)
    return result


def _changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _changed_keys(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}={b!r} (was {a!r})")
    return out


def _load_target(cfg: TrainConfig):
    target_cfg, params, _ = data_mod.load_target(cfg.target, cfg.train.target_dtype)
    return target_cfg, params


def head_params_for_export(params: dict, vocab: dict) -> dict:
    out = {k: params[k] for k in HEAD_PARAM_KEYS}
    out["d2t"] = np.asarray(vocab["d2t"], np.int32)
    out["t2d"] = np.asarray(vocab["t2d"], bool)
    return out


def export_head(cfg: TrainConfig, run_dir: str | os.PathLike, out: str | os.PathLike | None = None, *,
                data_dir=None, held_seqs=None, target=None, trainer: Trainer | None = None, params=None,
                step: int | None = None, log=print) -> dict:
    """Writes `out` (default RUN/head): the bf16 head in the published layout, checked to load
    back through `models.hf.load_eagle3` and to fit 32 MiB; `loss.png`; `metrics.json` with the
    held-out loss of the exported (bf16-rounded) weights. Returns the metrics."""
    from treespec_jax.models.hf import load_eagle3, save_eagle3

    run = Path(run_dir)
    out = Path(out) if out is not None else run / "head"
    target_cfg, target_params = target if target is not None else _load_target(cfg)
    with np.load(run / "vocab.npz") as z:
        vocab = {k: z[k] for k in z.files}
    hc = head_config(target_cfg, cfg, len(vocab["draft_ids"]))
    if params is None:
        found = checkpoints(run)
        if not found:
            raise FileNotFoundError(f"no checkpoint in {run}: train first")
        like = init_head(target_params, target_cfg, hc, vocab["draft_ids"], jax.random.key(0))
        params, _, meta = load_checkpoint(found[-1], like, make_optimizer(cfg).init(like))
        step = meta["step"]
    save_eagle3(out, hc, head_params_for_export(jax.device_get(params), vocab), "bf16")
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    if size > MAX_HEAD_BYTES:
        raise RuntimeError(f"exported head is {size / 2**20:.1f} MiB, over the {MAX_HEAD_BYTES / 2**20:.0f} MiB limit")
    loaded_cfg, loaded = load_eagle3(out, "bf16", target=target_cfg)
    metrics = {"step": step, "head_dir": str(out), "head_bytes": size, "draft_vocab_size": hc.draft_vocab_size,
               "coverage": float(vocab["coverage"]) if "coverage" in vocab else None}
    if held_seqs is None and data_dir is not None:
        held_seqs = data_mod.read_shards(data_dir).split()[1]
    if held_seqs is not None and len(held_seqs):
        trainer = trainer or Trainer(cfg, target_cfg, hc, vocab)
        rounded = head_params_of(loaded)
        batches = data_mod.heldout_batches(held_seqs, cfg.train.seq_len, cfg.train.batch_rows, cfg.train.eval_batches)
        metrics.update(trainer.evaluate(rounded, target_params, batches))
        with open(run / "eval.csv", "a") as f:
            f.write(f"{step},{metrics['heldout_loss']:.6f}," + ",".join(f"{a:.4f}" for a in metrics["acc"]) + "\n")
        log(f"held-out loss {metrics['heldout_loss']:.4f}; top-1 agreement per step "
            + " ".join(f"{a:.3f}" for a in metrics["acc"]))
    if (run / "loss.csv").exists():
        metrics["loss_png"] = plot_losses(run / "loss.csv", run / "loss.png", metrics.get("heldout_loss"))
    (run / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    log(f"exported {out} ({size / 2**20:.1f} MiB, Vd={hc.draft_vocab_size}, step {step})")
    return metrics


def plot_losses(csv_path: Path, png: Path, heldout: float | None = None) -> str | None:
    """Loss curve (weighted total and step 0 / last step) and agreement; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = read_loss_csv(csv_path)
    if not rows:
        return None
    steps = [r["step"] for r in rows]
    accs = sorted(k for k in rows[0] if k.startswith("acc_"))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(steps, [r["loss"] for r in rows], label="weighted total")
    a.plot(steps, [r["loss_0"] for r in rows], label="step 0")
    last = accs[-1].split("_")[1]
    a.plot(steps, [r[f"loss_{last}"] for r in rows], label=f"step {last}")
    if heldout is not None:
        a.axhline(heldout, color="k", ls="--", lw=1, label=f"held-out total {heldout:.3f}")
    a.set_xlabel("step")
    a.set_ylabel("soft cross-entropy")
    a.legend()
    for k in accs:
        b.plot(steps, [r[k] for r in rows], label=k.replace("acc_", "step "))
    b.set_xlabel("step")
    b.set_ylabel("top-1 agreement with the target")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return str(png)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Train / export an EAGLE-3 head (resumable runs).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("train", "export"):
        p = sub.add_parser(name)
        p.add_argument("--run", required=True, type=Path, help="run directory (checkpoints, logs, export)")
        p.add_argument("--data", type=Path, default=None, help="data directory of shards")
        p.add_argument("--config", type=Path, default=None, help="training TOML (default configs/train/eagle3.toml)")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
        if name == "train":
            p.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget of this run")
            p.add_argument("--export", action="store_true", help="export at the end of this run")
        else:
            p.add_argument("--out", type=Path, default=None, help="head directory (default RUN/head)")
    args = ap.parse_args(argv)
    cfg = load_config(args.config, dict(parse_override(s) for s in args.set))
    if args.cmd == "train":
        if args.data is None:
            ap.error("train needs --data")
        result = train(cfg, args.data, args.run, max_minutes=args.max_minutes, export=args.export)
        print(json.dumps({"step": result.step, "stopped": result.stopped, "checkpoint": str(result.checkpoint),
                          "export": result.export}, indent=2, default=str))
    else:
        metrics = export_head(cfg, args.run, args.out, data_dir=args.data, log=_log_to(args.run))
        print(json.dumps(metrics, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
