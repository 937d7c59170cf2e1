"""A non-editable install (``pip install .`` into a fresh virtual environment) records evidence
into the store in the cache directory and leaves its site-packages as installed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.mark.slow
def test_an_installed_package_records_evidence_without_touching_site_packages(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "tests", "benchmarks",
        "notebooks", "docs", ".hypothesis", ".ruff_cache"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip",
                    str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    str(src)], check=True, cwd=tmp_path)
    where = subprocess.run([str(py), "-c", "import metrale, pathlib; "
                            "print(pathlib.Path(metrale.__file__).parent)"],
                           check=True, capture_output=True, text=True, cwd=tmp_path)
    package = Path(where.stdout.strip())
    assert venv in package.parents, package  # the installed copy, not a checkout
    before = _tree(package)
    assert "kernels/sm_90/EVIDENCE.toml" in before

    from metrale.realize.evidence import EvidenceRecord, append_records
    from metrale.realize.functor import realization

    k = next(k for k in realization("sm_90").kernels() if k.point.family == "rmsnorm")
    made = EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", str(k.point), "bandwidth", 1234.5,
                          4300.0, "GB/s", "2027-01-01", "nvcc test", k.source_hash)
    records = tmp_path / "records.toml"
    append_records(records, [made])
    env = {k: v for k, v in os.environ.items() if k != "METRALE_EVIDENCE"}
    env["METRALE_CACHE"] = str(tmp_path / "cache")
    met = [str(venv / "bin" / "met")]
    subprocess.run(met + ["evidence", "import", str(records)], check=True, env=env,
                   cwd=tmp_path, capture_output=True)
    store = tmp_path / "cache" / "evidence.sqlite"
    assert store.is_file()
    listed = subprocess.run(met + ["evidence", "list", "--hardware", "sm_90", "--format",
                                   "json"], check=True, env=env, cwd=tmp_path,
                            capture_output=True, text=True)
    mine = [r for r in json.loads(listed.stdout) if r["value"] == 1234.5]
    assert [(r["from"], r["status"]) for r in mine] == [("store", "counts")]
    export = subprocess.run(met + ["evidence", "export", "--hardware", "sm_90"], check=True,
                            env=env, cwd=tmp_path, capture_output=True, text=True)
    assert "value = 1234.5" in export.stdout
    assert _tree(package) == before  # nothing written into the installed package
