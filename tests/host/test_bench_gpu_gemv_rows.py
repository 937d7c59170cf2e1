"""benchmarks/bench_gpu_gemv_rows.py launches what the plans launch, checked where there is no
GPU: at every shape and row count it times, its multi-row entry, grid and shared memory are the
ones sm_90's KERNELS.toml gives the bf16 decode point (``MULTI_COLS`` left at the source's 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_gemv_rows as bench  # noqa: E402

from metrale.lkb.presentation import Presentation  # noqa: E402
from metrale.realize.functor import realization  # noqa: E402
from tests.kernel_cases import matmul_point  # noqa: E402

P = Presentation.load()
F = realization("sm_90", presentation=P)


@pytest.mark.parametrize("rows", [2, 8, 9, 16])
@pytest.mark.parametrize("model,name,n,k", [s for s in bench.GEMV_SHAPES
                                            if s[0] != "qwen3-30b-a3b"])
def test_the_bench_launches_the_plans_multi_row_entry(model, name, n, k, rows):
    family = "gate_up_swiglu" if name == "gate_up" else "linear"
    fam = P.family(family)
    kernel = F.realize(matmul_point(fam, "gemv", "bf16"))
    (entry, _, (grid, _, shared)), = kernel.launches_for({"rows": rows, "k": k, "n": n})
    assert bench.multi_launch(name, n, k, rows, "") == (entry, grid, shared)
    assert entry.endswith("_rows8" if rows <= 8 else "_rows16")


def test_bf16_of_rounds_an_f32_output_as_the_bf16_kernels_store_it():
    """--acts f32 compares an f32 output with the bf16 entries' bytes through bf16_of: it must
    round to nearest even as __float2bfloat16_rn does (ml_dtypes' cast, for finite and infinite
    values) and keep the all-ones poison a NaN, so that an unwritten output never matches."""
    import ml_dtypes
    import numpy as np

    ties = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x7F7FFFFF, 0x00008000, 0x80018000,
                     0x00000001, 0x80000000, 0x7F800000, 0xFF800000], np.uint32).view(np.float32)
    rng = np.random.default_rng(0)
    y = np.concatenate([ties, rng.standard_normal(4096).astype(np.float32)])
    want = y.astype(ml_dtypes.bfloat16).view(np.uint16)
    assert (bench.bf16_of(np, y) == want).all()
    poison = np.full(3, 0xFFFFFFFF, np.uint32).view(np.float32)
    got = bench.bf16_of(np, poison)
    assert (got == 0xFFFF).all() and np.isnan(got.view(ml_dtypes.bfloat16).astype(np.float32)).all()
    keep = np.arange(5, dtype=np.uint16)
    assert bench.bf16_of(np, keep) is keep
