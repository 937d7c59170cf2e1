"""gpt-oss on the host backend against transformers' ``GptOssForCausalLM`` in float32.

A tiny random gpt-oss checkpoint (``tiny-gpt-oss``: layer 0 slides over 8 positions, layer 1
attends to all, per-head sinks, biased q/k/v/o, 6 experts with 2 per token, yarn RoPE) is
built by transformers; its experts' gate/up matrices are scaled up so that the SwiGLU's clamp
at 7 binds for many activations. The engine at ``act="f32"`` prefills a 24-token prompt (three
windows long) and decodes 8 steps fed transformers' tokens: every step's logits agree within
rtol 1e-3 / atol 1e-3 × logit scale, every greedy token is transformers' argmax or within 1 %
of its logit range, and ``generate`` follows transformers' tokens. The mxfp4 checkpoint that
``quantize_checkpoint`` writes (``*_blocks``/``*_scales`` experts) is compared with
transformers run on its dequantized weights.

The comparison can fail: the same weights under a config without the window, without the
clamp, or with the sinks zeroed give logits outside the tolerance (checked here too).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from metrale.plan.config import ModelConfig
from metrale.runtime.engine import Engine, checkpoint_weights
from metrale.runtime.quantize import quantize_checkpoint
from tests.oracle import hf_reference, make_hf_checkpoint

pytest.importorskip("torch")
pytest.importorskip("transformers")

PROMPT = [int(t) for t in np.random.default_rng(52).integers(0, 256, 24)]
STEPS = 8
RTOL = ATOL = 1e-3
GATE_UP_GAIN = 8.0  # gate/up pre-activations ~ N(0, 8): |gate| > 7 for about 38 % of them
MAX_CTX = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gpt_oss_oracle")


def _rewrite(src, dst, *, config=None, scale=None):
    """A copy of checkpoint ``src`` with config.json keys ``config`` replaced and the tensors
    named in ``scale`` multiplied by their factor (the rest byte for byte)."""
    import safetensors.numpy

    dst.mkdir(parents=True, exist_ok=True)
    tensors = safetensors.numpy.load_file(str(src / "model.safetensors"))
    import ml_dtypes

    for name, factor in (scale or {}).items():
        for key in [k for k in tensors if k.endswith(name)]:
            tensors[key] = (tensors[key].astype(np.float32) * factor).astype(ml_dtypes.bfloat16)
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    data = json.loads((src / "config.json").read_text())
    data.update(config or {})
    (dst / "config.json").write_text(json.dumps(data))
    return dst


@pytest.fixture(scope="module")
def bf16_checkpoint(root):
    plain = make_hf_checkpoint("gpt_oss", root / "plain", seed=52)
    return _rewrite(plain, root / "bf16", scale={"mlp.experts.gate_up_proj": GATE_UP_GAIN})


@pytest.fixture(scope="module")
def bf16_reference(bf16_checkpoint):
    return hf_reference(bf16_checkpoint, PROMPT, STEPS)


def _dequantized_copy(src, dst):
    """An f32 checkpoint, in transformers' gpt-oss layout, of the weights ``src`` holds after
    dequantization (experts back to ``x @ W``'s [E, k, n])."""
    import safetensors.numpy

    from metrale.plan.circuit import circuit_for

    config = ModelConfig.load(src)
    circuit = circuit_for(config, "mxfp4")
    weights = checkpoint_weights(src, config, "mxfp4")
    tensors = {n: np.ascontiguousarray(np.swapaxes(w, -1, -2) if n in circuit.transposed else w)
               for n, w in weights.items()}
    dst.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(tensors, str(dst / "model.safetensors"), {"format": "pt"})
    data = json.loads((src / "config.json").read_text())
    data.pop("quantization_config", None)
    data["dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(data))
    return dst


def _run(ckpt, ref):
    """The engine's prefill and decode logits, fed ``ref``'s tokens, and its greedy tokens."""
    with Engine.load(ckpt, act="f32", max_ctx=MAX_CTX) as engine:
        rows = [engine.prefill(PROMPT)]
        for i in range(STEPS):
            rows.append(engine.decode([ref.greedy_tokens[i]]))
        tokens = list(engine.generate(PROMPT, STEPS + 1).ids)  # a Generation since i50
    return rows, tokens


def _scale(ref) -> float:
    return float(max(np.abs(ref.prefill_logits).max(), np.abs(ref.step_logits).max()))


def _compare(rows, tokens, ref, label):
    scale = _scale(ref)
    assert scale > 1.0, f"{label}: degenerate reference logits (scale {scale})"
    np.testing.assert_allclose(rows[0], ref.prefill_logits, rtol=RTOL, atol=ATOL * scale,
                               err_msg=f"{label}: prefill logits")
    refs = [ref.prefill_logits[-1], *ref.step_logits]
    ours = [rows[0][-1], *(r[0] for r in rows[1:])]
    for i, (mine, theirs) in enumerate(zip(ours, refs)):
        if i:
            np.testing.assert_allclose(mine, theirs, rtol=RTOL, atol=ATOL * scale,
                                       err_msg=f"{label}: decode step {i - 1} logits")
        best, pick = int(theirs.argmax()), int(mine.argmax())
        spread = float(theirs.max() - theirs.min())
        assert best == ref.greedy_tokens[i]
        assert pick == best or theirs[best] - theirs[pick] <= 0.01 * spread, (
            f"{label}: step {i} picks {pick}, transformers {best}, "
            f"{theirs[best] - theirs[pick]:.4g} below it of a range {spread:.4g}")
    # generate() feeds its own tokens: it follows transformers' up to the first step whose
    # top-2 margin is within twice the logit tolerance (after a near-tie both may rightly part)
    margins = ref.margins()
    tol = 2 * (ATOL + RTOL) * scale
    decisive = [i for i, m in enumerate(margins) if m > tol]
    assert len(decisive) >= (STEPS + 1) // 2, f"{label}: too few decisive steps {margins}"
    tie = next((i for i, m in enumerate(margins) if m <= tol), STEPS + 1)
    assert tokens[:tie] == ref.greedy_tokens[:tie], (label, tie, tokens, ref.greedy_tokens)


def test_config_matches_transformers_defaults():
    """The built-ins' shapes are transformers' GptOssConfig's (120b's are its defaults)."""
    import transformers

    hf = transformers.GptOssConfig()
    for name, experts, layers in (("gpt-oss-120b", 128, 36), ("gpt-oss-20b", 32, 24)):
        c = ModelConfig.load(name)
        assert (c.hidden_size, c.moe_intermediate_size, c.head_dim, c.num_attention_heads,
                c.num_key_value_heads, c.vocab_size, c.sliding_window, c.num_experts_per_tok,
                c.rms_norm_eps, c.rope_theta, c.swiglu_limit, c.swiglu_alpha) == (
            hf.hidden_size, hf.intermediate_size, hf.head_dim, hf.num_attention_heads,
            hf.num_key_value_heads, hf.vocab_size, hf.sliding_window, hf.num_experts_per_tok,
            hf.rms_norm_eps, hf.rope_parameters["rope_theta"], hf.swiglu_limit,
            hf.swiglu_alpha)
        assert (c.num_experts, c.num_hidden_layers) == (experts, layers)
        assert c.layer_types == tuple(transformers.GptOssConfig(
            num_hidden_layers=layers).layer_types)
        yarn = hf.rope_parameters
        r = c.rope_scaling
        assert (r.rope_type, r.factor, r.beta_fast, r.beta_slow, r.truncate,
                r.original_max_position_embeddings) == (
            yarn["rope_type"], yarn["factor"], yarn["beta_fast"], yarn["beta_slow"],
            yarn["truncate"], yarn["original_max_position_embeddings"])


def test_yarn_tables_match_transformers():
    import torch
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from metrale.plan.models import builtin_config
    from metrale.plan.rope import rope_table

    for name in ("tiny-gpt-oss", "gpt-oss-20b"):
        rot = GptOssRotaryEmbedding(transformers.GptOssConfig(**builtin_config(name)))
        pos = torch.arange(300)[None]
        cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
        mine_cos, mine_sin = rope_table(ModelConfig.load(name), 300)
        # torch's float32 pow may give an inverse frequency one ulp off numpy's (its vector and
        # scalar paths differ, and which elements take which follows the buffer's alignment), so
        # an angle may be one ulp of the largest angle off: that times the tables' scale, twice
        scale = float(np.abs(mine_cos).max())
        atol = 2 * scale * float(np.spacing(np.float32(299.0)))
        assert atol < 1e-4  # far below what a wrong factor, ramp or attention factor moves
        np.testing.assert_allclose(mine_cos, cos[0].numpy(), rtol=0, atol=atol)
        np.testing.assert_allclose(mine_sin, sin[0].numpy(), rtol=0, atol=atol)
        assert not np.allclose(np.abs(mine_cos).max(), 1.0)  # the attention factor applies


def test_bf16_gpt_oss_matches_transformers(bf16_checkpoint, bf16_reference):
    assert len(PROMPT) > 2 * ModelConfig.load(bf16_checkpoint).sliding_window
    rows, tokens = _run(bf16_checkpoint, bf16_reference)
    _compare(rows, tokens, bf16_reference, "gpt_oss/bf16")


@pytest.mark.parametrize("change", ["no window", "no clamp", "no sinks"])
def test_the_comparison_sees_each_gpt_oss_feature(change, bf16_checkpoint, bf16_reference,
                                                  root):
    """Each feature changes the logits beyond the tolerance on these weights and prompt."""
    if change == "no window":
        ckpt = _rewrite(bf16_checkpoint, root / "nowindow", config={"sliding_window": 1000})
    elif change == "no clamp":
        ckpt = _rewrite(bf16_checkpoint, root / "noclamp", config={"swiglu_limit": 1e6})
    else:
        ckpt = _rewrite(bf16_checkpoint, root / "nosinks", scale={"self_attn.sinks": 0.0})
    with Engine.load(ckpt, act="f32", max_ctx=MAX_CTX) as engine:
        got = engine.prefill(PROMPT)
    err = np.abs(got - bf16_reference.prefill_logits).max()
    assert err > 10 * (ATOL + RTOL) * _scale(bf16_reference), (change, err)


def test_mxfp4_gpt_oss_matches_transformers_on_dequantized_weights(bf16_checkpoint, root):
    qdir = root / "mxfp4"
    if qdir.exists():
        shutil.rmtree(qdir)
    report = quantize_checkpoint(bf16_checkpoint, qdir, "mxfp4", progress=False)
    import safetensors

    with safetensors.safe_open(str(qdir / "model.safetensors"), "np") as f:
        names = set(f.keys())
        blocks = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_blocks")
        scales = f.get_tensor("model.layers.0.mlp.experts.gate_up_proj_scales")
    # transformers' layout: [E, 2·inter, hidden/32, 16] E2M1 pairs, [E, 2·inter, hidden/32] E8M0
    assert blocks.shape == (6, 64, 2, 16) and blocks.dtype == np.uint8
    assert scales.shape == (6, 64, 2) and scales.dtype == np.uint8
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert "model.layers.0.mlp.router.weight" in names  # routers stay bf16
    assert {t.name for t in report.quantized} >= {"model.layers.1.mlp.experts.down_proj"}
    # transformers' own mxfp4 reader gives, from these bytes, the weights the engine binds
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32).numpy()
    ours = checkpoint_weights(qdir, ModelConfig.load(qdir), "mxfp4")[
        "model.layers.0.mlp.experts.gate_up_proj"]
    assert np.abs(ours).max() > 0
    assert np.swapaxes(ours, -1, -2).tobytes() == np.ascontiguousarray(theirs).tobytes()
    ddir = _dequantized_copy(qdir, root / "mxfp4-deq")
    ref = hf_reference(ddir, PROMPT, STEPS)
    with Engine.load(qdir, act="f32", max_ctx=MAX_CTX) as engine:
        assert engine.quant == "mxfp4"
    rows, tokens = _run(qdir, ref)
    _compare(rows, tokens, ref, "gpt_oss/mxfp4")


PUBLISHED_KEEP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                  "lm_head"]
"""``quantization_config.modules_to_not_convert`` of the published gpt-oss checkpoints."""


def test_published_layout_keeps_attention_bf16(bf16_checkpoint, root):
    """As published: mxfp4 experts, bf16 attention named in ``modules_to_not_convert``. The
    circuit types those projections bf16, the engine reads them as stored, and it agrees with
    transformers on the dequantized weights."""
    import safetensors.numpy

    qdir = root / "mxfp4"
    if not qdir.exists():
        quantize_checkpoint(bf16_checkpoint, qdir, "mxfp4", progress=False)
    tensors = safetensors.numpy.load_file(str(qdir / "model.safetensors"))
    plain = safetensors.numpy.load_file(str(bf16_checkpoint / "model.safetensors"))
    attention = [n for n in plain if ".self_attn." in n and n.endswith("_proj.weight")]
    for name in attention:
        x = name.removesuffix(".weight")
        del tensors[x + ".weight_blocks"], tensors[x + ".weight_scales"]
        tensors[name] = plain[name]
    pdir = root / "published"
    pdir.mkdir(exist_ok=True)
    safetensors.numpy.save_file(tensors, str(pdir / "model.safetensors"), {"format": "pt"})
    data = json.loads((qdir / "config.json").read_text())
    data["quantization_config"]["modules_to_not_convert"] = PUBLISHED_KEEP
    (pdir / "config.json").write_text(json.dumps(data))

    from metrale.plan.circuit import circuit_for

    circuit = circuit_for(ModelConfig.load(pdir), "mxfp4")
    assert str(circuit.input_type("model.layers.1.self_attn.o_proj.weight")) == "bf16[hidden,q_dim]"
    assert circuit.input_type("model.layers.1.mlp.experts.down_proj").fmt == "mxfp4"
    weights = checkpoint_weights(pdir, ModelConfig.load(pdir), "mxfp4")
    for name in attention:  # read as stored, not through a quantizer
        assert weights[name].tobytes() == plain[name].astype(np.float32).tobytes()
    ref = hf_reference(_dequantized_copy(pdir, root / "published-deq"), PROMPT, STEPS)
    rows, tokens = _run(pdir, ref)
    _compare(rows, tokens, ref, "gpt_oss/published mxfp4")
