"""Registers and spills of the Mosaic GPU attention kernels as ptxas reports them (GPU only).

    PYTHONPATH=. python3 benchmarks/tools/ptxas_report.py [--mla-only | --gqa-only] [--only TEXT] [--ptx-dir DIR]

A diagnostic (logs only). Mosaic GPU hands each kernel to ptxas; with MOSAIC_GPU_DUMP_PTXAS=1 (read
by jaxlib when it compiles) ptxas' verbose resource lines go to the process's output among the
dumped modules. (With MOSAIC_GPU_DUMP_TO also set they go to that folder instead, a `.ptxas` file
beside each kernel's `.ptx`, and none reach the output.) So this
compiles the forms below in a child process with that variable set, captures its output and
prints, per form, the resource figures found after it compiled: registers, spill stores / loads,
stack frames. A warpgroup-specialised kernel reports one register count for
the whole kernel (the per-warpgroup budgets are `setmaxnreg` at run time), so spills are the figure
to read: a compute or memory warpgroup that outgrows its budget shows up as spill stores and loads.
With `--ptx-dir DIR` it keeps each form's PTX there instead, for `benchmarks/tools/sass_spills.py`, which
says in which loop the spills sit.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.bench_cascade import PAGE, cascade_inputs  # noqa: E402
from benchmarks.report import log  # noqa: E402
from treespec_jax.attention.cascade import CascadeConfig, verify_attention  # noqa: E402
from treespec_jax.tree.masks import ancestor_mask  # noqa: E402

# (label, B, P, N, KV dtype): the default forms the shapes take, at a small P.
FORMS = (("bf16 fused, 128-row heads (B=1 / B=32 / B=64 form)", 1, 2048, 64, jnp.bfloat16),
         ("bf16 fused, persistent (B=64 form)", 160, 256, 64, jnp.bfloat16),
         ("FP8 unfused, V widened by the memory warpgroup (B=1 form)", 1, 2048, 64, jnp.float8_e4m3fn),
         ("FP8 unfused, widened, persistent (B=32 / B=64 form)", 160, 256, 64, jnp.float8_e4m3fn),
         ("FP8 fused, 64-row heads, key split (B=8 form)", 8, 2048, 16, jnp.float8_e4m3fn))

# (label, latent cache dtype, fused window): the MLA latent decode's default forms (DeepSeek-V3
# widths: latent 512 + rope 64, 128 heads; a small batch and prefix, as only compilation matters).
MLA_FORMS = (("MLA bf16 decode, tree window fused (the bf16 cascade's form)", jnp.bfloat16, True, {}),
             ("MLA FP8 decode, tree window fused (the FP8 cascade's form)", jnp.float8_e4m3fn, True, {}),
             ("MLA FP8 decode, tree window fused, values widened 128 channels at a time", jnp.float8_e4m3fn, True,
              dict(widen_cols=128)),
             ("MLA FP8 decode, tree window fused, values widened in one piece (widen_cols=256)", jnp.float8_e4m3fn,
              True, dict(widen_cols=256)),
             ("MLA bf16 decode, tree window fused, P in a buffer of its own (p_in_ring=False)", jnp.bfloat16,
              True, dict(p_in_ring=False)),
             ("MLA bf16 decode, tree window fused, descriptors hoisted out of the loop (loop_descriptors=False)",
              jnp.bfloat16, True, dict(loop_descriptors=False)),
             ("MLA FP8 decode, tree window fused, descriptors hoisted out of the loop (loop_descriptors=False)",
              jnp.float8_e4m3fn, True, dict(loop_descriptors=False)))

# ptxas' figures; the captured output also holds binary module text, so match the figures alone.
RESOURCE = re.compile(rb"Used \d+ registers[^\\\n]{0,60}|\d+ bytes spill stores, \d+ bytes spill loads|"
                      rb"\d+ bytes stack frame")
COMPILED = re.compile(rb"\[ *[\d.]+s\] compiled and ran: [^\n]*")


def compile_forms(mla_only: bool = False, only: str = "", gqa_only: bool = False):
    rng = np.random.default_rng(0)
    key = jax.random.key(0)
    cfg = CascadeConfig(page_size=PAGE, prefix_kernel="mosaic_gpu")
    for label, b, p, n, dtype in () if mla_only else [f for f in FORMS if only in f[0]]:
        q, kp, vp, table, lengths, mask = cascade_inputs(key, rng, b, p, n, dtype)
        out = jax.block_until_ready(jax.jit(lambda *a: verify_attention(*a, config=cfg))(
            q, kp, vp, table, lengths, mask))
        finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
        log(f"compiled and ran: {label} (B={b}, P={p}, N={n}); output finite: {finite}")
    from pallas_kernels.attention.mla_decode import quantize_query
    from pallas_kernels.attention.mla_decode_mgpu import mla_decode_mgpu
    b, p, n, hq, lora, rope = 2, 1024, 16, 128, 512, 64
    per_req = (p + n) // PAGE + 1
    table = jnp.asarray(rng.permutation(b * per_req).reshape(b, per_req), jnp.int32)
    lens = jnp.full((b,), p, jnp.int32)
    parents = np.stack([np.r_[-1, rng.integers(0, np.arange(1, n))] for _ in range(b)]).astype(np.int32)
    mask = ancestor_mask(jnp.asarray(parents))  # [B, N, 2] uint32
    for label, dtype, fused, opts in [f for f in MLA_FORMS if only in f[0] and not gqa_only]:
        pool = jax.random.normal(key, (b * per_req * PAGE, lora + rope), jnp.bfloat16).astype(dtype)
        q = quantize_query(jax.random.normal(key, (b, n, hq, lora + rope), jnp.bfloat16), dtype)
        extra = dict(window=n, **opts) if fused else dict(opts)
        out, _ = jax.block_until_ready(mla_decode_mgpu(q, pool, table, lens, mask if fused else None,
                                                       kv_lora_rank=lora, page_size=PAGE, scale=0.07, **extra))
        finite = bool(np.isfinite(np.asarray(out, np.float32)).all())
        log(f"compiled and ran: {label} (B={b}, P={p}, N={n}); output finite: {finite}")


def report(output: bytes) -> int:
    """Prints each form's line and the ptxas figures that precede it (ptxas runs at compile time,
    before the form's log line); returns how many figures were found."""
    found, pending = 0, []
    for m in re.finditer(COMPILED.pattern + b"|" + RESOURCE.pattern, output):
        text = m.group().decode(errors="replace")
        if COMPILED.fullmatch(m.group()):
            print(text)
            for fig in dict.fromkeys(pending):  # each figure once (ptxas repeats the spill line)
                print("    " + fig)
            pending = []
        else:
            pending.append(text)
            found += 1
    for fig in dict.fromkeys(pending):
        print("    (after the last form) " + fig)
    log(f"{found} ptxas resource figures")
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mla-only", action="store_true", help="only the MLA latent decode's forms")
    ap.add_argument("--gqa-only", action="store_true", help="only the GQA prefix kernel's forms")
    ap.add_argument("--only", default="", help="only the forms whose label holds this text")
    ap.add_argument("--ptx-dir", help="also keep the PTX of each form here (as NN.ptx, in form order), for "
                    "benchmarks/tools/sass_spills.py on a machine with ptxas and nvdisasm")
    ap.add_argument("--compile-only", action="store_true", help="(the child process) compile the forms and exit")
    a = ap.parse_args(argv)
    if jax.default_backend() != "gpu":
        print("ptxas_report: needs a GPU (Mosaic GPU compiles only there)")
        return 1
    if a.compile_only:
        compile_forms(a.mla_only, a.only, a.gqa_only)
        return 0
    env = {k: v for k, v in os.environ.items() if k != "MOSAIC_GPU_DUMP_TO"}
    with tempfile.TemporaryDirectory() as dump:
        if a.ptx_dir:
            # With a dump folder, Mosaic writes each kernel's PTX and ptxas lines there (beside
            # hundreds of MB of MLIR pass logs per kernel, which stay in the temporary folder).
            env.update(MOSAIC_GPU_DUMP_TO=dump, MOSAIC_GPU_DUMP_PTX="1")
        child = subprocess.run([sys.executable, __file__, "--compile-only", "--only", a.only]
                               + (["--mla-only"] if a.mla_only else []) + (["--gqa-only"] if a.gqa_only else []),
                               env=dict(env, MOSAIC_GPU_DUMP_PTXAS="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, check=False)
        if child.returncode:
            print(child.stdout[-4000:].decode(errors="replace"))
            log(f"the compiling process failed (exit {child.returncode})")
            return 1
        if not a.ptx_dir:
            return 0 if report(child.stdout) else 1
        return keep_ptx(Path(dump), Path(a.ptx_dir), child.stdout)


def keep_ptx(dump: Path, target: Path, output: bytes) -> int:
    """Copies each dumped kernel's PTX to `target` as NN.ptx (compile order, which is form order) and
    prints each form's line with its ptxas figures (dumped beside the PTX, not to the output)."""
    target.mkdir(parents=True, exist_ok=True)
    forms = [m.group().decode(errors="replace") for m in COMPILED.finditer(output)]
    ptx = sorted(dump.glob("*.ptx"), key=lambda f: f.stat().st_mtime)
    for n, f in enumerate(ptx):
        shutil.copy(f, target / f"{n:02d}.ptx")
        print(f"{n:02d}.ptx: {forms[n] if n < len(forms) else f.name}")
        figures = f.with_suffix(".ptxas").read_bytes() if f.with_suffix(".ptxas").exists() else b""
        for fig in dict.fromkeys(m.group().decode(errors="replace") for m in RESOURCE.finditer(figures)):
            print("    " + fig)
    log(f"{len(ptx)} PTX files kept in {target}")
    return 0 if ptx else 1


if __name__ == "__main__":
    raise SystemExit(main())
