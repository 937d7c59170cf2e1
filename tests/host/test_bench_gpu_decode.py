"""benchmarks/bench_gpu_decode.py's plans without named relations, checked where there is no
GPU (its weights are the runtime's pooled ones: tests/host/test_pooled_weights.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_decode as bench  # noqa: E402

from metrale.plan.config import ModelConfig  # noqa: E402
from metrale.runtime.engine import Engine, _weight_shapes  # noqa: E402


def test_without_drops_only_the_named_relations_and_the_engine_plans_over_what_is_left():
    from metrale.lkb.errors import ConfigError
    from metrale.lkb.presentation import Presentation

    assert bench.without_relations("") is None
    shipped = {r.name for r in Presentation.load().relations}
    P = bench.without_relations("add_rmsnorm,qkv_concat")
    assert {r.name for r in P.relations} == shipped - {"add_rmsnorm", "qkv_concat"}
    with pytest.raises(ConfigError, match="add_rmsnorn"):
        bench.without_relations("add_rmsnorn")
    config = ModelConfig.load("tiny-llama")
    weights = {n: np.zeros(s, np.float32) for n, (s, _) in _weight_shapes(config, "bf16").items()}
    families = {}
    for presentation in (None, P):
        eng = Engine(config, "bf16", weights, hardware="host", backend=None, loader=None,
                     act="f32", max_ctx=8, slots=1, blocking=True, debug=False, graphs=False,
                     fuse=True, policy="exact", presentation=presentation)
        try:
            families[presentation is None] = {k.family for k in eng.plan("decode", 1).kernels}
        finally:
            eng.close()
    assert {"add_rmsnorm", "qkv"} <= families[True]
    assert not {"add_rmsnorm", "qkv"} & families[False]
    assert {"rmsnorm", "linear"} <= families[False]  # the adds go to linear_residual instead
