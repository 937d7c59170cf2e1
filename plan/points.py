"""The points a model's plans use on a class: what ``met build`` compiles ahead of time.

The matmul points are the ones the search chooses by cost: on sm_90, GEMV-shaped for decode
and GEMM-shaped (tensor cores) for a 64-row prefill.

>>> pts = plan_points("tiny-qwen3", "bf16", "sm_90")
>>> sorted({p.param("shape") for p in pts if p.family == "qkv"})
['gemm', 'gemv']
>>> any(p.family == "sample" for p in plan_points("tiny-qwen3", "bf16", "host"))
True
"""

from __future__ import annotations

from typing import Any

from metrale.lkb.family import Point

from .plan import plan_for

DECODE_ROWS = (1, 8)
PREFILL_ROWS = (64,)


def plan_points(model: Any, quant: str, hardware: str, kernels_dir: Any = None, *,
                act: str = "bf16") -> frozenset[Point]:
    """Every point launched by the decode (rows 1 and 8) and prefill (64 rows) plans, the
    decode plans ending in ``sample`` as generation runs them."""
    points: set[Point] = set()
    for mode, rows_list in (("decode", DECODE_ROWS), ("prefill", PREFILL_ROWS)):
        for rows in rows_list:
            points |= plan_for(model, quant, hardware, mode=mode, rows=rows, act=act,
                               kernels_dir=kernels_dir, sample=mode == "decode").points()
    return frozenset(points)
