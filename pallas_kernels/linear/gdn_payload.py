"""Layout of one GDN layer's ReplaySSM payload row: `[k | v | a | b]`.

A verify node's payload row holds exactly the per-node inputs the delta-rule state update reads,
as they were read (before L2 normalisation and before the gates are applied), so a replay over
the committed state reproduces the verify's state bit for bit up to the kernel's own rounding:

    columns [0, H*dk)                    k, key heads in order, each `dk` wide
    columns [H*dk, H*dk + HV*dv)         v, value heads in order, each `dv` wide
    columns [H*dk + HV*dv, ... + HV)     a (gate pre-activation), one per value head
    columns [H*dk + HV*dv + HV, ... + HV) b (beta pre-activation), one per value head

The payload buffer of one layer is `[B, T, width]` in the dtype of k/v/a/b (they must agree so
nothing is rounded between verify and replay). q is not stored: replay produces no output.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class GdnPayloadLayout:
    """Column offsets of `[k | v | a | b]` for one layer's head dims."""

    num_k_heads: int  # H: key/query heads
    num_v_heads: int  # HV: value heads (a multiple of H)
    head_k_dim: int  # dk
    head_v_dim: int  # dv

    @property
    def v_offset(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def a_offset(self) -> int:
        return self.v_offset + self.num_v_heads * self.head_v_dim

    @property
    def b_offset(self) -> int:
        return self.a_offset + self.num_v_heads

    @property
    def width(self) -> int:
        return self.b_offset + self.num_v_heads


def pack_payload(k: jax.Array, v: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`k [B,T,H,dk]`, `v [B,T,HV,dv]`, `a/b [B,T,HV]` -> payload `[B, T, width]` (jnp, no kernel)."""
    bsz, t = k.shape[:2]
    return jnp.concatenate(
        [k.reshape(bsz, t, -1), v.reshape(bsz, t, -1), a, b], axis=-1
    )


def split_payload(payload: jax.Array, layout: GdnPayloadLayout):
    """Inverse of `pack_payload`: `[B, T, width]` -> (k, v, a, b) with their head shapes."""
    bsz, t, width = payload.shape
    if width != layout.width:
        raise ValueError(f"payload width {width} does not match the layout's {layout.width} ({layout})")
    k = payload[..., : layout.v_offset].reshape(bsz, t, layout.num_k_heads, layout.head_k_dim)
    v = payload[..., layout.v_offset : layout.a_offset].reshape(
        bsz, t, layout.num_v_heads, layout.head_v_dim
    )
    a = payload[..., layout.a_offset : layout.b_offset]
    b = payload[..., layout.b_offset :]
    return k, v, a, b
