"""benchmarks/bench_gpu_prefill.py's wiring, checked where there is no GPU: every kernel it
launches takes its arguments from the buffers the script makes, at every shape it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_prefill as bench  # noqa: E402


@pytest.mark.parametrize("shape", ["gemm", "gemv"])
@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4"])
def test_every_launch_finds_its_buffers_and_a_grid(weight, shape):
    for _model, _name, family, dims in bench.SHAPES:
        kernel = bench.realized(family, weight, shape)
        assert kernel.entry.endswith("_mma") == (shape == "gemm"), kernel.entry
        buffers = {"x", "r", *bench.OUT_PORTS[family]}
        for port in bench.WEIGHT_PORTS[family]:
            buffers |= {port, f"{port}_scale", f"{port}_global"}
        for rows in (8, 2048):
            sizes = {"rows": rows, **dims}
            for arg in kernel.args:
                name, _, ty = arg.partition(":")
                assert (name in buffers) if ty == "ptr" else (name in sizes), (kernel.entry, arg)
            grid, block, shared = kernel.launch_for(sizes)
            assert min(grid) >= 1 and block[0] % 32 == 0 and shared >= 0
        assert len(bench.widths(family, dims)) == len(bench.WEIGHT_PORTS[family])
