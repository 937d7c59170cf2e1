"""The Engine on the host backend against transformers float32, on the same tiny checkpoints.

For llama, qwen3 and qwen3_moe (bf16 checkpoints from ``tests/oracle.py``) and for the fp8,
mxfp4 and nvfp4 checkpoints ``quantize_checkpoint`` makes of them (compared with transformers
run on the dequantized weights), the engine at ``act="f32"`` must give the reference's
prefill logits and 16 decode steps' logits within rtol 1e-3 / atol 1e-3 × logit scale, fed
the reference's tokens, and ``generate`` must pick the reference's greedy tokens wherever the
reference's top-2 margin is clearly above the tolerance. Steps with a small margin are skipped
by name (the reason is printed and checked never to be all of them), never silently.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from metrale.runtime.checkpoint import Checkpoint
from metrale.runtime.engine import Engine, checkpoint_weights
from metrale.runtime.quantize import quantize_checkpoint
from tests.oracle import hf_reference, make_hf_checkpoint

pytest.importorskip("torch")
pytest.importorskip("transformers")

ARCHS = ("llama", "qwen3", "qwen3_moe")
FORMATS = ("fp8", "mxfp4", "nvfp4")
PROMPT = [3, 17, 99, 200, 5, 64, 1, 250]
STEPS = 16
RTOL = ATOL = 1e-3
MARGIN = 2  # a greedy choice counts only when its margin is this many tolerances wide


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("engine_oracle")


@pytest.fixture(scope="module")
def bf16_checkpoints(root):
    return {arch: make_hf_checkpoint(arch, root / arch, seed=11) for arch in ARCHS}


def _dequantized_copy(src, dst):
    """An f32 checkpoint of the weights ``src`` holds after dequantization (for transformers)."""
    import safetensors.numpy

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    with Checkpoint.open(src) as ck:
        for name in ck.weight_names():
            w = ck.weight(name)
            tensors[name] = np.ascontiguousarray(
                w.dequantize() if hasattr(w, "dequantize") else w, np.float32)
        config = dict(ck.config)
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _compare(engine: Engine, ref, label: str) -> list[str]:
    """Assert logits and greedy tokens agree; return the greedy steps skipped (small margin).

    Decode steps are fed the reference's tokens, so every step's logits are compared even
    after a near-tie; the argmax of each is compared wherever the reference's top-2 margin
    exceeds ``MARGIN`` tolerances, and ``generate`` must follow the reference's tokens up to
    the first step with a smaller margin (after a tie the two runs may rightly part).
    """
    scale = float(max(np.abs(ref.prefill_logits).max(), np.abs(ref.step_logits).max()))
    assert scale > 1.0, f"{label}: degenerate reference logits (scale {scale})"
    atol = ATOL * scale
    tol = MARGIN * (atol + RTOL * scale)
    got = engine.prefill(PROMPT)
    np.testing.assert_allclose(got, ref.prefill_logits, rtol=RTOL, atol=atol,
                               err_msg=f"{label}: prefill logits")
    rows = [got[-1]]
    for i in range(STEPS):
        row = engine.decode([ref.greedy_tokens[i]])[0]
        np.testing.assert_allclose(row, ref.step_logits[i], rtol=RTOL, atol=atol,
                                   err_msg=f"{label}: decode step {i} logits")
        rows.append(row)
    margins = ref.margins()
    skipped = [f"{label} step {i}: margin {m:.3g} <= {tol:.3g}"
               for i, m in enumerate(margins) if m <= tol]
    compared = [i for i, m in enumerate(margins) if m > tol]
    assert len(compared) >= (STEPS + 1) // 2, f"{label}: too few decisive steps: {skipped}"
    for i in compared:
        assert int(rows[i].argmax()) == ref.greedy_tokens[i], f"{label}: greedy step {i}"
    tokens = list(engine.generate(PROMPT, STEPS + 1).ids)
    first_tie = next((i for i, m in enumerate(margins) if m <= tol), STEPS + 1)
    assert tokens[:first_tie] == ref.greedy_tokens[:first_tie], label
    return skipped


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_checkpoint_matches_transformers(arch, bf16_checkpoints, capsys):
    ckpt = bf16_checkpoints[arch]
    ref = hf_reference(ckpt, PROMPT, STEPS)
    with Engine.load(ckpt, act="f32", max_ctx=64) as engine:
        assert engine.quant == "bf16"
        skipped = _compare(engine, ref, arch)
    with capsys.disabled():
        for s in skipped:
            print(f"\n  greedy comparison skipped at {s}")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_checkpoint_matches_transformers_on_dequantized_weights(
        arch, fmt, bf16_checkpoints, root, capsys):
    qdir = root / f"{arch}-{fmt}"
    if not qdir.exists():
        quantize_checkpoint(bf16_checkpoints[arch], qdir, fmt, progress=False)
    ddir = _dequantized_copy(qdir, root / f"{arch}-{fmt}-deq")
    ref = hf_reference(ddir, PROMPT, STEPS)
    with Engine.load(qdir, act="f32", max_ctx=64) as engine:
        assert engine.quant == fmt
        skipped = _compare(engine, ref, f"{arch}/{fmt}")
    with capsys.disabled():
        for s in skipped:
            print(f"\n  greedy comparison skipped at {s}")


def test_quantized_weights_really_differ_from_bf16(bf16_checkpoints, root):
    """The quantized runs test something: their weights are not the bf16 ones."""
    from metrale.plan.config import ModelConfig

    ckpt = bf16_checkpoints["qwen3"]
    config = ModelConfig.load(ckpt)
    plain = checkpoint_weights(ckpt, config, "bf16")
    for fmt in FORMATS:
        qdir = root / f"qwen3-{fmt}"
        if not qdir.exists():
            quantize_checkpoint(ckpt, qdir, fmt, progress=False)
        q = checkpoint_weights(qdir, ModelConfig.load(qdir), fmt)
        name = "model.layers.0.mlp.down_proj.weight"
        assert not np.array_equal(q[name], plain[name]), fmt
        assert np.abs(q[name] - plain[name]).max() < 0.5 * np.abs(plain[name]).max(), fmt
