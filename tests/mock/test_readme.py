"""The README for users: its test command is what CI runs, it stays short, and the tree stays the
product (lab logs and measurement history live in git history, not in the tree)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_the_readme_test_command_is_what_ci_runs():
    """The second quick-start command, environment variables included, is .ci/run's command."""
    install_and_run, tests = _quick_start()
    assert install_and_run == "pip install . && met run"
    lines = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()
             if ln.strip() and not ln.lstrip().startswith("#")]
    commands = [ln for ln in lines if not ln.startswith(("set ", "cd "))]
    assert commands == [tests]
    assert "CI=true HYPOTHESIS_PROFILE=ci python -m pytest" in tests
    assert not any(ln.startswith("export ") for ln in lines)  # nothing the README does not set


def test_the_user_docs_stay_short():
    assert len(README.splitlines()) <= 250
    assert len((ROOT / "docs" / "performance.md").read_text().splitlines()) <= 300


PRODUCT = re.compile(r"^(metrale|lkb|realize|plan|runtime|tests|notebooks)/"
                     r"|^benchmarks/[^/]+\.(py|sh)$"
                     r"|^kernels/.*(\.(cu|cuh|h|py)|/(KERNELS|HARDWARE)\.toml"
                     r"|/(KERNEL_FAMILIES|FUSIONS)\.toml)$"
                     r"|^(README\.md|docs/[^/]+\.md)$")


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(),
                    reason="not a git checkout")
def test_lines_outside_the_product_are_at_most_15_percent_of_the_tree():
    """Product code, tests, kernels, notebooks, benchmark scripts and user docs are the tree;
    measurement results, shipped evidence, images and configuration at most 15 % of its lines."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    total = other = 0
    outside = {}
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file():
            continue
        n = path.read_bytes().count(b"\n")
        total += n
        if not PRODUCT.search(name):
            other += n
            outside[name] = n
    assert other <= 0.15 * total, sorted(outside.items(), key=lambda kv: -kv[1])[:10]
