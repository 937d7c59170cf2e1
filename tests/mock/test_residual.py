"""Residual(H) on a temporary kernels tree: shadows, class-only sources and per-point copies,
each counted with its reason and evidence; ``met residual`` as a table and as JSON."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from metrale.cli import main
from metrale.lkb.presentation import Presentation
from metrale.realize.evidence import EVIDENCE_FILE, EvidenceRecord, append_records
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir
from metrale.realize.residual import (
    CLASS_ONLY,
    NO_POINT,
    PER_POINT_COPY,
    SHADOW,
    leaf_targets,
    residual,
)

SHIPPED = default_kernels_dir()
COMMON = SHIPPED / "cuda" / "common"
COMMON_TOML = (COMMON / "KERNELS.toml").read_text()
P = Presentation.load()


def table_text(name: str, **extra: str) -> str:
    m = re.search(rf"^\[kernel\.{name}\]\n(.*?)(?=^\[kernel\.|\Z)", COMMON_TOML, re.S | re.M)
    assert m, name
    return f"[kernel.{name}]\n{m.group(1).rstrip()}\n" + "".join(
        f"{k} = {v}\n" for k, v in extra.items())


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """The shipped tree plus: a shadow of rmsnorm in sm_90/common (with its reason), a shadow of
    add without one, a class-only source, an orphan table, and a per-point copy in a leaf; no
    measured evidence (the statuses below are those of unmeasured kernels)."""
    root = tmp_path / "kernels"
    shutil.copytree(SHIPPED, root, ignore=shutil.ignore_patterns("__pycache__", "*.py",
                                                                 "EVIDENCE.toml"))
    own = root / "sm_90" / "common"
    shutil.rmtree(own, ignore_errors=True)  # the shipped residual: this tree has its own
    own.mkdir(parents=True)
    shutil.copy(COMMON / "norm.cu", own / "norm.cu")
    shutil.copy(COMMON / "misc.cu", own / "misc.cu")
    (own / "wgmma_probe.cu").write_text('extern "C" __global__ void probe() {}\n')
    (own / "old_attention.cu").write_text('extern "C" __global__ void old() {}\n')
    orphan = table_text("argmax").replace("[kernel.argmax]",
                                          '[kernel.argmax2]\nfamily = "argmaks"').replace(
        '"misc.cu"', '"old_attention.cu"')
    (own / "KERNELS.toml").write_text(
        table_text("rmsnorm", reason='"one warp per row is faster on Hopper"')
        + table_text("add", when='{ act = ["bf16"] }') + orphan)
    leaf = root / "sm_90" / "qwen3-0.6b" / "bf16"
    leaf.mkdir(parents=True)
    shutil.copy(COMMON / "misc.cu", leaf / "argmax.cu")
    (leaf / "scratch.cu").write_text("// an experiment\n")
    (leaf / "KERNELS.toml").write_text(
        table_text("argmax", reason='"vocab 151936 fits one block"').replace('"misc.cu"',
                                                                            '"argmax.cu"'))
    return root


def test_shipped_residual_runs_and_counts() -> None:
    r = residual("sm_90")
    assert r.count == len(r.entries) == sum(r.by_kind().values())
    assert all(e.reason for e in r.entries)


def test_each_kind_is_counted_with_its_reason(tree: Path) -> None:
    r = residual("sm_90", tree)
    by = {(e.kind, e.name): e for e in r.entries}
    rms = by[(SHADOW, "rmsnorm[act=bf16,h_block=256]")]
    assert rms.file == "sm_90/common/norm.cu"
    assert rms.reason == "one warp per row is faster on Hopper"
    assert rms.evidence == "shared, unmeasured"
    assert (SHADOW, "rmsnorm[act=f32,h_block=256]") in by
    assert by[(SHADOW, "add[act=bf16]")].reason == "no reason given"
    assert (SHADOW, "add[act=f32]") not in by  # the table claims bf16 only
    probe = by[(CLASS_ONLY, "wgmma_probe.cu")]
    assert probe.reason == "claimed by no KERNELS.toml table" and probe.evidence == NO_POINT
    old = by[(CLASS_ONLY, "old_attention.cu")]
    assert "names family 'argmaks', which is not in the presentation" in old.reason
    assert "did you mean 'argmax'?" in old.reason
    copy = by[(PER_POINT_COPY, "qwen3-0.6b/bf16: argmax[]")]
    assert copy.file == "sm_90/qwen3-0.6b/bf16/argmax.cu"
    assert copy.reason == "vocab 151936 fits one block"
    scratch = by[(PER_POINT_COPY, "scratch.cu")]
    assert "claimed by no table" in scratch.reason
    assert r.by_kind() == {SHADOW: 3, CLASS_ONLY: 2, PER_POINT_COPY: 2}
    assert r.count == 7
    # misc.cu in sm_90/common is claimed (by the add shadow), so it is not class-only
    assert (CLASS_ONLY, "misc.cu") not in by


def test_residual_is_per_class(tree: Path) -> None:
    """sm_90's shadows are sm_90's residual; sm_80 and sm_100 do not inherit them."""
    assert residual("sm_80", tree).count == 0
    assert residual("sm_100", tree).count == 0
    assert leaf_targets("sm_90", tree)[0].path == "sm_90/qwen3-0.6b/bf16"


def test_evidence_counts_only_while_the_hash_matches(tree: Path) -> None:
    F = realization("sm_90", kernels_dir=tree)
    point = P.family("rmsnorm").point(act="bf16", h_block=256)
    k = F.realize(point)

    def record(source_hash: str) -> EvidenceRecord:
        return EvidenceRecord("sm_90", "NVIDIA H200", "rmsnorm", str(point), "time", 3.0, 2.5,
                              "us", "2026-11-01", "nvcc 13.0.88", source_hash)

    append_records(tree / "sm_90" / EVIDENCE_FILE, [record(k.source_hash)])
    entry = next(e for e in residual("sm_90", tree).entries if e.name == str(point))
    assert entry.evidence == "measured on sm_90"
    # editing the shadow's source makes the record stale
    with open(tree / "sm_90" / "common" / "norm.cu", "a") as f:
        f.write("// tuned\n")
    entry = next(e for e in residual("sm_90", tree).entries if e.name == str(point))
    assert entry.evidence == "stale"


def test_met_residual_table_and_json(tree: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["residual", "--hardware", "sm_90", "--kernels", str(tree)]) == 0
    out = capsys.readouterr().out
    assert "residual(sm_90): 7" in out
    assert main(["residual", "--hardware", "sm_90", "--kernels", str(tree), "--format",
                 "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["count"] == 7 and data["hardware"] == "sm_90"
    assert {e["kind"] for e in data["entries"]} == {SHADOW, CLASS_ONLY, PER_POINT_COPY}
    assert all(set(e) == {"kind", "name", "file", "reason", "evidence"}
               for e in data["entries"])


def test_met_residual_on_the_shipped_tree(capsys: pytest.CaptureFixture) -> None:
    assert main(["residual", "--hardware", "sm_90"]) == 0
    assert re.search(r"residual\(sm_90\): \d+", capsys.readouterr().out)
    assert main(["residual", "--hardware", "sm90"]) == 3  # ConfigError, with the nearest
    assert "did you mean 'sm_90'?" in capsys.readouterr().err
