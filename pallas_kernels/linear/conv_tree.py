"""Causal depthwise conv update over a draft tree (causal_conv1d_update with parent indices).

Per channel, width W. Node t's window is the request's committed W-1 columns followed by the inputs
along the root-to-t path; the output is `bias + sum_c weight[:, c] * window[c]` over the window's
last W columns (optionally silu), and the node's state row is the window's last W-1 columns.

Every node's window is gathered on its own: starting at t, at most W-1 parent hops give the newest
columns, and once the path runs out the remaining (older) columns come from the committed state.
No node depends on another node's result, so a branch costs what a chain step costs; the chain
form (`parents=None`) computes the parent as t-1 instead of loading it.

The hops are precomputed once per step (`conv_lag_sources(parents, W) -> [B, T, W-1] int32`, tiny
XLA work shared by every conv layer of the step), so a node's W-1 column loads all issue at once
instead of each waiting on the previous hop's parent load. Source `c >= 0` is node c's input;
`c < 0` is committed column W - 1 + c (-1 the newest). `walk="parents"` reads the parents instead
and chases the pointers in the kernel; both give the same windows bit for bit. The table is the
default: it ties the pointer chase at small batches and wins at large ones (results: conv-lag-table).

Layouts: `x [B, T, D]`, `conv_pool [S, W-1, D]` (oldest column first; one column is contiguous
over channels), `weight [D, W]`, `bias [D]`, `parents [B, T] int32` (-1 <= parents[t] < t; a
parent outside that range gives unspecified values for that node but no out-of-bounds read),
`state_slots [B] int32`. Node state rows `[B, T, W-1, D]` (same row layout as the pool) are written
into a caller buffer when given (aliased in and out). A padded request (slot < 0) reads no state
and writes no state row; its outputs are zeros.
Grid `(B, cdiv(D, block_d))`; launch knobs in `ConvTreeConfig`, `default_config(channels)` when none is
given.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, require_power_of_two, resolve_backend, with_overrides
from pallas_kernels.linear.mamba2_reference import conv_tree_update_reference

WALKS = ("precomputed", "parents")


@dataclasses.dataclass(frozen=True)
class ConvTreeConfig:
    """Launch knobs of `conv_tree_update`; `default_config(channels)` gives the default."""

    block_d: int  # channels per program (power of two); tiles never exceed next_pow2(D)
    num_warps: int = 4  # Triton warps per program

    def __post_init__(self):
        require_power_of_two(self, "block_d")


def default_config(channels: int) -> ConvTreeConfig:
    """The conv update's config when given none: min(next_pow2(channels), 256) channels per program,
    4 warps."""
    return ConvTreeConfig(block_d=min(next_pow2(channels), 256))


def sanitize_parents(parents: jax.Array) -> jax.Array:
    """Every parent outside [0, t) becomes -1: a malformed pointer ends the path (never a cycle)."""
    parents = parents.astype(jnp.int32)
    node = jnp.arange(parents.shape[-1], dtype=jnp.int32)
    return jnp.where((parents >= 0) & (parents < node), parents, -1)


@functools.partial(jax.jit, static_argnames=("width",))
def conv_lag_sources(parents: jax.Array, width: int) -> jax.Array:
    """`parents [B, T]` -> `[B, T, width-1] int32`: where the column at lag 1..width-1 of node t's
    window comes from (see the module docstring: >= 0 a node, < 0 a committed column)."""
    if not isinstance(width, int) or width < 2:
        raise ValueError(f"conv width must be an int >= 2, got {width!r}")
    par = sanitize_parents(parents)
    cur = jnp.broadcast_to(jnp.arange(par.shape[-1], dtype=jnp.int32), par.shape)
    lags = []
    for _ in range(width - 1):
        up = jnp.take_along_axis(par, jnp.maximum(cur, 0), axis=1)
        cur = jnp.where(cur >= 0, up, cur - 1)  # off the path: step back through committed columns
        lags.append(cur)
    return jnp.stack(lags, axis=-1)


def _conv_kernel(*refs, T, W, BD, D, tree, walk, has_bias, silu, write_states):
    refs = list(refs)
    tree_ref = refs.pop(0) if tree else None  # parents [B, T] (walk="parents") or lag sources [B, T, W-1]
    precomputed = tree and walk == "precomputed"
    slots_ref, x_ref, w_ref = refs[:3]
    refs = refs[3:]
    bias_ref = refs.pop(0) if has_bias else None
    pool_ref = refs.pop(0)
    if write_states:
        refs.pop(0)  # aliased input of the node-state buffer
    y_ref = refs.pop(0)
    rows_ref = refs.pop(0) if write_states else None

    b = pl.program_id(0)
    d0 = pl.program_id(1) * BD
    dmask = d0 + jnp.arange(BD) < D
    slot = slots_ref[b]
    live = slot >= 0
    # weight[:, c] for c = W-1 (newest) down to 0, as fp32 vectors over this channel tile.
    weights = [plgpu.load(w_ref.at[pl.ds(d0, BD), jnp.int32(W - 1 - lag)], mask=dmask, other=0.0).astype(jnp.float32)
               for lag in range(W)]
    base = (plgpu.load(bias_ref.at[pl.ds(d0, BD)], mask=dmask, other=0.0).astype(jnp.float32)
            if has_bias else jnp.zeros((BD,), jnp.float32))

    def parent(s):
        return tree_ref[b, s] if tree else s - 1

    def node(t, carry):
        # `cur` is the node supplying the column at this lag. Once the path has run out it counts
        # down through the committed columns instead: -1 is the newest (column W-2), -2 the one
        # before, so the committed column is W - 1 + cur. Integer arithmetic only, no counters.
        cur = t
        acc = base
        if precomputed:
            # All W-1 sources up front (independent loads), clamped so a bad table stays in bounds:
            # a node <= t, or one of the W-1 committed columns.
            srcs = [t] + [jnp.clip(tree_ref[b, t, jnp.int32(j)], -(W - 1), t) for j in range(W - 1)]
        for lag in range(W):
            if precomputed:
                cur = srcs[lag]
            on_path = cur >= 0
            col = plgpu.load(x_ref.at[b, jnp.maximum(cur, 0), pl.ds(d0, BD)], mask=dmask & on_path, other=0.0)
            col = col.astype(jnp.float32)
            if lag > 0:  # the newest column is always node t itself
                from_state = plgpu.load(pool_ref.at[jnp.maximum(slot, 0), jnp.maximum(W - 1 + cur, 0), pl.ds(d0, BD)],
                                        mask=dmask & jnp.logical_not(on_path) & live, other=0.0)
                col = jnp.where(on_path, col, from_state.astype(jnp.float32))
            acc = acc + weights[lag] * col
            if write_states and lag < W - 1:
                plgpu.store(rows_ref.at[b, t, jnp.int32(W - 2 - lag), pl.ds(d0, BD)], col.astype(rows_ref.dtype),
                            mask=dmask & live)
            if lag < W - 1 and not precomputed:
                nxt = parent(jnp.maximum(cur, 0)) if tree else cur - 1
                if tree:  # a parent that does not decrease (malformed tree) ends the path: in bounds
                    nxt = jnp.where(nxt < cur, nxt, -1)
                cur = jnp.where(on_path, nxt, cur - 1)
        if silu:
            acc = acc * jax.nn.sigmoid(acc)
        plgpu.store(y_ref.at[b, t, pl.ds(d0, BD)], jnp.where(live, acc, 0.0).astype(y_ref.dtype), mask=dmask)
        return carry

    lax.fori_loop(0, T, node, 0)


def conv_tree_update(x, conv_pool, state_slots, weight, bias=None, parents=None, *, silu=False,
                     node_states=None, lags=None, walk="precomputed", block_d=None, num_warps=None, config=None,
                     backend=None):
    """Tree conv update; see the module docstring.

    Shapes: `x [B, T, D]`, `conv_pool [S, W-1, D]`, `state_slots [B] int32`, `weight [D, W]`,
    `bias [D]` or None, `parents [B, T] int32` or None (the chain), `node_states [B, T, W-1, D]` or
    None, `lags [B, T, W-1] int32` = `conv_lag_sources(parents, W)` (computed here when None; pass
    it to share one table across layers). `walk` selects which input form of the tree the kernel
    reads: "precomputed" (default) the lag table `lags`, "parents" the parent pointers themselves
    (the in-kernel pointer chase; ignores `lags`); both give the same windows bit for bit. It is
    part of the call's input contract, not a launch knob, so it stays out of `ConvTreeConfig`.
    `config`: launch knobs (`ConvTreeConfig`); None = `default_config(D)`; `block_d` and
    `num_warps`, when given, override its fields. Returns `(y [B, T, D] in x.dtype, node_states or
    None)`. The committed pool is only read.
    """
    if x.ndim != 3:
        raise ValueError(f"x must be [B, T, D], got shape {x.shape}")
    nb, T, D = x.shape
    if weight.ndim != 2 or weight.shape[0] != D or weight.shape[1] < 2:
        raise ValueError(f"weight must be [D, W] = [{D}, W>=2], got {weight.shape}")
    W = weight.shape[1]
    if conv_pool.ndim != 3 or conv_pool.shape[1:] != (W - 1, D):
        raise ValueError(f"conv_pool must be [S, W-1, D] = [S, {W - 1}, {D}], got {conv_pool.shape}")
    if bias is not None and bias.shape != (D,):
        raise ValueError(f"bias must be [D] = ({D},), got {bias.shape}")
    if state_slots.shape != (nb,) or not jnp.issubdtype(state_slots.dtype, jnp.integer):
        raise ValueError(f"state_slots must be [B] = ({nb},) integers, got {state_slots.shape} {state_slots.dtype}")
    if parents is not None and (parents.shape != (nb, T) or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"parents must be [B, T] = {(nb, T)} integers, got {parents.shape} {parents.dtype}")
    if node_states is not None and node_states.shape != (nb, T, W - 1, D):
        raise ValueError(f"node_states must be [B, T, W-1, D] = {(nb, T, W - 1, D)}, got {node_states.shape}")
    config = default_config(D) if config is None else config
    config = with_overrides(config, block_d=block_d, num_warps=num_warps)
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    if lags is not None:
        if parents is None:
            raise ValueError("lags given without parents: a chain (parents=None) takes no lag table")
        if lags.shape != (nb, T, W - 1) or not jnp.issubdtype(lags.dtype, jnp.integer):
            raise ValueError(f"lags must be [B, T, W-1] = {(nb, T, W - 1)} integers, got {lags.shape} {lags.dtype}")
    kind = resolve_backend(backend)
    if kind == "reference":
        y, rows = conv_tree_update_reference(x, conv_pool, state_slots, weight, bias, parents, silu)
        if node_states is not None:
            live = (state_slots >= 0)[:, None, None, None]
            node_states = jnp.where(live, rows.astype(node_states.dtype), node_states)
        return y.astype(x.dtype), node_states

    BD = min(next_pow2(D), config.block_d)
    tree = parents is not None
    write_states = node_states is not None
    if tree and walk == "precomputed":
        # The kernel reads only the lag table (it replaces the parents input).
        parents = (conv_lag_sources(parents, W) if lags is None else lags).astype(jnp.int32)
    elif tree:
        parents = parents.astype(jnp.int32)  # the parent walk ends a path at a malformed pointer itself
    inputs = ([parents] if tree else []) + [state_slots.astype(jnp.int32), x, weight]
    inputs += ([bias] if bias is not None else []) + [conv_pool]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    aliases = {}
    if write_states:
        aliases = {len(inputs): 1}
        inputs.append(node_states)
        out_shape.append(jax.ShapeDtypeStruct(node_states.shape, node_states.dtype))
    kernel = functools.partial(_conv_kernel, T=T, W=W, BD=BD, D=D, tree=tree, walk=walk, has_bias=bias is not None,
                               silu=silu, write_states=write_states)
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=(nb, pl.cdiv(D, BD)),
        input_output_aliases=aliases,
        interpret=kind == "interpret",
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=1),
        name="conv_tree_update" if tree else "conv_chain_update",
    )(*inputs)
    return outs[0], (outs[1] if write_states else None)
