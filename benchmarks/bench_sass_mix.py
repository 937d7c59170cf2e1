"""What the decode GEMVs' hot loops issue, read from their sm_90a machine code, against the FMA floor.

The exact multi-row GEMVs are bound by issue, not bytes (docs/performance.md): their time
follows what their loop issues for each KiB of weights, whose floor is the FMAs themselves (a
KiB holds 512 bf16 weights, each multiplied by every row: 16 warp FFMAs a KiB and row). The
machine code says that before any device call. This compiles a source for sm_90a with nvcc in
each weight format and each variant's defines, disassembles it with nvdisasm, finds each entry's
hot loop (of the loops, a backward branch and the code it jumps back over, the one whose body
holds the most FFMA) and counts what the loop issues by opcode. ``issued per KiB`` is the loop's
count scaled by its FFMAs to a KiB of weights; ``of floor`` is the FFMA share, the fraction of
the issue slots doing the arithmetic.

Run where nvcc and nvdisasm are (nvdisasm: the ``nvidia-cuda-nvdisasm`` wheel, in the test extra):
``python benchmarks/bench_sass_mix.py [--source gemv.cu] [--entries REGEX] [--weights bf16,fp8]
[--acts bf16,f32] [--variants "A;B"]`` (f32 activations: what the loops would issue were x
widened to f32 before them). Prints a table; writes ``benchmarks/results/sass_mix.json``.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from itertools import product
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result  # noqa: E402

KERNELS = Path(__file__).resolve().parents[1] / "kernels"
COMMON = KERNELS / "cuda" / "common"
WEIGHT_BYTES = {"bf16": 2.0, "f32": 4.0, "fp8": 1.0, "mxfp4": 0.5, "nvfp4": 0.5}
"""Bytes a weight takes in each format (fp4's scales left out)."""

_INSN = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)[^;]*?"
                   r"(?:`\((\.L_x_\d+)\))?\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_SECTION = re.compile(r"^\.text\.([A-Za-z0-9_]+):")


@attrs.frozen
class Loop:
    """One entry's hot loop: its address range and what it issues, by opcode."""

    entry: str
    start: int
    end: int
    mix: tuple[tuple[str, int], ...]

    @property
    def issued(self) -> int:
        return sum(n for _, n in self.mix)

    @property
    def ffma(self) -> int:
        return dict(self.mix).get("FFMA", 0)


def functions(sass: str) -> dict[str, list[tuple[int, str, int | None]]]:
    """nvdisasm's ``-c`` listing split by function: each instruction as (address, opcode,
    branch target address or None), labels resolved.

    >>> text = (".text.k:\\n        /*0000*/   FFMA R1, R2, R3, R1 ;\\n.L_x_0:\\n"
    ...         "        /*0010*/   FFMA R1, R2, R3, R1 ;\\n"
    ...         "        /*0020*/   @!P0 BRA `(.L_x_0) ;\\n")
    >>> functions(text)["k"]
    [(0, 'FFMA', None), (16, 'FFMA', None), (32, 'BRA', 16)]
    """
    out: dict[str, list] = {}
    labels: dict[str, int] = {}
    pending: list[str] = []
    raw: list[tuple[str, int, str, str | None]] = []
    name = None
    for line in sass.splitlines():
        if m := _SECTION.match(line.strip()):
            name = m.group(1)
            out[name] = []
        elif m := _LABEL.match(line.strip()):
            pending.append(m.group(1))
        elif name and (m := _INSN.search(line)):
            addr = int(m.group(1), 16)
            labels.update((label, addr) for label in pending)
            pending.clear()
            raw.append((name, addr, m.group(2), m.group(3)))
    for fn, addr, op, target in raw:
        out[fn].append((addr, op, labels[target] if target else None))
    return out


def hot_loop(entry: str, insns: list[tuple[int, str, int | None]]) -> Loop | None:
    """Of the entry's loops (a branch back to an address at or before it, and the code from
    there to the branch), the one holding the most FFMA, the shortest of equals; then, while a
    loop inside it holds nine tenths of its FFMA or more, that one (a branch back across a
    rarely taken path, such as a fallback loop, must not swallow the hot loop). None where no
    loop holds an FFMA.

    >>> insns = [(0, "FFMA", None), (16, "LDG", None), (32, "FFMA", None), (48, "BRA", 16)]
    >>> hot_loop("k", insns)
    Loop(entry='k', start=16, end=48, mix=(('BRA', 1), ('FFMA', 1), ('LDG', 1)))
    >>> outer = [(0, "FFMA", None), *[(16 * i, "FFMA", None) for i in range(1, 11)],
    ...          (176, "BRA", 16), (192, "BRA", 0)]
    >>> hot_loop("k", outer).start, hot_loop("k", outer).end
    (16, 176)
    """
    loops = []
    for addr, op, target in insns:
        if op != "BRA" or target is None or target > addr:
            continue
        body = Counter(o for a, o, _ in insns if target <= a <= addr)
        if body["FFMA"]:
            loops.append(Loop(entry, target, addr, tuple(sorted(body.items()))))
    if not loops:
        return None

    def key(loop: Loop) -> tuple[int, int]:
        return loop.ffma, -(loop.end - loop.start)

    best = max(loops, key=key)
    while inner := [lp for lp in loops if lp != best and best.start <= lp.start
                    and lp.end <= best.end and 10 * lp.ffma >= 9 * best.ffma]:
        best = max(inner, key=key)
    return best


def rows_of(entry: str) -> int:
    """The x rows an entry's loop serves: 8 or 16 for the multi-row entries, else 1."""
    m = re.search(r"_rows(\d+)$", entry)
    return int(m.group(1)) if m else 1


def row(loop: Loop, weight: str, variant: str, act: str = "bf16") -> dict:
    """``loop``'s figures for a KiB of ``weight`` weights."""
    floor = 1024 / WEIGHT_BYTES[weight] * rows_of(loop.entry) / 32  # warp FFMAs a KiB
    return {"entry": loop.entry, "weight": weight, "act": act, "variant": variant,
            "rows": rows_of(loop.entry), "loop": [loop.start, loop.end],
            "issued": loop.issued, "ffma": loop.ffma,
            "issued_per_kib": loop.issued / loop.ffma * floor, "floor_per_kib": floor,
            "of_floor": loop.ffma / loop.issued, "mix": dict(loop.mix)}


def disassemble(source: Path, defines: list[str], tmp: Path, nvcc: str, nvdisasm: str) -> str:
    """``source`` compiled for sm_90a (-O3, as the build) and disassembled (code only)."""
    cubin = tmp / "k.cubin"
    subprocess.run([nvcc, "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", "-o", str(cubin),
                    str(source), f"-I{COMMON}", *(f"-D{d}" for d in defines)],
                   check=True, capture_output=True, text=True)
    return listing(cubin, nvdisasm)


def listing(cubin: Path, nvdisasm: str) -> str:
    """nvdisasm's listing of a cubin's code sections."""
    return subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True,
                          text=True).stdout


def nvcc_version(nvcc: str) -> str:
    """The compiler's release line (``Cuda compilation tools, release 13.0, V13.0.88``): the
    machine code, and so every count, is that compiler's."""
    out = subprocess.run([nvcc, "--version"], check=True, capture_output=True, text=True).stdout
    return next((ln.strip() for ln in out.splitlines() if "release" in ln), out.strip())


def find_nvdisasm() -> str | None:
    """nvdisasm on the PATH, else the one the ``nvidia-cuda-nvdisasm`` wheel installs."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    for root in map(Path, nvidia.__path__):
        for path in root.glob("cu*/bin/nvdisasm"):
            return str(path)
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="gemv.cu", help="a source of kernels/cuda/common")
    ap.add_argument("--entries", default=r"^metrale_(linear|gate_up_swiglu|qkv)_rows(8|16)$",
                    help="regex of the entries to read")
    ap.add_argument("--weights", default="bf16,fp8")
    ap.add_argument("--acts", default="bf16,f32",
                    help="activation types (f32: what the loops would issue were x widened "
                         "before them)")
    ap.add_argument("--variants", default="", help="';'-separated defines beside the default")
    args = ap.parse_args(argv)
    nvcc, nvdisasm = shutil.which("nvcc"), find_nvdisasm()
    if not (nvcc and nvdisasm):
        print(f"needs nvcc and nvdisasm on the PATH (found {nvcc}, {nvdisasm}); nvdisasm: "
              "pip install nvidia-cuda-nvdisasm", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for act, weight, variant in product(args.acts.split(","), args.weights.split(","),
                                            ["", *filter(None, args.variants.split(";"))]):
            defines = [f"ACT_{act.upper()}", f"WEIGHT_{weight.upper()}", "K_BLOCK=256",
                       "ACROSS_SEQUENTIAL", *variant.split()]
            listing = disassemble(COMMON / args.source, defines, Path(tmp), nvcc, nvdisasm)
            for entry, insns in sorted(functions(listing).items()):
                loop = hot_loop(entry, insns) if re.search(args.entries, entry) else None
                if loop is None:
                    continue
                r = row(loop, weight, variant, act)
                rows.append(r)
                top = ", ".join(f"{op} {n}" for op, n in
                                sorted(r["mix"].items(), key=lambda x: -x[1])[:6])
                print(f"x {act:4} w {weight:5} {variant or 'default':16} {entry:32} "
                      f"{r['issued_per_kib']:6.0f} a KiB (floor {r['floor_per_kib']:4.0f}, "
                      f"FFMA {r['of_floor']:4.0%}) | loop {r['issued']}: {top}", flush=True)
    doc = {"source": args.source, "entries": args.entries, "nvcc": nvcc_version(nvcc),
           "rows": rows}
    print(f"wrote {write_result('sass_mix', doc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
