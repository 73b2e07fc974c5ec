"""Mamba2 layer glue: tree verify (conv + SSM scan) and the commit after the accepted path is known.

One decode step of a Mamba2 layer over a verify window of T nodes (a tree given by parents, or the
chain):

1. `mamba2_verify`: the tree conv over the raw `xBC [B, T, conv_dim]` (channels ordered
   `[x (H*P) | B (G*N) | C (G*N)]` as in Mamba2's in_proj), then the SSM tree scan. Every node
   starts from its parent's state; roots read the committed pools in place.
   - staged (`mode="staged"`): per-node SSM states go to `scratch.ssm [B, T, H, P, N]` and
     per-node conv rows to `scratch.conv_rows [B, T, W-1, conv_dim]`.
   - ReplaySSM (`mode="replay_ssm"`, the default): no state is written anywhere; the scan writes each
     node's payload row `[B | x | dt]` into `scratch.ssm [B, T, width]` and the conv keeps nothing
     (its commit rebuilds from the raw inputs, which the result carries).
2. `mamba2_commit(path, accept_len)`: path[b, d] is the accepted node at depth d.
   - staged: copy scratch row path[accept_len - 1] into the pools (our scratch row t is the state
     after node t, so the seed's "1 + path[accept_len - 1]" with its leading committed row becomes
     plain path[accept_len - 1] here; for a chain that is accept_len - 1).
   - ReplaySSM: pack the path's payload rows and raw conv inputs to the window front with the
     shared row-move kernel, replay the payload like a chain over the committed SSM state
     (`mamba2_replay_commit`, in place) and rebuild the conv window from the packed inputs.

A padded request (state slot < 0) reads and writes no pool row.

Per step, not per layer: `mamba2_step_plan(parents, conv_width, walk)` (or
`Mamba2Layer.step_plan`) builds the conv's lag sources and, for `walk="precomputed"`, the scan's
ancestor list once; pass the result as `plan=` to every layer's verify of that step. Without it each
layer rebuilds the same tiny tables.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout, payload_dtype
from pallas_kernels.linear.mamba2_replay import mamba2_replay_commit
from pallas_kernels.linear.conv_tree import conv_lag_sources
from pallas_kernels.linear.chunked_common import FP32_DOTS, MAX_CHUNKED_NODES
from pallas_kernels.linear.mamba2_chunked import mamba2_tree_chunked
from pallas_kernels.linear.mamba2_tree import WALKS, Mamba2ScanPlan, mamba2_scan_plan, mamba2_tree_scan
from pallas_kernels.row_move import pack_path_rows
from treespec_jax.linear.conv import conv_commit_from_inputs, conv_commit_staged, conv_verify
from treespec_jax.linear.state_mode import StateMode, check_state_mode
from treespec_jax.support import Capability, TreeBackend, TreeSupport

__all__ = [
    "Mamba2Dims", "Mamba2CommitConfig", "Mamba2Weights", "Mamba2Pools", "Mamba2VerifyScratch",
    "Mamba2VerifyResult", "Mamba2StepPlan", "mamba2_step_plan", "new_verify_scratch", "mamba2_verify",
    "mamba2_commit", "pack_path_rows", "Mamba2Layer",
]


@dataclasses.dataclass(frozen=True)
class Mamba2Dims:
    """Static shape facts of one Mamba2 layer."""

    nheads: int  # H: SSM heads
    headdim: int  # P: channels per head
    dstate: int  # N: state columns per channel
    ngroups: int  # G: B/C groups; head h reads group h // (H // G)
    conv_width: int = 4  # W: depthwise conv taps

    def __post_init__(self):
        for name in ("nheads", "headdim", "dstate", "ngroups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.nheads % self.ngroups:
            raise ValueError(f"nheads {self.nheads} must be a multiple of ngroups {self.ngroups}")
        if self.conv_width < 2:
            raise ValueError(f"conv_width must be >= 2, got {self.conv_width}")

    @property
    def conv_dim(self) -> int:
        return self.nheads * self.headdim + 2 * self.ngroups * self.dstate

    @property
    def payload(self) -> Mamba2PayloadLayout:
        return Mamba2PayloadLayout(self.ngroups, self.dstate, self.nheads, self.headdim)


VERIFY_FORMS = ("auto", "recurrent", "chunked")


@dataclasses.dataclass(frozen=True)
class Mamba2CommitConfig:
    """How verify keeps what the commit needs."""

    mode: StateMode = "replay_ssm"  # ReplaySSM (default): no per-node states; "staged": per-node states
    backend: str | None = None  # kernel backend for every kernel called here (see pallas_kernels.common)
    # How the recurrent tree scan replays a branch's parent state from the committed state:
    # "parents" (default) chases parent pointers; "precomputed" replays along the step's ancestor
    # list (Mamba2StepPlan.scan). Speed only: both give the same results up to rounding.
    # results: mamba2-walk
    walk: str = "parents"
    # Verify scan form: "recurrent" (mamba2_tree_scan, node by node), "chunked" (mamba2_chunked: all
    # nodes at once under the ancestor mask; ReplaySSM only, as it forms no node states; T <= 64) or
    # "auto" (default): chunked under ReplaySSM up to 64 nodes, else recurrent. Same results up to
    # rounding. results: mamba2-chunked
    verify_form: str = "auto"
    # The chunked form's fp32 products: "tf32x3" (three TF32 tensor-core passes, about fp32
    # accuracy, faster) or "ieee". The CPU interpreter always runs IEEE. results: mamba2-chunked
    fp32_dots: str = "tf32x3"

    def __post_init__(self):
        check_state_mode(self.mode, "Mamba2")
        if self.walk not in WALKS:
            raise ValueError(f"Mamba2CommitConfig.walk must be one of {WALKS}, got {self.walk!r}")
        if self.verify_form not in VERIFY_FORMS:
            raise ValueError(f"Mamba2CommitConfig.verify_form must be one of {VERIFY_FORMS}, got {self.verify_form!r}")
        if self.fp32_dots not in FP32_DOTS:
            raise ValueError(f"Mamba2CommitConfig.fp32_dots must be one of {tuple(FP32_DOTS)}, got {self.fp32_dots!r}")
        if self.verify_form == "chunked" and self.mode != "replay_ssm":
            raise ValueError(f"Mamba2CommitConfig: verify_form='chunked' forms no node states, so it needs "
                             f"mode='replay_ssm', got mode={self.mode!r}")

    @property
    def replay_ssm(self) -> bool:
        return self.mode == "replay_ssm"

    def form_for(self, num_nodes: int) -> str:
        """The scan form a verify of `num_nodes` nodes runs: "chunked" or "recurrent"."""
        if self.verify_form != "auto":
            return self.verify_form
        return "chunked" if self.replay_ssm and num_nodes <= MAX_CHUNKED_NODES else "recurrent"


class Mamba2Weights(NamedTuple):
    A_log: jax.Array  # [H]
    dt_bias: jax.Array  # [H]
    D: jax.Array  # [H]
    conv_weight: jax.Array  # [conv_dim, W]
    conv_bias: jax.Array | None  # [conv_dim]


class Mamba2Pools(NamedTuple):
    ssm: jax.Array  # [S, H, P, N] committed recurrent states (fp32 or bf16)
    conv: jax.Array  # [S, W-1, conv_dim] committed conv windows


class Mamba2VerifyScratch(NamedTuple):
    ssm: jax.Array  # staged: [B, T, H, P, N] node states; ReplaySSM: [B, T, width] payload rows
    conv_rows: jax.Array | None  # staged: [B, T, W-1, conv_dim]; ReplaySSM: None


class Mamba2StepPlan(NamedTuple):
    """Per-step tree tables shared by every Mamba2 layer of the step (built by `mamba2_step_plan`)."""

    scan: Mamba2ScanPlan | None  # depths and root paths for walk="precomputed" (None: parent walk)
    conv_lags: jax.Array  # [B, T, W-1] int32 lag sources for the tree conv


def mamba2_step_plan(parents: jax.Array | None, conv_width: int, walk: str = "parents") -> Mamba2StepPlan | None:
    """`parents [B, T]` -> the step's shared plan (None for a chain: it needs none). The scan's
    ancestor list is built only for `walk="precomputed"`; the parent walk (the default) needs none
    (`scan` is None)."""
    if walk not in WALKS:
        raise ValueError(f"walk must be one of {WALKS}, got {walk!r}")
    if parents is None:
        return None
    scan = mamba2_scan_plan(parents) if walk == "precomputed" else None
    return Mamba2StepPlan(scan, conv_lag_sources(parents, conv_width))


class Mamba2VerifyResult(NamedTuple):
    y: jax.Array  # [B, T, H, P] SSM outputs (gated by silu(z) when z was given)
    scratch: Mamba2VerifyScratch  # the written verify scratch
    conv_inputs: jax.Array | None  # ReplaySSM: the raw xBC [B, T, conv_dim] the conv commit replays


def new_verify_scratch(dims: Mamba2Dims, cfg: Mamba2CommitConfig, batch: int, nodes: int,
                       state_dtype=jnp.float32, act_dtype=jnp.bfloat16, dt_dtype=None) -> Mamba2VerifyScratch:
    """Allocates the verify scratch once; thread it through steps (donated) so it is reused.

    `act_dtype` is the dtype of xbc (and so of the conv outputs x, B), `dt_dtype` that of dt
    (default act_dtype); the payload holds all three exactly.
    """
    if cfg.replay_ssm:
        dtype = payload_dtype(act_dtype, act_dtype, act_dtype if dt_dtype is None else dt_dtype)
        return Mamba2VerifyScratch(jnp.zeros((batch, nodes, dims.payload.width), dtype), None)
    ssm = jnp.zeros((batch, nodes, dims.nheads, dims.headdim, dims.dstate), state_dtype)
    conv_rows = jnp.zeros((batch, nodes, dims.conv_width - 1, dims.conv_dim), act_dtype)
    return Mamba2VerifyScratch(ssm, conv_rows)


def _split_xbc(dims: Mamba2Dims, xbc: jax.Array):
    """`[B, T, conv_dim]` -> `x [B, T, H, P]`, `B [B, T, G, N]`, `C [B, T, G, N]`."""
    nb, T = xbc.shape[:2]
    hp, gn = dims.nheads * dims.headdim, dims.ngroups * dims.dstate
    x = xbc[..., :hp].reshape(nb, T, dims.nheads, dims.headdim)
    B = xbc[..., hp : hp + gn].reshape(nb, T, dims.ngroups, dims.dstate)
    C = xbc[..., hp + gn :].reshape(nb, T, dims.ngroups, dims.dstate)
    return x, B, C


def mamba2_verify(dims: Mamba2Dims, cfg: Mamba2CommitConfig, weights: Mamba2Weights, pools: Mamba2Pools,
                  state_slots: jax.Array, xbc: jax.Array, dt: jax.Array, parents: jax.Array | None,
                  scratch: Mamba2VerifyScratch, z: jax.Array | None = None,
                  plan: Mamba2StepPlan | None = None, mask: jax.Array | None = None) -> Mamba2VerifyResult:
    """Verify forward of one Mamba2 layer over T nodes; see the module docstring.

    `xbc [B, T, conv_dim]` raw (pre-conv), `dt [B, T, H]`, `parents [B, T] int32` or None (chain),
    `z [B, T, H, P]` optional gate, `state_slots [B] int32`, `plan` the step's
    `mamba2_step_plan(parents, dims.conv_width, cfg.walk)` (built here when None), `mask
    [B, T, 2] uint32` the step's packed ancestor rows (used by `verify_form="chunked"`; built from
    parents when None). The pools are only read.
    """
    if xbc.ndim != 3 or xbc.shape[2] != dims.conv_dim:
        raise ValueError(f"xbc must be [B, T, {dims.conv_dim}] for {dims}, got {xbc.shape}")
    if cfg.replay_ssm != (scratch.conv_rows is None):
        raise ValueError(f"scratch does not match mode={cfg.mode!r}: allocate it with new_verify_scratch")
    if plan is not None and not isinstance(plan, Mamba2StepPlan):
        raise ValueError(f"plan must be a Mamba2StepPlan (mamba2_step_plan), got {type(plan).__name__}")
    if plan is None:
        plan = mamba2_step_plan(parents, dims.conv_width, cfg.walk)
    elif parents is None:
        raise ValueError("plan given without parents: a chain (parents=None) takes no plan")
    lags, scan_plan = (None, None) if plan is None else (plan.conv_lags, plan.scan)
    conv_y, conv_rows = conv_verify(xbc, pools.conv, state_slots, weights.conv_weight, weights.conv_bias, parents,
                                    silu=True, node_states=scratch.conv_rows, lags=lags, backend=cfg.backend)
    x, B, C = _split_xbc(dims, conv_y)
    scan_kw = dict(z=z, walk=cfg.walk, plan=scan_plan, backend=cfg.backend)
    if cfg.form_for(xbc.shape[1]) == "chunked":
        y, payload = mamba2_tree_chunked(x, dt, weights.A_log, B, C, weights.D, weights.dt_bias, pools.ssm,
                                         state_slots, parents, mask=mask, z=z, mode="replay", payload=scratch.ssm,
                                         fp32_dots=cfg.fp32_dots, backend=cfg.backend)
        return Mamba2VerifyResult(y, Mamba2VerifyScratch(payload, None), xbc)
    if cfg.replay_ssm:
        y, payload = mamba2_tree_scan(x, dt, weights.A_log, B, C, weights.D, weights.dt_bias, pools.ssm, state_slots,
                                      parents, mode="replay", payload=scratch.ssm, **scan_kw)
        return Mamba2VerifyResult(y, Mamba2VerifyScratch(payload, None), xbc)
    y, states = mamba2_tree_scan(x, dt, weights.A_log, B, C, weights.D, weights.dt_bias, pools.ssm, state_slots,
                                 parents, mode="staged", scratch=scratch.ssm, **scan_kw)
    return Mamba2VerifyResult(y, Mamba2VerifyScratch(states, conv_rows), None)


def _last_accepted(path, accept_len):
    T = path.shape[1]
    last = jnp.take_along_axis(path, jnp.clip(accept_len - 1, 0, T - 1)[:, None], axis=1)[:, 0]
    return jnp.clip(last, 0, T - 1)


def mamba2_commit(dims: Mamba2Dims, cfg: Mamba2CommitConfig, weights: Mamba2Weights, pools: Mamba2Pools,
                  state_slots: jax.Array, result: Mamba2VerifyResult, path: jax.Array,
                  accept_len: jax.Array) -> Mamba2Pools:
    """Writes the state after the last accepted node into both pools; see the module docstring.

    `path [B, T] int32` (path[b, d] = node at depth d, root first), `accept_len [B] int32` in 1..T.
    Donate the pools at the jit boundary so the updates happen in place.
    """
    scratch = result.scratch
    nb, T = scratch.ssm.shape[:2]
    if path.shape != (nb, T) or accept_len.shape != (nb,):
        raise ValueError(f"path must be [B, T] = {(nb, T)} and accept_len [B], got {path.shape}, {accept_len.shape}")
    if cfg.replay_ssm:
        payload = pack_path_rows(scratch.ssm, path, accept_len, backend=cfg.backend)
        ssm = mamba2_replay_commit(payload, accept_len, pools.ssm, state_slots, weights.A_log, weights.dt_bias,
                                   ngroups=dims.ngroups, dstate=dims.dstate, backend=cfg.backend)
        packed_x = pack_path_rows(result.conv_inputs, path, accept_len, backend=cfg.backend)
        conv = conv_commit_from_inputs(pools.conv, state_slots, packed_x, accept_len)
        return Mamba2Pools(ssm, conv)
    rows = scratch.ssm[jnp.arange(nb), _last_accepted(path, accept_len)]
    dst = jnp.where(state_slots >= 0, state_slots, pools.ssm.shape[0])  # padded requests: dropped
    ssm = pools.ssm.at[dst].set(rows.astype(pools.ssm.dtype), mode="drop")
    conv = conv_commit_staged(pools.conv, state_slots, scratch.conv_rows, path, accept_len)
    return Mamba2Pools(ssm, conv)


@dataclasses.dataclass(frozen=True, eq=False)
class Mamba2Layer(TreeBackend):
    """A Mamba2 layer as a node of the backend tree, with its verify and commit."""

    name: str  # path component, e.g. "layers.3"
    dims: Mamba2Dims  # static shapes
    cfg: Mamba2CommitConfig = Mamba2CommitConfig()  # ReplaySSM or staged, kernel backend

    def tree_support(self) -> TreeSupport:
        # Verify follows parents in both commit modes. Draft lanes keep no per-lane recurrent state.
        return TreeSupport(
            Capability.ok(),
            Capability.refused("mamba2 linear-attention layer in draft lanes (lanes keep no per-lane recurrent state)"),
        )

    def step_plan(self, parents) -> Mamba2StepPlan | None:
        """The step's shared tables for this layer's shape; layers of equal conv width and walk
        share one (build it once per step, pass it to every layer's verify)."""
        return mamba2_step_plan(parents, self.dims.conv_width, self.cfg.walk)

    def verify(self, weights, pools, state_slots, xbc, dt, parents, scratch, z=None,
               plan: Mamba2StepPlan | None = None) -> Mamba2VerifyResult:
        return mamba2_verify(self.dims, self.cfg, weights, pools, state_slots, xbc, dt, parents, scratch, z, plan)

    def commit(self, weights, pools, state_slots, result, path, accept_len) -> Mamba2Pools:
        return mamba2_commit(self.dims, self.cfg, weights, pools, state_slots, result, path, accept_len)
