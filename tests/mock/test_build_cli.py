"""``met build`` and the build's report without a GPU compiler: ``--cache`` holds everything,
the reported time includes planning, compiles run in parallel with their own times, and the
progress bar stays off a non-terminal (issue 54 item 4, issue 48's cold start)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from metrale.cli import main
from metrale.lkb.target import KernelTarget
from metrale.lkb.vendor import Vendor
from metrale.realize.build import build
from metrale.realize.cache import BuildCache
from metrale.realize.compute import Availability, Binary
from metrale.realize.registry import Registry
from tests.mock.test_registry import points

A = KernelTarget("sm_90", "qwen3-0.6b", "bf16")


@pytest.fixture
def elsewhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every default cache and registry location pointed at one folder, so a test can see that
    nothing was written there."""
    home = tmp_path / "defaults"
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "xdg"))
    monkeypatch.setenv("METRALE_CACHE", str(home / "cache"))
    monkeypatch.setenv("METRALE_REGISTRY", str(home / "registry"))
    monkeypatch.setenv("HOME", str(home / "home"))
    return home


def test_cache_dir_holds_the_registry_too(tmp_path: Path, elsewhere: Path, capsys) -> None:
    cache = tmp_path / "my cache"
    argv = ["build", "tiny-qwen3", "--quant", "bf16", "--hardware", "host", "--cache",
            str(cache), "--format", "json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["registry"] == str(cache / "registry" / "host" / "tiny-qwen3" / "bf16")
    assert Registry(cache / "registry").summands() == (KernelTarget("host", "tiny-qwen3",
                                                                     "bf16"),)
    assert not elsewhere.exists()  # nothing under ~/.cache, $METRALE_CACHE or $METRALE_REGISTRY
    # --registry still wins over the cache's own folder
    assert main([*argv, "--registry", str(tmp_path / "reg")]) == 0
    assert json.loads(capsys.readouterr().out)["registry"].startswith(str(tmp_path / "reg"))


def test_reported_time_includes_planning(tmp_path: Path, capsys) -> None:
    t0 = time.perf_counter()
    assert main(["build", "tiny-qwen3", "--quant", "bf16", "--hardware", "host", "--cache",
                 str(tmp_path), "--format", "json"]) == 0
    took = time.perf_counter() - t0
    report = json.loads(capsys.readouterr().out)
    assert 0 < report["planning_s"] < report["seconds"] <= took
    assert report["seconds"] > 0.5 * took  # the command's time, not the compile step's alone
    assert main(["build", "tiny-qwen3", "--quant", "bf16", "--hardware", "host", "--cache",
                 str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("build host/tiny-qwen3/bf16: ") and "(planning " in out[-2]
    assert out[-1].startswith("registry summand: ")


def test_a_bad_job_count_is_refused(tmp_path: Path, capsys) -> None:
    assert main(["build", "tiny-qwen3", "--quant", "bf16", "--hardware", "host", "--cache",
                 str(tmp_path), "--jobs", "0"]) == 3
    assert capsys.readouterr().err.strip() == \
        "met: --jobs: bad job count (expected an int >= 1, found 0)"


class SlowFake:
    """A compiler that takes ``seconds`` a unit (sleeping, so parallel units overlap) and
    records how many ran at once."""

    vendor = Vendor.NVIDIA
    source_extension, output_extension, output_is_text = ".cu", ".ptx", True

    def __init__(self, seconds: float) -> None:
        import threading

        self.seconds, self.running, self.most = seconds, 0, 0
        self.lock = threading.Lock()

    def available(self) -> Availability:
        return Availability(True, "fake")

    def version(self) -> str:
        return "slow fake 1.0"

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None, headers: Mapping[str, str] | None = None) -> Binary:
        import re

        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(self.seconds)
        with self.lock:
            self.running -= 1
        entries = re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                             r'(\w+)\s*\(', source)
        return Binary("".join(f".visible .entry {e}(\n" for e in entries).encode(), arch,
                      entries, "ptx", self.version())


def test_units_compile_in_parallel_each_with_its_time(tmp_path: Path, capsys) -> None:
    fake = SlowFake(0.4)
    pts = points("rmsnorm", "add", "swiglu", "argmax", "rope", "embedding")
    report = build(pts, "sm_90", target=A, cache=BuildCache(tmp_path), progress=True,
                   compute=fake, jobs=4)
    built = [u for u in report.units if u.status == "built"]
    assert report.ok and len(built) > 4 and fake.most == 4
    assert all(0.4 <= u.seconds < 5 for u in built)
    assert report.seconds < 0.75 * report.compile_s  # overlapped, not one after another
    assert report.jobs == 4 and report.slowest(2) == tuple(
        sorted(built, key=lambda u: -u.seconds)[:2])
    assert {i.compile_s for i in report.items} <= {u.seconds for u in built}
    assert capsys.readouterr().err == ""  # progress=True, but stderr is not a terminal
    warm = build(pts, "sm_90", target=A, cache=BuildCache(tmp_path), progress=False,
                 compute=fake)
    assert all(u.status == "cached" and u.seconds == 0 for u in warm.units)
    assert warm.compile_s == 0 and "compiling" not in warm.summary()
    table = report.compile_table(2)
    assert table.row_count == 2 and "2 slowest of" in str(table.title)


def test_a_checkpoint_folder_with_a_space_in_its_name_builds(tmp_path: Path, capsys) -> None:
    """Issue 53 item 8: ``met build "my model"`` (a config.json in a folder with a space)."""
    from metrale.plan.config import ModelConfig

    folder = tmp_path / "my model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(ModelConfig.load("tiny-qwen3").to_hf_dict()))
    assert main(["build", str(folder), "--quant", "bf16", "--hardware", "host", "--cache",
                 str(tmp_path / "c"), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "host/my model/bf16" and report["counts"]["host"] > 0
    assert Registry(tmp_path / "c" / "registry").summands() == (
        KernelTarget("host", "my model", "bf16"),)
