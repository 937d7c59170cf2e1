"""The tensor-core GEMM's own source (kernels/cuda/common/gemm.cu) run on the host.

``tests/host/simt`` compiles gemm.cu with the host compiler against an emulation of the CUDA
execution model: a thread per CUDA thread, barriers for ``__syncthreads``, and the five PTX
instructions the kernel issues (cp.async and its groups, ldmatrix, mma.sync) emulated as the PTX
ISA defines them, cp.async's copies landing only at the wait that completes them. The sm_90
realization's launch rule and argument list drive each launch, as the runtime's would, so these
tests check the kernel's tiling, fragment layouts, pipeline and epilogues, and its KERNELS.toml
table, against the reference semantics: on random inputs within the bf16 tolerance, and byte for
byte where every sum is exact. (The emulated MMA sums in double; the hardware's order inside an
MMA is its own, which only the device tests see.)
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import re
import shutil
import subprocess
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from metrale.lkb.presentation import Presentation
from metrale.lkb.quant import QuantFormat
from metrale.lkb.semantics import SEMANTICS
from metrale.realize.functor import realization

CXX = shutil.which("g++")
NVCC = shutil.which("nvcc")
pytestmark = pytest.mark.skipif(CXX is None or NVCC is None,
                                reason="needs g++ and the CUDA headers (nvcc's)")

HERE = Path(__file__).resolve().parent / "simt"
COMMON = Path(__file__).resolve().parents[2] / "kernels" / "cuda" / "common"
P = Presentation.load()
F = realization("sm_90", presentation=P)
GEMM = {"act": "bf16", "shape": "gemm", "k_block": 256, "across": "sequential"}
RTOL = 1.6e-2


def _cuda_includes() -> list[Path]:
    """Where the CUDA headers are: nvcc's own include path (its ``--dryrun`` names it), else
    the NVRTC distribution's."""
    from metrale.realize.compute import find_nvrtc

    r = subprocess.run([NVCC, "--dryrun", "-c", "-x", "cu", "/dev/null", "-o", "/dev/null"],
                       capture_output=True, text=True, timeout=60)
    found = [Path(m) for m in re.findall(r'-I"?([^"\s]+)', " ".join(
        line for line in (r.stdout + r.stderr).splitlines() if "INCLUDES=" in line))]
    nvrtc = find_nvrtc()
    found += list(nvrtc.include_dirs) if nvrtc else []
    return [d for d in found if (d / "cuda_bf16.h").is_file()][:1]


def library(tmp: Path, defines: tuple[str, ...]) -> ctypes.CDLL:
    """gemm.cu with ``defines``, compiled for the host emulation (cached by source content)."""
    texts = [p.read_bytes() for p in (HERE / "simt.hpp", HERE / "gemm_host.cpp",
                                      *sorted(COMMON.glob("*.cu*")))]
    key = hashlib.sha256(b"".join(texts) + " ".join(defines).encode()).hexdigest()[:16]
    out = tmp / f"gemm_{key}.so"
    if not out.is_file():
        includes = _cuda_includes()
        assert includes, "no CUDA headers found"
        cmd = [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-w", f"-I{includes[0]}",
               f"-I{COMMON}", *(f"-D{d}" for d in defines), str(HERE / "gemm_host.cpp"),
               "-o", str(out), "-lpthread"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    return ctypes.CDLL(str(out))


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("simt")


def run(build_dir: Path, family: str, point, sizes: dict[str, int], arrays: dict) -> None:
    """Launch ``point``'s sm_90 kernel on the host emulation: its defines, entry, launch rule
    and argument order from the realization; ``arrays`` holds every pointer argument by name
    (None for a null pointer), outputs written in place."""
    kernel = F.realize(point)
    lib = library(build_dir, tuple(d.removeprefix("-D") for d in kernel.defines))
    grid, block, shared = kernel.launch_for(sizes)
    values = []
    for a in kernel.args:
        name, _, ty = a.partition(":")
        if ty == "ptr":
            arr = arrays[name]
            values.append(ctypes.c_void_p(None if arr is None else arr.ctypes.data))
        else:
            assert ty == "i32", a
            values.append(ctypes.c_int(sizes[name]))
    argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    assert block[1:] == (1, 1)
    rc = lib.simt_launch(kernel.entry.encode(), *grid, block[0], shared, argv)
    assert rc == 0, f"{kernel.entry} is not in gemm_host.cpp"


def _weight(fmt: str, n: int, k: int, rng: np.random.Generator) -> tuple[dict, np.ndarray]:
    """(device parts: data, scale, global; the dequantized f32 values the reference takes)."""
    w = rng.standard_normal((n, k)).astype(np.float32) / np.float32(np.sqrt(k))
    if fmt == "bf16":
        data = w.astype(ml_dtypes.bfloat16)
        return {"": data, "_scale": None, "_global": None}, data.astype(np.float32)
    qt = QuantFormat.parse(fmt).quantize(w)
    glob = None if qt.global_scale is None else np.asarray(qt.global_scale, np.float32).reshape(1)
    return ({"": np.ascontiguousarray(qt.data), "_scale": qt.scale, "_global": glob},
            np.asarray(qt.dequantize(), np.float32))


def _kwargs(family: str, point) -> dict:
    accepted = inspect.signature(SEMANTICS[P.family(family).semantics]).parameters
    return {k: v for k, v in point.as_dict().items() if k in accepted}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    g, w = got.astype(np.float32), want.astype(np.float32)
    assert np.isfinite(g).all(), f"{what}: unwritten or not finite"
    scale = float(np.abs(w).max())
    np.testing.assert_allclose(g, w, rtol=RTOL, atol=1e-5 + RTOL * scale * 0.1, err_msg=what)


# (family, sizes): two row tiles, the last ragged (70 = 64 + 6); column tiles with ragged ends;
# k with a short last k-block (544 = 2 x 256 + 32), or rows not 16-byte aligned (300)
CASES = [
    ("linear", {"rows": 70, "k": 544, "n": 136}),
    ("linear", {"rows": 9, "k": 300, "n": 40}),
    ("lm_head", {"rows": 20, "k": 288, "n": 130}),
    ("linear_add", {"rows": 70, "k": 288, "n": 136}),
    ("qkv", {"rows": 33, "k": 288, "nq": 136, "nk": 24, "nv": 40}),
    ("gate_up_swiglu", {"rows": 70, "k": 544, "n": 72}),
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,sizes", CASES, ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}{v}" for k, v in x.items()))
def test_gemm_matches_reference_on_the_emulation(build_dir, family, sizes, weight):
    fam = P.family(family)
    point = fam.point(**GEMM, weight=weight, **({"out": "f32"} if family == "lm_head" else {}))
    if weight != "bf16" and sizes["k"] % (QuantFormat.parse(weight).block_size or 1):
        pytest.skip(f"{weight} needs k a multiple of its block")  # fp8 takes any k
    assert F.realize(point).entry.endswith("_mma")
    rng = np.random.default_rng(sizes["rows"] + sizes["k"])
    rows, k = sizes["rows"], sizes["k"]
    x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    arrays: dict = {"x": x}
    host = [x]
    for port in fam.inputs[1:]:
        if port.name in fam.weights:
            n = sizes["n"] if "n" in sizes else sizes[port.dims[0]]
            parts, values = _weight(weight, n, k, rng)
            arrays.update({port.name + s: v for s, v in parts.items()})
            host.append(values)
        else:  # linear_add's residual
            r = rng.standard_normal((rows, sizes["n"])).astype(ml_dtypes.bfloat16)
            arrays[port.name] = r
            host.append(r)
    outs = []
    for port in fam.outputs:
        cols = sizes[port.dims[1]]
        dtype = np.float32 if port.type(point.as_dict()).dtype.name == "f32" else ml_dtypes.bfloat16
        out = np.full((rows, cols), np.nan, dtype)  # poison
        arrays[port.name] = out
        outs.append(out)
    run(build_dir, family, point, sizes, arrays)
    want = SEMANTICS[fam.semantics](*host, **_kwargs(family, point))
    for port, g, w in zip(fam.outputs, outs, want):
        _close(g, w, f"{point} {port.name}")


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_gemm_is_exact_where_every_sum_is(build_dir, weight):
    """Small integers in x and weights on the grid make every product and partial sum exact in
    f32: the kernel must give the reference's bytes, which pins each output to its row and
    column (a wrong fragment layout or tile index moves values)."""
    fam = P.family("linear")
    point = fam.point(**GEMM, weight=weight)
    rows, k, n = 70, 544, 136
    rng = np.random.default_rng(3)
    x = rng.integers(-3, 4, (rows, k)).astype(np.float32)
    x[x == 0] = 5  # every product counts
    w = rng.choice(np.array([-6, -4, -2, -1, 1, 1.5, 3, 6], np.float32), (n, k))
    if weight == "mxfp4":
        qt = QuantFormat.parse("mxfp4").quantize(w)
        assert np.array_equal(np.asarray(qt.dequantize(), np.float32), w)  # scale 2^0, on grid
        arrays = {"w": np.ascontiguousarray(qt.data), "w_scale": qt.scale, "w_global": None}
    else:
        arrays = {"w": w.astype(ml_dtypes.bfloat16), "w_scale": None, "w_global": None}
    xb = x.astype(ml_dtypes.bfloat16)
    y = np.full((rows, n), np.nan, ml_dtypes.bfloat16)
    run(build_dir, "linear", point, {"rows": rows, "k": k, "n": n}, {"x": xb, "y": y, **arrays})
    (ref,) = SEMANTICS["linear"](xb, w, **_kwargs("linear", point))
    assert np.abs(ref.astype(np.float32)).max() > 100  # large sums, exact in f32 (< 2^24)
    assert y.tobytes() == ref.tobytes()


def test_a_pipeline_one_wait_short_reads_poison(build_dir):
    """The emulation's cp.async copies land only at the wait that completes their group: built
    to wait for one group fewer than the kernel asks (METRALE_SIMT_WAIT_SLACK=1), the kernel
    reads tiles still in flight, which hold the poison shared memory starts with, so its
    outputs are not finite. The tests above would therefore catch a wait missing from gemm.cu."""
    fam = P.family("linear")
    point = fam.point(**GEMM, weight="bf16")
    kernel = F.realize(point)
    defines = tuple(d.removeprefix("-D") for d in kernel.defines)
    rows, k, n = 16, 544, 128
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((n, k)).astype(ml_dtypes.bfloat16)
    outputs = {}
    for slack in (0, 1):
        y = np.full((rows, n), np.nan, ml_dtypes.bfloat16)
        lib = library(build_dir, (*defines, f"METRALE_SIMT_WAIT_SLACK={slack}"))
        grid, block, shared = kernel.launch_for({"rows": rows, "k": k, "n": n})
        values = [ctypes.c_void_p(a.ctypes.data) for a in (x, w)] + [ctypes.c_void_p(None)] * 2
        values += [ctypes.c_void_p(y.ctypes.data), ctypes.c_int(rows), ctypes.c_int(k),
                   ctypes.c_int(n)]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        assert lib.simt_launch(kernel.entry.encode(), *grid, block[0], shared, argv) == 0
        outputs[slack] = y.astype(np.float32)
    assert np.isfinite(outputs[0]).all()
    assert not np.isfinite(outputs[1]).any()
