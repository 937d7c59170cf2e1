"""benchmarks/bench_cold_start.py reads what ``met run`` prints: checked on the host class, where
the same command runs without a GPU (a change to met run's figures would otherwise go unseen
until a device run)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_cold_start as bench  # noqa: E402


def test_a_fresh_met_run_is_timed_and_read(tmp_path):
    got = bench.timed_run("tiny-qwen3", "host", tmp_path)
    assert got["wall_s"] > got["load_s"] > 0 and got["prefill_tokens"] == 8
    assert 0 < got["prefill_ms"] < 1e3 * got["wall_s"]
