"""Mamba2 verify scan over a draft tree (or a chain), as one Pallas kernel.

Per node t with parent p(t) (layouts in `mamba2_reference`):
`dt' = softplus(dt + dt_bias)`, `h_t = exp(dt' A) h_p + dt' x_t B_t^T`, `y_t = h_t C_t + D x_t`,
optionally `y_t *= silu(z_t)`; a root (parent -1) starts from the committed state `h0`.

Grid `(B, H, cdiv(P, block_p))`: one program owns a `[block_p, N]` tile of one request's head
state and walks the nodes in index order, keeping the state in registers. Node t continues from
node t-1's state when p(t) == t-1, so a chain never reloads anything. A root takes `h0`. At a
branch (p(t) != t-1, p(t) >= 0) the parent's state is *replayed*: rebuilt by re-running the
updates of its root path over `h0`. `walk="parents"` (default) chases parent pointers leaf to root
(`h_p = (prod of decays) h0 + sum_s (decays after s) dt'_s x_s B_s^T`; results: mamba2-walk).
`walk="precomputed"` reads the path from the step's ancestor list (`Mamba2ScanPlan.paths
[B, T, T]`, root first), so each replayed node's loads depend on a loop counter, not on the
previous node's parent pointer, and reruns the forward recurrence itself from `h0` (a replayed
state equals the one the walk computed the first time).

No node state is kept for reuse, in memory or in extra register tiles: replays read only the
inputs (results: mamba2-branch-slots).

Launch knobs: `Mamba2ScanConfig` (frozen); `default_config(headdim, dstate)` is what the scan runs
when given none.

Modes (what is written besides `y`):
- "staged": every node's state goes to `scratch [B, T, H, P, N]` (aliased in and out, so rows of
  padded requests stay as they were). Roots read the committed pool in place; the scratch is
  never seeded with a copy of it. Row t holds the state *after* node t (no leading committed row).
- "replay" (ReplaySSM): nothing but `y` and each node's payload row `[B | x | dt]` into
  `payload [B, T, width]` (aliased); the committed pool is only read.
- "outputs": only `y` (benchmarks and callers that keep nothing).

A padded request (state slot < 0) reads no state, writes zeros to `y` and nothing else.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import next_pow2, require_power_of_two, resolve_backend, with_overrides
from pallas_kernels.linear.mamba2_reference import (
    Mamba2PayloadLayout,
    mamba2_tree_scan_reference,
    payload_dtype,
    softplus,
)
from pallas_kernels.tree_masks import ancestor_mask_bool

MODES = ("staged", "replay", "outputs")
WALKS = ("precomputed", "parents")
# A [block_p, N] fp32 tile of this many elements keeps h, h0 and the walk accumulator in registers
# at 4 warps without spilling on Hopper (three such tiles live at a branch).
_TILE_ELEMS = 2048


@dataclasses.dataclass(frozen=True)
class Mamba2ScanConfig:
    """Launch knobs of `mamba2_tree_scan`; `default_config(headdim, dstate)` gives the default."""

    block_p: int  # channels per program (power of two); tiles never exceed next_pow2(headdim)
    num_warps: int = 4  # Triton warps per program (power of two)
    unroll: bool = False  # emit the node loop as straight-line code (same results)

    def __post_init__(self):
        require_power_of_two(self, "block_p")
        require_power_of_two(self, "num_warps")
        if not isinstance(self.unroll, bool):
            raise ValueError(f"Mamba2ScanConfig.unroll must be a bool, got {self.unroll!r}")


def default_config(headdim: int, dstate: int) -> Mamba2ScanConfig:
    """The scan's config when given none: the widest power-of-two channel tile (up to
    next_pow2(headdim)) whose `[block_p, next_pow2(dstate)]` fp32 state tile holds at most
    _TILE_ELEMS elements, 4 warps, a rolled node loop."""
    return Mamba2ScanConfig(block_p=max(1, min(next_pow2(headdim), _TILE_ELEMS // next_pow2(dstate))))


class Mamba2ScanPlan(NamedTuple):
    """What the precomputed walk needs besides `parents`, built once per step and shared by every layer."""

    depth: jax.Array  # [B, T] int32: strict ancestors of node t (a root has 0)
    paths: jax.Array  # [B, T, T] int32: paths[b, t, d] = node at depth d on root..t, -1 past depth t


def sanitize_parents(parents: jax.Array) -> jax.Array:
    """`[B, T]` -> int32 with every parent outside [0, t) replaced by -1 (a root).

    Every kernel here treats a malformed pointer (self-loop, forward, below -1) as a root, so a
    malformed tree gives unspecified values for that node's subtree but never an unbounded walk.
    """
    parents = parents.astype(jnp.int32)
    node = jnp.arange(parents.shape[-1], dtype=jnp.int32)
    return jnp.where((parents >= 0) & (parents < node), parents, -1)


def ancestor_paths(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`parents [B, T]` -> `(depth [B, T], paths [B, T, T])` int32, see `Mamba2ScanPlan`.

    The ancestors of t are the set bits of its ancestor-or-self row; along a root path indices
    increase, so sorting them gives the path root first. Malformed parents read as roots.
    """
    parents = sanitize_parents(parents)
    t = parents.shape[-1]
    anc = ancestor_mask_bool(parents)  # [B, t, s]: s is t or an ancestor of t
    depth = jnp.sum(anc, axis=-1, dtype=jnp.int32) - 1
    keys = jnp.sort(jnp.where(anc, jnp.arange(t, dtype=jnp.int32), t), axis=-1)
    paths = jnp.where(jnp.arange(t)[None, None, :] <= depth[..., None], keys, -1)
    return depth, paths.astype(jnp.int32)


@jax.jit
def mamba2_scan_plan(parents: jax.Array) -> Mamba2ScanPlan:
    """The per-step plan for `parents [B, T]` (-1 <= parents[t] < t): the ancestor list the
    precomputed walk replays along. Tiny XLA work ([B, T, T] ints); compute it once per step and
    pass it to every layer's scan."""
    return Mamba2ScanPlan(*ancestor_paths(parents))


def program_coords(slots_ref, block_p: int, nheads: int, ngroups: int):
    """(request b, head h, channel tile pt, its first channel, B/C group, state slot, live) of a
    program on the (B, H, channel tiles) grid; shared with the chunked form."""
    b = pl.program_id(0)
    h = pl.program_id(1)
    pt = pl.program_id(2)
    slot = slots_ref[b]
    return b, h, pt, pt * block_p, h // (nheads // ngroups), slot, slot >= 0


def _scan_kernel(*refs, T, H, P, N, G, BP, NP, tree, walk, has_z, mode, layout, unroll):
    refs = list(refs)
    parents_ref = depth_ref = paths_ref = None
    if tree:
        parents_ref = refs.pop(0)
        if walk == "precomputed":
            depth_ref, paths_ref = refs.pop(0), refs.pop(0)
    slots_ref, x_ref, dt_ref, alog_ref, dtb_ref, d_ref, b_ref, c_ref = refs[:8]
    refs = refs[8:]
    z_ref = refs.pop(0) if has_z else None
    pool_ref = refs.pop(0)
    if mode != "outputs":
        refs.pop(0)  # the aliased input buffer; we write through its output ref
    y_ref = refs.pop(0)
    side_ref = refs.pop(0) if mode != "outputs" else None

    b, h, pt, p0, g, slot, live = program_coords(slots_ref, BP, H, G)
    pidx = p0 + jnp.arange(BP)
    nidx = jnp.arange(NP)
    pmask = pidx < P
    nmask = nidx < N
    tmask = pmask[:, None] & nmask[None, :]
    neg_a = -jnp.exp(alog_ref[h].astype(jnp.float32))
    dt_bias = dtb_ref[h].astype(jnp.float32)
    d_skip = d_ref[h].astype(jnp.float32)

    h0 = plgpu.load(pool_ref.at[jnp.maximum(slot, 0), h, pl.ds(p0, BP), pl.ds(0, NP)],
                    mask=tmask & live, other=0.0).astype(jnp.float32)

    new_path = tree and walk == "precomputed"

    def node_terms(s):
        """Decay, rank-1 input term and raw inputs of node s."""
        dt_raw = dt_ref[b, s, h]
        dtp = softplus(dt_raw.astype(jnp.float32) + dt_bias)
        x_raw = plgpu.load(x_ref.at[b, s, h, pl.ds(p0, BP)], mask=pmask, other=0.0)
        b_raw = plgpu.load(b_ref.at[b, s, g, pl.ds(0, NP)], mask=nmask, other=0.0)
        u = (dtp * x_raw.astype(jnp.float32))[:, None] * b_raw.astype(jnp.float32)[None, :]
        return jnp.exp(dtp * neg_a), u, x_raw, b_raw, dt_raw

    def rebuild_by_parents(p, t):
        """State after node p, accumulated leaf to root over h0 (p == -1 gives h0).

        The walk also stops when a parent pointer fails to decrease (a malformed tree): the result
        is then unspecified, but the kernel always terminates and never reads past node t.
        """

        def body(carry):
            s, _, acc, scale = carry
            a, u, *_ = node_terms(s)
            return parents_ref[b, s], s, acc + scale * u, scale * a

        _, _, acc, scale = lax.while_loop(
            lambda c: (c[0] >= 0) & (c[0] < c[1]), body, (p, t, jnp.zeros_like(h0), jnp.float32(1.0)))
        return acc + scale * h0

    def rebuild(p):
        """State after node p (0 <= p < t) replayed from h0 along the precomputed root path
        (`walk="precomputed"`): the forward recurrence itself, so it equals the first pass's state."""
        end = jnp.clip(depth_ref[b, p], 0, p) + 1  # a path to p holds at most p + 1 nodes

        def body(d, st):
            s = jnp.clip(paths_ref[b, p, d], 0, p)
            a, u, *_ = node_terms(s)
            return a * st + u

        return lax.fori_loop(0, end, body, h0)

    def start_state(t, state):
        """The state node t updates: its parent's (from the carry, h0 or a replay)."""
        if not new_path:  # the earlier kernel, unchanged
            p = parents_ref[b, t]
            return lax.cond(p == t - 1, lambda: state, lambda: rebuild_by_parents(p, t))
        p = parents_ref[b, t]
        p = jnp.where((p >= 0) & (p < t), p, -1)  # a malformed pointer reads as a root (in bounds)
        branch = p != t - 1
        state = jnp.where(branch & (p < 0), h0, state)
        return lax.cond(branch & (p >= 0), lambda: rebuild(jnp.maximum(p, 0)), lambda: state)

    def step(t, state):
        if new_path:
            # Node t's own loads first: they do not depend on the start state, so they are in
            # flight while the branch replays.
            a, u, x_raw, b_raw, dt_raw = node_terms(t)
            state = start_state(t, state)
        else:  # the chain and the earlier tree kernel, in their original order
            if tree:
                state = start_state(t, state)
            a, u, x_raw, b_raw, dt_raw = node_terms(t)
        state = a * state + u
        c_t = plgpu.load(c_ref.at[b, t, g, pl.ds(0, NP)], mask=nmask, other=0.0).astype(jnp.float32)
        y = jnp.sum(state * c_t[None, :], axis=1) + d_skip * x_raw.astype(jnp.float32)
        if has_z:
            z = plgpu.load(z_ref.at[b, t, h, pl.ds(p0, BP)], mask=pmask, other=0.0).astype(jnp.float32)
            y = y * (z * jax.nn.sigmoid(z))
        y = jnp.where(live, y, 0.0)
        plgpu.store(y_ref.at[b, t, h, pl.ds(p0, BP)], y.astype(y_ref.dtype), mask=pmask)
        if mode == "staged":
            plgpu.store(side_ref.at[b, t, h, pl.ds(p0, BP), pl.ds(0, NP)],
                        state.astype(side_ref.dtype), mask=tmask & live)
        elif mode == "replay":
            pdt = side_ref.dtype
            plgpu.store(side_ref.at[b, t, pl.ds(layout.x_offset + h * P + p0, BP)], x_raw.astype(pdt),
                        mask=pmask & live)
            # One program per group writes B and one per head writes dt, so no word is written twice.
            first_of_group = (h % (H // G) == 0) & (pt == 0) & live
            plgpu.store(side_ref.at[b, t, pl.ds(layout.b_offset + g * N, NP)], b_raw.astype(pdt),
                        mask=nmask & first_of_group)
            plgpu.store(side_ref.at[b, t, pl.ds(layout.dt_offset + h, 1)],
                        jnp.full((1,), dt_raw, dtype=pdt), mask=jnp.full((1,), (pt == 0) & live))
        return state

    if unroll:
        # Straight-line nodes: every node's x/B/C/dt loads are independent of the state, so the
        # compiler can issue them ahead instead of paying their latency once per loop trip.
        state = h0
        for t in range(T):
            state = step(jnp.int32(t), state)
    else:
        lax.fori_loop(0, T, step, h0)


def _check(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents, z, mode, scratch, payload):
    if x.ndim != 4:
        raise ValueError(f"x must be [B, T, H, P], got shape {x.shape}")
    nb, T, H, P = x.shape
    if B.ndim != 4 or B.shape[:2] != (nb, T) or C.shape != B.shape:
        raise ValueError(f"B and C must be [B, T, G, N] matching x {x.shape}, got {B.shape} and {C.shape}")
    G, N = B.shape[2], B.shape[3]
    if G < 1 or H % G:
        raise ValueError(f"nheads {H} must be a multiple of ngroups {G}")
    if dt.shape != (nb, T, H):
        raise ValueError(f"dt must be [B, T, H] = {(nb, T, H)}, got {dt.shape}")
    for name, v in (("A_log", A_log), ("D", D), ("dt_bias", dt_bias)):
        if v.shape != (H,):
            raise ValueError(f"{name} must be [H] = ({H},), got {v.shape}")
    if state_pool.ndim != 4 or state_pool.shape[1:] != (H, P, N):
        raise ValueError(f"state_pool must be [S, H, P, N] = [S, {H}, {P}, {N}], got {state_pool.shape}")
    if state_slots.shape != (nb,) or not jnp.issubdtype(state_slots.dtype, jnp.integer):
        raise ValueError(f"state_slots must be [B] = ({nb},) integers, got {state_slots.shape} {state_slots.dtype}")
    if parents is not None and (parents.shape != (nb, T) or not jnp.issubdtype(parents.dtype, jnp.integer)):
        raise ValueError(f"parents must be [B, T] = {(nb, T)} integers, got {parents.shape} {parents.dtype}")
    if z is not None and z.shape != x.shape:
        raise ValueError(f"z must match x {x.shape}, got {z.shape}")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "staged":
        want = (nb, T, H, P, N)
        if scratch is None or scratch.shape != want:
            raise ValueError(f"staged mode needs scratch {want}, got {None if scratch is None else scratch.shape}")
    elif scratch is not None:
        raise ValueError(f"scratch is only written in staged mode, got mode={mode!r}")
    layout = Mamba2PayloadLayout(G, N, H, P)
    if mode == "replay":
        want = (nb, T, layout.width)
        if payload is None or payload.shape != want:
            raise ValueError(f"replay mode needs payload {want}, got {None if payload is None else payload.shape}")
        if payload.dtype != payload_dtype(B.dtype, x.dtype, dt.dtype):
            raise ValueError(f"payload dtype {payload.dtype} would not hold B/x/dt "
                             f"({B.dtype}/{x.dtype}/{dt.dtype}) exactly; use {payload_dtype(B.dtype, x.dtype, dt.dtype)}")
    elif payload is not None:
        raise ValueError(f"payload is only written in replay mode, got mode={mode!r}")
    return layout


def check_plan(plan, nb: int, T: int) -> None:
    """Refuses a plan whose arrays do not fit `[B, T]` = (nb, T), naming the bad field."""
    if not isinstance(plan, Mamba2ScanPlan):
        raise ValueError(f"plan must be a Mamba2ScanPlan (mamba2_scan_plan(parents)), got {type(plan).__name__}")
    for name, arr in plan._asdict().items():
        want = (nb, T, T) if name == "paths" else (nb, T)
        if arr.shape != want:
            raise ValueError(f"plan.{name} must be {list(want)}, got {list(arr.shape)}")


def mamba2_tree_scan(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents=None, *, z=None,
                     mode="outputs", scratch=None, payload=None, plan=None, walk="parents",
                     block_p=None, num_warps=None, unroll=None, config=None, backend=None):
    """Mamba2 verify scan; see the module docstring.

    Shapes: `x [B, T, H, P]`, `dt [B, T, H]`, `A_log/D/dt_bias [H]`, `B/C [B, T, G, N]`,
    `state_pool [S, H, P, N]`, `state_slots [B] int32` (< 0: padded request), `parents [B, T] int32`
    (-1 <= parents[t] < t; None: the chain, compiled without any parent test; a parent outside that
    range is read as a root, so that node and its descendants get unspecified values but nothing
    hangs or reads out of bounds), `z [B, T, H, P]`.
    `walk` selects which input form of the tree the replay at a branch reads: "parents" (the
    default) the parent pointers (the pointer chase, which needs no plan and ignores one),
    "precomputed" the plan's ancestor list (`Mamba2ScanPlan.paths`). It is part of the call's
    input contract, not a launch knob, so it stays out of `Mamba2ScanConfig`. `plan` is
    `mamba2_scan_plan(parents)`, computed here when the precomputed walk needs it and None is
    given (pass it to share one plan across layers). Plan and walk change speed only.
    `config`: launch knobs (`Mamba2ScanConfig`); None = `default_config(P, N)`. `block_p` (power of
    two), `num_warps` and `unroll`, when given, override the config's field of that name.
    Returns `(y [B, T, H, P] in x.dtype, side)` where side is the updated scratch (staged), the
    updated payload (replay) or None (outputs).
    """
    layout = _check(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents, z, mode, scratch, payload)
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    nb, T, H, P = x.shape
    if plan is not None:
        if parents is None:
            raise ValueError("plan given without parents: a chain (parents=None) takes no plan")
        check_plan(plan, nb, T)
    config = default_config(P, B.shape[3]) if config is None else config
    config = with_overrides(config, block_p=block_p, num_warps=num_warps, unroll=unroll)
    kind = resolve_backend(backend)
    if kind == "reference":
        y, states = mamba2_tree_scan_reference(x, dt, A_log, B, C, D, dt_bias, state_pool, state_slots, parents, z)
        live = state_slots >= 0
        side = None
        if mode == "staged":
            side = jnp.where(live[:, None, None, None, None], states.astype(scratch.dtype), scratch)
        elif mode == "replay":
            side = jnp.where(live[:, None, None], layout.pack(B, x, dt).astype(payload.dtype), payload)
        return y.astype(x.dtype), side

    G, N = B.shape[2], B.shape[3]
    NP = next_pow2(N)
    BP = min(next_pow2(P), config.block_p)
    tree = parents is not None
    tree_inputs = []
    if tree:
        # The kernel reads malformed pointers as roots itself (no extra XLA op per layer call).
        parents = parents.astype(jnp.int32)
        tree_inputs = [parents]
        if walk == "precomputed":
            if plan is None:
                plan = mamba2_scan_plan(parents)
            tree_inputs += [plan.depth.astype(jnp.int32), plan.paths.astype(jnp.int32)]
    inputs = tree_inputs + [
        state_slots.astype(jnp.int32), x, dt, A_log, dt_bias, D, B, C] + ([z] if z is not None else []) + [state_pool]
    side = None if mode == "outputs" else (scratch if mode == "staged" else payload)
    kernel = functools.partial(_scan_kernel, T=T, H=H, P=P, N=N, G=G, BP=BP, NP=NP, tree=tree,
                               walk=walk, has_z=z is not None, mode=mode, layout=layout, unroll=config.unroll)
    return launch_head_tiles(kernel, inputs, x, side, grid=(nb, H, pl.cdiv(P, BP)), num_warps=config.num_warps,
                             interpret=kind == "interpret",
                             name="mamba2_tree_scan" if tree else "mamba2_chain_scan")


def launch_head_tiles(kernel, inputs: list, x: jax.Array, side: jax.Array | None, *, grid, num_warps: int,
                      interpret: bool, name: str):
    """One launch over (request, head, channel tile) programs, shared by the recurrent and chunked
    Mamba2 scans: writes y (x's shape and dtype) and, when `side` (the staged scratch or the payload
    rows) is given, updates it in place as the last, aliased operand. Returns `(y, side or None)`."""
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    aliases = {}
    if side is not None:
        aliases = {len(inputs): 1}
        inputs = inputs + [side]
        out_shape.append(jax.ShapeDtypeStruct(side.shape, side.dtype))
    outs = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        name=name,
    )(*inputs)
    return outs[0], (outs[1] if side is not None else None)


__all__ = ["MODES", "WALKS", "Mamba2ScanConfig", "Mamba2ScanPlan", "default_config", "ancestor_paths", "check_plan", "launch_head_tiles",
           "mamba2_scan_plan", "mamba2_tree_scan", "sanitize_parents"]
