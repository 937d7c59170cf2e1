"""The transformers oracle itself: its checkpoints load as our configs and its RoPE is ours.

Checks that each tiny checkpoint builds, reads back through ``ModelConfig.load`` equal to the
built-in it was made from, agrees field by field with transformers' own reading, and that
``hf_reference`` is a faithful, decisive greedy run. Then ``rope_table`` against transformers'
rotary embeddings for default, linear and llama3 scaling.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest

from metrale.lkb.dtype import BF16
from metrale.plan.config import ModelConfig, RopeScaling
from metrale.plan.models import TINY_BY_ARCH
from metrale.plan.rope import rope_inv_freq, rope_table
from tests.oracle import HF_CONFIG_CLASSES, hf_reference, load_hf_model, make_hf_checkpoint

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ARCHS = ("llama", "qwen3", "qwen3_moe")
PROMPT = [3, 17, 99, 200, 5, 64, 1, 250]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    return {arch: make_hf_checkpoint(arch, root / arch) for arch in ARCHS}


def _hf_view(hf) -> dict:
    """transformers' reading of a config, in our field names."""
    rope = dict(hf.rope_parameters)
    view = {
        "hidden_size": hf.hidden_size,
        "intermediate_size": hf.intermediate_size,
        "num_hidden_layers": hf.num_hidden_layers,
        "num_attention_heads": hf.num_attention_heads,
        "num_key_value_heads": hf.num_key_value_heads,
        "head_dim": getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        "vocab_size": hf.vocab_size,
        "tie_word_embeddings": hf.tie_word_embeddings,
        "rope_theta": float(rope["rope_theta"]),
        "rope_type": rope["rope_type"],
        "rms_norm_eps": hf.rms_norm_eps,
        "max_position_embeddings": hf.max_position_embeddings,
        "sliding_window": getattr(hf, "sliding_window", None),
    }
    if rope["rope_type"] == "llama3":
        view["rope"] = (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                        rope["original_max_position_embeddings"])
    if hf.model_type == "qwen3_moe":
        view.update(num_experts=hf.num_experts, num_experts_per_tok=hf.num_experts_per_tok,
                    moe_intermediate_size=hf.moe_intermediate_size,
                    norm_topk_prob=hf.norm_topk_prob, decoder_sparse_step=hf.decoder_sparse_step,
                    mlp_only_layers=tuple(hf.mlp_only_layers))
    return view


def _our_view(c: ModelConfig) -> dict:
    view = {
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "rope_theta": c.rope_theta,
        "rope_type": "default" if c.rope_scaling is None else c.rope_scaling.rope_type,
        "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "sliding_window": c.sliding_window,
    }
    r = c.rope_scaling
    if r is not None and r.rope_type == "llama3":
        view["rope"] = (r.factor, r.low_freq_factor, r.high_freq_factor,
                        r.original_max_position_embeddings)
    if c.is_moe:
        view.update(num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                    moe_intermediate_size=c.moe_intermediate_size,
                    norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                    mlp_only_layers=c.mlp_only_layers)
    return view


# -- checkpoints -----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpoint_loads_as_its_builtin(checkpoints, arch):
    ckpt = checkpoints[arch]
    assert (ckpt / "model.safetensors").is_file()
    ours = ModelConfig.load(ckpt)
    builtin = ModelConfig.load(TINY_BY_ARCH[arch])
    # transformers 5 rewrote the file in its own spelling (rope_parameters, dtype,
    # num_local_experts); the reading must not change.
    assert ours == attrs.evolve(builtin, name=ckpt.name)
    assert ours.dtype == BF16


@pytest.mark.parametrize("arch", ARCHS)
def test_our_config_agrees_with_transformers(checkpoints, arch):
    ours = ModelConfig.load(checkpoints[arch])
    theirs = transformers.AutoConfig.from_pretrained(checkpoints[arch])
    assert theirs.model_type == ours.arch
    assert _our_view(ours) == _hf_view(theirs)


@pytest.mark.parametrize("name", ["qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen3-30b-a3b",
                                  "tiny-qwen3-moe"])
def test_transformers_reads_our_writer(name):
    ours = ModelConfig.load(name)
    cls = getattr(transformers, HF_CONFIG_CLASSES[ours.arch])
    assert _hf_view(cls.from_dict(ours.to_hf_dict())) == _our_view(ours)


def test_is_moe_layer_matches_transformers_model():
    d = ModelConfig.load("tiny-qwen3-moe").to_hf_dict()
    d.update(num_hidden_layers=5, decoder_sparse_step=2, mlp_only_layers=[3])
    ours = ModelConfig.from_hf_dict(d)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**d))
    sparse = ["SparseMoe" in type(layer.mlp).__name__ for layer in model.model.layers]
    assert sparse == [ours.is_moe_layer(i) for i in range(5)] == [False, True, False, False, False]


def test_weights_are_seeded_and_not_default(tmp_path, checkpoints):
    a = safetensors_torch.load_file(checkpoints["qwen3"] / "model.safetensors")
    b = safetensors_torch.load_file(make_hf_checkpoint("qwen3", tmp_path / "b") / "model.safetensors")
    c = safetensors_torch.load_file(make_hf_checkpoint("qwen3", tmp_path / "c", seed=1)
                                    / "model.safetensors")
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not any(torch.equal(a[k], c[k]) for k in a)
    norm = a["model.layers.0.self_attn.q_norm.weight"].float()
    assert norm.dtype == torch.float32 and not torch.all(norm == 1)
    assert abs(float(norm.mean()) - 1) < 0.1
    w = a["model.layers.0.self_attn.q_proj.weight"].float()
    assert 0.09 < float(w.std()) < 0.16  # hidden_size ** -0.5 == 0.125


def test_tied_checkpoint_and_float32(tmp_path):
    ckpt = make_hf_checkpoint("llama", tmp_path / "t", dtype="float32", tie_word_embeddings=True)
    c = ModelConfig.load(ckpt)
    assert c.tie_word_embeddings and c.dtype.name == "f32"
    tensors = safetensors_torch.load_file(ckpt / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert tensors["model.embed_tokens.weight"].dtype == torch.float32


# -- the reference run -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_reference_is_a_faithful_greedy_run(checkpoints, arch):
    start = time.perf_counter()
    ref = hf_reference(checkpoints[arch], PROMPT, 5)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0
    prefill, tokens, steps = ref
    assert prefill.shape == (len(PROMPT), 256) and prefill.dtype == np.float32
    assert steps.shape == (5, 256) and steps.dtype == np.float32
    assert tokens[0] == int(prefill[-1].argmax())
    assert tokens[1:] == [int(r.argmax()) for r in steps]
    # not degenerate: logits spread, rows differ, and most greedy choices are decisive
    assert float(prefill.std(axis=-1).min()) > 0.3
    assert float(np.abs(prefill[1:] - prefill[:-1]).max()) > 0.5
    assert float(np.median(ref.margins())) > 1e-2
    # the cached decode equals one forward over prompt + fed tokens (no cache)
    model = load_hf_model(checkpoints[arch])
    with torch.inference_mode():
        full = model(torch.tensor([PROMPT + tokens[:-1]])).logits[0].numpy()
    np.testing.assert_allclose(full[: len(PROMPT)], prefill, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(full[len(PROMPT):], steps, rtol=1e-4, atol=1e-4)
    again = hf_reference(checkpoints[arch], PROMPT, 5)
    assert np.array_equal(again.prefill_logits, prefill) and again.greedy_tokens == tokens


# -- RoPE against transformers' rotary embedding ---------------------------------------------

ROPE_CASES = {
    "tiny-qwen3": None,
    "qwen3-8b": None,
    "tiny-llama": None,
    "llama-3.2-1b": None,
    "llama-3.1-8b": None,
    "llama-3.1-8b/linear": RopeScaling("linear", 4.0),
    "llama-3.1-8b/llama3-2-3": RopeScaling("llama3", 16.0, 2.0, 3.0, 1000),
}


def _case(key: str) -> ModelConfig:
    c = ModelConfig.load(key.split("/")[0])
    if "/" in key:
        c = attrs.evolve(c, rope_scaling=ROPE_CASES[key])
    return c


def _hf_rotary(c: ModelConfig):
    cls = getattr(transformers, HF_CONFIG_CLASSES[c.arch])
    hf = cls.from_dict(c.to_hf_dict())
    module = {"llama": "llama", "qwen3": "qwen3", "qwen3_moe": "qwen3_moe"}[c.arch]
    modeling = __import__(f"transformers.models.{module}.modeling_{module}", fromlist=["x"])
    rotary_cls = next(getattr(modeling, n) for n in dir(modeling) if n.endswith("RotaryEmbedding"))
    return rotary_cls(hf)


@pytest.mark.parametrize("key", list(ROPE_CASES))
def test_rope_table_matches_transformers(key):
    c = _case(key)
    rotary = _hf_rotary(c)
    ours = rope_inv_freq(c)
    theirs = rotary.inv_freq.numpy()
    assert ours.dtype == np.float32 and ours.shape == theirs.shape == (c.head_dim // 2,)
    # transformers' float32 pow is 1-ulp accurate, ours correctly rounded: at most 1 ulp apart
    np.testing.assert_array_max_ulp(ours, theirs, maxulp=1)
    positions = 4096
    cos_hf, sin_hf = rotary(torch.zeros(1, dtype=torch.float32), torch.arange(positions)[None])
    half = c.head_dim // 2
    cos_hf, sin_hf = cos_hf[0].numpy(), sin_hf[0].numpy()
    # neox layout: transformers repeats the half table
    assert np.array_equal(cos_hf[:, :half], cos_hf[:, half:])
    cos, sin = rope_table(c, positions)
    assert cos.shape == sin.shape == (positions, half) and cos.dtype == np.float32
    # entries cross zero, so relative 1e-6 gets an absolute floor of 1e-6 (the table's scale
    # is 1); measured: at most 1.2e-7 apart
    np.testing.assert_allclose(cos, cos_hf[:, :half], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sin, sin_hf[:, :half], rtol=1e-6, atol=1e-6)


def test_llama3_cases_exercise_every_band():
    c = ModelConfig.load("tiny-llama")
    plain = rope_inv_freq(attrs.evolve(c, rope_scaling=None))
    scaled = rope_inv_freq(c)
    factor = c.rope_scaling.factor
    kept = scaled == plain
    divided = np.isclose(scaled, plain / factor, rtol=1e-6)
    smoothed = ~kept & ~divided
    assert kept.any() and divided.any() and smoothed.any()
    assert np.all(scaled[smoothed] < plain[smoothed])
    assert np.all(scaled[smoothed] > plain[smoothed] / factor)


def test_linear_scaling_divides_every_frequency():
    c = ModelConfig.load("tiny-qwen3")
    plain = rope_inv_freq(c)
    scaled = rope_inv_freq(attrs.evolve(c, rope_scaling=RopeScaling("linear", 4.0)))
    assert np.array_equal(scaled, (plain / np.float32(4)).astype(np.float32))
