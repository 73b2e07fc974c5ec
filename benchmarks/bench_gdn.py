"""GDN tree verify / commit on the GPU: compiled conformance first, then timing.

Run: PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_gdn.py [--quick] [--no-fla] [--budget-s S]
     [--configs 32x16,32x64,64x16]

Conformance (compiled Pallas Triton vs the fp32 jnp references, fresh random inputs, NaN-poisoned
outputs and workspaces): recurrent tree verify in staged and ReplaySSM modes (ReplaySSM writes the
workspace at exactly the branch points), the chain kernel, the chunked tree form, the ReplaySSM
commit, at small and Qwen3-Next dims.

Timing (Qwen3-Next dims H=16, HV=32, dk=dv=128, bf16 inputs, fp32 state; B in {1, 32, 64};
trees of 8, 16, 64 nodes): each kernel runs in chains of INNER and 3 x INNER calls inside one
jitted function (buffers donated, so aliased outputs are updated in place); the difference of the
two chains' medians per call is the figure (`timing.time_step`, device time). The tree kernels are timed against the
chain verify of the same node count measured in the same run, and against the state read (+ write)
byte floor at the measured device copy bandwidth.
flash-linear-attention's fused_recurrent chain (if the fla-core wheel was carried) is the outside
reference.
"""

from __future__ import annotations

import argparse
import functools
import datetime
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.report import log, parse_shapes, rel_err
from benchmarks import timing
from benchmarks.timing import measure_copy_bandwidth
from pallas_kernels.linear.chunked_common import FP32_DOTS
from pallas_kernels.linear.gdn_chunked import (MAX_CHUNKED_NODES, TWO_PASS_FACTOR_WARPS, chunk_rows,
                                              default_apply_reads_keys, default_two_pass,
                                              gdn_chunked_verify, two_pass_factor)
from pallas_kernels.linear.gdn_common import default_scale, gdn_dims
from pallas_kernels.linear.gdn_payload import GdnPayloadLayout, pack_payload
from pallas_kernels.linear.gdn_replay import gdn_replay_commit
from pallas_kernels.row_move import pack_path_rows
from pallas_kernels.linear.gdn_common import GdnDims
from pallas_kernels.linear.gdn_tree import (GdnKernelConfig, branch_points, gdn_tree_verify, pick_launch,
                                            uses_value_major)
from treespec_jax.linear.gdn import GdnLayerConfig, GdnTree, gdn_commit_replay, verify_kernel_for
from treespec_jax.tree import draft_tree
from treespec_jax.tree.masks import ancestor_mask, chain_parents

QWEN = dict(H=16, HV=32, DK=128, DV=128)
SMALL = dict(H=2, HV=4, DK=16, DV=16)
INNER = 10  # kernel calls in the shorter timed chain (timing.time_step also runs 3 x INNER)
DEFAULT_CONFIGS = [(1, 8), (1, 16), (1, 64), (32, 8), (32, 16), (32, 64), (64, 8), (64, 16), (64, 64)]
_T0 = time.time()  # this module's start, for its --budget-s
CHUNKED_IEEE = False  # --chunked-ieee: also time the chunked form with IEEE fp32 products (results: gdn-tf32x3)
SKIP_COMMIT = False  # --skip-commit: the T=64 commit step takes minutes to compile at B=32
FUSED_CHUNKED = True  # --no-fused-chunked: skip the fused chunked kernel (slower than two-pass past 16 nodes; results: gdn-two-pass)
# --lean: only what the layer's route chooses between (the recurrent tree and chain, and the chunked
# form the kernel's defaults pick, input-dtype grams included), no staged kernels, no factor-alone
# timings: a config compiles in about a third of the time, for route decisions over many T.
LEAN = False


def random_tree(rng, batch, t, p_extend=0.5):
    """The bench's historical trees: node i extends i - 1 with probability 1/2, else a uniformly random
    earlier node (not DFS numbered, so branch points stay alive long and overlap)."""
    parents = np.full((batch, t), -1, np.int32)
    for b in range(batch):
        for i in range(1, t):
            parents[b, i] = i - 1 if rng.random() < p_extend else rng.integers(0, i)
    return parents


# (topk K, steps S) of the drafter round that selects a T-node tree (WORKSPACE's config examples).
EAGLE_SHAPES = {8: (2, 4), 16: (4, 5), 32: (4, 6), 64: (8, 6)}


def eagle_shape(t):
    if t in EAGLE_SHAPES:
        return EAGLE_SHAPES[t]
    for k in (4, 2, 8):
        for s in range(10, 1, -1):
            if (s - 1) * k <= t <= k + (s - 1) * k * k + 1:
                return k, s
    raise ValueError(f"no drafter round (K, S) selects T={t} nodes")


def eagle_tree(rng, batch, t):
    """Trees as the drafter builds them: a K-wide, S-step round of top-K children (log-probs of a
    random softmax over 64 tokens), best T-1 entries kept and numbered depth first, best child first
    (`draft_tree.select_tree`), so branch points nest like a stack."""
    k, steps = eagle_shape(t)

    def topk_logprobs(shape):
        logits = 2.5 * rng.standard_normal(shape + (64,))
        lp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return jnp.asarray(-np.sort(-lp, axis=-1)[..., :k], jnp.float32)

    def tokens(shape):
        return jnp.asarray(rng.integers(0, 1000, shape), jnp.int32)

    lanes, cands = draft_tree.seed_lanes(topk_logprobs((batch,)), tokens((batch, k)))
    record = draft_tree.CandidateRecord.empty(batch, k, steps).write(0, cands)
    for step in range(1, steps):
        lanes, cands = draft_tree.expand_lanes(lanes, topk_logprobs((batch, k)), tokens((batch, k, k)), step,
                                               num_steps=steps)
        record = record.write(step, cands)
    return np.asarray(draft_tree.select_tree(record, jnp.zeros((batch,), jnp.int32), t).parents)


def random_path(rng, parents):
    batch, t = parents.shape
    path = np.full((batch, t), -1, np.int32)
    acc = np.zeros(batch, np.int32)
    for b in range(batch):
        cur, nodes = 0, [0]
        while True:
            kids = np.nonzero(parents[b] == cur)[0]
            if len(kids) == 0:
                break
            cur = int(kids[0])
            nodes.append(cur)
        path[b, : len(nodes)] = nodes
        acc[b] = len(nodes)
    return path, acc


def inputs(key, batch, t, d, dtype, pool_rows=None):
    ks = jax.random.split(key, 8)
    pool_rows = pool_rows or batch + 1
    n = lambda k, s: jax.random.normal(k, s, jnp.float32)
    x = dict(q=n(ks[0], (batch, t, d["H"], d["DK"])).astype(dtype),
             k=n(ks[1], (batch, t, d["H"], d["DK"])).astype(dtype),
             v=n(ks[2], (batch, t, d["HV"], d["DV"])).astype(dtype),
             a=n(ks[3], (batch, t, d["HV"])).astype(dtype),
             b=n(ks[4], (batch, t, d["HV"])).astype(dtype),
             A_log=0.5 * n(ks[5], (d["HV"],)), dt_bias=n(ks[6], (d["HV"],)),
             state_pool=0.1 * n(ks[7], (pool_rows, d["HV"], d["DK"], d["DV"])),
             state_slots=jnp.asarray(np.random.default_rng(batch).permutation(pool_rows)[:batch], jnp.int32))
    return x


def args_of(x):
    return [x[n] for n in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_pool", "state_slots")]


def width(d):
    return GdnPayloadLayout(d["H"], d["HV"], d["DK"], d["DV"]).width


def dims_of(d, bsz, t):
    return GdnDims(bsz, t, d["H"], d["HV"], d["DK"], d["DV"], bsz + 1)


# ----------------------------------------------------------------------------------------------
# Conformance
# ----------------------------------------------------------------------------------------------

CONFORMANCE_LINES: list[str] = []


def conformance(quick: bool, only=None) -> bool:
    """Every case (`only`: their indices) compiled against the references."""
    ok = True
    tol = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
    cases = [(SMALL, 2, 14, jnp.float32), (QWEN, 2, 8, jnp.float32), (QWEN, 2, 16, jnp.bfloat16),
             (QWEN, 3, 33, jnp.float32), (QWEN, 2, 64, jnp.bfloat16)]
    if quick:
        cases = cases[:2]
    if only is not None:
        cases = [cases[i] for i in only]
    rng = np.random.default_rng(0)

    def check(name, cond, detail=""):
        nonlocal ok
        ok &= bool(cond)
        line = f"{'PASS' if cond else 'FAIL'} {name} {detail}".strip()
        CONFORMANCE_LINES.append(f"- {line}")
        log(f"  {line}")

    for i, case in enumerate(cases):
        try:
            conformance_case(i, *case, tol[case[3]], rng, check)
        except Exception as e:  # report and go on: one broken lowering must not hide the rest
            check(f"case {i} raised", False, repr(e)[:2000])
    return ok


def conformance_case(i, d, bsz, t, dtype, tol, rng, check):
    """One conformance case: every GDN kernel compiled vs the fp32 references."""
    x = inputs(jax.random.key(100 + i), bsz, t, d, dtype)
    args = args_of(x)
    parents_np = random_tree(rng, bsz, t)
    if i == 0:
        # Request 0 nests 3 branch points (0 -> 1 -> 2 -> 3, each with a later child).
        parents_np[0] = [-1, 0, 1, 2, 2, 1, 0] + list(range(6, t - 1))
    parents = jnp.asarray(parents_np)
    nodes = jnp.full((bsz, t, d["HV"], d["DK"], d["DV"]), jnp.nan, jnp.float32)
    payload = jnp.full((bsz, t, width(d)), jnp.nan, dtype)
    tag = f"dims={d} B={bsz} T={t} {jnp.dtype(dtype).name}"
    log(f"case {tag}")
    CONFORMANCE_LINES.append(f"- case {tag}")
    with jax.default_matmul_precision("highest"):
        ref = gdn_tree_verify(*args, parents, nodes, store="every_node", backend="reference")
        ref_chain = gdn_tree_verify(*args, None, nodes, store="every_node", backend="reference")
    pool_bits = np.asarray(x["state_pool"]).view(np.uint32).copy()
    br = np.asarray(branch_points(parents))
    ref_states = np.asarray(ref.node_states)
    launch = pick_launch(dims_of(d, bsz, t), None)
    st = gdn_tree_verify(*args, parents, nodes, store="every_node", backend="pallas")
    e1, e2 = rel_err(st.out, ref.out), rel_err(st.node_states, ref.node_states)
    check("staged tree out/states", max(e1, e2) < tol, f"{e1:.2e} {e2:.2e} launch {launch}")
    rp = gdn_tree_verify(*args, parents, nodes, store="branch_points", payload=payload, backend="pallas")
    ws = np.asarray(rp.node_states)
    e3 = rel_err(rp.out, ref.out)
    e4 = rel_err(ws[br], ref_states[br]) if br.any() else 0.0
    check("replay tree out / branch-point rows", max(e3, e4) < tol,
          f"{e3:.2e} {e4:.2e} (branch points {int(br.sum())})")
    check("replay workspace untouched (NaN) off the branch points", np.isnan(ws[~br]).all())
    same = np.array_equal(ws[br].view(np.uint32), np.asarray(st.node_states)[br].view(np.uint32))
    line = f"INFO branch-point rows bitwise == staged states: {same}"
    CONFORMANCE_LINES.append(f"- {line}")
    log(f"  {line}")
    check("replay payload == [k|v|a|b]", np.array_equal(
        np.asarray(rp.payload.astype(jnp.float32)),
        np.asarray(pack_payload(*args[1:5]).astype(jnp.float32))))
    check("pool bitwise untouched by verify", np.array_equal(np.asarray(args[7]).view(np.uint32), pool_bits))
    ch = gdn_tree_verify(*args, None, nodes, store="every_node", backend="pallas")
    e5 = rel_err(ch.out, ref_chain.out)
    check("chain kernel vs reference", e5 < tol, f"{e5:.2e}")
    if t <= MAX_CHUNKED_NODES:
        out, pl_ = gdn_chunked_verify(*args, ancestor_mask(parents), payload, backend="pallas")
        e6 = rel_err(out, ref.out)
        check("chunked vs recurrent reference", e6 < tol, f"{e6:.2e}")
        out3, _ = gdn_chunked_verify(*args, ancestor_mask(parents), payload, backend="pallas", fp32_dots="tf32x3")
        e7 = rel_err(out3, ref.out)
        check("chunked (tf32x3 products) vs recurrent reference", e7 < tol, f"{e7:.2e}")
        check("chunked payload == [k|v|a|b]", np.array_equal(
            np.asarray(pl_.astype(jnp.float32)), np.asarray(pack_payload(*args[1:5]).astype(jnp.float32))))
        for label, keys in (("chunked two-pass", False), ("chunked two-pass, apply reads keys", True)):
            try:  # a form that fails to compile must not hide the other checks of the case
                for dots in ("ieee", "tf32x3"):
                    out2, pl2 = gdn_chunked_verify(*args, ancestor_mask(parents), jnp.full_like(payload, jnp.nan),
                                                   backend="pallas", fp32_dots=dots, two_pass=True,
                                                   apply_reads_keys=keys)
                    e8 = rel_err(out2, ref.out)
                    check(f"{label} ({dots} products) vs recurrent reference", e8 < tol, f"{e8:.2e}")
                check(f"{label}: payload == [k|v|a|b]", np.array_equal(
                    np.asarray(pl2.astype(jnp.float32)), np.asarray(pack_payload(*args[1:5]).astype(jnp.float32))))
            except Exception as e:  # noqa: BLE001
                check(f"{label} raised", False, repr(e)[:2000])
        if args[1].dtype == jnp.bfloat16:  # q k^T, k k^T from the bf16 rows as loaded, every form
            for label, form in (("fused", dict(two_pass=False)), ("two-pass", dict(two_pass=True, apply_reads_keys=False)),
                                ("two-pass, apply reads keys", dict(two_pass=True, apply_reads_keys=True))):
                try:
                    out4, pl4 = gdn_chunked_verify(*args, ancestor_mask(parents), jnp.full_like(payload, jnp.nan),
                                                   backend="pallas", fp32_dots="tf32x3", input_dtype_grams=True,
                                                   **form)
                    e9 = rel_err(out4, ref.out)
                    check(f"chunked {label}, input-dtype grams (tf32x3) vs recurrent reference", e9 < tol, f"{e9:.2e}")
                    check(f"chunked {label}, input-dtype grams: payload == [k|v|a|b]", np.array_equal(
                        np.asarray(pl4.astype(jnp.float32)),
                        np.asarray(pack_payload(*args[1:5]).astype(jnp.float32))))
                except Exception as e:  # noqa: BLE001
                    check(f"chunked {label}, input-dtype grams raised", False, repr(e)[:2000])
    # ReplaySSM commit along a random accepted path equals the state at the last accepted node.
    path_np, acc_np = random_path(rng, np.asarray(parents))
    acc_np[0] = 0 if bsz > 2 else acc_np[0]  # a padded request commits nothing
    path, acc = jnp.asarray(path_np), jnp.asarray(acc_np)
    packed = pack_path_rows(rp.payload, path, acc)
    new_pool = gdn_replay_commit(x["state_pool"], x["state_slots"], packed, acc, x["A_log"],
                                 x["dt_bias"], num_k_heads=d["H"], head_k_dim=d["DK"], backend="pallas")
    errs, untouched = [], True
    slots = np.asarray(x["state_slots"])
    for b in range(bsz):
        if acc_np[b] == 0:
            untouched &= np.array_equal(np.asarray(new_pool[slots[b]]), np.asarray(x["state_pool"][slots[b]]))
        else:
            errs.append(rel_err(new_pool[slots[b]], ref_states[b, path_np[b, acc_np[b] - 1]]))
    check("replay commit == state at last accepted node", max(errs) < tol and untouched,
          f"{max(errs):.2e}")


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------

def time_step(step, carry):
    """Device seconds per step: chains of INNER and 3 x INNER `step(carry) -> carry` calls in one jit
    (donated), the difference per call (`timing.time_step`)."""
    return timing.time_step(step, carry, inner=INNER, reps=7)


def bench_case(bsz, t, rng, bw, launch=None, sweep=False, chunked_launch=None, eagle_trees=True):
    """Times one (B, T): the chain and tree kernels.

    Tree timings are keyed `tree_replay_rec` / `tree_staged` (the bench's random trees) and
    `eagle_replay_rec` (drafter-shaped trees, ReplaySSM only); `launch_tree` is the (block_v, warps,
    stages) they ran with.
    """
    d = QWEN
    dtype = jnp.bfloat16
    x = inputs(jax.random.key(bsz * 1000 + t), bsz, t, d, dtype)
    args = args_of(x)
    parents = jnp.asarray(random_tree(rng, bsz, t))
    eagle = jnp.asarray(eagle_tree(rng, bsz, t)) if eagle_trees else None
    # The tree's kernel-facing forms are built once per step and shared by every layer.
    tree = jax.block_until_ready(GdnTree.from_parents(parents))
    eagle_tree_ = jax.block_until_ready(GdnTree.from_parents(eagle)) if eagle_trees else None
    knobs = tuple(launch) if launch else ()
    # launch = (block_v, warps, stages[, value_major]) from --sweep-recurrent ("32:4:1:v").
    # No launch: the library's default config (value-major tiles); a swept launch is key-major unless it
    # ends in "v".
    kcfg = GdnKernelConfig(*knobs[:3], value_major=len(knobs) > 3 and bool(knobs[3])) if knobs else GdnKernelConfig()
    # A chunked launch (block_v, warps, stages[, factor_warps]): the 4th sets the two-pass factor kernel.
    ccfg = GdnKernelConfig(*chunked_launch[:3]) if chunked_launch else GdnKernelConfig()
    fwarps = chunked_launch[3] if chunked_launch and len(chunked_launch) > 3 else None
    nodes = jnp.zeros((bsz, t, d["HV"], d["DK"], d["DV"]), jnp.float32)
    payload = jnp.zeros((bsz, t, width(d)), dtype)
    out0 = jnp.zeros(x["v"].shape, dtype)
    res = {}

    chain_mask = ancestor_mask(chain_parents(bsz, t))

    def verify_step(is_tree, store, chunked=False, drafter_tree=False, fp32_dots="ieee", two_pass=False,
                    keys=False, grams=False):
        # two_pass / keys / grams = None: the kernel's own default for this shape and dtype.
        step_tree = eagle_tree_ if drafter_tree else tree

        def step(c):
            ns, pl_, _ = c
            if chunked:
                mask = tree.ancestor_mask if is_tree else chain_mask
                o, pl_ = gdn_chunked_verify(*args, mask, pl_, config=ccfg, fp32_dots=fp32_dots, two_pass=two_pass,
                                            factor_warps=fwarps if two_pass else None, apply_reads_keys=keys,
                                            input_dtype_grams=grams)
                return ns, pl_, o
            r = gdn_tree_verify(*args, step_tree.parents if is_tree else None, ns, store=store,
                                payload=pl_ if store == "branch_points" else None,
                                branch=step_tree.branch if is_tree and store == "branch_points" else None,
                                config=kcfg)
            return r.node_states, (r.payload if r.payload is not None else pl_), r.out
        return step

    carry = (nodes, payload, out0)
    kernels = [("chain_replay", False, "branch_points"), ("tree_replay_rec", True, "branch_points")]
    if eagle_trees:
        kernels += [("eagle_replay_rec", True, "branch_points")]
    if not sweep and not LEAN:
        kernels += [("chain_staged", False, "every_node"), ("tree_staged", True, "every_node")]
    for name, is_tree, store in kernels:
        if sweep == "chunked":
            break
        t0 = time.time()
        step = verify_step(is_tree, store, drafter_tree=name.startswith("eagle"))
        res[name], carry = time_step(step, carry)
        log(f"    {name} {res[name]*1e6:.1f}us (compile+time {time.time() - t0:.1f}s)")
    if sweep != "chunked":
        # The chain and the tree kernels share one launch (no tree-only launch knobs).
        # A trailing "v" marks value-major state tiles.
        launch_used = pick_launch(dims_of(d, bsz, t), kcfg) + (("v",) if uses_value_major(dims_of(d, bsz, t), kcfg) else ())
        res["launch_chain"] = res["launch_tree"] = launch_used
    if t <= MAX_CHUNKED_NODES and sweep is not True:  # a recurrent launch sweep leaves the chunked form alone
        # (name, tree?, fp32 products, two-pass?, apply reads keys?, input-dtype grams?)
        forms = [("tree_chunked", True, "ieee", False, False, False)] if CHUNKED_IEEE else []
        if fwarps is None and FUSED_CHUNKED and not LEAN:  # a swept launch naming factor warps: two-pass only
            forms += [("tree_chunked_tf32x3", True, "tf32x3", False, False, False),
                      ("chain_chunked_tf32x3", False, "tf32x3", False, False, False)]
        if not LEAN:
            forms += [("tree_chunked2_tf32x3", True, "tf32x3", True, False, False),
                      ("chain_chunked2_tf32x3", False, "tf32x3", True, False, False),
                      ("tree_chunked3_tf32x3", True, "tf32x3", True, True, False),
                      ("chain_chunked3_tf32x3", False, "tf32x3", True, True, False)]
        # The kernel's default form for bf16 rows (two-pass by grid and rows, its default variant, q k^T
        # and k k^T from the bf16 rows): what the layer's chunked route runs.
        forms += [("tree_grams_tf32x3", True, "tf32x3", None, None, None),
                  ("chain_grams_tf32x3", False, "tf32x3", None, None, None)]
        outs = {}  # each timed form's output (the carry's last step), for the agreement checks below
        for name, is_tree, dots, two, keys, grams in forms:
            try:  # one form that cannot launch (e.g. shared memory) leaves the row's other columns
                res[name], carry = time_step(verify_step(is_tree, None, chunked=True, fp32_dots=dots, two_pass=two,
                                                         keys=keys, grams=grams), carry)
                outs[name] = jnp.copy(carry[2])  # the next timed form donates the carry
            except Exception as e:  # noqa: BLE001
                log(f"    {name} at B={bsz} T={t} raised {e!r}"[:600])
        # Compiled agreement, from the timed outputs (same inputs, so no extra run): the two two-pass
        # variants, and the default one with and without input-dtype grams. bf16 outputs round at about
        # 4e-3, so above 1e-2 is a failure.
        base_tree = default_form_without_grams(bsz, t)
        for key, new, old, what in (("keys_vs_two_pass", "tree_chunked3_tf32x3", "tree_chunked2_tf32x3",
                                     "two-pass (apply reads keys) vs two-pass"),
                                    ("grams_vs_default", "tree_grams_tf32x3", base_tree,
                                     "input-dtype grams vs without")):
            if new in outs and old in outs:
                res[key] = float(rel_err(outs[new], outs[old]))
                log(f"    {'PASS' if res[key] < 1e-2 else 'FAIL'} {what} at B={bsz} T={t}: rel err {res[key]:.2e}")
        # The two-pass form's first kernel alone (tree masks): the rest of its time is the apply kernel's.
        dims = gdn_dims(*args)

        def factor_step(c, p_only=False):
            ns, pl_, o = c
            _, _, pl_ = two_pass_factor(args[0], args[1], args[3], args[4], args[5], args[6], tree.ancestor_mask, pl_,
                                        dims=dims, chunk=chunk_rows(t),
                                        layout=GdnPayloadLayout(d["H"], d["HV"], d["DK"], d["DV"]),
                                        use_qk_l2norm=True, scale=default_scale(d["DK"]),
                                        precision=FP32_DOTS["tf32x3"], interpret=False,
                                        factor_warps=TWO_PASS_FACTOR_WARPS if fwarps is None else fwarps,
                                        p_only=p_only)
            return ns, pl_, o
        for key, p_only in () if LEAN else (("tree_factor_tf32x3", False), ("tree_p_factor_tf32x3", True)):
            try:
                res[key], carry = time_step(functools.partial(factor_step, p_only=p_only), carry)
            except Exception as e:  # noqa: BLE001
                log(f"    two-pass factor alone (p_only={p_only}) at B={bsz} T={t} raised {e!r}"[:600])
    br = np.asarray(branch_points(parents))
    res["branch_frac"] = float(br.sum()) / (bsz * t)
    if eagle_trees:
        res["eagle_branch_frac"] = float(np.asarray(branch_points(eagle)).sum()) / (bsz * t)
    state_bytes = bsz * d["HV"] * d["DK"] * d["DV"] * 4
    res["floor_rw"] = 2 * state_bytes / bw
    res["floor_r"] = state_bytes / bw
    if sweep or SKIP_COMMIT:
        return res
    # ReplaySSM commit along the greedy-first path (row move + replay).
    path_np, acc_np = random_path(rng, np.asarray(parents))
    path, acc = jnp.asarray(path_np), jnp.asarray(acc_np)
    cfg = GdnLayerConfig(d["H"], d["HV"], d["DK"], d["DV"], kernel=GdnKernelConfig(*knobs[:3]))

    def commit_step(c):
        pool, pl_ = c
        return gdn_commit_replay(cfg, pool, x["state_slots"], pl_, path, acc, x["A_log"], x["dt_bias"])

    res["replay_commit"], _ = time_step(commit_step, (x["state_pool"], carry[1]))
    res["accept_mean"] = float(acc_np.mean())
    return res


def parse_launch(text):
    """"block_v:warps:stages[:v],..." -> tuples; a trailing "v" = value-major state tiles (1)."""
    return [tuple(1 if v == "v" else int(v) for v in item.split(":")) for item in text.split(",") if item]


def best_ratio(r):
    """Fastest tree form over fastest chain form (the recurrent and, T <= MAX_CHUNKED_NODES, chunked kernels)."""
    trees = [r[k] for k in ("tree_replay_rec", "tree_chunked_tf32x3", "tree_chunked2_tf32x3", "tree_chunked3_tf32x3",
                            "tree_grams_tf32x3") if k in r]
    chains = [r[k] for k in ("chain_replay", "chain_chunked_tf32x3", "chain_chunked2_tf32x3", "chain_chunked3_tf32x3",
                             "chain_grams_tf32x3") if k in r]
    return f"{min(trees) / min(chains):.2f}x" if trees and chains else "-"


def default_route(bsz, t, r):
    """What the layer's default config runs for this (B, T) (`GdnLayerConfig.chunked_route`,
    `chain_runs_chunked`): "<tree form> / <chain form>, <their time ratio>" ("-" if either form was
    not timed)."""
    d = QWEN
    cfg = GdnLayerConfig(d["H"], d["HV"], d["DK"], d["DV"])
    lo, hi, padded_min = cfg.chunked_route(bsz, jnp.bfloat16)
    tree_kernel = verify_kernel_for(cfg.mode, t, True, cfg.chunked_tree_verify, lo, max_nodes=hi,
                                    padded_min_nodes=padded_min)
    # The layer's chunked route runs the kernel's defaults for bf16 rows (the "grams" columns).
    tree_key = "tree_grams_tf32x3" if tree_kernel == "chunked" else "tree_replay_rec"
    chain_key = "chain_grams_tf32x3" if cfg.chain_runs_chunked(t, bsz, jnp.bfloat16) else "chain_replay"
    name = {"tree_replay_rec": "recurrent", "tree_grams_tf32x3": "chunked", "chain_replay": "recurrent",
            "chain_grams_tf32x3": "chunked"}
    ratio = f"{r[tree_key] / r[chain_key]:.2f}x" if tree_key in r and chain_key in r else "-"
    return f"{name[tree_key]} / {name[chain_key]}, {ratio}"


def default_form_without_grams(bsz, t):
    """The timed tree form the kernel's default for (B, T) runs, less the input-dtype grams."""
    if not default_two_pass(bsz, QWEN["HV"], chunk_rows(t)):
        return "tree_chunked_tf32x3"
    return "tree_chunked3_tf32x3" if default_apply_reads_keys(chunk_rows(t)) else "tree_chunked2_tf32x3"


def grams_ratio(bsz, t, r):
    """The kernel's default tree form (input-dtype grams) over the same without them, and their
    outputs' agreement (PASS below 1e-2)."""
    ratio = _ratio(r, "tree_grams_tf32x3", default_form_without_grams(bsz, t))
    if "grams_vs_default" in r:
        ratio += f", {'PASS' if r['grams_vs_default'] < 1e-2 else 'FAIL'} {r['grams_vs_default']:.1e}"
    return ratio


def _us(r, key):
    return f"{r[key]*1e6:.1f}" if key in r else "-"


def _ratio(r, num, den):
    return f"{r[num] / r[den]:.2f}x" if num in r and den in r else "-"


def bench(quick: bool, budget_s: float, use_fla: bool, configs, sweep_rec, sweep_chunked, sweep_at,
          progress=None, eagle_trees=True):
    """Times every config, then the sweeps; returns the markdown tables. `progress(tables)` (if given)
    gets the tables so far after each measured config, so a run cut short still leaves its rows."""
    if configs is None:
        configs = [(1, 16), (32, 16)] if quick else DEFAULT_CONFIGS
    if not configs and not (sweep_at and (sweep_rec or sweep_chunked)) and not use_fla:
        return "\n(no timing requested)"
    bw = measure_copy_bandwidth()
    log(f"device copy bandwidth (read+write): {bw / 1e12:.2f} TB/s")
    rng = np.random.default_rng(1)
    rows, sweep, fla = [], [], {}
    show = lambda: render(rows, sweep, fla, bw)  # noqa: E731
    for bsz, t in configs:
        if time.time() - _T0 > budget_s:
            log(f"budget reached; skipping B={bsz} T={t}")
            continue
        try:
            r = bench_case(bsz, t, rng, bw, eagle_trees=eagle_trees)
        except Exception as e:
            log(f"B={bsz} T={t} raised {e!r}"[:3000])
            continue
        rows.append((bsz, t, r))
        log(f"B={bsz:3d} T={t:3d} chain_replay {_us(r, 'chain_replay')}us tree_replay(rec) "
            f"{_us(r, 'tree_replay_rec')}us ({r['tree_replay_rec'] / r['chain_replay']:.2f}x) "
            f"chunked tf32x3 tree {_us(r, 'tree_chunked_tf32x3')}us chain {_us(r, 'chain_chunked_tf32x3')}us "
            f"two-pass tree {_us(r, 'tree_chunked2_tf32x3')}us chain {_us(r, 'chain_chunked2_tf32x3')}us "
            f"two-pass/keys tree {_us(r, 'tree_chunked3_tf32x3')}us chain {_us(r, 'chain_chunked3_tf32x3')}us "
            f"default form (grams) tree {_us(r, 'tree_grams_tf32x3')}us ({grams_ratio(bsz, t, r)}) "
            f"chain {_us(r, 'chain_grams_tf32x3')}us "
            f"(ieee tree {_us(r, 'tree_chunked')}us) best tree/best chain {best_ratio(r)} chain_staged {_us(r, 'chain_staged')}us tree_staged "
            f"{_us(r, 'tree_staged')}us commit {_us(r, 'replay_commit')}us floor_rw {_us(r, 'floor_rw')}us"
            + (f" eagle_tree {_us(r, 'eagle_replay_rec')}us "
               f"({r['eagle_replay_rec'] / r['chain_replay']:.2f}x)" if eagle_trees else ""))
        if progress:
            progress(show())
    fla.update(fla_reference(bw) if use_fla else {})
    for bsz, t in sweep_at:
        for kind, launches in (("recurrent", sweep_rec), ("chunked", sweep_chunked if t <= MAX_CHUNKED_NODES else [])):
            for launch in launches:
                if time.time() - _T0 > budget_s + 40:
                    log(f"budget reached; skipping the {kind} sweep at B={bsz} T={t} from launch {launch}")
                    break
                try:
                    if kind == "recurrent":
                        r = bench_case(bsz, t, rng, bw, launch=launch, sweep=True, eagle_trees=eagle_trees)
                    else:
                        r = bench_case(bsz, t, rng, bw, chunked_launch=launch, sweep="chunked",
                                       eagle_trees=False)
                except Exception as e:
                    log(f"sweep {kind} B={bsz} T={t} launch={launch} raised {e!r}"[:2000])
                    continue
                sweep.append((bsz, t, kind, launch, r))
                log(f"sweep {kind} B={bsz} T={t} (block_v, warps, stages)={launch}: "
                    + " ".join(f"{k} {v*1e6:.1f}us" for k, v in r.items() if isinstance(v, float) and k.startswith(("chain", "tree"))))
                if progress:
                    progress(show())
    return show()


def render(rows, sweep, fla, bw):
    """The timing tables as markdown."""
    d = QWEN
    state_node = d["HV"] * d["DK"] * d["DV"] * 4
    payload_node = width(d) * 2

    md = []
    md.append("\n### GDN tree verify, Qwen3-Next dims (H=16, HV=32, dk=dv=128), bf16 in, fp32 state")
    md.append(f"copy bandwidth {bw/1e12:.2f} TB/s; times are medians (us); ratios vs our chain verify of the "
              "same run; launch = (block_v, warps, stages) of the tree and chain kernels. ReplaySSM stores "
              "every branch point's state to the workspace. Tree columns use the bench's random trees "
              "(comparable with earlier runs); the drafter-tree columns use `select_tree` trees (K-wide "
              "S-step rounds, DFS numbered); branch = share of nodes that are branch points.")
    md.append("| B | T | launch | chain (ReplaySSM) | tree ReplaySSM recurrent | tree/chain "
              "| branch nodes | drafter tree ReplaySSM | drafter tree/chain | drafter branch "
              "| chunked tree (tf32x3) | chunked chain (tf32x3) | two-pass chunked tree (tf32x3) "
              "| two-pass chunked chain (tf32x3) | two-pass factor kernel alone (tree) "
              "| two-pass, apply reads keys: tree | same: chain "
              "| kernel's default form (input-dtype grams): tree (vs without) | same: chain | best tree / best chain "
              "| layer default tree / chain form, ratio | staged chain | staged tree | staged tree/chain "
              "| floor r+w | chain/floor_r | commit (move+replay) | staged B/node | ReplaySSM B/node (recurrent) |")
    md.append("|---" * 29 + "|")
    for bsz, t, r in rows:
        replay_b = r["branch_frac"] * state_node + payload_node
        tree_rec = r["tree_replay_rec"]
        if "eagle_replay_rec" in r:
            eagle = (f"| {_us(r, 'eagle_replay_rec')} | {r['eagle_replay_rec'] / r['chain_replay']:.2f}x "
                     f"| {r['eagle_branch_frac']:.0%} ")
        else:
            eagle = "| - | - | - "
        md.append(
            f"| {bsz} | {t} | {r['launch_tree']} | {_us(r, 'chain_replay')} "
            f"| {tree_rec*1e6:.1f} | {tree_rec / r['chain_replay']:.2f}x "
            f"| {r['branch_frac']:.0%} " + eagle + f"| {_us(r, 'tree_chunked_tf32x3')} "
            f"| {_us(r, 'chain_chunked_tf32x3')} | {_us(r, 'tree_chunked2_tf32x3')} "
            f"| {_us(r, 'chain_chunked2_tf32x3')} | {_us(r, 'tree_factor_tf32x3')} "
            f"| {_us(r, 'tree_chunked3_tf32x3')} (its factor kernel alone {_us(r, 'tree_p_factor_tf32x3')})"
            + (f" (vs two-pass: rel err {r['keys_vs_two_pass']:.1e})" if "keys_vs_two_pass" in r else "")
            + f" | {_us(r, 'chain_chunked3_tf32x3')} | {_us(r, 'tree_grams_tf32x3')} ({grams_ratio(bsz, t, r)}) "
            f"| {_us(r, 'chain_grams_tf32x3')} "
            f"| {best_ratio(r)} "
            f"| {default_route(bsz, t, r)} "
            f"| {_us(r, 'chain_staged')} | {_us(r, 'tree_staged')} "
            f"| {_ratio(r, 'tree_staged', 'chain_staged')} | {_us(r, 'floor_rw')} "
            f"| {r['chain_replay'] / r['floor_r']:.1f}x | {_us(r, 'replay_commit')} (acc {r.get('accept_mean', float('nan')):.1f}) "
            f"| {state_node/1024:.0f} KiB | {replay_b/1024:.1f} KiB |")
    if sweep:
        md.append("\n| B | T | kernel | (block_v, warps, stages[, factor warps]) | chain (us) | tree recurrent (us) "
                  "| tree/chain | drafter tree (us) | drafter tree/chain | chunked tree tf32x3 (us) "
                  "| chunked chain tf32x3 (us) | two-pass tree tf32x3 (us) | two-pass chain tf32x3 (us) "
                  "| two-pass factor alone (us) | two-pass, apply reads keys: tree | chain "
                  "| kernel's default form (input-dtype grams): tree | chain |")
        md.append("|---" * 18 + "|")
        nan = float("nan")
        for bsz, t, kind, launch, r in sweep:
            tree = r.get("tree_replay_rec", nan)
            eagle = r.get("eagle_replay_rec", nan)
            chain = r.get("chain_replay", nan)
            md.append(f"| {bsz} | {t} | {kind} | {launch} | {chain*1e6:.1f} "
                      f"| {tree*1e6:.1f} | {tree / chain:.2f}x | {eagle*1e6:.1f} | {eagle / chain:.2f}x "
                      f"| {r.get('tree_chunked_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('chain_chunked_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('tree_chunked2_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('chain_chunked2_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('tree_factor_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('tree_chunked3_tf32x3', nan)*1e6:.1f} | {r.get('chain_chunked3_tf32x3', nan)*1e6:.1f} "
                      f"| {r.get('tree_grams_tf32x3', nan)*1e6:.1f} | {r.get('chain_grams_tf32x3', nan)*1e6:.1f} |")
    if fla:
        md.append("\n| fla fused_recurrent chain, T=16 | us |")
        md.append("|---|---|")
        for k, v in fla.items():
            md.append(f"| {k} | {v*1e6:.1f} |")
    return "\n".join(md)


def fla_reference(bw):
    """flash-linear-attention's fused_recurrent GDN chain at T=16 (torch, bf16), if importable."""
    try:
        import torch
        import triton
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception as e:  # the wheel is optional
        log(f"fla not available: {e!r}")
        return {}
    res = {}
    d = QWEN
    for bsz in (1, 32):
        t = 16
        dev = "cuda"
        q = torch.randn(bsz, t, d["H"], d["DK"], device=dev, dtype=torch.bfloat16)
        k = torch.randn(bsz, t, d["H"], d["DK"], device=dev, dtype=torch.bfloat16)
        v = torch.randn(bsz, t, d["HV"], d["DV"], device=dev, dtype=torch.bfloat16)
        a = torch.randn(bsz, t, d["HV"], device=dev, dtype=torch.bfloat16)
        b = torch.randn(bsz, t, d["HV"], device=dev, dtype=torch.bfloat16)
        A_log = 0.5 * torch.randn(d["HV"], device=dev)
        dt_bias = torch.randn(d["HV"], device=dev)
        h0 = 0.1 * torch.randn(bsz, d["HV"], d["DK"], d["DV"], device=dev)
        fn = lambda: fused_recurrent_gated_delta_rule(
            q=q, k=k, v=v, g=a, beta=b, scale=d["DK"] ** -0.5, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
            use_beta_sigmoid_in_kernel=True)
        try:
            ms = triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
        except Exception as e:
            log(f"fla call failed: {e!r}")
            return res
        res[f"B={bsz}"] = ms * 1e-3
        log(f"fla fused_recurrent chain B={bsz} T=16: {ms*1e3:.1f} us")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="two conformance cases; timing at 1x16 and 32x16 unless --configs is given")
    p.add_argument("--no-fla", action="store_true", help="skip the flash-linear-attention reference")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new timing configs after this")
    p.add_argument("--skip-conformance", action="store_true")
    p.add_argument("--conformance-cases", default=None, help="comma list of case indices to run (default all)")
    p.add_argument("--configs", default=None,
                   help="BxT timing configs (default " + ",".join(f"{b}x{t}" for b, t in DEFAULT_CONFIGS)
                   + "; --quick: 1x16,32x16); an explicit list wins over --quick")
    p.add_argument("--no-drafter-trees", action="store_true",
                   help="time only the bench's random trees, not also drafter-shaped (select_tree) trees")
    p.add_argument("--sweep-recurrent", default="",
                   help="block_v:warps:stages[:v],... for the recurrent kernels (v: value-major state tiles)")
    p.add_argument("--sweep-chunked", default="", help="block_v:warps:stages[:factor_warps],... for the chunked forms (two-pass: "
                   "the apply kernel's launch and the factor kernel's warps)")
    p.add_argument("--sweep-at", default="32x16", help="BxT configs the sweeps run at")
    p.add_argument("--chunked-ieee", action="store_true", help="also time the chunked form with IEEE products")
    p.add_argument("--skip-commit", action="store_true", help="do not time the ReplaySSM commit")
    p.add_argument("--no-fused-chunked", action="store_true",
                   help="time the chunked form only as two-pass (the fused kernel loses 2-3x past 16 nodes)")
    p.add_argument("--lean", action="store_true", help="time only what the layer's route chooses between (the "
                   "recurrent kernels and the default two-pass variant), no staged kernels or factor-alone runs")
    p.add_argument("--inner", type=int, default=INNER, help="kernel calls in the shorter timed chain (the longer has 3x)")
    p.add_argument("--markdown", default=None, help="also write the dated section to this file (e.g. $OUT/gdn.md)")
    p.add_argument("--results", default=str(Path(__file__).resolve().parent / "RESULTS.md"),
                   help="append the dated section here (benchmarks/RESULTS.md by default)")
    p.add_argument("--no-results", action="store_true", help="do not append to the results file")
    a = p.parse_args(argv)
    globals()["INNER"] = a.inner
    globals()["SKIP_COMMIT"] = a.skip_commit
    globals()["FUSED_CHUNKED"] = not a.no_fused_chunked
    globals()["CHUNKED_IEEE"] = a.chunked_ieee
    globals()["LEAN"] = a.lean
    configs = None if a.configs is None else parse_shapes(a.configs)
    log(f"jax {jax.__version__} devices {jax.devices()}")
    ok = True
    if not a.skip_conformance:
        only = None if a.conformance_cases is None else [int(i) for i in a.conformance_cases.split(",")]
        ok = conformance(a.quick, only)
        log(f"conformance: {'PASS' if ok else 'FAIL'}")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python3 benchmarks/bench_gdn.py " + " ".join(argv if argv is not None else sys.argv[1:])

    def section(tables, note=""):
        return (f"\n## GDN tree verify and commits (bench_gdn.py), {stamp}\n\n"
                f"jax {jax.__version__}, {jax.devices()[0].device_kind}; command: `{cmd.strip()}`\n\n"
                f"conformance: {'skipped' if a.skip_conformance else 'PASS' if ok else 'FAIL'}\n" + "\n".join(CONFORMANCE_LINES) + "\n" + tables
                + "\n" + note)

    def write_markdown(md):
        if a.markdown:
            with open(a.markdown, "w") as fh:
                fh.write(md)

    # The section so far is rewritten after conformance and after every timed config, so a run
    # stopped by a time limit still leaves what it measured.
    write_markdown(section("", "\n(timing not reached yet)\n"))
    tables = bench(a.quick, a.budget_s, not a.no_fla, configs, parse_launch(a.sweep_recurrent),
                   parse_launch(a.sweep_chunked), parse_shapes(a.sweep_at),
                   progress=lambda t: write_markdown(section(t, "\n(run still in progress)\n")),
                   eagle_trees=not a.no_drafter_trees)
    md = section(tables)
    print(md, flush=True)
    write_markdown(md)
    if not a.no_results:
        with open(a.results, "a") as fh:  # one append, so concurrent writers do not clobber each other
            fh.write(md)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
