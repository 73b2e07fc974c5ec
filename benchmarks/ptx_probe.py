"""Which tensor-core and copy instructions the compiled Pallas Triton kernels use (GPU only).

    PYTHONPATH=. python3 benchmarks/ptx_probe.py --dump /tmp/ptx [--markdown $OUT/ptx.md]

Compiles the cascade prefix and window kernels and the GDN tree kernel once at a benchmark shape
with XLA's dump enabled, then counts, per PTX entry point in any dumped file, the Hopper warpgroup MMA (`wgmma`), the
Ampere-style warp MMA (`mma.sync`), async copies (`cp.async`) and bulk tensor copies
(`cp.async.bulk`). A compute-bound attention kernel that shows `mma.sync` and no `wgmma` runs at
most about half the H200's bf16 rate; this probe tells which case we are in.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections import defaultdict
from pathlib import Path

PATTERNS = {
    "wgmma": re.compile(r"wgmma\.mma_async|llvm\.nvvm\.wgmma|warp_group_dot"),
    "mma v3 layout": re.compile(r"versionMajor = 3"),
    "mma.sync": re.compile(r"\bmma\.sync|llvm\.nvvm\.mma\.|versionMajor = 2"),
    "cp.async": re.compile(r"\bcp\.async\.(?:ca|cg)|async_copy_global_to_local"),
    "cp.async.bulk": re.compile(r"\bcp\.async\.bulk|async_tma_copy"),
}


def count_ptx(folder: Path) -> dict[str, dict[str, int]]:
    """`{entry name: {instruction family: count}}` over every .ptx file under `folder`."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        entry = None
        for line in path.read_text(errors="replace").splitlines():
            m = re.search(r"\.entry\s+([\w$]+)|define\s+[^@]*@([\w$.]+)\(", line)
            if m:
                entry = f"{path.name}: {m.group(1) or m.group(2)}"
            if entry is None:
                entry = f"{path.name} (no .entry)"
            for name, pat in PATTERNS.items():
                if pat.search(line):
                    counts[entry][name] += 1
    return counts


def compile_kernels():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.attention.prefix_decode import prefix_decode
    from pallas_kernels.attention.tree_window import tree_window_attention

    rng = np.random.default_rng(0)
    b, n, hq, hkv, d, page, p = 4, 64, 32, 8, 128, 64, 4096
    pages = b * (p + n) // page + 8
    k_pool = jnp.asarray(rng.standard_normal((pages * page, hkv, d)), jnp.bfloat16)
    v_pool = jnp.asarray(rng.standard_normal((pages * page, hkv, d)), jnp.bfloat16)
    table = jnp.asarray(rng.permutation(pages)[: b * ((p + n) // page + 1)].reshape(b, -1), jnp.int32)
    lengths = jnp.full((b,), p, jnp.int32)
    q = jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.bfloat16)
    out, lse = prefix_decode(q, k_pool, v_pool, table, lengths, page_size=page)
    mask = jnp.asarray(rng.integers(0, 2**32, (b, n, 2), dtype=np.uint64), jnp.uint32)
    res = tree_window_attention(q, k_pool, v_pool, table, lengths, mask, out, lse, window=n, page_size=page)
    jax.block_until_ready(res)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dump", default="/tmp/ptx_dump", help="XLA dump folder")
    p.add_argument("--markdown", default=None, help="write the table here too")
    a = p.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit("ptx_probe must set XLA_FLAGS before jax is imported; run it as a script")
    # --xla_gpu_dump_llvmir also writes each Triton kernel's pass log (`*.triton-passes.log`, the
    # TTGIR after every pass) and the LLVM IR: plain --xla_dump_to wrote no PTX on jax 0.11.2.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={a.dump} --xla_gpu_dump_llvmir=true").strip()
    compile_kernels()
    files = sorted(p for p in Path(a.dump).rglob("*") if p.is_file())
    print(f"{len(files)} dumped files; names with ptx/triton/cubin/llir:")
    for f in files:
        if any(tag in f.name.lower() for tag in ("ptx", "triton", "cubin", "llir", "ttgir", ".ll")):
            print(f"  {f.name} ({f.stat().st_size} B)")
    counts = count_ptx(Path(a.dump))
    lines = ["| entry (or file) | " + " | ".join(PATTERNS) + " |", "|---|" + "---|" * len(PATTERNS)]
    for entry, c in sorted(counts.items()):
        if any(c.values()):
            lines.append(f"| {entry} | " + " | ".join(str(c.get(k, 0)) for k in PATTERNS) + " |")
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        Path(a.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
