"""``plan_points(..., memo=DIR)``: a model's plan points kept under the digest of what chooses
them, so a warm ``met build`` plans nothing, and anything that could choose other points (a
kernel file, the evidence store, the model) asks for a new plan."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from metrale.plan import points as points_mod
from metrale.plan.points import plan_points, points_digest
from metrale.realize.hardware import default_kernels_dir


def _no_planning(*args, **kwargs):
    raise AssertionError("planned though the points were kept")


def test_the_second_ask_plans_nothing_and_gives_the_same_points(tmp_path, monkeypatch):
    memo = tmp_path / "points"
    first = plan_points("tiny-qwen3", "bf16", "sm_90", memo=memo)
    assert first == plan_points("tiny-qwen3", "bf16", "sm_90")  # the memo changes nothing
    (kept,) = memo.glob("points-*.json")
    monkeypatch.setattr(points_mod, "plan_for", _no_planning)
    assert plan_points("tiny-qwen3", "bf16", "sm_90", memo=memo) == first
    assert {p.family for p in first} >= {"qkv", "sample", "last_row"}  # the prepared steps'


def test_a_damaged_memo_is_planned_again_and_rewritten(tmp_path):
    memo = tmp_path / "points"
    first = plan_points("tiny-qwen3", "bf16", "sm_90", memo=memo)
    (kept,) = memo.glob("points-*.json")
    for damage in ("", "{", '{"points": [["linear", [["act"]]]]}', '{"points": 3}'):
        kept.write_text(damage)
        assert plan_points("tiny-qwen3", "bf16", "sm_90", memo=memo) == first
        assert kept.read_text() not in ("", damage)


def test_what_chooses_the_points_changes_the_digest(tmp_path, monkeypatch):
    base = points_digest("tiny-qwen3", "bf16", "sm_90")
    assert base == points_digest("tiny-qwen3", "bf16", "sm_90")
    for other in (points_digest("tiny-llama", "bf16", "sm_90"),
                  points_digest("tiny-qwen3", "fp8", "sm_90"),
                  points_digest("tiny-qwen3", "bf16", "sm_80"),
                  points_digest("tiny-qwen3", "bf16", "sm_90", act="f32")):
        assert other != base
    tree = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), tree, ignore=shutil.ignore_patterns("__pycache__"))
    copied = points_digest("tiny-qwen3", "bf16", "sm_90", tree)
    assert copied == base  # the same files, wherever they are
    source = tree / "cuda" / "common" / "rows.cu"
    source.write_text(source.read_text() + "\n// an edit\n")
    assert points_digest("tiny-qwen3", "bf16", "sm_90", tree) != copied
    store = tmp_path / "evidence.sqlite"
    monkeypatch.setenv("METRALE_EVIDENCE", str(store))
    none = points_digest("tiny-qwen3", "bf16", "sm_90")
    store.write_bytes(b"records")
    written = points_digest("tiny-qwen3", "bf16", "sm_90")
    assert written != none
    os.utime(store, ns=(1, 1))  # a store written again (``met tune``)
    assert points_digest("tiny-qwen3", "bf16", "sm_90") != written


@pytest.mark.parametrize("model", ["tiny-qwen3"])
def test_met_build_keeps_the_points_in_its_cache(tmp_path, model, monkeypatch, capsys):
    """A second ``met build --cache DIR`` (nvcc or not: the host class builds by semantics)
    finds its points in DIR/points and plans nothing."""
    from metrale.cli import main

    cache = tmp_path / "cache"
    assert main(["build", model, "--quant", "bf16", "--hardware", "host", "--cache",
                 str(cache), "--format", "json"]) == 0
    assert list((cache / "points").glob("points-*.json"))
    monkeypatch.setattr(points_mod, "plan_for", _no_planning)
    assert main(["build", model, "--quant", "bf16", "--hardware", "host", "--cache",
                 str(cache), "--format", "json"]) == 0
    capsys.readouterr()
    assert Path(cache / "points").is_dir()
