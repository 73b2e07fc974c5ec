"""Tiny random fp32 targets, drafters and engines shared by the engine tests."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from treespec_jax.config import (BackendsConfig, KVCacheConfig, ModelConfig, SamplingConfig, SchedulerConfig,
                                 ServeConfig, SpeculativeConfig)
from treespec_jax.drafter.oracle import ModelDrafter
from treespec_jax.engine import Engine, Request
from treespec_jax.engine.loading import attention_for
from treespec_jax.models.config import LlamaConfig
from treespec_jax.models.llama import LlamaModel, apply_rope, init_params, mlp_block, rms_norm, rope_inv_freq

PAGE = 16
# The jitted programs an `Engine` launches, as JAX's compile log names them.
ENGINE_PROGRAMS = ("jit(step)", "jit(_prefill_chunk)", "jit(_draft_prefill_chunk)", "jit(_admit_slots)",
                   "jit(_release_slot)", "jit(first_token)")


@contextlib.contextmanager
def engine_programs_lowered():
    """Yields a list that collects the engine programs (`ENGINE_PROGRAMS`) lowered while the block
    runs: JAX logs a program each time it lowers it for a new signature, a cache miss."""
    lowered = []

    class Compiles(logging.Handler):
        def emit(self, record):
            words = record.getMessage().split(" ")
            if words[0] == "Compiling" and len(words) > 1 and words[1] in ENGINE_PROGRAMS:
                lowered.append(words[1])

    logger, handler, level = logging.getLogger("jax"), Compiles(), logging.getLogger("jax").level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles(True):
            yield lowered
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def tiny_config(family: str = "llama", vocab: int = 64, layers: int = 2, **kw) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=4,
                       num_kv_heads=2, head_dim=16, rope_theta=1e4, max_position_embeddings=512,
                       attention_bias=family == "qwen2", qk_norm=family == "qwen3", family=family, **kw)


@functools.lru_cache(maxsize=None)
def tiny_target(family: str = "llama", vocab: int = 64, seed: int = 0, scale: float = 2.0, layers: int = 2):
    """A sharp random model (scale 2 makes its distributions peaked, so greedy paths repeat)."""
    cfg = tiny_config(family, vocab, layers)
    return cfg, init_params(cfg, jax.random.key(seed), scale=scale)


def serve_config(algorithm="NONE", topk=1, steps=3, nodes=None, *, sampler="greedy", temperature=0.0, top_p=1.0,
                 attention="dense", kernel="pallas", slots=2, kv="auto", chunk=16, total_tokens=4096) -> ServeConfig:
    spec = SpeculativeConfig() if algorithm == "NONE" else SpeculativeConfig(
        algorithm=algorithm, topk=topk, num_steps=steps, num_draft_tokens=nodes)
    return ServeConfig(
        model=ModelConfig(dtype="fp32"), speculative=spec,
        kv_cache=KVCacheConfig(dtype=kv, page_size=PAGE, max_total_tokens=total_tokens),
        scheduler=SchedulerConfig(max_running_requests=slots, chunked_prefill_size=chunk),
        sampling=SamplingConfig(backend=sampler, temperature=temperature, top_p=top_p),
        backends=BackendsConfig(attention_backend=attention, kernel_backend=kernel))


def with_cuda_graphs(config: ServeConfig, mode: str) -> ServeConfig:
    """`config` with `backends.cuda_graphs = mode`."""
    return config.replace(backends=dataclasses.replace(config.backends, cuda_graphs=mode))


@functools.lru_cache(maxsize=None)
def cached_engine(config: ServeConfig, noise: float = 1.0) -> Engine:
    """One engine per (config, noise) for the whole test session: every engine costs its jit
    compilations, and `decode` leaves an engine as it found it (slots and pages all free)."""
    return oracle_engine(config, noise=noise)


def oracle_engine(config: ServeConfig, family="llama", vocab=64, noise=1.0, seed=0, tokenizer=None) -> Engine:
    """An engine whose drafter is the target itself (noise > 0: the noisy oracle), or plain."""
    cfg, params = tiny_target(family, vocab, seed)
    drafter = None
    if config.speculative.enabled:
        drafter = ModelDrafter(LlamaModel(cfg, attention_for(config)), noise=noise, noise_seed=seed + 1)
    return Engine(config, cfg, params, drafter, params if drafter else None, tokenizer=tokenizer)


def mixed_requests(vocab=64, seed=0, **kw) -> list[Request]:
    """Prompts of different lengths (one longer than a prefill chunk, one a page boundary) and
    different budgets, more requests than slots, so requests join and finish mid-batch."""
    rng = np.random.default_rng(seed)
    shapes = [(5, 14), (20, 9), (3, 17), (33, 6), (16, 11)]
    return [Request(prompt=rng.integers(0, vocab, size=n).tolist(), max_new_tokens=m, seed=100 + i, **kw)
            for i, (n, m) in enumerate(shapes)]


def dense_forward(cfg: LlamaConfig, params: dict, tokens: np.ndarray) -> np.ndarray:
    """One full causal forward with no cache (fp32, jnp): `tokens [T]` -> logits `[T, V]`."""
    x = params["embed"][jnp.asarray(tokens)][None]
    t = x.shape[1]
    pos = jnp.arange(t)[None]
    inv = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    causal = jnp.tril(jnp.ones((t, t), bool))
    for i in range(cfg.num_layers):
        p = params[f"layers_{i}"]
        h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
        q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
        if "bq" in p:
            q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
        q = q.reshape(1, t, cfg.num_heads, cfg.head_dim)
        k = k.reshape(1, t, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(1, t, cfg.num_kv_heads, cfg.head_dim)
        if "q_norm" in p:
            q, k = rms_norm(q, p["q_norm"], cfg.rms_norm_eps), rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        q, k = apply_rope(q, pos, inv), apply_rope(k, pos, inv)
        g = cfg.num_heads // cfg.num_kv_heads
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") / np.sqrt(cfg.head_dim)
        s = jnp.where(causal, s, -jnp.inf)
        a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v, precision="highest")
        x = x + a.reshape(1, t, -1) @ p["wo"]
        x = x + mlp_block(p, rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps))
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return np.asarray((x @ head)[0], np.float32)
