"""Tree rejection sampling: accept a root path of a draft tree, exact in distribution.

Starting at node 0 with p = the target's distribution there, the children of the current node are
tried one at a time in increasing node index. A child with token x drawn from q is accepted with
probability min(1, p(x) / q(x)); on acceptance the walk moves to that child and p, q restart from the
target / draft distributions at that child. On rejection the residual p <- normalise(max(p - q, 0))
and, when children were sampled without replacement, q <- q with x removed, renormalised. When
every child is rejected (or the node is a leaf) the bonus token is drawn from the residual p.

Two draft modes:
- point mass (`draft_probs=None`): children are the drafter's deterministic top-K, so q = one-hot(x).
  Acceptance is p(x); rejection zeroes x in p.
- sampled: the children of node i were drawn one after another without replacement from
  `draft_probs[b, i]`, and their node indices increase in draw order (the walk relies on that order).

Every accepted token is then distributed exactly as the target would sample it (the test checks
this with a chi-square over >= 200k draws). Uniforms come from `keys` (one typed PRNG key per
request, e.g. `walk_keys(seeds, vc)`) folded with the loop step, so a request's result does not
depend on its batch slot.

The walk is one `fori_loop` of N steps: each step either examines one child (the "next child"
pointer walks siblings through a precomputed next-sibling table) or finishes with the bonus draw.
Each node is examined at most once, so N steps always suffice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def child_tables(parents: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`parents [B, N]` -> (`first_child [B, N]`, `next_sibling [B, N]`) int32, -1 where none.

    first_child[i] = smallest j with parents[j] == i; next_sibling[j] = smallest j' > j with the
    same parent as j.
    """
    n = parents.shape[-1]
    idx = jnp.arange(n, dtype=jnp.int32)
    big = jnp.int32(n)
    # is_child[b, i, j]: j is a child of i.
    is_child = parents[:, None, :] == idx[None, :, None]
    first_child = jnp.min(jnp.where(is_child, idx[None, None, :], big), axis=-1)
    # same[b, j, j']: j' > j shares j's parent (the root's parent -1 is never shared).
    same = (parents[:, :, None] == parents[:, None, :]) & (idx[None, None, :] > idx[None, :, None])
    same = same & (parents[:, :, None] >= 0)
    next_sibling = jnp.min(jnp.where(same, idx[None, None, :], big), axis=-1)
    none = jnp.int32(-1)
    return jnp.where(first_child == big, none, first_child), jnp.where(next_sibling == big, none, next_sibling)


# Domain tag folded into a request's key so rejection uniforms never reuse a Gumbel-max key.
REJECTION_STREAM = 0x52454A  # "REJ"


def walk_keys(seeds: jax.Array, verified_len: jax.Array) -> jax.Array:
    """`seeds [B]`, `verified_len [B]` int32 -> `[B]` typed keys for one verify step.

    Keyed like the Gumbel sampler by (seed, position) so a request's rejection draws are
    reproducible and independent of its batch slot; the extra fold keeps the streams apart.
    """
    def one(seed, position):
        key = jax.random.fold_in(jax.random.key(seed), position)
        return jax.random.fold_in(key, REJECTION_STREAM)

    return jax.vmap(one)(jnp.asarray(seeds, jnp.int32), jnp.asarray(verified_len, jnp.int32))


def _normalise(x: jax.Array, fallback: jax.Array) -> jax.Array:
    """Rows of `x [B, V]` scaled to sum 1; a row with no mass left keeps `fallback` (only reachable
    by rounding: an exact zero residual means p == q, where rejection has probability 0)."""
    total = jnp.sum(x, axis=-1, keepdims=True)
    return jnp.where(total > 0, x / jnp.where(total > 0, total, 1.0), fallback)


def tree_rejection_sample(
    target_probs: jax.Array,
    node_tokens: jax.Array,
    parents: jax.Array,
    keys: jax.Array,
    draft_probs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Recursive rejection sampling over a batch of trees.

    target_probs `[B, N, V]` float: target distribution at each node (what it predicts next); each
      row should sum to 1 (it is renormalised once; a row with no mass is left as is).
    node_tokens `[B, N]` int32, parents `[B, N]` int32 (parents[:, 0] = -1, parents[j] < j).
    keys `[B]` typed PRNG keys (`jax.random.key`), one per request.
    draft_probs `[B, N, V]` or None: the draft distribution each node's children were sampled from
      (without replacement, in node-index order); None = children are point-mass top-K picks.
    Returns (path `[B, N]` int32 -1 padded, accept_len `[B]` int32 incl. bonus,
             predicts `[B, N]` int32 -1 padded): predicts[d] is the token accepted after path[d].
    """
    b, n, v = target_probs.shape
    if node_tokens.shape != (b, n) or parents.shape != (b, n):
        raise ValueError(f"node_tokens {node_tokens.shape} and parents {parents.shape} must be {(b, n)}")
    if keys.shape != (b,):
        raise ValueError(f"keys must be one typed PRNG key per request, shape {(b,)}; got {keys.shape}")
    if draft_probs is not None and draft_probs.shape != (b, n, v):
        raise ValueError(f"draft_probs has shape {draft_probs.shape}; expected {(b, n, v)}")
    sampled_q = draft_probs is not None
    # Rows are renormalised once so float error in a softmax cannot bias the acceptance test.
    target_probs = target_probs.astype(jnp.float32)
    target_probs = _normalise(target_probs, target_probs)
    draft = _normalise(draft_probs.astype(jnp.float32), draft_probs.astype(jnp.float32)) if sampled_q else None
    first_child, next_sibling = child_tables(parents)
    rows = jnp.arange(b)
    vocab_ids = jnp.arange(v, dtype=jnp.int32)

    def step(it, carry):
        cur, child, depth, done, p, q, path, predicts = carry
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, it)
        accept_key, bonus_key = jnp.moveaxis(jax.vmap(jax.random.split)(step_keys), 1, 0)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(accept_key)
        has_child = child >= 0
        safe_child = jnp.maximum(child, 0)
        x = node_tokens[rows, safe_child]
        px = p[rows, x]
        if sampled_q:
            qx = q[rows, x]
            # min(1, p/q) via u * q < p avoids dividing; q(x) = 0 cannot occur for a drawn child.
            accept = u * qx < px
        else:
            accept = u < px
        examining = ~done & has_child
        take = examining & accept
        reject = examining & ~accept
        finish = ~done & ~has_child

        # Rejected child: residual update.
        onehot_x = vocab_ids[None, :] == x[:, None]
        if sampled_q:
            residual = jnp.maximum(p - q, 0.0)
            q_rest = _normalise(jnp.where(onehot_x, 0.0, q), q)
        else:
            residual = jnp.where(onehot_x, 0.0, p)
            q_rest = q
        p_rej = _normalise(residual, p)

        # Accepted child: restart from the child's own distributions.
        p_new = target_probs[rows, safe_child]
        q_new = draft[rows, safe_child] if sampled_q else q

        # Finished: bonus from the residual p.
        bonus = jax.vmap(jax.random.categorical)(bonus_key, jnp.log(p)).astype(jnp.int32)

        predicts = predicts.at[rows, depth].set(
            jnp.where(take, x, jnp.where(finish, bonus, predicts[rows, depth])))
        next_depth = jnp.where(take, depth + 1, depth)
        path = path.at[rows, jnp.minimum(next_depth, n - 1)].set(
            jnp.where(take, child, path[rows, jnp.minimum(next_depth, n - 1)]))
        p = jnp.where(take[:, None], p_new, jnp.where(reject[:, None], p_rej, p))
        if sampled_q:
            q = jnp.where(take[:, None], q_new, jnp.where(reject[:, None], q_rest, q))
        cur = jnp.where(take, child, cur)
        child = jnp.where(take, first_child[rows, safe_child], jnp.where(reject, next_sibling[rows, safe_child], child))
        return cur, child, next_depth, done | finish, p, q, path, predicts

    init_q = draft[:, 0] if sampled_q else jnp.zeros((b, 1), jnp.float32)
    carry = (
        jnp.zeros((b,), jnp.int32),  # current node
        first_child[:, 0],  # next child of the current node to examine, -1 = none left
        jnp.zeros((b,), jnp.int32),  # depth of the current node
        jnp.zeros((b,), bool),  # bonus drawn
        target_probs[:, 0],  # residual target distribution at the current node
        init_q,  # residual draft distribution (sampled mode only)
        jnp.full((b, n), -1, jnp.int32).at[:, 0].set(0),
        jnp.full((b, n), -1, jnp.int32),
    )
    # Each step examines one node or draws the bonus: N - 1 examinations + 1 bonus at most.
    _, _, depth, _, _, _, path, predicts = jax.lax.fori_loop(0, n, step, carry)
    return path, depth + 1, predicts
