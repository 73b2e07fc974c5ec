"""One decode round as one jitted step over an explicit `DecodeState`, one function per stage.

    verify      the target runs the tree drafted last round: node i at slot vc + i, RoPE at
                vc + depth[i], seeing the committed prefix and its ancestors (`verify_stage`)
    walk        the acceptance backend picks the root path (`AcceptedPath`, `walk_stage`)
    compact     every target layer's KV rows, the feature rows and the positions move along the
                path, so row d holds the path node at depth d (`compact_stage`)
    commit      vc += accept_len; the bonus token is the next root (`commit_stage`)
    draft       the drafter's step 0 over the accepted rows, K lanes per step for steps 1..S-1,
                `select_tree`; the tree is stored beside its root for the next round (`draft_stage`)

Everything after `walk` sees a chain. K = 1 is the chain (the same stages, chain-shaped trees);
plain decoding is the same step on one-node trees with no drafter. Empty batch slots run along
on the scratch page and never advance. Shapes are static (B slots, N, K, S, page counts), so
requests joining and leaving never recompile; the host reads one `StepOutput` per step.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from treespec_jax.cache.routing import CompactionRouter
from treespec_jax.drafter.base import AcceptedRows, Drafter, draft_tree
from treespec_jax.engine import sampler
from treespec_jax.models.llama import LlamaModel
from treespec_jax.sampling.keyed import SamplingParams
from treespec_jax.tree.spec import TreeSpec
from treespec_jax.tree.verify import AcceptedPath


@struct.dataclass
class DecodeState:
    """Everything that crosses steps; pools are donated into each step."""

    target_pools: dict  # {"k{i}", "v{i}": [slots, Hkv, D]} the target's paged KV
    draft_pools: dict  # the drafter's paged cache (same page table), {} without a drafter
    page_table: jax.Array  # [B, max_pages] int32; rows of empty slots are all scratch (0)
    lengths: jax.Array  # [B] int32 vc: committed tokens in the target cache; the root sits at vc
    tree_tokens: jax.Array  # [B, N] int32 next round's tree, node 0 = the root (last sampled token)
    tree_parents: jax.Array  # [B, N] int32 its parents (chain for a freshly admitted request)
    active: jax.Array  # [B] bool slot holds a decoding request
    seeds: jax.Array  # [B] int32 per-request seed of keyed sampling
    sampling: SamplingParams  # [B] per-request temperature / top-k / top-p


@struct.dataclass
class StepOutput:
    """What the host reads once per step."""

    tokens: jax.Array  # [B, N] int32 committed tokens (AcceptedPath.predicts), valid < accept_len
    accept_len: jax.Array  # [B] int32 tokens committed this step (0 for empty slots)
    sibling_rank: jax.Array  # [B, N] int32 which child of its parent path node d+1 was (0 = best)


@dataclasses.dataclass(frozen=True)
class RoundShape:
    """Static shape of a round."""

    num_nodes: int  # N verify nodes incl. the root (1 = plain decoding)
    topk: int  # K lanes per draft step
    num_steps: int  # S draft steps per round
    sampler: str  # acceptance backend, one of sampler.BACKENDS


def sibling_ranks(parents: jax.Array) -> jax.Array:
    """`[B, N]`: rank of each node among its parent's children in index order (DFS numbers the
    best child first, so rank 0 is the drafter's favourite); the root gets 0."""
    n = parents.shape[1]
    same = parents[:, :, None] == parents[:, None, :]  # [B, j, i]
    earlier = jnp.arange(n)[None, :] < jnp.arange(n)[:, None]  # i < j
    return jnp.sum(same & earlier[None], axis=-1, dtype=jnp.int32)


class Round:
    """The jitted round of one (target, drafter, shape); `step(params, state)`."""

    def __init__(self, target: LlamaModel, drafter: Drafter | None, shape: RoundShape, router: CompactionRouter,
                 move_backend: str | None = None):
        if (drafter is None) != (shape.num_nodes == 1):
            raise ValueError(f"a round with N={shape.num_nodes} nodes needs a drafter iff N > 1")
        self.target = target
        self.drafter = drafter
        self.shape = shape
        self.router = router
        self.move_backend = move_backend

    # ---- stages, in the order a round runs them ------------------------------------------

    def verify_stage(self, params, state: DecodeState):
        """-> (spec, logits [B, N, V], features [B, N, F] or None, positions [B, N], target pools)."""
        n = self.shape.num_nodes
        spec = TreeSpec.from_parents(state.tree_parents)
        rows = state.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)[None, :]
        positions = spec.load_step(rows)
        logits, features, pools = self.target.verify(params["target"], state.target_pools, state.tree_tokens,
                                                     positions, spec.ancestor_mask(), state.page_table,
                                                     state.lengths)
        return spec, logits, features, positions, pools

    def walk_stage(self, spec: TreeSpec, logits, state: DecodeState, draw: str = "auto") -> AcceptedPath:
        return sampler.accept(self.shape.sampler, logits, state.tree_tokens, spec.parents, spec.depths, state.seeds,
                              state.lengths, state.sampling, draw)

    def compact_stage(self, spec: TreeSpec, path: AcceptedPath, pools, features, positions, state: DecodeState):
        """KV rows of every target layer (one move per buffer of the cache group), then the
        feature rows and positions, along the path."""
        if self.shape.num_nodes == 1:
            return pools, features
        pools = self.router.compact(pools, {"target": state.page_table}, state.lengths, path.path,
                                    backend=self.move_backend)
        if features is not None:
            features, _ = spec.compact_rows(path.path, features, positions, backend=self.move_backend)
        return pools, features

    def commit_stage(self, path: AcceptedPath, state: DecodeState):
        """-> (accept_len [B] (0 for empty slots), new lengths [B], new roots [B])."""
        accept_len = jnp.where(state.active, path.accept_len, 0)
        bonus = jnp.take_along_axis(path.predicts, (path.accept_len - 1)[:, None], axis=1)[:, 0]
        return accept_len, state.lengths + accept_len, bonus

    def draft_stage(self, params, state: DecodeState, path: AcceptedPath, features, roots):
        """-> (draft pools, next tree tokens [B, N], next parents [B, N])."""
        b, n = state.tree_tokens.shape
        if self.drafter is None:
            return state.draft_pools, roots[:, None], jnp.full((b, 1), -1, jnp.int32)
        path_nodes = jnp.maximum(path.path, 0)
        accepted = AcceptedRows(
            path_tokens=jnp.where(path.path >= 0, jnp.take_along_axis(state.tree_tokens, path_nodes, axis=1), 0),
            predicts=path.predicts, features=features if features is not None else jnp.zeros((b, n, 1)),
            start=state.lengths, accept_len=path.accept_len, page_table=state.page_table)
        dparams = params["draft"]
        pools, root_logits, root_feature, frontier = self.drafter.step0(dparams, dict(state.draft_pools), accepted)
        s = self.shape
        pools, tree = draft_tree(self.drafter, dparams, pools, root_logits, root_feature, frontier, roots,
                                 state.page_table, topk=s.topk, num_steps=s.num_steps, num_nodes=s.num_nodes)
        return pools, tree.tokens, tree.parents

    # ---- the round ----------------------------------------------------------------------

    def step(self, params, state: DecodeState, draw: str = "auto") -> tuple[DecodeState, StepOutput]:
        """One round. `draw` (static, `sampling.keyed.DRAWS`): what the active slots' sampling
        needs, known to the host that admitted them; "auto" decides on the device.

        The state may hold wider trees than this round's N (an engine whose rounds switch to a
        chain under load, `speculative.chain_above_batch`): the round verifies the stored tree's
        first N nodes, a subtree since parents come before their children, and stores its own
        drafts padded with dummies (`extend_tree`). Either way nothing but agreed tokens is kept."""
        n, stored = self.shape.num_nodes, state.tree_tokens.shape[1]
        if stored < n:
            raise ValueError(f"a round of N={n} nodes needs stored trees of at least N nodes, got {stored}")
        if stored == n:
            return self._step(params, state, draw)
        state = state.replace(tree_tokens=state.tree_tokens[:, :n], tree_parents=state.tree_parents[:, :n])
        state, out = self._step(params, state, draw)
        tokens, parents = extend_tree(state.tree_tokens, state.tree_parents, stored)
        return state.replace(tree_tokens=tokens, tree_parents=parents), out

    def _step(self, params, state: DecodeState, draw: str) -> tuple[DecodeState, StepOutput]:
        spec, logits, features, positions, target_pools = self.verify_stage(params, state)
        path = self.walk_stage(spec, logits, state, draw)
        target_pools, features = self.compact_stage(spec, path, target_pools, features, positions, state)
        accept_len, lengths, roots = self.commit_stage(path, state)
        draft_pools, tokens, parents = self.draft_stage(params, state, path, features, roots)
        ranks = jnp.take_along_axis(sibling_ranks(spec.parents), jnp.maximum(path.path, 0), axis=1)
        out = StepOutput(tokens=path.predicts, accept_len=accept_len, sibling_rank=ranks)
        # Empty slots keep their (scratch) tree so they never drift; active ones take the new one.
        keep = state.active[:, None]
        state = state.replace(
            target_pools=target_pools, draft_pools=draft_pools, lengths=lengths,
            tree_tokens=jnp.where(keep, tokens, state.tree_tokens),
            tree_parents=jnp.where(keep, parents, state.tree_parents))
        return state, out


def extend_tree(tokens: jax.Array, parents: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """`[B, n]` tree -> `[B, num_nodes]`: a chain of dummy tokens (0) below its last node. A dummy
    the target happens to agree with is accepted like any draft, so output stays exact."""
    b, n = tokens.shape
    pad = num_nodes - n
    below_last = jnp.arange(n - 1, num_nodes - 1, dtype=parents.dtype)
    return (jnp.concatenate([tokens, jnp.zeros((b, pad), tokens.dtype)], axis=1),
            jnp.concatenate([parents, jnp.broadcast_to(below_last, (b, pad))], axis=1))


def bootstrap_tree(root: jax.Array, num_nodes: int) -> tuple[jax.Array, jax.Array]:
    """A freshly admitted request's first tree: its root `[B]` and a chain of dummies below it
    (`extend_tree`)."""
    b = root.shape[0]
    return extend_tree(root.astype(jnp.int32)[:, None], jnp.full((b, 1), -1, jnp.int32), num_nodes)
