"""Compile-time variants of the decode kernels, timed side by side on the GPU.

The GEMV and decode-attention sources take their tuning constants as defines (``WARPS``,
``DOT_AHEAD``, ``DOT_CHUNKS``, ``DOT_RING``, ``GEMV_MIN_BLOCKS``, ``ROWS_PER_WARP``, ``CHUNK``);
this script builds each variant for sm_90a as the build compiles kernels
(``realize.compute.NvidiaTarget``, headers resolved by ``realize.kernel.source_identity``),
times it at the decode shapes of Qwen3-0.6B and Llama-3.1-8B, and compares with the
device-to-device copy rate measured in the same run. Weights and KV caches rotate through
enough copies (more than 200 MB) that L2 holds none of them between launches, and every variant
of a format runs on the same ones; each figure is the median over several replays of a CUDA
graph of back-to-back launches, so it includes the launch gaps a decode step pays (decode
attention launched as the step launches it, programmatic dependent launches). gemv.cu's split
entries (a block a column, which the plans launch for linear where n <= 1024) run as the
variant "split" at every linear shape, their bytes compared with the default's.

Run on the lent GPU: ``python benchmarks/bench_gpu_variants.py`` (``--only gemv`` or
``--only attention``; ``--weights fp8,mxfp4`` sweeps only those GEMV formats). Writes
``benchmarks/results/gpu_variants.json`` (with ``--only``: ``gpu_variants_<part>.json``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402

from metrale.realize.compute import NvidiaTarget  # noqa: E402
from metrale.realize.hardware import default_kernels_dir  # noqa: E402
from metrale.realize.kernel import source_identity  # noqa: E402

ROTATE_BYTES = 256 << 20
LAUNCHES = 24  # launches per captured graph
REPEATS = 9

# (model, kernel, n, k): the decode GEMVs (qkv as one linear of its total width)
GEMV_SHAPES = [
    ("qwen3-0.6b", "qkv", 4096, 1024), ("qwen3-0.6b", "o_proj", 1024, 2048),
    ("qwen3-0.6b", "gate_up", 3072, 1024), ("qwen3-0.6b", "down", 1024, 3072),
    ("llama-3.1-8b", "qkv", 6144, 4096), ("llama-3.1-8b", "o_proj", 4096, 4096),
    ("llama-3.1-8b", "gate_up", 14336, 4096), ("llama-3.1-8b", "down", 4096, 14336),
    ("qwen3-30b-a3b", "o_proj", 2048, 4096),
]
# (model, hq, hkv, head_dim)
ATTENTION_SHAPES = [("qwen3-0.6b", 16, 8, 128), ("llama-3.1-8b", 32, 8, 128),
                    ("qwen3-30b-a3b", 32, 4, 128)]
CONTEXT = 1024

# "" is the source's own choice; the others override it. The first override of each list is the
# choice the source replaced or declined, for the comparison in the same run: for bf16 and fp8 a
# warp's next loads issued only after the arithmetic of all those before (DOT_RING=0), for
# mxfp4 the ring (DOT_RING=1); for fp8 and mxfp4 the second is version 10's one 8-wide chunk per
# load (8 and 4 bytes; version 11 loads 16).
GEMV_VARIANTS = {
    "bf16": ["", "DOT_RING=0", "GATE_UP_MIN_BLOCKS=8", "GEMV_MIN_BLOCKS=6 DOT_AHEAD=6",
             "GEMV_MIN_BLOCKS=5 DOT_AHEAD=8"],
    "fp8": ["", "DOT_RING=0", "DOT_CHUNKS=1 DOT_RING=0", "DOT_AHEAD=2",
            "GEMV_MIN_BLOCKS=6 DOT_AHEAD=6"],
    "mxfp4": ["", "DOT_RING=1", "DOT_CHUNKS=1 DOT_AHEAD=4 DOT_RING=0", "DOT_AHEAD=2",
              "DOT_AHEAD=4"],
    "nvfp4": [""],
}
# the tensor-core GEMV (gemv_mma.cu), against gemv.cu's default on the same weights: the L2 fetch
# size of the weight loads (the source's 128 bytes, plain loads, 256) and rounds of loads in
# flight (fp4's default is 2, the others' 4). Version 17's sweep ran these five before 128 became
# the default, the fetch size then named WEIGHT_L2_FETCH (results/gpu_variants_gemv_mma.json).
# Since version 34 GEMV_MMA_AHEAD sets the linear entry's rounds and gate_up_swiglu's (halved)
# except fp8's, which GEMV_MMA_GATE_UP_AHEAD sets; this sweep times those two entries only (its
# qkv rows are the linear entry at qkv's shape, not the qkv entry and its GEMV_MMA_QKV_AHEAD).
GEMV_MMA_VARIANTS = ["", "GEMV_MMA_L2_FETCH=0", "GEMV_MMA_L2_FETCH=256",
                     "GEMV_MMA_L2_FETCH=256 GEMV_MMA_AHEAD=4",
                     "GEMV_MMA_L2_FETCH=256 GEMV_MMA_AHEAD=8"]


def gemv_mma_launch(k: int, pair: bool, variant: str) -> tuple[int, int]:
    """(threads, dynamic shared bytes) of a gemv_mma.cu launch for ``variant``, as the source
    sizes them: the k-block partials of each of its tiles."""
    defines = parse_defines(variant)
    warps, k_block = int(defines.get("WARPS", 8)), int(defines.get("K_BLOCK", 256))
    return 32 * warps, -(-k // k_block) * 512 * (2 if pair else 1)
# decode attention: positions per thread block (the grid follows a CHUNK override); each launch
# is followed by the merge of its chunk records (metrale_attention_decode_merge)
ATTENTION_VARIANTS = ["", "CHUNK=32", "CHUNK=128"]


def merge_shared(d: int, chunk: int) -> int:
    """Dynamic shared bytes of metrale_attention_decode_merge at head_dim ``d`` when CHUNK is
    ``chunk``: a window of MERGE_W = 8 KV blocks' chunk records, their factors, the outputs, the
    running max and sum. KERNELS.toml's formula is this at its CHUNK, 64."""
    w = 8 * 256 // chunk
    return (w * (d + 4) + 3 * w + d + 4) * 4


def then_launch(module: Any, kernel: Any, sizes: dict, pointers: dict, variant: str = "") -> tuple:
    """The launch after ``kernel``'s own (its KERNELS.toml ``then`` table): (function, grid,
    block, shared bytes, arguments) at ``sizes``, the arguments in the table's order, pointers
    from ``pointers`` by name and numbers from the kernel's sizes. A CHUNK override in
    ``variant`` resizes the merge's window, so its shared memory is :func:`merge_shared`'s."""
    (entry, args, (grid, block, shared)), = kernel.launches_for(sizes)[1:]
    chunk = int(parse_defines(variant).get("CHUNK", 64))
    assert merge_shared(sizes["d"], 64) == shared, (shared, "KERNELS.toml's merge formula moved")
    from metrale.runtime.cuda_loader import SCALAR_TYPES, parse_args

    env = kernel.sizes(sizes)
    values = tuple(pointers[a.name] if a.kind in ("ptr", "scratch")
                   else SCALAR_TYPES[a.kind](env[a.name]) for a in parse_args(args))
    return module.get_function(entry), grid, block, merge_shared(sizes["d"], chunk), values


def parse_defines(text: str) -> dict[str, str]:
    """Space-separated ``NAME`` or ``NAME=VALUE`` as a dict (a bare name is ``1``)."""
    return dict((d.split("=") + ["1"])[:2] for d in text.split())


def build(source: str, defines: str, out: Path) -> Path:
    """``source`` (a file of cuda/common, or a path under the kernels folder such as
    ``sm_90/common/gemm_wgmma.cu``) compiled to an sm_90a cubin at ``out``, with the build's
    compiler and flags, its includes found as sm_90's chain finds them; ``defines`` is
    space-separated ``NAME`` or ``NAME=VALUE``."""
    path = source if "/" in source else f"cuda/common/{source}"
    text, _, headers, _ = source_identity(default_kernels_dir(), path,
                                          ("sm_90/common", "sm_80/common", "cuda/common"))
    values = parse_defines(defines)
    binary = NvidiaTarget("cubin").compile(text, "sm_90a", values, name=out.stem,
                                           headers=headers)
    out.write_bytes(binary.data)
    return out


@cache
def decode_kernel(family: str, style: str = "neox") -> Any:
    """The sm_90 realization of ``family``'s bf16 decode point (kv_block 256, ``style`` where the
    family has one): its defines, entry and KERNELS.toml launch rule."""
    from metrale.lkb.presentation import Presentation
    from metrale.realize.functor import realization

    P = Presentation.load()
    want = {"act": "bf16", "mode": "decode", "kv_block": 256, "style": style}
    pt = next(p for p in P.family(family).points
              if all(p.as_dict().get(k, v) == v for k, v in want.items()))
    return realization("sm_90", presentation=P).realize(pt)


def decode_attention(cp: Any, family: str, variant: str, out: Path, style: str = "neox") -> tuple:
    """(module, function, kernel) of ``family``'s decode kernel on sm_90, built with the defines
    the build gives its point plus ``variant``'s: ``kernel`` is its realization (KERNELS.toml's
    launch rules: ``kernel.launch_for(numbers)``), and the function may use 200 KB of shared
    memory."""
    kernel = decode_kernel(family, style)
    defines = " ".join(d.removeprefix("-D") for d in kernel.defines)
    module = cp.RawModule(path=str(build("attention_decode.cu", f"{defines} {variant}", out)))
    fn = module.get_function(kernel.entry)  # loads the file
    fn.max_dynamic_shared_size_bytes = 200 * 1024
    return module, fn, kernel


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
    """`copies` weight triples (data, scale, global; None where the format has none) in `fmt`,
    and the bytes one launch reads."""
    out = []
    for _ in range(copies):
        scale = glob = None
        if fmt == "bf16":
            data = bf16_bits(cp, (n, k), 0.02)
        elif fmt == "fp8":
            data = cp.random.randint(0, 0x7E, (n, k), dtype=cp.int32).astype(cp.uint8)  # finite e4m3
            scale = cp.full(n, 0.01, cp.float32)
        elif fmt == "mxfp4":
            data = cp.random.randint(0, 256, (n, k // 2), dtype=cp.int32).astype(cp.uint8)
            scale = cp.full((n, k // 32), 120, cp.uint8)
        else:  # nvfp4: e4m3 block scales from 2^-2 to 2^2, one f32 global
            data = cp.random.randint(0, 256, (n, k // 2), dtype=cp.int32).astype(cp.uint8)
            scale = cp.random.randint(0x28, 0x48, (n, k // 16), dtype=cp.int32).astype(cp.uint8)
            glob = cp.full(1, 0.01, cp.float32)
        out.append((data, scale, glob))
    nbytes = out[0][0].nbytes + (out[0][1].nbytes if out[0][1] is not None else 0)
    return out, nbytes


def gemv_launcher(fn: Any, pair: bool, grid: tuple, threads: int, ws: list, x: Any, y: Any,
                  n: int, shared: int = 0) -> Any:
    """launch(i): one GEMV over weight copy i (``pair``: gate_up, whose rows n.. are up's), with
    ``shared`` bytes of dynamic shared memory."""
    null = np.uint64(0)  # a null pointer argument
    rows, k = np.int32(x.shape[0]), np.int32(x.shape[1])

    def launch(i: int) -> None:
        d, s, g = ws[i]
        sp = s if s is not None else null
        gp = g if g is not None else null
        if pair:
            su = s[n:] if s is not None else null
            fn(grid, (threads,), (x, d, sp, gp, d[n:], su, gp, y, rows, k, np.int32(n)),
               shared_mem=shared)
        else:
            fn(grid, (threads,), (x, d, sp, gp, y, rows, k, np.int32(n)), shared_mem=shared)
    return launch


def decode_inputs(cp: Any, hq: int, hkv: int, d: int, rows: int, position: int) -> Any:
    """A decode attention launch's inputs at ``rows`` rows at ``position`` over a cache of
    CONTEXT + 1 positions: as many cache copies as rotate past L2, random q, k and v, the output,
    positions, slots, a zeroed workspace (room for the records of chunks down to 16 positions),
    and the sizes KERNELS.toml's formulas take."""
    max_ctx = CONTEXT + 1
    copies = max(2, -(-ROTATE_BYTES // (rows * max_ctx * hkv * d * 2 * 2)))
    cache_shape = (rows * max_ctx * hkv * d,)
    return SimpleNamespace(
        max_ctx=max_ctx, copies=copies,
        caches=[(bf16_bits(cp, cache_shape), bf16_bits(cp, cache_shape)) for _ in range(copies)],
        q=bf16_bits(cp, (rows, hq, d)), k=bf16_bits(cp, (rows, hkv, d)),
        v=bf16_bits(cp, (rows, hkv, d)), o=cp.empty((rows, hq, d), cp.uint16),
        positions=cp.full(rows, position, cp.int32), slots=cp.arange(rows, dtype=cp.int32),
        work=cp.zeros(rows * hq * -(-max_ctx // 16) * (d + 4) * 4 + (1 << 16), cp.uint8),
        sizes={"rows": rows, "hq": hq, "hkv": hkv, "d": d, "max_ctx": max_ctx, "window": 0})


def chunk_shape(shape: tuple, variant: str, max_ctx: int) -> tuple:
    """The (grid, block, shared bytes) of a decode attention launch for ``variant``: a CHUNK
    override changes the grid's chunks and scales the shared memory (KERNELS.toml has 64)."""
    chunk = int(parse_defines(variant).get("CHUNK", 64))
    (x, y, _), block, shared = shape
    return (x, y, -(-max_ctx // chunk)), block, min(shared * max(chunk, 64) // 64, 200 * 1024)


def _function(fn: Any) -> int:
    """The ``CUfunction`` of a CuPy ``RawKernel`` (its ``kernel``) or ``Function``."""
    return getattr(fn, "kernel", fn).ptr


def _arg(a: Any) -> np.generic:
    """A kernel argument for a driver launch: a device array's address, or the scalar itself."""
    return np.uint64(a.data.ptr) if hasattr(a, "data") and hasattr(a.data, "ptr") else a


def attention_launcher(fn: Any, shape: tuple, caches: list, heads: tuple, rest: tuple,
                       scalars: tuple, merge: tuple | None = None) -> Any:
    """launch(i): a decode attention kernel over cache copy i, as the decode step launches it (a
    programmatic dependent launch); ``shape`` is its (grid, block, shared bytes) and the
    arguments are heads, the caches, rest, scalars. ``merge`` (function, grid, block, shared
    bytes, arguments: :func:`then_launch`) is a second launch made after it."""
    from metrale.runtime.cuda_driver import DriverLauncher

    driver = DriverLauncher()
    grid, block, shared = shape

    def launch(i: int) -> None:
        import cupy as cp

        stream = cp.cuda.get_current_stream().ptr
        kc, vc = caches[i]
        driver.launch_dependent(_function(fn), grid, block, shared, stream,
                                tuple(_arg(a) for a in (*heads, kc, vc, *rest, *scalars)))
        if merge is not None:
            mfn, mgrid, mblock, mshared, margs = merge
            driver.launch_dependent(_function(mfn), mgrid, mblock, mshared, stream,
                                    tuple(_arg(a) for a in margs))
    return launch


def build_modules(cp: Any, tmp: Path, jobs: list[tuple[str, str, str]]) -> dict:
    """Each job (weight format, source, defines) compiled, eight at a time, and loaded; bf16
    activations unless the defines say ``ACT_F32``."""
    def defines(fmt: str, extra: str) -> str:
        act = "" if "ACT_F32" in extra.split() else "ACT_BF16 "
        return f"{act}K_BLOCK=256 WEIGHT_{fmt.upper()} {extra}"

    with ThreadPoolExecutor(8) as pool:
        cubins = list(pool.map(
            lambda i: build(jobs[i][1], defines(jobs[i][0], jobs[i][2]), tmp / f"job_{i}.cubin"),
            range(len(jobs))))
    return {job: cp.RawModule(path=str(c)) for job, c in zip(jobs, cubins, strict=True)}


def gemv_case(cp: Any, fmt: str, name: str, n: int, k: int, rows: int) -> SimpleNamespace:
    """One GEMV shape's inputs: enough weight copies in ``fmt`` to rotate past L2 (gate_up's
    gate and up rows stacked), random activations, the output, and the bytes one launch moves."""
    wn = 2 * n if name == "gate_up" else n
    copies = max(2, -(-ROTATE_BYTES // (wn * k * 2)))
    ws, wbytes = gemv_weights(cp, fmt, wn, k, copies)
    x = bf16_bits(cp, (rows, k))
    y = cp.empty((rows, n), cp.uint16)
    return SimpleNamespace(ws=ws, copies=copies, x=x, y=y, total=wbytes + x.nbytes + y.nbytes)


def bench_gemv(cp: Any, tmp: Path, rate: float, formats: list[str],
               baseline: str | None = None, variants: list[str] | None = None) -> list[dict]:
    """gemv.cu's variants (``variants``, else GEMV_VARIANTS of the format) at the decode shapes,
    on the same weights, each output compared byte for byte with the default's; ``baseline``,
    another gemv.cu-like source in cuda/common, runs as the variant "baseline"."""
    variants_of = {fmt: GEMV_VARIANTS[fmt] if variants is None else variants for fmt in formats}
    # (source, defines, split): the source's split entry (a block a column; the plans launch it
    # where n <= 1024) runs as the variant "split" at every linear shape, on the default defines
    kernels_of = {fmt: [("gemv.cu", v, False) for v in vs] + [("gemv.cu", "", True)]
                  + ([(baseline, "", False)] if baseline else [])
                  for fmt, vs in variants_of.items()}
    modules = build_modules(cp, tmp, sorted({(fmt, src, f"ACROSS_SEQUENTIAL {v}")
                                             for fmt, ks in kernels_of.items()
                                             for src, v, _ in ks}))
    rows_out = []
    for fmt, kernels in kernels_of.items():
        for model, name, n, k in GEMV_SHAPES:
            for rows in (1, 8) if name in ("gate_up", "down") else (1,):
                case = gemv_case(cp, fmt, name, n, k, rows)
                ws, copies, x, y, total = case.ws, case.copies, case.x, case.y, case.total
                ref = None  # the default's output: a variant changes the speed, never a byte
                for source, v, split in kernels:  # every variant on the same weights
                    if split and name == "gate_up":
                        continue
                    y.fill(0xFFFF)  # poisoned (a NaN): every output must be written
                    defs = parse_defines(v)
                    warps, rpw = int(defs.get("WARPS", 4)), int(defs.get("ROWS_PER_WARP", 8))
                    cols = 1 if name == "gate_up" else int(defs.get("GEMV_COLS", 1))
                    grid = (n if split else -(-n // (warps * cols)), -(-rows // rpw), 1)
                    entry = "metrale_gate_up_swiglu" if name == "gate_up" else "metrale_linear"
                    entry += "_split" if split else ""
                    fn = modules[fmt, source, f"ACROSS_SEQUENTIAL {v}"].get_function(entry)
                    launch = gemv_launcher(fn, name == "gate_up", grid, 32 * warps, ws, x, y, n,
                                           -(-k // 256) * rpw * 4 if split else 0)
                    sec = time_graph(cp, launch, copies)
                    got = y.copy()
                    same = ref is None or bool((got == ref).all())
                    ref = got if ref is None else ref
                    label = ("baseline" if source == baseline else "split" if split
                             else v or "default")
                    rows_out.append({"kind": "gemv", "weight": fmt, "variant": label,
                                     "model": model, "kernel": name, "n": n, "k": k,
                                     "rows": rows, "seconds": sec, "bytes": total,
                                     "bytes_per_s": total / sec,
                                     "of_copy_rate": total / sec / rate,
                                     "same_bytes_as_default": same})
                    print(f"gemv {fmt:5} {label:32} {model:12} {name:7} rows={rows} "
                          f"{sec * 1e6:7.2f} us {total / sec / 1e12:5.2f} TB/s"
                          f"{'' if same else '  BYTES DIFFER FROM DEFAULT'}", flush=True)
                del ws, case
    return rows_out


def bench_gemv_mma(cp: Any, tmp: Path, rate: float, formats: list[str],
                   row_counts: tuple[int, ...] = (1, 8), baseline: str | None = None,
                   variants: list[str] | None = None) -> list[dict]:
    """gemv_mma.cu's variants (``variants``, else GEMV_MMA_VARIANTS) at the decode shapes and
    ``row_counts``, each beside gemv.cu's default kernel on the same weights (``variant``
    "gemv.cu"); outputs are compared with gemv.cu's within the bf16 tolerance of the largest
    output (the orders differ, so bytes may). ``baseline``, another gemv_mma source in cuda/common
    (the previous revision, for one), runs as the variant "baseline", and every gemv_mma variant
    says whether its bytes equal the baseline's."""
    kernels = [("gemv.cu", "ACROSS_SEQUENTIAL")] + [
        ("gemv_mma.cu", v) for v in (GEMV_MMA_VARIANTS if variants is None else variants)]
    if baseline:
        kernels.append((baseline, ""))
    modules = build_modules(cp, tmp, [(fmt, src, v) for fmt in formats for src, v in kernels])
    rows_out = []
    for fmt in formats:
        for model, name, n, k in GEMV_SHAPES:
            for rows in row_counts:
                pair = name == "gate_up"
                case = gemv_case(cp, fmt, name, n, k, rows)
                ws, copies, x, y, total = case.ws, case.copies, case.x, case.y, case.total
                ref = None
                outputs = []  # (row, source, bytes) of each gemv_mma kernel
                for source, v in kernels:
                    y.fill(0xFFFF)  # poisoned (a NaN): every output must be written
                    mma = source != "gemv.cu"
                    entry = ("metrale_gate_up_swiglu" if pair else "metrale_linear") + (
                        "_gemv_mma" if mma else "")
                    fn = modules[fmt, source, v].get_function(entry)
                    if mma:
                        threads, shared = gemv_mma_launch(k, pair, v)
                        fn.max_dynamic_shared_size_bytes = shared
                        grid = (-(-n // 16), -(-rows // 8), 1)
                        launch = gemv_launcher(fn, pair, grid, threads, ws, x, y, n, shared)
                    else:
                        grid = (-(-n // 4), -(-rows // 8), 1)
                        launch = gemv_launcher(fn, pair, grid, 128, ws, x, y, n)
                    sec = time_graph(cp, launch, copies)
                    got = y.view(cp.uint16).astype(cp.uint32) << 16
                    got = cp.asnumpy(got.view(cp.float32))
                    ref = got if ref is None else ref
                    err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
                    label = (source if not mma else "gemv_mma baseline" if source == baseline
                             else f"gemv_mma {v or 'default'}")
                    rows_out.append({"kind": "gemv_mma", "weight": fmt, "variant": label,
                                     "model": model, "kernel": name, "n": n, "k": k,
                                     "rows": rows, "seconds": sec, "bytes": total,
                                     "bytes_per_s": total / sec,
                                     "of_copy_rate": total / sec / rate,
                                     "finite": bool(np.isfinite(got).all()),
                                     "max_rel_diff_vs_gemv": err})
                    if mma:
                        outputs.append((rows_out[-1], source, y.copy()))
                    print(f"{fmt:5} {label:28} {model:12} {name:7} rows={rows} "
                          f"{sec * 1e6:7.2f} us {total / sec / 1e12:5.2f} TB/s "
                          f"diff {err:.1e}", flush=True)
                if baseline:
                    base = next(got for _, source, got in outputs if source == baseline)
                    for row, _, got in outputs:
                        row["same_bytes_as_baseline"] = bool((got == base).all())
                del ws, case
    return rows_out


def bench_attention(cp: Any, tmp: Path, rate: float) -> list[dict]:
    kernels = {v: decode_attention(cp, "kv_append_attention", v, tmp / f"attn_{i}.cubin")
               for i, v in enumerate(ATTENTION_VARIANTS)}
    out = []
    for model, hq, hkv, d in ATTENTION_SHAPES:
        for rows, position in ((1, CONTEXT), (8, CONTEXT), (1, 200)):
            x = decode_inputs(cp, hq, hkv, d, rows, position)
            scalars = (np.int32(rows), np.int32(hq), np.int32(hkv), np.int32(d),
                       np.int32(x.max_ctx), np.float32(d ** -0.5), np.int32(0))
            kv_bytes = rows * (position + 1) * hkv * d * 2 * 2
            ref = None  # the default's output: a variant changes the speed, never a byte
            for v, (module, fn, kernel) in kernels.items():
                x.o.fill(0xFFFF)  # poisoned (a NaN): every output must be written
                merge = then_launch(module, kernel, x.sizes,
                                    {"positions": x.positions, "o": x.o, "work": x.work}, v)
                launch = attention_launcher(fn, chunk_shape(kernel.launch_for(x.sizes), v,
                                                            x.max_ctx),
                                            x.caches, (x.k, x.v, x.q),
                                            (x.positions, x.slots, x.o, x.work), scalars, merge)
                sec = time_graph(cp, launch, x.copies)
                got = x.o.copy()
                same = ref is None or bool((got == ref).all())
                ref = got if ref is None else ref
                # a chunk other than the default's merges a KV block's positions in other
                # groups: the order inside the block changes, so may the last bits
                reorders = "CHUNK" in parse_defines(v)
                out.append({"kind": "attention", "variant": v or "default", "model": model,
                            "rows": rows, "position": position, "seconds": sec,
                            "bytes": kv_bytes, "bytes_per_s": kv_bytes / sec,
                            "of_copy_rate": kv_bytes / sec / rate,
                            "same_bytes_as_default": same, "changes_order": reorders})
                differ = ("  bytes differ (the chunk is part of the order)" if reorders
                          else "  BYTES DIFFER FROM DEFAULT")
                print(f"attention {v or 'default':10} {model:12} rows={rows} "
                      f"position={position} {sec * 1e6:7.2f} us{'' if same else differ}",
                      flush=True)
            del x
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=["gemv", "attention", "gemv_mma"])
    ap.add_argument("--weights", default=",".join(GEMV_VARIANTS),
                    help="the GEMV weight formats to sweep, comma-separated")
    ap.add_argument("--rows", default="1,8", help="gemv_mma: the row counts, comma-separated")
    ap.add_argument("--baseline", help="gemv or gemv_mma: another source in kernels/cuda/common "
                    "(e.g. the previous revision's), timed on the same weights")
    ap.add_argument("--gemv-variants", help="gemv: the variants' defines, ';'-separated "
                    "('' is the source's own choice); default: GEMV_VARIANTS")
    ap.add_argument("--mma-variants", help="gemv_mma: the variants' defines, ';'-separated "
                    "('' is the source's own choice); default: GEMV_MMA_VARIANTS")
    args = ap.parse_args()
    formats = args.weights.split(",")
    if unknown := set(formats) - set(GEMV_VARIANTS):
        ap.error(f"--weights: unknown {sorted(unknown)}; known: {list(GEMV_VARIANTS)}")
    import cupy as cp

    cp.random.seed(0)
    rate = device_copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as t:
        if args.only in (None, "attention"):
            rows += bench_attention(cp, Path(t), rate)
        if args.only in (None, "gemv"):
            gv = None if args.gemv_variants is None else args.gemv_variants.split(";")
            rows += bench_gemv(cp, Path(t), rate, formats, args.baseline, gv)
        if args.only in (None, "gemv_mma"):
            variants = None if args.mma_variants is None else args.mma_variants.split(";")
            rows += bench_gemv_mma(cp, Path(t), rate, formats,
                                   tuple(int(r) for r in args.rows.split(",")), args.baseline,
                                   variants)
    name = f"gpu_variants_{args.only}" if args.only else "gpu_variants"  # a part: its own file
    path = write_result(name, {"copy_rate_bytes_per_s": rate, "launches_per_graph": LAUNCHES,
                               "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
