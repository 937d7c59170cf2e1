"""The build with the machine's nvcc: cold then warm through the cache, a broken source recorded
while the others build, and every binary exporting its entry (skipped without nvcc)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from metrale.lkb.errors import CompileError
from metrale.lkb.presentation import Presentation
from metrale.lkb.target import KernelTarget
from metrale.realize.build import build, unit_source
from metrale.realize.cache import BuildCache, cache_key
from metrale.realize.compute import cubin_code_bytes, cubin_entries, ptx_entries
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir, load_hardware
from metrale.realize.registry import Registry
from tests.host.conftest import MEASURED_CLASS, nvidia_group

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")

P = Presentation.load()
TARGET = KernelTarget("sm_90", "qwen3-0.6b", "bf16")


def small_points() -> list:
    """The bf16 decode points of one layer: norm, linear, attention (a few distinct binaries)."""
    want = {"rmsnorm": {}, "add_rmsnorm": {}, "rope": {"style": "neox"},
            "linear": {"weight": "bf16", "shape": "gemv", "across": "sequential"},
            "attention": {"mode": "decode"}}
    out = []
    for name, extra in want.items():
        for p in P.family(name).points:
            params = dict(p.params)
            if params.get("act") == "bf16" and all(params.get(k) == v for k, v in extra.items()):
                out.append(p)
    return out


def test_cold_then_warm(tmp_path: Path) -> None:
    pts = small_points()
    reg = Registry(tmp_path / "reg")
    cold = build(pts, "sm_90", target=TARGET, cache=BuildCache(tmp_path / "cache"),
                 registry=reg, progress=False)
    assert cold.ok, cold.summary()
    assert cold.count("built") >= 3 and cold.count("cached") == 0
    assert cold.compiler.startswith("nvcc ") and cold.arch == "sm_90a"
    warm = build(pts, "sm_90", target=TARGET, cache=BuildCache(tmp_path / "cache"),
                 registry=reg, progress=False)
    assert warm.ok and warm.count("built") == 0 and warm.count("cached") == cold.count("built")
    assert warm.seconds < 1.0, warm.summary()
    assert {str(i.point): i.sha256 for i in warm.items} == \
        {str(i.point): i.sha256 for i in cold.items}
    # every binary in the registry is a cubin for sm_90a exporting its entry, and the report
    # carries that entry's machine-code bytes, cold or warm
    summand = reg.inject(TARGET)
    for i in cold.items:
        b = summand.load(str(i.point))
        assert b.format == "cubin" and b.arch == "sm_90a"
        assert i.kernel.entry in cubin_entries(b.data)
        assert i.code_bytes == cubin_code_bytes(b.data)[i.kernel.entry] > 0
    assert [i.code_bytes for i in warm.items] == [i.code_bytes for i in cold.items]
    assert cold.to_json()["items"][0]["code_bytes"] == cold.items[0].code_bytes


def test_a_broken_source_is_recorded_and_the_others_build(tmp_path: Path) -> None:
    tree = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), tree,
                    ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    rope = tree / "cuda" / "common" / "rope.cu"
    rope.write_text(rope.read_text() + "\nthis is not C++;\n")
    cache = BuildCache(tmp_path / "cache")
    report = build(small_points(), "sm_90", target=TARGET, kernels_dir=tree, cache=cache,
                   registry=Registry(tmp_path / "reg"), progress=False, output="ptx")
    failed = [i for i in report.items if i.status == "failed"]
    assert {i.point.family for i in failed} == {"rope"}
    assert report.count("built") >= 3 and not report.ok and report.registry is None
    (err,) = report.errors
    assert isinstance(err, CompileError) and "nvcc failed compiling rope.cu" in str(err)
    assert "this is not C++;" in str(err)  # the numbered source is in the message
    for i in report.items:
        if i.status == "built":
            b = cache.get(cache_key(*_unit_key(tree, i.kernel, report.compiler)))
            assert b is not None and i.kernel.entry in ptx_entries(b.data.decode())
    # no cache entry for the broken unit
    assert cache.get(cache_key(*_unit_key(tree, failed[0].kernel, report.compiler))) is None


def _unit_key(tree: Path, kernel, compiler: str) -> tuple:
    text, headers = unit_source(tree, kernel)  # the source cut to the kernel's entries
    return text, kernel.define_map(), "sm_90a", compiler, None, headers


@pytest.mark.parametrize("name", [  # the run's one build of each class (conftest.nvidia_builds)
    pytest.param(c.name, marks=nvidia_group(c.name)) for c in load_hardware()
    if c.vendor.value == "nvidia" and c.arch is not None])
def test_every_source_of_every_nvidia_class_compiles_and_exports_its_entries(
        name: str, nvidia_builds) -> None:
    """Every NVIDIA class with an arch builds for that arch, and each binary exports the entry
    of every point it serves (the run's one build of the class, each source at a define set cut
    to the entries the class's points launch from it there, which tests/host/test_cuda_sources.py
    reads too): every realized point of sm_90, and of every class in the full tier; in the
    default tier, every source of each other class (conftest.NvidiaBuilds)."""
    F = realization(name)
    report = nvidia_builds.report(name)
    assert report.ok, "".join(f"\n{e}" for e in report.errors)
    assert report.arch == F.hw.arch
    kernels = nvidia_builds.kernels(name)
    assert {k.source for k in kernels} == {k.source for k in F.kernels()}
    if nvidia_builds.full or name == MEASURED_CLASS:
        kernels = list(F.kernels())
    # every binary compiled now, or served by the cache from an earlier compile of exactly
    # these inputs (source, headers, defines, arch, compiler and flags): conftest.run_build_cache
    built = {nvidia_builds.key(k.source, k.defines) for k in kernels}
    assert report.count("built") + report.count("cached") == len(built) == len(report.results)
    ptx = nvidia_builds.ptx(name)
    for k in F.kernels():  # every point served by a unit built
        key = nvidia_builds.key(k.source, k.defines)
        if key not in built:
            continue
        exported = ptx_entries(ptx[key])
        assert set(k.entries) <= set(exported), (k.point, k.entries)
        assert set(exported) == set(report.units[key].entries), key  # no entry unlaunched


class _Recorder:
    """A backend that only records the modules it is given (the loader's side of binding)."""

    def __init__(self) -> None:
        self.modules: list[tuple[str, bytes]] = []

    def module(self, data: bytes, label: str) -> int:
        self.modules.append((label, bytes(data)))
        return len(self.modules) - 1

    def kernel(self, module: int, entry: str, arity: int | None = None) -> tuple[int, str]:
        assert arity is not None, entry  # machine code does not declare it: the loader must
        return module, entry


def test_met_build_compiles_cold_then_warm_the_units_the_engine_compiles_up_front(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """Issue 48's cold start, from one cold compile of tiny-qwen3's sm_90 units (qwen3-0.6b's
    are the same sources and defines): `met build` compiles them to machine code, into the cache
    and the registry, and finds them all when run again. An Engine on a GPU compiles the kernels
    it launches before its first step (``CudaPlanLoader.prepare``, the build's parallel compile,
    to the format the loader loads, so the driver compiles nothing as the first steps load their
    modules): they are the very units `met build` compiles (one cache key), so a build warms
    `met run`; one missing, prepare compiles it, once, and binding every launch after that only
    reads the cache."""
    from metrale.cli import main
    from metrale.plan.plan import plan_for
    from metrale.plan.points import prepared_steps
    from metrale.realize.build import unit_key
    from metrale.runtime.cuda_loader import CudaPlanLoader

    root, reg = tmp_path / "cache", tmp_path / "reg"
    argv = ["build", "tiny-qwen3", "--quant", "bf16", "--hardware", "sm_90", "--cache",
            str(root), "--registry", str(reg), "--format", "json"]
    assert main(argv) == 0
    cold = json.loads(capsys.readouterr().out)
    assert cold["counts"]["built"] > 3 and cold["counts"]["cached"] == 0
    assert cold["counts"]["failed"] == 0
    assert cold["registry"] == str(reg / "sm_90" / "tiny-qwen3" / "bf16")
    assert main(argv) == 0
    warm = json.loads(capsys.readouterr().out)
    assert warm["counts"]["built"] == 0 and warm["counts"]["cached"] == cold["counts"]["built"]
    assert Registry(reg).summands() == (KernelTarget("sm_90", "tiny-qwen3", "bf16"),)
    assert {i["point"] for i in warm["items"]} == {i["point"] for i in cold["items"]}

    plans = [plan_for("tiny-qwen3", "bf16", "sm_90", mode=mode, rows=rows, logits=logits,
                      sample=sample) for mode, rows, logits, sample in prepared_steps(1, 1024)]
    units = {unit_key(k.kernel) for p in plans for k in p.launches}
    assert [p.mode for p in plans][:2] == ["prefill", "prefill"]  # the first token's first
    # the build's units are the engine's and what only the full-logits prefill launches (here
    # nothing), so that every cache entry is a unit of the engine's
    full = plan_for("tiny-qwen3", "bf16", "sm_90", mode="prefill", rows=64, logits="all")
    assert not {unit_key(k.kernel) for k in full.launches} - units
    assert cold["counts"]["built"] == len(units)
    part = tmp_path / "part"  # the build's cache less one entry (its smallest binary)
    shutil.copytree(root, part)
    BuildCache(part).discard(min(part.rglob("*.bin"), key=lambda f: f.stat().st_size).stem)
    cache = BuildCache(part)
    loader = CudaPlanLoader("sm_90a", cache=cache)
    loader.prepare(plans, progress=False)
    assert cache.misses == 1 and cache.hits == len(units) - 1  # the missing unit compiled once
    backend = _Recorder()
    for p in plans:
        for k in p.launches:
            handle, _ = loader.bind(backend, k, (1, 1, 1), (1, 1, 1), 0)
            assert handle[1] == k.kernel.entry
    assert cache.misses == 1  # binding compiled nothing
    assert len(backend.modules) == len(units)  # one module per unit, loaded once
    assert all(data[:4] == b"\x7fELF" for _, data in backend.modules)  # machine code (cubin)
