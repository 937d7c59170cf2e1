"""benchmarks/bench_gpu_decode.py's pieces that run without a GPU: the relations a variant
leaves out, and the line a cell prints with its variants."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from metrale.lkb.errors import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_gpu_decode as bench  # noqa: E402


def test_a_variant_leaves_out_exactly_the_named_relations():
    full = bench.without_relations("qkv_concat")
    assert bench.without_relations("") is None
    names = {r.name for r in full.relations}
    assert "qkv_concat" not in names and "gate_up_swiglu" in names
    both = bench.without_relations("qkv_concat,gate_up_swiglu")
    assert {r.name for r in both.relations} == names - {"gate_up_swiglu"}


def test_an_unknown_relation_is_a_typed_error_naming_it():
    with pytest.raises(ConfigError, match="qkv_concatt"):
        bench.without_relations("qkv_concatt")


def test_each_variant_prints_its_step_and_whether_its_logits_match():
    row = {"model": "qwen3-0.6b", "quant": "bf16", "policy": "exact", "batch": 1,
           "step_s": 0.001, "launches": 199, "floor_s": 0.0003, "copy_floor_s": 0.00031,
           "predicted_s": 0.0011, "logits_sha256": "a",
           "without": [{"relations": "qkv_concat", "step_s": 0.0012, "launches": 255,
                        "logits_sha256": "a"},
                       {"relations": "mma_gemv_linear", "step_s": 0.0009, "launches": 199,
                        "logits_sha256": "b"}]}
    line = bench.metrale_line(row)
    assert "| without qkv_concat 1.200 ms (255 launches, same logits)" in line
    assert "| without mma_gemv_linear 0.900 ms (199 launches, other logits)" in line
