"""benchmarks/ab_gpu_step.sh: ``prepare`` writes each revision's tree beside the working tree,
and ``run`` benchmarks the trees in turn, each from its own files, with every line and result
file named by its tree.

The installs and the benchmark are replaced by a stub ``python3`` first on PATH: it records the
tree it runs in (the tree's MARK file) and writes the result file the script copies.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ab_gpu_step.sh"
BASH, GIT = shutil.which("bash"), shutil.which("git")

STUB = """#!/bin/sh
[ "$1" = "-m" ] && exit 0  # pip
echo "metrale $(cat MARK) $*"
mkdir -p benchmarks/results
echo '{"tree": "'"$(cat MARK)"'"}' > benchmarks/results/gpu_decode.json
"""


def _git(tree: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run([GIT, *args], cwd=tree, env=env, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture()
def repo(tmp_path: Path) -> tuple[Path, str]:
    """A repository whose first commit's MARK says "old" and whose working tree says "new"."""
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(SCRIPT, tmp_path / "benchmarks" / SCRIPT.name)
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 't'\n")
    (tmp_path / "MARK").write_text("old")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "old")
    (tmp_path / "MARK").write_text("new")
    (tmp_path / "stub").mkdir()
    stub = tmp_path / "stub" / "python3"
    stub.write_text(STUB)
    stub.chmod(0o755)
    return tmp_path, _git(tmp_path, "rev-parse", "--short", "HEAD")


def _script(tree: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": f"{tree / 'stub'}:{os.environ['PATH']}", **env}
    return subprocess.run([BASH, "benchmarks/ab_gpu_step.sh", *args], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(BASH is None or GIT is None, reason="bash or git is not installed")
def test_each_tree_runs_from_its_own_files_in_the_order_given(repo):
    tree, rev = repo
    prep = _script(tree, "prepare", rev)
    assert prep.returncode == 0, prep.stderr
    assert (tree / ".ab" / rev / "MARK").read_text() == "old"
    assert "/.ab/" in (tree / ".git" / "info" / "exclude").read_text().splitlines()
    out = tree / "out"
    run = _script(tree, "run", OUT=str(out), STEP_ARGS="m --batches 1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [ln.split()[:3] for ln in lines] == [
        ["work", "metrale", "new"], [rev, "metrale", "old"], ["work", "metrale", "new"]]
    assert all(ln.endswith("benchmarks/bench_gpu_decode.py m --batches 1") for ln in lines)
    got = {p.name: json.loads(p.read_text())["tree"] for p in out.glob("gpu_decode_*.json")}
    assert got == {"gpu_decode_1_work.json": "new", f"gpu_decode_2_{rev}.json": "old",
                   "gpu_decode_3_work.json": "new"}


@pytest.mark.skipif(BASH is None or GIT is None, reason="bash or git is not installed")
def test_an_unknown_revision_or_tree_is_named(repo):
    tree, _ = repo
    bad = _script(tree, "prepare", "nosuchrev")
    assert bad.returncode == 2 and "no such revision: nosuchrev" in bad.stderr
    missing = _script(tree, "run", "nosuchrev", OUT=str(tree / "out"))
    assert missing.returncode == 2 and "nosuchrev: no tree at" in missing.stderr
    assert _script(tree).returncode == 2


def _result(folder: Path, n: int, tag: str, steps: dict[tuple, tuple[float, str]]) -> None:
    rows = [{"model": m, "quant": q, "policy": "exact", "batch": b, "step_s": s,
             "logits_sha256": h} for (m, q, b), (s, h) in steps.items()]
    rows.append({"model": "m", "engine": "hf eager"})  # a peer's row: no step_s, not counted
    (folder / f"gpu_decode_{n}_{tag}.json").write_text(json.dumps({"rows": rows}))


def test_the_summary_gives_each_tree_its_medians_ratios_and_whether_logits_agree(tmp_path):
    """ab_summary.py over a call's result files: runs in call order, the median of each tree's
    runs, its ratio to the base tree's median, and a step whose logits differ between trees
    named as such (the run's table and ab_summary.json say the same)."""
    a, b = ("qwen", "bf16", 1), ("qwen", "bf16", 8)
    _result(tmp_path, 1, "work", {a: (1.0e-3, "h1"), b: (4.0e-3, "h8")})
    _result(tmp_path, 2, "abc123", {a: (0.9e-3, "h1"), b: (4.4e-3, "other")})
    _result(tmp_path, 3, "abc123", {a: (0.8e-3, "h1"), b: (4.2e-3, "other")})
    _result(tmp_path, 4, "work", {a: (1.2e-3, "h1"), b: (4.0e-3, "h8")})
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ab_summary.py"),
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    got = json.loads((tmp_path / "ab_summary.json").read_text())
    first, second = got["steps"]
    assert (first["batch"], second["batch"]) == (1, 8)
    assert first["trees"]["work"] == {"runs_ms": [1.0, 1.2], "median_ms": 1.1, "ratio": 1.0}
    assert first["trees"]["abc123"] == {"runs_ms": [0.9, 0.8], "median_ms": 0.85,
                                        "ratio": round(0.85 / 1.1, 4)}
    assert first["same_logits"] and not second["same_logits"]
    lines = run.stdout.splitlines()
    assert lines[1].split()[-1] == "same" and lines[2].split()[-1] == "DIFFER"
    assert "0.850 (0.773)" in lines[1]


def test_the_summary_names_a_missing_base_or_an_empty_folder(tmp_path):
    script = str(ROOT / "benchmarks" / "ab_summary.py")
    empty = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                           text=True, timeout=60)
    assert empty.returncode != 0 and "no gpu_decode_N_TAG.json files" in empty.stderr
    _result(tmp_path, 1, "abc123", {("m", "bf16", 1): (1e-3, "h")})
    nobase = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True,
                            text=True, timeout=60)
    assert nobase.returncode != 0 and "no runs of the baseline tree 'work'" in nobase.stderr


def test_the_summary_module_example_holds():
    run = subprocess.run([sys.executable, "-m", "doctest", "benchmarks/ab_summary.py"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
