"""The whole GPU suite in one device call: conformance of every compiled kernel, then timings.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_suite.py --quick --out $OUT 2>&1 | tee $OUT/suite.log
    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 benchmarks/gpu_suite.py --owed --out $OUT   # what is still owed

The conformance of the compiled kernels is the pytest `gpu` tier (`tests`, first): tests/gpu/ at
serving widths and every kernel test's compiled case, each against its fp32 reference; alone:

    python -m pytest -m "gpu and not sweep"      # (-m gpu: the sweep tier's compiled cases too)

Then each benchmark module's `main(argv)` in turn (cascade, mla, gdn, mamba2, mosaic, launches; their
own conformance passes are kept: each gates its timings); a failure in one is reported and the
others still run. On the device machine the working tree is a copy, so with
`--out DIR` every module that writes a dated markdown section writes it to DIR/<module>.md instead
of appending to that copy's benchmarks/RESULTS.md (bring the files back and append them here).
This driver prints a one-line status per module last.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

def run_gpu_tests(argv) -> int:
    """The pytest gpu tier in a child process (its conftest sets JAX up before the first array)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    return subprocess.call([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *argv], cwd=root)


# The pytest tier's flags: addopts' -q is cleared so that each case's outcome prints as it finishes
# (benchmarks/gpu_tier.sh runs the same tier in parallel workers under a time limit).
TIER_FLAGS = ["-o", "addopts=", "-v", "-rfE"]

# name -> (module or callable taking argv, quick-mode flags, flags that send its markdown section to a file)
SUITES = {
    "tests": (run_gpu_tests, [*TIER_FLAGS, "-m", "gpu and not sweep"], lambda md: ["--junitxml", str(Path(md).with_suffix(".xml"))]),
    "cascade": ("benchmarks.bench_cascade", ["--quick"], lambda md: ["--markdown", md, "--no-results"]),
    "mla": ("benchmarks.bench_mla", [], lambda md: ["--markdown", md]),
    "gdn": ("benchmarks.bench_gdn", ["--quick", "--no-fla"], lambda md: ["--markdown", md, "--no-results"]),
    "mamba2": ("benchmarks.bench_mamba2", ["--quick"], lambda md: ["--markdown", md]),
    # The Mosaic GPU kernels alone (bf16/FP8, 1/2 pages per step, MLA) against the Triton ones; it
    # logs, it writes no markdown section.
    "mosaic": ("benchmarks.tools.mgpu_prefix_check", ["--shapes", "32x32768x64,8x8192x16", "--fp8"], lambda md: []),
    # The fused GQA kernel's launches (gridded, persistent without and with prefetch_query), bit-checked
    # and timed in interleaved rounds; it logs, it writes no markdown section.
    "launches": ("benchmarks.tools.fused_window_cost", ["--launches", "--shapes", "64x4096x64"], lambda md: []),
    # The cascade and the matmul ceiling in two power states (after idle, under load); logs only.
    "power": ("benchmarks.tools.power_state", ["--shapes", "64x4096x64", "--rounds", "1"], lambda md: []),
    # Per-kernel device times of the default cascade at the small shapes (profiler trace); logs only.
    "profile": ("benchmarks.kernel_profile", ["--dtypes", "bf16"], lambda md: []),
    # ptxas' registers and spills of the Mosaic kernels; with --out, each form's PTX is kept in
    # OUT/ptx for benchmarks/tools/sass_spills.py (at most 8 files come back from the device: pick forms).
    "ptxas": ("benchmarks.tools.ptxas_report", ["--mla-only"], lambda md: ["--ptx-dir", str(Path(md).parent / "ptx")]),
}
# Flags a module gets in the full (not --quick) run beyond its defaults.
FULL_ARGS = {"tests": [*TIER_FLAGS, "-m", "gpu"], "mosaic": ["--fp8", "--mla"], "mla": ["--fuse-window"],
             "launches": ["--launches", "--shapes", "64x4096x64,32x32768x64"]}

# What is still owed (`--owed`), suite name -> that module's arguments: whoever builds what they
# cannot run lists the runs here (benchmarks/RESULTS.md records each payment).
OWED: dict[str, list[str]] = {
    # 2026-12-04: the tier was cut at its limit twice with 3-4 unnamed failures (archive/2026-12-04.md).
    "tests": [*TIER_FLAGS, "-m", "gpu and not sweep"],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="each module's quick mode")
    p.add_argument("--owed", action="store_true", help=f"only the measurements still owed ({sorted(OWED)})")
    p.add_argument("--only", default=None, help=f"comma list of {sorted(SUITES)}")
    p.add_argument("--out", default=None, help="folder for each module's markdown section (e.g. $OUT)")
    a = p.parse_args(argv)
    if a.owed and not OWED and not a.only:
        print("gpu_suite --owed: nothing is owed (benchmarks/RESULTS.md, summary)")
        return 0
    default = OWED if a.owed else SUITES
    names = [n for n in (a.only or ",".join(default)).split(",") if n]
    unknown = [n for n in names if n not in SUITES]
    if unknown:
        p.error(f"unknown suites {unknown}; choose from {sorted(SUITES)}")
    status = {}
    for name in names:
        module, quick_args, markdown_args = SUITES[name]
        mode_args = OWED.get(name, []) if a.owed else (quick_args if a.quick else FULL_ARGS.get(name, []))
        argv = mode_args + (markdown_args(str(Path(a.out) / f"{name}.md")) if a.out else [])
        t0 = time.perf_counter()
        try:
            code = module(argv) if callable(module) else importlib.import_module(module).main(argv)
            ok = code in (None, 0) or isinstance(code, dict)
            status[name] = f"{'ok' if ok else f'FAILED (exit {code})'} in {time.perf_counter() - t0:.0f} s"
        except Exception:  # keep going: one broken module must not hide the others' numbers
            traceback.print_exc()
            status[name] = f"ERROR after {time.perf_counter() - t0:.0f} s"
    print("\n== gpu_suite ==")
    for name, line in status.items():
        print(f"{name:8s} {line}")
    return 0 if all(v.startswith("ok") for v in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
