"""GDN tree verify, recurrent form: every node starts from its parent's state.

One program per (request b, value head hv, dv-tile): the `[dk, block_v]` fp32 state tile stays in
registers while the program walks the nodes in index order. A chain (`parents=None`, or
parents[t] == t - 1 everywhere) never leaves registers. When node t's parent p is not t - 1:
  - p = -1 (a root): the committed state is reloaded from the pool in place;
  - otherwise p is a branch point: its state is reloaded from `node_states[b, p]`, which this same
    program stored earlier.
Branch-point states go through `node_states`, not extra register tiles: register slots are slower
(results: gdn-branch-slots).

Where node states go (`store`):
  "every_node"    staged mode: the state after node t goes to `node_states[b, t]` (the verify
                  scratch, a destination separate from the committed pool; never seeded with a copy).
  "branch_points" ReplaySSM mode: only branch points (nodes with a child other than t + 1,
                  `branch_points(parents)`) are stored, into the one workspace all layers share; every
                  other row of `node_states` is left as it was.
The committed pool is only read here; the commit kernels are the only writers.

Optionally the kernel also writes each node's replay payload row `[k | v | a | b]` (see
`gdn_payload`), so a ReplaySSM verify needs no separate q/k/v split for the commit.

Launch knobs: `GdnKernelConfig`, one frozen config shared by every GDN kernel (recurrent, chunked,
replay); `default_config(dims)` is what an entry point runs when given none.

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
from pallas_kernels.linear.chunked_common import FP32_DOTS
from pallas_kernels.linear.gdn_common import GdnDims, default_scale, gates, gdn_dims, l2_normalize
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_reference import gdn_tree_verify_reference

Store = Literal["every_node", "branch_points"]
STORES = ("every_node", "branch_points")
MAX_NUM_WARPS = 32


@dataclass(frozen=True)
class GdnKernelConfig:
    """Launch knobs of the GDN kernels; a None field is resolved per launch by that kernel's rule
    (`pick_launch`; the two-pass apply kernel: `gdn_chunked.two_pass_block_v`). `default_config(dims)`
    is the config an entry point runs when given none."""

    block_v: int | None = None  # dv columns per program (power of two dividing dv)
    num_warps: int | None = None  # Triton warps per program
    num_stages: int | None = None  # Triton software-pipelining stages of the node loop
    # Hold the state tile as [block_v, dk] in registers (memory keeps [dk, dv]) so the two per-node
    # reductions over dk run along the tile's fast axis, as flash-linear-attention's transposed
    # state layout does. Recurrent tree/chain verify only (the chunked forms and the replay commit
    # ignore it). None = value-major exactly when B * HV >= MIN_PROGRAMS (`default_config`): there
    # full-width key-major tiles already fill the GPU, and below it value-major tiles are slower.
    # results: gdn-launch
    value_major: bool | None = None
    # Fewest (B, HV) programs of the two-pass chunked form's factor kernel for which the chunked
    # verify (`two_pass=None`) and the layer's routes run the two-pass form at 16 padded rows; past
    # 16 rows it runs on every grid, and smaller grids at 16 rows keep the fused kernel.
    # results: gdn-two-pass
    two_pass_min_programs: int = 256
    # The chunked forms' fp32 products (`FP32_DOTS`; the recurrent kernels and the replay commit
    # ignore it): "ieee" (exact fp32 on the FMA units) or "tf32x3" (three TF32 tensor-core passes,
    # about fp32 accuracy; compiled runs only, interpreted runs stay IEEE). The kernel keeps the
    # exact products by default; the GDN layer passes its `GdnLayerConfig.chunked_fp32_dots`
    # ("tf32x3", 4.5x faster; results: gdn-tf32x3) as `gdn_chunked_verify`'s `fp32_dots`, which
    # overrides this field.
    fp32_dots: str = "ieee"

    def __post_init__(self):
        if self.value_major is not None and not isinstance(self.value_major, bool):
            raise ValueError(f"GdnKernelConfig.value_major={self.value_major!r} must be a bool or None")
        if self.fp32_dots not in FP32_DOTS:
            raise ValueError(f"GdnKernelConfig.fp32_dots must be one of {tuple(FP32_DOTS)}, got {self.fp32_dots!r}")
        for name in ("block_v", "num_warps", "num_stages", "two_pass_min_programs"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"GdnKernelConfig.{name}={val!r} must be a positive int or None")


# Default launch (`pick_launch`): value-major tiles (the default once B * HV >= MIN_PROGRAMS) take
# VALUE_MAJOR_BLOCK_V columns and 4 warps; key-major ones split dv into tiles until the grid has at
# least MIN_PROGRAMS programs, but keep tiles >= MIN_DEFAULT_BLOCK_V columns wide. Narrower one-warp
# tiles (block_v 8, as flash-linear-attention's fused_recurrent uses) are slower for the tree and
# staged kernels: their state stores become 32-byte strided segments.
# results: gdn-launch
MIN_PROGRAMS = 512
MIN_DEFAULT_BLOCK_V = 32
VALUE_MAJOR_BLOCK_V = 32
# Chunked trees of more than 32 nodes (64 padded rows) hold [64, dk] q/k tiles beside the state
# tile: with 128-column state tiles they need 278,528 bytes of shared memory, more than the
# H200's 232,448, so their default tiles are narrower.
CHUNKED_WIDE_BLOCK_V = 32


class GdnVerifyResult(NamedTuple):
    out: jax.Array  # [B, T, HV, dv] in v's dtype
    node_states: jax.Array  # [B, T, HV, dk, dv] fp32: the staged scratch or the ReplaySSM workspace
    payload: jax.Array | None  # [B, T, width] replay payload rows, when a payload buffer was given


def default_config(dims: GdnDims) -> GdnKernelConfig:
    """The config a GDN entry point runs when given none: value-major state tiles exactly when
    B * HV >= MIN_PROGRAMS (read by the recurrent verify kernels only), two_pass_min_programs and
    fp32_dots at their field defaults, and block_v / num_warps / num_stages None, which each launch
    resolves by its own rule (they differ between the recurrent, fused chunked and two-pass kernels;
    see `pick_launch`)."""
    return GdnKernelConfig(value_major=dims.batch * dims.num_v_heads >= MIN_PROGRAMS)


def uses_value_major(dims: GdnDims, config: GdnKernelConfig | None) -> bool:
    """Whether the recurrent verify kernels hold value-major state tiles (see GdnKernelConfig)."""
    if config is None or config.value_major is None:
        return default_config(dims).value_major
    return config.value_major


def pick_launch(dims: GdnDims, config: GdnKernelConfig | None, *, chunked: bool = False
                ) -> tuple[int, int, int]:
    """(block_v, num_warps, num_stages) for one launch; explicit config fields win.

    Default: value-major tiles (the recurrent verify kernels only; not `chunked`) take
    min(VALUE_MAJOR_BLOCK_V, dv) columns; otherwise halve block_v from dv while the
    (B, HV, dv / block_v) grid has fewer than MIN_PROGRAMS programs (small batches need dv tiles to
    fill the GPU), stopping at MIN_DEFAULT_BLOCK_V; chunked trees above 32 nodes take
    CHUNKED_WIDE_BLOCK_V columns (shared memory). Then 4 warps for state tiles of at most 64 x 64
    elements, 8 above, and one pipeline stage (each node depends on the last).
    """
    config = config or GdnKernelConfig()
    dv = dims.head_v_dim
    min_block_v = 16 if chunked else 8  # Triton dot operands need >= 16 columns
    block_v = config.block_v
    if block_v is None and not chunked and uses_value_major(dims, config):
        block_v = min(VALUE_MAJOR_BLOCK_V, dv)
    if block_v is None and chunked and dims.nodes > 32:
        block_v = min(CHUNKED_WIDE_BLOCK_V, dv)
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
    if not 1 <= num_warps <= MAX_NUM_WARPS or num_warps & (num_warps - 1) or num_stages < 1:
        raise ValueError(f"num_warps={num_warps} must be a power of two in [1, {MAX_NUM_WARPS}] and "
                         f"num_stages={num_stages} >= 1")
    return block_v, num_warps, num_stages


def _check_tree_inputs(dims: GdnDims, parents, node_states, payload, branch, k, v, a, b, store):
    if store not in STORES:
        raise ValueError(f"store={store!r} is not one of {STORES}")
    want = (dims.batch, dims.nodes, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    if node_states.shape != want or node_states.dtype != jnp.float32:
        raise ValueError(f"node_states must be float32 {want}; got {node_states.dtype} {node_states.shape}")
    if parents is not None and (parents.shape != (dims.batch, dims.nodes)
                                or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"parents must be [B, T] = {(dims.batch, dims.nodes)} int32; got "
                         f"{parents.shape} {parents.dtype}")
    if parents is not None and dims.nodes >= _PARENT_FIELD:
        raise ValueError(f"a tree verify takes at most {_PARENT_FIELD - 1} nodes, got T={dims.nodes}")
    if branch is not None:
        if parents is None:
            raise ValueError("branch was given for a chain (parents=None); a chain has no branch points")
        if branch.shape != (dims.batch, dims.nodes) or not (jnp.issubdtype(branch.dtype, jnp.integer)
                                                            or branch.dtype == jnp.bool_):
            raise ValueError(f"branch must be [B, T] = {(dims.batch, dims.nodes)} bool/int32; got "
                             f"{branch.shape} {branch.dtype}")
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


# One int32 code per node, built once per program from the parent and branch vectors and picked
# once per node: parents[t] + 1 in bits 0..15, the branch-point (store) bit 24.
_PARENT_FIELD = 1 << 16
_BRANCH_SHIFT = 24


def _verify_kernel(parents_ref, branch_ref, slots_ref, q_ref, k_ref, v_ref, a_ref, b_ref, alog_ref,
                   dtb_ref, pool_ref, _nodes_in_ref, *rest, chain: bool, store: str, nodes: int,
                   group: int, block_v: int, use_qk_l2norm: bool, scale: float,
                   layout: GdnPayloadLayout | None, compiled: bool, nodes_pow2: int,
                   value_major: bool = False):
    # value_major: the state tile lives in registers as [block_v, dk] (memory keeps [dk, dv]), so
    # both per-node reductions over dk run along the tile's fast axis.
    def tile_in(x):
        return x.T if value_major else x

    tile_out = tile_in
    if layout is not None:
        _payload_in_ref, o_ref, nodes_ref, payload_ref = rest
    else:
        o_ref, nodes_ref = rest
    b = pl.program_id(0)
    hv = pl.program_id(1)
    vt = pl.program_id(2)
    kh = hv // group
    dk = k_ref.shape[-1]
    cols = pl.ds(vt * block_v, block_v)
    slot = slots_ref[b]
    alog = alog_ref[hv]
    dtb = dtb_ref[hv]
    branch_store = store == "branch_points" and not chain
    if not chain:
        # One vector load of parents (and branch flags) up front, folded into one code per node, so
        # each node picks one scalar (no dependent scalar loads inside the loop).
        node_ids = jnp.arange(nodes_pow2, dtype=jnp.int32)
        in_window = node_ids < nodes
        window = pl.ds(0, nodes_pow2)
        # Any negative parent is a root (as in the reference), never a wrapped row index.
        code_vec = jnp.maximum(plgpu.load(parents_ref.at[b, window], mask=in_window, other=-1), -1) + 1
        if branch_store:
            branch_vec = plgpu.load(branch_ref.at[b, window], mask=in_window, other=0)
            code_vec = code_vec + jnp.where(branch_vec != 0, 1 << _BRANCH_SHIFT, 0)

    def committed():
        return tile_in(pool_ref[slot, hv, :, cols].astype(jnp.float32))

    def body(t, h):
        if not chain:
            code = jnp.sum(jnp.where(node_ids == t, code_vec, 0))
            p = (code & (_PARENT_FIELD - 1)) - 1

            def reload():
                if compiled:
                    # The parent's tile was stored by other threads of this program.
                    plgpu.debug_barrier()
                return jax.lax.cond(p < 0, committed,
                                    lambda: tile_in(nodes_ref[b, jnp.maximum(p, 0), hv, :, cols]))

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
        if value_major:  # h [block_v, dk]
            delta = beta * (v_raw.astype(jnp.float32) - jnp.sum(h * k[None, :], axis=1))
            h = h + delta[:, None] * k[None, :]
            o_ref[b, t, hv, cols] = jnp.sum(h * q[None, :], axis=1).astype(o_ref.dtype)
        else:  # h [dk, block_v]
            delta = beta * (v_raw.astype(jnp.float32) - jnp.sum(h * k[:, None], axis=0))
            h = h + k[:, None] * delta[None, :]
            o_ref[b, t, hv, cols] = jnp.sum(h * q[:, None], axis=0).astype(o_ref.dtype)
        if store == "every_node":
            nodes_ref[b, t, hv, :, cols] = tile_out(h)
        elif branch_store:
            @pl.when(((code >> _BRANCH_SHIFT) & 1) != 0)
            def _():
                nodes_ref[b, t, hv, :, cols] = tile_out(h)
        if layout is not None:
            dv = v_ref.shape[-1]
            payload_ref[b, t, pl.ds(layout.v_offset + hv * dv + vt * block_v, block_v)] = v_raw

            @pl.when(vt == 0)
            def _():
                payload_ref[b, t, layout.a_offset + hv] = a_raw
                payload_ref[b, t, layout.b_offset + hv] = b_raw

            @pl.when((vt == 0) & (hv % group == 0))
            def _():
                payload_ref[b, t, pl.ds(kh * dk, dk)] = k_raw
        return h

    jax.lax.fori_loop(0, nodes, body, committed())


def _verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents, node_states,
                      payload, store, branch, use_qk_l2norm, scale):
    out, states = gdn_tree_verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots,
                                            parents, use_qk_l2norm=use_qk_l2norm, scale=scale)
    if store == "every_node":
        node_states = states
    elif parents is not None:
        keep = branch.astype(bool)[:, :, None, None, None]
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
      "branch_points" writes only the rows of branch points (`branch_points(parents)`).
    payload: optional `[B, T, width]` buffer for the replay payload rows, updated in place.
    branch: optional precomputed `branch_points(parents)` `[B, T]` (compute it once per step and
    share it across layers, as `GdnTree.branch` does; computed here when None).
    config: launch knobs (`GdnKernelConfig`); None = `default_config(dims)`.
    Returns `GdnVerifyResult(out, node_states, payload)`.
    """
    dims = gdn_dims(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots)
    _check_tree_inputs(dims, parents, node_states, payload, branch, k, v, a, b, store)
    config = default_config(dims) if config is None else config
    scale = default_scale(dims.head_k_dim) if scale is None else float(scale)
    kind = resolve_backend(backend)
    chain = parents is None
    if not chain and branch is None and store == "branch_points":
        branch = branch_points(parents)
    if kind == "reference":
        return _verify_reference(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, parents,
                                 node_states, payload, store, branch, use_qk_l2norm, scale)
    block_v, num_warps, num_stages = pick_launch(dims, config)
    unread = jnp.zeros((dims.batch, dims.nodes), jnp.int32)  # a parents/branch vector the kernel skips
    if chain:
        parents = unread
    branch = unread if branch is None else branch.astype(jnp.int32)
    layout = None if payload is None else GdnPayloadLayout(
        dims.num_k_heads, dims.num_v_heads, dims.head_k_dim, dims.head_v_dim)
    kernel = functools.partial(
        _verify_kernel, chain=chain, store=store, nodes=dims.nodes, group=dims.group,
        block_v=block_v, use_qk_l2norm=use_qk_l2norm, scale=scale, layout=layout,
        compiled=kind == "compiled", nodes_pow2=max(2, next_pow2(dims.nodes)),
        value_major=uses_value_major(dims, config))
    out_shape = [jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(node_states.shape, jnp.float32)]
    args = [parents.astype(jnp.int32), branch, state_slots.astype(jnp.int32), q, k, v, a, b,
            A_log.astype(jnp.float32), dt_bias.astype(jnp.float32), state_pool, node_states]
    aliases = {len(args) - 1: 1}
    if payload is not None:
        out_shape.append(jax.ShapeDtypeStruct(payload.shape, payload.dtype))
        args.append(payload)
        aliases[len(args) - 1] = 2
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


__all__ = ["GdnKernelConfig", "GdnVerifyResult", "branch_points", "check_payload", "default_config", "gdn_tree_verify",
           "pick_launch", "uses_value_major"]
