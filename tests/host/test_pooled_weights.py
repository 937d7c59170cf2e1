"""The pooled random weights (``runtime.engine.pooled_weights``) that ``met bench``, ``met tune``
and the GPU benchmarks time with: every tensor the model's plans bind, in its storage format,
one host array per shape shared by the layers, finite once dequantized, seeded, and an engine
loaded with them decodes to finite logits."""

from __future__ import annotations

import time

import numpy as np
import pytest

from metrale.lkb.errors import ConfigError
from metrale.lkb.quant import QuantTensor
from metrale.plan.config import ModelConfig
from metrale.runtime.engine import Engine, _weight_shapes, pooled_weights, seeded_weights


def _plain(t):
    return np.asarray(t.dequantize() if isinstance(t, QuantTensor) else t, np.float32)


@pytest.mark.parametrize("quant", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-llama", "tiny-gpt-oss"])
def test_pooled_weights_bind_every_tensor_and_share_one_array_per_shape(model, quant):
    config = ModelConfig.load(model)
    shapes = _weight_shapes(config, quant)
    w = pooled_weights(model, quant)
    assert set(w) == set(shapes)
    for name, (shape, fmt) in shapes.items():
        t = w[name]
        assert tuple(t.shape) == tuple(shape), name
        assert isinstance(t, QuantTensor) == bool(fmt), name
        values = _plain(t)
        assert np.isfinite(values).all(), name
        assert np.count_nonzero(values) > values.size // 2, name  # never timing on zeros
    layers = [n for n in shapes if n.startswith("model.layers.")]
    firsts = {n.split(".", 3)[3]: n for n in reversed(layers)}  # each role's first layer
    for name in layers:
        assert w[name] is w[firsts[name.split(".", 3)[3]]], name  # one array for every layer


def test_pooled_weights_are_seeded():
    a, b = pooled_weights("tiny-llama", "mxfp4", seed=3), pooled_weights("tiny-llama", "mxfp4",
                                                                         seed=3)
    c = pooled_weights("tiny-llama", "mxfp4", seed=4)
    name = "model.layers.0.mlp.down_proj.weight"
    assert (a[name].data == b[name].data).all()
    assert not (a[name].data == c[name].data).all()
    with pytest.raises(ConfigError, match="seed"):
        pooled_weights("tiny-llama", seed=-1)


def test_pooled_weights_of_an_8b_model_take_seconds():
    start = time.perf_counter()
    w = pooled_weights("llama-3.1-8b", "mxfp4")
    assert time.perf_counter() - start < 30  # drawing 8e9 normal values takes minutes
    assert w["lm_head.weight"].shape == (128256, 4096)


@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_an_engine_loaded_with_pooled_weights_decodes_to_finite_logits(quant):
    with Engine.load("tiny-qwen3-moe", quant=quant, act="f32", max_ctx=8,
                     random="pooled") as eng:
        prog = eng.program("decode", 1)
        prog.run()
        assert np.isfinite(prog.read("logits")).all()


def test_an_unknown_way_of_drawing_weights_is_a_typed_error():
    with pytest.raises(ConfigError, match="random.*'uniform'"):
        seeded_weights(ModelConfig.load("tiny-llama"), "bf16", random="uniform")
