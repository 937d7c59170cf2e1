"""Whole models with the sm_90 plans on the CUDA emulation (tests/host/simt) against the host
backend's reference plans: prefill (8 tokens: GEMV points; 40 tokens: the tensor-core GEMM and
attention; 100 tokens of bf16: the GEMM fed by the Tensor Memory Accelerator; 130 under the
bounded policy: the chain GEMM; 260 of mxfp4: its weights made bf16 first) and decode steps
replayed from the captured graph, logits within the bf16 tolerance. The device runs the same comparison in tests/cuda/test_engine_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.runtime.engine import Engine
from metrale.runtime.host_backend import HostBackend
from tests.host import simt
from tests.kernel_cases import use_shape

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")

PROMPTS = {"gemv": [5, 17, 3, 99, 42, 7, 1, 250],
           "gemm": [(37 * i + 11) % 251 for i in range(40)]}


def _close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    scale = float(np.abs(want).max())
    assert np.isfinite(got).all(), what
    err = float(np.abs(got - want).max())
    assert err <= 1.6e-2 * scale + 1e-5, f"{what}: max |emulated - host| {err:.4g}, scale {scale:.4g}"


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


def test_kernel_times_time_a_kernel_with_the_launches_after_it(build_dir, monkeypatch):
    """Decode attention is two launches (its chunks, then their merge): the kernel profile times
    them together, and in each timing copy the merge reads the buffers the copy gives the first
    launch, so the pair works on one set of inputs."""
    from metrale.runtime import bench as rb
    from metrale.runtime.backend import DevicePtr

    seen: dict[str, tuple] = {}

    def record(be, lns, chains, repeats):
        seen[lns[0].kernel.family] = (lns, chains)
        return 1e-6

    monkeypatch.setattr(rb, "_time_launches", record)
    with Engine.load("tiny-llama", hardware="sm_90", max_ctx=64, backend=HostBackend(),
                     loader=simt.plan_loader(build_dir)) as emu:
        timings = {t.family: t for t in rb.kernel_times(emu, 1, repeats=2)}
    lns, chains = seen["rope_kv_append_attention"]
    assert [ln.kernel.index for ln in lns] == [lns[0].kernel.index] * 2
    assert timings["rope_kv_append_attention"].count == emu.config.num_hidden_layers
    first, merge = lns[0].arg_names, lns[1].arg_names
    positions = (first.index(merge[0]), 0)  # the positions buffer in both launches
    assert len(chains) > 1 and len({c[0][positions[0]] for c in chains}) == len(chains)
    for own, after in chains:
        assert isinstance(after[0], DevicePtr) and own[positions[0]] == after[positions[1]]
    assert all(len(lns) == 1 for f, (lns, _) in seen.items() if "attention" not in f)


def test_a_long_bf16_prompt_reaches_the_tensor_memory_accelerator_gemm(build_dir):
    """Past 64 rows the bf16 GEMMs are gemm_tma.cu's: a 100-token prompt's prefill runs them
    through the whole runtime (the plan's tensor-map arguments, the host backend's encoding of
    them, the emulated tensor copies) and matches the host's."""
    prompt = [(37 * i + 11) % 251 for i in range(100)]
    with Engine.load("tiny-llama", hardware="sm_90", quant="bf16", max_ctx=128,
                     backend=HostBackend(), loader=simt.plan_loader(build_dir)) as emu, \
            Engine.load("tiny-llama", hardware="host", quant="bf16", max_ctx=128) as host:
        launched = {e for k in emu.plan("prefill", len(prompt)).launches for e in k.launched}
        assert {"metrale_qkv_tma", "metrale_gate_up_swiglu_tma"} <= launched, launched
        _close(emu.prefill(prompt), host.prefill(prompt), "tiny-llama bf16 100-token prefill")


def test_a_bounded_prompt_of_a_row_tile_runs_the_chain_gemm(build_dir):
    """Under the bounded policy, from 128 rows, the chain_* relations give the bf16 GEMMs to
    gemm_chain.cu: a 130-token prompt's prefill runs it through the whole runtime (its weights'
    tensor maps in 128-row boxes, the `wide` its table's values give) and matches the host's
    exact plan within the tolerance (the relations' bounds are far inside it)."""
    prompt = [(37 * i + 11) % 251 for i in range(130)]
    with Engine.load("tiny-llama", hardware="sm_90", quant="bf16", max_ctx=160,
                     policy="bounded", backend=HostBackend(),
                     loader=simt.plan_loader(build_dir)) as emu, \
            Engine.load("tiny-llama", hardware="host", quant="bf16", max_ctx=160) as host:
        use_shape(emu, "prefill", len(prompt), "gemm")
        plan = emu.plan("prefill", len(prompt))
        launched = {e for k in plan.launches for e in k.launched}
        assert {"metrale_qkv_chain", "metrale_gate_up_swiglu_chain"} <= launched, launched
        assert any(a.relation == "chain_qkv" for a in plan.applied), plan.applied
        _close(emu.prefill(prompt), host.prefill(prompt), "tiny-llama bf16 bounded 130-token")


def test_a_long_mxfp4_prompt_makes_its_weights_bf16_first(build_dir):
    """Past 256 rows an mxfp4 GEMM makes its weights bf16 into the program's workspace and runs
    gemm_tma.cu on them: a 260-token prompt's prefill on its gemm points runs that chain through
    the whole runtime (the scratch tensors' slices of the workspace, their tensor maps, the
    emulated copies) and matches the host's."""
    prompt = [(37 * i + 11) % 251 for i in range(260)]
    with Engine.load("tiny-llama", hardware="sm_90", quant="mxfp4", max_ctx=272,
                     backend=HostBackend(), loader=simt.plan_loader(build_dir)) as emu, \
            Engine.load("tiny-llama", hardware="host", quant="mxfp4", max_ctx=272) as host:
        use_shape(emu, "prefill", len(prompt), "gemm")
        launched = {e for k in emu.plan("prefill", len(prompt)).launches for e in k.launched}
        assert {"metrale_weights3_bf16", "metrale_qkv_tma", "metrale_weights2_bf16",
                "metrale_gate_up_swiglu_tma"} <= launched, launched
        _close(emu.prefill(prompt), host.prefill(prompt), "tiny-llama mxfp4 260-token prefill")
        # its workspace holds the largest weights made bf16 (gate and up, 128 x 64 each), and the
        # engine counts it: in its memory figures and in the kept prefills' budget
        work = emu.program("prefill", len(prompt)).workspace_bytes
        assert work >= 2 * 128 * 64 * 2 and emu.memory()["workspaces"] >= work
