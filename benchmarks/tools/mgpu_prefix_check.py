"""The Mosaic GPU prefix kernels on the GPU: compile, conformance, timing against the Triton ones.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/tools/mgpu_prefix_check.py [--skip-timing]
        [--skip-conformance] [--shapes BxPxN,...] [--fp8] [--mla] [--interpret | --smoke]

1. Conformance (D=128, page 64, G=4, R=64, ragged P incl. 0 and partial last pages, NaN/inf in
   every slot no request owns), for bf16 and FP8 E4M3 pools, one and two pages per step:
   `prefix_decode_mgpu_row_layout` against a dense fp32 attention over whole pages below P (its
   contract), then prefix + `tree_window_row_layout(..., prefix_whole_pages=True)` against one dense
   fp32 attention of the whole verify.
`--mla` adds the Mosaic GPU MLA latent decode (bf16 and FP8 caches): conformance against the
whole-pages fp32 reference, then DeepSeek-V3 shapes against the Triton latent decode and both MLA
cascades.

2. Timing (Hq=32, Hkv=8, D=128, page 64, random page tables; by default N=64 at B=32/P=32k,
   B=64/P=4k, B=1/P=32k (a key split) and B=8/P=8k/N=16 (64-row heads: one compute warpgroup for
   bf16, the warpgroup key split for FP8); bf16, and FP8 with `--fp8`): the Mosaic GPU prefix with
   its defaults and with one option flipped at a time (softmax fence, the earlier grid order with a
   head's row tiles apart, each warpgroup's softmax overlapped with its own matmuls (16-bit pools),
   the other warpgroup layout on 64-row heads), alone and as cascades with the window kernel,
   against the Pallas Triton `prefix_decode_row_layout` on the same inputs (`--no-triton` skips it).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import log, lse_agrees, parse_shapes, rel_err  # noqa: E402
from benchmarks.timing import feed_scalar, median_time, traced_matmul_flops, traced_time  # noqa: E402
from pallas_kernels.attention.prefix_decode import (default_num_splits, heads_to_rows, padded_rows,  # noqa: E402
                                                   prefix_decode_row_layout)
from pallas_kernels.attention.prefix_decode_mgpu import (default_mgpu_num_splits,  # noqa: E402
                                                     prefix_decode_mgpu_row_layout, warpgroup_layout)
from pallas_kernels.attention.reference import cascade_dense_reference, prefix_decode_reference  # noqa: E402
from pallas_kernels.attention.tree_window import tree_window_row_layout  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402

PAGE = 64
# Calls chained inside one jit per device-time sample (timing.traced_time).
CHAINED = 60


def time_call(fn, args, feed_index: int, interpreted: bool, samples: int = 7) -> float:
    """Seconds per call: device time (`timing.traced_time`: calls chained in one jit, each fed
    through argument `feed_index`, traced after an idle second; lines marked *host* in RESULTS.md
    used the host-clock `chained_time`), or per call from Python when `interpreted` (--smoke: chaining would put the
    Mosaic and Triton interpreters in one jit, which deadlocked on a 2-core CPU)."""
    if interpreted:
        return median_time(fn, *args, samples=samples)
    return traced_time(fn, args, feed_scalar(feed_index), inner=CHAINED)


def pools(rng, b, lengths, w, hkv, d, dtype):
    per_req = -(-(int(lengths.max()) + w) // PAGE)
    num_pages = b * per_req + 2
    table = rng.permutation(num_pages)[: b * per_req].reshape(b, per_req).astype(np.int32)
    k = rng.standard_normal((num_pages * PAGE, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_pages * PAGE, hkv, d)).astype(np.float32)
    live = np.zeros(num_pages * PAGE, bool)
    for i in range(b):
        pos = np.arange(lengths[i] + w)
        live[table[i, pos // PAGE] * PAGE + pos % PAGE] = True
    k[~live] = np.nan
    v[~live] = np.inf
    return jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(table)


def conformance(interpret: bool = False, dtype=jnp.bfloat16, pages_per_step: int = 1, stages: int = 2,
                r: int = 64, key_split: bool | None = None, **opts) -> bool:
    """`dtype`: the pools' dtype (bf16, or FP8 E4M3 with the bf16 query cast to FP8 by the kernel);
    `r` = 16 makes 64-row heads (one compute warpgroup, or both on the same rows alternating key
    steps: the default for FP8, or `key_split=True`)."""
    rng = np.random.default_rng(0)
    b, hkv, g, d = 3, 2, 4, 128
    lengths = np.array([0, 100, 1000], np.int32)
    k, v, table = pools(rng, b, lengths, r, hkv, d, dtype)
    q = jnp.asarray(rng.standard_normal((b, r, hkv * g, d)), jnp.bfloat16)
    lens = jnp.asarray(lengths)
    total = padded_rows(r * g)
    qr = heads_to_rows(q, hkv, total)
    kw = dict(query_rows=r, group=g, page_size=PAGE, scale=d ** -0.5, pages_per_step=pages_per_step, stages=stages,
              key_split=key_split, interpret=interpret, **opts)
    out, lse = prefix_decode_mgpu_row_layout(qr, k, v, table, lens, **kw)
    ref_out, ref_lse = prefix_decode_reference(q, k, v, table, lens, page_size=PAGE, scale=d ** -0.5,
                                               whole_pages=True)
    got = jnp.transpose(out[:, :, : r * g].reshape(b, hkv, r, g, d), (0, 2, 1, 3, 4)).reshape(b, r, hkv * g, d)
    e_out = rel_err(got, ref_out)
    lse_rows = jnp.transpose(lse[:, :, : r * g].reshape(b, hkv, r, g), (0, 2, 1, 3)).reshape(b, r, hkv * g)
    lse_ok = lse_agrees(lse_rows, ref_lse)
    mask = ancestor_mask(jnp.asarray(np.stack([np.r_[-1, rng.integers(0, np.arange(1, r))] for _ in range(b)])
                                     .astype(np.int32)))
    win = tree_window_row_layout(qr, k, v, table, lens, mask, out, lse, query_rows=r, group=g, window=r,
                                 page_size=PAGE, scale=d ** -0.5, value_dim=d, prefix_whole_pages=True,
                                 interpret=interpret)
    cas = jnp.transpose(win[:, :, : r * g].reshape(b, hkv, r, g, d), (0, 2, 1, 3, 4)).reshape(b, r, hkv * g, d)
    dense, _ = cascade_dense_reference(q, k, v, table, lens, mask, window=r, page_size=PAGE, scale=d ** -0.5)
    e_cas = rel_err(cas, dense)
    # Under FP8 the dense reference scores the unquantised query, the prefix half the FP8 one.
    ok = e_out < 2e-2 and lse_ok and e_cas < (6e-2 if dtype != jnp.bfloat16 else 2e-2)
    log(f"conformance {jnp.dtype(dtype).name} R={r} pages_per_step={pages_per_step} stages={stages} "
        f"key_split={key_split}{''.join(f' {k}={v}' for k, v in opts.items())}: prefix rel {e_out:.2e}, lse {'ok' if lse_ok else 'BAD'}, cascade rel {e_cas:.2e} -> "
        f"{'PASS' if ok else 'FAIL'}")
    return ok


FULL_SHAPES = ((32, 32768, 64), (64, 4096, 64), (1, 32768, 64), (8, 8192, 16))
SMOKE_SHAPES = ((2, 200, 32), (1, 300, 16))


def timing(shapes=FULL_SHAPES, hq=32, hkv=8, d=128, samples=7, interpret=False, dtypes=(jnp.bfloat16,), splits=(),
           triton=True, overlap=True, lean=False, widen=False, registers=()):
    """`--smoke` runs this on tiny shapes in the interpreters (a CPU check of the script itself)."""
    flops_rate = (None if interpret else traced_matmul_flops()) or 1e12  # interpreted: a placeholder rate
    for dtype in dtypes:
        for shape in shapes:
            time_shape(shape, dtype, flops_rate, hq, hkv, d, samples, interpret, splits, triton, overlap, lean,
                       widen, registers)


def time_shape(shape, dtype, flops_rate, hq, hkv, d, samples, interpret, splits=(), triton=True, overlap=True,
               lean=False, widen=False, registers=()):
    """Mosaic GPU prefix (defaults, then one option flipped at a time) against the Triton prefix,
    alone and as cascades; `splits`: also the Mosaic prefix and cascade with each of these key-split
    counts (the default count is `prefix_decode_mgpu.default_mgpu_num_splits`, one wave of CTAs);
    `widen` (FP8): also V widened by the compute warpgroups, the gridded launch, and the memory
    warpgroup's register budget at 56 (compute 224), against the default; `registers`: also the
    Mosaic prefix and cascade under each of these (compute, memory) register budgets.
    """
    g = hq // hkv
    b, p, n = shape
    total = padded_rows(n * g)
    rng = np.random.default_rng(b)
    per_req = (p + n) // PAGE + 1
    table = jnp.asarray(rng.permutation(b * per_req).reshape(b, per_req), jnp.int32)
    k = jax.random.normal(jax.random.PRNGKey(1), (b * per_req * PAGE, hkv, d), jnp.bfloat16).astype(dtype)
    v = jax.random.normal(jax.random.PRNGKey(2), (b * per_req * PAGE, hkv, d), jnp.bfloat16).astype(dtype)
    qr = jax.random.normal(jax.random.PRNGKey(3), (b, hkv, total, d), jnp.bfloat16)
    lens = jnp.full((b,), p, jnp.int32)
    mask = ancestor_mask(jnp.asarray(np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)])
                                     .astype(np.int32)))
    kw = dict(query_rows=n, group=g, page_size=PAGE, scale=d ** -0.5, interpret=interpret)

    def mgpu(**opts):
        return jax.jit(lambda *a: prefix_decode_mgpu_row_layout(*a, **opts, **kw))

    tr = jax.jit(lambda *a: prefix_decode_row_layout(*a, **kw))
    wgs, rows_per_cta, key_split = warpgroup_layout(total, itemsize=jnp.dtype(dtype).itemsize)
    steps = -(-table.shape[1] // 2)
    log(f"{jnp.dtype(dtype).name} B={b} P={p} N={n}: default key splits: Triton prefix "
        f"{default_num_splits(b, hkv, total // (128 if total % 128 == 0 else 64), table.shape[1])}, Mosaic prefix "
        f"{default_mgpu_num_splits(b, hkv, total // rows_per_cta, steps)} (warpgroup key split: {key_split})")

    def cascade(prefix, whole):
        def f(qr, k, v, table, lens, mask):
            out, lse = prefix(qr, k, v, table, lens)
            return tree_window_row_layout(qr, k, v, table, lens, mask, out, lse, window=n, value_dim=d,
                                          prefix_whole_pages=whole, **kw)
        # Interpreted (--smoke), the two kernels run as separate calls: Pallas' Mosaic GPU
        # interpreter inside one jit with the window kernel deadlocked on a 2-core CPU
        # (its simulated warpgroups block XLA's CPU threads in callbacks).
        return f if interpret else jax.jit(f)

    # (options, prefix kernel): the defaults first, then one option flipped at a time.
    variants = [("", mgpu())]
    if not lean:
        variants += [(", softmax fence on", mgpu(fence_softmax=True)),
                     (", row tiles not adjacent", mgpu(tiles_adjacent=False))]
    if overlap and jnp.dtype(dtype).itemsize == 2 and not key_split:
        variants.append((", overlapped softmax", mgpu(overlap_softmax=True)))
    if total % 128:  # a 64-row head: the other warpgroup layout too
        if key_split:
            variants.append((", no warpgroup key split", mgpu(key_split=False)))
        else:
            variants.append((", warpgroup key split", mgpu(key_split=True)))
        variants.append((", warpgroup key split, 1 page/step, 4 stages",
                         mgpu(key_split=True, stages=4, pages_per_step=1)))
    variants += [(f", {ns} splits", mgpu(num_splits=ns)) for ns in splits]
    if widen and jnp.dtype(dtype).itemsize == 1:
        # The default widens V in the memory warpgroup (no key split) and launches persistent where
        # the items outnumber the SMs; against it: each compute warpgroup widening its own copy (the
        # earlier default), the gridded launch, and the memory warpgroup given 56 registers (the
        # compute ones 224), the default where the memory warpgroup widens (results: registers).
        variants += [(", compute warpgroups widen V", mgpu(memory_widens_values=False)),
                     (", gridded", mgpu(persistent=False)),
                     (", registers 224/56", mgpu(registers=(224, 56))),
                     (", gridded, registers 224/56", mgpu(persistent=False, registers=(224, 56)))]
    variants += [(f", registers {c}/{m}", mgpu(registers=(c, m))) for c, m in registers]
    flop = 4 * b * n * hq * (p + n) * d
    res = {}
    # (name, function, arguments); every chained timing feeds the output into P (argument 4) the
    # same way, so the feed's cost cancels between prefix and cascade.
    runs = [(f"mgpu prefix{opts}", fn, (qr, k, v, table, lens)) for opts, fn in variants]
    if triton:
        runs.append(("triton prefix", tr, (qr, k, v, table, lens)))
    cas_args = (qr, k, v, table, lens, mask)
    runs += [(f"mgpu cascade{opts}", cascade(fn, True), cas_args) for opts, fn in variants]
    if triton:
        runs.append(("triton cascade", cascade(tr, False), cas_args))
    # Every Mosaic variant's output against the default's first (the default passed conformance);
    # one that differs is not timed.
    firsts = {}
    for name, fn, args in runs:
        try:
            if name.startswith("mgpu"):
                kind = name.split(",")[0]  # "mgpu prefix" or "mgpu cascade"
                out = jax.tree_util.tree_leaves(fn(*args))[0]
                if kind not in firsts:
                    firsts[kind] = out
                elif not rel_err(out, firsts[kind]) < 1e-2:  # splits reorder sums: bf16-level moves
                    log(f"{jnp.dtype(dtype).name} B={b} P={p} N={n}: {name} DIFFERS from the default "
                        f"(rel {rel_err(out, firsts[kind]):.2e}); not timed")
                    continue
            res[name] = time_call(fn, args, 4, interpret, samples)
            log(f"{jnp.dtype(dtype).name} B={b} P={p} N={n}: {name} {res[name] * 1e3:.3f} ms, {flop / res[name] / 1e12:.0f} TFLOP/s, "
                f"{flop / flops_rate / res[name]:.2f} of the FLOP floor's speed")
        except Exception as exc:  # noqa: BLE001
            log(f"B={b} P={p}: {name} FAILED {type(exc).__name__}: {str(exc)[:400]}")


def mla_check(interpret: bool = False, timing_too: bool = True, smoke: bool = False,
              dtypes=(jnp.bfloat16, jnp.float8_e4m3fn), registers=(), lean: bool = False) -> bool:
    """The Mosaic GPU MLA latent decode: conformance (small), then DeepSeek-V3 shapes (B=32,
    P=8192, N=16, 128 heads, latent 512 + rope 64) against the Triton latent decode and both
    cascades; for each latent cache dtype (an FP8 cache takes the FP8-quantised query). `registers`:
    also the decode under each of these (compute, memory) register budgets. `lean`: conformance of
    the default schedule only; of the other schedules' decodes only "split" timed; the cascade: the
    default only; with 16-bit caches also the fused decode (the 16-bit cascade's kernel) under the
    default and each `registers` budget, in interleaved rounds."""
    ok = True
    for dtype in dtypes:
        ok = mla_check_dtype(dtype, interpret, timing_too, smoke, registers, lean) and ok
    return ok


def mla_check_dtype(dtype, interpret: bool, timing_too: bool, smoke: bool, registers=(), lean: bool = False) -> bool:
    from pallas_kernels.attention.mla_decode import mla_decode, mla_decode_reference, quantize_query
    from pallas_kernels.attention.mla_decode_mgpu import SCHEDULES, default_schedule, mla_decode_mgpu, schedule_fits
    from treespec_jax.attention.mla import MlaCascadeConfig, mla_verify_attention

    name = jnp.dtype(dtype).name
    lora, rope, scale = (128, 64, 0.07) if smoke else (512, 64, 0.07)
    rng = np.random.default_rng(1)
    b, r, hq = 2, 16, 16
    lengths = np.array([300, 40], np.int32)
    per_req = -(-(int(lengths.max()) + r) // PAGE)
    num_pages = b * per_req + 2
    table = jnp.asarray(rng.permutation(num_pages)[: b * per_req].reshape(b, per_req).astype(np.int32))
    pool = np.full((num_pages * PAGE, lora + rope), np.nan, np.float32)
    for i in range(b):
        pos = np.arange(lengths[i] + r)
        pool[np.asarray(table)[i, pos // PAGE] * PAGE + pos % PAGE] = rng.standard_normal((len(pos), lora + rope))
    pool = jnp.asarray(pool, dtype)
    q = quantize_query(jnp.asarray(rng.standard_normal((b, r, hq, lora + rope)), jnp.bfloat16), dtype)
    lens = jnp.asarray(lengths)
    ref_out, ref_lse = mla_decode_reference(q, pool, table, lens, kv_lora_rank=lora, page_size=PAGE, scale=scale,
                                            whole_pages=True)
    ok = True
    itemsize = jnp.dtype(dtype).itemsize
    # How the two compute warpgroups share a step's scores: the default first.
    schedules = [default_schedule(dtype)] + ([] if lean else [s for s in SCHEDULES if s != default_schedule(dtype)])
    for schedule in schedules:
        if not schedule_fits(schedule, lora + rope, itemsize, lora):
            log(f"MLA {name}: schedule {schedule} does not fit shared memory at width {lora + rope}; not run")
            continue
        out, lse = mla_decode_mgpu(q, pool, table, lens, kv_lora_rank=lora, page_size=PAGE, scale=scale,
                                   schedule=schedule, interpret=interpret)
        e_out = rel_err(out, ref_out)
        lse_ok = lse_agrees(lse, ref_lse)
        ok = ok and e_out < 2e-2 and lse_ok
        log(f"MLA {name} conformance (schedule {schedule}): decode rel {e_out:.2e}, lse {'ok' if lse_ok else 'BAD'}"
            f" -> {'PASS' if e_out < 2e-2 and lse_ok else 'FAIL'}")
    # Key splits merged by `split_merge.merge_splits` (the Pallas kernel where `MergeConfig.kernel` is on):
    # the Mosaic decode (splits first) and the Triton decode (splits on axis 1), three splits each.
    from pallas_kernels.attention.mla_decode import MlaDecodeConfig
    split_forms = {"mgpu decode": lambda: mla_decode_mgpu(q, pool, table, lens, kv_lora_rank=lora, page_size=PAGE,
                                                          scale=scale, num_splits=3, interpret=interpret),
                   "triton decode": lambda: mla_decode(q, pool, table, lens, kv_lora_rank=lora, page_size=PAGE,
                                                       scale=scale, config=MlaDecodeConfig(num_splits=3),
                                                       backend="interpret" if interpret else None,
                                                       poison_outputs=True)}
    # The Triton decode reads every prefix key, the Mosaic one whole pages (the window kernel the rest).
    refs = {"mgpu decode": (ref_out, ref_lse),
            "triton decode": mla_decode_reference(q, pool, table, lens, kv_lora_rank=lora, page_size=PAGE,
                                                  scale=scale)}
    for label, run in split_forms.items():
        out, lse = run()
        e_out, lse_ok = rel_err(out, refs[label][0]), lse_agrees(lse, refs[label][1])
        ok = ok and e_out < 2e-2 and lse_ok
        log(f"MLA {name} conformance ({label}, 3 key splits): decode rel {e_out:.2e}, lse {'ok' if lse_ok else 'BAD'}"
            f" -> {'PASS' if e_out < 2e-2 and lse_ok else 'FAIL'}")
    if not ok or not timing_too:
        return ok
    flops_rate = (None if smoke else traced_matmul_flops()) or 1e12  # smoke: a placeholder rate
    b, n, hq, p = (2, 8, 8, 300) if smoke else (32, 16, 128, 8192)
    per_req = (p + n) // PAGE + 1
    table = jnp.asarray(np.random.default_rng(2).permutation(b * per_req).reshape(b, per_req), jnp.int32)
    pool = jax.random.normal(jax.random.PRNGKey(4), (b * per_req * PAGE, lora + rope), jnp.bfloat16).astype(dtype)
    q = jax.random.normal(jax.random.PRNGKey(5), (b, n, hq, lora + rope), jnp.bfloat16)
    q8 = quantize_query(q, dtype)  # what the decodes multiply (the cascades quantise q themselves)
    lens = jnp.full((b,), p, jnp.int32)
    mask = ancestor_mask(jnp.asarray(np.stack([np.r_[-1, np.random.default_rng(i).integers(0, np.arange(1, n))]
                                               for i in range(b)]).astype(np.int32)))
    flop = 2 * b * n * hq * (p + n) * (2 * lora + rope)
    kw = dict(kv_lora_rank=lora, page_size=PAGE, scale=scale)
    backend = "interpret" if smoke else None
    fns = {
        "mgpu decode": jax.jit(lambda *a: mla_decode_mgpu(*a, interpret=smoke, **kw)),
        # A request's row tiles launched apart (they read the same pages; results: grid-order).
        **({} if lean else {"mgpu decode, tiles apart": jax.jit(lambda *a: mla_decode_mgpu(
            *a, interpret=smoke, tiles_adjacent=False, **kw))}),
        **{f"mgpu decode, schedule {s}": jax.jit(lambda *a, s=s: mla_decode_mgpu(*a, interpret=smoke, schedule=s, **kw))
           for s in (("split",) if lean else SCHEDULES)},
        **{f"mgpu decode, registers {c}/{m}": jax.jit(lambda *a, rg=(c, m): mla_decode_mgpu(*a, interpret=smoke,
                                                                                             registers=rg, **kw))
           for c, m in registers},
        **({} if lean else {"triton decode": jax.jit(lambda *a: mla_decode(*a, backend=backend, **kw))}),
    }
    first = None
    for label, fn in fns.items():
        try:
            out = fn(q8, pool, table, lens)[0]
            if label == "mgpu decode":  # the default, checked against fp32 above
                first = out
            elif label.startswith("mgpu") and (first is None or not rel_err(out, first) < 1e-3):
                log(f"MLA {name}: {label} DIFFERS from the default decode or the default failed; not timed")
                ok = False
                continue
            t = time_call(fn, (q8, pool, table, lens), 3, smoke, samples=1 if smoke else 7)
            log(f"MLA {name} B={b} P={p} N={n}: {label} {t * 1e3:.3f} ms, {flop / t / 1e12:.0f} TFLOP/s "
                f"({flop / flops_rate / t:.2f} of the FLOP floor's speed)")
        except Exception as exc:  # noqa: BLE001
            log(f"MLA {name}: {label} FAILED {type(exc).__name__}: {str(exc)[:400]}")
    forms = [("mosaic_gpu", None)] + ([] if lean else [("mosaic_gpu", s) for s in SCHEDULES] + [("triton", None)])
    for kernel, schedule in forms:
        label = kernel if schedule is None else f"{kernel}, schedule {schedule}"
        cfg = MlaCascadeConfig(kv_lora_rank=lora, rope_dim=rope, page_size=PAGE, scale=scale, prefix_kernel=kernel,
                               backend=backend, schedule=schedule)
        try:
            cas = jax.jit(lambda *a, c=cfg: mla_verify_attention(*a, config=c))
            t = time_call(cas, (q, pool, table, lens, mask), 3, smoke, samples=1 if smoke else 7)
            log(f"MLA {name} B={b} P={p} N={n}: cascade ({label}) {t * 1e3:.3f} ms, "
                f"{flop / flops_rate / t:.2f} of the FLOP floor's speed")
        except Exception as exc:  # noqa: BLE001
            log(f"MLA {name}: cascade ({label}) FAILED {type(exc).__name__}: {str(exc)[:400]}")
    if registers or lean:
        # The cascade's kernel (the decode with the window fused, every cache dtype).
        ok = interleaved_forms((q8, pool, table, lens, mask), n, registers, kw, smoke, name, flop,
                               flops_rate) and ok
    return ok


def interleaved_forms(args, window, registers, kw, smoke, name, flop, flops_rate) -> bool:
    """The MLA latent decode with the tree window of `window` keys fused (the cascade's kernel)
    under its defaults, each of the `registers` budgets and, over a 16-bit cache, `p_in_ring`
    flipped, compared with the default (same bits expected; within 1e-3 relative is timed), then
    timed in two interleaved rounds (such an option moves it by about the spread between rounds)."""
    from pallas_kernels.attention.mla_decode_mgpu import default_config, mla_decode_mgpu

    forms = {"default": {}, **{f"registers {c}/{m}": dict(registers=(c, m)) for c, m in registers}}
    if jnp.dtype(args[0].dtype).itemsize == 2:
        flipped = not default_config().p_in_ring
        forms[f"p_in_ring {flipped}"] = dict(p_in_ring=flipped)
    fns = {label: jax.jit(lambda *a, o=o: mla_decode_mgpu(*a, window=window, interpret=smoke, **o, **kw))
           for label, o in forms.items()}
    what = "fused decode (the cascade's kernel)"
    ok, first = True, None
    for label, fn in list(fns.items()):
        try:
            out = np.asarray(fn(*args)[0], np.float32)
        except Exception as exc:  # noqa: BLE001 - a new form's first compile may fail; the others still run
            log(f"MLA {name}: {what}, {label} FAILED {type(exc).__name__}: {str(exc)[:400]}")
            ok = False
            del fns[label]
            continue
        if first is None:
            first = out
        elif not np.array_equal(out, first):
            err = rel_err(out, first)
            log(f"MLA {name}: {what}, {label} differs from the default's bits (rel {err:.2e})"
                f"{'' if err < 1e-3 else '; not timed'}")
            if not err < 1e-3:
                ok = False
                del fns[label]
        else:
            log(f"MLA {name}: {what}, {label}: the default's bits")
    for rnd in range(2):
        for label, fn in fns.items():
            t = time_call(fn, args, 3, smoke, samples=1 if smoke else 7)
            log(f"MLA {name} {what}, {label}, round {rnd + 1}: {t * 1e3:.3f} ms, "
                f"{flop / flops_rate / t:.2f} of the FLOP floor's speed")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--interpret", action="store_true", help="conformance only, in the interpreters (CPU)")
    ap.add_argument("--mla", action="store_true", help="also the MLA latent decode (conformance, then timing)")
    ap.add_argument("--smoke", action="store_true", help="the timing code on tiny shapes in the interpreters (CPU)")
    ap.add_argument("--skip-conformance", action="store_true")
    ap.add_argument("--shapes", default=None, help="timing shapes BxPxN,... (default: the four of issue #3)")
    ap.add_argument("--fp8", action="store_true", help="also time FP8 E4M3 pools")
    ap.add_argument("--fp8-only", action="store_true", help="time FP8 E4M3 pools only")
    ap.add_argument("--widen", action="store_true",
                    help="FP8: also time V widened by the compute warpgroups, the gridded launch and the "
                         "memory warpgroup's register budget at 56 (compute 224)")
    ap.add_argument("--no-triton", action="store_true", help="skip the Triton prefix and cascade rows")
    ap.add_argument("--forms", default=None, help="conformance of these forms only: a count N (the first N) "
                    "or a comma list of indices into the form list, e.g. 11,12,13")
    ap.add_argument("--lean", action="store_true", help="time only the defaults, the warpgroup layouts and the "
                    "key-split counts (no fence, grid-order or overlap variants)")
    ap.add_argument("--mla-dtypes", default="bf16,fp8", help="with --mla: bf16 and/or fp8 latent caches")
    ap.add_argument("--mla-lean", action="store_true", help="with --mla: conformance of the default schedule only; "
                    "time it, split, --registers, the default cascade and (16-bit) the fused decode under --registers")
    ap.add_argument("--no-overlap", action="store_true", help="leave the overlapped-softmax variant out of the timing")
    ap.add_argument("--splits", default="", help="also time the Mosaic prefix/cascade with these key-split "
                    "counts, e.g. 4,8,16")
    ap.add_argument("--registers", default="", help="also time the Mosaic prefix/cascade (and with --mla the "
                    "MLA decode) under these (compute, memory) register budgets, e.g. '224,56;240,24'")
    a = ap.parse_args(argv)
    try:
        registers = tuple(tuple(int(v) for v in pair.split(",")) for pair in a.registers.split(";") if pair.strip())
    except ValueError:
        registers = ((),)
    if any(len(pair) != 2 for pair in registers):
        ap.error(f"--registers {a.registers!r}: give compute,memory pairs separated by ';', e.g. '224,56;240,24'")
    if a.smoke:
        timing(SMOKE_SHAPES, hq=8, hkv=2, d=64, samples=1, interpret=True, dtypes=(jnp.bfloat16, jnp.float8_e4m3fn),
               splits=(2,), widen=True, registers=registers)
        return 0 if mla_check(interpret=True, timing_too=True, smoke=True, registers=registers) else 1
    timing_too = not (a.skip_timing or a.interpret)
    ok = True
    bf, f8 = jnp.bfloat16, jnp.float8_e4m3fn
    # (dtype, pages per step, stages, R, key split, options): 256-row heads (two row tiles of
    # warpgroups), then 64-row heads (the default layout per dtype, the key split forced on for bf16
    # and off for FP8), the key split forced on 256-row heads, and each warpgroup's softmax
    # overlapped with its own matmuls (off by default: it conforms but is slower, results: overlap-softmax).
    overlap = dict(overlap_softmax=True)
    widen = dict(memory_widens_values=True)  # each FP8 V page widened once, by the memory warpgroup
    forms = (
            (bf, 1, 2, 64, None, {}), (f8, 1, 2, 64, None, {}), (bf, 2, 2, 64, None, {}), (f8, 2, 2, 64, None, {}),
            (f8, 2, 3, 64, None, {}), (bf, 2, 2, 16, None, {}), (f8, 2, 2, 16, None, {}), (f8, 1, 4, 16, None, {}),
            (bf, 1, 4, 16, True, {}), (f8, 2, 2, 16, False, {}), (bf, 2, 2, 64, True, {}),
            (bf, 2, 2, 64, None, overlap), (bf, 1, 2, 64, None, overlap), (bf, 2, 2, 16, None, overlap),
            (f8, 2, 2, 64, None, widen), (f8, 1, 4, 16, None, widen), (f8, 1, 3, 64, None, widen))
    if a.forms is not None:
        # "N": the first N forms; "i,j,...": those indices ("12," is form 12 alone).
        try:
            picks = [int(v) for v in a.forms.split(",") if v.strip()]
        except ValueError:
            picks = []
        bad = [i for i in picks if not 0 <= i < len(forms)] if "," in a.forms else []
        if not picks or bad:
            ap.error(f"--forms {a.forms!r}: give a count or indices in [0, {len(forms)})")
        forms = forms[:picks[0]] if "," not in a.forms else tuple(forms[i] for i in picks)
    for dtype, pps, stages, r, ks, opts in forms:
        if a.skip_conformance:
            break
        try:
            ok = conformance(a.interpret, dtype, pps, stages, r, ks, **opts) and ok
        except Exception:  # noqa: BLE001 - a first run may find lowering problems
            traceback.print_exc()
            ok = False
    shapes = FULL_SHAPES if a.shapes is None else parse_shapes(a.shapes)
    if ok and timing_too and shapes:  # `--shapes ""`: no GQA timing (e.g. --mla alone)
        dtypes = ((jnp.float8_e4m3fn,) if a.fp8_only else
                  (jnp.bfloat16, jnp.float8_e4m3fn) if a.fp8 else (jnp.bfloat16,))
        timing(shapes, dtypes=dtypes, splits=tuple(int(v) for v in a.splits.split(",") if v), triton=not a.no_triton,
               overlap=not (a.no_overlap or a.lean), lean=a.lean, widen=a.widen, registers=registers)
    if a.mla:
        try:
            mla_dtypes = {"bf16": jnp.bfloat16, "fp8": jnp.float8_e4m3fn}
            ok = mla_check(a.interpret, timing_too, dtypes=tuple(mla_dtypes[v] for v in a.mla_dtypes.split(",")),
                           registers=registers, lean=a.mla_lean) and ok
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
