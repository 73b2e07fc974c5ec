"""GDN tree verify, recurrent form: every node starts from its parent's state.

One program per (request b, value head hv, dv-tile): the `[dk, block_v]` fp32 state tile stays in
registers while the program walks the nodes in index order. Parents precede children, so when
node t's parent is not t - 1 the parent's state was already stored by this same program and is
reloaded (a root, parent -1, reloads the committed state from the pool in place). A chain
(`parents=None`, or parents[t] == t - 1 everywhere) never reloads.

Where node states go (`store`):
  "every_node"    staged mode: the state after node t goes to `node_states[b, t]` (the verify
                  scratch, a destination separate from the committed pool; never seeded with a copy).
  "branch_points" ReplaySSM mode: only nodes with a child other than t + 1 are stored (the one
                  workspace all layers share); every other row of `node_states` is left as it was.
The committed pool is only read here; the commit kernels are the only writers.

Optionally the kernel also writes each node's replay payload row `[k | v | a | b]` (see
`gdn_payload`), so a ReplaySSM verify needs no separate q/k/v split for the commit.

Public entry point: `gdn_tree_verify(...)` with `backend=None|"pallas"|"interpret"|"reference"`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, resolve_backend
from pallas_kernels.linear.branch_slots import branch_points
from pallas_kernels.linear.gdn_common import GdnDims, default_scale, gates, gdn_dims, l2_normalize
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_tree_verify_reference

Store = Literal["every_node", "branch_points"]
STORES = ("every_node", "branch_points")


@dataclass(frozen=True)
class GdnKernelConfig:
    """Launch knobs of the GDN kernels; None picks the per-kernel default (see `pick_launch`)."""

    block_v: int | None = None  # dv columns per program (power of two dividing dv)
    num_warps: int | None = None  # Triton warps per program
    num_stages: int | None = None  # Triton software-pipelining stages of the node loop


# Default launch (measured on an H200, benchmarks/RESULTS.md "GDN tree verify"): split dv into
# tiles until the grid has at least this many programs, but keep tiles >= 32 columns wide. Narrow
# one-warp tiles (block_v 8, as flash-linear-attention's fused_recurrent uses) measured 2-3x slower
# here for the tree and staged kernels: their state stores become 32-byte strided segments.
MIN_PROGRAMS = 512
MIN_DEFAULT_BLOCK_V = 32


class GdnVerifyResult(NamedTuple):
    out: jax.Array  # [B, T, HV, dv] in v's dtype
    node_states: jax.Array  # [B, T, HV, dk, dv] fp32: the staged scratch or the ReplaySSM workspace
    payload: jax.Array | None  # [B, T, width] replay payload rows, when a payload buffer was given


def pick_launch(dims: GdnDims, config: GdnKernelConfig | None, *, chunked: bool = False
                ) -> tuple[int, int, int]:
    """(block_v, num_warps, num_stages) for one launch; explicit config fields win.

    Default: halve block_v from dv while the (B, HV, dv / block_v) grid has fewer than MIN_PROGRAMS
    programs (small batches need dv tiles to fill the GPU), then 4 warps for tiles of at most
    64 x 64 state elements, 8 above, and one pipeline stage (each node depends on the last).
    """
    config = config or GdnKernelConfig()
    dv = dims.head_v_dim
    min_block_v = 16 if chunked else 8  # Triton dot operands need >= 16 columns
    block_v = config.block_v
    if block_v is None:
        block_v = dv
        while (block_v > MIN_DEFAULT_BLOCK_V
               and dims.batch * dims.num_v_heads * (dv // block_v) < MIN_PROGRAMS):
            block_v //= 2
    if block_v < min_block_v or block_v & (block_v - 1) or dv % block_v:
        raise ValueError(f"block_v={block_v} must be a power of two >= {min_block_v} dividing dv={dv}")
    num_warps = config.num_warps
    if num_warps is None:
        num_warps = 4 if dims.head_k_dim * block_v <= 64 * 64 else 8
    num_stages = 1 if config.num_stages is None else config.num_stages
    if num_warps < 1 or num_warps & (num_warps - 1) or num_stages < 1:
        raise ValueError(f"num_warps={num_warps} must be a power of two and num_stages={num_stages} >= 1")
    return block_v, num_warps, num_stages


def _check_tree_inputs(dims: GdnDims, parents, node_states, payload, k, v, a, b, store):
    if store not in STORES:
        raise ValueError(f"store={store!r} is not one of {STORES}")
    want = (dims.batch, dims.nodes, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    if node_states.shape != want or node_states.dtype != jnp.float32:
        raise ValueError(f"node_states must be float32 {want}; got {node_states.dtype} {node_states.shape}")
    if parents is not None and (parents.shape != (dims.batch, dims.nodes)
                                or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"parents must be [B, T] = {(dims.batch, dims.nodes)} int32; got "
                         f"{parents.shape} {parents.dtype}")
    if payload is not None:
        check_payload(dims, payload, k, v, a, b)


def check_payload(dims: GdnDims, payload, k, v, a, b) -> GdnPayloadLayout:
    """Payload buffer `[B, T, width]` in the one dtype k, v, a and b share."""
    layout = GdnPayloadLayout(dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    want = (dims.batch, dims.nodes, layout.width)
    if payload.shape != want:
        raise ValueError(f"payload must be [B, T, width] = {want}; got {payload.shape}")
    dtypes = {x.dtype for x in (payload, k, v, a, b)}
    if len(dtypes) != 1:
        raise ValueError(f"payload, k, v, a and b must share one dtype so replay reads exactly what "
                         f"verify read; got payload {payload.dtype}, k {k.dtype}, v {v.dtype}, "
                         f"a {a.dtype}, b {b.dtype}")
    return layout


def _verify_kernel(parents_ref, branch_ref, slots_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref,
                   dtb_ref, pool_ref, _nodes_in_ref, *rest, chain: bool, store: str, nodes: int,
                   group: int, block_v: int, use_qk_l2norm: bool, scale: float,
                   layout: GdnPayloadLayout | None, compiled: bool, nodes_pow2: int):
    if layout is not None:
        _payload_in_ref, o_ref, nodes_ref, payload_ref = rest
    else:
        o_ref, nodes_ref = rest
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    kh = hv // group
    cols = pl.ds(vt * block_v, block_v)
    slot = slots_ref[b]
    alog = alog_ref[hv]
    dtb = dtb_ref[hv]
    if not chain:
        # One vector load of the request's parents and branch flags up front, so no node waits on a
        # dependent scalar load before deciding whether to reload.
        node_ids = jnp.arange(nodes_pow2, dtype=jnp.int32)
        in_window = node_ids < nodes
        parents_vec = plgpu.load(parents_ref.at[b, pl.ds(0, nodes_pow2)], mask=in_window, other=-1)
        branch_vec = plgpu.load(branch_ref.at[b, pl.ds(0, nodes_pow2)], mask=in_window, other=0)

        def pick(vec, t):
            return jnp.sum(jnp.where(node_ids == t, vec, 0))

    def committed():
        return pool_ref[slot, hv, :, cols].astype(jnp.float32)

    def body(t, h):
        if not chain:
            p = pick(parents_vec, t)

            def reload():
                if compiled:
                    # The parent's tile was stored by other threads of this program.
                    plgpu.debug_barrier()
                return jax.lax.cond(p < 0, committed,
                                    lambda: nodes_ref[b, jnp.maximum(p, 0), hv, :, cols])

            h = jax.lax.cond(p != t - 1, reload, lambda: h)
        k_raw = k_ref[b, t, kh, :]
        v_raw = v_ref[b, t, hv, cols]
        a_raw = a_ref[b, t, hv]
        b_raw = b_ref[b, t, hv]
        k = k_raw.astype(jnp.float32)
        q = q_ref[b, t, kh, :].astype(jnp.float32)
        if use_qk_l2norm:
            k, q = l2_normalize(k), l2_normalize(q)
        q = q * scale
        g, beta = gates(a_raw, b_raw, alog, dtb)
        h = h * jnp.exp(g)
        delta = beta * (v_raw.astype(jnp.float32) - jnp.sum(h * k[:, None], axis=0))
        h = h + k[:, None] * delta[None, :]
        o_ref[b, t, hv, cols] = jnp.sum(h * q[:, None], axis=0).astype(o_ref.dtype)
        if store == "every_node":
            nodes_ref[b, t, hv, :, cols] = h
        elif not chain:
            @pl.when(pick(branch_vec, t) != 0)
            def _():
                nodes_ref[b, t, hv, :, cols] = h
        if layout is not None:
            dv = v_ref.shape[-1]
            payload_ref[b, t, pl.ds(layout.v_offset + hv * dv + vt * block_v, block_v)] = v_raw

            @pl.when(vt == 0)
            def _():
                payload_ref[b, t, layout.a_offset + hv] = a_raw
                payload_ref[b, t, layout.b_offset + hv] = b_raw

            @pl.when((vt == 0) & (hv % group == 0))
            def _():
                dk = k_ref.shape[-1]
                payload_ref[b, t, pl.ds(kh * dk, dk)] = k_raw
        return h

    jax.lax.fori_loop(0, nodes, body, committed())


def _verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents, node_states,
                      payload, store, use_qk_l2norm, scale):
    out, states = gdn_tree_verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots,
                                            parents, use_qk_l2norm=use_qk_l2norm, scale=scale)
    if store == "every_node":
        node_states = states
    elif parents is not None:
        keep = branch_points(parents)[:, :, None, None, None]
        node_states = jnp.where(keep, states, node_states)
    if payload is not None:
        payload = pack_payload(k, v, a, b)
    return GdnVerifyResult(out.astype(v.dtype), node_states, payload)


def gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents, node_states, *,
                    store: Store, payload: jax.Array | None = None, branch: jax.Array | None = None,
                    use_qk_l2norm: bool = True,
                    scale: float | None = None, config: GdnKernelConfig | None = None,
                    backend: str | None = None) -> GdnVerifyResult:
    """GDN verify over a tree of T nodes (recurrent form). Shapes in `gdn_common`.

    parents: `[B, T] int32` (parents[t] < t, -1 for a root) or None for a chain (no parent loads).
    node_states: `[B, T, HV, dk, dv]` fp32, updated in place (donate it under jit); see `store`.
    payload: optional `[B, T, width]` buffer for the replay payload rows, updated in place.
    branch: optional precomputed `branch_points(parents)` `[B, T]` (compute it once per step and
    share it across layers; computed here when None).
    Returns `GdnVerifyResult(out, node_states, payload)`.
    """
    dims = gdn_dims(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots)
    _check_tree_inputs(dims, parents, node_states, payload, k, v, a, b, store)
    scale = default_scale(dims.head_k_dim) if scale is None else float(scale)
    kind = resolve_backend(backend)
    if kind == "reference":
        return _verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents,
                                 node_states, payload, store, use_qk_l2norm, scale)
    block_v, num_warps, num_stages = pick_launch(dims, config)
    chain = parents is None
    if chain:
        parents = jnp.zeros((dims.batch, dims.nodes), jnp.int32)  # never read
    if store == "branch_points" and not chain:
        branch = branch_points(parents) if branch is None else branch
        if branch.shape != (dims.batch, dims.nodes):
            raise ValueError(f"branch must be [B, T] = {(dims.batch, dims.nodes)}; got {branch.shape}")
        branch = branch.astype(jnp.int32)
    else:
        branch = jnp.zeros((dims.batch, dims.nodes), jnp.int32)  # never read
    layout = None if payload is None else GdnPayloadLayout(
        dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    kernel = functools.partial(
        _verify_kernel, chain=chain, store=store, nodes=dims.nodes, group=dims.group,
        block_v=block_v, use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout,
        compiled=kind == "compiled", nodes_pow2=max(2, next_pow2(dims.nodes)))
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(node_states.shape, jnp.float32)]
    args = [parents.astype(jnp.int32), branch, state_slots.astype(jnp.int32), q, k, v, a, b,
            A_log.astype(jnp.float32), dt_bias.astype(jnp.float32), state_pool, node_states]
    aliases = {11: 1}
    if payload is not None:
        out_shape.append(jax.ShapeDtypeStruct(payload.shape, payload.dtype))
        args.append(payload)
        aliases[12] = 2
    results = pl.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(dims.batch, dims.num_v_heads, dims.head_v_dim // block_v),
        input_output_aliases=aliases,
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name="gdn_tree_verify",
    )(*args)
    return GdnVerifyResult(results[0], results[1], results[2] if payload is not None else None)
