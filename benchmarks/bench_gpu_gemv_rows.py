"""Batched decode GEMVs on the GPU: gemv.cu's multi-row entries against its one-row entries.

Past one row a decode step's GEMVs launch gemv.cu's `_rows8` / `_rows16` entries, which load
each weight chunk once for all of a tile's rows (gemv_rows.cuh), in place of the one-row entries
that take the rows one after another (warp_dots_rows). This times both at the decode shapes of
Qwen3-0.6B and Llama-3.1-8B (``bench_gpu_variants.GEMV_SHAPES``) at 8 and 16 rows, the
multi-row entries in the variants of their tuning defines (``MULTI_COLS``, ``MULTI_AHEAD``,
``MULTI_MIN_BLOCKS``), on weights rotated past L2 and graph replays (``time_graph``). Every
variant's output is compared byte for byte with the one-row entries' (the bytes of each row
launched alone). Linear shapes with n <= 1024 run the split entries, as the plans do.
``--acts bf16,f32`` also times the multi-row entries built for f32 activations, fed the same
bf16 values widened: what the loops would cost if x's producer wrote it widened (their output,
rounded to bf16, must still be the one-row bytes).

Run on the lent GPU: ``python benchmarks/bench_gpu_gemv_rows.py [--weights bf16,fp8]
[--variants "A;B"] [--acts bf16,f32]``. Writes ``benchmarks/results/gpu_gemv_rows.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_copy_rate, write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    GEMV_SHAPES,
    build_modules,
    gemv_case,
    gemv_launcher,
    parse_defines,
    time_graph,
)

VARIANTS = ["", "MULTI_AHEAD=4", "MULTI_COLS=1", "MULTI_COLS=4 MULTI_AHEAD=2", "MULTI_AHEAD=2",
            "MULTI_AHEAD=8 MULTI_COLS=1"]
"""The multi-row entries' defines: "" is the source's own choice."""


def multi_launch(name: str, n: int, k: int, rows: int, variant: str) -> tuple[str, tuple, int]:
    """(entry, grid, shared bytes) of the multi-row launch at a shape, as KERNELS.toml's tables
    make it for ``variant``'s MULTI_COLS."""
    tile = 8 if rows <= 8 else 16
    cols = int(parse_defines(variant).get("MULTI_COLS", 2))
    if name == "gate_up":
        return f"metrale_gate_up_swiglu_rows{tile}", (-(-n // 4), -(-rows // tile), 1), 0
    if n <= 1024:
        return (f"metrale_linear_split_rows{tile}", (-(-n // cols), -(-rows // tile), 1),
                -(-k // 256) * cols * tile * 4)
    return f"metrale_linear_rows{tile}", (-(-n // (4 * cols)), -(-rows // tile), 1), 0


ACT_DEFINE = {"bf16": "", "f32": "ACT_F32 "}
"""The defines of an activation dtype (bf16 is build_modules' own)."""


def io_of(cp: Any, act: str, case: Any) -> tuple[Any, Any]:
    """(x, y) of a case for ``act``: in f32, x's bf16 values widened (exact) and an f32 output."""
    if act == "bf16":
        return case.x, case.y
    x = (case.x.astype(cp.uint32) << 16).view(cp.float32)
    return x, cp.empty(case.y.shape, cp.float32)


def bf16_of(cp: Any, y: Any) -> Any:
    """An output's bf16 bits: f32 rounded to nearest even, a NaN as all ones."""
    if y.dtype == cp.uint16:
        return y
    bits = y.view(cp.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)
    return cp.where(cp.isnan(y), cp.uint16(0xFFFF), rounded)


def main() -> None:
    import cupy as cp

    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default="bf16")
    ap.add_argument("--variants", help="';'-separated defines of the multi-row entries")
    ap.add_argument("--rows", default="8,16")
    ap.add_argument("--acts", default="bf16", help="bf16 and/or f32: the multi-row entries' x")
    args = ap.parse_args()
    variants = VARIANTS if args.variants is None else args.variants.split(";")
    formats = args.weights.split(",")
    rate = device_copy_rate()
    print(f"device-to-device copy: {rate / 1e12:.2f} TB/s (read + write)", flush=True)
    shapes = [s for s in GEMV_SHAPES if s[0] != "qwen3-30b-a3b"]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        acts = args.acts.split(",")
        modules = build_modules(cp, Path(tmp), [
            (fmt, "gemv.cu", f"{ACT_DEFINE[a]}ACROSS_SEQUENTIAL {v}")
            for fmt in formats for a in sorted({"bf16", *acts}) for v in variants])
        for fmt in formats:
            base = modules[fmt, "gemv.cu", f"ACROSS_SEQUENTIAL {variants[0]}"]
            for model, name, n, k in shapes:
                for rows in map(int, args.rows.split(",")):
                    case = gemv_case(cp, fmt, name, n, k, rows)
                    pair = name == "gate_up"
                    one = "metrale_gate_up_swiglu" if pair else "metrale_linear"
                    case.y.fill(0xFFFF)
                    launch = gemv_launcher(base.get_function(one), pair,
                                           (-(-n // 4), -(-rows // 8), 1), 128, case.ws,
                                           case.x, case.y, n)
                    runs = [("one-row entries", time_graph(cp, launch, case.copies), True)]
                    ref = case.y.copy()
                    for act in acts:
                        x, y = io_of(cp, act, case)
                        for v in variants:
                            entry, grid, shared = multi_launch(name, n, k, rows, v)
                            fn = modules[fmt, "gemv.cu",
                                         f"{ACT_DEFINE[act]}ACROSS_SEQUENTIAL {v}"]
                            y.view(cp.uint16).fill(0xFFFF)  # poisoned (a NaN): all written
                            launch = gemv_launcher(fn.get_function(entry), pair, grid, 128,
                                                   case.ws, x, y, n, shared)
                            sec = time_graph(cp, launch, case.copies)
                            x_of = "" if act == "bf16" else "x f32 "
                            runs.append((f"{entry.split('_')[-1]} {x_of}{v or 'default'}", sec,
                                         bool((bf16_of(cp, y) == ref).all())))
                    for label, sec, same in runs:
                        out.append({"weight": fmt, "model": model, "kernel": name, "n": n,
                                    "k": k, "rows": rows, "variant": label, "seconds": sec,
                                    "bytes": case.total, "bytes_per_s": case.total / sec,
                                    "of_copy_rate": case.total / sec / rate,
                                    "same_bytes_as_one_row": same})
                        print(f"{fmt:5} {model:12} {name:7} rows={rows:2} {label:34} "
                              f"{sec * 1e6:8.2f} us {case.total / sec / 1e12:5.2f} TB/s"
                              f"{'' if same else '  BYTES DIFFER'}", flush=True)
                    del case
    path = write_result("gpu_gemv_rows", {"copy_rate_bytes_per_s": rate, "rows": out})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
