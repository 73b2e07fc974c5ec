"""Mamba2 tree verify scan, ReplaySSM commit and tree conv on the GPU: compiled conformance, then timing.

Run: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mamba2.py [--quick] [--budget-s S]
     [--configs 32x16,64x16] [--markdown FILE] [--sweep] [--tiles 16x4,16x2] [--chunked]

Conformance (compiled Pallas Triton vs the fp32 jnp references; fresh random inputs; scratch,
payload and node-row buffers poisoned with NaN; a padded request in every batch): the tree scan in
staged, ReplaySSM and outputs-only modes for both replay walks timed below (the default
parent-pointer walk and the precomputed ancestor-list walk) on trees with nested branch points,
the chain kernel, z gating, bf16 inputs, the replay commit (vs the staged state at the last
accepted node), the tree conv with the precomputed lag table and with the earlier parent walk, at
small and Nemotron-H dims.

Timing (Nemotron-H-like: H=128, headdim 64, dstate 128, ngroups 8, bf16 activations, fp32 state;
conv dim 2*8*128 + 128*64 = 10240, width 4; random depth-first trees): each kernel runs in chains
of INNER and 3 x INNER calls inside one jitted function, with the request slots rotated through a
pool several times the L2 so each call reads cold state; the difference of the two chains'
medians per call is the figure (`timing.time_step`, device time). Per B x T config, all in one run: the chain
kernel (parents=None), the default tree kernel ("old": parent-pointer replay), and the tree kernel
with the precomputed ancestor-list walk, its per-step plan built outside the timed layer (as the
layer glue shares it; the plan's own cost is timed once as "plan"). Ratios are tree / chain of the
same run, and vs the byte floor (state read over the measured device copy bandwidth). The scan keeps
no branch register slots (results: mamba2-branch-slots).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import log, parse_shapes, rel_err
from benchmarks import timing
from benchmarks.timing import measure_copy_bandwidth
from pallas_kernels.linear.conv_tree import conv_lag_sources, conv_tree_update
from pallas_kernels.linear.mamba2_reference import Mamba2PayloadLayout
from pallas_kernels.linear.mamba2_replay import mamba2_replay_commit
from pallas_kernels.linear.mamba2_chunked import mamba2_tree_chunked
from pallas_kernels.linear.mamba2_tree import mamba2_scan_plan, mamba2_tree_scan
from treespec_jax.linear.mamba2 import mamba2_step_plan, pack_path_rows
from treespec_jax.tree.masks import ancestor_mask

NEMOTRON = dict(H=128, P=64, N=128, G=8)
SMALL = dict(H=4, P=16, N=16, G=2)
CONV_W = 4
INNER = 10  # kernel calls in the shorter timed chain (timing.time_step also runs 3 x INNER)
_T0 = time.time()  # this module's start, for its --budget-s
POOL_BYTES = 512 << 20  # rotate slots through at least this much state (H200 L2 is 60 MB)
TIMING_DIMS = NEMOTRON  # --smoke swaps in SMALL
SMOKE = False
# Depth-first tree whose branch points nest three deep: replays of every depth.
NESTED16 = [-1, 0, 1, 2, 2, 1, 5, 5, 0, 8, 9, 9, 8, 12, 12, 0]
OLD = dict(walk="parents")  # the default tree kernel (parent-pointer replay): the timed baseline
PRE = dict(walk="precomputed")  # replay along the per-step ancestor list (Mamba2ScanPlan)
DEFAULT_CONFIGS = "32x16,1x16,64x16,32x64,64x64,1x64,32x8,1x8,64x8"
QUICK_CONFIGS = "32x16,1x16"


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


def drafter_tree(rng, batch, t):
    """Trees as the drafter selects them (K-wide S-step rounds, depth-first, best child first), from
    bench_gdn's builder so both benches time the same shapes; None where it cannot be imported."""
    try:
        from benchmarks.bench_gdn import eagle_tree
        return np.asarray(eagle_tree(rng, batch, t), np.int32)
    except Exception as exc:  # an optional comparison: report and keep timing the random trees
        log(f"drafter-shaped trees unavailable for T={t}: {exc!r}")
        return None


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


def chunked(a, slots, parents, **kw):
    return mamba2_tree_chunked(a["x"], a["dt"], a["A_log"], a["B"], a["C"], a["D"], a["dt_bias"], a["state_pool"],
                               slots, parents, z=a.get("z"), **kw)


CHUNKED = False  # --chunked: also time the chunked (SSD) tree form, mamba2_chunked.py


def variant_name(kw):
    return "old (parent walk)" if kw.get("walk", "parents") == "parents" else "precomputed walk"


# ----------------------------------------------------------------------------------------------
# Conformance
# ----------------------------------------------------------------------------------------------

def conformance(quick: bool, results: list | None = None, smoke: bool = False) -> bool:
    """Every check logs one line; `results` (if given) collects (name, passed) for the markdown."""
    ok = True

    def check(name, err, tol):
        nonlocal ok
        good = bool(err <= tol)  # NaN / inf never pass (rel_err gives inf for a non-finite output)
        ok &= good
        if results is not None:
            results.append((name, good))
        log(f"  {'PASS' if good else 'FAIL'} {name}: rel err {err:.2e} (tol {tol:.0e})")

    def same(name, a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        check(name, 0.0 if a.shape == b.shape and np.array_equal(a, b) else 1.0, 0.0)

    rng = np.random.default_rng(0)
    full_variants = [PRE, OLD]
    cases = [("small", SMALL, 3, 16, jnp.float32, 2e-5, full_variants),
             ("small", SMALL, 3, 64, jnp.float32, 2e-5, full_variants),
             ("small-bf16", SMALL, 3, 33, jnp.bfloat16, 1e-2, full_variants[:1]),
             ("nemotron", NEMOTRON, 2, 16, jnp.bfloat16, 1e-2, [full_variants[0], OLD])]
    if quick:
        cases = [cases[0], cases[-1]]
    if smoke:  # CPU plumbing check (interpret mode): one small case
        cases = cases[:1]

    def one_case(tag, d, nb, t, act, tol, variants):
        H, P, N, G = d["H"], d["P"], d["N"], d["G"]
        a = mamba_inputs(jax.random.key(t * 7 + nb), nb, t, d, 6, act=act)
        par = dfs_tree(rng, nb, t)
        par[0, :16] = NESTED16[: min(t, 16)] if t >= 16 else par[0, :16]  # nested branch points
        parents = jnp.asarray(par)
        slots = jnp.asarray([4, -1, 1] if nb == 3 else [3, -1], jnp.int32)  # one padded request
        live = np.asarray(slots) >= 0
        name = f"{tag} B={nb} T={t}"
        y_ref, s_ref = scan(a, slots, parents, mode="staged", scratch=jnp.zeros((nb, t, H, P, N)), backend="reference")
        lay = Mamba2PayloadLayout(G, N, H, P)
        want_pay = np.asarray(lay.pack(a["B"], a["x"], a["dt"]), np.float32)
        st_default = None
        for kw in variants:
            vname = f"{name} {variant_name(kw)}"
            scratch = jnp.full((nb, t, H, P, N), jnp.nan, jnp.float32)
            y, st = jax.jit(lambda a, s, p, sc, kw=kw: scan(a, s, p, mode="staged", scratch=sc, **kw))(
                a, slots, parents, scratch)
            check(f"{vname} staged y", rel_err(np.asarray(y)[live], np.asarray(y_ref)[live]), tol)
            check(f"{vname} staged states", rel_err(np.asarray(st)[live], np.asarray(s_ref)[live]), tol)
            check(f"{vname} padded y zero / scratch untouched",
                  0.0 if (np.asarray(y, np.float32)[~live] == 0).all() and np.isnan(np.asarray(st)[~live]).all()
                  else 1.0, 0.0)
            pay0 = jnp.full((nb, t, lay.width), jnp.nan, act)
            y2, pay = jax.jit(lambda a, s, p, pl_, kw=kw: scan(a, s, p, mode="replay", payload=pl_, **kw))(
                a, slots, parents, pay0)
            same(f"{vname} replay y == staged y (bitwise)", y2, y)
            same(f"{vname} payload rows exact", np.asarray(pay, np.float32)[live], want_pay[live])
            check(f"{vname} padded payload untouched", 0.0 if np.isnan(np.asarray(pay, np.float32)[~live]).all()
                  else 1.0, 0.0)
            y3, _ = jax.jit(lambda a, s, p, kw=kw: scan(a, s, p, **kw))(a, slots, parents)
            same(f"{vname} outputs-only y == staged y (bitwise)", y3, y)
            if st_default is None:
                st_default, pay_default = st, pay
        # The chunked (SSD) form, compiled: outputs vs the reference, payload rows, chain.
        pay0 = jnp.full((nb, t, lay.width), jnp.nan, act)
        yc, payc = jax.jit(lambda a, s, p, pl_: chunked(a, s, p, mode="replay", payload=pl_))(a, slots, parents, pay0)
        check(f"{name} chunked tree y", rel_err(np.asarray(yc)[live], np.asarray(y_ref)[live]), tol)
        y3x, _ = jax.jit(lambda a, s, p: chunked(a, s, p, fp32_dots="tf32x3"))(a, slots, parents)
        check(f"{name} chunked tree y, tf32x3 products", rel_err(np.asarray(y3x)[live], np.asarray(y_ref)[live]), tol)
        same(f"{name} chunked payload rows exact", np.asarray(payc, np.float32)[live], want_pay[live])
        ycc, _ = jax.jit(lambda a, s: chunked(a, s, None))(a, slots)
        ycc_ref, _ = scan(a, slots, None, backend="reference")
        check(f"{name} chunked chain y", rel_err(np.asarray(ycc)[live], np.asarray(ycc_ref)[live]), tol)
        for kw in (OLD, PRE):
            yu, _ = jax.jit(lambda a, s, p, kw=kw: scan(a, s, p, unroll=True, **kw))(a, slots, parents)
            check(f"{name} unrolled tree kernel {variant_name(kw)}", rel_err(np.asarray(yu)[live],
                                                                           np.asarray(y_ref)[live]), tol)
        y3, _ = jax.jit(lambda a, s: scan(a, s, None))(a, slots)
        y3_ref, _ = scan(a, slots, None, backend="reference")
        check(f"{name} chain kernel", rel_err(y3, y3_ref), tol)
        path, acc = random_paths(rng, par)
        packed = pack_path_rows(pay_default, jnp.asarray(path), jnp.asarray(acc))
        commit = jax.jit(lambda pk, ac, pool, s: mamba2_replay_commit(pk, ac, pool, s, a["A_log"], a["dt_bias"],
                                                                       ngroups=G, dstate=N))
        new_pool = np.asarray(commit(packed, jnp.asarray(acc), a["state_pool"], slots))
        for b in np.nonzero(live)[0]:
            last = path[b, acc[b] - 1]
            check(f"{name} replay commit b={b} vs staged state", rel_err(new_pool[int(slots[b])],
                                                                          np.asarray(st_default)[b, last]),
                  2e-5 if act == jnp.float32 else 1e-2)
        untouched = [s for s in range(6) if s not in set(np.asarray(slots)[live].tolist())]
        same(f"{name} other pool slots untouched", new_pool[untouched], np.asarray(a["state_pool"])[untouched])
        # Tree conv at this batch over this layer's conv dim ([x | B | C]): lag table and parent walk.
        cd = 2 * G * N + H * P
        k1, k2, k3, k4 = jax.random.split(jax.random.key(t), 4)
        xc = jax.random.normal(k1, (nb, t, cd), jnp.float32).astype(act)
        cpool = jax.random.normal(k2, (6, CONV_W - 1, cd), jnp.float32).astype(act)
        w = jax.random.normal(k3, (cd, CONV_W), jnp.float32).astype(act)
        bias = jax.random.normal(k4, (cd,), jnp.float32).astype(act)
        rows0 = jnp.full((nb, t, CONV_W - 1, cd), jnp.nan, act)
        yc_ref, rows_ref = conv_tree_update(xc, cpool, slots, w, bias, parents, silu=True, node_states=rows0,
                                            backend="reference")
        lags = conv_lag_sources(parents, CONV_W)
        for cname, ckw in (("lag table", dict(lags=lags)), ("parent walk (old)", dict(walk="parents"))):
            yc, rows = jax.jit(lambda x, p, r, ckw=ckw: conv_tree_update(x, cpool, slots, w, bias, p, silu=True,
                                                                         node_states=r, **ckw))(xc, parents, rows0)
            check(f"{name} conv {cname} y", rel_err(np.asarray(yc)[live], np.asarray(yc_ref)[live]),
                  2e-6 if act == jnp.float32 else 1e-2)
            same(f"{name} conv {cname} rows exact", np.asarray(rows, np.float32)[live],
                 np.asarray(rows_ref, np.float32)[live])
            check(f"{name} conv {cname} padded rows untouched, y zero",
                  0.0 if np.isnan(np.asarray(rows, np.float32)[~live]).all()
                  and (np.asarray(yc, np.float32)[~live] == 0).all() else 1.0, 0.0)

    for case in cases:
        try:
            one_case(*case)
        except Exception:  # a kernel that fails to lower or run fails conformance; keep going
            traceback.print_exc()
            ok = False
            if results is not None:
                results.append((f"{case[0]} B={case[2]} T={case[3]}: exception (see log)", False))
    return ok


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def time_step(step, carry):
    """Device seconds per step: chains of INNER and 3 x INNER `step(carry) -> carry` calls in one jit
    (donated), the difference per call (`timing.time_step`)."""
    return timing.time_step(step, carry, inner=INNER, reps=5)


def bench_case(nb, t, rng, launch, staged=False, unroll_variant=False, drafter=True, commit=True):
    d = TIMING_DIMS
    H, P, N, G = d["H"], d["P"], d["N"], d["G"]
    state_bytes = H * P * N * 4
    sets = max(2, -(-POOL_BYTES // (nb * state_bytes)))  # rotate through >= POOL_BYTES of state
    a = mamba_inputs(jax.random.key(nb * 100 + t), nb, t, d, nb * sets)
    par = dfs_tree(rng, nb, t)
    parents = jnp.asarray(par)
    lay = Mamba2PayloadLayout(G, N, H, P)
    plan = mamba2_scan_plan(parents)
    res = {}
    dpar = drafter_tree(rng, nb, t) if drafter and t > 1 else None

    def verify_step(tree, mode, kw):
        def step(c):
            side, i, acc = c
            slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
            skw = {"scratch": side} if mode == "staged" else {"payload": side} if mode == "replay" else {}
            y, side2 = scan(a, slots, parents if tree else None, mode=mode, **launch, **skw, **kw)
            return (side if side2 is None else side2), (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
        return step

    def side_for(mode):  # donated: fresh per run
        return (jnp.zeros((nb, t, H, P, N), jnp.float32) if mode == "staged"
                else jnp.zeros((nb, t, lay.width), jnp.bfloat16))

    def timed(key, tree, mode, kw):
        res[key], _ = time_step(verify_step(tree, mode, kw), (side_for(mode), jnp.int32(0), jnp.float32(0)))

    timed(("replay", "chain"), False, "replay", {})
    timed(("replay", "old"), True, "replay", OLD)
    timed(("replay", "pre"), True, "replay", dict(PRE, plan=plan))
    if dpar is not None:  # the same timings over drafter-shaped trees
        dparents = jnp.asarray(dpar)
        dplan = mamba2_scan_plan(dparents)

        def dtimed(key, kw):
            def step(c):
                side, i, acc = c
                slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
                y, side2 = scan(a, slots, dparents, mode="replay", payload=side, **launch, **kw)
                return side2, (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
            res[key], _ = time_step(step, (side_for("replay"), jnp.int32(0), jnp.float32(0)))

        dtimed(("drafter", "old"), OLD)
        dtimed(("drafter", "pre"), dict(PRE, plan=dplan))
        res["drafter_stats"] = tree_stats(dpar)
    if staged:
        timed(("staged", "chain"), False, "staged", {})
        timed(("staged", "old"), True, "staged", OLD)
        timed(("staged", "pre"), True, "staged", dict(PRE, plan=plan))
    if unroll_variant:
        timed(("unrolled", "old"), True, "replay", dict(OLD, unroll=True))
        timed(("unrolled", "pre"), True, "replay", dict(PRE, plan=plan, unroll=True))
        timed(("unrolled", "chain"), False, "replay", dict(unroll=True))
    if CHUNKED:
        mask = ancestor_mask(parents)  # built once per step, as attention's

        def chunked_step(tree, fp32_dots):
            def step(c):
                side, i, acc = c
                slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
                y, side2 = chunked(a, slots, parents if tree else None, mask=mask if tree else None,
                                   mode="replay", payload=side, fp32_dots=fp32_dots)
                return side2, (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
            return step

        for tree, fp32_dots in ((True, "ieee"), (False, "ieee"), (True, "tf32x3")):
            key = ("chunked", "tree" if tree else "chain") + (() if fp32_dots == "ieee" else (fp32_dots,))
            res[key], _ = time_step(chunked_step(tree, fp32_dots), (side_for("replay"), jnp.int32(0), jnp.float32(0)))
    # The per-step plan (ancestor list + conv lags), built once per step for all layers.
    plan_fn = jax.jit(lambda p: mamba2_step_plan(p, CONV_W, "precomputed"))
    res["plan"] = timing.median_time(plan_fn, parents, samples=10)
    # ReplaySSM commit over a random accepted path per request (payload already packed).
    path, acc = random_paths(rng, par)
    payload = lay.pack(a["B"], a["x"], a["dt"])
    acc_j = jnp.asarray(acc)

    def commit_step(c):
        pool, i = c
        slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
        pool = mamba2_replay_commit(payload, acc_j, pool, slots, a["A_log"], a["dt_bias"], ngroups=G, dstate=N)
        return pool, (i + 1) % sets
    res["commit"] = time_step(commit_step, (a["state_pool"], jnp.int32(0)))[0] if commit else float("nan")
    res["mean_accept"] = float(acc.mean())
    # Tree conv (Nemotron conv dim), outputs only (ReplaySSM keeps no conv rows).
    cd = 2 * G * N + H * P
    xc = jax.random.normal(jax.random.key(1), (nb, t, cd), jnp.float32).astype(jnp.bfloat16)
    cpool = jax.random.normal(jax.random.key(2), (nb * sets, CONV_W - 1, cd), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(3), (cd, CONV_W), jnp.float32).astype(jnp.bfloat16)
    bias = jnp.zeros((cd,), jnp.bfloat16) + 0.1
    lags = conv_lag_sources(parents, CONV_W)

    def conv_step(tree, kw):
        def step(c):
            i, acc = c
            slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
            y, _ = conv_tree_update(xc, cpool, slots, w, bias, parents if tree else None, silu=True, **kw)
            return (i + 1) % sets, acc + y[0, 0, 0].astype(jnp.float32)
        return step
    for key, tree, kw in (("chain", False, {}), ("old", True, dict(walk="parents")), ("new", True, dict(lags=lags))):
        res[("conv", key)], _ = time_step(conv_step(tree, kw), (jnp.int32(0), jnp.float32(0)))
    res["stats"] = tree_stats(par)
    res["state_bytes"] = nb * state_bytes
    res["conv_bytes"] = nb * t * cd * 2 * 2 + nb * (CONV_W - 1) * cd * 2  # x read + y write + state read
    return res


def bench_forms(configs, budget_s, on_table=None):
    """--forms: the verify forms alone (ReplaySSM, y + payload rows) at each (B, T): the recurrent
    chain and tree scans (launch defaults, parent walk) and the chunked form's chain and tree with
    TF32x3 products. Returns the markdown table; `on_table(text)` gets it after every config."""
    d = TIMING_DIMS
    H, P, N, G = d["H"], d["P"], d["N"], d["G"]
    bw = measure_copy_bandwidth() if jax.default_backend() == "gpu" else 1e11
    rng = np.random.default_rng(3)
    head = ("| B | T | recurrent chain | recurrent tree | chunked chain (tf32x3) | chunked tree (tf32x3) "
            "| best tree / best chain | chunked tree / recurrent chain | state-read floor |\n|" + " --- |" * 9)
    lines = []
    table = lambda: (f"Verify forms, Nemotron-H-like dims, ReplaySSM (y + payload rows), median us per layer call; "  # noqa: E731
                     f"copy bandwidth {bw / 1e12:.2f} TB/s:\n\n{head}\n" + "\n".join(lines))
    for nb, t in configs:
        if time.time() - _T0 > budget_s:
            log(f"budget reached; skipping forms at B={nb} T={t} and later")
            lines.append(f"| {nb} | {t} | skipped (budget) |")
            continue
        state_bytes = H * P * N * 4
        sets = max(2, -(-POOL_BYTES // (nb * state_bytes)))
        a = mamba_inputs(jax.random.key(nb * 100 + t + 7), nb, t, d, nb * sets)
        lay = Mamba2PayloadLayout(G, N, H, P)
        parents = jnp.asarray(dfs_tree(rng, nb, t))
        mask = ancestor_mask(parents)

        def step_of(form, tree):
            def step(c):
                side, i, acc = c
                slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
                par = parents if tree else None
                if form == "chunked":
                    y, side2 = chunked(a, slots, par, mask=mask if tree else None, mode="replay", payload=side,
                                       fp32_dots="tf32x3")
                else:
                    y, side2 = scan(a, slots, par, mode="replay", payload=side, **(OLD if tree else {}))
                return side2, (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
            return step

        r = {}
        try:
            for form in ("recurrent", "chunked"):
                for tree in (False, True):
                    carry = (jnp.zeros((nb, t, lay.width), jnp.bfloat16), jnp.int32(0), jnp.float32(0))
                    r[form, tree], _ = time_step(step_of(form, tree), carry)
        except Exception:
            traceback.print_exc()
            lines.append(f"| {nb} | {t} | error (see log) |")
            continue
        us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
        best_tree = min(r["recurrent", True], r["chunked", True])
        best_chain = min(r["recurrent", False], r["chunked", False])
        cells = [str(nb), str(t), us(r["recurrent", False]), us(r["recurrent", True]), us(r["chunked", False]),
                 us(r["chunked", True]), f"{best_tree / best_chain:.2f}x",
                 f"{r['chunked', True] / r['recurrent', False]:.2f}x", us(nb * state_bytes / bw)]
        lines.append("| " + " | ".join(cells) + " |")
        log("forms " + " ".join(cells))
        if on_table is not None:
            on_table(table())
    return table()


def sweep_tiles(tiles, nb=32, t=16):
    """Tree ReplaySSM verify (outputs only) at one shape over (block_p, num_warps) choices, for the
    chain and both tree walks."""
    if SMOKE:
        nb, t = 2, 8
    d = TIMING_DIMS
    H, P, N = d["H"], d["P"], d["N"]
    sets = max(2, -(-POOL_BYTES // (nb * H * P * N * 4)))
    a = mamba_inputs(jax.random.key(5), nb, t, d, nb * sets)
    parents = jnp.asarray(dfs_tree(np.random.default_rng(5), nb, t))
    variants = [("chain", None, {}), ("old", parents, OLD),
                ("precomputed walk", parents, dict(PRE, plan=mamba2_scan_plan(parents)))]
    lines = []
    for bp, nw in tiles:
        out = {}
        for vname, par, kw in variants:
            def step(c, bp=bp, nw=nw, par=par, kw=kw):
                i, acc = c
                slots = (jnp.arange(nb, dtype=jnp.int32) + i * nb) % (nb * sets)
                y, _ = scan(a, slots, par, block_p=bp, num_warps=nw, **kw)
                return (i + 1) % sets, acc + y[0, 0, 0, 0].astype(jnp.float32)
            try:
                out[vname], _ = time_step(step, (jnp.int32(0), jnp.float32(0)))
            except Exception:
                traceback.print_exc()
                out[vname] = float("nan")
        line = f"| {bp} | {nw} | " + " | ".join(f"{out[v] * 1e6:.1f}" for v, _, _ in variants) + " |"
        log(f"tile sweep B={nb} T={t} block_p={bp} warps={nw}: " +
            ", ".join(f"{v} {out[v] * 1e6:.1f} us" for v, _, _ in variants))
        lines.append(line)
    head = ("| block_p | warps | " + " | ".join(v for v, _, _ in variants) + " |\n|" + " --- |" * (2 + len(variants)))
    return f"Tile sweep, B={nb} T={t}, outputs-only mode (median us):\n\n{head}\n" + "\n".join(lines)


def parse_configs(text):
    out = parse_shapes(text, dims=2)
    bad = [f"{nb}x{t}" for nb, t in out if nb < 1 or not 1 <= t <= 64]
    if bad:
        raise ValueError(f"configs {bad}: need B >= 1 and 1 <= T <= 64")
    return out


def parse_tiles(text):
    """BLOCK_PxWARPS items, e.g. 16x4,32x8."""
    return parse_shapes(text, dims=2)


def bench(configs, budget_s, launch, staged=False, unroll_variant=False, on_row=None, drafter=True, commit=True):
    """Times every config; returns (bandwidth, markdown table rows, extra lines). `on_row(bw, rows,
    notes)` runs after each config, so a run cut short still leaves its finished rows behind."""
    bw = measure_copy_bandwidth() if jax.default_backend() == "gpu" else 1e11  # CPU smoke: a stand-in
    log(f"device copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    rng = np.random.default_rng(1)
    rows, notes = [], []
    for nb, t in configs:
        if on_row is not None and rows:
            on_row(bw, rows, notes)
        if time.time() - _T0 > budget_s:
            log(f"budget reached; skipping B={nb} T={t} and later")
            rows.append(f"| {nb} | {t} | skipped (budget) |")
            continue
        try:
            r = bench_case(nb, t, rng, launch, staged, unroll_variant, drafter, commit)
        except Exception:
            traceback.print_exc()
            rows.append(f"| {nb} | {t} | error (see log) |")
            continue
        floor = r["state_bytes"] / bw  # read the committed state once
        chain, old, pre = r[("replay", "chain")], r[("replay", "old")], r[("replay", "pre")]
        us = lambda s: "skipped" if s != s else f"{s * 1e6:.1f}"  # noqa: E731  (NaN = not timed)
        log(f"B={nb:2d} T={t:2d} branches~{r['stats'][0]:.1f} depth {r['stats'][1]:2d} | ReplaySSM verify chain "
            f"{us(chain)} us, old tree {us(old)} us ({old / chain:.2f}x, {r['stats'][2]:.2f} replays/node), "
            f"precomputed walk {us(pre)} us ({pre / chain:.2f}x) | floor {us(floor)} us | plan {us(r['plan'])} us/step "
            f"| commit({r['mean_accept']:.1f} rows) "
            f"{us(r['commit'])} us | conv chain {us(r[('conv', 'chain')])} old {us(r[('conv', 'old')])} "
            f"lag-table {us(r[('conv', 'new')])} us (floor {us(r['conv_bytes'] / bw)})")
        if ("staged", "chain") in r:
            line = (f"staged verify B={nb} T={t}: chain {us(r[('staged', 'chain')])}, old tree "
                    f"{us(r[('staged', 'old')])}, precomputed walk {us(r[('staged', 'pre')])} us")
            log("    " + line)
            notes.append(line)
        if ("chunked", "tree") in r:
            line = (f"chunked (SSD) form B={nb} T={t}: tree {us(r[('chunked', 'tree')])} us "
                    f"({r[('chunked', 'tree')] / chain:.2f}x the recurrent chain), chain {us(r[('chunked', 'chain')])} us "
                    f"({r[('chunked', 'chain')] / chain:.2f}x), tree with tf32x3 products "
                    f"{us(r[('chunked', 'tree', 'tf32x3')])} us, recurrent tree {us(old)} us")
            log("    " + line)
            notes.append(line)
        if ("unrolled", "chain") in r:
            line = (f"unrolled node loop B={nb} T={t}: ReplaySSM chain {us(r[('unrolled', 'chain')])}, "
                    f"old tree {us(r[('unrolled', 'old')])}, precomputed walk {us(r[('unrolled', 'pre')])} us")
            log("    " + line)
            notes.append(line)
        cells = [str(nb), str(t), "random", f"{r['stats'][0]:.1f} / {r['stats'][1]}", us(chain),
                 f"{us(old)} ({old / chain:.2f}x)", f"{us(pre)} ({pre / chain:.2f}x)"]
        cells += [us(floor), us(r["plan"]), us(r["commit"]),
                  f"{us(r[('conv', 'chain')])} / {us(r[('conv', 'old')])} / {us(r[('conv', 'new')])}"]
        rows.append("| " + " | ".join(cells) + " |")
        if ("drafter", "old") in r:
            dold, dpre = r[("drafter", "old")], r[("drafter", "pre")]
            cells = [str(nb), str(t), "drafter", f"{r['drafter_stats'][0]:.1f} / {r['drafter_stats'][1]}", us(chain),
                     f"{us(dold)} ({dold / chain:.2f}x)", f"{us(dpre)} ({dpre / chain:.2f}x)", "", "", "", ""]
            rows.append("| " + " | ".join(cells) + " |")
            log(f"    drafter-shaped trees: branches~{r['drafter_stats'][0]:.1f} depth {r['drafter_stats'][1]} | old "
                f"{us(dold)} us ({dold / chain:.2f}x, {r['drafter_stats'][2]:.2f} replays/node) "
                f"precomputed walk {us(dpre)} us ({dpre / chain:.2f}x)")
    if on_row is not None:
        on_row(bw, rows, notes)
    return bw, rows, notes


def markdown(args_line, conf, bw, rows, notes, launch, sweep_md):
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    dev = jax.devices()[0]
    out = [f"## Mamba2 tree scan: parent walk, ancestor-list replay, conv lag table ({date}, "
           f"{getattr(dev, 'device_kind', dev.platform)}, jax {jax.__version__})", "",
           f"Command: `python3 benchmarks/bench_mamba2.py {args_line}`", ""]
    if conf is not None:
        passed = sum(1 for _, g in conf if g)
        out.append(f"Compiled conformance: {'PASS' if passed == len(conf) else 'FAIL'} ({passed}/{len(conf)} checks; "
                   "NaN-poisoned scratch/payload/rows, a padded request per batch, every timed variant).")
        out += [f"- FAIL {n}" for n, g in conf if not g]
        out.append("")
    if rows:
        launch_txt = ", ".join(f"{k}={v}" for k, v in launch.items()) or "defaults"
        out.append(f"Timing, Nemotron-H-like dims, ReplaySSM verify (y + payload rows), cold state, median us per "
                   f"layer call; launch {launch_txt}; copy bandwidth {bw / 1e12:.2f} TB/s. \"old tree\" is the "
                   "default kernel (parent-pointer replay); \"precomputed walk\" replays along the per-step "
                   "ancestor list. "
                   "Plan = the per-step tables (all layers share them). Conv: chain / old parent walk / lag table. "
                   "Trees: \"random\" = this bench's random depth-first trees (comparable with earlier runs), "
                   "\"drafter\" = `select_tree` trees of a K-wide S-step round (bench_gdn's builder).")
        out.append("")
        head = ["B", "T", "tree", "branches / depth", "chain", "old tree", "precomputed walk", "floor", "plan",
                "commit", "conv chain / old / new"]
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + " --- |" * len(head))
        out += rows
        out.append("")
        out += [f"- {n}" for n in notes] + ([""] if notes else [])
    if SMOKE:
        out.append("SMOKE RUN (small dims, CPU interpret mode): the numbers mean nothing.\n")
    if sweep_md:
        out += [sweep_md, ""]
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help=f"two conformance cases, timing configs {QUICK_CONFIGS} (unless --configs)")
    p.add_argument("--budget-s", type=float, default=150.0, help="stop starting new timing configs after this")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--configs", default=None, help=f"BxT list (default {DEFAULT_CONFIGS})")
    p.add_argument("--block-p", type=int, default=None, help="launch: state rows per program (power of two)")
    p.add_argument("--num-warps", type=int, default=None, help="launch: warps per program")
    p.add_argument("--staged", action="store_true", help="also time staged verify (chain, both tree walks)")
    p.add_argument("--sweep", action="store_true", help="after the configs (budget permitting), time "
                   "(block_p, num_warps) tilings at B=32 T=16 for the chain and both tree walks")
    p.add_argument("--tiles", default="16x4,16x2,32x4,8x4,16x8", help="tilings for --sweep (BLOCK_PxWARPS)")
    p.add_argument("--unroll", action="store_true", help="also time the unrolled node loop (unroll=True)")
    p.add_argument("--forms", action="store_true", help="time only the verify forms (recurrent and chunked "
                   "chain/tree) at --configs; no conv, plan, commit or walk variants")
    p.add_argument("--chunked", action="store_true", help="also time the chunked (SSD) tree and chain forms")
    p.add_argument("--skip-commit", action="store_true", help="do not time the ReplaySSM commit (unchanged here)")
    p.add_argument("--no-drafter-trees", action="store_true",
                   help="time only the random trees, not also drafter-shaped (select_tree) trees")
    p.add_argument("--markdown", default=None, help="write a dated markdown section (for RESULTS.md) to this file")
    p.add_argument("--smoke", action="store_true", help="CPU plumbing check: small dims, interpret mode, numbers "
                   "meaningless")
    a = p.parse_args(argv)
    globals()["CHUNKED"] = a.chunked
    if a.smoke:
        global TIMING_DIMS, POOL_BYTES, INNER, SMOKE
        TIMING_DIMS, POOL_BYTES, INNER, SMOKE = SMALL, 1 << 16, 1, True
        a.configs = a.configs or "2x8"
    configs = parse_configs(a.configs or (QUICK_CONFIGS if a.quick else DEFAULT_CONFIGS))
    tiles = parse_tiles(a.tiles)
    launch = {k: v for k, v in (("block_p", a.block_p), ("num_warps", a.num_warps)) if v is not None}
    log(f"jax {jax.__version__} devices {jax.devices()}")
    ok, conf = True, None
    if not a.skip_conformance:
        conf = []
        try:
            ok = conformance(a.quick, conf, a.smoke)
        except Exception:  # report and still time what compiles
            traceback.print_exc()
            ok = False
            conf.append(("conformance: exception (see log)", False))
        log(f"conformance: {'PASS' if ok else 'FAIL'}")
    args_line = " ".join(sys.argv[1:] if argv is None else argv)
    state = dict(bw=0.0, rows=[], notes=[], sweep="")

    def write_md(bw=None, rows=None, notes=None):
        """(Re)writes the whole section: after conformance and after every timed config."""
        if bw is not None:
            state.update(bw=bw, rows=list(rows), notes=list(notes))
        if a.markdown:
            text = markdown(args_line, conf, state["bw"], state["rows"], state["notes"], launch, state["sweep"])
            with open(a.markdown, "w") as fh:
                fh.write(text + "\n")

    write_md()
    if a.forms and not a.skip_timing:
        def on_table(text):
            state["sweep"] = text
            write_md()
        on_table(bench_forms(configs, a.budget_s, on_table))
    elif not a.skip_timing:
        bench(configs, a.budget_s, launch, a.staged, a.unroll, on_row=write_md,
              drafter=not a.no_drafter_trees, commit=not a.skip_commit)
        if a.sweep and time.time() - _T0 <= a.budget_s:
            try:
                state["sweep"] = sweep_tiles(tiles)
            except Exception:
                traceback.print_exc()
            write_md()
        elif a.sweep:
            log("budget reached; skipping the tile sweep")
    if a.markdown:
        log(f"wrote {a.markdown}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
