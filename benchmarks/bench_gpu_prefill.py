"""The prefill GEMMs on tensor cores against cuBLAS (through torch) and the floors, on the GPU.

For the matmul launches of a layer of Qwen3-0.6B and Llama-3.1-8B (SHAPES: qkv, o_proj,
gate_up with SwiGLU, down_proj; the head; and the last layer's down_proj with its residual add)
at several prompt lengths, this script builds the sm_90 realization of each `gemm` point (bf16
activations; bf16, fp8, mxfp4, nvfp4 or f32 weights) as the build compiles it, checks its output
against torch's on the same inputs, and times it. The peer is the same work in torch: one cuBLAS
matmul over the concatenated weights (``addmm`` where the residual is added, ``silu(g) * u``
after it for gate_up), bf16. Floors, from the same run: the tensor-core peak (dense bf16, the
H200's datasheet figure) and the bytes moved at the device-to-device copy rate measured here; a
launch's floor is the larger.
Up to ``--gemv-rows`` rows the decode GEMV of the same family runs too, on the same buffers, so
the run shows where the tensor cores start to pay (the planner's GEMV_MAX_ROWS). Each figure is
the median over several replays of a CUDA graph of back-to-back launches.

Then whole prefill steps (``--steps 512,2048``): the sm_90 plan's prefill of one prompt, against
the tensor-core floor of its FLOPs and transformers' eager forward over the same prompt, and the
same prompt keeping only the last row's logits, whose SHA-256 each step's row keeps.
``--kernels-dirs A,B`` plans the same steps over variant kernel folders too (copies of
``kernels/`` with an edited launch rule or source), each right after the shipped folder's, in the
same process: an A/B of a kernel change on whole steps, the hashes equal where it is
bit-identical.

With ``--variants``, instead: gemm.cu built with each of GEMM_VARIANTS' defines (tile shape,
stages, where the k-blocks' sum lives, blocks per SM), and sm_90's own wgmma GEMM with each of
WGMMA_VARIANTS' where it runs, each checked against torch and timed at VARIANT_CASES, side by
side with the sources' own choices, into ``gpu_prefill_variants.json``.

Run on the lent GPU: ``python benchmarks/bench_gpu_prefill.py`` (``--rows 8,64,512,2048``,
``--weights bf16,fp8,mxfp4,nvfp4,f32``; ``--record`` records each gemm kernel's throughput at the
largest rows as sm_90 evidence in the evidence store, and each other kernel of the longest step's plans, the
last-row plan's own included). Writes ``benchmarks/results/gpu_prefill.json``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import itertools
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import array_sha256, device_copy_rate, result_name, write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    LAUNCHES,
    REPEATS,
    bf16_bits,
    build,
    parse_defines,
    time_graph,
)
from stale_evidence import unmeasured_kernels  # noqa: E402

from metrale.realize.kernel import tensor_map_box, workspace_bytes  # noqa: E402
from metrale.runtime.cuda_driver import DriverLauncher, encode_tensor_map  # noqa: E402

TENSOR_PEAK = 989.4e12
"""Dense bf16 tensor-core FLOP/s of the H200 SXM (NVIDIA's datasheet: 1979 TFLOPS with
2:4 sparsity), the compute floor of a launch."""

AGREES = 2e-2
"""The largest difference from cuBLAS, relative to the largest output, a case may show and still
be recorded as evidence: bf16 outputs round at 2^-9 and the peer's weights are the bf16 of the
dequantized values, so a correct kernel stays far below it and a broken one far above."""

# (model, launch, family, sizes other than rows)
SHAPES = [
    ("qwen3-0.6b", "qkv", "qkv", {"k": 1024, "nq": 2048, "nk": 1024, "nv": 1024}),
    ("qwen3-0.6b", "o_proj", "linear", {"k": 2048, "n": 1024}),
    ("qwen3-0.6b", "gate_up", "gate_up_swiglu", {"k": 1024, "n": 3072}),
    ("qwen3-0.6b", "down", "linear", {"k": 3072, "n": 1024}),
    ("llama-3.1-8b", "qkv", "qkv", {"k": 4096, "nq": 4096, "nk": 1024, "nv": 1024}),
    ("llama-3.1-8b", "o_proj", "linear", {"k": 4096, "n": 4096}),
    ("llama-3.1-8b", "gate_up", "gate_up_swiglu", {"k": 4096, "n": 14336}),
    ("llama-3.1-8b", "down", "linear", {"k": 14336, "n": 4096}),
    ("qwen3-0.6b", "lm_head", "lm_head", {"k": 1024, "n": 151936}),
    ("llama-3.1-8b", "lm_head", "lm_head", {"k": 4096, "n": 128256}),
    ("qwen3-0.6b", "down_add", "linear_add", {"k": 3072, "n": 1024}),
    ("llama-3.1-8b", "down_add", "linear_add", {"k": 14336, "n": 4096}),
]
"""Each layer's matmuls as the prefill plans launch them (o_proj and down_proj plain: the
residual add goes to add_rmsnorm), the head, and the last layer's down_proj with its residual
add, as the plans that keep only the last row's logits launch it (linear_add)."""
FORMATS = {"lm_head": ("bf16",), "qkv": ("bf16", "fp8", "mxfp4", "nvfp4"),
           "gate_up_swiglu": ("bf16", "fp8", "mxfp4", "nvfp4"),
           "linear_add": ("bf16", "fp8", "mxfp4", "nvfp4")}
"""Weight formats a family runs in, where not every one: the plans keep the head in bf16, and
only linear runs on f32 weights (the exact policy's fp8 prefill dequantizes them first)."""
# gemm.cu's compile-time choices (its header explains each); "" is the source's own
GEMM_VARIANTS = [
    "",
    "TOT_SHARED=0 BK=32 STAGES=4 GEMM_MIN_BLOCKS=1",  # version 14's
    "BK=32 STAGES=2 GEMM_MIN_BLOCKS=3",
    "MI=4 BK=32 STAGES=2",  # 128 x 128, the fastest at 2048 rows in version 15's sweep
    "MI=4 BK=64 STAGES=2 GEMM_MIN_BLOCKS=1",
    "BK=64 STAGES=3 GEMM_MIN_BLOCKS=1",
]
# sm_90's own GEMM (gemm_wgmma.cu): RAW_SMALL=0 takes fp8 and fp4 weights through registers in
# the one-warpgroup blocks of 1-64 rows, where the source stages them raw. (STAGES=5 and
# SMALL_STAGES=6, more stages of 64-column tiles in flight, lost in versions 26 and 27's sweeps;
# they remain valid defines.)
WGMMA_VARIANTS = ["", "RAW_SMALL=0"]
# (model, launch, rows) the variants run at
VARIANT_CASES = [("llama-3.1-8b", "gate_up", 2048), ("llama-3.1-8b", "down", 2048),
                 ("llama-3.1-8b", "qkv", 512), ("llama-3.1-8b", "o_proj", 64),
                 ("llama-3.1-8b", "gate_up", 64), ("llama-3.1-8b", "down", 16),
                 ("llama-3.1-8b", "lm_head", 64), ("qwen3-0.6b", "gate_up", 64),
                 ("qwen3-0.6b", "down", 64), ("qwen3-0.6b", "gate_up", 512)]
WEIGHT_PORTS = {"qkv": ("wq", "wk", "wv"), "linear": ("w",), "linear_add": ("w",),
                "gate_up_swiglu": ("wg", "wu"), "lm_head": ("w",)}
OUT_PORTS = {"qkv": ("q", "k_", "v"), "linear": ("y",), "linear_add": ("y",),
             "gate_up_swiglu": ("h",), "lm_head": ("logits",)}
GEMM_FAMILIES = frozenset(WEIGHT_PORTS)
ATTENTION_FAMILIES = frozenset({"attention", "kv_append_attention", "kv_append_attention_online"})
"""The families whose prefill kernels are measured in tensor throughput (TFLOP/s)."""


def runs_in(family: str, fmt: str) -> bool:
    """Whether the plans run ``family`` with ``fmt`` weights (FORMATS)."""
    return fmt in FORMATS.get(family, (fmt,))


@cache
def realized(family: str, weight: str, shape: str = "gemm", hw: str = "sm_90",
             k_block: int = 256) -> Any:
    """The ``hw`` kernel of ``family``'s ``shape`` point with bf16 activations and ``weight``
    (k in blocks of ``k_block``: 16 is the one chain of the bounded ``chain_*`` relations)."""
    from metrale.lkb.presentation import Presentation
    from metrale.realize.functor import realization

    P = Presentation.load()
    point = P.family(family).point(act="bf16", weight=weight, shape=shape, k_block=k_block,
                                   across="sequential",
                                   **({"out": "f32"} if family == "lm_head" else {}))
    return realization(hw, presentation=P).realize(point)


@functools.cache
def chain_kernel(family: str, weight: str) -> Any:
    """sm_90's k chain (``gemm_chain.cu``) at ``family``'s k_block 16 point in ``weight``, or
    None where its tables do not take that format (the point is then not compiled)."""
    kernel = realized(family, weight, k_block=16)
    return kernel if kernel is not None and kernel.source.endswith("gemm_chain.cu") else None


def takes(kernel: Any, sizes: dict[str, int]) -> bool:
    """Whether ``kernel``'s tables' limits take a launch at ``sizes`` (the k chain: a row tile of
    128 at least, mxfp4's 256)."""
    from metrale.lkb.errors import LaunchError

    try:
        kernel.launches_for(sizes)
    except LaunchError:
        return False
    return True


def shadowed(family: str, weight: str) -> Any:
    """The kernel sm_90's own gemm kernel of ``family`` in ``weight`` shadows (sm_80's, which
    sm_90 would run without it), or None where sm_90 runs the inherited one."""
    return realized(family, weight, "gemm", "sm_80") if realized(family, weight).shadow else None


def wgmma_own(family: str, weight: str) -> bool:
    """Whether sm_90 runs ``family`` in ``weight`` on gemm_wgmma.cu's blocks (whose
    WGMMA_VARIANTS the variants time): every format but bf16, up to the threshold past which
    gemm_tma.cu takes the fp8 and fp4 weights made bf16 (bf16 past 64 rows runs it)."""
    return weight != "bf16" and realized(family, weight).source.startswith("sm_90/")


def wgmma_kernel(kernel: Any) -> Any:
    """``kernel`` (sm_90's GEMM of a quantized or f32 weight) as gemm_wgmma.cu's launches alone,
    at any rows: the launch converting each tile in shared memory as its own, its combine after
    it, and no weight made bf16 first (``tma`` 0), for the variants to rebuild and time."""
    if kernel.entry.endswith("_wgmma"):
        return kernel
    own, *rest = (t for t in kernel.then if "_wgmma" in t.entry)
    return attrs.evolve(kernel, entry=own.entry, launch=own.launch, args=own.args,
                        then=tuple(rest), values=(*kernel.values, ("tma", "0")), scratch=())


def gemm_cu(family: str, weight: str) -> Any:
    """gemm.cu's kernel of ``family``'s gemm point in ``weight``: the base of the variants."""
    return shadowed(family, weight) or realized(family, weight)


def widths(family: str, sizes: dict[str, int]) -> list[int]:
    """The output rows of each weight port of ``family``."""
    if family == "qkv":
        return [sizes["nq"], sizes["nk"], sizes["nv"]]
    return [sizes["n"]] * len(WEIGHT_PORTS[family])


def make_weight(cp: Any, fmt: str, n: int, k: int, rng: np.random.Generator) -> dict:
    """A weight of ``n`` x ``k`` in ``fmt`` (data, scale, global on the device) and its values as a
    bf16 torch-ready f32 array on the device (the dequantized weights, for the check)."""
    from metrale.lkb.quant import QuantFormat

    w = (rng.standard_normal((n, k)).astype(np.float32) / np.float32(np.sqrt(k)))
    if fmt == "f32":
        return {"data": cp.asarray(w), "scale": None, "global": None, "values": cp.asarray(w),
                "bytes": w.nbytes}
    if fmt == "bf16":
        import ml_dtypes

        data = w.astype(ml_dtypes.bfloat16)
        return {"data": cp.asarray(data.view(np.uint16)), "scale": None, "global": None,
                "values": cp.asarray(data.astype(np.float32)), "bytes": data.nbytes}
    qt = QuantFormat.parse(fmt).quantize(w)
    scale = None if qt.scale is None else cp.asarray(np.ascontiguousarray(qt.scale).view(np.uint8))
    glob = None if qt.global_scale is None else cp.asarray(np.asarray(qt.global_scale,
                                                                      np.float32).reshape(1))
    nbytes = qt.data.nbytes + (0 if qt.scale is None else qt.scale.nbytes)
    return {"data": cp.asarray(np.ascontiguousarray(qt.data).view(np.uint8)), "scale": scale,
            "global": glob,
            "values": cp.asarray(np.asarray(qt.dequantize(), np.float32)), "bytes": nbytes}


def time_torch(torch: Any, fn: Any) -> float:
    """Median seconds per call of a torch callable over REPEATS replays of a graph of LAUNCHES
    calls (as bench_gpu_variants.time_graph times a kernel), captured with torch's graph API."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(LAUNCHES):
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPEATS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / LAUNCHES)
    return statistics.median(times)


def cubin(tmp: Path, kernel: Any) -> Path:
    """``kernel``'s source compiled for sm_90a with its defines, once per (source, defines) in
    ``tmp``."""
    defines = " ".join(d.removeprefix("-D") for d in kernel.defines)
    key = hashlib.sha256(f"{kernel.source} {defines}".encode()).hexdigest()[:16]
    out = tmp / f"{Path(kernel.source).stem}_{key}.cubin"
    return out if out.is_file() else build(kernel.source, defines, out)


def prebuild(tmp: Path, models: list[str], formats: list[str]) -> None:
    """Every cubin the launches of ``models`` in ``formats`` use, compiled in parallel."""
    kernels = {(k.source, k.defines): k for _m, _n, family, _d in SHAPES if _m in models
               for fmt in formats if runs_in(family, fmt)
               for k in [realized(family, fmt, "gemm"), realized(family, fmt, "gemv"),
                         shadowed(family, fmt)] if k is not None}
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda k: cubin(tmp, k), kernels.values()))


def launch_chain(kernel: Any, sizes: dict[str, int], own_shape: Any) -> list[tuple]:
    """``(entry, args, (grid, block, shared), own)`` of each launch ``kernel`` makes at
    ``sizes``: its own entry on ``own_shape()`` (a variant's tile), then its ``then`` launches on
    the table's shapes. Past one row a GEMV's own grid is empty, and its multi-row entry is the
    first launch made, on the table's shape."""
    out = []
    for i, (entry, args, shape) in enumerate(kernel.launches_for(sizes)):
        own = i == 0 and entry == kernel.entry
        out.append((entry, args, own_shape() if own else shape, own))
    return out


class Built:
    """A realized kernel compiled and loaded, with its KERNELS.toml launch rule."""

    def __init__(self, cp: Any, tmp: Path, kernel: Any) -> None:
        self.kernel = kernel
        self.module = cp.RawModule(path=str(cubin(tmp, kernel)))
        self.fn = self.module.get_function(kernel.entry)

    def launch_shape(self, sizes: dict[str, int]) -> tuple[tuple, tuple, int]:
        """(grid, block, shared bytes) at ``sizes``."""
        return self.kernel.launch_for(sizes)

    def launcher(self, sizes: dict[str, int], ptrs: dict[str, Any]) -> Any:
        """launch(): the kernel's launches at ``sizes`` (its own on launch_shape's grid, then its
        ``then`` launches) on the buffers ``ptrs`` (by argument name) and one zeroed workspace
        for its scratch arguments, in stream order."""
        import cupy as cp

        env = self.kernel.sizes(sizes)
        chain = launch_chain(self.kernel, sizes, lambda: self.launch_shape(sizes))
        slices = self.kernel.workspace(sizes)  # each scratch argument's slice of one workspace
        work = cp.zeros(max(workspace_bytes(slices), 1), cp.uint8)  # kept alive by the closure
        null = np.uint64(0)

        def value(arg: str, ty: str) -> Any:
            if ty == "ptr":
                return null if ptrs.get(arg) is None else ptrs[arg]
            if (box := tensor_map_box(ty)) is not None and arg in slices:  # a scratch tensor's
                s = slices[arg]
                return encode_tensor_map(work.data.ptr + s.offset, s.rows, s.cols, s.dtype, box)
            if box is not None:  # the buffer's tensor map, encoded
                a = ptrs[arg]
                return encode_tensor_map(a.data.ptr, a.size // a.shape[-1], a.shape[-1], "bf16",
                                         box)
            if ty == "scratch":
                return work[slices[arg].offset:slices[arg].end]
            return np.int32(env[arg])

        calls = []
        for entry, args, (grid, block, shared), own in chain:
            fn = self.fn if own else self.module.get_function(entry)
            fn.max_dynamic_shared_size_bytes = max(shared, 1)
            calls.append((fn, grid, block, shared, tuple(
                value(arg, ty) for arg, _, ty in (a.partition(":") for a in args))))
        # CuPy passes no tensor map (a 128-byte argument): such launches go through the driver
        driver = DriverLauncher() if any(isinstance(v, np.void) for *_, vals in calls
                                         for v in vals) else None

        def launch() -> None:
            for fn, grid, block, shared, vals in calls:
                if driver is not None and any(isinstance(v, np.void) for v in vals):
                    driver.launch_dependent(fn.kernel.ptr, grid, block, shared,
                                            cp.cuda.get_current_stream().ptr,
                                            tuple(np.uint64(v.data.ptr) if hasattr(v, "data")
                                                  and hasattr(v.data, "ptr") else v
                                                  for v in vals), dependent=False)
                else:
                    fn(grid, block, vals, shared_mem=shared)
        return launch


def tile_shape(defines: str, weight: str) -> dict[str, int]:
    """gemm.cu's tile at these defines (its defaults otherwise): BM, BN, threads, shared bytes."""
    d = {k: int(v) for k, v in parse_defines(defines).items()}
    parts = 3 if weight == "f32" else 1
    wm, wn, mi = d.get("WARPS_M", 2), d.get("WARPS_N", 4), d.get("MI", 2)
    bk, stages = d.get("BK", 64 if parts == 1 else 32), d.get("STAGES", 2)
    bm, bn = wm * 16 * mi, wn * 32
    shared = stages * (bm + parts * bn) * (bk + 8) * 2 + (
        4 * bm * bn if d.get("TOT_SHARED", int(parts == 1)) else 0)
    return {"bm": bm, "bn": bn, "threads": 32 * wm * wn, "shared": shared}


def with_defines(kernel: Any, defines: str) -> Any:
    """``kernel`` compiled with the space-separated ``defines`` after its own."""
    return attrs.evolve(kernel, defines=kernel.defines + tuple(f"-D{d}" for d in defines.split()))


class Variant(Built):
    """A gemm kernel built with extra defines, launched on the tile those defines give."""

    def __init__(self, cp: Any, tmp: Path, kernel: Any, defines: str, weight: str) -> None:
        super().__init__(cp, tmp, with_defines(kernel, defines))
        self.family = kernel.point.family
        self.tile = tile_shape(defines, weight)

    def launch_shape(self, sizes: dict[str, int]) -> tuple[tuple, tuple, int]:
        t = self.tile
        cols = (-(-sizes["nq"] // t["bn"]) - (-sizes["nk"] // t["bn"]) - (-sizes["nv"] // t["bn"])
                if self.family == "qkv" else
                -(-sizes["n"] // (t["bn"] // 2)) if self.family == "gate_up_swiglu" else
                -(-sizes["n"] // t["bn"]))
        return (-(-sizes["rows"] // t["bm"]), cols, 1), (t["threads"], 1, 1), t["shared"]


# bits of a weight's raw-staged slots in gemm_wgmma.cu's tables: fp8's in the tables that take
# fp8 and nvfp4, fp4's in those that take bf16 and mxfp4 (KERNELS.toml); f32 none
TABLE_RAW_BITS = {"fp8": 8, "nvfp4": 8, "mxfp4": 4, "bf16": 4, "f32": 0}


def wgmma_shared(defines: str, weight: str, warpgroups: int = 2) -> int:
    """gemm_wgmma.cu's shared memory at these defines (its defaults otherwise) for blocks of
    ``warpgroups``: STAGES (SMALL_STAGES for one warpgroup) stages of an activation tile of 64
    rows a warpgroup, 8 KiB each, and the weight planes (three for f32), 16 KiB each; 1 KiB to
    align the first stage; then, as the table gives them at both block sizes, raw weights' slots
    of 128 rows of 64 weights, one for each tile in flight (stages - 2), as wide as its table's
    widest raw weight (a block on the register path leaves them unused)."""
    planes = 3 if weight == "f32" else 1
    d = parse_defines(defines)
    stages = int(d.get("STAGES", 3 if planes == 3 else 4) if warpgroups == 2 else
                 d.get("SMALL_STAGES", 4))
    slots = (stages - 2) * 128 * 64 * TABLE_RAW_BITS[weight] // 8
    return stages * (8192 * warpgroups + planes * 16384) + 1024 + slots


class WgmmaVariant(Built):
    """sm_90's wgmma GEMM built with extra defines: KERNELS.toml's launches, with the shared
    memory its stages take."""

    def __init__(self, cp: Any, tmp: Path, kernel: Any, defines: str, weight: str) -> None:
        super().__init__(cp, tmp, with_defines(kernel, defines))
        self.defines, self.weight = defines, weight

    def launch_shape(self, sizes: dict[str, int]) -> tuple[tuple, tuple, int]:
        grid, block, _ = super().launch_shape(sizes)
        return grid, block, wgmma_shared(self.defines, self.weight, block[0] // 128)


class Launch:
    """One launch's kernels and weights, built once: the sm_90 realizations of the family's gemm
    point in ``fmt`` (tensor cores) and of its gemv point (the decode kernel, for the rows where
    both apply), the weights on the device and, for the peer, their dequantized values as one
    bf16 torch tensor (the weights concatenated)."""

    def __init__(self, cp: Any, torch: Any, tmp: Path, family: str, dims: dict[str, int],
                 fmt: str, k_block: int = 256) -> None:
        self.family, self.dims, self.fmt = family, dims, fmt
        self.gemm = Built(cp, tmp, realized(family, fmt, "gemm", k_block=k_block))
        self._built = (cp, tmp)
        rng = np.random.default_rng(dims["k"])
        self.widths = widths(family, dims)
        self.ws = [make_weight(cp, fmt, n, dims["k"], rng) for n in self.widths]
        self.tw = torch.cat([torch.as_tensor(w["values"], device="cuda")
                             for w in self.ws]).to(torch.bfloat16)
        for w in self.ws:
            del w["values"]

    @functools.cached_property
    def gemv(self) -> Built:
        """The decode kernel of the same launch, built when first asked for."""
        return Built(*self._built, realized(self.family, self.fmt, "gemv"))

    @functools.cached_property
    def shadowed(self) -> Built | None:
        """The inherited gemm kernel sm_90's own one shadows, if it does (timed beside it)."""
        k = shadowed(self.family, self.fmt)
        return None if k is None else Built(*self._built, k)


def bench_case(cp: Any, torch: Any, lc: Launch, model: str, name: str, rows: int,
               rate: float, gemv_rows: int, gemm: Built | None = None) -> dict:
    """``lc`` at ``rows`` rows: Metrale's tensor-core kernel (and, up to ``gemv_rows`` rows, its
    GEMV) checked against torch on the same (dequantized) weights, all timed, with the floors."""
    family, dims, k = lc.family, lc.dims, lc.dims["k"]
    sizes = {"rows": rows, **dims}
    x = bf16_bits(cp, (rows, k))
    r = bf16_bits(cp, (rows, dims["n"])) if family == "linear_add" else None
    f32_out = family == "lm_head"
    outs = [cp.empty((rows, n), cp.float32 if f32_out else cp.uint16) for n in
            (lc.widths if family == "qkv" else [dims["n"]])]
    ptrs = {"x": x, "r": r}
    for port, w in zip(WEIGHT_PORTS[family], lc.ws):
        ptrs.update({port: w["data"], f"{port}_scale": w["scale"], f"{port}_global": w["global"]})
    ptrs.update(zip(OUT_PORTS[family], outs))

    # the peer on the same values: torch bf16 (cuBLAS), weights as bf16 of the dequantized values
    tx = torch.as_tensor(x.view(cp.int16), device="cuda").view(torch.bfloat16)
    tr = None if r is None else torch.as_tensor(r.view(cp.int16), device="cuda").view(torch.bfloat16)

    def peer() -> Any:
        if family == "linear_add":
            return torch.addmm(tr, tx, lc.tw.t())
        y = tx @ lc.tw.t()
        if family == "gate_up_swiglu":
            return torch.nn.functional.silu(y[:, :dims["n"]]) * y[:, dims["n"]:]
        return y

    want = peer().float()

    def checked(built: Built) -> tuple[float, bool, float]:
        """(median seconds, outputs finite, max relative difference from the peer)."""
        launch = built.launcher(sizes, ptrs)
        for o in outs:
            o.fill(np.nan if f32_out else 0xFFFF)  # poison: NaN
        launch()
        cp.cuda.Device().synchronize()
        got = torch.cat([torch.as_tensor(o, device="cuda") if f32_out else
                         torch.as_tensor(o.view(cp.int16), device="cuda").view(torch.bfloat16)
                         for o in outs], dim=1).float()
        rel = float((got - want).abs().max() / want.abs().max())
        return time_graph(cp, lambda _: launch(), 1), bool(torch.isfinite(got).all()), rel

    t_shadowed = checked(lc.shadowed) if gemm is None and lc.shadowed else None
    gemm = gemm or lc.gemm
    t, finite, rel = checked(gemm)
    t_gemv = checked(lc.gemv) if rows <= gemv_rows else None
    t_peer = time_torch(torch, peer)
    n_total = sum(lc.widths)
    flops = 2.0 * rows * n_total * k
    nbytes = sum(w["bytes"] for w in lc.ws) + 2 * rows * k + (4 if f32_out else 2) * rows * n_total
    floor = max(flops / TENSOR_PEAK, nbytes / rate)
    out = {"model": model, "launch": name, "family": family, "weight": lc.fmt, "rows": rows,
           "k_block": dict(gemm.kernel.point.params)["k_block"],
           "point": str(gemm.kernel.point), "source_hash": gemm.kernel.source_hash,
           "seconds": t, "peer_seconds": t_peer, "tflops": flops / t / 1e12,
           "peer_tflops": flops / t_peer / 1e12, "vs_peer": t_peer / t, "floor_s": floor,
           "of_floor": floor / t, "finite": finite, "max_rel_err_vs_peer": rel}
    if t_shadowed is not None:
        out.update(shadowed_point=str(lc.shadowed.kernel.point),
                   shadowed_entry=lc.shadowed.kernel.entry, shadowed_seconds=t_shadowed[0],
                   shadowed_finite=t_shadowed[1], shadowed_max_rel_err_vs_peer=t_shadowed[2],
                   shadowed_vs_gemm=t_shadowed[0] / t)
    if t_gemv is not None:
        out.update(gemv_seconds=t_gemv[0], gemv_finite=t_gemv[1],
                   gemv_max_rel_err_vs_peer=t_gemv[2], gemv_vs_gemm=t_gemv[0] / t)
    return out


def bench_variants(cp: Any, torch: Any, tmp: Path, rate: float, formats: list[str],
                   rows_only: set[int] | None = None, with_gemm_cu: bool = True) -> list[dict]:
    """Every GEMM_VARIANTS build (unless not ``with_gemm_cu``) and WGMMA_VARIANTS build at
    VARIANT_CASES (those at ``rows_only``, if given) in ``formats``: checked, timed, with the
    peer."""
    shapes = {(m, n): (f, d) for m, n, f, d in SHAPES}
    cases = [c for c in VARIANT_CASES if rows_only is None or c[2] in rows_only]
    gemm_variants = GEMM_VARIANTS if with_gemm_cu else []
    kernels = {}
    for model, name, _rows in cases:
        for fmt in formats:
            if not runs_in(shapes[model, name][0], fmt):
                continue
            k = gemm_cu(shapes[model, name][0], fmt)
            for v in gemm_variants:
                built = with_defines(k, v)
                kernels[built.source, built.defines] = built
            if wgmma_own(shapes[model, name][0], fmt):  # sm_90's own, and its variants
                for v in WGMMA_VARIANTS:
                    built = with_defines(realized(shapes[model, name][0], fmt), v)
                    kernels[built.source, built.defines] = built
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda k: cubin(tmp, k), kernels.values()))
    out = []
    for model, name, rows in cases:
        family, dims = shapes[model, name]
        for fmt in formats:
            if not runs_in(family, fmt):
                continue
            lc = Launch(cp, torch, tmp, family, dims, fmt)
            own = [(f"wgmma {v}".strip(), WgmmaVariant(cp, tmp, wgmma_kernel(lc.gemm.kernel), v,
                                                       fmt))
                   for v in (WGMMA_VARIANTS if wgmma_own(family, fmt) else [])]
            for v, built in [(v, Variant(cp, tmp, gemm_cu(family, fmt), v, fmt))
                             for v in gemm_variants] + own:
                c = bench_case(cp, torch, lc, model, name, rows, rate, 0, built)
                c["variant"] = v
                out.append(c)
                print(f"{model:<13} {name:<8} {fmt:<6} rows {rows:>5} [{v or 'source'}]: "
                      f"{c['seconds'] * 1e6:9.1f} us {c['tflops']:6.0f} TFLOP/s "
                      f"(cuBLAS x{c['vs_peer']:.2f}) rel err {c['max_rel_err_vs_peer']:.1e}",
                      flush=True)
    return out


def prefill_flops(config: Any, rows: int) -> float:
    """The tensor-core work of a dense model's prefill of ``rows`` tokens: the layers' matmuls,
    causal attention (q·k and p·v over the positions each row sees) and the logits of every row."""
    c = config
    qkv = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    o = c.num_attention_heads * c.head_dim * c.hidden_size
    mlp = 3 * c.hidden_size * c.intermediate_size
    seen = rows * (rows + 1) / 2  # positions summed over the rows
    attention = 4 * seen * c.num_attention_heads * c.head_dim
    return c.num_hidden_layers * (2 * rows * (qkv + o + mlp) + attention) + \
        2 * rows * c.hidden_size * c.vocab_size


def hf_prefill(torch: Any, model: str, rows: int) -> float:
    """transformers' forward over a ``rows``-token prompt (bf16, random weights, its cache made
    on the way, every row's logits as Metrale's prefill gives them): median seconds of 5 after
    2, CUDA events."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from metrale.plan.config import ModelConfig

    cfg = AutoConfig.for_model(**ModelConfig.load(model).to_hf_dict())
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, rows), device="cuda")
    times = []
    with torch.no_grad():
        for i in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            m(ids, use_cache=True)
            b.record()
            b.synchronize()
            if i >= 2:
                times.append(a.elapsed_time(b) / 1e3)
    del m
    torch.cuda.empty_cache()
    return statistics.median(times)


def tensor_records(measured: list[tuple[str, str, float, str]]) -> list:
    """Evidence records of tensor throughput on this GPU, against the tensor-core peak, from
    (family, point, TFLOP/s, source hash)."""
    import cupy as cp

    from metrale.realize.compute import NvidiaTarget
    from metrale.realize.evidence import EvidenceRecord

    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    today, toolchain = datetime.date.today().isoformat(), NvidiaTarget("ptx").version()
    return [EvidenceRecord("sm_90", device, family, point, "tensor_throughput", tflops,
                           TENSOR_PEAK / 1e12, "TFLOP/s", today, toolchain, source_hash)
            for family, point, tflops, source_hash in measured]


def step_kernels(eng: Any, config: Any, rows: int, step_s: float, records: list | None,
                 logits: str = "all", skip: frozenset = frozenset()) -> list[dict]:
    """Each distinct kernel of the prefill of a ``rows``-token prompt (``logits`` as
    prefill_program takes it; points in ``skip`` left out) timed alone, printed as shares of the
    step; with ``records``, evidence for those the matmul cases do not measure: the prefill
    attention's tensor throughput (causal: each row sees itself and the rows before it) and the
    other kernels' bandwidth."""
    from bench_gpu_decode import print_kernels

    from metrale.runtime.bench import evidence, kernel_times

    timings = [k for k in kernel_times(eng, rows, mode="prefill", repeats=5, logits=logits)
               if k.point not in skip]
    seen = rows * (rows + 1) / 2
    attention_flops = 4 * seen * config.num_attention_heads * config.head_dim
    kernels = []
    for k in timings:
        row = {"kernel": k.label, "point": k.point, "count": k.count, "seconds": k.seconds,
               "bytes": k.bytes_moved, "bytes_per_s": k.bytes_per_s}
        if k.family in ATTENTION_FAMILIES:
            row["tflops"] = attention_flops / k.seconds / 1e12
        kernels.append(row)
    print_kernels(kernels, step_s)
    if records is not None:
        import cupy as cp

        from metrale.realize.compute import NvidiaTarget
        from metrale.realize.hardware import load_hardware

        records += tensor_records([(k.family, k.point, row["tflops"], k.kernel.source_hash)
                                   for k, row in zip(timings, kernels)
                                   if "tflops" in row and k.kernel is not None])
        records += evidence([k for k, row in zip(timings, kernels)
                             if "tflops" not in row and k.family not in GEMM_FAMILIES],
                            load_hardware().get("sm_90"),
                            cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                            NvidiaTarget("ptx").version())
    return kernels


def prefill_engine(model: str, quant: str, max_ctx: int, policy: str = "exact",
                   graphs: bool = True, kernels_dir: str | None = None) -> Any:
    """An sm_90 engine with one cache slot of ``max_ctx`` positions and random weights, planned
    under ``policy`` over ``kernels_dir`` (None: the shipped folder); its prefills replay a
    captured graph, as the engine's do (``graphs`` False: launched one by one from the host)."""
    from metrale.plan.config import ModelConfig
    from metrale.runtime.engine import Engine, pooled_weights

    return Engine(ModelConfig.load(model), quant, pooled_weights(model, quant), hardware="sm_90",
                  backend=None, loader=None, act="bf16", max_ctx=max_ctx, slots=1,
                  blocking=False, debug=False, graphs=graphs, fuse=True, policy=policy,
                  kernels_dir=kernels_dir)


def prefill_steps(torch: Any, models: list[str], lengths: list[int], quants: list[str],
                  hf: bool, kernels: bool = False, records: list | None = None,
                  policies: tuple[str, ...] = ("exact",),
                  kernels_dirs: tuple[str, ...] = ()) -> list[dict]:
    """Whole prefill steps on the sm_90 plans under each of ``policies`` (random weights, one
    sequence from position 0), against the tensor-core floor of their FLOPs and, in bf16,
    transformers' forward (which, like the first timing, gives every row's logits; once a
    model and length); then the plan with the last row's only. With ``kernels`` (or
    ``records``), the longest prompt's kernels one by one (step_kernels), each point once a
    model and quant: a later policy's plan times only the kernels it adds. Each of
    ``kernels_dirs`` (variant kernel folders) plans the same steps again, right after the
    shipped folder's, its rows marked ``kernels_dir`` (neither its kernels timed alone nor
    recorded)."""
    from metrale.plan.config import ModelConfig
    from metrale.runtime.bench import time_prefill

    out = []
    hf_seconds: dict[tuple[str, int], float] = {}
    for model in models:
        config = ModelConfig.load(model)
        timed: dict[str, set[str]] = {}  # quant -> points whose kernels its steps have timed
        for quant, policy, folder in ((q, p, f) for q in quants for p in policies
                                      for f in (None, *kernels_dirs)):
            eng = prefill_engine(model, quant, max(lengths), policy, kernels_dir=folder)
            for rows in lengths:
                t = time_prefill(eng, rows, steps=5, warmup=2)
                last = time_prefill(eng, rows, steps=5, warmup=2, logits="last")
                # the same weights and prompt give the same hash exactly when the plans' kernels
                # agree bit for bit (the last row's logits read every row through attention): how
                # an A/B of kernel folders checks a bit-identical change
                logits = eng.prefill_program(rows, logits="last").read("logits")
                host = time_prefill(eng, rows, steps=5, warmup=2, replay=False)
                flops = prefill_flops(config, rows)
                row = {"model": model, "quant": quant, "policy": policy, "rows": rows,
                       "step_s": t.step_s,
                       "graph": t.graph, "host_launched_step_s": host.step_s,
                       "last_logits_step_s": last.step_s, "launches": t.launches, "flops": flops,
                       "tflops": flops / t.step_s / 1e12,
                       "of_tensor_floor": flops / TENSOR_PEAK / t.step_s,
                       "last_logits_finite": bool(np.isfinite(logits).all()),
                       "last_logits_sha256": array_sha256(logits)}
                # a record run's steps are planned after its cases are recorded: what is left
                unmeasured = sorted(str(k.point)
                                    for k in unmeasured_kernels(eng.plan("prefill", rows)))
                if unmeasured:
                    row["unmeasured"] = unmeasured
                    print(f"prefill {model} {quant} {policy} {rows}: planned with "
                          f"{len(unmeasured)} kernels unmeasured on sm_90 (their choice may "
                          f"change once recorded): {', '.join(unmeasured)}", flush=True)
                if folder is not None:
                    row["kernels_dir"] = folder
                if hf and quant == "bf16":
                    if (model, rows) not in hf_seconds:
                        hf_seconds[model, rows] = hf_prefill(torch, model, rows)
                    row["hf_eager_s"] = hf_seconds[model, rows]
                    row["vs_hf_eager"] = row["hf_eager_s"] / t.step_s
                out.append(row)
                peer = (f", HF eager {row['hf_eager_s'] * 1e3:.2f} ms (x{row['vs_hf_eager']:.2f})"
                        if "hf_eager_s" in row else "")
                print(f"prefill {model:<13} {quant:<6} {policy:<7} {rows:>5} tokens"
                      + (f" [{folder}]" if folder else "") + ": "
                      f"{t.step_s * 1e3:8.2f} ms, {row['tflops']:5.0f} TFLOP/s "
                      f"({row['of_tensor_floor']:.0%} of the tensor floor){peer}; "
                      f"last row's logits only {last.step_s * 1e3:.2f} ms; launched from the "
                      f"host {host.step_s * 1e3:.2f} ms; last row's logits "
                      f"{row['last_logits_sha256'][:12]}"
                      + ("" if row["last_logits_finite"] else " NOT FINITE"), flush=True)
                if (kernels or records is not None) and rows == max(lengths) and folder is None:
                    done = timed.setdefault(quant, set())
                    row["kernels"] = step_kernels(eng, config, rows, t.step_s, records,
                                                  skip=frozenset(done))
                    done.update(k["point"] for k in row["kernels"])
                    # the kernels only the last row's logits launch (last_row, ...)
                    row["last_logits_kernels"] = step_kernels(
                        eng, config, rows, last.step_s, records, logits="last",
                        skip=frozenset(done))
                    done.update(k["point"] for k in row["last_logits_kernels"])
            eng.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="8,64,512,2048",
                    help="rows each launch is timed at (empty: no launches, steps only)")
    ap.add_argument("--weights", default="bf16,fp8,mxfp4,f32")
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--k-blocks", default="256,16",
                    help="the gemm points' k_block values to time: 256, and 16 (bf16 weights "
                         "from 128 rows, mxfp4 from 256: the bounded chain_* relations' points)")
    ap.add_argument("--gemv-rows", type=int, default=64,
                    help="also time the GEMV (decode) kernel at rows up to this many")
    ap.add_argument("--steps", default="512,2048",
                    help="prompt lengths of whole prefill steps (empty: none)")
    ap.add_argument("--step-quants", default="bf16,mxfp4")
    ap.add_argument("--policies", default="exact",
                    help="plan the steps under each of these policies (exact, bounded)")
    ap.add_argument("--no-hf", action="store_true", help="no transformers peer for the steps")
    ap.add_argument("--kernels-dirs", default="",
                    help="variant kernel folders (comma-separated: copies of kernels/ with an "
                         "edited table or source) whose plans' steps are timed right after the "
                         "shipped folder's, in the same process")
    ap.add_argument("--kernels", action="store_true",
                    help="time each kernel of the longest prefill step alone")
    ap.add_argument("--variants", action="store_true",
                    help="time gemm.cu's GEMM_VARIANTS and gemm_wgmma.cu's WGMMA_VARIANTS at "
                         "VARIANT_CASES instead")
    ap.add_argument("--variant-rows", default="",
                    help="with --variants: only the cases at these rows (comma-separated)")
    ap.add_argument("--wgmma-only", action="store_true",
                    help="with --variants: gemm_wgmma.cu's variants only")
    ap.add_argument("--record", action="store_true",
                    help="record evidence (throughput at the largest rows) for sm_90 in the evidence store")
    ap.add_argument("--name", default="gpu_prefill", type=result_name,
                    help="write benchmarks/results/NAME.json (an experiment's run beside the "
                         "record's; --variants writes gpu_prefill_variants.json)")
    args = ap.parse_args()
    import cupy as cp
    import torch

    rows_list = [int(r) for r in args.rows.split(",") if r]
    rate = device_copy_rate()
    print(f"device copy rate {rate / 1e12:.2f} TB/s; tensor peak {TENSOR_PEAK / 1e12:.0f} TFLOP/s")
    cases = []
    if args.variants:
        with tempfile.TemporaryDirectory() as tmp:
            only = {int(r) for r in args.variant_rows.split(",") if r} or None
            cases = bench_variants(cp, torch, Path(tmp), rate, args.weights.split(","), only,
                                   not args.wgmma_only)
        path = write_result("gpu_prefill_variants", {
            "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
            "copy_rate": rate, "tensor_peak": TENSOR_PEAK, "variants": GEMM_VARIANTS,
            "wgmma_variants": WGMMA_VARIANTS,
            "launches": LAUNCHES, "repeats": REPEATS, "cases": cases})
        print(f"wrote {path}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        prebuild(Path(tmp), args.models.split(","), args.weights.split(","))
        for model, name, family, dims in SHAPES:
            if model not in args.models.split(","):
                continue
            for fmt, k_block in itertools.product(args.weights.split(","),
                                                  map(int, args.k_blocks.split(","))):
                if not runs_in(family, fmt) or k_block != 256 and not chain_kernel(family, fmt):
                    continue
                lc = Launch(cp, torch, Path(tmp), family, dims, fmt, k_block)
                for rows in rows_list:
                    if k_block != 256 and not takes(lc.gemm.kernel, {"rows": rows, **dims}):
                        continue
                    c = bench_case(cp, torch, lc, model, name, rows, rate,
                                   args.gemv_rows if k_block == 256 else 0)
                    cases.append(c)
                    gemv = (f"; GEMV {c['gemv_seconds'] * 1e6:.1f} us (x{c['gemv_vs_gemm']:.2f})"
                            if "gemv_seconds" in c else "")
                    gemv += (f"; shadowed {c['shadowed_entry']} "
                             f"{c['shadowed_seconds'] * 1e6:.1f} us (x{c['shadowed_vs_gemm']:.2f})"
                             if "shadowed_seconds" in c else "")
                    print(f"{model:<13} {name:<8} {fmt:<6} k_block {k_block:>3} rows {rows:>5}: "
                          f"{c['seconds'] * 1e6:9.1f} us {c['tflops']:6.0f} TFLOP/s "
                          f"(cuBLAS bf16 {c['peer_seconds'] * 1e6:9.1f} us, x{c['vs_peer']:.2f}; "
                          f"{c['of_floor']:.0%} of floor) rel err {c['max_rel_err_vs_peer']:.1e}"
                          + gemv, flush=True)
    records: list | None = [] if args.record else None
    if args.record and cases:  # before the steps are planned, so that they price these records
        record(cases, max(rows_list), [])
    steps = prefill_steps(torch, args.models.split(","),
                          [int(r) for r in args.steps.split(",") if r],
                          args.step_quants.split(","), not args.no_hf, args.kernels,
                          records, tuple(args.policies.split(",")),
                          tuple(filter(None, args.kernels_dirs.split(",")))) if args.steps else []
    path = write_result(args.name, {"device": cp.cuda.runtime.getDeviceProperties(0)["name"]
                                    .decode(), "copy_rate": rate, "tensor_peak": TENSOR_PEAK,
                                    "launches": LAUNCHES, "repeats": REPEATS,
                                    "cases": cases, "steps": steps})
    print(f"wrote {path}")
    if args.record and records:  # the steps' kernels timed alone
        record([], 0, records)


def agrees(case: dict) -> bool:
    """Whether a case's outputs are finite and within ``AGREES`` of cuBLAS's (relative to the
    largest output): only such a case records evidence."""
    return case["finite"] and case["max_rel_err_vs_peer"] < AGREES


def time_records(cases: list[dict], device: str, date: str, toolchain: str) -> list:
    """A time record of each agreeing case (its kernel's launches at its shape and rows, as the
    plans' cost model reads them: ``time@k=..,n=..,rows=..`` in µs), made on ``device``.

    >>> r, = time_records([{"model": "qwen3-0.6b", "launch": "o_proj", "family": "linear",
    ...     "point": "linear[x]", "rows": 64, "seconds": 6.4e-6, "source_hash": "ab",
    ...     "finite": True, "max_rel_err_vs_peer": 0.003}], "H100", "2026-12-06", "nvcc")
    >>> r.metric, round(r.value, 3), r.unit
    ('time@k=2048,n=1024,rows=64', 6.4, 'us')
    """
    from metrale.realize.evidence import EvidenceRecord

    dims = {(model, name): d for model, name, _f, d in SHAPES}
    out = []
    for c in cases:
        if not agrees(c):
            continue
        at = {**dims[c["model"], c["launch"]], "rows": c["rows"]}
        metric = "time@" + ",".join(f"{k}={v}" for k, v in sorted(at.items()))
        out.append(EvidenceRecord("sm_90", device, c["family"], c["point"], metric,
                                  c["seconds"] * 1e6, None, "us", date, toolchain,
                                  c["source_hash"]))
    return out


def record(cases: list[dict], rows: int, more: list) -> None:
    """Record each measured gemm point's throughput at ``rows`` (its best launch shape) in the
    evidence store, against the tensor-core peak, every case's time at its shape and rows (what
    the plans' cost model reads: without them a point's cost at few rows is the analytic
    model's alone), and the records in ``more`` (step_kernels'); a case whose outputs are not
    finite or differ from cuBLAS's by ``AGREES`` or more records nothing."""
    import cupy as cp

    from metrale.realize.compute import NvidiaTarget
    from metrale.realize.evidence import record_evidence
    from metrale.realize.evidence_store import default_store_path

    best: dict[str, dict] = {}
    for c in cases:
        if c["rows"] == rows and agrees(c) and (c["point"] not in best
                                                or c["tflops"] > best[c["point"]]["tflops"]):
            best[c["point"]] = c
    device = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    times = time_records(cases, device, datetime.date.today().isoformat(),
                         NvidiaTarget("ptx").version())
    records = tensor_records([(c["family"], c["point"], c["tflops"], c["source_hash"])
                              for c in best.values()]) + times + more
    added = record_evidence(records)
    print(f"recorded {added} new evidence records in {default_store_path()}")


if __name__ == "__main__":
    main()
