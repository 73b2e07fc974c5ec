"""Draft-tree lanes, the candidate record, and tree selection (EAGLE-2 style, deterministic).

Entries. A round of S draft steps with top-K lanes scores E = K + (S-1) K^2 candidates per request:
- step 0 (`seed_lanes`): entries 0..K-1 are the drafter's top-K after the root, parent -1 ("under
  the root"), depth 1;
- step s >= 1 (`expand_lanes`): lane l (0 <= l < K) proposes K children; child j of lane l is entry
  K + (s-1) K^2 + l K + j, depth s + 1, parent = the lane's entry.
An entry id is always larger than its parent's.

Scores. Seed score = min(logprob, 0); child score = lane score + min(child logprob, 0), so a child
never outscores its parent. NaN scores (padded requests, bad drafter output) become -inf, and a
child of a -inf lane is -inf. Every score also gets `+ 0.0`, which turns -0.0 into +0.0 so that
the two zeros rank as the tie they are.

Ranking. Everywhere (next lanes, kept set, sibling order) entries rank by (score desc, entry id asc).
Because parents score >= children and have lower ids, a parent always outranks its children, so
the best N-1 entries are closed under parents: they form a tree under the root.

Lanes. After step s the K best of that step's candidates (in rank order) are the next lanes: lane r
chosen at step s is fed to draft forward s + 1 and writes lane-window slot s K + r (draft-cache slot
frontier + s K + r). The lane window holds (S-1) K slots: lanes chosen at the last step S-1 are
never fed and own no slot.
Lane ancestor mask: `Lanes.masks [B, K, 2] uint32` (the `tree.masks` packing: word 0 = bits 0..31,
word 1 = bits 32..63) has bit w set iff lane-window slot w holds the lane itself or one of its lane
ancestors. A seed lane r has mask 1 << r; lane r chosen at step s has (parent lane's mask) |
1 << (s K + r). Lanes chosen at a final step s = S-1 >= 1 get their parent lane's mask (no bit of
their own); seed lanes always get 1 << r, even when S = 1 never feeds them.
Lane attention lets row r see window slot w iff bit w of masks[r] is set.

Node numbering (`select_tree`). Node 0 is the request's root token. The kept entries are numbered
depth first with each node's best child first, so the most likely path is 0, 1, 2, ...; this is
done without recursion by sorting on a key built from the rank (0..62, stored + 1 in 6 bits) of each
ancestor along the entry's root path, one 6-bit field per level, five levels per int32 word.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from treespec_jax.tree import masks

MAX_TOPK = 16
MAX_STEPS = 10
LEVEL_BITS = 6  # one sibling-path field per tree level; ranks + 1 <= 63 fit
LEVELS_PER_WORD = 5  # 5 * 6 = 30 bits keeps every int32 key word non-negative


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """Static size of a draft tree round; validated on construction."""

    topk: int  # K: lanes per step and children per lane, 1..16 (1 = chain)
    num_steps: int  # S: draft steps per round (step 0 seeds the lanes), 1..10
    num_nodes: int  # N: verify nodes incl. the root, 2..min(64, E + 1)

    def __post_init__(self):
        k, s, n = self.topk, self.num_steps, self.num_nodes
        for name, value in (("topk", k), ("num_steps", s), ("num_nodes", n)):
            if not _is_static_int(value):
                raise TypeError(f"TreeShape.{name} must be a static integer, got {value!r}")
        if not 1 <= k <= MAX_TOPK:
            raise ValueError(f"topk K={k} must lie in 1..{MAX_TOPK}")
        if not 1 <= s <= MAX_STEPS:
            raise ValueError(f"num_steps S={s} must lie in 1..{MAX_STEPS} (6 key bits per level, S*6 <= 62)")
        hi = min(masks.MAX_TREE_NODES, self.num_entries + 1)
        if not 2 <= n <= hi:
            raise ValueError(
                f"num_nodes N={n} must lie in 2..{hi} = min({masks.MAX_TREE_NODES}, K + (S-1)K^2 + 1) for K={k}, S={s}")

    @property
    def num_entries(self) -> int:
        """E = K + (S-1) K^2 scored candidates per request."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @property
    def lane_window(self) -> int:
        """(S-1) K lane-window slots."""
        return (self.num_steps - 1) * self.topk


def _is_static_int(value) -> bool:
    """Python / numpy integers (not bools, not traced arrays)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def step_offset(topk: int, step: int) -> int:
    """First entry id of draft step `step` (0 for the seeds)."""
    return 0 if step == 0 else topk + (step - 1) * topk * topk


def _clean_scores(x: jax.Array) -> jax.Array:
    """NaN -> -inf and -0.0 -> +0.0 (see module docstring), float32."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.isnan(x), -jnp.inf, x) + 0.0


def rank_order(scores: jax.Array) -> jax.Array:
    """`[B, M]` -> `[B, M]` int32 indices in rank order: score desc, index asc; NaN ranks as -inf."""
    # A stable sort of the negated (cleaned) scores keeps equal scores in index order.
    return jnp.argsort(-_clean_scores(scores), axis=-1, stable=True).astype(jnp.int32)


@struct.dataclass
class Lanes:
    """The K lanes a draft step feeds forward."""

    scores: jax.Array  # [B, K] float32 cumulative scores (-inf for NaN / padded)
    entries: jax.Array  # [B, K] int32 candidate-record entry id of each lane
    tokens: jax.Array  # [B, K] int32 token each lane feeds to the next draft forward
    masks: jax.Array  # [B, K, 2] uint32 packed lane-window ancestor masks (module docstring)


@struct.dataclass
class StepCandidates:
    """One step's scored candidates, to be written into the CandidateRecord at `step_offset`."""

    tokens: jax.Array  # [B, C] int32 (C = K for step 0, K^2 after)
    scores: jax.Array  # [B, C] float32 cumulative scores, NaN already -inf
    parents: jax.Array  # [B, C] int32 parent entry id, -1 = under the root


@struct.dataclass
class CandidateRecord:
    """Every scored candidate of a round, `[B, E]` with E = K + (S-1) K^2 (entry-id order).

    Entries of steps not written yet hold NaN scores and hang under the root, so a record is a
    valid (if useless) input to `select_tree` at any point.
    """

    tokens: jax.Array  # [B, E] int32 candidate token
    scores: jax.Array  # [B, E] float32 cumulative score (NaN = unwritten; ranks as -inf)
    parents: jax.Array  # [B, E] int32 parent entry id, -1 = under the root
    depths: jax.Array  # [B, E] int32 tree depth of the entry (step + 1; unwritten entries 1)
    topk: int = struct.field(pytree_node=False)  # K
    num_steps: int = struct.field(pytree_node=False)  # S

    @classmethod
    def empty(cls, batch: int, topk: int, num_steps: int) -> "CandidateRecord":
        shape = TreeShape(topk, num_steps, 2)  # validates K and S
        e = shape.num_entries
        # Unwritten entries hang under the root (depth 1) so the record is always a valid forest.
        return cls(
            tokens=jnp.zeros((batch, e), jnp.int32),
            scores=jnp.full((batch, e), jnp.nan, jnp.float32),
            parents=jnp.full((batch, e), -1, jnp.int32),
            depths=jnp.ones((batch, e), jnp.int32),
            topk=topk,
            num_steps=num_steps,
        )

    def write(self, step: int, cands: StepCandidates) -> "CandidateRecord":
        """Returns the record with step `step`'s candidates written (step is a static integer)."""
        k, s = self.topk, self.num_steps
        if not _is_static_int(step) or not 0 <= step < s:
            raise ValueError(f"step must be a static integer in 0..{s - 1}, got {step!r}")
        step = int(step)
        width = k if step == 0 else k * k
        if cands.tokens.shape != (self.tokens.shape[0], width):
            raise ValueError(f"step {step} writes [B, {width}] candidates, got {cands.tokens.shape}")
        lo = step_offset(k, step)
        return self.replace(
            tokens=self.tokens.at[:, lo:lo + width].set(cands.tokens.astype(jnp.int32)),
            scores=self.scores.at[:, lo:lo + width].set(cands.scores),
            parents=self.parents.at[:, lo:lo + width].set(cands.parents),
            depths=self.depths.at[:, lo:lo + width].set(step + 1),
        )


def _lane_bits(slot: jax.Array) -> jax.Array:
    """`slot [...]` int32 in 0..63 -> `[..., 2]` uint32 with only bit `slot` set."""
    one = jnp.uint32(1)
    low = jnp.where(slot < 32, jnp.left_shift(one, jnp.clip(slot, 0, 31).astype(jnp.uint32)), jnp.uint32(0))
    high = jnp.where(slot >= 32, jnp.left_shift(one, jnp.clip(slot - 32, 0, 31).astype(jnp.uint32)), jnp.uint32(0))
    return jnp.stack([low, high], axis=-1)


def seed_lanes(logprobs_topk: jax.Array, tokens_topk: jax.Array) -> tuple[Lanes, StepCandidates]:
    """Step 0. `logprobs_topk [B, K]` float, `tokens_topk [B, K]` int32 -> (lanes, candidates).

    Entries 0..K-1 under the root; the lanes are those K entries in rank order, lane r has mask
    1 << r.
    """
    if logprobs_topk.ndim != 2 or tokens_topk.shape != logprobs_topk.shape:
        raise ValueError(f"logprobs_topk {logprobs_topk.shape} and tokens_topk {tokens_topk.shape} must both be [B, K]")
    b, k = logprobs_topk.shape
    TreeShape(k, 1, 2)  # validates K
    scores = _clean_scores(jnp.minimum(_clean_scores(logprobs_topk), 0.0))
    tokens = tokens_topk.astype(jnp.int32)
    cands = StepCandidates(tokens=tokens, scores=scores, parents=jnp.full((b, k), -1, jnp.int32))
    order = rank_order(scores)
    lane_masks = jnp.broadcast_to(_lane_bits(jnp.arange(k, dtype=jnp.int32)), (b, k, 2))
    lanes = Lanes(
        scores=jnp.take_along_axis(scores, order, axis=1),
        entries=order,
        tokens=jnp.take_along_axis(tokens, order, axis=1),
        masks=lane_masks,
    )
    return lanes, cands


def expand_lanes(lanes: Lanes, child_logprobs: jax.Array, child_tokens: jax.Array, step: int, *,
                 num_steps: int) -> tuple[Lanes, StepCandidates]:
    """Draft step `step` (1..num_steps-1, a static integer): each lane proposes K children.

    `lanes` are the lanes fed at this step (from `seed_lanes` or the previous `expand_lanes`),
    `child_logprobs [B, K, K]` float (lane l, child j), `child_tokens [B, K, K]` int32.
    Returns (next lanes = the best K of the K^2 children in rank order, this step's candidates
    `[B, K^2]` in entry order l K + j).
    """
    b, k = lanes.scores.shape
    if child_logprobs.shape != (b, k, k) or child_tokens.shape != (b, k, k):
        raise ValueError(
            f"child_logprobs {child_logprobs.shape} and child_tokens {child_tokens.shape} must be {(b, k, k)}")
    shape = TreeShape(k, num_steps, 2)
    if not _is_static_int(step) or not 1 <= step < num_steps:
        raise ValueError(f"expand step must be a static integer in 1..{num_steps - 1}, got {step!r}")
    step = int(step)
    if shape.lane_window > masks.MAX_TREE_NODES:
        raise ValueError(f"lane window (S-1)K = {shape.lane_window} exceeds the {masks.MAX_TREE_NODES}-bit mask")
    child = jnp.minimum(_clean_scores(child_logprobs), 0.0)
    scores = _clean_scores(lanes.scores[:, :, None] + child).reshape(b, k * k)
    tokens = child_tokens.astype(jnp.int32).reshape(b, k * k)
    parents = jnp.broadcast_to(lanes.entries[:, :, None], (b, k, k)).reshape(b, k * k)
    cands = StepCandidates(tokens=tokens, scores=scores, parents=parents)

    order = rank_order(scores)[:, :k]  # child index l K + j of the next lanes, in rank order
    parent_lane = order // k
    lane_masks = jnp.take_along_axis(lanes.masks, parent_lane[:, :, None], axis=1)
    if step < num_steps - 1:
        own_slot = step * k + jnp.arange(k, dtype=jnp.int32)
        lane_masks = lane_masks | _lane_bits(own_slot)[None]
    next_lanes = Lanes(
        scores=jnp.take_along_axis(scores, order, axis=1),
        entries=order + step_offset(k, step),
        tokens=jnp.take_along_axis(tokens, order, axis=1),
        masks=lane_masks,
    )
    return next_lanes, cands


@struct.dataclass
class DraftTree:
    """The selected verify tree per request (node 0 = root)."""

    tokens: jax.Array  # [B, N] int32 node tokens; tokens[:, 0] = the request's root token
    parents: jax.Array  # [B, N] int32; parents[:, 0] = -1, 0 <= parents[:, j] < j
    depths: jax.Array  # [B, N] int32; root 0
    entries: jax.Array  # [B, N] int32 candidate-record entry of each node; -1 for the root
    scores: jax.Array  # [B, N] float32 cumulative score of each node; 0 for the root


def select_tree(record: CandidateRecord, root_tokens: jax.Array, num_nodes: int) -> DraftTree:
    """Keeps the best N-1 entries of `record` and numbers them depth first, best child first.

    root_tokens `[B]` int: each request's root token (its last committed token). When roots live in
    a wider per-request buffer, pass a strided slice of it, e.g. `flat[::stride]` for a flat
    `[B * stride]` array or `x[:, 0]` for `[B, stride]`; any `[B]` array works, jitted or not.
    Returns a DraftTree with tokens / parents / depths / entries / scores `[B, N]`.

    Precondition (true for records built by `seed_lanes` / `expand_lanes`): no entry outscores its
    parent, so the kept set is closed under parents. A hand-built record that breaks this can
    produce parents of -1 below the root; nothing here can check it without a host round trip.
    """
    shape = TreeShape(record.topk, record.num_steps, num_nodes)
    b, e = record.scores.shape
    if e != shape.num_entries:
        raise ValueError(f"record holds {e} entries; K={record.topk}, S={record.num_steps} need {shape.num_entries}")
    root_tokens = jnp.asarray(root_tokens)
    if root_tokens.shape != (b,):
        raise ValueError(f"root_tokens must be [B] = {(b,)}, got {root_tokens.shape}")
    n = num_nodes
    kept_n = n - 1
    rows = jnp.arange(b)[:, None]

    scores = _clean_scores(record.scores)
    order = rank_order(scores)
    kept = order[:, :kept_n]  # [B, N-1] entry ids in rank order
    # rank_of[entry] = its position in the kept prefix (0..N-2), -1 for dropped entries.
    rank_of = jnp.full((b, e), -1, jnp.int32).at[rows, kept].set(jnp.arange(kept_n, dtype=jnp.int32)[None])

    # Walk each kept entry up to the root, dropping (rank + 1) into the 6-bit field of every level.
    num_words = -(-shape.num_steps // LEVELS_PER_WORD)
    words = [jnp.zeros((b, kept_n), jnp.int32) for _ in range(num_words)]
    cur = kept
    for _ in range(shape.num_steps):
        live = cur >= 0
        safe = jnp.maximum(cur, 0)
        level = jnp.take_along_axis(record.depths, safe, axis=1) - 1  # 0-based level of `cur`
        field = jnp.where(live, jnp.take_along_axis(rank_of, safe, axis=1) + 1, 0)
        for w in range(num_words):
            in_word = live & (level // LEVELS_PER_WORD == w)
            shift = (LEVELS_PER_WORD - 1 - level % LEVELS_PER_WORD) * LEVEL_BITS
            words[w] = words[w] | jnp.where(in_word, jnp.left_shift(field, jnp.maximum(shift, 0)), 0)
        cur = jnp.where(live, jnp.take_along_axis(record.parents, safe, axis=1), -1)

    # Lexicographic sort over the key words (most significant level first) = pre-order DFS.
    sorted_ops = jax.lax.sort(tuple(words) + (kept,), dimension=1, num_keys=num_words)
    dfs_entries = sorted_ops[-1]  # [B, N-1]
    node_of = jnp.full((b, e), -1, jnp.int32).at[rows, dfs_entries].set(
        jnp.arange(1, n, dtype=jnp.int32)[None])
    parent_entry = jnp.take_along_axis(record.parents, dfs_entries, axis=1)
    parent_node = jnp.where(parent_entry < 0, 0,
                            jnp.take_along_axis(node_of, jnp.maximum(parent_entry, 0), axis=1))

    def root_col(x, fill):
        return jnp.concatenate([jnp.full((b, 1), fill, x.dtype), x], axis=1)

    return DraftTree(
        tokens=jnp.concatenate([root_tokens.astype(jnp.int32)[:, None],
                                jnp.take_along_axis(record.tokens, dfs_entries, axis=1)], axis=1),
        parents=root_col(parent_node, -1),
        depths=root_col(jnp.take_along_axis(record.depths, dfs_entries, axis=1), 0),
        entries=root_col(dfs_entries, -1),
        scores=root_col(jnp.take_along_axis(scores, dfs_entries, axis=1), 0.0),
    )


def build_record(steps: list[StepCandidates], topk: int, num_steps: int) -> CandidateRecord:
    """Writes a full round's per-step candidates (step 0 first) into a fresh record."""
    if len(steps) != num_steps:
        raise ValueError(f"expected {num_steps} steps of candidates, got {len(steps)}")
    record = CandidateRecord.empty(steps[0].tokens.shape[0], topk, num_steps)
    for step, cands in enumerate(steps):
        record = record.write(step, cands)
    return record
