"""Dense masked attention baselines in XLA, timed over K/V gathered beforehand (gather not timed).

`time_dense_attention(q [B, R, Hq, Dk], k [B, T, Hkv, Dk], v [B, T, Hkv, Dv], vis [B, R, T])` tries
jax.nn.dot_product_attention with the cudnn kernel, then its XLA implementation, then (value width
different from the key width, as in MLA where the value is the latent part of the key row) a plain
einsum -> masked softmax -> einsum graph. Returns (implementation, median seconds per call).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from benchmarks.report import log
from benchmarks.timing import median_time


def _einsum_attention(q, k, v, vis, scale):
    group = q.shape[2] // k.shape[2]
    qg = q.reshape(q.shape[:2] + (k.shape[2], group, q.shape[-1]))  # [B, R, Hkv, G, Dk]
    s = jnp.einsum("brhgd,bthd->brhgt", qg, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(vis[:, :, None, None, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1).astype(v.dtype)
    out = jnp.einsum("brhgt,bthd->brhgd", w, v, preferred_element_type=jnp.float32)
    return out.reshape(q.shape[:3] + (v.shape[-1],)).astype(q.dtype)


def time_dense_attention(q, k, v, vis, scale: float, samples: int = 7):
    same_width = k.shape[-1] == v.shape[-1]
    for impl in ("cudnn", "xla", "einsum"):
        if impl != "einsum" and not same_width:
            continue
        try:
            if impl == "einsum":
                f = jax.jit(lambda qq, kk, vv, mm: _einsum_attention(qq, kk, vv, mm, scale))
            else:
                f = jax.jit(lambda qq, kk, vv, mm, impl=impl: jax.nn.dot_product_attention(
                    qq, kk, vv, mask=mm[:, None], scale=scale, implementation=impl))
            jax.block_until_ready(f(q, k, v, vis))
            return impl, median_time(f, q, k, v, vis, samples=samples)
        except Exception as exc:  # noqa: BLE001 - an implementation that does not run is reported
            log(f"dense {impl} unavailable: {type(exc).__name__}: {str(exc)[:160]}")
    return "none", float("nan")
