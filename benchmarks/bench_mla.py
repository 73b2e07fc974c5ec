"""GPU conformance and timing of the MLA cascade (latent decode + tree window) and KV row compaction.

Run on the GPU machine from the repository root:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mla.py [--markdown FILE]

Shapes: DeepSeek-V3 MLA (128 heads, kv_lora_rank 512, rope 64), B=32, P=8192, N=16, page 64, a
random page table, random trees. One set of shapes serves both the checks and the timings, so every
kernel compiles once:

1. Conformance of the COMPILED kernels (ragged prefix lengths incl. P = 0 and P < N, NaN in every
   slot no row may read): row moves (bf16 and FP8 words) against the reference, byte for byte, and
   the donated move has no pool-sized copy in its compiled HLO; the latent decode against its fp32
   reference; the verify cascade against one dense fp32 attention. bf16 and FP8 latent caches, a few
   decode tilings; under FP8 both the native FP8 score dot and the widened one. A variant that fails
   to compile or to conform is reported and not timed.
2. Timings (device time, `timing.traced_time`: chains of 60 calls in one jit after a warm-up, traced,
   the span of their kernels per call; P = 8192 for every request):
   the verify cascade through its default prefix kernel (the Mosaic GPU latent decode on Hopper) and
   through the Pallas Triton decode at `--triton-variants` tilings, each with the decode it runs alone, the same-run baselines (byte floor = latent bytes / measured copy
   bandwidth; FLOP floor = 2*B*N*Hq*(P+N)*(2L+Dr) / measured bf16 matmul rate), and a 32-layer
   compaction of the latent pools (32 donated buffers, the path's rows moved in place).

`main(argv)` is the entry point benchmarks/gpu_suite.py imports; it returns a dict of results.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.dense import time_dense_attention
from benchmarks.report import log, lse_agrees, rel_err
from benchmarks.timing import feed_scalar, measure_ceilings, median_time, traced_time
from pallas_kernels.attention.mla_decode import MlaDecodeConfig, mla_decode, mla_decode_reference
from pallas_kernels.attention.reference import dense_tree_visibility
from pallas_kernels.row_move import move_rows, move_rows_reference
from pallas_kernels.attention import mla_decode_mgpu as mla_mgpu_module
from pallas_kernels.attention.mla_decode_mgpu import mla_decode_mgpu
from pallas_kernels.common import resolve_backend
from treespec_jax.attention.cascade import covers_tail
from treespec_jax.attention.mla import (MLA_MGPU_BLOCK_K, MlaCascadeConfig, mla_verify_attention,
                                        quantize_absorbed_query, uses_mosaic_latent_decode)
from treespec_jax.cache.paged import slot_of
from treespec_jax.cache.pools import BufferSpec, CacheGroupSpec, LayerKV
from treespec_jax.cache.routing import CompactionRouter, compact_window_rows
from treespec_jax.tree.masks import ancestor_mask

FP8 = jnp.float8_e4m3fn
B, P, N, HQ, LORA, ROPE, PAGE = 32, 8192, 16, 128, 512, 64, 64
SCALE = 192 ** -0.5  # DeepSeek-V3: (qk_nope 128 + qk_rope 64)^-1/2
LAYERS = 32

# Decode tilings tried; each that compiles and conforms is timed.
DECODE_CONFIGS = (
    MlaDecodeConfig(),  # the defaults (block_k by cache dtype, FP8 score dot, page-id prefetch)
    MlaDecodeConfig(prefetch_page_ids=False),
    MlaDecodeConfig(block_q=64, block_k=64, num_warps=8, num_stages=2),
)


TRACED_CHAIN = 60  # calls per traced chain (timing.traced_time)


def make_latent(key, rng, lengths: np.ndarray, dtype):
    """Latent pool with random rows at positions < lengths[b] + N of each request, NaN elsewhere."""
    pages_per_req = -(-(P + N) // PAGE)
    num_pages = B * pages_per_req + 3
    table = rng.permutation(num_pages)[: B * pages_per_req].reshape(B, pages_per_req).astype(np.int32)
    pos = np.arange(pages_per_req * PAGE)
    slots = table[:, pos // PAGE] * PAGE + pos % PAGE  # [B, T]
    live = pos[None, :] < (lengths + N)[:, None]
    dst = np.where(live, slots, num_pages * PAGE).reshape(-1)  # dead rows scatter out of range
    rows = jax.random.normal(key, (dst.size, LORA + ROPE), jnp.float32)
    pool = jnp.full((num_pages * PAGE, LORA + ROPE), jnp.nan, jnp.float32)
    pool = pool.at[jnp.asarray(dst)].set(rows, mode="drop").astype(dtype)
    return pool, jnp.asarray(table)


def dense_mla_reference(q, pool, table, lengths, mask):
    """One dense fp32 attention per request over its gathered latent rows (no per-head K/V copies).

    Row r sees positions < P and window position P + j iff mask bit j; value = leading LORA channels.
    """
    t = table.shape[1] * PAGE
    pos = jnp.arange(t, dtype=jnp.int32)
    slots = table[:, pos // PAGE] * PAGE + pos % PAGE
    vis = dense_tree_visibility(lengths, mask, t, N)  # [B, R, T]
    seen = jnp.any(vis, axis=1)  # [B, T]
    rows = jnp.where(seen[..., None], pool[slots].astype(jnp.float32), 0.0)  # NaN rows never enter
    s = jnp.einsum("brhc,btc->brht", q.astype(jnp.float32), rows, precision=jax.lax.Precision.HIGHEST) * SCALE
    s = jnp.where(vis[:, :, None, :], s, -jnp.inf)
    w = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("brht,btc->brhc", w, rows[..., :LORA], precision=jax.lax.Precision.HIGHEST)


def random_masks(rng) -> jax.Array:
    parents = np.full((B, N), -1, np.int32)
    for j in range(1, N):
        parents[:, j] = rng.integers(0, j, size=B)
    return ancestor_mask(jnp.asarray(parents))


# ------------------------------------------------------------------------------------------------
# Row moves and compaction
# ------------------------------------------------------------------------------------------------

def random_paths(rng, batch, n) -> np.ndarray:
    path = np.full((batch, n), -1, np.int32)
    for b in range(batch):
        length = int(rng.integers(1, n + 1))
        path[b, :length] = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), length - 1, replace=False))])
    return path


def check_row_moves(results, rng):
    """Compiled row moves vs the reference (bytes), and no pool-sized copy in the donated jit."""
    for dtype in (jnp.bfloat16, FP8):
        name = f"row_move[{jnp.dtype(dtype).name}]"
        try:
            slots = 4096
            buf = jax.random.normal(jax.random.PRNGKey(7), (slots, LORA + ROPE), jnp.float32).astype(dtype)
            bases = rng.permutation(slots // N)[:B] * N
            path = random_paths(rng, B, N)
            dst = (bases[:, None] + np.arange(N)[None]).astype(np.int32)
            src = np.where(path >= 0, bases[:, None] + path, -1).astype(np.int32)
            ref = move_rows_reference(buf, jnp.asarray(src), jnp.asarray(dst))
            expect = np.asarray(jax.lax.bitcast_convert_type(ref, jnp.uint8))
            fn = jax.jit(lambda b_, s, d: move_rows(b_, s, d), donate_argnums=0)
            hlo = fn.lower(buf, jnp.asarray(src), jnp.asarray(dst)).compile().as_text()
            pool_shape = re.escape(f"[{slots},")
            copies = [ln for ln in hlo.splitlines() if re.search(r"= \S+" + pool_shape + r".* copy\(", ln)]
            out = fn(buf, jnp.asarray(src), jnp.asarray(dst))
            same = np.array_equal(np.asarray(jax.lax.bitcast_convert_type(out, jnp.uint8)), expect)
            ok = same and not copies
            results["checks"].append((name, "bytes equal" if same else "BYTES DIFFER",
                                      f"pool copies in HLO: {len(copies)}", ok))
        except Exception as exc:  # noqa: BLE001 - report and continue
            traceback.print_exc()
            results["checks"].append((name, f"FAILED {type(exc).__name__}", str(exc)[:100], False))
        log(f"{name}: {results['checks'][-1]}")


def time_compaction(results, rng, dtype=jnp.bfloat16):
    """32 latent layers of one group (page 64), B=32 windows of N=16 at P: in-place moves."""
    pages_per_req = -(-(P + N) // PAGE)
    num_pages = B * pages_per_req
    buffers = tuple(BufferSpec(f"c{i}", (LORA + ROPE,), jnp.dtype(dtype).name) for i in range(LAYERS))
    layers = tuple(LayerKV(i, f"c{i}", None, kv_lora_rank=LORA) for i in range(LAYERS))
    group = CacheGroupSpec("latent", PAGE, num_pages, buffers, layers)
    router = CompactionRouter([group])
    key = jax.random.PRNGKey(11)
    pools = {b.name: jax.random.normal(jax.random.fold_in(key, i), group.pool_shape(b.name), jnp.float32
                                       ).astype(dtype) for i, b in enumerate(buffers)}
    table = jnp.asarray(rng.permutation(num_pages).reshape(B, pages_per_req).astype(np.int32))
    start = jnp.full((B,), P, jnp.int32)
    path = jnp.asarray(random_paths(rng, B, N))
    fn = jax.jit(lambda p, t, s, pa: compact_window_rows(router, p, {"latent": t}, s, pa), donate_argnums=0)
    holder = {"pools": pools}

    def step():
        holder["pools"] = fn(holder["pools"], table, start, path)
        return holder["pools"]["c0"]

    t = median_time(step)
    moved_bytes = 2 * int(jnp.sum((path >= 0) & (path != jnp.arange(N)[None]))) * (LORA + ROPE) * \
        jnp.dtype(dtype).itemsize * LAYERS
    results["compaction_ms"] = t * 1e3
    results["compaction_bytes"] = moved_bytes
    log(f"compaction 32 layers x latent[{group.num_slots}, {LORA + ROPE}] {jnp.dtype(dtype).name}, "
        f"B={B} N={N}: {t * 1e3:.3f} ms ({moved_bytes / 1e6:.2f} MB moved, read + write)")


# ------------------------------------------------------------------------------------------------
# MLA decode and cascade
# ------------------------------------------------------------------------------------------------

def mla_variants(dtype):
    """(label, decode config) in the order tried for this cache dtype."""
    out = []
    for i, cfg in enumerate(DECODE_CONFIGS):
        tag = (f"bq{cfg.block_q}/bk{cfg.key_block(dtype, PAGE)}/w{cfg.num_warps}/s{cfg.num_stages}"
               + ("/pf" if cfg.prefetch_page_ids else ""))
        if dtype == FP8:
            out.append((tag + "/fp8dot", dataclasses.replace(cfg, fp8_score_dot=True)))
            if i == 0:  # the widened FP8 dot once, for comparison
                out.append((tag, dataclasses.replace(cfg, fp8_score_dot=False)))
        else:
            out.append((tag, cfg))
    return out


def run_mla(results, ceilings, rng, dtype, triton_variants=1, causal_split=False, schedules=(),
            fuse_window=False):
    dname = jnp.dtype(dtype).name
    key = jax.random.PRNGKey(3)
    ragged = np.full((B,), P, np.int32)
    ragged[:4] = [0, 3, P // 2 + 5, P - 1]  # P = 0, P < N, partial last pages
    pool_chk, table = make_latent(key, rng, ragged, dtype)
    q = jax.random.normal(jax.random.fold_in(key, 1), (B, N, HQ, LORA + ROPE), jnp.float32).astype(jnp.bfloat16)
    mask = random_masks(rng)
    lengths_chk = jnp.asarray(ragged)

    q_eff = q.astype(FP8) if dtype == FP8 else q
    ref_dec = jax.jit(lambda *a: mla_decode_reference(*a, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE))(
        q, pool_chk, table, lengths_chk)
    ref_out = jax.jit(dense_mla_reference)(q_eff, pool_chk, table, lengths_chk, mask)
    jax.block_until_ready((ref_dec, ref_out))
    log(f"{dname}: references ready")

    pool, table_t = make_latent(key, rng, np.full((B,), P, np.int32), dtype)
    lengths = jnp.full((B,), P, jnp.int32)
    bw, flops = ceilings
    latent_bytes = B * (P + N) * (LORA + ROPE) * jnp.dtype(dtype).itemsize
    byte_floor = latent_bytes / bw
    flop = 2 * B * N * HQ * (P + N) * (2 * LORA + ROPE)
    flop_floor = flop / flops
    floor = max(byte_floor, flop_floor)
    time_dense_mla(results, q, pool, table_t, lengths, mask, dname)
    # (prefix kernel, tiling label, decode config, prefix_covers_tail): the cascade's default first
    # (the Mosaic GPU latent decode where it runs, every row decoded to its whole-page bound; with
    # `causal_split` also the causal split), then the Pallas Triton decode at each tiling.
    # Each row's "decode alone" is the decode that row's cascade runs.
    kind = resolve_backend(None)
    default_kernel = "mosaic_gpu" if uses_mosaic_latent_decode(
        MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE), kind,
        quantize_absorbed_query(q, dtype), pool) else "triton"
    rows = [("mosaic_gpu", "default", None, covers_tail(None, True))] if default_kernel == "mosaic_gpu" else []
    if causal_split and default_kernel == "mosaic_gpu":
        rows.append(("mosaic_gpu", "causal split", None, False))
    if default_kernel == "mosaic_gpu":  # other schedules of the latent decode's warpgroups
        for sched in schedules:
            if not mla_mgpu_module.schedule_fits(sched, LORA + ROPE, jnp.dtype(dtype).itemsize, LORA,
                                                 MLA_MGPU_BLOCK_K):
                log(f"{dname}: schedule {sched} does not fit shared memory at these widths; not run")
            elif sched != mla_mgpu_module.default_schedule(dtype):
                rows.append(("mosaic_gpu", f"schedule {sched}", None, covers_tail(None, True)))
    if fuse_window and default_kernel == "mosaic_gpu":
        # The default flipped: every cache dtype (FP8 too) fuses the window into the latent decode
        # (results: mla-fuse-window); this row keeps the window kernel.
        rows.append(("mosaic_gpu", "window kernel", None, covers_tail(None, True)))
    rows += [("triton", label, dcfg, False) for label, dcfg in mla_variants(dtype)[:triton_variants]]
    for kernel, label, dcfg, covers in rows:
        name = f"mla[{dname},{kernel},{label}]"
        # The decode's rows: as the cascade passes them (one query row of N * HQ heads when covers).
        as_dec = (lambda x: x.reshape(x.shape[0], 1, -1, x.shape[-1])) if covers else (lambda x: x)
        try:
            t0 = time.perf_counter()
            if kernel == "mosaic_gpu":
                sched = label.split()[-1] if label.startswith("schedule ") else None
                dec = jax.jit(lambda q, *a, f=as_dec, s=sched: mla_decode_mgpu(
                    f(quantize_absorbed_query(q, dtype)), *a, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                    block_k=MLA_MGPU_BLOCK_K, schedule=s, interpret=kind == "interpret"))
                ccfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE,
                                        prefix_kernel="mosaic_gpu", prefix_covers_tail=covers, schedule=sched,
                                        fuse_window={"window kernel": False, "window fused": True}.get(label))
            else:
                dec = jax.jit(lambda *a, c=dcfg: mla_decode(*a, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                                                            config=c))
                ccfg = MlaCascadeConfig(kv_lora_rank=LORA, rope_dim=ROPE, page_size=PAGE, scale=SCALE, decode=dcfg,
                                        prefix_kernel="triton")
            # Checked with NaN-poisoned outputs where the kernel takes them (every element written),
            # timed as the cascade runs it (no poison fill).
            check_dec = dec if kernel == "mosaic_gpu" else jax.jit(
                lambda *a, c=dcfg: mla_decode(*a, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE, config=c,
                                              poison_outputs=True))
            out, lse = check_dec(q, pool_chk, table, lengths_chk)
            # The Mosaic decode covers whole pages only (the window kernel takes the partial last
            # page), so it is checked against the whole-pages reference of the rows it decodes.
            ref = ref_dec if kernel != "mosaic_gpu" else jax.jit(
                lambda *a: mla_decode_reference(*a, kv_lora_rank=LORA, page_size=PAGE, scale=SCALE,
                                                whole_pages=True))(as_dec(q_eff), pool_chk, table, lengths_chk)
            e_dec = rel_err(out, ref[0])
            lse_ok = lse_agrees(lse, ref[1])
            cas = jax.jit(lambda *a, c=ccfg: mla_verify_attention(*a, config=c))
            e_cas = rel_err(cas(q, pool_chk, table, lengths_chk, mask), ref_out)
            ok = e_dec < 2e-2 and e_cas < 2e-2 and lse_ok
            results["checks"].append((name, f"decode rel {e_dec:.2e}, lse {'ok' if lse_ok else 'BAD'}",
                                      f"cascade rel {e_cas:.2e}", ok))
            log(f"{name}: decode {e_dec:.2e} lse_ok={lse_ok} cascade {e_cas:.2e} "
                f"({time.perf_counter() - t0:.1f}s incl. compile)")
            if not ok:
                continue
            # Device time: calls chained in one jit, each fed the last one's output through P, traced
            # after an idle second (timing.traced_time), as the matmul ceiling is.
            t_cas = traced_time(cas, (q, pool, table_t, lengths, mask), feed_scalar(3), inner=TRACED_CHAIN)
            t_dec = traced_time(dec, (q, pool, table_t, lengths), feed_scalar(3), inner=TRACED_CHAIN)
        except Exception as exc:  # noqa: BLE001 - a variant that does not compile is reported, not fatal
            traceback.print_exc()
            results["checks"].append((name, f"FAILED {type(exc).__name__}", str(exc)[:100], False))
            log(f"{name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            continue
        row = dict(dtype=dname, kernel=kernel, variant=label, cascade_ms=t_cas * 1e3, decode_ms=t_dec * 1e3,
                   byte_floor_ms=byte_floor * 1e3, flop_floor_ms=flop_floor * 1e3,
                   vs_floor=t_cas / floor, window_overhead=t_cas / t_dec - 1, tflops=flop / t_cas / 1e12)
        results["timings"].append(row)
        log(f"{dname} {kernel} {label}: cascade {t_cas * 1e3:.3f} ms, decode alone {t_dec * 1e3:.3f} ms, byte floor "
            f"{byte_floor * 1e3:.3f} ms, FLOP floor {flop_floor * 1e3:.3f} ms, {t_cas / floor:.2f}x floor, "
            f"{flop / t_cas / 1e12:.0f} TFLOP/s")


def time_dense_mla(results, q, pool, table, lengths, mask, dname):
    """XLA dense masked attention over the gathered latent rows (one KV head; key = the whole row,
    value = its leading LORA channels), the baseline the issue asks for; gather not timed."""
    t = table.shape[1] * PAGE
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (B, t))
    rows = pool[slot_of(table, pos, PAGE)].astype(jnp.bfloat16)  # [B, T, LORA + ROPE]
    vis = dense_tree_visibility(lengths, mask, t, N)
    impl, sec = time_dense_attention(q, rows[:, :, None, :], rows[:, :, None, :LORA], vis, SCALE, samples=5)
    results.setdefault("dense", []).append((dname, impl, sec * 1e3))
    log(f"{dname}: dense XLA baseline ({impl}) {sec * 1e3:.3f} ms")


def markdown(results) -> str:
    bw, flops = results["ceilings"]
    lines = [f"### MLA cascade + KV compaction ({results['date']}, {results['device']}, jax {jax.__version__})",
             "",
             f"Command: `{results['command']}`. Shapes: B={B}, P={P}, N={N}, Hq={HQ}, kv_lora_rank={LORA}, "
             f"rope={ROPE}, page {PAGE}, random page table, random trees. Ceilings measured in the same run: "
             f"copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul {flops / 1e12:.0f} TFLOP/s.",
             "",
             "| check | result | detail | ok |", "| --- | --- | --- | --- |"]
    for name, a, b, ok in results["checks"]:
        lines.append(f"| {name} | {a} | {b} | {'yes' if ok else 'NO'} |")
    lines += ["", "| latent | prefix kernel | decode tiling | cascade ms | decode alone ms | byte floor ms | FLOP floor ms | "
              "cascade / max(floor) | window overhead | TFLOP/s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results["timings"]:
        lines.append(f"| {r['dtype']} | {r['kernel']} | {r['variant']} | {r['cascade_ms']:.3f} | {r['decode_ms']:.3f} | "
                     f"{r['byte_floor_ms']:.3f} | {r['flop_floor_ms']:.3f} | {r['vs_floor']:.2f}x | "
                     f"{100 * r['window_overhead']:.1f}% | {r['tflops']:.0f} |")
    for dname, impl, ms in results.get("dense", []):
        lines.append(f"\nDense masked attention in XLA over the gathered {dname} latent rows ({impl}, gather not "
                     f"timed): {ms:.3f} ms.")
    if "compaction_ms" in results:
        lines += ["", f"Compaction, {LAYERS} latent layers (bf16, [S, {LORA + ROPE}] each, B={B}, N={N}, random "
                  f"accepted paths, pools donated): {results['compaction_ms']:.3f} ms for "
                  f"{results['compaction_bytes'] / 1e6:.2f} MB read+written."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", help="write the results section to this file")
    parser.add_argument("--skip-fp8", action="store_true", help="bf16 latent cache only")
    parser.add_argument("--skip-bf16", action="store_true", help="FP8 latent cache only")
    parser.add_argument("--causal-split", action="store_true",
                        help="also the Mosaic cascade with MlaCascadeConfig(prefix_covers_tail=False)")
    parser.add_argument("--schedules", default="",
                        help="also the Mosaic cascade under these latent-decode schedules (comma list of "
                        f"{mla_mgpu_module.SCHEDULES}; the dtype's default is the default row)")
    parser.add_argument("--fuse-window", action="store_true",
                        help="also the Mosaic cascade with the window kernel (the default fuses the window "
                        "into the latent decode)")
    parser.add_argument("--skip-moves", action="store_true", help="skip the row-move checks and compaction timing")
    parser.add_argument("--triton-variants", type=int, default=1,
                        help="how many Triton latent-decode tilings to check and time besides the default cascade")
    args = parser.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("bench_mla: needs a GPU (jax.default_backend() is "
              f"{jax.default_backend()!r}); nothing run", file=sys.stderr)
        return {"skipped": True}
    results = {"checks": [], "timings": [], "device": jax.devices()[0].device_kind,
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": "PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/bench_mla.py " + " ".join(argv or [])}
    rng = np.random.default_rng(0)
    results["ceilings"] = measure_ceilings()
    log(f"ceilings: copy {results['ceilings'][0] / 1e12:.2f} TB/s, matmul {results['ceilings'][1] / 1e12:.0f} TFLOP/s")
    if not args.skip_moves:
        check_row_moves(results, rng)
        try:
            time_compaction(results, rng)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
    for dtype in (() if args.skip_bf16 else (jnp.bfloat16,)) + (() if args.skip_fp8 else (FP8,)):
        run_mla(results, results["ceilings"], rng, dtype, triton_variants=args.triton_variants,
                causal_split=args.causal_split,
                schedules=tuple(v for v in args.schedules.split(",") if v), fuse_window=args.fuse_window)
    text = markdown(results)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    return results


if __name__ == "__main__":
    res = main(sys.argv[1:])
    sys.exit(0 if res.get("skipped") or all(c[3] for c in res["checks"]) else 1)
