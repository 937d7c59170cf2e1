"""Whole models on the GPU (sm_90 plans through CupyBackend, decode replayed as a CUDA graph)
against the same models on the host backend: logits within the bf16 tolerance."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("cupy")

from metrale.runtime.cupy_backend import CupyBackend  # noqa: E402
from metrale.runtime.engine import Engine  # noqa: E402
from tests.kernel_cases import use_shape  # noqa: E402

ok, why = CupyBackend.available()
if not ok:
    pytest.skip(f"no CUDA device: {why}", allow_module_level=True)


def _close(gpu: np.ndarray, host: np.ndarray, what: str) -> None:
    scale = float(np.abs(host).max())
    assert np.isfinite(gpu).all(), what
    err = float(np.abs(gpu - host).max())
    # bf16 activations through every layer: 1.6e-2 of the logit scale (PyTorch's bf16 rtol)
    assert err <= 1.6e-2 * scale + 1e-5, f"{what}: max |gpu - host| {err:.4g}, scale {scale:.4g}"


# an 8-token prompt takes the GEMV points; 40 tokens the GEMM points (tensor cores on sm_90)
PROMPTS = {"gemv": [5, 17, 3, 99, 42, 7, 1, 250],
           "gemm": [(37 * i + 11) % 251 for i in range(40)]}


@pytest.mark.parametrize("shape", sorted(PROMPTS))
@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss"])
@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_gpu_engine_matches_host(model, quant, shape):
    with Engine.load(model, hardware="sm_90", quant=quant, max_ctx=64) as gpu, \
            Engine.load(model, hardware="host", quant=quant, max_ctx=64) as host:
        _prefill_and_decode(gpu, host, PROMPTS[shape], f"{model} {quant}")


def _prefill_and_decode(gpu: Engine, host: Engine, prompt: list[int], what: str) -> None:
    """The prompt's prefill, then four decode steps (each feeding the host's argmax), on both
    engines: logits within the tolerance at every step."""
    _close(gpu.prefill(prompt), host.prefill(prompt), f"{what} prefill")
    token = 11
    for step in range(4):
        g, h = gpu.decode([token]), host.decode([token])
        _close(g, h, f"{what} decode step {step}")
        token = int(h[0].argmax())


def test_a_long_bf16_prompt_on_the_tensor_memory_accelerator_gemm_matches_host():
    """Past 64 rows the bf16 GEMMs are gemm_tma.cu's (tiles by tensor copies): a 100-token
    prompt runs them, with the driver's tensor maps, within the tolerance of the host."""
    with Engine.load("tiny-llama", hardware="sm_90", quant="bf16", max_ctx=128) as gpu, \
            Engine.load("tiny-llama", hardware="host", quant="bf16", max_ctx=128) as host:
        launched = {e for k in gpu.plan("prefill", 100).launches for e in k.launched}
        assert {"metrale_qkv_tma", "metrale_gate_up_swiglu_tma"} <= launched, launched
        _prefill_and_decode(gpu, host, [(37 * i + 11) % 251 for i in range(100)],
                            "tiny-llama bf16 100 tokens")


@pytest.mark.parametrize("quant,tokens", [("mxfp4", 260), ("fp8", 390)])
def test_a_long_quantized_prompt_with_its_weights_made_bf16_first_matches_host(quant, tokens):
    """Past its threshold a quantized GEMM makes its weights bf16 in the workspace and runs
    on them: gemm_chain.cu for mxfp4 (the bounded chain_* relations reach its points), gemm_tma.cu
    for fp8 (its own GEMM under the bounded policy; the exact one keeps its f32 weights): the
    prompt's prefill on its gemm points (a tiny model's cheapest plan runs the GEMVs) and the
    decode after it within the tolerance of the host."""
    with Engine.load("tiny-llama", hardware="sm_90", quant=quant, max_ctx=tokens + 8,
                     policy="bounded") as gpu, \
            Engine.load("tiny-llama", hardware="host", quant=quant, max_ctx=tokens + 8) as host:
        use_shape(gpu, "prefill", tokens, "gemm")
        launched = {e for k in gpu.plan("prefill", tokens).launches for e in k.launched}
        qkv = "metrale_qkv_chain" if quant == "mxfp4" else "metrale_qkv_tma"
        assert {"metrale_weights3_bf16", qkv} <= launched, launched
        _prefill_and_decode(gpu, host, [(37 * i + 11) % 251 for i in range(tokens)],
                            f"tiny-llama {quant} {tokens} tokens")


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-qwen3"])
@pytest.mark.parametrize("quant", ["bf16", "fp8", "mxfp4"])
def test_gpu_engine_under_the_bounded_policy_matches_host(model, quant):
    """The bounded plan's GEMV-shaped matmuls on tensor cores (gemv_mma) stay within the bf16
    tolerance of the host's exact plan. The decode takes its gemv points with every relation
    applied, so the mma_gemv ones, whatever the machine's evidence store would choose."""
    with Engine.load(model, hardware="sm_90", quant=quant, max_ctx=64, policy="bounded") as gpu, \
            Engine.load(model, hardware="host", quant=quant, max_ctx=64) as host:
        use_shape(gpu, "decode", 1, "gemv")
        entries = {k.kernel.entry for k in gpu.plan("decode", 1).kernels if k.kernel}
        assert any(e.endswith("_gemv_mma") for e in entries), sorted(entries)
        _prefill_and_decode(gpu, host, PROMPTS["gemv"], f"{model} {quant} bounded")


@pytest.mark.parametrize("rows", [8, 16])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-gpt-oss"])
@pytest.mark.parametrize("policy", ["exact", "bounded"])
def test_gpu_decode_rows_are_row_invariant(policy, model, rows):
    """A row's logits do not depend on the other rows of its step: under the exact policy its
    bytes are those of decoding it alone (the bucket of one row may run other kernels, which
    are bit-identical); under the bounded policy, whose kernels per bucket differ within their
    bound, those of the same step with every other row changed."""
    prompts = [[1 + s, 9, 2 * s + 3] for s in range(rows)]
    others = [[7 + 2 * s, 4, s + 1] for s in range(rows)]
    tokens = [7 + s for s in range(rows)]
    with Engine.load(model, hardware="sm_90", max_ctx=64, slots=rows, policy=policy) as batch, \
            Engine.load(model, hardware="sm_90", max_ctx=64, slots=rows if policy == "bounded"
                        else 1, policy=policy) as alone:
        assert batch.plan("decode", rows).row_invariant
        for s, prompt in enumerate(prompts):
            batch.prefill(prompt, slot=s)
        many = batch.decode(tokens)
        for s in (0, rows // 2 + 1, rows - 1):
            if policy == "exact":
                alone.prefill(prompts[s], slot=0)
                one = alone.decode(tokens[s:s + 1])[0]
            else:  # row s as it was; every other row another prompt and token
                for t in range(rows):
                    alone.prefill(prompts[s] if t == s else others[t], slot=t)
                one = alone.decode([tokens[s] if t == s else 3 + t for t in range(rows)])[s]
            assert many[s].tobytes() == one.tobytes(), f"{model} {policy} row {s} of {rows}"


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_quantized_checkpoint_on_gpu_matches_host(arch, fmt, tmp_path):
    """A checkpoint ``quantize_checkpoint`` wrote, loaded from disk on both backends: the GPU
    stores each weight as its kernels read it (codes and scales re-derived from the loaded
    values) and must give the host's logits within the bf16 tolerance. The head and the routers
    stay bf16 in the checkpoint, as the plans read them."""
    pytest.importorskip("transformers")
    from metrale.runtime.checkpoint import Checkpoint
    from metrale.runtime.quantize import quantize_checkpoint
    from tests.oracle import make_hf_checkpoint

    src = make_hf_checkpoint(arch, tmp_path / arch, seed=5)
    dst = tmp_path / f"{arch}-{fmt}"
    quantize_checkpoint(src, dst, fmt, progress=False)
    with Checkpoint.open(dst) as ck:
        assert hasattr(ck.weight("model.layers.0.self_attn.q_proj.weight"), "dequantize")
        assert not hasattr(ck.weight("lm_head.weight"), "dequantize")
    with Engine.load(dst, hardware="sm_90", max_ctx=64) as gpu, \
            Engine.load(dst, hardware="host", max_ctx=64) as host:
        assert gpu.quant == host.quant == fmt
        _prefill_and_decode(gpu, host, PROMPTS["gemv"], f"{arch} {fmt} checkpoint")
