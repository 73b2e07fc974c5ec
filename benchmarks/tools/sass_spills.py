"""Where a Mosaic GPU kernel spills: local loads and stores per loop of its SASS (runs on the CPU).

    # on the GPU machine: keep the PTX Mosaic generates for the ptxas_report forms
    PYTHONPATH=. python3 benchmarks/tools/ptxas_report.py --mla-only --only "bf16" --ptx-dir $OUT/ptx
    # here, with a CUDA toolkit's ptxas and nvdisasm (e.g. the nvidia-cuda-nvdisasm wheel):
    python3 benchmarks/tools/sass_spills.py DIR [--ptxas ptxas] [--nvdisasm nvdisasm]

A diagnostic (no GPU needed once the PTX is here). ptxas' totals (`ptxas_report.py`) say how many
bytes spill, not where; a spill outside the key loop costs nothing, one inside it costs every
step. This assembles each `*.ptx` in DIR for sm_90a (`ptxas -v`: its spill totals should equal the
device's, as they do with ptxas 13.0), disassembles it and prints, per loop (a body ending
in a conditional backward branch; the wait-retry branches Mosaic's barrier waits place after the
kernel's code are unconditional and not loops), its instruction count and its local stores (STL),
local loads (LDL), wgmma instructions (HGMMA) and exp2s (MUFU.EX2). A key loop that reloads hoisted
wgmma descriptors from local memory every step shows here as LDLs before its HGMMAs (what
`MlaMgpuConfig.loop_descriptors` prevents; results: loop-descriptors).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*)")
LABEL = re.compile(r"^\s*\.(L_x_\d+):")
BRANCH = re.compile(r"^(@!?U?P\d+\s+)?BRA(?:\.\w+)*\s+`?\(?\.(L_x_\d+)")
MIN_LOOP = 16  # instructions; shorter backward branches are spin loops on a barrier


def opcode(text: str) -> str:
    """The instruction's opcode with its modifiers ("LDL.64"), past any predicate ("@P0")."""
    parts = text.split()
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def instructions(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """(address, text) of every instruction, and each label's address (its next instruction's)."""
    out, labels, pending = [], {}, []
    for line in sass.splitlines():
        if m := LABEL.match(line):
            pending.append(m.group(1))
        elif m := ADDRESS.search(line):
            address = int(m.group(1), 16)
            out.append((address, m.group(2).strip()))
            labels.update((name, address) for name in pending)
            pending = []
    return out, labels


def tally(texts) -> dict:
    """Local stores and loads, wgmmas and exp2s among these instructions (predicated ones too)."""
    ops = [opcode(t) for t in texts]
    count = lambda op: sum(o.startswith(op) for o in ops)  # noqa: E731
    return dict(stl=count("STL"), ldl=count("LDL"), hgmma=count("HGMMA"), ex2=count("MUFU.EX2"))


def loops(sass: str, parsed=None) -> list[dict]:
    """One row per loop: its address range and counts (see the module docstring). `parsed`:
    `instructions(sass)` where the caller has it already."""
    ins, labels = parsed or instructions(sass)
    rows = []
    for address, text in ins:
        m = BRANCH.match(text)
        if not m or not m.group(1) or labels.get(m.group(2), address + 1) > address:
            continue
        body = [t for a, t in ins if labels[m.group(2)] <= a <= address]
        if len(body) < MIN_LOOP:
            continue
        rows.append(dict(start=labels[m.group(2)], end=address, size=len(body), **tally(body)))
    return rows


def report(ptx: Path, ptxas: str, nvdisasm: str) -> None:
    cubin = ptx.with_suffix(".cubin")
    built = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)], capture_output=True, text=True)
    print(f"== {ptx.name}")
    for line in (built.stdout + built.stderr).splitlines():
        if "spill" in line or "registers" in line:
            print("   " + line.strip())
    if built.returncode:
        print(f"   ptxas failed (exit {built.returncode})")
        return
    sass = subprocess.run([nvdisasm, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    parsed = instructions(sass)
    total = tally(t for _, t in parsed[0])
    print(f"   {len(parsed[0])} instructions, {total['stl']} STL, {total['ldl']} LDL in all")
    for row in loops(sass, parsed):
        print(f"   loop {row['start']:#07x}-{row['end']:#07x}: {row['size']:5d} instructions, STL {row['stl']:3d}, "
              f"LDL {row['ldl']:3d}, HGMMA {row['hgmma']:3d}, MUFU.EX2 {row['ex2']:3d}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="a folder of *.ptx files (ptxas_report.py --ptx-dir)")
    ap.add_argument("--ptxas", default="ptxas")
    ap.add_argument("--nvdisasm", default="nvdisasm")
    a = ap.parse_args(argv)
    files = sorted(a.dir.glob("*.ptx"))
    if not files:
        print(f"sass_spills: no *.ptx in {a.dir}", file=sys.stderr)
        return 1
    for ptx in files:
        report(ptx, a.ptxas, a.nvdisasm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
