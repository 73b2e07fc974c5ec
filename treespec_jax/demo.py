"""`treespec demo`: tree speculation against plain decoding on a small random transformer.

The serving loop, paged caches and real model families arrive with their own issues; until then
this demo runs the whole tree pipeline end to end with full-recompute attention (no KV cache):

  drafter step 0 on the root -> `seed_lanes`; steps 1..S-1 feed the K lanes with their lane-window
  ancestor masks -> `expand_lanes`; `select_tree` keeps N-1 candidates; the target scores every
  node in one forward (positions vc + depth, ancestor-mask visibility); the verify walk accepts a
  root path; the committed tokens are the path's predictions plus the bonus.

With the greedy or keyed ("gumbel") sampler the output must equal plain decoding's token for token
(same seed): the demo checks that and exits 1 if it does not. The drafter is the target with
perturbed weights, so it agrees with the target often but not always.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from treespec_jax.config import ConfigError, ServeConfig
from treespec_jax.sampling.keyed import SamplingParams, sample_at, target_probs
from treespec_jax.tree import masks
from treespec_jax.tree.draft_tree import CandidateRecord, expand_lanes, seed_lanes, select_tree
from treespec_jax.tree.verify import greedy_walk, keyed_targets, rejection_walk


@dataclasses.dataclass(frozen=True)
class ToyModelConfig:
    vocab: int = 96  # vocabulary size
    dim: int = 64  # model width
    heads: int = 4  # attention heads (head dim = dim / heads)
    layers: int = 2  # transformer blocks
    logit_scale: float = 6.0  # sharpens the random model's next-token distributions


def init_params(cfg: ToyModelConfig, key: jax.Array) -> dict:
    keys = jax.random.split(key, 2 + 4 * cfg.layers)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[0])
    params = {"embed": jax.random.normal(keys[0], (cfg.vocab, cfg.dim)), "unembed": normal(keys[1], (cfg.dim, cfg.vocab))}
    for i in range(cfg.layers):
        k = keys[2 + 4 * i: 6 + 4 * i]
        params[f"qkv{i}"] = normal(k[0], (cfg.dim, 3 * cfg.dim))
        params[f"out{i}"] = normal(k[1], (cfg.dim, cfg.dim))
        params[f"up{i}"] = normal(k[2], (cfg.dim, 4 * cfg.dim))
        params[f"down{i}"] = normal(k[3], (4 * cfg.dim, cfg.dim))
    return params


def perturb(params: dict, key: jax.Array, scale: float) -> dict:
    """The demo drafter: the target's weights plus relative Gaussian noise."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(tree, [w * (1 + scale * jax.random.normal(k, w.shape)) for w, k in zip(leaves, keys)])


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x, positions):
    """x [B, T, H, Dh], positions [B, T]."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000.0 ** (jnp.arange(half) / half))
    ang = positions[..., None, None].astype(jnp.float32) * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], -1)


def forward(cfg: ToyModelConfig, params: dict, tokens, positions, visible):
    """tokens/positions [B, T], visible [B, T, T] bool -> logits [B, T, V] (float32)."""
    b, t = tokens.shape
    dh = cfg.dim // cfg.heads
    x = params["embed"][tokens]
    for i in range(cfg.layers):
        qkv = (_rms(x) @ params[f"qkv{i}"]).reshape(b, t, 3, cfg.heads, dh)
        q, k, v = _rope(qkv[:, :, 0], positions), _rope(qkv[:, :, 1], positions), qkv[:, :, 2]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dh)
        s = jnp.where(visible[:, None], s, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).reshape(b, t, cfg.dim)
        x = x + a @ params[f"out{i}"]
        x = x + jax.nn.gelu(_rms(x) @ params[f"up{i}"]) @ params[f"down{i}"]
    return cfg.logit_scale * (_rms(x) @ params["unembed"])


def window_logits(cfg, params, seq, length, win_tokens, win_depths, win_visible):
    """Scores a window of tokens after each request's committed context.

    seq [B, L] holds each request's tokens; the last one (index length-1) is the root, which is
    not part of the context (it is the window's node 0 in the runtime). win_tokens / win_depths
    [B, W], win_visible [B, W, W] -> logits [B, W, V]. Window node i sits at position
    vc + depth[i] with vc = length - 1 and sees the whole context plus the visible window nodes.
    """
    b, l = seq.shape
    w = win_tokens.shape[1]
    vc = length - 1
    ctx_pos = jnp.broadcast_to(jnp.arange(l), (b, l))
    ctx_valid = ctx_pos < vc[:, None]
    tokens = jnp.concatenate([seq, win_tokens], axis=1)
    positions = jnp.concatenate([ctx_pos, vc[:, None] + win_depths], axis=1)
    causal = (ctx_pos[:, :, None] >= ctx_pos[:, None, :]) & ctx_valid[:, None, :]
    top = jnp.concatenate([causal | jnp.eye(l, dtype=bool)[None], jnp.zeros((b, l, w), bool)], axis=2)
    bottom = jnp.concatenate([jnp.broadcast_to(ctx_valid[:, None, :], (b, w, l)), win_visible], axis=2)
    logits = forward(cfg, params, tokens, positions, jnp.concatenate([top, bottom], axis=1))
    return logits[:, l:]


def _append(seq, length, new_tokens, count):
    """Writes new_tokens[b, :count[b]] at seq[b, length[b]:]."""
    b, n = new_tokens.shape
    cols = length[:, None] + jnp.arange(n)[None]
    keep = jnp.arange(n)[None] < count[:, None]
    cols = jnp.where(keep, cols, seq.shape[1])  # out of bounds -> dropped
    return seq.at[jnp.arange(b)[:, None], cols].set(new_tokens, mode="drop"), length + count


@functools.partial(jax.jit, static_argnums=0)
def plain_step(cfg, params, seq, length, seeds, sp):
    """One plain decoding step: the root's logits, the keyed draw at position vc + 1."""
    b = seq.shape[0]
    root = seq[jnp.arange(b), length - 1]
    logits = window_logits(cfg, params, seq, length, root[:, None], jnp.zeros((b, 1), jnp.int32),
                           jnp.ones((b, 1, 1), bool))[:, 0]
    token = sample_at(logits, seeds, length, sp)  # vc + 1 = length
    return _append(seq, length, token[:, None], jnp.ones((b,), jnp.int32))


def _topk_logprobs(logits, k):
    lp = jax.nn.log_softmax(logits, axis=-1)
    vals, ids = jax.lax.top_k(lp, k)
    return vals, ids.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "topk", "num_steps", "num_nodes", "sampler"))
def spec_step(cfg, target, drafter, seq, length, seeds, sp, key, *, topk, num_steps, num_nodes, sampler):
    """One speculative round: draft a tree, verify it in one target forward, commit the path."""
    b = seq.shape[0]
    k, s = topk, num_steps
    root = seq[jnp.arange(b), length - 1]
    # Drafter window: slot 0 = root, slot 1 + j = lane-window index j.
    lane_w = (s - 1) * k
    dw = 1 + lane_w
    d_tokens = jnp.zeros((b, dw), jnp.int32).at[:, 0].set(root)
    d_depths = jnp.zeros((b, dw), jnp.int32)
    d_vis = jnp.zeros((b, dw, dw), bool).at[:, :, 0].set(True)
    logits0 = window_logits(cfg, drafter, seq, length, d_tokens[:, :1], d_depths[:, :1], d_vis[:, :1, :1])[:, 0]
    lanes, cands = seed_lanes(*_topk_logprobs(logits0, k))
    record = CandidateRecord.empty(b, k, s).write(0, cands)
    for step in range(1, s):
        slots = 1 + (step - 1) * k + jnp.arange(k)
        d_tokens = d_tokens.at[:, slots].set(lanes.tokens)
        d_depths = d_depths.at[:, slots].set(step)
        lane_rows = masks.unpack_mask_rows(lanes.masks, lane_w)  # [B, K, lane_w]
        d_vis = d_vis.at[:, slots, 1:].set(lane_rows)
        logits = window_logits(cfg, drafter, seq, length, d_tokens, d_depths, d_vis)[:, slots]
        lanes, cands = expand_lanes(lanes, *_topk_logprobs(logits, k), step, num_steps=s)
        record = record.write(step, cands)
    tree = select_tree(record, root, num_nodes)

    vis = masks.ancestor_mask_bool(tree.parents)
    node_logits = window_logits(cfg, target, seq, length, tree.tokens, tree.depths, vis)
    if sampler == "rejection":
        probs = target_probs(node_logits, sp)  # the same masks plain decoding samples under
        keys = jax.random.split(key, b)
        accepted = rejection_walk(probs, tree.tokens, tree.parents, keys)
    else:
        accepted = greedy_walk(tree.tokens, tree.parents,
                               keyed_targets(node_logits, tree.parents, seeds, length - 1, sp))
    seq, length = _append(seq, length, jnp.maximum(accepted.predicts, 0), accepted.accept_len)
    return seq, length, accepted.accept_len


def run_plain(cfg, params, seq, length, seeds, sp, new_tokens):
    for _ in range(new_tokens):
        seq, length = plain_step(cfg, params, seq, length, seeds, sp)
    return seq, length


def run_spec(cfg, target, drafter, seq, length, seeds, sp, new_tokens, *, topk, num_steps, num_nodes, sampler, key):
    goal = length + new_tokens
    forwards, accepted = 0, []
    while bool(jnp.any(length < goal)):
        key, sub = jax.random.split(key)
        seq, length, acc = spec_step(cfg, target, drafter, seq, length, seeds, sp, sub, topk=topk,
                                     num_steps=num_steps, num_nodes=num_nodes, sampler=sampler)
        forwards += 1
        accepted.append(np.asarray(acc))
    return seq, length, forwards, np.stack(accepted)


def build_parser() -> argparse.ArgumentParser:
    from treespec_jax.cli import add_config_flags, flag_dest

    p = argparse.ArgumentParser(prog="treespec demo", description=__doc__.splitlines()[0])
    add_config_flags(p)
    p.add_argument("--batch", type=int, default=4, help="requests decoded together")
    p.add_argument("--prompt-len", type=int, default=8, help="random prompt tokens per request")
    p.add_argument("--max-new-tokens", type=int, default=40, help="tokens generated per request")
    p.add_argument("--draft-noise", type=float, default=0.1, help="relative weight noise of the demo drafter")
    p.add_argument("--no-chain", action="store_true", help="skip the K = 1 chain comparison")
    # The demo's defaults are a tree (K=4, S=5, N=16, EAGLE3); every config flag overrides them.
    p.set_defaults(**{flag_dest("speculative", "algorithm"): "EAGLE3", flag_dest("speculative", "topk"): 4,
                      flag_dest("speculative", "num_steps"): 5, flag_dest("speculative", "num_draft_tokens"): 16})
    return p


def main(argv: list[str] | None = None) -> int:
    from treespec_jax.cli import config_from_args

    args = build_parser().parse_args(argv)
    problems = [f"--{name} must be >= 1, got {val}" for name, val in
                (("batch", args.batch), ("prompt-len", args.prompt_len), ("max-new-tokens", args.max_new_tokens))
                if val < 1]
    try:
        cfg: ServeConfig = config_from_args(args)
        problems += cfg.problems()
    except ConfigError as err:
        problems += list(err.problems)
    if problems:
        print(f"treespec demo: refused, {len(problems)} problem(s):", file=sys.stderr)
        for problem in problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    spec, sampling = cfg.speculative, cfg.sampling
    if spec.algorithm == "NONE":
        print("treespec demo: speculation is off (--speculative-algorithm NONE); nothing to compare", file=sys.stderr)
        return 2
    k, s, n = spec.topk, spec.num_steps, spec.num_draft_tokens or spec.num_steps + 1
    sampler = sampling.backend
    if sampler == "greedy" and sampling.temperature > 0:
        sampler = "gumbel"

    model = ToyModelConfig()
    key = jax.random.key(cfg.seed)
    k_target, k_draft, k_prompt, k_rej = jax.random.split(key, 4)
    target = init_params(model, k_target)
    drafter = perturb(target, k_draft, args.draft_noise)
    b = args.batch
    max_len = args.prompt_len + args.max_new_tokens + n + 1
    prompt = jax.random.randint(k_prompt, (b, args.prompt_len), 0, model.vocab, jnp.int32)
    seq = jnp.zeros((b, max_len), jnp.int32).at[:, :args.prompt_len].set(prompt)
    length = jnp.full((b,), args.prompt_len, jnp.int32)
    seeds = (cfg.seed + jnp.arange(b, dtype=jnp.int32)) % (2**31 - 1)
    sp = SamplingParams.create(jnp.full((b,), sampling.temperature), jnp.full((b,), max(sampling.top_k, 0)),
                               jnp.full((b,), sampling.top_p))
    new = args.max_new_tokens
    print(f"treespec demo: B={b}, toy target (V={model.vocab}, {model.layers} layers), drafter noise "
          f"{args.draft_noise}, sampler={sampler}, temperature={sampling.temperature}, seed={cfg.seed}")

    t0 = time.perf_counter()
    plain_seq, _ = run_plain(model, target, seq, length, seeds, sp, new)
    plain = np.asarray(plain_seq)[:, args.prompt_len:args.prompt_len + new]
    print(f"  plain decoding: {new} target forwards ({time.perf_counter() - t0:.1f} s incl. compile)")

    shapes = [("tree", k, s, n)] + ([] if args.no_chain or k == 1 else [("chain", 1, s, s + 1)])
    status = 0
    for label, kk, ss, nn in shapes:
        t0 = time.perf_counter()
        out_seq, _, forwards, acc = run_spec(model, target, drafter, seq, length, seeds, sp, new, topk=kk,
                                             num_steps=ss, num_nodes=nn, sampler=sampler, key=k_rej)
        out = np.asarray(out_seq)[:, args.prompt_len:args.prompt_len + new]
        mean_acc = float(acc.mean())
        line = (f"  {label} K={kk} S={ss} N={nn}: {forwards} target forwards, {mean_acc:.2f} tokens/forward "
                f"per request ({time.perf_counter() - t0:.1f} s incl. compile)")
        if sampler == "rejection":
            print(line + "; rejection sampling is exact in distribution, not token-exact: no equality check")
            continue
        same = bool((out == plain).all())
        print(line + f"; output {'equals' if same else 'DIFFERS FROM'} plain decoding")
        if not same:
            bad = np.argwhere(out != plain)[0]
            print(f"    first difference: request {bad[0]}, token {bad[1]}: {out[tuple(bad)]} vs {plain[tuple(bad)]}",
                  file=sys.stderr)
            status = 1
    print(f"  request 0 tokens: {plain[0].tolist()}")
    return status


if __name__ == "__main__":
    sys.exit(main())
