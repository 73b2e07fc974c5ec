"""Training-time forwards: the frozen target over packed rows, and the EAGLE-3 head unrolled.

Both run on packed rows `[B, T]`: several whole sequences back to back, `segments [B, T]` naming
the sequence of each token (-1 = padding) and `positions [B, T]` restarting at 0 for each
sequence, so every sequence is computed exactly as if it were alone at the start of a request.

Target (`target_forward`): the decoder of `treespec_jax.models.llama` without a KV cache. It
reuses that module's `rms_norm`, `project_qkv` and `mlp_block`; attention is one
masked softmax per layer in which a token sees the tokens of its own sequence at or before it
(fp32 scores and weights, as the engine's prefill attention computes them). It returns the
inputs of the feature layers (concatenated, the engine's `features`) and the logits.

Head, unrolled (`head_unrolled`): the training-time test. Serving drafts a chain of steps from the
last accepted row; the forward reproduces, for every anchor position p of a sequence at once, the
chain that would start there when the target's accepted prefix ends at p:

- step 0 at anchor p consumes (token x[p+1], target feature f[p]) at RoPE position p: the
  row the engine's drafter prefill / step 0 writes for position p (`drafter/eagle3.py`: draft
  position p holds (feature of target token p, token p + 1)). Its logits score x[p+2].
- step i >= 1 at anchor p consumes (token x[p+1+i], the head's own output t of step i-1 at the
  same anchor) at RoPE position p + i: the lane the engine feeds at draft step i, which sits at
  frontier + i - 1 with frontier = p + 1 (`drafter/base.py`). The token is the data's, i.e. the
  candidate that serving would have to have drafted for the chain to reach this step. Its logits
  score x[p+2+i].

Attention mask of the unrolled draft. A query of step i at anchor p sees
  (a) the step-0 keys of positions q <= p of its own sequence: the draft cache below the frontier,
      which serving fills from the target's features (prefill and step 0), never from drafts;
  (b) the keys of steps 1..i at the same anchor p (its own chain, including its own key): the
      lane-window slots of its lane ancestors and itself (`tree/draft_tree.py` lane masks).
No query sees another anchor's chain keys, and step 0 sees only (a). So step i's attention is the
causal [T, T] block against the step-0 keys plus i diagonal entries, one per chain key, all in one
softmax. With a chain (K = 1) this is exactly the engine's `lanes` call, step for step; with a
tree each lane is one such chain.

Loss targets: step i at anchor p predicts x[p+2+i], whose distribution under the target is the
target's softmax at row r = p+1+i, restricted to the draft vocabulary and renormalised. The
term counts when row r and the anchor lie in the same sequence and x[r+1] is a reply token
(`label_mask`), so nothing is learned across a sequence boundary, from a prompt token or from
padding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treespec_jax.models.config import Eagle3Config, LlamaConfig
from treespec_jax.models.llama import mlp_block, project_qkv, rms_norm

HIGHEST = jax.lax.Precision.HIGHEST
HEAD_PARAM_KEYS = ("fc", "input_norm", "hidden_norm", "layer", "norm", "lm_head")


def sequence_mask(segments: jax.Array) -> jax.Array:
    """`[B, T]` segment ids -> `[B, T, T]` bool: query t sees key s iff same segment and s <= t."""
    t = segments.shape[1]
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    return causal[None] & (segments[:, :, None] == segments[:, None, :])


def _grouped(q: jax.Array, num_kv: int) -> jax.Array:
    b, t, hq, d = q.shape
    return q.reshape(b, t, num_kv, hq // num_kv, d)


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array, extra_k=(), extra_v=()) -> jax.Array:
    """Softmax attention, fp32 scores and weights, output in q's dtype.

    `q [B, T, Hq, D]` sees keys `k, v [B, S, Hkv, D]` where `visible [B, T, S]`, and, for each
    pair in `extra_k / extra_v` (`[B, T, Hkv, D]` each), the one key at its own row (a chain key
    of the same anchor). All in one softmax.
    """
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5
    qg = _grouped(q, hkv)  # [B, T, Hkv, G, D]
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32, precision=HIGHEST) * scale
    s = jnp.where(visible[:, None, None], s, -jnp.inf)
    parts = [s]
    for ek in extra_k:
        parts.append(jnp.einsum("btkgd,btkd->bkgt", qg, ek, preferred_element_type=jnp.float32,
                                precision=HIGHEST)[..., None] * scale)
    w = jax.nn.softmax(jnp.concatenate(parts, -1) if extra_k else s, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", w[..., :k.shape[1]], v.astype(jnp.float32), precision=HIGHEST)
    for j, ev in enumerate(extra_v):
        out = out + jnp.einsum("bkgt,btkd->btkgd", w[..., k.shape[1] + j], ev.astype(jnp.float32), precision=HIGHEST)
    return out.reshape(b, t, hq, d).astype(q.dtype)


def target_forward(params: dict, cfg: LlamaConfig, tokens: jax.Array, positions: jax.Array, segments: jax.Array,
                   feature_layers: tuple[int, ...], logits: bool = True):
    """The target over packed rows -> (logits `[B, T, V]` f32 or the normed last hidden `[B, T, H]`,
    features `[B, T, len(feature_layers) * H]` in the params' dtype).

    Same computation as `Llama.__call__` over a prefill batch, per sequence.
    """
    visible = sequence_mask(segments)
    embed = params["embed"]
    x = embed[tokens]
    captured = {}
    for i in range(cfg.num_layers):
        if i in feature_layers:
            captured[i] = x
        p = params[f"layers_{i}"]
        q, k, v = project_qkv(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), positions, cfg)
        a = _attend(q, k, v, visible)
        x = x + a.reshape(a.shape[0], a.shape[1], cfg.q_width) @ p["wo"]
        x = x + mlp_block(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))
    if cfg.num_layers in feature_layers:
        captured[cfg.num_layers] = x
    features = jnp.concatenate([captured[i] for i in feature_layers], -1)
    xn = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    if not logits:
        return xn, features
    return target_logits(params, cfg, xn), features


def target_logits(params: dict, cfg: LlamaConfig, xn: jax.Array, rows=None) -> jax.Array:
    """Logits f32 of the normed hidden `xn` over the whole vocabulary, or over vocabulary `rows`."""
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    if rows is not None:
        w = w[:, rows]
    return (xn @ w.astype(xn.dtype)).astype(jnp.float32)


def label_mask(segments: jax.Array, reply: jax.Array) -> jax.Array:
    """`[B, T]` bool: row r's next token x[r+1] is a reply token of r's own sequence."""
    nxt_same = segments[:, 1:] == segments[:, :-1]
    m = nxt_same & reply[:, 1:] & (segments[:, :-1] >= 0)
    return jnp.concatenate([m, jnp.zeros_like(m[:, :1])], axis=1)


def shift_left(x: jax.Array, n: int, fill=0) -> jax.Array:
    """x[:, t + n] at t (along axis 1), `fill` past the end."""
    if n == 0:
        return x
    pad = jnp.full((x.shape[0], n) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, n:], pad], axis=1)


def step_valid(segments: jax.Array, labels: jax.Array, step: int) -> jax.Array:
    """`[B, T]` bool: step `step` at anchor p has a loss term (row p+1+step in p's sequence, labelled)."""
    r = 1 + step
    same = shift_left(segments, r, -2) == segments
    return same & shift_left(labels, r, False) & (segments >= 0)


class HeadStep:
    """One draft step of the head on aligned rows, split so the unrolled loop can keep the keys.

    `params` are the head's (layout of `drafter/eagle3.py`) in the compute dtype, `embed` the
    target's token embedding.
    """

    def __init__(self, cfg: Eagle3Config):
        self.cfg = cfg
        self.lc = cfg.as_layer_config()

    def project(self, params, features):
        return features.astype(params["fc"].dtype) @ params["fc"]

    def qkv(self, params, embed, tokens, h, positions):
        c = self.cfg
        e = embed[tokens].astype(h.dtype)
        x = jnp.concatenate([rms_norm(e, params["input_norm"], c.rms_norm_eps),
                             rms_norm(h, params["hidden_norm"], c.rms_norm_eps)], -1)
        return project_qkv(params["layer"], x, positions, self.lc)

    def finish(self, params, h, attn):
        """(logits `[B, T, Vd]` f32, t `[B, T, H]`) from the step's input h and attention output."""
        c, layer = self.cfg, params["layer"]
        b, t = attn.shape[:2]
        s = h + attn.reshape(b, t, self.lc.q_width) @ layer["wo"]
        out = s + mlp_block(layer, rms_norm(s, layer["mlp_norm"], c.rms_norm_eps))
        logits = rms_norm(out, params["norm"], c.rms_norm_eps) @ params["lm_head"]
        return logits.astype(jnp.float32), out


def head_unrolled(params: dict, embed: jax.Array, cfg: Eagle3Config, tokens: jax.Array, positions: jax.Array,
                  segments: jax.Array, features: jax.Array, num_steps: int, step_fn=None, remat: bool = False):
    """The unrolled draft (module docstring) -> list over steps of `step_fn(i, logits, t)`.

    `tokens / positions / segments [B, T]`, `features [B, T, 3Ht]` (the target's). Without
    `step_fn` the list holds each step's (logits `[B, T, Vd]` f32, t `[B, T, H]`), anchor-aligned:
    entry [b, p] of step i is the chain anchored at p. `step_fn` (e.g. a loss) lets each step's
    logits die inside the step; with `remat` each step is recomputed in the backward pass.
    """
    head = HeadStep(cfg)
    visible = sequence_mask(segments)
    h = head.project(params, features)
    k0 = v0 = None
    chain_k, chain_v = [], []
    results = []
    for i in range(num_steps):
        toks = shift_left(tokens, 1 + i)

        def step(params, embed, h, k0, v0, chain_k, chain_v, i=i, toks=toks):
            q, k, v = head.qkv(params, embed, toks, h, positions + i)
            if i == 0:
                k0, v0 = k, v
                attn = _attend(q, k, v, visible)
            else:
                attn = _attend(q, k0, v0, visible, tuple(chain_k) + (k,), tuple(chain_v) + (v,))
            logits, t = head.finish(params, h, attn)
            out = (logits, t) if step_fn is None else step_fn(i, logits, t)
            return out, t, k, v

        if remat:
            step = jax.checkpoint(step)
        out, t, k, v = step(params, embed, h, k0, v0, tuple(chain_k), tuple(chain_v))
        if i == 0:
            k0, v0 = k, v
        else:
            chain_k.append(k)
            chain_v.append(v)
        results.append(out)
        h = t
    return results


def ttt_loss(params: dict, embed: jax.Array, cfg: Eagle3Config, batch: dict, target_probs: jax.Array,
             target_top1_draft: jax.Array, num_steps: int, decay: float, remat: bool = False):
    """Weighted soft cross-entropy of the unrolled draft -> (loss, metrics).

    `batch`: tokens / positions / segments / reply `[B, T]` and features `[B, T, 3Ht]`.
    `target_probs [B, T, Vd]` f32: the target's softmax at each row over the draft vocabulary,
    renormalised. `target_top1_draft [B, T]` int32: the draft id of the target's argmax at each
    row over the whole vocabulary, -1 when that token is outside the draft vocabulary (for the
    greedy-acceptance proxy: the head's top-1 equals the target's top-1).
    metrics: per step `loss [S]`, `acc [S]` (top-1 agreement), `count [S]` (loss terms).
    """
    segments = batch["segments"]
    labels = label_mask(segments, batch["reply"])

    def step_fn(i, logits, t):
        valid = step_valid(segments, labels, i)
        probs = shift_left(target_probs, 1 + i)
        logq = jax.nn.log_softmax(logits, axis=-1)
        ce = -jnp.sum(probs * logq, axis=-1)
        top1 = shift_left(target_top1_draft, 1 + i, -1)
        hit = (jnp.argmax(logits, axis=-1) == top1) & valid
        n = jnp.sum(valid)
        return (jnp.sum(jnp.where(valid, ce, 0.0)) / jnp.maximum(n, 1), jnp.sum(hit) / jnp.maximum(n, 1), n)

    outs = head_unrolled(params, embed, cfg, batch["tokens"], batch["positions"], segments, batch["features"],
                         num_steps, step_fn, remat)
    losses = jnp.stack([o[0] for o in outs])
    weights = jnp.asarray([decay ** i for i in range(num_steps)], jnp.float32)
    metrics = {"loss": losses, "acc": jnp.stack([o[1] for o in outs]), "count": jnp.stack([o[2] for o in outs])}
    return jnp.sum(weights * losses), metrics
