"""ReplaySSM commit for GDN: replay the accepted path's payload rows as a chain, in place.

After the accepted path's payload rows were packed to the window front (row d = the path node at
depth d, see `row_move.pack_path_rows`), request b replays rows 0 .. min(num_rows[b], T) - 1 over its
committed state and writes the result back to its pool row. The pool is aliased input -> output,
so under jit with donation no copy of the pool is made. A request with num_rows == 0 (a padded
slot) reads and writes nothing.

One program per (request, value head, dv-tile); the `[dk, block_v]` fp32 tile stays in registers.

Public entry points: `gdn_replay_commit(...)` with `backend=None|"pallas"|"interpret"|"reference"`,
and `pallas_kernels.row_move.pack_path_rows(...)` (the row move).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import resolve_backend
from pallas_kernels.linear.gdn_common import GdnDims, gates, l2_normalize
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, split_payload
from pallas_kernels.linear.gdn_reference import gdn_replay_reference
from pallas_kernels.linear.gdn_tree import GdnKernelConfig, default_config, pick_launch


def _replay_kernel(num_rows_ref, slots_ref, payload_ref, alog_ref, dtb_ref, _pool_in_ref, pool_ref,
                   *, nodes: int, group: int, dk: int, dv: int, block_v: int, use_qk_l2norm: bool,
                   layout: GdnPayloadLayout):
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    kh = hv // group
    cols = pl.ds(vt * block_v, block_v)
    n = jnp.minimum(num_rows_ref[b], nodes)
    alog = alog_ref[hv]
    dtb = dtb_ref[hv]

    @pl.when(n > 0)
    def _():
        slot = slots_ref[b]

        def body(i, h):
            k = payload_ref[b, i, pl.ds(kh * dk, dk)].astype(jnp.float32)
            if use_qk_l2norm:
                k = l2_normalize(k)
            v = payload_ref[b, i, pl.ds(layout.v_offset + hv * dv + vt * block_v, block_v)]
            g, beta = gates(payload_ref[b, i, layout.a_offset + hv],
                            payload_ref[b, i, layout.b_offset + hv], alog, dtb)
            h = h * jnp.exp(g)
            delta = beta * (v.astype(jnp.float32) - jnp.sum(h * k[:, None], axis=0))
            return h + k[:, None] * delta[None, :]

        h = jax.lax.fori_loop(0, n, body, pool_ref[slot, hv, :, cols])
        pool_ref[slot, hv, :, cols] = h


def gdn_replay_commit(state_pool, state_slots, payload, num_rows, A_log, dt_bias, *, num_k_heads: int,
                      head_k_dim: int, use_qk_l2norm: bool = True,
                      config: GdnKernelConfig | None = None, backend: str | None = None):
    """Replays packed payload rows over the committed states; returns the updated pool.

    state_pool `[S, HV, dk, dv]` fp32 (aliased, updated in place), state_slots `[B] int32`,
    payload `[B, T, width]` (rows already packed: row d = accepted node at depth d),
    num_rows `[B] int32` (accept_len; min(num_rows, T) rows are replayed, 0 = untouched).
    config: launch knobs; None = `gdn_tree.default_config` of the replay's dims.
    """
    if state_pool.ndim != 4 or state_pool.dtype != jnp.float32:
        raise ValueError(f"state_pool must be float32 [S, HV, dk, dv]; got {state_pool.dtype} {state_pool.shape}")
    num_slots, hv, dk, dv = state_pool.shape
    if dk != head_k_dim:
        raise ValueError(f"head_k_dim={head_k_dim} does not match the pool's dk={dk}")
    if num_k_heads < 1 or hv % num_k_heads:
        raise ValueError(f"value heads HV={hv} must be a multiple of num_k_heads={num_k_heads}")
    layout = GdnPayloadLayout(num_k_heads, hv, dk, dv)
    if payload.ndim != 3 or payload.shape[2] != layout.width:
        raise ValueError(f"payload must be [B, T, {layout.width}] for {layout}; got {payload.shape}")
    bsz, t, _ = payload.shape
    for name, x in (("state_slots", state_slots), ("num_rows", num_rows)):
        if x.shape != (bsz,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be [B={bsz}] int32; got {x.shape} {x.dtype}")
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x.shape != (hv,):
            raise ValueError(f"{name} must be [HV] = {(hv,)}; got {x.shape}")
    kind = resolve_backend(backend)
    if kind == "reference":
        k, v, a, b = split_payload(payload, layout)
        return gdn_replay_reference(state_pool, state_slots, k, v, a, b, A_log, dt_bias, num_rows,
                                    use_qk_l2norm=use_qk_l2norm)
    dims = GdnDims(bsz, t, num_k_heads, hv, dk, dv, num_slots)
    # The replay kernel keeps key-major tiles; value_major only steers the verify kernels' launch.
    config = default_config(dims) if config is None else config
    block_v, num_warps, num_stages = pick_launch(dims, dataclasses.replace(config, value_major=False))
    kernel = functools.partial(_replay_kernel, nodes=t, group=hv // num_k_heads, dk=dk, dv=dv,
                               block_v=block_v, use_qk_l2norm=use_qk_l2norm, layout=layout)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype),
        grid=(bsz, hv, dv // block_v),
        input_output_aliases={5: 0},
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_replay_commit",
    )(num_rows.astype(jnp.int32), state_slots.astype(jnp.int32), payload, A_log.astype(jnp.float32),
      dt_bias.astype(jnp.float32), state_pool)
