"""Build failures are clear and contained (issue 10, cases 11, 12 and 14).

A missing compiler says which vendor, what was looked for and how to install it. A compile
error carries the kernel, the options, the log and the numbered source, the other kernels of
the build still compile, and the cache keeps nothing for the failed one. Two build processes
on one cache both succeed and leave only whole entries. (Damaged entries, case 13, are in
``tests/mock/test_cache.py``; ``met build`` itself is tested with the build.)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from metrale.lkb.errors import CompileError
from metrale.realize.cache import BuildCache, cache_key
from metrale.realize.compute import HostTarget, NvidiaTarget, target_for

ROOT = Path(__file__).resolve().parents[2]


# -- case 11: no compiler ----------------------------------------------------------------------


def test_no_nvidia_compiler_says_vendor_what_was_looked_for_and_how_to_install(monkeypatch):
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr("metrale.realize.compute.find_nvrtc", lambda: None)
    t = NvidiaTarget()
    with pytest.raises(CompileError) as e:
        t.compile("extern \"C\" __global__ void k() {}", "sm_90a", {}, name="rmsnorm",
                  entry="k")
    text = str(e.value)
    assert text.startswith("rmsnorm.cu: k: cannot compile for NVIDIA: ")
    assert "no nvcc on PATH and no NVRTC wheel" in text  # what was looked for
    assert "install the CUDA toolkit or `pip install nvidia-cuda-nvrtc-cu12`" in text
    with pytest.raises(CompileError, match="no NVIDIA compiler: no nvcc on PATH"):
        t.version()  # a build asks for the compiler identity first: the same answer
    assert e.value.exit_status == 5


@pytest.mark.parametrize("vendor,looked,install", [
    ("amd", "hipcc from ROCm", "install ROCm"),
    ("apple", "xcrun metal", "install the Xcode command line tools"),
    ("intel", "icpx from oneAPI", "install the Intel oneAPI Base Toolkit"),
])
def test_vendors_without_a_compiler_say_so_in_one_sentence(vendor, looked, install):
    t = target_for(vendor)
    with pytest.raises(CompileError) as e:
        t.compile("", "x", {}, name="rope", entry="rope")
    assert str(e.value) == (
        f"rope{t.source_extension}: rope: no compiler for vendor {vendor}: Metrale has no "
        f"{vendor} compute target (looked for {looked}); {install} and register a "
        f"ComputeTarget for {vendor}")
    assert t.available().reason in str(e.value)


# -- case 12: one kernel fails, the others build, nothing is cached for it --------------------

GOOD = 'extern "C" __global__ void {name}(float* x) {{ x[threadIdx.x] = SCALE; }}\n'
BROKEN = ('extern "C" __global__ void {name}(float* x) {{\n'
          '    x[threadIdx.x] = SCALE\n'  # missing ';'
          '}}\n')


def _build_all(cache: BuildCache, target, sources: dict[str, str], arch: str,
               defines: dict) -> tuple[dict, dict]:
    """What a build loop does: every kernel is tried; failures are collected, not fatal."""
    built, failed = {}, {}
    for name, source in sources.items():
        try:
            built[name] = cache.build(target, source, arch, defines, name, name)
        except CompileError as e:
            failed[name] = e
    return built, failed


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_a_compile_error_is_contained_and_says_everything(tmp_path):
    cache, t = BuildCache(tmp_path), NvidiaTarget("ptx", compiler="nvcc")
    names = ["rmsnorm", "rope", "swiglu"]
    sources = {n: (BROKEN if n == "rope" else GOOD).format(name=n) for n in names}
    built, failed = _build_all(cache, t, sources, "sm_90a", {"SCALE": 2})
    assert sorted(built) == ["rmsnorm", "swiglu"] and sorted(failed) == ["rope"]
    e = failed["rope"]
    assert (e.file, e.key) == ("rope.cu", "rope")  # the kernel
    assert "-arch=sm_90a" in e.command and "-DSCALE=2" in e.command  # the options
    assert "rope.cu(3): error" in e.log  # the compiler's log, positions in the kernel's name
    text = str(e)
    assert text.startswith("rope.cu: rope: nvcc failed compiling rope.cu for sm_90a")
    assert "   2 |     x[threadIdx.x] = SCALE" in text  # numbered source
    version = t.version()
    for n in names:  # the cache holds the good ones, and nothing for the failed one
        payload, meta = cache.paths(cache_key(sources[n], {"SCALE": 2}, "sm_90a", version, n))
        assert meta.is_file() == payload.is_file() == (n != "rope")
    again, _ = _build_all(BuildCache(tmp_path), t, sources, "sm_90a", {"SCALE": 2})
    assert again == built  # a rerun loads the good ones from the cache


def test_a_host_kernel_that_does_not_exist_is_contained_too(tmp_path):
    cache = BuildCache(tmp_path)
    sources = {"add": "numpy", "rmsnorm_missing": "numpy", "multiply": "numpy"}
    built, failed = _build_all(cache, HostTarget(), sources, "host", {})
    assert sorted(built) == ["add", "multiply"] and list(failed) == ["rmsnorm_missing"]
    e = failed["rmsnorm_missing"]
    assert str(e).startswith("rmsnorm_missing.py: rmsnorm_missing: host module 'numpy' has no "
                             "attribute 'rmsnorm_missing'")
    assert len(list(tmp_path.rglob("*.json"))) == 2  # two entries, none for the failure


# -- case 14: two build processes on one cache -----------------------------------------------

BUILDER = textwrap.dedent("""
    import sys
    from metrale.realize.cache import BuildCache
    from metrale.realize.compute import HostTarget
    cache = BuildCache(sys.argv[1])
    names = ["add", "subtract", "multiply", "divide", "maximum", "minimum", "exp", "log"]
    for i in range(int(sys.argv[2])):
        for name in names:  # a new key each round: both processes miss, compile and put it
            b = cache.build(HostTarget(), "numpy", "host", {"ROUND": i}, name, name)
            assert b.data == f"numpy:{name}".encode(), b
    print(cache.hits, cache.misses, cache.discarded)
""")


def test_two_build_processes_on_one_cache_both_succeed(tmp_path):
    rounds = 40
    procs = [subprocess.Popen([sys.executable, "-c", BUILDER, str(tmp_path), str(rounds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()
        hits, misses, discarded = map(int, out.split())
        assert hits + misses == rounds * 8
        assert discarded == 0  # the other's half-written entry is a miss, never damage
    assert not [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
    fresh = BuildCache(tmp_path)
    for i in range(rounds):  # every entry whole and loadable
        b = fresh.build(HostTarget(), "numpy", "host", {"ROUND": i}, "add", "add")
        assert HostTarget.load(b) is __import__("numpy").add
    assert (fresh.hits, fresh.discarded) == (rounds, 0)
