"""Do the 8B-shaped decode step's weight matmuls read at copy bandwidth, and would fusing them help?

    PYTHONPATH=. python3 benchmarks/tools/gemv_probe.py [--batches 1,8] [--layers 32] [--layouts separate,fused]
        [--out DIR]

A Llama-3.1-8B-shaped stack of projections only (no attention, norms or RoPE: those read no
weights): per layer q/k/v, o, gate/up and down, then the 128k lm_head, with random bf16 weights, in
two layouts:
  - separate: seven matmuls per layer, the model's layout (`wq`, `wk`, `wv`, `w_gate`, `w_up`);
  - fused: q/k/v in one `[H, Q + 2 KV]` matmul and gate/up in one `[H, 2F]` matmul (four per layer),
    gate and up as the two halves of its columns, or (`fused-pairs`) in the model's order, gate
    column j next to up column j (`models.llama.fuse_projections`): whether XLA fuses the SwiGLU
    product into the down matmul in one order and not the other. `--layouts` picks among the three.
Each is traced as a jitted chain of passes (`benchmarks.timing.traced_chain`) and reported as
device ms per pass, against its floor (weight bytes / measured copy bandwidth), with the kernels
that took the time. If the separate stack is well above its floor and the fused one is not, the
model's step misses its floor on the small matmuls' launches and tails, and fused projections are
the fix; if both are above, the matmul kernel itself reads below bandwidth at this batch.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp

from benchmarks.timing import feed_scalar, measure_copy_bandwidth, span_per_call, traced_chain

H, Q, KV, F, V = 4096, 4096, 1024, 14336, 128256


def make_weights(layers: int, fused: bool, key) -> dict:
    """Random bf16 weights `[in, out]` of `layers` layers in one layout, plus the lm_head."""
    def mat(k, shape):
        return (jax.random.normal(k, shape, jnp.float32) / shape[0] ** 0.5).astype(jnp.bfloat16)

    out = {"layers": []}
    for i in range(layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 7)
        if fused:
            w = {"wqkv": mat(ks[0], (H, Q + 2 * KV)), "w_gate_up": mat(ks[1], (H, 2 * F))}
        else:
            w = {"wq": mat(ks[0], (H, Q)), "wk": mat(ks[1], (H, KV)), "wv": mat(ks[2], (H, KV)),
                 "w_gate": mat(ks[3], (H, F)), "w_up": mat(ks[4], (H, F))}
        w.update(wo=mat(ks[5], (Q, H)), w_down=mat(ks[6], (F, H)))
        out["layers"].append(w)
    out["lm_head"] = mat(jax.random.fold_in(key, layers), (H, V))
    return out


def projections(x: jax.Array, w: dict, pairs: bool = False) -> jax.Array:
    """One pass: `x [B, H]` through every layer's projections -> `[B, V]` logits. k and v are
    folded into the attention stand-in so that no matmul is dead code."""
    for p in w["layers"]:
        if "wqkv" in p:
            q, k, v = jnp.split(x @ p["wqkv"], [Q, Q + KV], axis=-1)
            if pairs:
                gu = (x @ p["w_gate_up"]).reshape(x.shape[0], F, 2)
                g, u = gu[..., 0], gu[..., 1]
            else:
                g, u = jnp.split(x @ p["w_gate_up"], [F], axis=-1)
        else:
            q, k, v = x @ p["wq"], x @ p["wk"], x @ p["wv"]
        attn = q.at[:, :KV].add(k * v)
        x = x + attn @ p["wo"]
        if "wqkv" not in p:
            g, u = x @ p["w_gate"], x @ p["w_up"]
        x = x + (jax.nn.silu(g) * u) @ p["w_down"]
    return x @ w["lm_head"]


LAYOUTS = ("separate", "fused", "fused-pairs")


def probe(batch: int, layers: int, layout: str, bandwidth: float, top: int, inner: int) -> dict:
    """One layout (LAYOUTS) at `batch`: its traced ms per pass against its floor, and its kernels."""
    w = make_weights(layers, layout != "separate", jax.random.key(0))
    pairs = layout == "fused-pairs"
    nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(w))
    x = jax.random.normal(jax.random.key(1), (batch, H), jnp.bfloat16)
    traces = traced_chain(functools.partial(projections, pairs=pairs), (x, w), feed_scalar(0), inner=inner, runs=3)
    if traces is None:
        raise SystemExit("gemv_probe: no device kernels to trace on the CPU")
    ms = 1e3 * statistics.median(span_per_call(ev, inner) for ev in traces)
    by_name = defaultdict(lambda: [0, 0.0])
    for name, _, dur in traces[-1]:
        by_name[name][0] += 1
        by_name[name][1] += dur
    busy = sum(d for _, d in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    del w
    return {"batch": batch, "layout": layout, "weight_bytes": nbytes, "ms": ms,
            "floor_ms": 1e3 * nbytes / bandwidth, "x_floor": ms / (1e3 * nbytes / bandwidth),
            "kernels_per_pass": sum(c for c, _ in by_name.values()) / inner,
            "busy_ms": busy / inner / 1e6,
            "top": [{"name": n[:100], "per_pass": c / inner, "us_per_pass": d / inner / 1e3} for n, (c, d) in ranked]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--inner", type=int, default=1, help="passes per traced chain")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--layouts", default="separate,fused", help="separate, fused (gate/up halves), fused-pairs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    layouts = args.layouts.split(",")
    unknown = [x for x in layouts if x not in LAYOUTS]
    if unknown:
        raise SystemExit(f"gemv_probe: unknown layouts {unknown} (known: {', '.join(LAYOUTS)})")
    bw = measure_copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for layout in layouts:
            rows.append(probe(batch, args.layers, layout, bw, args.top, args.inner))
            r = rows[-1]
            print(f"B={batch} {r['layout']:8s} {r['ms']:.3f} ms = {r['x_floor']:.2f}x floor "
                  f"({r['kernels_per_pass']:.0f} kernels, busy {r['busy_ms']:.3f} ms)", flush=True)
            for k in r["top"]:
                print(f"    {k['us_per_pass']:9.1f} us  x{k['per_pass']:.0f}  {k['name']}", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_probe.json").write_text(json.dumps({"copy_bw": bw, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
