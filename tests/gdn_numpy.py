"""Independent fp64 numpy GDN recurrence along each node's root path, and random trees/paths.

Shared by tests/test_gdn_tree.py and tests/test_gdn_commit.py (not a test module itself).
"""

from __future__ import annotations

import numpy as np

B, H, HV, DK, DV = 2, 2, 4, 16, 16  # tiny dims; HV = 2 H exercises grouped heads


def random_tree(rng, batch: int, t: int) -> np.ndarray:
    """Parents `[B, T]`: parents[0] = -1, parents[i] < i; half the nodes extend i - 1 (deep paths)."""
    parents = np.full((batch, t), -1, np.int32)
    for b in range(batch):
        for i in range(1, t):
            parents[b, i] = i - 1 if rng.random() < 0.5 else rng.integers(0, i)
    return parents


def chain(batch: int, t: int) -> np.ndarray:
    return np.broadcast_to(np.arange(t, dtype=np.int32) - 1, (batch, t)).copy()


def random_path(rng, parents: np.ndarray):
    """A random accepted root path per request: `path [B, T]` (-1 padded), `accept_len [B]`."""
    batch, t = parents.shape
    path = np.full((batch, t), -1, np.int32)
    accept = np.zeros(batch, np.int32)
    for b in range(batch):
        cur, nodes = 0, [0]
        while True:
            kids = np.nonzero(parents[b] == cur)[0]
            if len(kids) == 0 or rng.random() < 0.2:
                break
            cur = int(rng.choice(kids))
            nodes.append(cur)
        path[b, : len(nodes)] = nodes
        accept[b] = len(nodes)
    return path, accept


def random_inputs(rng, batch: int, t: int, pool_rows: int = 3, dtype=np.float32):
    """Fresh random q, k, v, a, b, A_log, dt_bias, pool `[S, HV, dk, dv]` and a slot permutation."""
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    x = dict(q=f(batch, t, H, DK), k=f(batch, t, H, DK), v=f(batch, t, HV, DV), a=f(batch, t, HV),
             b=f(batch, t, HV))
    x = {n: a.astype(dtype) for n, a in x.items()}
    x.update(A_log=0.5 * f(HV), dt_bias=f(HV), state_pool=f(pool_rows, HV, DK, DV),
             state_slots=rng.permutation(pool_rows)[:batch].astype(np.int32))
    return x


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def per_path_numpy(x, parents, *, use_qk_l2norm: bool, scale: float | None = None):
    """For every node, replay its root path from the committed state in fp64.

    Returns `out [B, T, HV, dv]` and `states [B, T, HV, dk, dv]` (state after each node).
    """
    q, k, v, a, b = (np.asarray(x[n], np.float64) for n in "qkvab")
    a_log, dt_bias = np.asarray(x["A_log"], np.float64), np.asarray(x["dt_bias"], np.float64)
    if use_qk_l2norm:
        q, k = _l2(q), _l2(k)
    scale = DK ** -0.5 if scale is None else scale
    group = HV // H
    q, k = np.repeat(q, group, axis=2) * scale, np.repeat(k, group, axis=2)
    g = -np.exp(a_log) * np.log1p(np.exp(a + dt_bias))
    beta = 1.0 / (1.0 + np.exp(-b))
    batch, t = parents.shape
    out = np.zeros(v.shape)
    states = np.zeros((batch, t, HV, DK, DV))
    for bi in range(batch):
        h0 = np.asarray(x["state_pool"], np.float64)[x["state_slots"][bi]]
        for node in range(t):
            path, cur = [], node
            while cur >= 0:
                path.append(cur)
                cur = parents[bi, cur]
            h = h0.copy()
            for s in reversed(path):
                h = h * np.exp(g[bi, s])[:, None, None]
                delta = beta[bi, s][:, None] * (v[bi, s] - np.einsum("hkv,hk->hv", h, k[bi, s]))
                h = h + k[bi, s][:, :, None] * delta[:, None, :]
            states[bi, node] = h
            out[bi, node] = np.einsum("hkv,hk->hv", h, q[bi, node])
    return out, states


def branch_rows(parents: np.ndarray) -> np.ndarray:
    """`[B, T] bool`: node s has a child other than s + 1."""
    batch, t = parents.shape
    res = np.zeros((batch, t), bool)
    for bi in range(batch):
        for c in range(t):
            p = parents[bi, c]
            if p >= 0 and c != p + 1:
                res[bi, p] = True
    return res
