"""Pure-jnp fp32 references for the Mamba2 tree scan, its ReplaySSM commit and the tree conv.

These are written in a different form from the kernels on purpose, so a test that compares the two
checks the kernels' serial walk against an independent formulation:

- Mamba2 states use the closed form of the elementwise recurrence over the ancestor mask. With the
  per-node log-decay `l_s = softplus(dt_s + dt_bias) * A` and `G_t = sum of l over the
  ancestors-or-self of t`,
  `h_t = exp(G_t) h0 + sum_{s anc-or-self t} exp(G_t - G_s) dt'_s x_s B_s^T`.
- Conv windows pick, for each node and each lag j, the ancestor at depth `depth_t - j` (or a column
  of the committed state once the path runs out).

Layouts (shared with the kernels and the layer glue):
- `x [B, T, H, P]`, `dt [B, T, H]`, `B/C [B, T, G, N]`, `z [B, T, H, P]` (optional gate),
  `A_log/dt_bias/D [H]`; head h reads group `h // (H // G)`.
- Recurrent pool `state_pool [S, H, P, N]`, addressed by `state_slots [B] int32`; a slot < 0 marks
  a padded request.
- Tree `parents [B, T] int32` with -1 <= parents[t] < t; None means the chain.
- Replay payload row per node: `[B (G*N) | x (H*P) | dt (H)]`, see `Mamba2PayloadLayout`.
- Conv pool `conv_pool [S, W-1, D]` (column-major: oldest column first, channels contiguous),
  inputs `x [B, T, D]`, `weight [D, W]`, `bias [D]`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.tree_masks import ancestor_mask_bool, chain_parents


@dataclasses.dataclass(frozen=True)
class Mamba2PayloadLayout:
    """Column layout of one ReplaySSM payload row `[B | x | dt]` of a Mamba2 layer."""

    ngroups: int  # G: B/C groups
    dstate: int  # N: state size per head row
    nheads: int  # H: SSM heads
    headdim: int  # P: channels per head

    @property
    def b_offset(self) -> int:
        return 0

    @property
    def x_offset(self) -> int:
        return self.ngroups * self.dstate

    @property
    def dt_offset(self) -> int:
        return self.x_offset + self.nheads * self.headdim

    @property
    def width(self) -> int:
        return self.dt_offset + self.nheads

    def pack(self, B: jax.Array, x: jax.Array, dt: jax.Array) -> jax.Array:
        """`B [b,T,G,N]`, `x [b,T,H,P]`, `dt [b,T,H]` -> `[b, T, width]` in their promoted dtype."""
        dtype = payload_dtype(B.dtype, x.dtype, dt.dtype)
        bt = x.shape[:2]
        return jnp.concatenate(
            [B.reshape(bt + (-1,)).astype(dtype), x.reshape(bt + (-1,)).astype(dtype), dt.astype(dtype)], axis=-1
        )

    def split(self, payload: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`[b, T, width]` -> `B [b,T,G,N]`, `x [b,T,H,P]`, `dt [b,T,H]`."""
        if payload.shape[-1] != self.width:
            raise ValueError(f"payload rows are {payload.shape[-1]} wide, layout {self} expects {self.width}")
        bt = payload.shape[:2]
        B = payload[..., : self.x_offset].reshape(bt + (self.ngroups, self.dstate))
        x = payload[..., self.x_offset : self.dt_offset].reshape(bt + (self.nheads, self.headdim))
        dt = payload[..., self.dt_offset :]
        return B, x, dt


def payload_dtype(*dtypes) -> jnp.dtype:
    """The payload keeps B, x and dt exactly, so its dtype is their promotion (bf16 in, bf16 out)."""
    return jnp.result_type(*dtypes)


def softplus(v: jax.Array) -> jax.Array:
    """dt' = softplus(dt + dt_bias), linear above 20 (as the model's); the reference and every
    Mamba2 kernel (recurrent, chunked, replay commit) use this one."""
    return jnp.where(v > 20.0, v, jnp.log1p(jnp.exp(jnp.minimum(v, 20.0))))


def _heads_from_groups(bc: jax.Array, nheads: int) -> jax.Array:
    """`[b, T, G, N]` -> `[b, T, H, N]` (head h reads group h // (H // G))."""
    return jnp.repeat(bc, nheads // bc.shape[2], axis=2)


def read_committed(state_pool: jax.Array, state_slots: jax.Array) -> jax.Array:
    """`[S, ...]`, `[B]` -> `[B, ...]` fp32; padded requests (slot < 0) read zeros."""
    rows = state_pool[jnp.maximum(state_slots, 0)].astype(jnp.float32)
    live = (state_slots >= 0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(live, rows, 0.0)


def mamba2_tree_scan_reference(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents=None, z=None):
    """fp32 reference. Returns `y [B, T, H, P]` and node states `[B, T, H, P, N]` (both fp32).

    Padded requests (slot < 0) get zero outputs and zero states.
    """
    nb, T, H, P = x.shape
    if parents is None:
        parents = chain_parents(nb, T)
    f32 = lambda a: a.astype(jnp.float32)
    anc = ancestor_mask_bool(parents)  # [b, t, s]
    dtp = softplus(f32(dt) + f32(dt_bias))  # [b, T, H]
    logdecay = dtp * (-jnp.exp(f32(A_log)))
    # precision="highest": on GPU a default fp32 einsum runs in TF32, far too coarse for a reference.
    G = jnp.einsum("bts,bsh->bth", anc.astype(jnp.float32), logdecay, precision="highest")
    diff = G[:, :, None, :] - G[:, None, :, :]  # [b, t, s, H]
    ancf = anc[..., None]
    weight = jnp.where(ancf, jnp.exp(jnp.where(ancf, diff, 0.0)), 0.0)
    Bh = _heads_from_groups(f32(B), H)
    Ch = _heads_from_groups(f32(C), H)
    h0 = read_committed(state_pool, state_slots)  # [b, H, P, N]
    states = jnp.exp(G)[..., None, None] * h0[:, None] + jnp.einsum(
        "btsh,bsh,bshp,bshn->bthpn", weight, dtp, f32(x), Bh, precision="highest"
    )
    y = jnp.einsum("bthpn,bthn->bthp", states, Ch, precision="highest") + f32(D)[:, None] * f32(x)
    if z is not None:
        y = y * jax.nn.silu(f32(z))
    live = (state_slots >= 0)[:, None, None, None]
    return jnp.where(live, y, 0.0), jnp.where(live[..., None], states, 0.0)


def mamba2_replay_commit_reference(payload, accept_len, state_pool, state_slots, A_log, dt_bias,
                                   layout: Mamba2PayloadLayout):
    """Replays payload rows 0 .. min(accept_len, T) - 1 of each request over its committed state.

    `payload [B, T, width]`, `accept_len [B] int32`, `state_pool [S, H, P, N]` -> new pool (pool dtype).
    """
    Bm, x, dt = layout.split(payload.astype(jnp.float32))
    T = payload.shape[1]
    dtp = softplus(dt + dt_bias.astype(jnp.float32))
    decay = jnp.exp(dtp * (-jnp.exp(A_log.astype(jnp.float32))))  # [b, T, H]
    Bh = _heads_from_groups(Bm, layout.nheads)
    h = read_committed(state_pool, state_slots)
    for i in range(T):  # static unroll keeps the reference an obvious serial chain
        upd = decay[:, i, :, None, None] * h + (dtp[:, i, :, None] * x[:, i])[..., None] * Bh[:, i, :, None, :]
        h = jnp.where((i < accept_len)[:, None, None, None], upd, h)
    live = state_slots >= 0
    dst = jnp.where(live, state_slots, state_pool.shape[0])
    return state_pool.at[dst].set(h.astype(state_pool.dtype), mode="drop")


def conv_tree_update_reference(x, conv_pool, state_slots, weight, bias=None, parents=None, silu=False):
    """fp32 reference of the tree conv. Returns `y [B, T, D]` and node state rows `[B, T, W-1, D]`.

    Node t's window is the W-1 committed columns followed by the inputs along root..t; its output is
    `bias + sum_c weight[:, c] * window[c]` over the last W columns, its state row the last W-1.
    Padded requests (slot < 0) get zero outputs and zero rows.
    """
    nb, T, Dc = x.shape
    W = weight.shape[1]
    if parents is None:
        parents = chain_parents(nb, T)
    anc = ancestor_mask_bool(parents)  # [b, t, s]
    depth = jnp.sum(anc, axis=-1) - 1  # [b, t]
    state = read_committed(conv_pool, state_slots)  # [b, W-1, D]
    xf = x.astype(jnp.float32)
    cols = []
    for lag in range(W - 1, -1, -1):  # window columns oldest .. newest
        want = depth - lag  # depth of the node at this lag, < 0 once the path runs out
        pick = anc & (depth[:, None, :] == want[:, :, None])  # [b, t, s]
        from_nodes = jnp.einsum("bts,bsd->btd", pick.astype(jnp.float32), xf, precision="highest")
        col_idx = jnp.clip(W - 1 + want, 0, W - 2)  # committed column for want < 0
        from_state = jnp.take_along_axis(state, col_idx[:, :, None], axis=1)  # [b, t, D]
        cols.append(jnp.where((want >= 0)[..., None], from_nodes, from_state))
    window = jnp.stack(cols, axis=2)  # [b, t, W, D]
    y = jnp.einsum("btcd,dc->btd", window, weight.astype(jnp.float32), precision="highest")
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if silu:
        y = jax.nn.silu(y)
    live = (state_slots >= 0)[:, None, None]
    return jnp.where(live, y, 0.0), jnp.where(live[..., None], window[:, :, 1:], 0.0)
