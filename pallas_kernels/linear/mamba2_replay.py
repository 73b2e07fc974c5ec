"""ReplaySSM commit for Mamba2: replay the accepted path's payload rows over the committed state.

After verify, the caller packs the accepted path's payload rows `[B | x | dt]` to the front of the
window (row d = path node at depth d; `pallas_kernels.row_move.move_rows`), so the accepted path is
a chain. This kernel replays rows 0 .. min(accept_len, T) - 1 of each request over its committed
state with the Mamba2 update `h = exp(dt' A) h + dt' x B^T` and writes the result back into the
same pool slot, in place (`input_output_aliases`). The result equals the state after the last
accepted node that verify computed, because both start from the same committed state and apply the
same nodes in root-to-leaf order.

Grid `(B, H, cdiv(P, block_p))`, one `[block_p, N]` state tile per program. A padded request
(slot < 0) reads and writes nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_backend
from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout, mamba2_replay_commit_reference, softplus

_TILE_ELEMS = 2048  # [block_p, N] fp32 tile held in registers (see mamba2_tree)


def _replay_kernel(accept_ref, slots_ref, payload_ref, alog_ref, dtb_ref, pool_in_ref, pool_ref, *,
                   T, H, P, N, G, BP, NP, layout):
    del pool_in_ref  # aliased with pool_ref; we read and write through the output ref
    b = pl.program_id(0)
    h = pl.program_id(1)
    p0 = pl.program_id(2) * BP
    g = h // (H // G)
    slot = slots_ref[b]
    n_rows = jnp.minimum(accept_ref[b], T)
    pmask = p0 + jnp.arange(BP) < P
    nmask = jnp.arange(NP) < N
    tmask = pmask[:, None] & nmask[None, :]
    neg_a = -jnp.exp(alog_ref[h].astype(jnp.float32))
    dt_bias = dtb_ref[h].astype(jnp.float32)

    @pl.when(slot >= 0)
    def _():
        tile = pool_ref.at[slot, h, pl.ds(p0, BP), pl.ds(0, NP)]
        state = plgpu.load(tile, mask=tmask, other=0.0).astype(jnp.float32)

        def body(i, st):
            dtp = softplus(payload_ref[b, i, layout.dt_offset + h].astype(jnp.float32) + dt_bias)
            xv = plgpu.load(payload_ref.at[b, i, pl.ds(layout.x_offset + h * P + p0, BP)], mask=pmask, other=0.0)
            bv = plgpu.load(payload_ref.at[b, i, pl.ds(layout.b_offset + g * N, NP)], mask=nmask, other=0.0)
            u = (dtp * xv.astype(jnp.float32))[:, None] * bv.astype(jnp.float32)[None, :]
            return jnp.exp(dtp * neg_a) * st + u

        state = lax.fori_loop(0, n_rows, body, state)
        plgpu.store(tile, state.astype(pool_ref.dtype), mask=tmask)


def mamba2_replay_commit(payload, accept_len, state_pool, state_slots, A_log, dt_bias, *, ngroups, dstate,
                         block_p=None, num_warps=4, backend=None):
    """Replays packed payload rows into the committed pool; see the module docstring.

    Shapes: `payload [B, T, G*N + H*P + H]` (rows 0.. hold the accepted path, root first),
    `accept_len [B] int32`, `state_pool [S, H, P, N]` (updated in place when donated),
    `state_slots [B] int32` (< 0: padded request), `A_log/dt_bias [H]`. Returns the new pool.
    """
    if state_pool.ndim != 4:
        raise ValueError(f"state_pool must be [S, H, P, N], got shape {state_pool.shape}")
    _, H, P, N = state_pool.shape
    if N != dstate:
        raise ValueError(f"state_pool dstate {N} != dstate {dstate}")
    if ngroups < 1 or H % ngroups:
        raise ValueError(f"nheads {H} must be a multiple of ngroups {ngroups}")
    layout = Mamba2PayloadLayout(ngroups, dstate, H, P)
    if payload.ndim != 3 or payload.shape[2] != layout.width:
        raise ValueError(f"payload must be [B, T, {layout.width}] for {layout}, got {payload.shape}")
    nb, T = payload.shape[:2]
    if accept_len.shape != (nb,) or state_slots.shape != (nb,):
        raise ValueError(f"accept_len and state_slots must be [B] = ({nb},), got {accept_len.shape}, {state_slots.shape}")
    if A_log.shape != (H,) or dt_bias.shape != (H,):
        raise ValueError(f"A_log and dt_bias must be [H] = ({H},), got {A_log.shape}, {dt_bias.shape}")
    if block_p is not None and (block_p < 1 or block_p & (block_p - 1)):
        raise ValueError(f"block_p must be a power of two, got {block_p}")
    kind = resolve_backend(backend)
    if kind == "reference":
        return mamba2_replay_commit_reference(payload, accept_len, state_pool, state_slots, A_log, dt_bias, layout)

    NP = next_pow2(N)
    BP = min(next_pow2(P), block_p) if block_p else max(1, min(next_pow2(P), _TILE_ELEMS // NP))
    kernel = functools.partial(_replay_kernel, T=T, H=H, P=P, N=N, G=ngroups, BP=BP, NP=NP, layout=layout)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        grid=(nb, H, pl.cdiv(P, BP)),
        input_output_aliases={5: 0},
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name="mamba2_replay_commit",
    )(accept_len.astype(jnp.int32), state_slots.astype(jnp.int32), payload, A_log, dt_bias, state_pool)
