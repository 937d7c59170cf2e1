"""ModelConfig: built-in shapes, config.json spellings, every inconsistency named, round trips."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.dtype import BF16, F32
from metrale.lkb.errors import ConfigError, ManyErrors
from metrale.lkb.files import atomic_write
from metrale.plan.config import ModelConfig, RopeScaling
from metrale.plan.models import BUILTIN, builtin_config, builtin_names

# name: arch, hidden, inter, layers, heads, kv, head_dim, vocab, tied, theta, rope, eps, max_pos
PUBLISHED = {
    "qwen3-0.6b": ("qwen3", 1024, 3072, 28, 16, 8, 128, 151936, True, 1e6, None, 1e-6, 40960),
    "qwen3-8b": ("qwen3", 4096, 12288, 36, 32, 8, 128, 151936, False, 1e6, None, 1e-6, 40960),
    "llama-3.2-1b": ("llama", 2048, 8192, 16, 32, 8, 64, 128256, True, 5e5,
                     RopeScaling("llama3", 32.0, 1.0, 4.0, 8192), 1e-5, 131072),
    "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, 128, 128256, False, 5e5,
                     RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 1e-5, 131072),
    "llama-3.1-70b": ("llama", 8192, 28672, 80, 64, 8, 128, 128256, False, 5e5,
                      RopeScaling("llama3", 8.0, 1.0, 4.0, 8192), 1e-5, 131072),
    "qwen3-30b-a3b": ("qwen3_moe", 2048, 6144, 48, 32, 4, 128, 151936, False, 1e6, None, 1e-6,
                      40960),
}
FIELDS = ("arch", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings", "rope_theta",
          "rope_scaling", "rms_norm_eps", "max_position_embeddings")


def write_config(tmp_path, data, name="config.json"):
    path = tmp_path / name
    atomic_write(path, json.dumps(data))
    return path


# -- built-ins -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_builtin_has_published_shape(name):
    c = ModelConfig.load(name)
    assert c.name == name
    assert tuple(getattr(c, f) for f in FIELDS) == PUBLISHED[name]
    assert c.dtype == BF16
    assert c.sliding_window is None
    assert c.layer_types == ("full_attention",) * c.num_hidden_layers
    assert c.quantization_config is None


def test_qwen3_30b_a3b_moe_fields():
    c = ModelConfig.load("qwen3-30b-a3b")
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 8, 768)
    assert c.norm_topk_prob is True
    assert (c.decoder_sparse_step, c.mlp_only_layers) == (1, ())
    assert [c.is_moe_layer(i) for i in range(48)] == [True] * 48
    assert c.sizes() == {"hidden": 2048, "inter": 6144, "heads": 32, "kv_heads": 4,
                         "head_dim": 128, "q_dim": 4096, "kv_dim": 512, "vocab": 151936,
                         "experts": 128, "top_k": 8, "moe_inter": 768}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"])
def test_tiny_shapes(name):
    c = ModelConfig.load(name)
    assert c.sizes()["hidden"] == 64 and c.num_hidden_layers == 2
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 2, 16)
    assert (c.intermediate_size, c.vocab_size) == (128, 256)
    if c.is_moe:
        assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (8, 2, 32)


@pytest.mark.parametrize("name", builtin_names())
def test_sizes_are_consistent(name):
    c = ModelConfig.load(name)
    s = c.sizes()
    assert s["q_dim"] == s["heads"] * s["head_dim"] == c.q_dim
    assert s["kv_dim"] == s["kv_heads"] * s["head_dim"] == c.kv_dim
    assert ("experts" in s) == c.is_moe
    assert all(isinstance(v, int) and v > 0 for v in s.values())


def test_dense_models_have_no_moe_layer():
    for name in ("qwen3-8b", "llama-3.1-8b"):
        c = ModelConfig.load(name)
        assert not any(c.is_moe_layer(i) for i in range(c.num_hidden_layers))


def test_builtin_config_is_a_copy():
    d = builtin_config("qwen3-8b")
    d["hidden_size"] = 1
    assert BUILTIN["qwen3-8b"]["hidden_size"] == 4096


def test_str_printer():
    assert str(ModelConfig.load("tiny-qwen3-moe")) == (
        "tiny-qwen3-moe: qwen3_moe, 2 layers, hidden 64, heads 4/2 x 16, inter 128, vocab 256,"
        " experts 8 top 2 x 32")


# -- sources ---------------------------------------------------------------------------------


def test_load_directory_file_and_name_agree(tmp_path):
    ckpt = tmp_path / "my-model"
    ckpt.mkdir()
    path = write_config(ckpt, builtin_config("qwen3-0.6b"))
    from_dir = ModelConfig.load(ckpt)
    from_file = ModelConfig.load(path)
    from_name = ModelConfig.load("qwen3-0.6b")
    assert from_dir.name == from_file.name == "my-model"
    assert from_dir == from_file == attrs.evolve(from_name, name="my-model")
    other = write_config(tmp_path, builtin_config("qwen3-0.6b"), "q.json")
    assert ModelConfig.load(str(other)).name == "q"


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(tmp_path)
    assert e.value.file == str(tmp_path / "config.json")


def test_unknown_source_suggests_builtin():
    with pytest.raises(ConfigError) as e:
        ModelConfig.load("qwen3-8")
    assert e.value.suggestion == "qwen3-8b"
    assert "qwen3-8" in str(e.value)


def test_json_syntax_error_has_position(tmp_path):
    path = tmp_path / "config.json"
    atomic_write(path, '{\n  "hidden_size": 64,\n  oops\n}')
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert (e.value.file, e.value.line) == (str(path), 3)


# -- spellings of transformers 4 and 5 ------------------------------------------------------


def test_transformers5_spellings(tmp_path):
    d = builtin_config("tiny-qwen3-moe")
    theta = d.pop("rope_theta")
    d.pop("rope_scaling")
    d.pop("torch_dtype")
    d["rope_parameters"] = {"rope_theta": theta, "rope_type": "default"}
    d["dtype"] = "float32"
    d["num_local_experts"] = d.pop("num_experts")
    c = ModelConfig.load(write_config(tmp_path, d))
    ref = ModelConfig.load("tiny-qwen3-moe")
    assert c == attrs.evolve(ref, name=c.name, dtype=F32)


def test_llama3_under_rope_parameters():
    d = builtin_config("llama-3.1-8b")
    scaling = d.pop("rope_scaling")
    d["rope_parameters"] = {**scaling, "rope_theta": d.pop("rope_theta")}
    c = ModelConfig.from_hf_dict(d, name="llama-3.1-8b")
    assert c == ModelConfig.load("llama-3.1-8b")


def test_rope_spellings():
    base = builtin_config("tiny-llama")
    legacy = {**base, "rope_scaling": {"type": "linear", "factor": 2}}
    assert ModelConfig.from_hf_dict(legacy).rope_scaling == RopeScaling("linear", 2.0)
    default = {**base, "rope_scaling": {"rope_type": "default"}}
    assert ModelConfig.from_hf_dict(default).rope_scaling is None
    absent = {k: v for k, v in base.items() if k not in ("rope_scaling", "rope_theta")}
    c = ModelConfig.from_hf_dict(absent)
    assert (c.rope_scaling, c.rope_theta) == (None, 10000.0)


def test_llama3_original_positions_default_to_max_positions():
    d = builtin_config("tiny-llama")
    del d["rope_scaling"]["original_max_position_embeddings"]
    assert ModelConfig.from_hf_dict(d).rope_scaling.original_max_position_embeddings == 512


def test_head_dim_defaults_follow_transformers():
    llama = builtin_config("tiny-llama")
    del llama["head_dim"]
    assert ModelConfig.from_hf_dict(llama).head_dim == 64 // 4
    qwen = builtin_config("tiny-qwen3")
    del qwen["head_dim"]
    assert ModelConfig.from_hf_dict(qwen).head_dim == 128  # Qwen3Config's default


def test_kv_heads_default_to_heads_and_arch_from_architectures():
    d = builtin_config("tiny-llama")
    del d["num_key_value_heads"]
    del d["model_type"]
    c = ModelConfig.from_hf_dict(d)
    assert (c.arch, c.num_key_value_heads) == ("llama", 4)


def test_quantization_config_kept_raw():
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    d = {**builtin_config("tiny-qwen3"), "quantization_config": q}
    c = ModelConfig.from_hf_dict(d)
    assert c.quantization_config == q and c.quantization_config is not q
    assert c != ModelConfig.from_hf_dict(builtin_config("tiny-qwen3"))
    assert hash(c) == hash(attrs.evolve(c, quantization_config=None))
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_sliding_window_only_when_enabled():
    off = {**builtin_config("tiny-qwen3"), "sliding_window": 32}
    assert ModelConfig.from_hf_dict(off).sliding_window is None
    on = {**off, "use_sliding_window": True, "max_window_layers": 1, "num_hidden_layers": 3}
    c = ModelConfig.from_hf_dict(on)
    assert c.sliding_window == 32
    assert c.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [c.layer_window(i) for i in range(3)] == [None, 32, 32]
    assert c.with_layers(4).layer_types[-1] == "sliding_attention"
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    moe = ModelConfig.from_hf_dict({**builtin_config("tiny-qwen3-moe"), "use_sliding_window": True,
                                    "sliding_window": 16})
    assert [moe.layer_window(i) for i in range(2)] == [16, 16]


def test_explicit_layer_types():
    d = {**builtin_config("tiny-qwen3"), "use_sliding_window": True, "sliding_window": 8,
         "layer_types": ["sliding_attention", "full_attention"]}
    c = ModelConfig.from_hf_dict(d)
    assert [c.layer_window(i) for i in range(2)] == [8, None]
    assert c.with_layers(1).layer_types == ("sliding_attention",)
    with pytest.raises(ConfigError) as e:
        c.with_layers(3)
    assert e.value.key == "layer_types"


# -- round trips and variants ----------------------------------------------------------------


@pytest.mark.parametrize("name", builtin_names())
def test_round_trip(name, tmp_path):
    c = ModelConfig.load(name)
    assert ModelConfig.from_hf_dict(c.to_hf_dict(), name=name) == c
    ckpt = tmp_path / name
    write_config(ckpt if ckpt.mkdir() is None else ckpt, c.to_hf_dict())
    assert ModelConfig.load(ckpt) == c
    assert hash(ModelConfig.load(ckpt)) == hash(c)


def test_with_layers():
    c = ModelConfig.load("llama-3.1-70b")
    short = c.with_layers(2)
    assert short.num_hidden_layers == 2 and len(short.layer_types) == 2
    assert attrs.evolve(short, num_hidden_layers=80, layer_types=c.layer_types) == c
    assert c.with_layers(80) == c
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ConfigError) as e:
            c.with_layers(bad)
        assert e.value.key == "num_hidden_layers"


def test_is_moe_layer_rule():
    d = {**builtin_config("tiny-qwen3-moe"), "num_hidden_layers": 6, "decoder_sparse_step": 2,
         "mlp_only_layers": [3]}
    c = ModelConfig.from_hf_dict(d)
    # sparse iff not in mlp_only_layers and (i + 1) % 2 == 0: layers 1 and 5 (3 is excluded)
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    for i in (-1, 6):
        with pytest.raises(ConfigError):
            c.is_moe_layer(i)


@given(layers=st.integers(1, 12), step=st.integers(1, 4), data=st.data())
def test_is_moe_layer_survives_with_layers(layers, step, data):
    only = data.draw(st.lists(st.integers(0, layers - 1), unique=True))
    d = {**builtin_config("tiny-qwen3-moe"), "num_hidden_layers": layers,
         "decoder_sparse_step": step, "mlp_only_layers": only}
    c = ModelConfig.from_hf_dict(d)
    assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c
    n = data.draw(st.integers(1, layers))
    cut = c.with_layers(n)
    assert [cut.is_moe_layer(i) for i in range(n)] == [c.is_moe_layer(i) for i in range(n)]
    assert sum(c.is_moe_layer(i) for i in range(layers)) == len(
        [i for i in range(layers) if i not in only and (i + 1) % step == 0])


# -- inconsistent configs: each names the file and the field ---------------------------------


def _set(name, **changes):
    d = builtin_config(name)
    for key, value in changes.items():
        if value is _DELETE:
            del d[key]
        else:
            d[key] = value
    return d


_DELETE = object()

BAD = [
    # (case, config.json dict, key named, expected substring in message)
    ("missing hidden_size", lambda: _set("tiny-llama", hidden_size=_DELETE),
     "hidden_size", "missing key"),
    ("missing vocab_size", lambda: _set("tiny-qwen3", vocab_size=_DELETE),
     "vocab_size", "missing key"),
    ("heads do not divide hidden", lambda: _set("tiny-llama", head_dim=_DELETE,
                                                num_attention_heads=3, num_key_value_heads=1),
     "head_dim", "do not divide hidden_size"),
    ("kv heads do not divide heads", lambda: _set("tiny-qwen3", num_key_value_heads=3),
     "num_key_value_heads", "expected a divisor of 4, found 3"),
    ("zero hidden", lambda: _set("tiny-llama", hidden_size=0), "hidden_size", "found 0"),
    ("negative vocab", lambda: _set("tiny-llama", vocab_size=-5), "vocab_size", "found -5"),
    ("zero layers", lambda: _set("tiny-qwen3", num_hidden_layers=0), "num_hidden_layers",
     "must be positive"),
    ("zero head_dim", lambda: _set("tiny-qwen3", head_dim=0), "head_dim", "must be positive"),
    ("odd head_dim", lambda: _set("tiny-qwen3", head_dim=15), "head_dim", "even"),
    ("string size", lambda: _set("tiny-llama", intermediate_size="128"), "intermediate_size",
     "wrong type"),
    ("bool size", lambda: _set("tiny-llama", num_hidden_layers=True), "num_hidden_layers",
     "wrong type"),
    ("unknown model_type", lambda: _set("tiny-qwen3", model_type="qwen2"), "model_type",
     "did you mean 'qwen3'?"),
    ("unknown architecture class", lambda: _set("tiny-llama", model_type=_DELETE,
                                                architectures=["LlamaForCausalLMM"]),
     "architectures", "did you mean 'LlamaForCausalLM'?"),
    ("no architecture at all", lambda: _set("tiny-llama", model_type=_DELETE,
                                            architectures=_DELETE),
     "model_type", "expected one of llama, qwen3, qwen3_moe"),
    ("class disagrees with model_type", lambda: _set("tiny-llama", model_type="qwen3"),
     "architectures", "disagrees"),
    ("unknown rope type", lambda: _set("tiny-llama", rope_scaling={"rope_type": "longrope",
                                                                   "factor": 4.0}),
     "rope_scaling.rope_type", "expected one of default, linear, llama3, yarn"),
    ("yarn mscale", lambda: _set("tiny-gpt-oss", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "mscale": 1.0}), "rope_scaling.mscale",
     "not supported"),
    ("gpt-oss experts per token", lambda: _set("tiny-gpt-oss", num_experts_per_tok=7),
     "num_experts_per_tok", "at most num_local_experts = 6"),
    ("gpt-oss layer types", lambda: _set("tiny-gpt-oss", layer_types=["sliding_attention"]),
     "layer_types", "one entry per layer"),
    ("swiglu limit", lambda: _set("tiny-gpt-oss", swiglu_limit=0.0), "swiglu_limit",
     "must be positive"),
    ("unknown rope type, v5 spelling", lambda: _set(
        "tiny-llama", rope_scaling=_DELETE,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5}),
     "rope_parameters.rope_type", "unknown rope scaling type"),
    ("llama3 without factor", lambda: _set("tiny-llama", rope_scaling={
        "rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
     "rope_scaling.factor", "missing key"),
    ("llama3 bands inverted", lambda: _set("tiny-llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "rope_scaling.high_freq_factor", "must exceed low_freq_factor"),
    ("unknown rope key", lambda: _set("tiny-llama", rope_scaling={
        "rope_type": "linear", "factor": 2.0, "beta_fast": 32}),
     "rope_scaling.beta_fast", "unknown key"),
    ("rope theta disagreement", lambda: _set("tiny-qwen3", rope_parameters={
        "rope_type": "default", "rope_theta": 10.0}),
     "rope_parameters.rope_theta", "disagrees"),
    ("negative rope theta", lambda: _set("tiny-qwen3", rope_theta=-1.0), "rope_theta",
     "must be positive"),
    ("top_k above experts", lambda: _set("tiny-qwen3-moe", num_experts_per_tok=9),
     "num_experts_per_tok", "expected at most num_experts = 8, found 9"),
    ("missing experts", lambda: _set("tiny-qwen3-moe", num_experts=_DELETE),
     "num_experts", "missing key"),
    ("zero moe inter", lambda: _set("tiny-qwen3-moe", moe_intermediate_size=0),
     "moe_intermediate_size", "must be positive"),
    ("mlp_only_layers out of range", lambda: _set("tiny-qwen3-moe", mlp_only_layers=[2]),
     "mlp_only_layers", "out of range"),
    ("mlp bias", lambda: _set("tiny-llama", mlp_bias=True), "mlp_bias", "not supported"),
    ("activation", lambda: _set("tiny-llama", hidden_act="gelu"), "hidden_act",
     "found 'gelu'"),
    ("partial rotary", lambda: _set("tiny-llama", partial_rotary_factor=0.5),
     "partial_rotary_factor", "not supported"),
    ("sliding without window", lambda: _set("tiny-qwen3", use_sliding_window=True,
                                            sliding_window=None),
     "sliding_window", "positive size"),
    ("layer_types length", lambda: _set("tiny-qwen3", layer_types=["full_attention"]),
     "layer_types", "expected 2 entries, found 1"),
    ("unknown dtype", lambda: _set("tiny-qwen3", torch_dtype="bfloat17"), "torch_dtype",
     "unknown dtype"),
    ("eps zero", lambda: _set("tiny-llama", rms_norm_eps=0), "rms_norm_eps", "must be positive"),
]


@pytest.mark.parametrize("case,make,key,text", BAD, ids=[b[0] for b in BAD])
def test_inconsistent_config_names_file_and_field(tmp_path, case, make, key, text):
    path = write_config(tmp_path, make())
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    err = e.value
    assert not isinstance(err, ManyErrors), str(err)
    assert err.file == str(path)
    assert err.key == key
    assert text in str(err)
    assert str(err).startswith(f"{path}: {key}: ")


def test_every_violation_is_reported(tmp_path):
    path = write_config(tmp_path, _set("tiny-qwen3-moe", hidden_size=0, num_key_value_heads=3,
                                       num_experts_per_tok=9))
    with pytest.raises(ManyErrors) as e:
        ModelConfig.load(path)
    assert {x.key for x in e.value.errors} == {"hidden_size", "num_key_value_heads",
                                               "num_experts_per_tok"}
    assert all(x.file == str(path) for x in e.value.errors)


def test_not_an_object(tmp_path):
    path = write_config(tmp_path, [1, 2])
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert e.value.file == str(path) and "found list" in str(e.value)


@pytest.mark.parametrize("patch,key", [({"num_hidden_layers": 2**70}, "num_hidden_layers"),
                                       ({"mlp_only_layers": [0, ""]}, "mlp_only_layers")])
def test_absurd_values_found_by_fuzzing_are_config_errors(tmp_path, patch, key):
    data = builtin_config("tiny-qwen3-moe")
    data.update(patch)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as e:
        ModelConfig.load(path)
    assert str(path) in str(e.value) and key in str(e.value)
