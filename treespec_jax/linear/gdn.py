"""GDN layers under tree verify: the verify call and the commit, in ReplaySSM and staged modes.

Modes (`GdnStateMode`):
  "replay_ssm" (default) The committed state pool is never written during verify. With
               `chunked_tree_verify` (default), trees on the layer's chunked route
               (`GdnLayerConfig.chunked_route`: by grid, padding and whether q and k are 16-bit;
               with bf16 q and k every tree of 8..64 nodes) run the chunked tree form (no node
               states at all);
               other trees run the recurrent
               kernel, which stores the state of every branch point (a node with a child other than
               t + 1) in the one workspace every layer shares (`[B, T, HV, dk, dv]`, one layer's
               worth) and reloads a branch's parent from there.
               Verify writes each node's replay payload row `[k | v | a | b]`; the commit packs the
               accepted path's rows to the window front (`pallas_kernels.row_move.move_rows`) and
               replays min(accept_len, T) of them over the committed state in place.
  "staged"     Verify writes every node's state to the verify scratch `[B, T, HV, dk, dv]` (roots
               read the committed pool in place; the scratch is never seeded with a copy). The commit
               copies scratch row path[accept_len - 1] into the pool.

Scratch row indexing: row t holds the state *after* node t; there is no leading committed row, so
the staged source row is path[accept_len - 1] (DESIGN's "1 + path[accept_len - 1]" counts such a
leading row). For a chain it is accept_len - 1. accept_len == 0 (a padded request) commits nothing.

A chain (topk == 1) passes no tree (`parents=None`, `ancestor_mask=None`): the recurrent kernel runs
without reading parents and never reloads; under ReplaySSM, chains in
`GdnLayerConfig.chain_chunked_ranges` take the chunked form with a chain's ancestor mask
(`chunked_chain_verify`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.linear.chunked_common import FP32_DOTS, MAX_CHUNKED_NODES
from pallas_kernels.linear.gdn_chunked import (MIN_CHUNK, chunk_rows, default_apply_reads_keys,
                                              default_input_dtype_grams,
                                              default_two_pass, gdn_chunked_verify)
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout
from pallas_kernels.linear.gdn_replay import gdn_replay_commit
from pallas_kernels.row_move import pack_path_rows
from pallas_kernels.linear.gdn_tree import GdnKernelConfig, branch_points, gdn_tree_verify
from treespec_jax.linear.state_mode import StateMode, check_state_mode
from treespec_jax.support import Capability, TreeBackend, TreeSupport
from treespec_jax.tree.masks import ancestor_mask as packed_ancestor_mask
from treespec_jax.tree.masks import chain_parents
from treespec_jax.tree.masks import unpack_mask_rows

# Smallest tree the layer may send to the chunked form under ReplaySSM.
GDN_TREE_VERIFY_CHUNKED_MIN_NODES = 8

# The layer's default routes. "Large grid": B * HV >= `GdnKernelConfig.two_pass_min_programs` (the
# two-pass form at every padding); "small grid": below it (the fused form at 16 padded rows,
# two-pass past them). The chunked cost steps with the padded rows (16, 32, 64) while the recurrent
# kernels' grows with T, so past 16 rows a tree goes chunked only from a minimum node count per
# padding. Every range and minimum below is where the chunked form is the faster one.
# results: gdn-routes
#
# Trees, large grid: 8..64 nodes, past 16 from GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES[padded rows,
# apply-reads-keys variant runs, input-dtype grams]. With grams the default variants take every tree
# past 16 nodes (17 and 33); without them the plain two-pass form from 26 nodes at 32 rows (the keys
# variant from 29) and at 64 rows the keys variant from 33, plain two-pass from 40. The variants not
# run by default (keys at 32 rows, plain two-pass at 64) keep their minima without grams.
GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS = (GDN_TREE_VERIFY_CHUNKED_MIN_NODES, MAX_CHUNKED_NODES)
GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES = {
    (32, False, False): 26, (32, True, False): 29, (64, False, False): 40, (64, True, False): 33,
    (32, False, True): 17, (32, True, True): 29, (64, False, True): 40, (64, True, True): 33}
# Trees, small grid: with input-dtype grams 8..64, without them 12..64 (the fused form loses below 12
# nodes there). Past 16 nodes by GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID[padded rows,
# keys variant runs, grams] (a minimum above the padded rows sends none): without grams only the
# keys variant at 64 rows, from 48 nodes; with grams the default variants from 17 and 33. The
# variants not run by default (keys at 32 rows, plain two-pass at 64) keep their minima without grams.
GDN_TREE_VERIFY_CHUNKED_NODES_SMALL_GRID = {False: (12, MAX_CHUNKED_NODES), True: (8, MAX_CHUNKED_NODES)}
GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID = {
    (32, False, False): 33, (32, True, False): 33, (64, False, False): 65, (64, True, False): 48,
    (32, False, True): 17, (32, True, True): 33, (64, False, True): 65, (64, True, True): 33}
# Wherever only the fused form runs (chunked_two_pass=False): 12..16, since past 16 nodes the fused
# form is slower than the recurrent tree on every grid (results: gdn-two-pass).
GDN_TREE_VERIFY_CHUNKED_NODES_FUSED = (12, 16)

# Chains (no tree) under ReplaySSM take the chunked form (the kernel's default for the grid and
# padding) over these node ranges (`GdnLayerConfig.chain_chunked_ranges`):
# - with grams, large grid: 8..64; 8..32 where the keys variant is off at 64 rows;
# - with grams, small grid: 8..16 (fused) and 48..64 where keys runs at 64 rows;
# - without grams, large grid only: 12..16 and 56..64 where keys runs at 64 rows.
GDN_CHAIN_VERIFY_CHUNKED_NODES = (12, 16)
GDN_CHAIN_VERIFY_CHUNKED_NODES_64_ROWS = (56, 64)
GDN_CHAIN_VERIFY_CHUNKED_NODES_GRAMS = (GDN_TREE_VERIFY_CHUNKED_MIN_NODES, MAX_CHUNKED_NODES)
GDN_CHAIN_VERIFY_CHUNKED_NODES_GRAMS_SMALL_GRID = ((GDN_TREE_VERIFY_CHUNKED_MIN_NODES, 16), (48, MAX_CHUNKED_NODES))

GdnStateMode = StateMode  # one mode for every linear-attention layer (linear.state_mode)


@dataclass(frozen=True)
class GdnLayerConfig:
    """One GDN layer's static facts."""

    num_k_heads: int  # H: query/key heads
    num_v_heads: int  # HV: value heads, a multiple of H (value head hv reads key head hv // (HV/H))
    head_k_dim: int  # dk (power of two >= 16)
    head_v_dim: int  # dv (power of two >= 16)
    use_qk_l2norm: bool = True  # L2-normalise q and k per head before the update (eps 1e-6)
    scale: float | None = None  # query scale; None = dk ** -0.5
    mode: GdnStateMode = "replay_ssm"  # "staged" is --disable-replay-ssm
    kernel: GdnKernelConfig = GdnKernelConfig()  # launch knobs shared by the GDN kernels
    # ReplaySSM trees on the chunked route (`chunked_route`) verify in the chunked form (no node
    # states, no workspace traffic); other trees and staged verify run the recurrent kernel. This and
    # chunked_min/max_nodes govern trees only; chains follow chunked_chain_verify.
    chunked_tree_verify: bool = True
    # ReplaySSM chains in `chain_chunked_ranges` verify in the chunked form (with 16-bit q and k:
    # 8..64 nodes on a large grid, 8..16 and 48..64 on a small one; otherwise 12..16 and 56..64 on a
    # large grid only); other chains run the recurrent chain kernel.
    chunked_chain_verify: bool = True
    # Smallest tree sent to the chunked form, in [GDN_TREE_VERIFY_CHUNKED_MIN_NODES (8),
    # MAX_CHUNKED_NODES (64)]; None = the grid's default (`chunked_route`).
    chunked_min_nodes: int | None = None
    # Largest tree sent to the chunked form, in [chunked_min_nodes, MAX_CHUNKED_NODES (64)]; None = the
    # default of the grid: 64 (trees past 16 nodes only from the padded-rows minima,
    # GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES[_SMALL_GRID]), 16 under chunked_two_pass=False
    # (GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS / _SMALL_GRID / _FUSED).
    chunked_max_nodes: int | None = None
    # The chunked form's fp32 products: "tf32x3" (three TF32 tensor-core passes, about fp32
    # accuracy, faster) or "ieee". The CPU interpreter always runs IEEE.
    # results: gdn-tf32x3
    chunked_fp32_dots: str = "tf32x3"
    # Run the chunked form as two kernels (True: key-side factors once per value head, then
    # out = Q' h0 + P v per dv tile), as one fused kernel (False), or None = by grid and padding
    # (`gdn_chunked.default_two_pass`: two-pass past 16 padded rows, and at 16 when B * HV >=
    # kernel.two_pass_min_programs). True on a small grid also runs two-pass at 16 rows.
    chunked_two_pass: bool | None = None
    # Where the two-pass form runs, run its variant whose second kernel reads q and k
    # (`gdn_chunked_verify(apply_reads_keys=True)`: the first kernel keeps only [T, T] products):
    # True / False at every size, None = from 64 padded rows (`gdn_chunked.default_apply_reads_keys`).
    chunked_apply_reads_keys: bool | None = None
    # The chunked forms form q k^T and k k^T from the 16-bit q and k rows as loaded (exact products, one
    # tensor-core pass) and scale them afterwards (`gdn_chunked_verify(input_dtype_grams=True)`): True
    # (q and k must then share bf16 or fp16; refused by gdn_verify otherwise), False, or None = on
    # when they do (faster; the routes follow it). results: gdn-grams
    chunked_input_dtype_grams: bool | None = None

    def __post_init__(self):
        check_state_mode(self.mode, "GDN")
        errors = []
        if self.num_k_heads < 1 or self.num_v_heads % self.num_k_heads:
            errors.append(f"num_v_heads={self.num_v_heads} must be a positive multiple of "
                          f"num_k_heads={self.num_k_heads}")
        lo, hi = GDN_TREE_VERIFY_CHUNKED_MIN_NODES, MAX_CHUNKED_NODES
        if self.chunked_min_nodes is not None and not lo <= self.chunked_min_nodes <= hi:
            errors.append(f"chunked_min_nodes={self.chunked_min_nodes} must be in [{lo}, {hi}]")
        if self.chunked_max_nodes is not None and not lo <= self.chunked_max_nodes <= hi:
            errors.append(f"chunked_max_nodes={self.chunked_max_nodes} must be in [{lo}, {hi}] (the chunked "
                          f"kernel's MAX_CHUNKED_NODES is {hi})")
        if (self.chunked_min_nodes is not None and self.chunked_max_nodes is not None
                and self.chunked_min_nodes > self.chunked_max_nodes):
            errors.append(f"chunked_min_nodes={self.chunked_min_nodes} must not exceed "
                          f"chunked_max_nodes={self.chunked_max_nodes}")
        if not (self.chunked_two_pass is None or isinstance(self.chunked_two_pass, bool)):
            errors.append(f"chunked_two_pass={self.chunked_two_pass!r} must be None, True or False")
        if not (self.chunked_apply_reads_keys is None or isinstance(self.chunked_apply_reads_keys, bool)):
            errors.append(f"chunked_apply_reads_keys={self.chunked_apply_reads_keys!r} must be None, True or False")
        elif self.chunked_apply_reads_keys and self.chunked_two_pass is False:
            errors.append("chunked_apply_reads_keys=True is a two-pass form, but chunked_two_pass=False")
        if not (self.chunked_input_dtype_grams is None or isinstance(self.chunked_input_dtype_grams, bool)):
            errors.append(f"chunked_input_dtype_grams={self.chunked_input_dtype_grams!r} must be None, True or False")
        if ((self.chunked_tree_verify or self.chunked_chain_verify) and self.kernel.block_v is not None
                and self.kernel.block_v < MIN_CHUNK):
            errors.append(f"kernel.block_v={self.kernel.block_v} is below the chunked forms' {MIN_CHUNK} columns "
                          f"(they share the layer's kernel config); use block_v >= {MIN_CHUNK} or "
                          f"chunked_tree_verify=False and chunked_chain_verify=False")
        if self.chunked_fp32_dots not in FP32_DOTS:
            errors.append(f"chunked_fp32_dots={self.chunked_fp32_dots!r} must be one of {tuple(FP32_DOTS)}")
        if errors:
            raise ValueError("GdnLayerConfig: " + "; ".join(errors))

    def _two_pass_runs(self, batch: int) -> bool:
        """The two-pass chunked form runs at 16 padded rows at this batch size: a large grid, not forced
        off (past 16 rows it runs on every grid unless forced off)."""
        return default_two_pass(batch, self.num_v_heads, config=self.kernel) and self.chunked_two_pass is not False

    def runs_input_dtype_grams(self, q_dtype, k_dtype=None) -> bool:
        """Whether the chunked forms take their grams from the q and k rows as loaded (k_dtype None =
        q's): chunked_input_dtype_grams, or where it is None, whether q and k share a 16-bit dtype."""
        if self.chunked_input_dtype_grams is None:
            return default_input_dtype_grams(q_dtype, q_dtype if k_dtype is None else k_dtype)
        return self.chunked_input_dtype_grams

    def chain_chunked_ranges(self, batch: int, q_dtype, k_dtype=None) -> tuple[tuple[int, int], ...]:
        """The (smallest, largest) node ranges of ReplaySSM chains that verify in the chunked form at
        this batch size and q / k dtypes (the GDN_CHAIN_VERIFY_CHUNKED_NODES* constants; the form is the
        kernel's default for the grid and padding, or chunked_two_pass=True's); () when chunked
        chains are off, staged, or chunked_two_pass=False."""
        if not (self.chunked_chain_verify and self.mode == "replay_ssm" and self.chunked_two_pass is not False):
            return ()
        keys_at_64 = self.runs_apply_reads_keys(64)
        if not self.runs_input_dtype_grams(q_dtype, k_dtype):
            if not self._two_pass_runs(batch):
                return ()
            return (GDN_CHAIN_VERIFY_CHUNKED_NODES,) + ((GDN_CHAIN_VERIFY_CHUNKED_NODES_64_ROWS,) if keys_at_64 else ())
        if not self._two_pass_runs(batch):
            return GDN_CHAIN_VERIFY_CHUNKED_NODES_GRAMS_SMALL_GRID[:None if keys_at_64 else 1]
        lo, hi = GDN_CHAIN_VERIFY_CHUNKED_NODES_GRAMS
        return ((lo, hi if keys_at_64 else 2 * MIN_CHUNK),)

    def chain_runs_chunked(self, num_nodes: int, batch: int, q_dtype, k_dtype=None) -> bool:
        """Whether a ReplaySSM chain of num_nodes nodes verifies in the chunked form
        (`chain_chunked_ranges`)."""
        return any(lo <= num_nodes <= hi for lo, hi in self.chain_chunked_ranges(batch, q_dtype, k_dtype))

    def chunked_route(self, batch: int, q_dtype, k_dtype=None) -> tuple[int, int, dict[int, int]]:
        """(smallest tree, largest tree, padded_min_nodes) this layer sends to the chunked form at this
        batch size and q / k dtypes (see `verify_kernel_for`). Explicit bounds win; an unset bound
        takes the grid's default range (8..64 on a large grid; on a small one 8..64 with input-dtype
        grams, 12..64 without; 12..16 wherever chunked_two_pass=False leaves only the fused form),
        clipped so that it never crosses the explicit one (an unset min becomes 8, an unset max 64).
        The padded-rows minima (GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES on a large grid, by the
        two-pass variant this layer runs at 32 and 64 rows and grams; _SMALL_GRID likewise on a small
        one) hold only when chunked_max_nodes is unset and the default range reaches past 16 nodes;
        otherwise the dict is empty."""
        large = self._two_pass_runs(batch)
        grams = self.runs_input_dtype_grams(q_dtype, k_dtype)
        if self.chunked_two_pass is False:
            lo, hi = GDN_TREE_VERIFY_CHUNKED_NODES_FUSED
        else:
            lo, hi = GDN_TREE_VERIFY_CHUNKED_NODES_TWO_PASS if large else GDN_TREE_VERIFY_CHUNKED_NODES_SMALL_GRID[grams]
        past_16 = hi > MIN_CHUNK
        if self.chunked_min_nodes is not None:
            lo = self.chunked_min_nodes
            hi = hi if hi >= lo else MAX_CHUNKED_NODES
        if self.chunked_max_nodes is not None:
            hi = self.chunked_max_nodes
            lo = lo if lo <= hi else GDN_TREE_VERIFY_CHUNKED_MIN_NODES
        if not past_16 or self.chunked_max_nodes is not None:
            return lo, hi, {}
        if not large:
            table = GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES_SMALL_GRID
        else:
            table = GDN_TREE_VERIFY_CHUNKED_PADDED_MIN_NODES
        return lo, hi, {rows: table[rows, self.runs_apply_reads_keys(rows), grams] for rows in (32, 64)}

    def runs_apply_reads_keys(self, padded_rows: int) -> bool:
        """Whether the two-pass form, where it runs, takes its apply-reads-keys variant at this many
        padded rows."""
        if self.chunked_apply_reads_keys is None:
            return default_apply_reads_keys(padded_rows)
        return self.chunked_apply_reads_keys

    @property
    def payload_layout(self) -> GdnPayloadLayout:
        return GdnPayloadLayout(self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim)


class GdnVerifyOutput(NamedTuple):
    out: jax.Array  # [B, T, HV, dv]
    node_states: jax.Array  # staged scratch / ReplaySSM workspace, [B, T, HV, dk, dv] fp32
    payload: jax.Array | None  # ReplaySSM payload rows [B, T, width]; None when staged


def verify_kernel_for(mode: GdnStateMode, num_nodes: int, is_tree: bool, chunked_tree_verify: bool,
                      min_nodes: int = GDN_TREE_VERIFY_CHUNKED_MIN_NODES, *,
                      max_nodes: int = MAX_CHUNKED_NODES, padded_min_nodes: Mapping[int, int] | None = None,
                      chain_chunked: bool = False) -> str:
    """Which kernel a verify runs: "chunked", "recurrent_tree" or "recurrent_chain".

    ReplaySSM trees of max(min_nodes, GDN_TREE_VERIFY_CHUNKED_MIN_NODES)..max_nodes nodes take the
    chunked form (`GdnLayerConfig` keeps max_nodes <= MAX_CHUNKED_NODES), except a tree padded past
    16 rows with fewer nodes than `padded_min_nodes[padded rows]` (32 or 64 rows; a missing key sets
    no minimum). A layer passes `*cfg.chunked_route(B, q.dtype, k.dtype)`; the defaults here are the widest range, with
    no padded-rows minimum. A chain runs the chunked form only under ReplaySSM with `chain_chunked`
    (`cfg.chain_runs_chunked(T, B, q.dtype, k.dtype)`).
    """
    check_state_mode(mode, "GDN")
    if not is_tree:
        return "chunked" if chain_chunked and mode == "replay_ssm" else "recurrent_chain"
    padded = chunk_rows(num_nodes)
    if (chunked_tree_verify and mode == "replay_ssm"
            and max(min_nodes, GDN_TREE_VERIFY_CHUNKED_MIN_NODES) <= num_nodes <= max_nodes
            and (padded == MIN_CHUNK or num_nodes >= (padded_min_nodes or {}).get(padded, 0))):
        return "chunked"
    return "recurrent_tree"


def node_state_buffer(batch: int, num_nodes: int, cfg: GdnLayerConfig) -> jax.Array:
    """A staged scratch or ReplaySSM workspace `[B, T, HV, dk, dv]` fp32 (contents are never read
    before they are written, so it is left uninitialised in spirit; zeros here)."""
    return jnp.zeros((batch, num_nodes, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32)


def payload_buffer(batch: int, num_nodes: int, cfg: GdnLayerConfig, dtype) -> jax.Array:
    """One layer's payload rows `[B, T, width]` in the dtype of k/v/a/b."""
    return jnp.zeros((batch, num_nodes, cfg.payload_layout.width), dtype)


def parents_from_ancestor_mask(mask: jax.Array) -> jax.Array:
    """`[B, T, 2] uint32` ancestor-or-self rows -> `parents [B, T] int32` (deepest strict ancestor).

    With parents before children the parent of t is its highest-numbered strict ancestor.
    """
    t = mask.shape[1]
    anc = unpack_mask_rows(mask, t) & ~jnp.eye(t, dtype=bool)
    return jnp.max(jnp.where(anc, jnp.arange(t, dtype=jnp.int32), -1), axis=-1).astype(jnp.int32)


class GdnTree(NamedTuple):
    """One step's tree in the forms the GDN kernels read; build it once per step for all layers."""

    parents: jax.Array  # [B, T] int32, parents[t] < t, -1 for a root
    ancestor_mask: jax.Array  # [B, T, 2] uint32 packed ancestor-or-self rows (what attention reads)
    branch: jax.Array  # [B, T] bool: node has a child other than t + 1 (the ReplaySSM workspace rows)

    @classmethod
    def from_parents(cls, parents: jax.Array) -> "GdnTree":
        parents = parents.astype(jnp.int32)
        return cls(parents, packed_ancestor_mask(parents), branch_points(parents))

    @classmethod
    def from_ancestor_mask(cls, mask: jax.Array) -> "GdnTree":
        parents = parents_from_ancestor_mask(mask)
        return cls(parents, mask, branch_points(parents))


def gdn_verify(cfg: GdnLayerConfig, q, k, v, a, b, A_log, dt_bias, state_pool, state_slots, *,
               node_states: jax.Array, payload: jax.Array | None = None,
               tree: GdnTree | None = None, backend: str | None = None) -> GdnVerifyOutput:
    """One GDN layer's verify over T nodes per request (shapes in `pallas_kernels.linear.gdn_common`).

    tree: the step's `GdnTree` (None = a chain); its branch points are shared by every layer.
    node_states: the staged scratch or the shared ReplaySSM workspace (updated in place, donate
    it; under ReplaySSM only branch-point rows are written). payload: this layer's
    `[B, T, width]` rows, required under ReplaySSM.
    """
    _check_layer(cfg, q, v)
    t = q.shape[1]
    if cfg.mode == "replay_ssm" and payload is None:
        raise ValueError("ReplaySSM verify needs this layer's payload buffer [B, T, width] (payload=None)")
    if cfg.mode == "staged" and payload is not None:
        raise ValueError("staged verify writes no replay payload; pass payload=None")
    if cfg.chunked_input_dtype_grams and not default_input_dtype_grams(q.dtype, k.dtype):
        # Refused on every route, not only where the chunked form would run.
        raise ValueError(f"chunked_input_dtype_grams=True needs q and k of one 16-bit float dtype; got q {q.dtype}, "
                         f"k {k.dtype} (use None to turn it on only for 16-bit rows)")
    lo, hi, padded_min = cfg.chunked_route(q.shape[0], q.dtype, k.dtype)
    kernel = verify_kernel_for(cfg.mode, t, tree is not None, cfg.chunked_tree_verify, lo, max_nodes=hi,
                               padded_min_nodes=padded_min,
                               chain_chunked=cfg.chain_runs_chunked(t, q.shape[0], q.dtype, k.dtype))
    common = dict(use_qk_l2norm=cfg.use_qk_l2norm, scale=cfg.scale, config=cfg.kernel, backend=backend)
    if kernel == "chunked":
        chain_chunked = tree is None
        mask = packed_ancestor_mask(chain_parents(q.shape[0], t)) if chain_chunked else tree.ancestor_mask
        # The layer picks the form itself (its knob, else the kernel's default for this grid and
        # padding) and passes its keys knob only to the two-pass form: given to the kernel with
        # two_pass=None, an explicit keys knob would ask for two-pass where the route chose fused.
        two_pass = (default_two_pass(q.shape[0], cfg.num_v_heads, chunk_rows(t), cfg.kernel) if cfg.chunked_two_pass is None
                    else cfg.chunked_two_pass)
        out, payload = gdn_chunked_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots,
                                          mask, payload, fp32_dots=cfg.chunked_fp32_dots, two_pass=two_pass,
                                          apply_reads_keys=cfg.chunked_apply_reads_keys if two_pass else None,
                                          input_dtype_grams=cfg.runs_input_dtype_grams(q.dtype, k.dtype), **common)
        return GdnVerifyOutput(out, node_states, payload)
    store = "every_node" if cfg.mode == "staged" else "branch_points"
    res = gdn_tree_verify(q, k, v, a, b, A_log, dt_bias, state_pool, state_slots,
                          None if tree is None else tree.parents, node_states, store=store,
                          payload=payload, branch=None if tree is None else tree.branch, **common)
    return GdnVerifyOutput(res.out, res.node_states, res.payload)


def gdn_commit_staged(state_pool, state_slots, scratch, path, accept_len) -> jax.Array:
    """Copies scratch row path[b, accept_len[b] - 1] into pool row state_slots[b]; returns the pool.

    `state_pool [S, HV, dk, dv]`, `scratch [B, T, HV, dk, dv]`, `path [B, T] int32`,
    `accept_len [B] int32` (0 = commit nothing). Donate the pool under jit to update it in place.
    """
    bsz, t = path.shape
    if scratch.shape[:2] != (bsz, t) or scratch.shape[2:] != state_pool.shape[1:]:
        raise ValueError(f"scratch must be [B, T] + pool row {state_pool.shape[1:]} with B, T = {(bsz, t)}; "
                         f"got {scratch.shape}")
    if accept_len.shape != (bsz,) or state_slots.shape != (bsz,):
        raise ValueError(f"accept_len and state_slots must be [B={bsz}]; got {accept_len.shape}, "
                         f"{state_slots.shape}")
    last = jnp.take_along_axis(path, jnp.maximum(accept_len - 1, 0)[:, None], axis=1)[:, 0]
    rows = scratch[jnp.arange(bsz), jnp.clip(last, 0, t - 1)]
    # Requests that commit nothing scatter out of bounds, which mode="drop" discards.
    dst = jnp.where(accept_len > 0, state_slots, state_pool.shape[0])
    return state_pool.at[dst].set(rows, mode="drop")


def gdn_commit_replay(cfg: GdnLayerConfig, state_pool, state_slots, payload, path, accept_len, A_log,
                      dt_bias, *, backend: str | None = None):
    """ReplaySSM commit of one layer: pack the accepted rows to the front, then replay them.

    Returns `(state_pool, packed_payload)`; both are updated in place under donation.
    """
    _check_mode(cfg, "replay_ssm")
    packed = pack_path_rows(payload, path, accept_len, backend=backend)
    pool = gdn_replay_commit(state_pool, state_slots, packed, accept_len, A_log, dt_bias,
                             num_k_heads=cfg.num_k_heads, head_k_dim=cfg.head_k_dim,
                             use_qk_l2norm=cfg.use_qk_l2norm, config=cfg.kernel, backend=backend)
    return pool, packed


def _check_mode(cfg: GdnLayerConfig, mode: str) -> None:
    if cfg.mode != mode:
        raise ValueError(f"this commit is for mode {mode!r}, but the layer runs {cfg.mode!r}")


def _check_layer(cfg: GdnLayerConfig, q, v) -> None:
    want_q = (cfg.num_k_heads, cfg.head_k_dim)
    want_v = (cfg.num_v_heads, cfg.head_v_dim)
    if q.shape[2:] != want_q or v.shape[2:] != want_v:
        raise ValueError(f"layer config expects q [..., {want_q}] and v [..., {want_v}]; got q {q.shape}, "
                         f"v {v.shape}")


@dataclass(frozen=True, eq=False)
class GdnTreeLayer(TreeBackend):
    """A GDN layer running the kernels above: verifies trees, has no per-lane state for lanes."""

    name: str  # path component, e.g. "layers.0"
    mode: GdnStateMode = "replay_ssm"  # which commit the layer runs; both verify trees

    def tree_support(self) -> TreeSupport:
        return TreeSupport(
            Capability.ok(),
            Capability.refused("GDN layer in draft lanes (lanes keep no per-lane recurrent state)"),
        )


@dataclass(frozen=True, eq=False)
class FusedChainGdnLayer(TreeBackend):
    """A KDA-style fused verify kernel that walks node t after t - 1: it refuses trees."""

    name: str  # path component
    kernel_name: str = "kda_fused_chain"  # the chain-only kernel, named in the refusal

    def tree_support(self) -> TreeSupport:
        return TreeSupport.refuse_both(
            f"{self.kernel_name} follows a chain (node t starts from t - 1) and cannot verify trees")
