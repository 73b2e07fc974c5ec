"""GPU conformance and timing of the GQA cascade tree attention (prefix decode + tree window).

Run on the GPU machine from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_cascade.py [--quick] [--markdown FILE]
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_cascade.py --variants [--budget-s 130]

`--variants` runs the launch-variant sweep of benchmarks/cascade_variants.py instead (prefix
pages_per_step / block_rows / warps / stages, window block_rows / warps; per-variant compiled
conformance first). `--variants --smoke` runs that sweep on tiny shapes in interpret mode (CPU, no
results appended unless --results is given).

1. Conformance: the COMPILED Pallas kernels against the fp32 references on random, poisoned inputs
   (NaN in every slot no row may see, NaN-filled outputs): prefix decode (GQA groups 1/4, page 16/64,
   ragged lengths with P = 0 and P < R, split and unsplit, bf16 and FP8), the window kernel (bf16,
   FP8, MLA latent layout), verify/lanes through the full cascade against one dense fp32 attention,
   and the sliding-window lane variant.
2. Timings (device time, `timing.traced_time`: chains of 60 calls inside one jit, each fed the
   previous call's output, traced with the profiler after an idle second, the span from the first
   kernel's start to the last one's end per call, as the matmul ceiling is measured; with
   `--host-clock` the cascade also by the host-clock chains of `timing.chained_time`; per call from
   Python unless `--lean`;
   Hq=32, Hkv=8, D=128, page 64, random trees, random page tables)
   for B=32,P=32768,N=64; B=64,P=4096,N=64; B=1,P=32768,N=64; B=8,P=8192,N=16, in bf16 and FP8 KV,
   with baselines from the same run: byte floor (K+V bytes / measured copy bandwidth), FLOP floor
   (4*B*N*Hq*(P+N)*D / measured bf16 matmul rate), dense masked attention in XLA
   (jax.nn.dot_product_attention over pre-gathered K/V, cudnn when it accepts the call) and the prefix
   decode alone.

`main(argv)` is the entry point used by benchmarks/gpu_suite.py. `--quick` runs the conformance
and the two smaller timing shapes only.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import sys
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.dense import time_dense_attention
from benchmarks.report import parse_shapes, rel_err
from benchmarks.timing import chained_time, feed_output, feed_scalar, measure_ceilings, median_time, traced_time
from pallas_kernels.attention.prefix_decode import (heads_to_rows, padded_rows, prefix_decode,
                                                    prefix_decode_row_layout)
from pallas_kernels.attention.reference import (cascade_dense_reference, dense_tree_visibility,
                                                sliding_lane_dense_reference)
from pallas_kernels.attention.prefix_decode_mgpu import prefix_decode_mgpu_row_layout
from pallas_kernels.attention.tree_window import tree_window_attention, tree_window_row_layout
from pallas_kernels.common import resolve_backend
from treespec_jax.attention.cascade import (CascadeConfig, cascade_attention, covers_tail, fuses_window,
                                            mosaic_rows, sliding_lane_attention, uses_mosaic_prefix)
from treespec_jax.cache.paged import slot_of
from treespec_jax.tree.masks import ancestor_mask

FP8 = jnp.float8_e4m3fn
HQ, HKV, D, PAGE = 32, 8, 128, 64
FULL_SHAPES = [(32, 32768, 64), (64, 4096, 64), (1, 32768, 64), (8, 8192, 16)]
QUICK_SHAPES = [(64, 4096, 64), (8, 8192, 16)]
# Calls in the shorter chain of a device-time sample (timing.chained_time; the longer has 3x).
CHAINED = 20


# ------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------

def random_parents(rng: np.random.Generator, batch: int, n: int) -> np.ndarray:
    par = np.full((batch, n), -1, np.int32)
    for j in range(1, n):
        par[:, j] = rng.integers(0, j, size=batch)
    return par


# KV dtype names of the scripts' --dtypes flags.
KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": FP8}


def kv_bytes(b: int, p: int, n: int, dtype) -> int:
    """K and V bytes a verify of N rows over P committed keys reads (the byte floor's numerator)."""
    return 2 * b * (p + n) * HKV * D * jnp.dtype(dtype).itemsize


def verify_flops(b: int, p: int, n: int) -> int:
    """Q K^T and P V FLOPs of that verify over every key (the FLOP floor's numerator)."""
    return 4 * b * n * HQ * (p + n) * D


def cascade_inputs(key, rng, b: int, p: int, n: int, dtype, spare_tokens: int = 0):
    """The timing inputs of one shape: pools of `dtype` mapping P + N (+ `spare_tokens`) tokens per
    request (random page table, no poison), q `[B, N, Hq, D]` bf16, every prefix length P and a
    random tree's ancestor mask: (q, k_pool, v_pool, page_table, lengths, mask)."""
    kp, vp, table = make_paged(key, rng, b, p + n + spare_tokens, HKV, D, PAGE, dtype, poison=False)
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, n, HQ, D), jnp.float32).astype(jnp.bfloat16)
    return q, kp, vp, table, jnp.full((b,), p, jnp.int32), ancestor_mask(jnp.asarray(random_parents(rng, b, n)))


def make_paged(key, rng, batch, max_len, hkv, d, page, dtype, poison=True, width=None):
    """Random pools with a random page table; every slot no request owns is NaN-poisoned."""
    pages_per_req = -(-max_len // page)
    num_pages = batch * pages_per_req + 2
    perm = rng.permutation(num_pages)
    table = jnp.asarray(perm[: batch * pages_per_req].reshape(batch, pages_per_req), jnp.int32)
    spare = perm[batch * pages_per_req:]
    shape = (num_pages * page, hkv, width or d)
    k1, k2 = jax.random.split(key)
    k = jax.random.normal(k1, shape, jnp.float32).astype(dtype)
    v = jax.random.normal(k2, shape, jnp.float32).astype(dtype)
    if poison:
        slots = (spare[:, None] * page + np.arange(page)[None, :]).reshape(-1)
        k = k.at[slots].set(jnp.nan)
        v = v.at[slots].set(jnp.nan)
    return k, v, table


def poison_beyond(pool, table, lengths, page):
    """NaN in every owned slot at or past `lengths[b]` (stale slots a row never sees)."""
    table = np.asarray(table)
    slots = []
    for b, n in enumerate(np.asarray(lengths)):
        for pos in range(int(n), table.shape[1] * page):
            slots.append(table[b, pos // page] * page + pos % page)
    if not slots:
        return pool
    return pool.at[np.asarray(slots)].set(jnp.nan)


def lse_err(lse, ref):
    lse = np.asarray(lse)
    ref = np.asarray(ref)
    if not np.array_equal(np.isneginf(lse), np.isneginf(ref)) or np.isnan(lse).any():
        return float("nan")
    fin = np.isfinite(ref)
    return float(np.max(np.abs(lse[fin] - ref[fin]))) if fin.any() else 0.0


# ------------------------------------------------------------------------------------------------
# Conformance
# ------------------------------------------------------------------------------------------------

class Checks:
    def __init__(self):
        self.rows = []

    def add(self, name, err, tol):
        ok = err == err and err <= tol  # NaN never passes
        self.rows.append((name, err, tol, ok))
        print(f"  {'PASS' if ok else 'FAIL'} {name}: err={err:.3e} tol={tol:.0e}", flush=True)

    def fail(self, name, exc):
        self.rows.append((name, float("nan"), 0.0, False))
        print(f"  FAIL {name}: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        traceback.print_exc(limit=3)

    @property
    def all_ok(self):
        return all(r[3] for r in self.rows)


def conformance(checks: Checks, seed=0):
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    print("conformance (compiled Pallas vs fp32 reference)", flush=True)
    bf_tol = 2e-2
    for (hq, hkv, r, page, dtype, score8) in [(8, 2, 16, 16, jnp.bfloat16, False),
                                              (8, 8, 64, 64, jnp.bfloat16, False),
                                              (8, 1, 16, 64, FP8, False),
                                              (8, 2, 16, 64, FP8, True)]:
        name = f"g{hq // hkv} R{r} page{page} {jnp.dtype(dtype).name}{' f8dot' if score8 else ''}"
        try:
            key, k0, k1, k2 = jax.random.split(key, 4)
            b, maxlen = 4, 1200 + 64
            lengths = jnp.asarray([0, r // 2, 1200, 517], jnp.int32)
            kp, vp, table = make_paged(k0, rng, b, maxlen, hkv, D, page, dtype)
            kp = poison_beyond(kp, table, lengths + r, page)
            vp = poison_beyond(vp, table, lengths + r, page)
            # Window slots P .. P + R - 1 hold finite values written by "the verify forward".
            q = jax.random.normal(k1, (b, r, hq, D), jnp.float32).astype(jnp.bfloat16)
            for splits in (None, 3):
                out, lse = prefix_decode(q, kp, vp, table, lengths, page_size=page, num_splits=splits,
                                         fp8_score_dot=score8, poison_outputs=True)
                ref, rlse = prefix_decode(q, kp, vp, table, lengths, page_size=page, backend="reference")
                checks.add(f"prefix {name} splits={splits}", rel_err(out, ref), bf_tol)
                checks.add(f"prefix lse2 {name} splits={splits}", lse_err(lse, rlse), 2e-2)
            mask = ancestor_mask(jnp.asarray(random_parents(rng, b, r)))
            win = tree_window_attention(q, kp, vp, table, lengths, mask, ref, rlse, window=r, page_size=page,
                                        poison_outputs=True)
            wref = tree_window_attention(q, kp, vp, table, lengths, mask, ref, rlse, window=r, page_size=page,
                                         backend="reference")
            checks.add(f"window {name}", rel_err(win, wref), bf_tol)
            casc = cascade_attention(q, kp, vp, table, lengths, mask, window=r,
                                     config=CascadeConfig(page_size=page, fp8_score_dot=score8))
            dense, _ = cascade_dense_reference(q, kp, vp, table, lengths, mask, window=r, page_size=page,
                                               scale=D ** -0.5)
            checks.add(f"cascade vs dense {name}", rel_err(casc, dense), bf_tol if dtype != FP8 else 6e-2)
            if page == 64:
                # The window fused into the Mosaic prefix kernel, unsplit (bf16 output written by the
                # kernel) and over three key splits.
                for splits in (1, 3):
                    fused = cascade_attention(q, kp, vp, table, lengths, mask, window=r, config=CascadeConfig(
                        page_size=page, prefix_kernel="mosaic_gpu", fuse_window=True, num_splits=splits))
                    checks.add(f"cascade fused window splits={splits} vs dense {name}", rel_err(fused, dense),
                               bf_tol if dtype != FP8 else 6e-2)
                # The unfused Mosaic cascade, in head layout where both kernels can tile it
                # (CascadeConfig.unfused_heads_io: every case here), one key range per CTA and three splits
                # handed to the window kernel.
                for splits in (1, 3):
                    unfused = cascade_attention(q, kp, vp, table, lengths, mask, window=r, config=CascadeConfig(
                        page_size=page, prefix_kernel="mosaic_gpu", fuse_window=False, num_splits=splits))
                    checks.add(f"cascade unfused Mosaic splits={splits} vs dense {name}", rel_err(unfused, dense),
                               bf_tol if dtype != FP8 else 6e-2)
            # The bf16 prefix partial through each prefix kernel that runs here (Triton always;
            # Mosaic where "auto" takes it), one key range per CTA so the partial stays bf16.
            for kernel in ("triton", "auto"):
                casc16 = cascade_attention(q, kp, vp, table, lengths, mask, window=r, config=CascadeConfig(
                    page_size=page, fp8_score_dot=score8, prefix_kernel=kernel, num_splits=1,
                    prefix_partial_dtype="bfloat16"))
                checks.add(f"cascade bf16 partial ({kernel} prefix) vs dense {name}", rel_err(casc16, dense),
                           bf_tol if dtype != FP8 else 6e-2)
        except Exception as exc:  # keep going: report every failure in one run
            checks.fail(name, exc)

    # Draft lanes K=4, S=5 (window 16) and the sliding-window lane variant.
    try:
        key, k0, k1 = jax.random.split(key, 3)
        b, kk, steps = 3, 4, 5
        w = (steps - 1) * kk
        frontier = jnp.asarray([3, 300, 64], jnp.int32)
        kp, vp, table = make_paged(k0, rng, b, 400, HKV, D, PAGE, jnp.bfloat16)
        kp = poison_beyond(kp, table, frontier + w, PAGE)
        vp = poison_beyond(vp, table, frontier + w, PAGE)
        q = jax.random.normal(k1, (b, kk, 16, D), jnp.float32).astype(jnp.bfloat16)
        bits = rng.random((b, kk, w)) < 0.4
        from treespec_jax.tree.masks import pack_mask_rows
        lane_mask = pack_mask_rows(jnp.asarray(bits))
        out = cascade_attention(q, kp, vp, table, frontier, lane_mask, window=w,
                                config=CascadeConfig(page_size=PAGE))
        dense, _ = cascade_dense_reference(q, kp, vp, table, frontier, lane_mask, window=w, page_size=PAGE,
                                           scale=D ** -0.5)
        checks.add("lanes K=4 S=5 vs dense", rel_err(out, dense), bf_tol)
        # Fused lanes need 64 rows per KV head for the Mosaic kernel: K=8 lanes, S=3, group 8.
        k8, w8 = 8, 16
        q8 = jax.random.normal(jax.random.fold_in(k1, 8), (b, k8, 8 * HKV, D), jnp.float32).astype(jnp.bfloat16)
        mask8 = pack_mask_rows(jnp.asarray(rng.random((b, k8, w8)) < 0.4))
        out = cascade_attention(q8, kp, vp, table, frontier, mask8, window=w8, config=CascadeConfig(
            page_size=PAGE, prefix_kernel="mosaic_gpu", fuse_window=True))
        dense8, _ = cascade_dense_reference(q8, kp, vp, table, frontier, mask8, window=w8, page_size=PAGE,
                                            scale=D ** -0.5)
        checks.add("lanes K=8 S=3 group 8 fused window vs dense", rel_err(out, dense8), bf_tol)
        row_tables = jnp.asarray(np.stack([np.stack([np.asarray(table)[bb]] * kk) for bb in range(b)]))
        row_lengths = jnp.asarray(np.minimum(np.asarray(frontier)[:, None], 200) * np.ones((1, kk), np.int32),
                                  jnp.int32)
        out = sliding_lane_attention(q, kp, vp, row_tables, row_lengths, table, frontier, lane_mask, window=w,
                                     config=CascadeConfig(page_size=PAGE), sliding_window=128)
        dense, _ = sliding_lane_dense_reference(q, kp, vp, row_tables, row_lengths, table, frontier, lane_mask,
                                             window=w, page_size=PAGE, scale=D ** -0.5, sliding_window=128)
        checks.add("sliding lanes vs dense", rel_err(out, dense), bf_tol)
    except Exception as exc:
        checks.fail("lanes", exc)

    # MLA latent layout through the window kernel (DeepSeek-like widths, few heads).
    try:
        key, k0, k1, k2, k3 = jax.random.split(key, 5)
        b, r, hq, lat, rope = 2, 16, 16, 512, 64
        lengths = jnp.asarray([5, 700], jnp.int32)
        lp, _, table = make_paged(k0, rng, b, 800, 1, D, PAGE, jnp.bfloat16, width=lat + rope)
        lp = poison_beyond(lp, table, lengths + r, PAGE)
        q = jax.random.normal(k1, (b, r, hq, lat + rope), jnp.float32).astype(jnp.bfloat16)
        po = jax.random.normal(k2, (b, r, hq, lat), jnp.float32)
        plse = jax.random.normal(k3, (b, r, hq), jnp.float32) + 2.0
        mask = ancestor_mask(jnp.asarray(random_parents(rng, b, r)))
        scale = 192 ** -0.5
        for dtype in (jnp.bfloat16, FP8):
            pool = lp.astype(dtype)
            out = tree_window_attention(q, pool, None, table, lengths, mask, po, plse, window=r, page_size=PAGE,
                                        scale=scale, rope_dim=rope, poison_outputs=True)
            ref = tree_window_attention(q, pool, None, table, lengths, mask, po, plse, window=r, page_size=PAGE,
                                        scale=scale, rope_dim=rope, backend="reference")
            checks.add(f"window MLA latent512 rope64 {jnp.dtype(dtype).name}", rel_err(out, ref), bf_tol)
    except Exception as exc:
        checks.fail("mla window", exc)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------

def dense_baseline(q, kp, vp, table, lengths, mask, window):
    """Dense masked attention over pre-gathered K/V with the tree mask (benchmarks.dense)."""
    b, n = q.shape[:2]
    t = int(np.asarray(lengths).max()) + window
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    slots = slot_of(table, pos, PAGE)
    vis = dense_tree_visibility(lengths, mask, t, window)  # [B, N, T]
    return time_dense_attention(q, kp[slots].astype(q.dtype), vp[slots].astype(q.dtype), vis,
                                q.shape[-1] ** -0.5)


def tune_prefix(q, kp, vp, table, lengths):
    """Times a few (block_rows, num_warps, num_stages) for the prefix kernel; returns the best."""
    best = None
    for br, nw, ns in [(128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2)]:
        try:
            f = jax.jit(lambda *a, br=br, nw=nw, ns=ns: prefix_decode(*a, page_size=PAGE, block_rows=br,
                                                                       num_warps=nw, num_stages=ns))
            t = median_time(f, q, kp, vp, table, lengths, samples=7)
            print(f"  tune prefix block_rows={br} warps={nw} stages={ns}: {t * 1e3:.3f} ms", flush=True)
            if best is None or t < best[0]:
                best = (t, dict(block_rows=br, num_warps=nw, num_stages=ns))
        except Exception as exc:
            print(f"  tune prefix {br},{nw},{ns} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
    return best[1] if best else {}


def time_shape(b, p, n, dtype, ceilings, tune, rng, key, fp8_dot_too, flip_covers_tail=False, lean=False,
               checks=None, partial_bf16=False, fuse_window=False, mosaic_small=False, persistent=False,
               host_clock=False, splits=()):
    """One table row. `flip_covers_tail`: also the cascade with `prefix_covers_tail` opposite to its
    default here; `partial_bf16`: also with `prefix_partial_dtype="bfloat16"`; `fuse_window`: also
    with `fuse_window` flipped from its default (`cascade.fuses_window`; Mosaic prefix only);
    `persistent`: also with the Mosaic prefix launched persistent (`persistent_prefix=True`);
    `mosaic_small`: at fewer than 64 rows per KV head, also with the other prefix kernel (Triton
    where the default pads to the Mosaic one, else the padded Mosaic one); each checked against
    the default cascade's output first (a row in `checks`, so a mismatch fails the run); `lean`: no
    per-call, Triton-prefix or dense baselines; `host_clock`: also the host-clock chains
    (`timing.chained_time`), the timer before the traced one; `splits`: also the cascade at each of
    these key-split counts (`CascadeConfig.num_splits`; the default's own rule picks one per shape)."""
    bw, flops = ceilings
    kp, vp, table = make_paged(key, rng, b, p + n, HKV, D, PAGE, dtype, poison=False)
    q = jax.random.normal(jax.random.fold_in(key, 7), (b, n, HQ, D), jnp.float32).astype(jnp.bfloat16)
    lengths = jnp.full((b,), p, jnp.int32)
    mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
    group = HQ // HKV
    interp = jax.default_backend() != "gpu"
    # The prefix kernel the default cascade picks here ("auto": Mosaic GPU where it runs), and which
    # half it gives the causal tail to (the default prefix_covers_tail follows the kernel).
    mosaic = not tune and uses_mosaic_prefix(CascadeConfig(page_size=PAGE), resolve_backend(None), q, kp, vp)
    # The rows as the cascade lays them out (the Mosaic prefix pads to at least one 64-row tile).
    qr = heads_to_rows(q, HKV, mosaic_rows(n * group) if mosaic else padded_rows(n * group))
    covers = covers_tail(None, mosaic)
    rows_kw = dict(query_rows=1, group=n * group) if covers else dict(query_rows=n, group=group)
    # The merge launch the cascades below take (--xla-merge sets it through CascadeConfig).
    kw = dict(page_size=PAGE, scale=D ** -0.5, **rows_kw, interpret=interp,
              merge_config=CascadeConfig(page_size=PAGE).merge)
    # Prefix alone on the row layout (kernel + split merge), as the cascade runs it.
    if mosaic:
        pre = jax.jit(lambda *a: prefix_decode_mgpu_row_layout(*a, **kw))
    else:
        pre = jax.jit(lambda *a: prefix_decode_row_layout(*a, **kw, **tune))
    # Device time: calls back to back inside one jit (each fed the previous output), as the kernels
    # run inside a served model's step; the per-call (Python-dispatched) cascade time stays beside it.
    # The same feed for every chain (through P, argument 4), so its cost cancels in the window overhead.
    def device_time(fn, args, feed=feed_scalar(4)):
        return traced_time(fn, args, feed, inner=3 * CHAINED)

    t_pre = device_time(pre, (qr, kp, vp, table, lengths))
    po, plse = pre(qr, kp, vp, table, lengths)
    # The window kernel as the cascade runs it (storing the head layout itself where it can).
    win = jax.jit(lambda *a: tree_window_row_layout(*a, query_rows=n, group=group, window=n, page_size=PAGE,
                                                    scale=D ** -0.5, value_dim=D, interpret=interp,
                                                    causal_prefix=not covers, prefix_whole_pages=mosaic,
                                                    heads_out=True))
    t_win = device_time(win, (qr, kp, vp, table, lengths, mask, po, plse))
    # The whole cascade through its public composition (q transposed in), with the default prefix
    # kernel (under --tune the Triton one, so the prefix, window and cascade columns time one path)
    # and, as the in-run baseline, with the Triton one.
    kernel = "triton" if tune else "auto"
    cas = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(page_size=PAGE,
                                                                                 prefix_kernel=kernel)))
    cas_args = (q, kp, vp, table, lengths, mask)
    t_cas = device_time(cas, cas_args)
    # The same cascade chained through its query instead (each call's output is the next call's q:
    # same shape and dtype, so no feed kernel runs, and whatever the cascade does to q before its
    # kernels, the FP8 cast, the row transpose, runs every call as in a served step instead of
    # being hoisted out of the chain as loop-invariant). Beside the scalar-fed column, not instead.
    t_cas_qfed = device_time(cas, cas_args, feed_output(0))
    # The host-clock timer beside it: wall clock of two chains (it also carries XLA's per-call host
    # work, which timing.traced_time leaves out).
    t_cas_chained = chained_time(cas, cas_args, feed_scalar(4), inner=CHAINED) if host_clock else float("nan")
    t_cas_call = float("nan") if lean else median_time(cas, *cas_args)

    def alternative(label, **config):
        # The cascade with `config` changed: checked against the default's output, then timed.
        alt = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
            **{"page_size": PAGE, "prefix_kernel": kernel, **config})))
        err = rel_err(alt(*cas_args), cas(*cas_args))
        name = f"{label} cascade vs default B={b},P={p},N={n} {jnp.dtype(dtype).name}"
        if checks is not None:
            checks.add(name, err, 1e-2)  # bf16 outputs of two summation orders (or partial dtypes)
        if err < 1e-2:
            return device_time(alt, cas_args)
        print(f"  {name}: DIFFERS (rel {err:.2e}); not timed", flush=True)
        return float("nan")

    t_cas_tail = (alternative(f"prefix_covers_tail={not covers}", prefix_covers_tail=not covers)
                  if flip_covers_tail else float("nan"))
    t_cas_bf16 = (alternative("prefix_partial_dtype=bfloat16", prefix_partial_dtype="bfloat16")
                  if partial_bf16 else float("nan"))
    # The fused window flipped from its default (cascade.fuses_window).
    fused_default = fuses_window(CascadeConfig(page_size=PAGE), mosaic, covers, kp, q)
    t_cas_fused = (alternative(f"fuse_window={not fused_default}", fuse_window=not fused_default,
                               prefix_kernel="mosaic_gpu")
                   if fuse_window and mosaic else float("nan"))
    t_cas_persistent = (alternative("persistent_prefix=True", persistent_prefix=True, prefix_kernel="mosaic_gpu")
                        if persistent and mosaic else float("nan"))
    # Under 64 rows per KV head "auto" takes the Triton prefix; the Mosaic one pads to 64 rows.
    # Under 64 rows per KV head the Mosaic prefix pads to 64 rows: time the other kernel beside it.
    other = "triton" if mosaic else "mosaic_gpu"
    t_cas_small_other = (alternative(f"prefix_kernel={other} (under 64 rows)", prefix_kernel=other)
                         if mosaic_small and padded_rows(n * group) < 64 else float("nan"))
    # Forced key splits: whether the default split rule (`default_mgpu_num_splits` or the Triton
    # one) leaves time at this shape, e.g. few (request, KV head) programs over a short prefix.
    t_cas_splits = {f"cascade_splits{s}_ms": alternative(f"num_splits={s}", num_splits=s) * 1e3 for s in splits}
    if lean:
        t_cas_triton = float("nan")
    elif mosaic:
        cas_tr = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
            page_size=PAGE, prefix_kernel="triton")))
        t_cas_triton = device_time(cas_tr, cas_args)
    else:
        t_cas_triton = t_cas
    t_cas8 = float("nan")
    if fp8_dot_too and not lean:
        try:
            cas8 = jax.jit(lambda *a: cascade_attention(*a, window=n, config=CascadeConfig(
                page_size=PAGE, fp8_score_dot=True, prefix_kernel="triton")))
            t_cas8 = device_time(cas8, cas_args)
        except Exception as exc:
            print(f"  fp8 score dot failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    impl, t_dense = ("-", float("nan")) if lean else dense_baseline(q, kp, vp, table, lengths, mask, n)
    kv_read = kv_bytes(b, p, n, dtype)
    byte_floor = kv_read / bw
    flop_floor = verify_flops(b, p, n) / flops
    floor = max(byte_floor, flop_floor)
    row = dict(shape=f"B={b},P={p},N={n}", kv=jnp.dtype(dtype).name, prefix_kernel="mosaic_gpu" if mosaic else "triton",
               prefix_ms=t_pre * 1e3, window_ms=t_win * 1e3, cascade_ms=t_cas * 1e3, cascade_call_ms=t_cas_call * 1e3,
               cascade_chained_ms=t_cas_chained * 1e3, chained_vs_floor=t_cas_chained / floor,
               cascade_triton_ms=t_cas_triton * 1e3, cascade_fp8dot_ms=t_cas8 * 1e3, cascade_tail_ms=t_cas_tail * 1e3,
               cascade_bf16_partial_ms=t_cas_bf16 * 1e3, cascade_fuse_flipped_ms=t_cas_fused * 1e3,
               cascade_small_rows_other_kernel_ms=t_cas_small_other * 1e3,
               fuse_flipped_vs_floor=t_cas_fused / floor, cascade_persistent_ms=t_cas_persistent * 1e3,
               persistent_vs_floor=t_cas_persistent / floor, dense_ms=t_dense * 1e3, dense_impl=impl,
               byte_floor_ms=byte_floor * 1e3, flop_floor_ms=flop_floor * 1e3,
               vs_floor=t_cas / floor, cascade_query_fed_ms=t_cas_qfed * 1e3,
               query_fed_vs_floor=t_cas_qfed / floor, window_overhead=(t_cas - t_pre) / t_pre,
               prefix_tbps=kv_read / t_pre / 1e12, dense_speedup=t_dense / t_cas, **t_cas_splits)
    print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    del kp, vp
    return row


def time_mla_window(b=32, p=8192, n=16, hq=128, lat=512, rope=64):
    """The window kernel alone on the MLA latent layout (DeepSeek-V3 widths); the MLA prefix is not ours."""
    rng = np.random.default_rng(5)
    key = jax.random.PRNGKey(5)
    out = {}
    for dtype in (jnp.bfloat16, FP8):
        lp, _, table = make_paged(key, rng, b, p + n, 1, D, PAGE, dtype, poison=False, width=lat + rope)
        q = jax.random.normal(key, (b, n, hq, lat + rope), jnp.float32).astype(jnp.bfloat16)
        po = jax.random.normal(key, (b, n, hq, lat), jnp.float32)
        plse = jax.random.normal(key, (b, n, hq), jnp.float32) + 10.0
        mask = ancestor_mask(jnp.asarray(random_parents(rng, b, n)))
        lengths = jnp.full((b,), p, jnp.int32)
        # The default row tiles, then 16 and 32 explicitly (device time, chained through P).
        for rows in (None, 16, 32):
            f = jax.jit(lambda q, lp, table, lengths, mask, po, plse, rows=rows: tree_window_attention(
                q, lp, None, table, lengths, mask, po, plse, window=n, page_size=PAGE, scale=192 ** -0.5,
                rope_dim=rope, block_rows=rows))
            name = jnp.dtype(dtype).name + ("" if rows is None else f" ({rows}-row tiles)")
            out[name] = traced_time(f, (q, lp, table, lengths, mask, po, plse), feed_scalar(3),
                                    inner=3 * CHAINED) * 1e3
            print(f"  MLA window B={b} N={n} Hq={hq} latent={lat} rope={rope} {name}: {out[name]:.3f} ms", flush=True)
    return out


def table_markdown(rows, ceilings, tune):
    bw, flops = ceilings
    lines = [f"measured copy bandwidth {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s; "
             f"prefix kernel launch {tune or 'prefix_decode.default_launch'}", "",
             f"Device times (`timing.traced_time`): chains of {3 * CHAINED} calls inside one jit (each fed the previous "
             "output) traced with the profiler, each after an idle second, the span from the first kernel's start to the "
             "last one's end per call, median of 3 chains (the matmul ceiling is traced the same way); 'host-clock "
             "chains' (`--host-clock`) is the earlier timer (host wall clock of chains of "
             f"{CHAINED} and {3 * CHAINED}, the difference per call), which also carries XLA's per-call host work; "
             "'cascade per call' dispatches each call from Python; 'query-fed' chains pass each call's output on as the "
             "next call's q (no feed kernel; the cascade's work on q runs every call) where the other chains add a "
             "tiny fused op on P.", "",
             "| shape | KV | prefix kernel | prefix ms | window ms | cascade ms | host-clock chains ms | chains / max floor "
             "| cascade per call ms "
             "| cascade, Triton prefix ms "
             "| cascade, Triton fp8-dot prefix ms | cascade, covers tail flipped ms | cascade, bf16 partial ms "
             "| cascade, fuse_window flipped ms | flipped / max floor "
             "| cascade, persistent prefix ms | persistent / max floor "
             "| byte floor ms | FLOP floor ms "
             "| cascade / max floor | cascade, query-fed ms | query-fed / max floor "
             "| window overhead | prefix TB/s | dense (impl) ms | dense / cascade |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['kv']} | {r['prefix_kernel']} | {r['prefix_ms']:.3f} | {r['window_ms']:.3f} "
                     f"| {r['cascade_ms']:.3f} | {r['cascade_chained_ms']:.3f} | {r['chained_vs_floor']:.2f}x "
                     f"| {r['cascade_call_ms']:.3f} | {r['cascade_triton_ms']:.3f} "
                     f"| {r['cascade_fp8dot_ms']:.3f} | {r['cascade_tail_ms']:.3f} "
                     f"| {r['cascade_bf16_partial_ms']:.3f} | {r['cascade_fuse_flipped_ms']:.3f} "
                     f"| {r['fuse_flipped_vs_floor']:.2f}x | {r['cascade_persistent_ms']:.3f} "
                     f"| {r['persistent_vs_floor']:.2f}x | {r['byte_floor_ms']:.3f} "
                     f"| {r['flop_floor_ms']:.3f} "
                     f"| {r['vs_floor']:.2f}x | {r['cascade_query_fed_ms']:.3f} | {r['query_fed_vs_floor']:.2f}x "
                     f"| {100 * r['window_overhead']:.1f}% | {r['prefix_tbps']:.2f} "
                     f"| {r['dense_ms']:.3f} ({r['dense_impl']}) | {r['dense_speedup']:.2f}x |")
    for r in rows:  # --splits: the cascade at forced key-split counts, beside the default's
        forced = [(k.removeprefix("cascade_splits").removesuffix("_ms"), v) for k, v in r.items()
                  if k.startswith("cascade_splits")]
        if forced:
            lines.append(f"\n{r['shape']} {r['kv']}, cascade ms at forced key splits: "
                         + ", ".join(f"{s}: {v:.4f}" for s, v in forced) + f" (default {r['cascade_ms']:.4f})")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="conformance + the two smaller shapes, no tuning")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--tune", action="store_true", help="also time a few prefix-kernel configurations")
    ap.add_argument("--flip-covers-tail", action="store_true",
                    help="also time the cascade with CascadeConfig.prefix_covers_tail opposite to its default")
    ap.add_argument("--partial-bf16", action="store_true",
                    help="also time the cascade with CascadeConfig(prefix_partial_dtype='bfloat16')")
    ap.add_argument("--fuse-window", action="store_true",
                    help="also time the cascade with CascadeConfig.fuse_window flipped (Mosaic prefix)")
    ap.add_argument("--persistent", action="store_true",
                    help="also time the cascade with the Mosaic prefix launched persistent (persistent_prefix=True)")
    ap.add_argument("--mosaic-small", action="store_true",
                    help="at fewer than 64 rows per KV head, also time the other prefix kernel (the default "
                         "pads them to the Mosaic one)")
    ap.add_argument("--splits", default="",
                    help="also time the cascade at these key-split counts, e.g. 1,2,4,8,16 (CascadeConfig.num_splits)")
    ap.add_argument("--host-clock", action="store_true",
                    help="also time the cascade by the host-clock chains (timing.chained_time), the earlier timer")
    ap.add_argument("--lean", action="store_true",
                    help="skip the per-call, Triton-prefix and dense baselines and the MLA window timing (faster variant runs)")
    ap.add_argument("--markdown", default=None, help="write the conformance summary and table to this file")
    ap.add_argument("--results", default=None,
                    help="append a dated section here (benchmarks/RESULTS.md by default; --smoke appends "
                         "only when this is given)")
    ap.add_argument("--no-results", action="store_true", help="do not append to the results file")
    ap.add_argument("--shapes", default=None, help="timing shapes BxPxN,... (default: the issue's four)")
    ap.add_argument("--dtypes", default="bf16,fp8", choices=("bf16,fp8", "bf16", "fp8"), help="KV dtypes to time")
    ap.add_argument("--variants", action="store_true", help="launch-variant sweep (cascade_variants.py)")
    ap.add_argument("--smoke", action="store_true", help="with --variants: tiny shapes, interpret mode")
    ap.add_argument("--focus", choices=("both", "prefix", "window"), default="both",
                    help="with --variants: sweep one kernel's variants, the other keeps its default")
    ap.add_argument("--budget-s", type=float, default=130.0,
                    help="with --variants: skip the remaining variant timings after this many seconds "
                         "(the final default/recommended cascades still run)")
    ap.add_argument("--merge-kernel-splits", action="store_true",
                    help="unfused cascades merge key-split partials in the merge kernel before the window "
                         "kernel (CascadeConfig.window_merges_splits=False; conformance runs so too)")
    ap.add_argument("--xla-merge", action="store_true",
                    help="merge key splits in XLA (CascadeConfig.merge=MergeConfig(kernel=False)) instead of the "
                         "Pallas kernel")
    args = ap.parse_args(argv)
    if args.xla_merge or args.merge_kernel_splits:
        # Every cascade this module builds, conformance and timings alike.
        from pallas_kernels.attention.split_merge import MergeConfig
        global CascadeConfig
        CascadeConfig = functools.partial(CascadeConfig, **(dict(merge=MergeConfig(kernel=False)) if args.xla_merge
                                                            else {}),
                                          **(dict(window_merges_splits=False) if args.merge_kernel_splits else {}))
    cmd = "python3 benchmarks/bench_cascade.py " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.variants:
        # Imported here: cascade_variants imports this module for its helpers.
        from benchmarks import cascade_variants
        md, ok = cascade_variants.run_variants(args, smoke=args.smoke)
        results = args.results or (None if args.smoke else str(Path(__file__).resolve().parent / "RESULTS.md"))
        if results and not args.no_results:
            cascade_variants.append_results(results, md, cmd)
            print(f"appended a section to {results}", flush=True)
        return 0 if ok else 1
    args.results = args.results or str(Path(__file__).resolve().parent / "RESULTS.md")
    print(f"jax {jax.__version__} devices {jax.devices()}", flush=True)
    checks = Checks()
    if not args.skip_conformance:
        conformance(checks)
    rows, ceilings, tune = [], (float("nan"), float("nan")), {}
    if not args.skip_timing:
        ceilings = measure_ceilings()
        print(f"copy bandwidth {ceilings[0] / 1e12:.2f} TB/s, bf16 matmul {ceilings[1] / 1e12:.0f} TFLOP/s", flush=True)
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
        if args.shapes:
            shapes = parse_shapes(args.shapes)
        rng = np.random.default_rng(1)
        key = jax.random.PRNGKey(1)
        if args.tune and not args.quick:
            b, p, n = FULL_SHAPES[0]
            kp, vp, table = make_paged(key, rng, b, p + n, HKV, D, PAGE, jnp.bfloat16, poison=False)
            q = jax.random.normal(key, (b, n, HQ, D), jnp.float32).astype(jnp.bfloat16)
            best = tune_prefix(q, kp, vp, table, jnp.full((b,), p, jnp.int32))
            print(f"  best prefix configuration: {best} (timings below use the kernel defaults)", flush=True)
            del kp, vp
        for dtype in [KV_DTYPES[name] for name in args.dtypes.split(",")]:
            for (b, p, n) in shapes:
                print(f"timing B={b} P={p} N={n} {jnp.dtype(dtype).name}", flush=True)
                try:
                    rows.append(time_shape(b, p, n, dtype, ceilings, tune, rng, jax.random.fold_in(key, b * p + n),
                                           fp8_dot_too=dtype == FP8, flip_covers_tail=args.flip_covers_tail,
                                           lean=args.lean, checks=checks, partial_bf16=args.partial_bf16,
                                           fuse_window=args.fuse_window, mosaic_small=args.mosaic_small,
                                           persistent=args.persistent, host_clock=args.host_clock,
                                           splits=[int(x) for x in args.splits.split(",") if x]))
                except Exception as exc:
                    print(f"  timing failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    mla = {}
    if not (args.skip_timing or args.quick or args.lean):
        try:
            mla = time_mla_window()
        except Exception as exc:
            print(f"  MLA window timing failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    summary = [f"conformance: {sum(r[3] for r in checks.rows)}/{len(checks.rows)} passed"]
    summary += [f"- {'PASS' if ok else 'FAIL'} {name}: {err:.2e} (tol {tol:.0e})" for name, err, tol, ok in checks.rows]
    md = f"bench_cascade {stamp}, jax {jax.__version__}, {jax.devices()[0].device_kind}\n\n" + "\n".join(summary)
    if rows:
        md += "\n\n" + table_markdown(rows, ceilings, tune)
    if mla:
        md += "\n\nMLA window kernel alone (B=32, P=8192, N=16, Hq=128, latent 512, rope 64): " + ", ".join(
            f"{k} {v:.3f} ms" for k, v in mla.items())
    print("\n" + md, flush=True)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(md + "\n")
    if not args.no_results:
        with open(args.results, "a") as fh:  # one append, so concurrent writers do not clobber
            fh.write(f"\n## Cascade tree attention (GQA), {stamp}\n\ncommand: `{cmd.strip()}`\n\n{md}\n")
    return 0 if checks.all_ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
