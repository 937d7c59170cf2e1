"""The NVIDIA compute target with the local nvcc (and NVRTC when a wheel is installed)."""

import re
import shutil
from pathlib import Path

import pytest

from metrale.lkb.errors import CompileError
from metrale.realize.cache import BuildCache
from metrale.realize.compute import NvidiaTarget, cubin_entries, find_nvrtc, target_for
from metrale.realize.hardware import load_hardware

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
needs_nvrtc = pytest.mark.skipif(find_nvrtc() is None, reason="no NVRTC library found")

SOURCE = """\
#include "scale.cuh"
extern "C" __global__ void scale_rows(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= SCALE * FACTOR;
}
extern "C" __global__ void fill(float* x) { x[threadIdx.x] = FACTOR; }
__device__ float not_an_entry(float a) { return a; }
"""
HEADERS = {"scale.cuh": "#pragma once\n#define FACTOR 3.0f\n"}


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_ptx_exports_the_entries(arch: str) -> None:
    t = NvidiaTarget("ptx", compiler="nvcc")
    assert t.available().ok and "nvcc" in t.available().reason
    b = t.compile(SOURCE, arch, {"SCALE": "2.0f"}, name="scale", entry="scale_rows",
                  headers=HEADERS)
    assert b.format == "ptx" and b.arch == arch
    assert b.entries == ("scale_rows", "fill")
    text = b.data.decode()
    assert re.search(rf"^\.target {arch}\b", text, flags=re.M)
    assert b.compiler == t.version() and t.version().startswith("nvcc ")


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_80", "sm_90a"])
def test_cubin_exports_the_entries(arch: str) -> None:
    b = NvidiaTarget("cubin", compiler="nvcc").compile(
        SOURCE, arch, {"SCALE": 2}, name="scale", entry="fill", headers=HEADERS)
    assert b.format == "cubin" and b.data[:4] == b"\x7fELF"
    assert set(b.entries) == {"scale_rows", "fill"}
    assert cubin_entries(b.data) == b.entries


@needs_nvcc
def test_defines_reach_the_compiler() -> None:
    t = NvidiaTarget("ptx", compiler="nvcc")
    a = t.compile(SOURCE, "sm_80", {"SCALE": "2.0f"}, name="s", headers=HEADERS)
    b = t.compile(SOURCE, "sm_80", {"SCALE": "5.0f"}, name="s", headers=HEADERS)
    assert a.data != b.data
    # 2 * 3 = 6.0f and 5 * 3 = 15.0f folded into the PTX as hex float immediates
    assert "0f40C00000" in a.data.decode() and "0f41700000" in b.data.decode()
    with pytest.raises(CompileError, match="SCALE"):
        t.compile(SOURCE, "sm_80", {}, name="s", headers=HEADERS)


@needs_nvcc
def test_syntax_error_gives_log_command_and_numbered_source() -> None:
    broken = SOURCE.replace("x[i] *= SCALE", "x[i] *= = SCALE")
    with pytest.raises(CompileError) as info:
        NvidiaTarget("ptx", compiler="nvcc").compile(broken, "sm_90a", {"SCALE": 1},
                                                    name="scale", entry="scale_rows",
                                                    headers=HEADERS)
    e = info.value
    msg = str(e)
    assert msg.startswith("scale.cu: scale_rows: nvcc failed compiling scale.cu for sm_90a")
    assert "-arch=sm_90a" in e.command and "-DSCALE=1" in e.command
    assert "scale.cu(4): error" in e.log
    assert "   4 |     if (i < n) x[i] *= = SCALE * FACTOR;" in msg
    assert "   1 | #include \"scale.cuh\"" in msg
    assert "/tmp/" not in e.command  # the temp folder is not part of the message


@needs_nvcc
def test_missing_entry_is_named_with_suggestion() -> None:
    with pytest.raises(CompileError) as info:
        NvidiaTarget().compile(SOURCE, "sm_80", {"SCALE": 1}, name="s", entry="scale_row",
                               headers=HEADERS)
    assert info.value.suggestion == "scale_rows"
    assert "extern \"C\"" in str(info.value)


@needs_nvcc
def test_every_shipped_nvidia_class_arch_compiles() -> None:
    t = NvidiaTarget("cubin", compiler="nvcc")
    archs = {c.arch for c in load_hardware() if c.arch is not None}
    assert archs == {"sm_80", "sm_89", "sm_90a", "sm_100a", "sm_120a", "sm_121a"}
    for arch in sorted(archs):
        b = t.compile(SOURCE, arch, {"SCALE": 1}, name="s", entry="fill", headers=HEADERS)
        assert set(b.entries) == {"scale_rows", "fill"}, arch


@needs_nvcc
def test_cache_hits_skip_the_compiler(tmp_path: Path) -> None:
    cache, t = BuildCache(tmp_path), NvidiaTarget("ptx", compiler="nvcc")
    first = cache.build(t, SOURCE, "sm_80", {"SCALE": 1}, "s", "fill", HEADERS)
    second = cache.build(t, SOURCE, "sm_80", {"SCALE": 1}, "s", "fill", HEADERS)
    assert first == second and (cache.hits, cache.misses) == (1, 1)
    changed = cache.build(t, SOURCE, "sm_80", {"SCALE": 1}, "s", "fill",
                          {"scale.cuh": "#define FACTOR 4.0f\n"})
    assert changed.data != first.data and cache.misses == 2


def test_bad_inputs_refused_before_compiling() -> None:
    t = NvidiaTarget()
    with pytest.raises(CompileError, match="not an identifier"):
        t.compile(SOURCE, "sm_80", {"2X": 1}, name="s")
    with pytest.raises(CompileError, match="string or an integer"):
        t.compile(SOURCE, "sm_80", {"X": True}, name="s")
    with pytest.raises(CompileError, match="relative path"):
        t.compile(SOURCE, "sm_80", {}, name="s", headers={"../x.cuh": ""})
    with pytest.raises(CompileError, match="ptx or cubin"):
        NvidiaTarget("sass")


def test_unavailable_reason_without_any_compiler(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("metrale.realize.compute.find_nvrtc", lambda: None)
    t = NvidiaTarget()
    a = t.available()
    assert not a.ok
    assert a.reason == ("no nvcc on PATH and no NVRTC wheel; install the CUDA toolkit or "
                        "`pip install nvidia-cuda-nvrtc-cu12`")
    with pytest.raises(CompileError, match="no nvcc on PATH"):
        t.compile(SOURCE, "sm_80", {}, name="s")


def test_other_vendors_say_what_is_missing() -> None:
    for vendor, looked in [("amd", "hipcc"), ("apple", "xcrun metal"), ("intel", "icpx")]:
        t = target_for(vendor)
        assert not t.available().ok
        assert f"no compiler for vendor {vendor}" in t.available().reason
        with pytest.raises(CompileError) as info:
            t.compile("", "x", {}, name="k", entry="k")
        assert looked in str(info.value) and "install" in str(info.value)


@needs_nvrtc
@pytest.mark.parametrize("output", ["ptx", "cubin"])
def test_nvrtc(output: str) -> None:
    t = NvidiaTarget(output, compiler="nvrtc")
    assert "NVRTC" in t.available().reason
    b = t.compile(SOURCE, "sm_90a", {"SCALE": 2}, name="s", entry="fill", headers=HEADERS)
    assert set(b.entries) >= {"fill", "scale_rows"} and b.format == output
    with pytest.raises(CompileError) as info:
        t.compile(SOURCE.replace("*=", "*= ="), "sm_90a", {"SCALE": 2}, name="s",
                  headers=HEADERS)
    assert "s.cu(4): error" in info.value.log and "   4 | " in str(info.value)


HOST_SOURCE = """\
#include <stdint.h>
template <int R>
__device__ int shift() { constexpr int s = __builtin_ctz(R); return s; }
extern "C" __global__ void host_bits(float* x, uint64_t* n) {
    x[0] = INFINITY;
    n[0] = (uint64_t)shift<8>() + (5 - __builtin_ctz(4u));
}
"""


@pytest.mark.parametrize("compiler", [
    pytest.param("nvcc", marks=needs_nvcc), pytest.param("nvrtc", marks=needs_nvrtc)])
def test_what_the_kernels_take_from_the_host_side_compiles_with_either_compiler(compiler):
    """The kernels include <stdint.h> and use math.h's INFINITY and GCC's __builtin_ctz (in
    constant expressions, where nvcc folds it), which nvcc's host side gives them: NVRTC, which reads no system
    header, is given them in memory (compute.NVRTC_SYSTEM_HEADERS)."""
    b = NvidiaTarget("ptx", compiler=compiler).compile(HOST_SOURCE, "sm_90a", {}, name="host",
                                                       entry="host_bits")
    assert b.entries == ("host_bits",)
