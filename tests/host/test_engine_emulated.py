"""Whole models with the sm_90 plans on the CUDA emulation (tests/host/simt) against the host
backend's reference plans: prefill (8 tokens: GEMV points; 40 tokens: the tensor-core GEMM and
attention) and decode steps replayed from the captured graph, logits within the bf16
tolerance. The device runs the same comparison in tests/cuda/test_engine_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.runtime.engine import Engine
from metrale.runtime.host_backend import HostBackend
from tests.host import simt

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")

PROMPTS = {"gemv": [5, 17, 3, 99, 42, 7, 1, 250],
           "gemm": [(37 * i + 11) % 251 for i in range(40)]}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max())
    assert np.isfinite(got).all(), what
    err = float(np.abs(got - want).max())
    assert err <= 1.6e-2 * scale + 1e-5, f"{what}: max |emulated - host| {err:.4g}, scale {scale:.4g}"


@pytest.fixture
def build_dir(simt_build_dir):
    return simt_build_dir


@pytest.mark.parametrize("shape", sorted(PROMPTS))
@pytest.mark.parametrize("model,quant", [("tiny-llama", "bf16"), ("tiny-qwen3", "mxfp4"),
                                         ("tiny-qwen3-moe", "fp8")])
def test_sm90_plans_on_the_emulation_match_the_host(build_dir, model, quant, shape):
    prompt = PROMPTS[shape]
    with Engine.load(model, hardware="sm_90", quant=quant, max_ctx=64, backend=HostBackend(),
                     loader=simt.plan_loader(build_dir)) as emu, \
            Engine.load(model, hardware="host", quant=quant, max_ctx=64) as host:
        full = emu.prefill(prompt)
        _close(full, host.prefill(prompt), f"{model} {quant} prefill")
        # the last-row plan (last_row, then the norm and lm_head on one row) gives that row's
        # bytes: every kernel after the layers is row-invariant
        assert emu.prefill(prompt, last=True).tobytes() == full[-1:].tobytes()
        token = 11
        for step in range(2):
            e, h = emu.decode([token]), host.decode([token])
            _close(e, h, f"{model} {quant} decode step {step}")
            token = int(h[0].argmax())
