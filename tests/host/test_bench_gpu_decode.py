"""benchmarks/bench_gpu_decode.py's random weights, checked where there is no GPU: every tensor
the model's plans bind, in its storage format, one host array per shape shared by the layers,
finite once dequantized, and a host engine built from them decodes to finite logits."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_decode as bench  # noqa: E402

from metrale.lkb.quant import QuantTensor  # noqa: E402
from metrale.plan.config import ModelConfig  # noqa: E402
from metrale.runtime.engine import Engine, _weight_shapes  # noqa: E402


@pytest.mark.parametrize("quant", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-llama"])
def test_fast_weights_bind_every_tensor_and_share_one_array_per_shape(model, quant):
    config = ModelConfig.load(model)
    shapes = _weight_shapes(config, quant)
    w = bench.fast_weights(model, quant, np.random.default_rng(0))
    assert set(w) == set(shapes)
    for name, (shape, fmt) in shapes.items():
        t = w[name]
        assert tuple(t.shape) == tuple(shape), name
        assert isinstance(t, QuantTensor) == bool(fmt), name
    layers = [n for n in shapes if n.startswith("model.layers.")]
    firsts = {n.split(".", 3)[3]: n for n in reversed(layers)}  # each role's first layer
    for name in layers:
        assert w[name] is w[firsts[name.split(".", 3)[3]]], name  # one array for every layer
    # the host loader takes plain arrays: the quantized tensors dequantized (finite codes and
    # scales give finite weights), on the bf16 plan
    plain = {n: t.dequantize() if isinstance(t, QuantTensor) else t for n, t in w.items()}
    assert all(np.isfinite(np.asarray(t, np.float32)).all() for t in plain.values())
    eng = Engine(config, "bf16", plain, hardware="host", backend=None, loader=None, act="f32",
                 max_ctx=8, slots=1, blocking=True, debug=False, graphs=False, fuse=True,
                 policy="exact")
    try:
        prog = eng.program("decode", 1)
        prog.run()
        assert np.isfinite(prog.read("logits")).all()
    finally:
        eng.close()


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
