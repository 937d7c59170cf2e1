"""benchmarks/trace_gpu_attention.py's reading of a phase-marked launch, checked on a trace made
by hand (the device writes the same layout: phase.cuh)."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_gpu_attention as trace  # noqa: E402


def test_its_doctests() -> None:
    assert doctest.testmod(trace).failed == 0


def test_a_second_wave_shows_as_the_blocks_start_spread() -> None:
    """Four blocks: three start together, one 5 µs later (it waited for a multiprocessor);
    every block runs the same phases for the same time, so each phase's median since its
    block's entry is that time, while the spread and the first-to-last span show the wave."""
    names = trace.PHASES[:3]
    marks = np.zeros((5, trace.MARKS, 2), np.int64)  # the fifth block ran no mark
    for b, start in enumerate((1000, 1010, 1020, 6000)):
        marks[b, :3, 1] = [start, start + 1400, start + 1500]
        marks[b, :3, 0] = [b * 10_000, b * 10_000 + 2800, b * 10_000 + 2980]
    r = trace.summarize(marks, names)
    assert r["blocks"] == 4
    assert r["block_start_spread_ns"] == 5000.0
    assert r["first_start_to_last_end_ns"] == 6500.0
    assert [(p["phase"], p["ns_since_block_start"], p["cycles_in_phase"]) for p in r["phases"]] \
        == [(names[0], 0.0, 0.0), (names[1], 1400.0, 2800.0), (names[2], 1500.0, 180.0)]
