"""Mamba2 tree verify scan, ReplaySSM commit and tree conv on the GPU: compiled conformance, then timing.

Run: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mamba2.py [--quick] [--budget-s S]

Conformance (compiled Pallas Triton vs the fp32 jnp references; fresh random inputs; scratch,
payload and node-row buffers poisoned with NaN; a padded request in every batch): the tree scan in
staged, ReplaySSM and outputs-only modes, the chain kernel, z gating, bf16 inputs, the replay
commit (vs the staged state at the last accepted node), the tree conv, at small and Nemotron-H dims.

Timing (Nemotron-H-like: H=128, headdim 64, dstate 128, ngroups 8, bf16 activations, fp32 state;
conv dim 2*8*128 + 128*64 = 10240, width 4; B in {1, 32, 64}; random depth-first trees of 8, 16, 64
nodes): each kernel runs INNER times inside one jitted function, with the request slots rotated
through a pool several times the L2 so each call reads cold state; median over reps. Ratios: tree
vs our chain kernel (parents=None) of the same node count, and vs the byte floor (state read, plus
writes, over the measured device copy bandwidth).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import log, rel_err
from benchmarks import timing
from benchmarks.timing import measure_copy_bandwidth
from pallas_kernels.linear.conv_tree import conv_tree_update
from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout
from pallas_kernels.linear.mamba2_replay import mamba2_replay_commit
from pallas_kernels.linear.mamba2_tree import mamba2_tree_scan
from treespec_jax.linear.mamba2 import pack_path_rows

NEMOTRON = dict(H=128, P=64, N=128, G=8)
SMALL = dict(H=4, P=16, N=16, G=2)
CONV_W = 4
INNER = 10  # kernel calls per timed jit call
_T0 = time.time()  # this module's start, for its --budget-s
POOL_BYTES = 512 << 20  # rotate slots through at least this much state (H200 L2 is 60 MB)


def dfs_tree(rng, batch, t, p_extend=0.5):
    """Random trees numbered depth first (first child first), like the drafter's trees."""
    out = np.full((batch, t), -1, np.int32)
    for b in range(batch):
        par = [-1] + [i - 1 if rng.random() < p_extend else int(rng.integers(0, i)) for i in range(1, t)]
        kids = [[] for _ in range(t)]
        for i in range(1, t):
            kids[par[i]].append(i)
        order, stack = [], [0]
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(reversed(kids[n]))
        new = {old: k for k, old in enumerate(order)}
        out[b] = [-1 if par[o] < 0 else new[par[o]] for o in order]
    return out


def tree_stats(parents):
    """(mean branch points, max depth, mean replayed nodes per tree node) over the batch."""
    nb, t = parents.shape
    is_branch = parents[:, 1:] != np.arange(t - 1)
    depth = np.zeros_like(parents)
    for i in range(1, t):
        depth[:, i] = np.where(parents[:, i] >= 0, depth[np.arange(nb), np.maximum(parents[:, i], 0)] + 1, 0)
    # A branch at node i walks its parent's path: depth(parent) + 1 replayed updates.
    replays = np.where(is_branch, np.take_along_axis(depth, np.maximum(parents[:, 1:], 0), 1) + 1, 0)
    return float(is_branch.sum(1).mean()), int(depth.max()), float(replays.sum(1).mean() / t)


def random_paths(rng, parents):
    nb, t = parents.shape
    path = np.full((nb, t), -1, np.int32)
    acc = np.zeros(nb, np.int32)
    for b in range(nb):
        node, full = int(rng.integers(0, t)), []
        while node >= 0:
            full.append(node)
            node = int(parents[b, node])
        full = full[::-1]
        path[b, :len(full)] = full
        acc[b] = len(full)
    return path, acc


def mamba_inputs(key, nb, t, d, slots, act=jnp.bfloat16, state=jnp.float32):
    H, P, N, G = d["H"], d["P"], d["N"], d["G"]
    ks = jax.random.split(key, 10)
    n = lambda k, s, dt=act: jax.random.normal(k, s, jnp.float32).astype(dt)
    return dict(
        x=n(ks[0], (nb, t, H, P)), dt=n(ks[1], (nb, t, H)),
        A_log=jax.random.uniform(ks[2], (H,), jnp.float32, 0.0, np.log(16.0)),
        B=n(ks[3], (nb, t, G, N)), C=n(ks[4], (nb, t, G, N)), D=n(ks[5], (H,), jnp.float32),
        dt_bias=0.5 * n(ks[6], (H,), jnp.float32), state_pool=n(ks[7], (slots, H, P, N), state),
        z=n(ks[8], (nb, t, H, P)),
    )


def scan(a, slots, parents, **kw):
    return mamba2_tree_scan(a["x"], a["dt"], a["A_log"], a["B"], a["C"], a["D"], a["dt_bias"], a["state_pool"],
                            slots, parents, z=a.get("z"), **kw)


# ----------------------------------------------------------------------------------------------
# Conformance
# ----------------------------------------------------------------------------------------------

def conformance(quick: bool) -> bool:
    ok = True

    def check(name, err, tol):
        nonlocal ok
        good = err <= tol
        ok &= good
        log(f"  {'PASS' if good else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")

    rng = np.random.default_rng(0)
    cases = [("small", SMALL, 3, 16, jnp.float32, 2e-5), ("small", SMALL, 3, 64, jnp.float32, 2e-5),
             ("small-bf16", SMALL, 3, 33, jnp.bfloat16, 1e-2), ("nemotron", NEMOTRON, 2, 16, jnp.bfloat16, 1e-2)]
    if quick:
        cases = cases[1:2] + cases[-1:]

    def one_case(tag, d, nb, t, act, tol):
        H, P, N, G = d["H"], d["P"], d["N"], d["G"]
        a = mamba_inputs(jax.random.key(t * 7 + nb), nb, t, d, 6, act=act)
        parents = jnp.asarray(dfs_tree(rng, nb, t))
        slots = jnp.asarray([4, -1, 1] if nb == 3 else [3, -1], jnp.int32)  # one padded request
        name = f"{tag} B={nb} T={t}"
        y_ref, s_ref = scan(a, slots, parents, mode="staged", scratch=jnp.zeros((nb, t, H, P, N)), backend="reference")
        scratch = jnp.full((nb, t, H, P, N), jnp.nan, jnp.float32)
        y, st = jax.jit(lambda a, s, p, sc: scan(a, s, p, mode="staged", scratch=sc))(a, slots, parents, scratch)
        live = np.asarray(slots) >= 0
        check(f"{name} staged y", rel_err(y, y_ref), tol)
        check(f"{name} staged states", rel_err(np.asarray(st)[live], np.asarray(s_ref)[live]), tol)
        check(f"{name} padded scratch untouched", 0.0 if np.isnan(np.asarray(st)[~live]).all() else 1.0, 0.0)
        lay = Mamba2PayloadLayout(G, N, H, P)
        pay0 = jnp.full((nb, t, lay.width), jnp.nan, act)
        y2, pay = jax.jit(lambda a, s, p, pl_: scan(a, s, p, mode="replay", payload=pl_))(a, slots, parents, pay0)
        check(f"{name} replay y == staged y", 0.0 if np.array_equal(np.asarray(y2, np.float32), np.asarray(y, np.float32)) else 1.0, 0.0)
        want = np.asarray(lay.pack(a["B"], a["x"], a["dt"]), np.float32)
        check(f"{name} payload rows exact", 0.0 if np.array_equal(np.asarray(pay, np.float32)[live], want[live]) else 1.0, 0.0)
        yu, _ = jax.jit(lambda a, s, p: scan(a, s, p, unroll=True))(a, slots, parents)
        check(f"{name} unrolled tree kernel", rel_err(yu, y_ref), tol)
        y3, _ = jax.jit(lambda a, s: scan(a, s, None))(a, slots)
        y3_ref, _ = scan(a, slots, None, backend="reference")
        check(f"{name} chain kernel", rel_err(y3, y3_ref), tol)
        path, acc = random_paths(rng, np.asarray(parents))
        packed = pack_path_rows(pay, jnp.asarray(path), jnp.asarray(acc))
        commit = jax.jit(lambda pk, ac, pool, s: mamba2_replay_commit(pk, ac, pool, s, a["A_log"], a["dt_bias"],
                                                                       ngroups=G, dstate=N))
        new_pool = np.asarray(commit(packed, jnp.asarray(acc), a["state_pool"], slots))
        for b in np.nonzero(live)[0]:
            last = path[b, acc[b] - 1]
            check(f"{name} replay commit b={b} vs staged state", rel_err(new_pool[int(slots[b])], np.asarray(st)[b, last]),
                  2e-5 if act == jnp.float32 else 1e-2)
        untouched = [s for s in range(6) if s not in set(np.asarray(slots)[live].tolist())]
        check(f"{name} other pool slots untouched",
              0.0 if np.array_equal(new_pool[untouched], np.asarray(a["state_pool"])[untouched]) else 1.0, 0.0)
        # Tree conv at this batch over this layer's conv dim ([x | B | C]).
        cd = 2 * G * N + H * P
        k1, k2, k3, k4 = jax.random.split(jax.random.key(t), 4)
        xc = jax.random.normal(k1, (nb, t, cd), jnp.float32).astype(act)
        cpool = jax.random.normal(k2, (6, CONV_W - 1, cd), jnp.float32).astype(act)
        w = jax.random.normal(k3, (cd, CONV_W), jnp.float32).astype(act)
        bias = jax.random.normal(k4, (cd,), jnp.float32).astype(act)
        rows0 = jnp.full((nb, t, CONV_W - 1, cd), jnp.nan, act)
        yc, rows = jax.jit(lambda x, p, r: conv_tree_update(x, cpool, slots, w, bias, p, silu=True, node_states=r))(
            xc, parents, rows0)
        yc_ref, rows_ref = conv_tree_update(xc, cpool, slots, w, bias, parents, silu=True, node_states=rows0,
                                            backend="reference")
        check(f"{name} conv y", rel_err(yc, yc_ref), 2e-6 if act == jnp.float32 else 1e-2)
        check(f"{name} conv rows exact", 0.0 if np.array_equal(np.asarray(rows, np.float32)[live],
                                                               np.asarray(rows_ref, np.float32)[live]) else 1.0, 0.0)
        check(f"{name} conv padded rows untouched", 0.0 if np.isnan(np.asarray(rows, np.float32)[~live]).all() else 1.0, 0.0)

    for case in cases:
        try:
            one_case(*case)
        except Exception:  # a kernel that fails to lower or run fails conformance; keep going
            traceback.print_exc()
            ok = False
    return ok


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def time_step(step, carry):
    """Median seconds per step; `step(carry) -> carry` runs INNER times per jitted call (donated)."""
    return timing.time_step(step, carry, inner=INNER, reps=5)


def bench_case(nb, t, rng, bw, staged: bool, unroll_variant: bool = False):
    d = NEMOTRON
    H, P, N, G = d["H"], d["P"], d["N"], d["G"]
    state_bytes = H * P * N * 4
    sets = max(2, -(-POOL_BYTES // (nb * state_bytes)))  # rotate through >= POOL_BYTES of state
    a = mamba_inputs(jax.random.key(nb * 100 + t), nb, t, d, nb * sets)
    parents = jnp.asarray(dfs_tree(rng, nb, t))
    lay = Mamba2PayloadLayout(G, N, H, P)
    res = {}

    def verify_step(tree, mode, unroll=False):
        def step(c):
            side, i, acc = c
            slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
            kw = {"scratch": side} if mode == "staged" else {"payload": side} if mode == "replay" else {}
            y, side2 = scan(a, slots, parents if tree else None, mode=mode, unroll=unroll, **kw)
            return (side if side2 is None else side2), (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
        return step

    for mode in ["replay", "staged"] if staged else ["replay"]:
        for tree in (True, False):
            side = (jnp.zeros((nb, t, H, P, N), jnp.float32) if mode == "staged"
                    else jnp.zeros((nb, t, lay.width), jnp.bfloat16))  # donated: fresh per run
            sec, _ = time_step(verify_step(tree, mode), (side, jnp.int32(0), jnp.float32(0)))
            res[(mode, tree)] = sec
    if unroll_variant:
        for tree in (True, False):
            side = jnp.zeros((nb, t, lay.width), jnp.bfloat16)
            res[("unrolled", tree)], _ = time_step(verify_step(tree, "replay", unroll=True),
                                                   (side, jnp.int32(0), jnp.float32(0)))
    # ReplaySSM commit over a random accepted path per request (payload already packed).
    path, acc = random_paths(rng, np.asarray(parents))
    payload = lay.pack(a["B"], a["x"], a["dt"])
    acc_j = jnp.asarray(acc)

    def commit_step(c):
        pool, i = c
        slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
        pool = mamba2_replay_commit(payload, acc_j, pool, slots, a["A_log"], a["dt_bias"], ngroups=G, dstate=N)
        return pool, (i + 1) % sets
    res["commit"], _ = time_step(commit_step, (a["state_pool"], jnp.int32(0)))
    res["mean_accept"] = float(acc.mean())
    # Tree conv (Nemotron conv dim), node rows written (staged) and not (ReplaySSM).
    cd = 2 * G * N + H * P
    xc = jax.random.normal(jax.random.key(1), (nb, t, cd), jnp.float32).astype(jnp.bfloat16)
    cpool = jax.random.normal(jax.random.key(2), (nb * sets, CONV_W - 1, cd), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (cd, CONV_W), jnp.float32).astype(jnp.bfloat16)
    bias = jnp.zeros((cd,), jnp.bfloat16) + 0.1

    def conv_step(tree):
        def step(c):
            i, acc = c
            slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
            y, _ = conv_tree_update(xc, cpool, slots, w, bias, parents if tree else None, silu=True)
            return (i + 1) % sets, acc + y[0, 0, 0].astype(jnp.float32)
        return step
    for tree in (True, False):
        res[("conv", tree)], _ = time_step(conv_step(tree), (jnp.int32(0), jnp.float32(0)))
    res["stats"] = tree_stats(np.asarray(parents))
    res["state_bytes"] = nb * state_bytes
    res["conv_bytes"] = nb * t * cd * 2 * 2 + nb * (CONV_W - 1) * cd * 2  # x read + y write + state read
    return res


def sweep_tiles(nb=32, t=16):
    """Tree ReplaySSM verify at one shape over a few (block_p, num_warps) choices."""
    d = NEMOTRON
    H, P, N, G = d["H"], d["P"], d["N"], d["G"]
    sets = max(2, -(-POOL_BYTES // (nb * H * P * N * 4)))
    a = mamba_inputs(jax.random.key(5), nb, t, d, nb * sets)
    parents = jnp.asarray(dfs_tree(np.random.default_rng(5), nb, t))
    out = {}
    for bp, nw in ((16, 4), (8, 4), (32, 4), (16, 8), (16, 2)):
        def step(c, bp=bp, nw=nw):
            i, acc = c
            slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
            y, _ = scan(a, slots, parents, block_p=bp, num_warps=nw)
            return (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
        out[(bp, nw)], _ = time_step(step, (jnp.int32(0), jnp.float32(0)))
    log(f"tile sweep B={nb} T={t} tree outputs-only: " +
        ", ".join(f"block_p={bp} warps={nw}: {sec * 1e6:.1f} us" for (bp, nw), sec in out.items()))


def bench(quick: bool, budget_s: float, sweep: bool = False, unroll_variant: bool = False):
    bw = measure_copy_bandwidth()
    log(f"device copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    if sweep:
        try:
            sweep_tiles()
        except Exception:
            traceback.print_exc()
    # Most informative first, so a budget cut drops the least.
    shapes = [(32, 16), (1, 16), (64, 64), (32, 64), (1, 64), (64, 16), (32, 8), (1, 8), (64, 8)]
    if quick:
        shapes = [(1, 16), (32, 16)]
    rng = np.random.default_rng(1)
    d = NEMOTRON
    lay = Mamba2PayloadLayout(d["G"], d["N"], d["H"], d["P"])
    rows = []
    for nb, t in shapes:
        if time.time() - _T0 > budget_s:
            log(f"budget reached; skipping B={nb} T={t} and later")
            break
        staged = (nb, t) in ((32, 16), (1, 16), (64, 8))
        try:
            r = bench_case(nb, t, rng, bw, staged, unroll_variant)
        except Exception:
            traceback.print_exc()
            continue
        # Byte floors: bytes that must move / copy bandwidth (which counts read + write bytes).
        floor = r["state_bytes"] / bw  # read the committed state once
        tree, chain = r[("replay", True)], r[("replay", False)]
        line = (f"B={nb:2d} T={t:2d} branches~{r['stats'][0]:.1f} depth {r['stats'][1]:2d} replays/node "
                f"{r['stats'][2]:.2f} | replay-verify tree "
                f"{tree * 1e6:7.1f} us chain {chain * 1e6:7.1f} us tree/chain {tree / chain:4.2f} "
                f"floor {floor * 1e6:6.1f} us (x{tree / floor:4.1f}) | commit({r['mean_accept']:.1f} rows) "
                f"{r['commit'] * 1e6:6.1f} us | conv tree {r[('conv', True)] * 1e6:6.1f} chain "
                f"{r[('conv', False)] * 1e6:6.1f} us (floor {r['conv_bytes'] / bw * 1e6:5.1f})")
        if ("unrolled", True) in r:
            line += (f" | unrolled replay-verify tree {r[('unrolled', True)] * 1e6:7.1f} chain "
                     f"{r[('unrolled', False)] * 1e6:7.1f} us")
        if ("staged", True) in r:
            st_floor = (r["state_bytes"] * (1 + t)) / bw  # read once, write T node states
            line += (f" | staged tree {r[('staged', True)] * 1e6:7.1f} chain {r[('staged', False)] * 1e6:7.1f} us "
                     f"(floor {st_floor * 1e6:6.1f})")
        log(line)
        rows.append(line)
    per_node_staged = d["H"] * d["P"] * d["N"] * 4
    per_node_replay = lay.width * 2
    log(f"bytes written per node per request (besides y): staged {per_node_staged} B (fp32 state), "
        f"ReplaySSM {per_node_replay} B (bf16 payload row) = {per_node_staged / per_node_replay:.0f}x less")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="two conformance cases, two timing configs")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new timing configs after this")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time a few (block_p, num_warps) tilings")
    p.add_argument("--unroll", action="store_true", help="also time the unrolled node loop (mamba2_tree_scan(unroll=True))")
    a = p.parse_args(argv)
    log(f"jax {jax.__version__} devices {jax.devices()}")
    ok = True
    if not a.skip_conformance:
        try:
            ok = conformance(a.quick)
        except Exception:  # report and still time what compiles
            traceback.print_exc()
            ok = False
        log(f"conformance: {'PASS' if ok else 'FAIL'}")
    bench(a.quick, a.budget_s, a.sweep, a.unroll)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
