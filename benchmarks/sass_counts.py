"""Static counts of a kernel source's sm_90 machine code, on a machine without a GPU.

Builds SOURCE (a file of kernels/cuda/common, or a path under kernels/ such as
``sm_90/common/gemm_wgmma.cu``) for sm_90a with DEFINES, as bench_gpu_variants.py builds its
variants (the build's compiler, flags and header chain), lists the cubin with ``cuobjdump``, and
for each entry reports:
- its registers and stack bytes, and its local-memory loads and stores (spills);
- its instructions and its tensor-core instructions (HMMA, HGMMA);
- its ten most frequent opcodes;
- ``gaps``: the instructions between consecutive tensor-core instructions.

A loop's body shows up there as a repeating run of gaps. Version 34 judged fp4's e2m1 placement
by these counts before any device time (``docs/gpu-notes.md``). They are counts of the code, not
of what runs: a figure of speed still comes only from the GPU.

    python3 benchmarks/sass_counts.py gemv_mma.cu --defines "ACT_BF16 WEIGHT_MXFP4 K_BLOCK=256" \\
        [--baseline OTHER.cu] [--name sass_gemv_mma_mxfp4]

``--baseline`` builds another source with the same defines, and each entry's line gives the
baseline's figures beside this source's. Writes ``benchmarks/results/NAME.json`` (default
``sass_<source stem>.json``).
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import result_name, write_result  # noqa: E402
from bench_gpu_variants import build  # noqa: E402

TENSOR = ("HMMA", "HGMMA")
# an instruction line of `cuobjdump -sass`: /*0a70*/  [@P0 ]OPCODE.MODIFIERS operands ;
INSTRUCTION = re.compile(r"\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)\S*")
RESOURCES = re.compile(r"Function (\S+):\s*REG:(\d+)\s+STACK:(\d+)")


def entries_of(sass: str) -> dict[str, list[str]]:
    """Each function's opcodes (no modifiers) in order, from a ``cuobjdump -sass`` listing."""
    out: dict[str, list[str]] = {}
    current = None
    for line in sass.splitlines():
        head = re.match(r"\s*Function : (\S+)", line)
        if head:
            current = out.setdefault(head.group(1), [])
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            current.append(m.group(1))
    return out


def resources_of(listing: str) -> dict[str, tuple[int, int]]:
    """Each function's (registers, stack bytes), from ``cuobjdump --dump-resource-usage``."""
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in RESOURCES.finditer(listing)}


def summary(ops: list[str], registers: int, stack: int) -> dict[str, Any]:
    """One entry's figures (the module docstring lists them)."""
    at = [i for i, op in enumerate(ops) if op in TENSOR]
    return {"registers": registers, "stack_bytes": stack,
            "spill_loads": ops.count("LDL"), "spill_stores": ops.count("STL"),
            "instructions": len(ops), "tensor": len(at),
            "top": collections.Counter(ops).most_common(10),
            "gaps": [b - a - 1 for a, b in zip(at, at[1:])]}


def count(source: str, defines: str, tmp: Path) -> dict[str, dict[str, Any]]:
    """Every entry of ``source`` built with ``defines``: its summary."""
    tool = shutil.which("cuobjdump")
    if tool is None:
        raise SystemExit("sass_counts: cuobjdump is not on PATH (it comes with nvcc)")
    cubin = build(source, defines, tmp / (Path(source).stem + ".cubin"))
    sass = subprocess.run([tool, "-sass", str(cubin)], check=True, capture_output=True,
                          text=True).stdout
    res = resources_of(subprocess.run([tool, "--dump-resource-usage", str(cubin)], check=True,
                                      capture_output=True, text=True).stdout)
    return {name: summary(ops, *res.get(name, (0, 0))) for name, ops in entries_of(sass).items()}


def line(name: str, s: dict[str, Any], base: dict[str, Any] | None) -> str:
    """One entry as a line: registers, stack, spills, instructions, tensor instructions."""
    def pair(key: str) -> str:
        return f"{s[key]}" if base is None else f"{s[key]} (base {base[key]})"
    return (f"{name}: registers {pair('registers')}, stack {pair('stack_bytes')}, spill "
            f"ld/st {s['spill_loads']}/{s['spill_stores']}, instructions {pair('instructions')},"
            f" tensor {pair('tensor')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("source")
    ap.add_argument("--defines", default="", help="space-separated NAME or NAME=VALUE")
    ap.add_argument("--baseline", help="another source, built with the same defines")
    ap.add_argument("--name", type=result_name, help="the results file's stem")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        ours = count(a.source, a.defines, tmp)
        (tmp / "base").mkdir()
        base = count(a.baseline, a.defines, tmp / "base") if a.baseline else {}
    for name, s in sorted(ours.items()):
        print(line(name, s, base.get(name)))
    path = write_result(a.name or f"sass_{Path(a.source).stem}",
                        {"source": a.source, "defines": a.defines, "arch": "sm_90a",
                         "baseline": a.baseline, "entries": ours, "baseline_entries": base})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
