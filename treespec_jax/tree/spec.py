"""TreeSpec: positions follow depth during the verify forward, rows follow the path after it.

Row i of a request's verify window holds node i and writes KV slot `window_start + i`, but its RoPE
position must be vc + depth[i] (vc = the committed length, the root's position). So:

- `load_step(positions)` before the forward: vc + i -> vc + depth[i] for every row i;
- `compact_rows(path, hidden, positions)` after it: hidden row d <- row path[d] for every depth d
  of the accepted path (path[d] >= 0), so row d holds the path node at depth d, and positions go
  back vc + depth[i] -> vc + i.

The shifts are `+ (depth[i] - i)` and `- (depth[i] - i)`, so they cancel for any depths. A fresh
spec is the chain (depth[i] = i), on which both shifts are the identity: a warm-up forward that
skips `load_step` and a chain round (K = 1) see exactly the chain. Rows past the accepted length
keep whatever they held; consumers only read rows < accept_len.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from pallas_kernels.row_move import move_rows
from treespec_jax.tree import masks


@struct.dataclass
class TreeSpec:
    """The verify window's tree for one step, per request."""

    parents: jax.Array  # [B, N] int32; parents[:, 0] = -1, 0 <= parents[:, j] < j
    depths: jax.Array  # [B, N] int32 depth of each node (root 0); chain: depths[i] = i

    @classmethod
    def chain(cls, batch: int, num_nodes: int) -> "TreeSpec":
        """The fresh spec: the chain parents[i] = i - 1, depths[i] = i."""
        if batch < 1 or not 1 <= num_nodes <= masks.MAX_TREE_NODES:
            raise ValueError(f"TreeSpec.chain needs batch >= 1 and 1 <= N <= {masks.MAX_TREE_NODES}, "
                             f"got batch={batch}, N={num_nodes}")
        parents = masks.chain_parents(batch, num_nodes)
        return cls(parents=parents, depths=jnp.broadcast_to(jnp.arange(num_nodes, dtype=jnp.int32), (batch, num_nodes)))

    @classmethod
    def from_parents(cls, parents: jax.Array) -> "TreeSpec":
        """Spec of the tree `parents [B, N]` (depths computed by `masks.depths`)."""
        parents = jnp.asarray(parents, jnp.int32)
        if parents.ndim != 2:
            raise ValueError(f"parents must be [B, N], got shape {parents.shape}")
        return cls(parents=parents, depths=masks.depths(parents))

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[1]

    def ancestor_mask(self) -> jax.Array:
        """`[B, N, 2]` uint32 packed ancestor-or-self rows (what tree attention reads)."""
        return masks.ancestor_mask(self.parents)

    def _shift(self) -> jax.Array:
        return self.depths - jnp.arange(self.num_nodes, dtype=jnp.int32)[None, :]

    def _check_window(self, name: str, x: jax.Array) -> None:
        if x.shape[:2] != self.parents.shape:
            raise ValueError(f"{name} has shape {x.shape}; its leading dims must be the window {self.parents.shape}")

    def load_step(self, positions: jax.Array) -> jax.Array:
        """`positions [B, N]` (window rows at vc + i) -> `[B, N]` vc + depth[i]."""
        self._check_window("positions", positions)
        return positions + self._shift().astype(positions.dtype)

    def compact_rows(self, path: jax.Array, hidden: jax.Array, positions: jax.Array, *,
                     backend: str | None = None) -> tuple[jax.Array, jax.Array]:
        """Moves the accepted path to the window front and undoes `load_step`.

        path `[B, N]` int32 (AcceptedPath.path, -1 padded), hidden `[B, N, ...]` (any dtype),
        positions `[B, N]` (vc + depth[i] after load_step) -> (hidden `[B, N, ...]` with row d =
        old row path[d] where path[d] >= 0, positions `[B, N]` = vc + i). `backend` is passed to
        `pallas_kernels.row_move.move_rows`.
        """
        self._check_window("path", path)
        self._check_window("hidden", hidden)
        self._check_window("positions", positions)
        b, n = self.parents.shape
        # One flat buffer of B*N rows: request b's row d is flat row b*N + d. Each request is one
        # group of pairs (disjoint rows), applied in increasing d: src = path[d] >= d never reads a
        # row an earlier pair of its group wrote.
        base = (jnp.arange(b, dtype=jnp.int32) * n)[:, None]
        src = jnp.where(path >= 0, base + path.astype(jnp.int32), -1)
        dst = base + jnp.arange(n, dtype=jnp.int32)[None, :]
        flat = hidden.reshape((b * n,) + hidden.shape[2:])
        moved = move_rows(flat, src, dst, backend=backend).reshape(hidden.shape)
        return moved, positions - self._shift().astype(positions.dtype)
