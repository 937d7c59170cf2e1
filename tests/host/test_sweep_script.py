"""benchmarks/sweep_gpu_step.sh: each variant's defines reach the source the step benchmark
builds, the source comes back unchanged, and a define the source lacks stops the sweep before
any benchmark runs.

The benchmark is replaced by a stub ``python3`` first on PATH, which records the source's
``#define`` lines it would have compiled and writes the result file the script copies.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sweep_gpu_step.sh"
BASH = shutil.which("bash")

SOURCE = """// a kernel source with tuning defines, one of them in branches
#if defined(WIDE)
#define AHEAD 8
#else
#define AHEAD 4
#endif
#define BLOCKS 2
"""

STUB = """#!/bin/sh
src=kernels/cuda/common/k.cu
line="metrale $(grep '^#define' $src | tr '\\n' ';')"
echo "$line" >> "$SWEEP_LOG"
echo "$line"
mkdir -p benchmarks/results
echo '{"variant": "'"$(grep -c '^#define' $src)"'"}' > benchmarks/results/gpu_decode.json
"""


@pytest.fixture()
def tree(tmp_path: Path) -> Path:
    """A repository root with the script, one kernel source, and the stub benchmark."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / SCRIPT.name)
    (tmp_path / "kernels" / "cuda" / "common").mkdir(parents=True)
    (tmp_path / "kernels" / "cuda" / "common" / "k.cu").write_text(SOURCE)
    (tmp_path / "stub").mkdir()
    stub = tmp_path / "stub" / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return tmp_path


def _sweep(tree: Path, *variants: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tree / "sweep.log"
    env = {**os.environ, "PATH": f"{tree / 'stub'}:{os.environ['PATH']}",
           "OUT": str(tree / "out"), "SWEEP_LOG": str(log)}
    proc = subprocess.run([BASH, "benchmarks/sweep_gpu_step.sh", "k.cu", *variants], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_each_variant_builds_its_defines_and_the_source_comes_back(tree):
    proc, runs = _sweep(tree, "base", "deep:AHEAD=16", "both:AHEAD=6,BLOCKS=3")
    assert proc.returncode == 0, proc.stderr
    assert runs == [
        "metrale #define AHEAD 8;#define AHEAD 4;#define BLOCKS 2;",
        "metrale #define AHEAD 16;#define AHEAD 16;#define BLOCKS 2;",  # every branch's line
        "metrale #define AHEAD 6;#define AHEAD 6;#define BLOCKS 3;",
    ]
    assert proc.stdout.splitlines()[0].startswith("base metrale")  # lines carry their tag
    assert (tree / "kernels" / "cuda" / "common" / "k.cu").read_text() == SOURCE
    assert sorted(p.name for p in (tree / "out").iterdir()) == [
        "gpu_decode_base.json", "gpu_decode_both.json", "gpu_decode_deep.json"]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_a_define_the_source_lacks_stops_the_sweep_before_it_runs(tree):
    proc, runs = _sweep(tree, "base", "typo:AHAED=16")
    assert proc.returncode == 2
    assert "typo: no #define AHAED in kernels/cuda/common/k.cu" in proc.stderr
    assert runs == []  # not even the valid variant ran
    assert (tree / "kernels" / "cuda" / "common" / "k.cu").read_text() == SOURCE


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_a_missing_source_is_named(tree):
    proc, _ = _sweep(tree, "base")
    assert proc.returncode == 0
    env = {**os.environ, "OUT": str(tree / "out")}
    missing = subprocess.run([BASH, "benchmarks/sweep_gpu_step.sh", "nope.cu", "base"], cwd=tree,
                             env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2
    assert "no such source: kernels/cuda/common/nope.cu" in missing.stderr
