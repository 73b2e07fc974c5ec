"""Conv verify and commit glue for linear-attention layers (the causal depthwise conv before the SSM).

Verify runs `pallas_kernels.linear.conv_tree.conv_tree_update` over the step's tree (with the
step's shared lag-source table when the caller has one); the committed conv pool `[S, W-1, D]` is
only read. The commit then writes each request's new committed window,
which is the window of the last accepted node, path[accept_len - 1]. Two equivalent sources:

- staged: the verify wrote every node's state row into `node_states [B, T, W-1, D]`; copy row
  path[accept_len - 1] (our rows hold the state *after* node t, so there is no leading committed
  row and no "1 +" offset).
- from packed inputs (ReplaySSM): the accepted path's raw conv inputs were packed to the window
  front (row d = node at depth d); the new window is the last W-1 columns of
  [committed window | packed rows 0 .. accept_len - 1].

Padded requests (slot < 0) are skipped by both commits.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.linear.conv_tree import conv_tree_update

__all__ = ["conv_verify", "conv_commit_staged", "conv_commit_from_inputs"]


def conv_verify(x, conv_pool, state_slots, weight, bias=None, parents=None, *, silu=True, node_states=None,
                lags=None, backend=None):
    """Tree conv over a verify window. `x [B, T, D]` -> `(y [B, T, D], node_states or None)`.

    Pass `node_states [B, T, W-1, D]` (a donated verify scratch) for the staged commit; leave it
    None under ReplaySSM, whose commit rebuilds the window from the packed inputs. `lags` is the
    step's `conv_lag_sources(parents, W)` table (computed by the kernel wrapper when None).
    """
    return conv_tree_update(x, conv_pool, state_slots, weight, bias, parents, silu=silu,
                            node_states=node_states, lags=lags, backend=backend)


def _scatter_rows(pool, state_slots, rows):
    live = state_slots >= 0
    dst = jnp.where(live, state_slots, pool.shape[0])  # padded requests scatter out of range: dropped
    return pool.at[dst].set(rows.astype(pool.dtype), mode="drop")


def _check_accept(accept_len, nb):
    if accept_len.shape != (nb,):
        raise ValueError(f"accept_len must be [B] = ({nb},), got {accept_len.shape}")


def conv_commit_staged(conv_pool, state_slots, node_states, path, accept_len):
    """Copies node row path[b, accept_len[b] - 1] into the committed pool slot of request b.

    `conv_pool [S, W-1, D]`, `node_states [B, T, W-1, D]`, `path [B, T] int32` (path[b, d] = node
    at depth d), `accept_len [B] int32` in 1..T. Returns the new pool.
    """
    nb, T = node_states.shape[:2]
    if path.shape != (nb, T):
        raise ValueError(f"path must be [B, T] = {(nb, T)}, got {path.shape}")
    _check_accept(accept_len, nb)
    last = jnp.take_along_axis(path, jnp.clip(accept_len - 1, 0, T - 1)[:, None], axis=1)[:, 0]
    rows = node_states[jnp.arange(nb), jnp.clip(last, 0, T - 1)]
    return _scatter_rows(conv_pool, state_slots, rows)


def conv_commit_from_inputs(conv_pool, state_slots, packed_x, accept_len):
    """New window = last W-1 columns of [committed window | packed_x rows 0 .. accept_len - 1].

    `conv_pool [S, W-1, D]`, `packed_x [B, T, D]` (row d = accepted node at depth d),
    `accept_len [B] int32` in 1..T (larger values are cut to T). Returns the new pool.
    """
    nb, T, D = packed_x.shape
    Wm1 = conv_pool.shape[1]
    if conv_pool.shape[2] != D:
        raise ValueError(f"conv_pool channels {conv_pool.shape[2]} != packed_x channels {D}")
    _check_accept(accept_len, nb)
    window = jnp.concatenate([conv_pool[jnp.maximum(state_slots, 0)], packed_x.astype(conv_pool.dtype)], axis=1)
    n = jnp.clip(accept_len, 0, T)
    # Column c of the new window is column n + c of [committed | packed] (length W-1 + T).
    cols = n[:, None] + jnp.arange(Wm1)[None, :]
    rows = jnp.take_along_axis(window, cols[:, :, None], axis=1)
    return _scatter_rows(conv_pool, state_slots, rows)
