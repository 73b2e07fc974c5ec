"""Keyed Gumbel-max sampling: the one function that decides a sampled token.

The token at absolute position t of a request is

    argmax_v( masked_logits[v] / temperature + g[v] ),   g = -log(-log u),
    u = uniform(fold_in(key(seed), t), [V])

with ties going to the lowest vocabulary id (`jnp.argmax` returns the first maximum). The draw
depends only on (seed, t), the logits and the request's temperature / top-k / top-p, never on the
row, batch slot or tree node that asks for it. Plain decoding, chain verify and every node of a
draft tree call `sample_at`, so a tree node at depth d (predicting position vc + d + 1) draws
exactly what plain decoding draws at that position.

Temperature 0 means greedy: plain argmax of the raw logits (top-k / top-p cannot change an argmax,
because the most likely token always survives both masks).

Masks, applied in this order and computed the same way on every path:
- top-k keeps the k tokens of highest logit, ties broken toward the lower id (exactly k survive);
  k = 0 or k >= V disables it.
- top-p keeps the shortest prefix of the tokens sorted by (probability desc, id asc) whose mass
  reaches top_p, where probabilities are softmax(logits / temperature) over the top-k survivors;
  the most likely token always survives. top_p = 1 disables it.
Masked logits become -inf before the Gumbel noise is added, so a masked token can never win.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class SamplingParams:
    """Per-request sampling parameters, each `[B]` (or any shape that is a prefix of the logits'
    leading shape; it broadcasts over the trailing leading axes, e.g. `[B]` over `[B, N, V]`)."""

    temperature: jax.Array  # float32; 0 = greedy, > 0 = Gumbel-max over logits / temperature
    top_k: jax.Array  # int32; 0 (or >= V) keeps every token, else the k most likely survive
    top_p: jax.Array  # float32 in (0, 1]; 1 keeps every token, else the nucleus of mass top_p

    @classmethod
    def create(cls, temperature, top_k=None, top_p=None) -> "SamplingParams":
        """Builds and validates parameters from host values; raises ValueError naming bad entries.

        Traced inputs (inside jit) skip the value checks; build params on the host to get them.
        """
        traced = any(isinstance(x, jax.core.Tracer) for x in (temperature, top_k, top_p))
        # Host values are checked as numpy before they reach the device: reading a device array
        # back would wait for whatever the device is still running.
        xp = jnp if traced else np
        temperature = xp.asarray(temperature, np.float32)
        top_k = xp.zeros(temperature.shape, np.int32) if top_k is None else xp.asarray(top_k, np.int32)
        top_p = xp.ones(temperature.shape, np.float32) if top_p is None else xp.asarray(top_p, np.float32)
        if not (temperature.shape == top_k.shape == top_p.shape):
            raise ValueError(
                f"temperature, top_k and top_p need one shape, got {temperature.shape}, {top_k.shape}, {top_p.shape}")
        if not traced:
            t, k, p = temperature, top_k, top_p
            bad_t = ~(np.isfinite(t) & (t >= 0))
            if bad_t.any():
                raise ValueError(f"temperature must be finite and >= 0; bad values {t[bad_t].tolist()}")
            if (k < 0).any():
                raise ValueError(f"top_k must be >= 0 (0 disables it); bad values {k[k < 0].tolist()}")
            bad_p = ~((p > 0) & (p <= 1))
            if bad_p.any():
                raise ValueError(f"top_p must lie in (0, 1]; bad values {p[bad_p].tolist()}")
            temperature, top_k, top_p = jnp.asarray(t), jnp.asarray(k), jnp.asarray(p)
        return cls(temperature=temperature, top_k=top_k, top_p=top_p)

    @classmethod
    def greedy(cls, batch: int) -> "SamplingParams":
        """Temperature 0 for `batch` requests."""
        return cls.create(np.zeros((batch,), np.float32))


def _broadcast_lead(x: jax.Array, lead_shape: tuple[int, ...], name: str) -> jax.Array:
    """Broadcasts a per-request array whose shape is a prefix of `lead_shape` over the rest."""
    x = jnp.asarray(x)
    if x.shape != lead_shape[: x.ndim]:
        raise ValueError(f"{name} has shape {x.shape}, which is not a prefix of the logits' leading shape {lead_shape}")
    return jnp.broadcast_to(x.reshape(x.shape + (1,) * (len(lead_shape) - x.ndim)), lead_shape)


def gumbel_noise(seed: jax.Array, position: jax.Array, vocab: int) -> jax.Array:
    """`[V]` float32 Gumbel noise for one (seed, position); the only source of randomness here."""
    key = jax.random.fold_in(jax.random.key(seed), position)
    # minval = tiny keeps log(u) finite; maxval 1 is exclusive, so -log(u) > 0.
    u = jax.random.uniform(key, (vocab,), jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    return -jnp.log(-jnp.log(u))


def filter_logits(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p mask on one row. `scaled [V]` = logits / temperature -> `[V]`, masked -inf."""
    vocab = scaled.shape[-1]
    ids = jnp.arange(vocab, dtype=jnp.int32)
    # Sort by (value desc, id asc): a stable argsort of the negated values keeps lower ids first.
    order = jnp.argsort(-scaled, stable=True)
    rank = jnp.zeros((vocab,), jnp.int32).at[order].set(ids)
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    keep = rank < k
    sorted_vals = jnp.where(jnp.arange(vocab) < k, scaled[order], -jnp.inf)
    probs = jax.nn.softmax(sorted_vals)
    mass_before = jnp.cumsum(probs) - probs
    # Keep a sorted token while the mass strictly before it is below top_p (rank 0 always stays).
    # top_p >= 1 keeps everything explicitly: a float32 cumsum can reach 1.0 before the tail.
    keep_sorted = (mass_before < top_p) | (top_p >= 1.0) | (jnp.arange(vocab) == 0)
    keep = keep & keep_sorted[rank]
    return jnp.where(keep, scaled, -jnp.inf)


# What a batch's draw has to compute, when the caller knows its rows' parameters (the engine does,
# on the host): "argmax" when no row samples, "gumbel" when rows sample but none masks, "filtered"
# when some row asks for top-k or top-p. "auto" decides both on the device with `lax.cond`, which
# XLA's GPU runtime resolves by copying the predicate to the host and waiting for it: the host
# then cannot run ahead of the device, so a serving loop passes what it knows instead.
DRAWS = ("auto", "argmax", "gumbel", "filtered")


def _asks_for_mask(top_k, top_p, vocab: int):
    """Rows whose top-k or top-p masks anything (numpy or jax arrays, elementwise)."""
    return ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)


def draw_for(temperature, top_k, top_p, vocab: int) -> str:
    """The least `draw` that is exact for host rows with these parameters (numpy or lists)."""
    t, k, p = (np.asarray(x) for x in (temperature, top_k, top_p))
    sampled = t > 0
    if not sampled.any():
        return "argmax"
    return "filtered" if (sampled & _asks_for_mask(k, p, vocab)).any() else "gumbel"


def _sample_rows(logits, seeds, positions, temperature, top_k, top_p, draw: str = "auto"):
    """Flat rows: `logits [R, V]`, the rest `[R]` -> `[R]` int32 tokens. `draw` (one of DRAWS)
    must cover every row: "argmax" returns the argmax of sampled rows too."""
    if draw not in DRAWS:
        raise ValueError(f"draw must be one of {DRAWS}, got {draw!r}")
    vocab = logits.shape[-1]
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if draw == "argmax":
        return greedy
    sampled_row = temperature > 0
    scaled = logits / jnp.where(sampled_row, temperature, 1.0)[:, None]
    # The masks need a per-row sort over the vocabulary: only when some sampled row asks for them.
    filtered = lambda x: jax.vmap(filter_logits)(x, top_k, top_p)  # noqa: E731
    if draw == "filtered":
        scaled = filtered(scaled)
    elif draw == "auto":
        wants_mask = sampled_row & _asks_for_mask(top_k, top_p, vocab)
        scaled = jax.lax.cond(jnp.any(wants_mask), filtered, lambda x: x, scaled)

    def noisy(x):
        noise = jax.vmap(gumbel_noise, in_axes=(0, 0, None))(seeds, positions, vocab)
        return jnp.argmax(x + noise, axis=-1).astype(jnp.int32)

    # The noise costs R x V uniforms and two logs; "auto" skips it for an all-greedy batch.
    if draw == "auto":
        sampled = jax.lax.cond(jnp.any(sampled_row), noisy, lambda x: greedy, scaled)
    else:
        sampled = noisy(scaled)
    return jnp.where(sampled_row, sampled, greedy)


def target_probs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The distribution `sample_at` draws from: `logits [..., V]` -> probabilities `[..., V]` f32.

    Softmax of the top-k / top-p filtered logits / temperature; a temperature-0 row is the one-hot
    of its argmax. Rejection sampling verifies against exactly this, so both samplers honour the
    same masks. `params` fields are per request, a prefix of the leading shape.
    """
    lead, vocab = logits.shape[:-1], logits.shape[-1]
    cols = [_broadcast_lead(x, lead, f"params.{n}").reshape(-1)
            for n, x in (("temperature", params.temperature), ("top_k", params.top_k), ("top_p", params.top_p))]
    temperature, top_k, top_p = cols
    flat = logits.reshape((-1, vocab)).astype(jnp.float32)
    sampled_row = temperature > 0
    scaled = jax.vmap(filter_logits)(flat / jnp.where(sampled_row, temperature, 1.0)[:, None], top_k, top_p)
    greedy = jax.nn.one_hot(jnp.argmax(flat, axis=-1), vocab, dtype=jnp.float32)
    probs = jnp.where(sampled_row[:, None], jax.nn.softmax(scaled, axis=-1), greedy)
    return probs.reshape(logits.shape)


def sample_at(logits: jax.Array, seeds: jax.Array, positions: jax.Array, params: SamplingParams,
              draw: str = "auto") -> jax.Array:
    """Keyed draw for every row of `logits [..., V]` -> tokens `[...]` int32.

    `positions [...]` int32 is the absolute position of the token being decided (for a verify node
    at depth d: vc + d + 1). `seeds` and the fields of `params` are per request: their shape is a
    prefix of `logits.shape[:-1]` (e.g. `[B]` for `[B, N, V]`) and they broadcast over the rest.
    `draw` (static, one of DRAWS) is what the rows need computed, from `draw_for` where the
    parameters are known on the host; the default decides on the device.
    """
    lead = logits.shape[:-1]
    positions = jnp.asarray(positions, jnp.int32)
    if positions.shape != lead:
        raise ValueError(f"positions has shape {positions.shape}; expected the logits' leading shape {lead}")
    cols = [
        _broadcast_lead(jnp.asarray(seeds, jnp.int32), lead, "seeds"),
        positions,
        _broadcast_lead(params.temperature, lead, "params.temperature"),
        _broadcast_lead(params.top_k, lead, "params.top_k"),
        _broadcast_lead(params.top_p, lead, "params.top_p"),
    ]
    flat = [c.reshape(-1) for c in cols]
    tokens = _sample_rows(logits.reshape((-1, logits.shape[-1])), *flat, draw=draw)
    return tokens.reshape(lead)


def greedy_tokens(logits: jax.Array) -> jax.Array:
    """`[..., V] -> [...]` int32 argmax with ties to the lowest id (temperature 0)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
