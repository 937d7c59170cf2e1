"""Compile-time variants of the decode kernels, timed side by side on the GPU.

The GEMV and decode-attention sources take their tuning constants as defines (``WARPS``,
``DOT_AHEAD``, ``GEMV_MIN_BLOCKS``, ``ROWS_PER_WARP``, ``VAHEAD``); this script builds each
variant with ``nvcc`` for sm_90a, times it at the decode shapes of Qwen3-0.6B and Llama-3.1-8B,
and compares with the device-to-device copy rate measured in the same run. Weights and KV
caches rotate through enough copies (more than 200 MB) that L2 holds none of them between
launches; each figure is the median over several replays of a CUDA graph of back-to-back
launches, so it includes the launch gaps a decode step pays. ``--attention-ref FILE`` times
another decode-attention source (an earlier version) beside the current one, in one process.

Run on the lent GPU: ``python benchmarks/bench_gpu_variants.py`` (``--only gemv`` or
``--only attention``). Writes ``benchmarks/results/gpu_variants.json``.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMMON = ROOT / "kernels" / "cuda" / "common"
ROTATE_BYTES = 256 << 20
LAUNCHES = 24  # launches per captured graph
REPEATS = 9

# (model, kernel, n, k): the decode GEMVs (qkv as one linear of its total width)
GEMV_SHAPES = [
    ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o_proj", 1024, 2048),
    ("qwen3-0.6b", "gate_up", 3072, 1024), ("qwen3-0.6b", "down", 1024, 3072),
    ("llama-3.1-8b", "qkv", 6144, 4096), ("llama-3.1-8b", "o_proj", 4096, 4096),
    ("llama-3.1-8b", "gate_up", 14336, 4096), ("llama-3.1-8b", "down", 4096, 14336),
]
# (model, hq, hkv, head_dim)
ATTENTION_SHAPES = [("qwen3-0.6b", 16, 8, 128), ("llama-3.1-8b", 32, 8, 128)]
CONTEXT = 1024

# "" is the source's own choice; the others override it (the first of each list: the
# choice before the eight-blocks-per-SM one, for the comparison in the same run)
GEMV_VARIANTS = {
    "bf16": ["", "GEMV_MIN_BLOCKS=5 DOT_AHEAD=8", "GEMV_MIN_BLOCKS=7 DOT_AHEAD=4",
             "GEMV_MIN_BLOCKS=6 DOT_AHEAD=6", "GEMV_MIN_BLOCKS=8 DOT_AHEAD=4 ROWS_PER_WARP=1",
             "WARPS=2 GEMV_MIN_BLOCKS=16 DOT_AHEAD=4"],
    "fp8": ["", "GEMV_MIN_BLOCKS=4 DOT_AHEAD=16", "GEMV_MIN_BLOCKS=6 DOT_AHEAD=6",
            "GEMV_MIN_BLOCKS=8 DOT_AHEAD=6"],
    "mxfp4": ["", "GEMV_MIN_BLOCKS=3 DOT_AHEAD=16", "GEMV_MIN_BLOCKS=6 DOT_AHEAD=6",
              "GEMV_MIN_BLOCKS=4 DOT_AHEAD=12"],
}
ATTENTION_VARIANTS = ["", "VAHEAD=8"]


def nvcc(source: Path, defines: list[str], out: Path) -> Path:
    cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-O3", f"-I{COMMON}",
           *(f"-D{d}" for d in defines), "-o", str(out), str(source)]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out


def time_graph(cp: Any, launch: Any, copies: int) -> float:
    """Median seconds per launch: a graph of LAUNCHES launches (copy i % copies), replayed."""
    cp.cuda.Device().synchronize()  # the inputs, made on the default stream, are written
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for i in range(copies):
            launch(i)  # warm: module load, first-touch
        stream.begin_capture()
        for i in range(LAUNCHES):
            launch(i % copies)
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(REPEATS):
            s, e = cp.cuda.Event(), cp.cuda.Event()
            s.record(stream)
            graph.launch(stream)
            e.record(stream)
            e.synchronize()
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3 / LAUNCHES)
    return statistics.median(times)


def bf16_bits(cp: Any, shape: tuple[int, ...], std: float = 1.0) -> Any:
    """Normal values as bf16 bit patterns (uint16), truncated from f32."""
    x = cp.random.standard_normal(shape, dtype=cp.float32) * np.float32(std)
    return (x.view(cp.uint32) >> 16).astype(cp.uint16)


def gemv_weights(cp: Any, fmt: str, n: int, k: int, copies: int) -> tuple[list, int]:
    """`copies` weight triples (data, scale, global) in `fmt`, and the bytes one launch reads."""
    out = []
    for _ in range(copies):
        if fmt == "bf16":
            data = bf16_bits(cp, (n, k), 0.02)
            scale = None
        elif fmt == "fp8":
            data = cp.random.randint(0, 0x7E, (n, k), dtype=cp.int32).astype(cp.uint8)  # finite e4m3
            scale = cp.full(n, 0.01, cp.float32)
        else:
            data = cp.random.randint(0, 256, (n, k // 2), dtype=cp.int32).astype(cp.uint8)
            scale = cp.full((n, k // 32), 120, cp.uint8)
        out.append((data, scale))
    nbytes = out[0][0].nbytes + (out[0][1].nbytes if out[0][1] is not None else 0)
    return out, nbytes


def gemv_launcher(fn: Any, pair: bool, grid: tuple, threads: int, ws: list, x: Any, y: Any,
                  n: int) -> Any:
    """launch(i): one GEMV over weight copy i (``pair``: gate_up, whose rows n.. are up's)."""
    null = np.uint64(0)  # a null pointer argument
    rows, k = np.int32(x.shape[0]), np.int32(x.shape[1])

    def launch(i: int) -> None:
        d, s = ws[i]
        sp = s if s is not None else null
        if pair:
            su = s[n:] if s is not None else null
            fn(grid, (threads,), (x, d, sp, null, d[n:], su, null, y, rows, k, np.int32(n)))
        else:
            fn(grid, (threads,), (x, d, sp, null, y, rows, k, np.int32(n)))
    return launch


def attention_launcher(fn: Any, grid: tuple, caches: list, heads: tuple, rest: tuple,
                       scalars: tuple) -> Any:
    """launch(i): kv_append_attention_decode over cache copy i."""
    def launch(i: int) -> None:
        kc, vc = caches[i]
        fn(grid, (256,), (*heads[:3], kc, vc, *rest, *scalars))
    return launch


def bench_gemv(cp: Any, tmp: Path, rate: float) -> list[dict]:
    jobs = [(fmt, v) for fmt, vs in GEMV_VARIANTS.items() for v in vs]

    def build(job: tuple[str, str]) -> Path:
        fmt, v = job
        defines = ["ACT_BF16", f"WEIGHT_{fmt.upper()}", "K_BLOCK=256", "ACROSS_SEQUENTIAL",
                   *v.split()]
        return nvcc(COMMON / "gemv.cu", defines, tmp / f"gemv_{fmt}_{len(defines)}_{hash(v)}.cubin")

    with ThreadPoolExecutor(8) as pool:
        cubins = list(pool.map(build, jobs))
    rows_out = []
    for (fmt, v), cubin in zip(jobs, cubins, strict=True):
        mod = cp.RawModule(path=str(cubin))
        linear = mod.get_function("metrale_linear")
        gate_up = mod.get_function("metrale_gate_up_swiglu")
        defs = dict(d.split("=") for d in v.split())
        warps, rpw = int(defs.get("WARPS", 4)), int(defs.get("ROWS_PER_WARP", 8))
        for model, name, n, k in GEMV_SHAPES:
            for rows in (1, 8) if name in ("gate_up", "down") else (1,):
                wn = 2 * n if name == "gate_up" else n
                copies = max(2, -(-ROTATE_BYTES // (wn * k * 2)))
                ws, wbytes = gemv_weights(cp, fmt, wn, k, copies)
                x = bf16_bits(cp, (rows, k))
                y = cp.empty((rows, n), cp.uint16)
                grid = (-(-n // warps), -(-rows // rpw), 1)

                fn = gate_up if name == "gate_up" else linear
                launch = gemv_launcher(fn, name == "gate_up", grid, 32 * warps, ws, x, y, n)
                sec = time_graph(cp, launch, copies)
                total = wbytes + x.nbytes + y.nbytes
                rows_out.append({"kind": "gemv", "weight": fmt, "variant": v or "default",
                                 "model": model, "kernel": name, "n": n, "k": k, "rows": rows,
                                 "seconds": sec, "bytes": total, "bytes_per_s": total / sec,
                                 "of_copy_rate": total / sec / rate})
                print(f"gemv {fmt:5} {v or 'default':32} {model:12} {name:7} rows={rows} "
                      f"{sec * 1e6:7.2f} us {total / sec / 1e12:5.2f} TB/s", flush=True)
                del ws
    return rows_out


def bench_attention(cp: Any, tmp: Path, rate: float, ref: Path | None) -> list[dict]:
    variants = [("ref", ref, "")] if ref else []
    variants += [("now", COMMON / "attention_decode.cu", v) for v in ATTENTION_VARIANTS]
    out = []
    for label, src, v in variants:
        cubin = nvcc(src, ["ACT_BF16", "KV_BLOCK=256", *v.split()], tmp / f"attn_{len(out)}.cubin")
        fn = cp.RawModule(path=str(cubin)).get_function("metrale_kv_append_attention_decode")
        per_q_head = "// grid (hq," in src.read_text()  # else one block per kv head
        for model, hq, hkv, d in ATTENTION_SHAPES:
            for rows, position in ((1, CONTEXT), (8, CONTEXT), (1, 200)):
                max_ctx = CONTEXT + 1
                nkv = -(-max_ctx // 256)
                cache_bytes = rows * max_ctx * hkv * d * 2 * 2
                copies = max(2, -(-ROTATE_BYTES // cache_bytes))

                def bf16(*shape: int) -> Any:
                    return bf16_bits(cp, shape)

                caches = [(bf16(rows * max_ctx * hkv * d), bf16(rows * max_ctx * hkv * d))
                          for _ in range(copies)]
                q, kn, vn = bf16(rows, hq, d), bf16(rows, hkv, d), bf16(rows, hkv, d)
                o = cp.empty((rows, hq, d), cp.uint16)
                positions = cp.full(rows, position, cp.int32)
                slots = cp.arange(rows, dtype=cp.int32)
                work = cp.zeros(1 << 22, cp.uint8)
                grid = (hq if per_q_head else hkv, rows, nkv)

                scalars = (np.int32(rows), np.int32(hq), np.int32(hkv), np.int32(d),
                           np.int32(max_ctx), np.float32(d ** -0.5), np.int32(0))
                launch = attention_launcher(fn, grid, caches, (kn, vn, q),
                                            (positions, slots, o, work), scalars)
                sec = time_graph(cp, launch, copies)
                kv_bytes = rows * (position + 1) * hkv * d * 2 * 2
                out.append({"kind": "attention", "variant": f"{label} {v}".strip(),
                            "model": model, "rows": rows, "position": position,
                            "seconds": sec, "bytes": kv_bytes,
                            "bytes_per_s": kv_bytes / sec, "of_copy_rate": kv_bytes / sec / rate})
                print(f"attention {label:12} {v:10} {model:12} rows={rows} position={position} "
                      f"{sec * 1e6:7.2f} us",
                      flush=True)
                del caches
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["gemv", "attention"])
    ap.add_argument("--attention-ref", type=Path, help="another attention_decode.cu to time")
    args = ap.parse_args()
    import cupy as cp

    cp.random.seed(0)
    rate = device_copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as t:
        if args.only in (None, "attention"):
            rows += bench_attention(cp, Path(t), rate, args.attention_ref)
        if args.only in (None, "gemv"):
            rows += bench_gemv(cp, Path(t), rate)
    path = write_result("gpu_variants", {"copy_rate_bytes_per_s": rate, "launches_per_graph":
                                         LAUNCHES, "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
