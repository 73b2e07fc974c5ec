"""EAGLE-3 draft head and the EAGLE-style single-depth MTP drafter.

EAGLE-3 (`Eagle3Head`): one decoder layer whose q/k/v read `[input_norm(embed(token)) ;
hidden_norm(h)]` (width 2H), with `h = fc(target features)` (the inputs of target layers 2, L//2,
L-3, concatenated to 3Ht) on rows that come from the target, or the head's own previous output
on lane rows. The residual stream starts at h: `s = h + attn(.)`, `t = s + mlp(mlp_norm(s))`;
`t` (before the final norm) is the recurrent feature the next step continues from, and
`lm_head(norm(t))` scores the draft vocabulary, whose id i is target id i + d2t[i]. The layer is
loaded and trained with separate q/k/v and gate/up weights and served fused
(`Eagle3Drafter.serving_params`, the target's column order: `models.llama.fuse_layer`).

Draft position p holds the row (feature of target token p, token p + 1): so step 0 over the
accepted path puts row d (feature of path node d, the target's token after it) at vc + d, and
the frontier after it is the new committed length.

MTP (`MtpHead`): `x = eh_proj([enorm(embed(token)) ; hnorm(h)])` with h the target's last hidden
state (before its final norm), one full decoder layer, its own final norm, and the target's LM
head over the full vocabulary. Same positions and recurrence as EAGLE-3.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from treespec_jax.drafter.base import AcceptedRows, Drafter, score_candidates
from treespec_jax.models.attention import PagedAttention, lanes_batch, prefill_batch
from treespec_jax.models.config import Eagle3Config, LlamaConfig
from treespec_jax.models.llama import (DTYPES, DecoderLayer, attention_block, fuse_layer, mlp_block,
                                       projection_params, rms_norm)

DRAFT_K, DRAFT_V = "draft_k0", "draft_v0"


class Eagle3Head(nn.Module):
    """`(embed, tokens [B, T], h [B, T, 3Ht or H], pools, batch)` -> (logits `[B, T, Vd]` f32, t `[B, T, H]`, pools)."""

    cfg: Eagle3Config
    attention: PagedAttention
    project: bool  # h is 3Ht target features (run fc) rather than the head's own H-wide output

    @nn.compact
    def __call__(self, embed, tokens, h, k_pool, v_pool, batch):
        c = self.cfg
        lc = c.as_layer_config()
        H, F, qw = c.hidden_size, c.intermediate_size, lc.q_width
        init = lambda key, shape: jax.random.normal(key, shape) / np.sqrt(shape[0])
        ones = nn.initializers.ones
        fc = self.param("fc", init, (3 * c.target_hidden_size, H))
        input_norm = self.param("input_norm", ones, (H,))
        hidden_norm = self.param("hidden_norm", ones, (H,))
        layer = {"wo": self.param("wo", init, (qw, H)), "mlp_norm": self.param("mlp_norm", ones, (H,)),
                 "w_down": self.param("w_down", init, (F, H))}
        # Serving reads the fused layer (`Eagle3Drafter.serving_params`); init and training the separate one.
        layer.update(projection_params(self, init, 2 * H, H, F, lc))
        norm = self.param("norm", ones, (H,))
        lm_head = self.param("lm_head", init, (H, c.draft_vocab_size))
        if self.project:
            h = h.astype(fc.dtype) @ fc
        e = embed[tokens].astype(h.dtype)
        x = jnp.concatenate([rms_norm(e, input_norm, c.rms_norm_eps), rms_norm(h, hidden_norm, c.rms_norm_eps)], -1)
        a, k_pool, v_pool = attention_block(layer, x, k_pool, v_pool, batch, self.attention, lc)
        s = h + a
        t = s + mlp_block(layer, rms_norm(s, layer["mlp_norm"], c.rms_norm_eps))
        logits = rms_norm(t, norm, c.rms_norm_eps) @ lm_head
        return logits.astype(jnp.float32), t, k_pool, v_pool


def head_apply(module: nn.Module, params: dict, *args):
    """Applies a head module to its own parameters (the `layer` sub-dict flattened in)."""
    flat = {k: v for k, v in params.items() if k not in ("layer", "d2t", "t2d", "embed", "lm_head_target")}
    flat.update(params.get("layer", {}))
    return module.apply({"params": flat}, *args)


class _HeadDrafter(Drafter):
    """Shared round logic of the EAGLE-3 and MTP heads (one draft layer, position p = (f_p, t_{p+1}))."""

    head_cfg: LlamaConfig  # the draft layer's heads / RoPE

    def pool_specs(self):
        row = (self.head_cfg.num_kv_heads, self.head_cfg.head_dim)
        return {DRAFT_K: (row, "key"), DRAFT_V: (row, "value")}

    def _run(self, params, pools, tokens, h, batch, project: bool):
        raise NotImplementedError

    def prefill(self, params, pools, tokens, next_tokens, features, page_table, start, valid):
        batch = prefill_batch(page_table, start, valid, tokens.shape[1], self.attention.page_size)
        _, _, pools = self._run(params, pools, next_tokens, features, batch, True)
        return pools

    def step0(self, params, pools, accepted: AcceptedRows):
        logits, feats, pools = self._run(params, pools, jnp.maximum(accepted.predicts, 0), accepted.features,
                                         accepted.chain_window(self.attention.page_size), True)
        last = (accepted.accept_len - 1)[:, None]
        root_logits = jnp.take_along_axis(logits, last[:, :, None], axis=1)[:, 0]
        root_feature = jnp.take_along_axis(feats, last[:, :, None], axis=1)[:, 0]
        return pools, root_logits, root_feature, accepted.start + accepted.accept_len

    def lanes(self, params, pools, tokens, features, lane_mask, frontier, step, num_steps, page_table):
        k = tokens.shape[1]
        positions = jnp.broadcast_to((frontier + step - 1)[:, None], (tokens.shape[0], k))
        batch = lanes_batch(page_table, frontier, positions, lane_mask, step, num_steps, self.attention.page_size)
        logits, feats, pools = self._run(params, pools, tokens, features, batch, False)
        return pools, logits, feats


class Eagle3Drafter(_HeadDrafter):
    """An EAGLE-3 head over the target's embedding (params: the head's + `embed`, the target's)."""

    def __init__(self, cfg: Eagle3Config, target_cfg: LlamaConfig, attention: PagedAttention):
        problems = cfg.target_problems(target_cfg)
        if problems:
            raise ValueError("EAGLE-3 head does not fit the target: " + "; ".join(problems))
        self.cfg = cfg
        self.head_cfg = cfg.as_layer_config()
        self.attention = attention
        self.feature_layers = target_cfg.eagle3_feature_layers
        self.feature_width = cfg.hidden_size
        self.module = Eagle3Head(cfg, attention, True)
        self.lane_module = Eagle3Head(cfg, attention, False)

    def serving_params(self, params):
        """The head's layer with fused q/k/v and gate/up projections (`models.llama.fuse_layer`):
        each draft step runs three matmuls fewer."""
        return {**params, "layer": fuse_layer(params["layer"], self.head_cfg)}

    def _run(self, params, pools, tokens, h, batch, project):
        module = self.module if project else self.lane_module
        logits, t, pools[DRAFT_K], pools[DRAFT_V] = head_apply(module, params, params["embed"], tokens, h,
                                                               pools[DRAFT_K], pools[DRAFT_V], batch)
        return logits, t, pools

    def score(self, params, logits, topk):
        vd = self.cfg.draft_vocab_size
        d2t = jnp.arange(vd, dtype=jnp.int32) + params["d2t"].astype(jnp.int32)
        return score_candidates(logits, topk, d2t)


def init_eagle3_params(cfg: Eagle3Config, key: jax.Array, dtype: str = "fp32") -> dict:
    """Random head parameters in the documented layout; d2t maps the draft vocabulary onto the
    first `draft_vocab_size` target ids in a shuffled order (so the map is really exercised)."""
    dt = DTYPES[dtype]
    H, F = cfg.hidden_size, cfg.intermediate_size
    lc = cfg.as_layer_config()
    keys = iter(jax.random.split(key, 16))
    mat = lambda shape: (jax.random.normal(next(keys), shape) / np.sqrt(shape[0])).astype(dt)
    vec = lambda shape: (1.0 + 0.1 * jax.random.normal(next(keys), shape)).astype(dt)
    ids = np.random.default_rng(int(jax.random.randint(next(keys), (), 0, 2**30))).permutation(cfg.vocab_size)
    ids = np.sort(ids[:cfg.draft_vocab_size])
    return {
        "fc": mat((3 * cfg.target_hidden_size, H)), "input_norm": vec((H,)), "hidden_norm": vec((H,)),
        "layer": {"wq": mat((2 * H, lc.q_width)), "wk": mat((2 * H, lc.kv_width)), "wv": mat((2 * H, lc.kv_width)),
                  "wo": mat((lc.q_width, H)), "mlp_norm": vec((H,)), "w_gate": mat((H, F)), "w_up": mat((H, F)),
                  "w_down": mat((F, H))},
        "norm": vec((H,)), "lm_head": mat((H, cfg.draft_vocab_size)),
        "d2t": jnp.asarray(ids - np.arange(cfg.draft_vocab_size), jnp.int32),
    }


class MtpHead(nn.Module):
    """EAGLE-style MTP module: eh_proj over [enorm(embed) ; hnorm(h)], one decoder layer, norm,
    the target's LM head. -> (logits `[B, T, V]` f32, t `[B, T, H]`, pools)."""

    cfg: LlamaConfig
    attention: PagedAttention

    @nn.compact
    def __call__(self, embed, lm_head, tokens, h, k_pool, v_pool, batch):
        c = self.cfg
        H = c.hidden_size
        ones = nn.initializers.ones
        enorm = self.param("enorm", ones, (H,))
        hnorm = self.param("hnorm", ones, (H,))
        eh_proj = self.param("eh_proj", lambda k, s: jax.random.normal(k, s) / np.sqrt(s[0]), (2 * H, H))
        norm = self.param("norm", ones, (H,))
        e = embed[tokens].astype(h.dtype)
        x = jnp.concatenate([rms_norm(e, enorm, c.rms_norm_eps), rms_norm(h, hnorm, c.rms_norm_eps)], -1) @ eh_proj
        mid, mlp_out, k_pool, v_pool = DecoderLayer(c, self.attention, name="layer")(x, k_pool, v_pool, batch)
        t = mid + mlp_out
        logits = rms_norm(t, norm, c.rms_norm_eps) @ lm_head
        return logits.astype(jnp.float32), t, k_pool, v_pool


class MtpDrafter(_HeadDrafter):
    """Single-depth MTP re-run at every draft step (so it can branch). Params: enorm, hnorm,
    eh_proj, layer (a target-layout decoder layer), norm, plus the target's `embed` and LM head
    (`lm_head_target [H, V]`: the target's lm_head, or embed^T when tied)."""

    def __init__(self, target_cfg: LlamaConfig, attention: PagedAttention):
        self.head_cfg = LlamaConfig(**{**target_cfg.__dict__, "num_layers": 1})
        self.attention = attention
        self.feature_layers = (target_cfg.num_layers,)
        self.feature_width = target_cfg.hidden_size
        self.module = MtpHead(self.head_cfg, attention)

    def _run(self, params, pools, tokens, h, batch, project):
        flat = {k: v for k, v in params.items() if k not in ("embed", "lm_head_target")}
        logits, t, pools[DRAFT_K], pools[DRAFT_V] = self.module.apply(
            {"params": flat}, params["embed"], params["lm_head_target"], tokens, h, pools[DRAFT_K], pools[DRAFT_V],
            batch)
        return logits, t, pools


def init_mtp_params(cfg: LlamaConfig, key: jax.Array, dtype: str = "fp32") -> dict:
    """Random MTP module parameters (without the target's embed / LM head)."""
    from treespec_jax.models.llama import init_params

    one = LlamaConfig(**{**cfg.__dict__, "num_layers": 1})
    k1, k2 = jax.random.split(key)
    layer = init_params(one, k1, dtype)["layers_0"]
    dt = DTYPES[dtype]
    ks = jax.random.split(k2, 4)
    H = cfg.hidden_size
    return {"enorm": (1 + 0.1 * jax.random.normal(ks[0], (H,))).astype(dt),
            "hnorm": (1 + 0.1 * jax.random.normal(ks[1], (H,))).astype(dt),
            "eh_proj": (jax.random.normal(ks[2], (2 * H, H)) / np.sqrt(2 * H)).astype(dt),
            "norm": (1 + 0.1 * jax.random.normal(ks[3], (H,))).astype(dt), "layer": layer}
