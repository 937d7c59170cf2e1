"""Experiment: the bounded plans' tensor-core GEMV (gemv_mma.cu) against the same GEMV with its
weights staged by the Tensor Memory Accelerator (gemv_mma_tma.cu), rings of 2, 3 and 4 slots, in
fp8, mxfp4 and nvfp4, at the decode GEMV shapes of Qwen3-0.6B, Llama-3.1-8B and Qwen3-30B-A3B
(``bench_gpu_variants.GEMV_SHAPES``: the linear and gate_up_swiglu entries), one and eight rows.

Each kernel runs as the variant sweeps run theirs: the same weight copies (enough that L2 holds
none), a graph of 24 launches replayed, the median over replays (``time_graph``), from a
poisoned output, and must write gemv_mma.cu's bytes. A ring that needs more shared memory than a
block may have is left out and says so. Writes ``benchmarks/results/gpu_gemv_tma.json``.

Run on the lent GPU from the repository root (Metrale installed, as device_setup.sh leaves it):
``python3 docs/experiments/tma/bench_gemv_tma.py``. The folder's sources are copied into the
installed kernels folder's cuda/common for the build and removed after.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

from _common import device_copy_rate, write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    GEMV_SHAPES,
    build_modules,
    gemv_case,
    gemv_launcher,
    time_graph,
)
from device import staged  # noqa: E402

FORMATS = ("fp8", "mxfp4", "nvfp4")
RINGS = (2, 3, 4)
WARPS, K_BLOCK, GROUP, XROWS = 8, 256, 16, 8
MAX_SHARED = 227 * 1024  # a block's dynamic shared memory on sm_90
SOURCES = ("gemv_mma_tma.cu", "tma.cuh")


def data_bytes(fmt: str, cols: int) -> int:
    return {"bf16": 2 * cols, "fp8": cols}.get(fmt, cols // 2)


def scale_bytes(fmt: str, cols: int) -> int:
    return {"mxfp4": cols // 32, "nvfp4": cols // 16}.get(fmt, 0)


def shared(fmt: str, k: int, tiles: int, stages: int | None) -> int:
    """gemv_mma.cu's dynamic shared bytes (stages None: its k-block partials), or
    gemv_mma_tma.cu's: the partials rounded to 128, then the ring (its Ring::bytes)."""
    part = -(-k // K_BLOCK) * tiles * GROUP * XROWS * 4
    if stages is None:
        return part
    cols = WARPS * K_BLOCK
    ds, sb = data_bytes(fmt, cols) + 64, scale_bytes(fmt, cols)
    slot = tiles * GROUP * (ds + (sb + 16 if sb else 0))
    return -(-part // 128) * 128 + stages * slot + 2 * stages * 8


def main() -> None:
    import cupy as cp

    rate = device_copy_rate()
    jobs = [(fmt, "gemv_mma.cu", "") for fmt in FORMATS] + [
        (fmt, "gemv_mma_tma.cu", f"TMA_STAGES={s}") for fmt in FORMATS for s in RINGS]
    with tempfile.TemporaryDirectory() as tmp, staged(*SOURCES):
        modules = build_modules(cp, Path(tmp), jobs)
    rows_out = []
    for fmt in FORMATS:
        for model, name, n, k in GEMV_SHAPES:
            for rows in (1, 8):
                pair = name == "gate_up"
                tiles = 2 if pair else 1
                case = gemv_case(cp, fmt, name, n, k, rows)
                entry = "metrale_gate_up_swiglu_gemv_mma" if pair else "metrale_linear_gemv_mma"
                base = None
                for (jfmt, _, defines), module in modules.items():
                    if jfmt != fmt:
                        continue
                    stages = int(defines.split("=")[1]) if defines else None
                    label = f"ring of {stages}" if stages else "gemv_mma"
                    smem = shared(fmt, k, tiles, stages)
                    row = {"weight": fmt, "model": model, "kernel": name, "n": n, "k": k,
                           "rows": rows, "variant": label, "shared_bytes": smem}
                    if smem > MAX_SHARED or (stages and k % 512):
                        rows_out.append({**row, "skipped": "shared memory" if smem > MAX_SHARED
                                         else "k not a multiple of 512"})
                        continue
                    fn = module.get_function(entry + ("_tma" if stages else ""))
                    fn.max_dynamic_shared_size_bytes = smem
                    case.y.fill(0xFFFF)  # poisoned (a NaN): every output must be written
                    launch = gemv_launcher(fn, pair, (-(-n // GROUP), -(-rows // XROWS), 1),
                                           32 * WARPS, case.ws, case.x, case.y, n, smem)
                    sec = time_graph(cp, launch, case.copies)
                    got = case.y.copy()
                    base = got if base is None else base
                    row |= {"seconds": sec, "bytes": case.total, "bytes_per_s": case.total / sec,
                            "of_copy_rate": case.total / sec / rate,
                            "same_bytes_as_gemv_mma": bool((got == base).all())}
                    rows_out.append(row)
                    print(f"{fmt:5} {label:10} {model:13} {name:7} rows={rows} "
                          f"{sec * 1e6:7.2f} us {case.total / sec / 1e12:5.2f} TB/s "
                          f"same bytes {row['same_bytes_as_gemv_mma']}", flush=True)
                del case
    same = all(r.get("same_bytes_as_gemv_mma", True) for r in rows_out)
    print(f"every ring wrote gemv_mma's bytes: {same}", flush=True)
    write_result("gpu_gemv_tma", {
        "what": "gemv_mma.cu against gemv_mma_tma.cu (TMA-staged weights, rings of 2-4 slots) "
                "at the decode GEMV shapes, fp8/mxfp4/nvfp4, 1 and 8 rows; seconds per launch",
        "command": "python3 docs/experiments/tma/bench_gemv_tma.py",
        "copy_rate_bytes_per_s": rate, "all_same_bytes": same, "results": rows_out,
        "shapes": GEMV_SHAPES, "rings": RINGS,
    })


if __name__ == "__main__":
    main()
