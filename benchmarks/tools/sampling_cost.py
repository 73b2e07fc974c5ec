"""What one decode step's token draw costs on the GPU, by sampling setting: `sample_at` on
`[B, V]` fp32 logits (SmolLM2's V = 49152) for greedy rows, temperature 0.8, and temperature 0.8
with top-p 0.9, next to a plain argmax in the same run. The draw holds a device-side branch (the
top-k / top-p sort is skipped when no row asks for it); `t0.8_no_branch` times the same draw with
the branch resolved at trace time (a copy of `keyed._sample_rows` without it), to see what the
branch itself costs.

    PYTHONPATH=. python benchmarks/tools/sampling_cost.py [--batches 1,8,64] [--vocab 49152]

Prints one JSON line per batch: microseconds per call (median of repeated jitted calls).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.timing import median_time
from treespec_jax.sampling import keyed
from treespec_jax.sampling.keyed import SamplingParams, sample_at


def _unbranched(logits, seeds, positions, temperature, top_k, top_p):
    """`keyed._sample_rows` with the filter branch taken out (no row here asks for top-k/top-p)."""
    logits = logits.astype(jnp.float32)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled_row = temperature > 0
    scaled = logits / jnp.where(sampled_row, temperature, 1.0)[:, None]
    noise = jax.vmap(keyed.gumbel_noise, in_axes=(0, 0, None))(seeds, positions, logits.shape[-1])
    sampled = jnp.argmax(scaled + noise, axis=-1).astype(jnp.int32)
    return jnp.where(sampled_row, sampled, greedy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    for b in (int(x) for x in args.batches.split(",")):
        rng = np.random.default_rng(b)
        logits = jnp.asarray(rng.standard_normal((b, args.vocab)) * 4, jnp.float32)
        seeds = jnp.arange(b, dtype=jnp.int32)
        positions = jnp.full((b,), 100, jnp.int32)
        settings = {"greedy": SamplingParams.greedy(b),
                    "t0.8": SamplingParams.create(jnp.full((b,), 0.8)),
                    "t0.8_top_p0.9": SamplingParams.create(jnp.full((b,), 0.8), top_p=jnp.full((b,), 0.9))}
        row = {"batch": b, "vocab": args.vocab, "device": jax.devices()[0].device_kind}
        row["argmax_us"] = 1e6 * median_time(jax.jit(lambda x: jnp.argmax(x, -1)), logits)
        draw = jax.jit(sample_at)
        for name, params in settings.items():
            row[f"{name}_us"] = 1e6 * median_time(draw, logits, seeds, positions, params)
        t08 = settings["t0.8"]
        row["t0.8_no_branch_us"] = 1e6 * median_time(jax.jit(_unbranched), logits, seeds, positions,
                                                     t08.temperature, t08.top_k, t08.top_p)
        print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


if __name__ == "__main__":
    main()
