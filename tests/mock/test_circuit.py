"""Model circuits: every built-in config builds a well-typed circuit with the expected ops."""

import time

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.diagram import Diagram
from metrale.lkb.dtype import BF16, E2M1, E4M3, F32, I32
from metrale.lkb.errors import ConfigError, PlanError
from metrale.plan.circuit import OPS, Circuit, circuit_for
from metrale.plan.config import ModelConfig
from metrale.plan.models import builtin_config, builtin_names

NAMES = builtin_names()
QUANTS = ("bf16", "fp8", "mxfp4", "nvfp4")


def _per_layer(config: ModelConfig, i: int) -> dict[str, int]:
    """The boxes layer ``i`` should hold."""
    out = {"rmsnorm": 2, "linear": 4, "view": 4, "rope": 1, "attention": 1, "add": 2}
    if config.arch in ("qwen3", "qwen3_moe"):
        out["qk_norm"] = 1
    if config.attention_bias:  # q, k, v and o
        out["bias"] = 4
    if config.is_moe_layer(i):
        out["moe"] = 1
    else:
        out["linear"] += 3
        out["swiglu"] = 1
    return out


def _expected_counts(config: ModelConfig) -> dict[str, int]:
    total = {"embed": 1, "rmsnorm": 1, "lm_head": 1}
    for i in range(config.num_hidden_layers):
        for op, n in _per_layer(config, i).items():
            total[op] = total.get(op, 0) + n
    return {op: total[op] for op in OPS if op in total}


def _layer_spans(c: Circuit) -> list[tuple[int, int]]:
    """Box index ranges of each layer: from its first rmsnorm to its second residual add."""
    spans, start, adds = [], 1, 0
    for j, box in enumerate(c.diagram.boxes[1:], start=1):
        if box.name == "add":
            adds += 1
            if adds == 2:
                spans.append((start, j + 1))
                start, adds = j + 1, 0
    return spans


@pytest.fixture(scope="module", params=[(n, m) for n in NAMES for m in ("decode", "prefill")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def built(request) -> Circuit:
    name, mode = request.param
    return circuit_for(name, mode=mode, rows=3)


def test_builds_well_typed(built: Circuit) -> None:
    d = built.diagram
    again = Diagram.flat(d.dom, d.cod, d.boxes, d.wiring, d.outputs)
    assert again == d
    assert len(built.input_names) == len(d.dom) and len(built.output_names) == len(d.cod)


def test_op_counts(built: Circuit) -> None:
    assert built.op_counts() == _expected_counts(built.config)
    assert len(_layer_spans(built)) == built.config.num_hidden_layers


def test_every_dim_binds(built: Circuit) -> None:
    sizes = built.sizes(max_ctx=32)
    d = built.diagram
    types = [*d.dom, *d.cod, *(t for b in d.boxes for t in (*b.dom, *b.cod))]
    for t in {*types}:
        assert all(isinstance(n, int) and n > 0 for n in t.bind(sizes).shape), t
    assert sizes["slots"] == (3 if built.mode == "decode" else 1)
    assert sizes["half"] * 2 == sizes["head_dim"]


def test_every_input_is_read(built: Circuit) -> None:
    read = {s for srcs in built.diagram.wiring for s in srcs}
    unread = [n for k, n in enumerate(built.input_names) if (-1, k) not in read]
    assert unread == []


def test_layers_share_boxes(built: Circuit) -> None:
    c, boxes = built.config, built.diagram.boxes
    spans = _layer_spans(built)
    first = {}
    for i, (a, b) in enumerate(spans):
        key = (c.is_moe_layer(i), c.layer_window(i))
        layer = boxes[a:b]
        if key in first:
            assert layer == first[key]
        first.setdefault(key, layer)
    assert all("layer" not in dict(b.params) for b in boxes)


def test_deterministic(built: Circuit) -> None:
    again = circuit_for(built.config, mode=built.mode, rows=built.rows)
    assert again == built and hash(again) == hash(built)
    assert again.input_names == built.input_names and again.diagram.boxes == built.diagram.boxes


def test_qk_norm_only_for_qwen3() -> None:
    assert "qk_norm" not in circuit_for("tiny-llama").op_counts()
    assert circuit_for("tiny-qwen3").op_counts()["qk_norm"] == 2
    assert "model.layers.0.self_attn.q_norm.weight" not in circuit_for("tiny-llama").input_names


def test_moe_only_where_config_says() -> None:
    base = ModelConfig.load("tiny-qwen3-moe").with_layers(6)
    cfg = attrs.evolve(base, decoder_sparse_step=2, mlp_only_layers=(3,))
    c = circuit_for(cfg)
    moe_layers = [i for i in range(6) if cfg.is_moe_layer(i)]
    assert moe_layers == [1, 5]
    spans = _layer_spans(c)
    has_moe = [any(b.name == "moe" for b in c.diagram.boxes[a:z]) for a, z in spans]
    assert [i for i, m in enumerate(has_moe) if m] == moe_layers
    assert "model.layers.1.mlp.experts.up_proj.weight" in c.input_names
    assert "model.layers.3.mlp.up_proj.weight" in c.input_names
    assert "model.layers.3.mlp.gate.weight" not in c.input_names
    (moe,) = {b for b in c.diagram.boxes if b.name == "moe"}
    assert dict(moe.params) == {"act": "bf16", "experts": 8, "top_k": cfg.num_experts_per_tok,
                                "renormalize": cfg.norm_topk_prob, "moe_inter": 32,
                                "weight": "bf16"}


def test_attention_params_and_windows() -> None:
    data = builtin_config("tiny-qwen3")
    data.update(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    cfg = ModelConfig.from_hf_dict(data, name="tiny-slide")
    assert [cfg.layer_window(i) for i in range(2)] == [None, 8]
    c = circuit_for(cfg)
    atts = [b for b in c.diagram.boxes if b.name == "attention"]
    assert [b.param("window") for b in atts] == [0, 8]
    p = dict(atts[0].params)
    assert (p["heads"], p["kv_heads"], p["head_dim"]) == (4, 2, 16)
    assert p["scale"] == 16 ** -0.5
    assert [str(t) for t in atts[0].cod] == [
        "bf16[rows,heads,head_dim]", "bf16[slots,max_ctx,kv_heads,head_dim]",
        "bf16[slots,max_ctx,kv_heads,head_dim]"]


def test_linear_roles_and_quant_types() -> None:
    formats = {"bf16": (BF16, ""), "fp8": (E4M3, "fp8"), "mxfp4": (E2M1, "mxfp4"),
               "nvfp4": (E2M1, "nvfp4")}
    for quant, (dtype, fmt) in formats.items():
        c = circuit_for("tiny-llama", quant)
        q = c.input_type("model.layers.0.self_attn.q_proj.weight")
        assert (q.shape, q.dtype, q.fmt) == (("q_dim", "hidden"), dtype, fmt)
        assert c.input_type("model.layers.0.input_layernorm.weight").dtype == BF16
        assert c.input_type("model.embed_tokens.weight").dtype == BF16
        assert c.input_type("lm_head.weight").dtype == BF16
        roles = [b.param("role") for b in c.diagram.boxes if b.name == "linear"][:7]
        assert roles == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"]
        assert {b.param("weight") for b in c.diagram.boxes if b.name == "linear"} == {quant}
    assert circuit_for("tiny-llama").output_type("logits").dtype == F32
    assert circuit_for("tiny-llama").input_type("tokens").dtype == I32


def test_rope_and_views() -> None:
    c = circuit_for("tiny-llama")
    (rope,) = {b for b in c.diagram.boxes if b.name == "rope"}
    assert rope.param("style") == "neox"
    assert str(rope.dom) == ("bf16[rows,heads,head_dim] @ bf16[rows,kv_heads,head_dim] @ "
                             "i32[rows] @ f32[max_pos,half] @ f32[max_pos,half]")
    views = {(b.param("src"), b.param("dst")) for b in c.diagram.boxes if b.name == "view"}
    assert views == {(("rows", "q_dim"), ("rows", "heads", "head_dim")),
                     (("rows", "kv_dim"), ("rows", "kv_heads", "head_dim")),
                     (("rows", "heads", "head_dim"), ("rows", "q_dim"))}


def test_tied_lm_head_reads_embedding() -> None:
    cfg = attrs.evolve(ModelConfig.load("tiny-llama"), tie_word_embeddings=True)
    c = circuit_for(cfg)
    assert "lm_head.weight" not in c.input_names
    k = c.input_names.index("model.embed_tokens.weight")
    j = [b.name for b in c.diagram.boxes].index("lm_head")
    assert c.diagram.wiring[j][1] == (-1, k) and c.diagram.wiring[0][1] == (-1, k)


def test_outputs_are_logits_and_caches() -> None:
    c = circuit_for("tiny-qwen3")
    assert c.output_names == ("logits", "kv.0.k", "kv.0.v", "kv.1.k", "kv.1.v")
    atts = [j for j, b in enumerate(c.diagram.boxes) if b.name == "attention"]
    assert c.diagram.outputs[1:] == ((atts[0], 1), (atts[0], 2), (atts[1], 1), (atts[1], 2))
    assert c.diagram.boxes[c.diagram.outputs[0][0]].name == "lm_head"


def test_modes_differ_as_circuits_not_wiring() -> None:
    d, p = circuit_for("tiny-llama", mode="decode", rows=4), circuit_for("tiny-llama",
                                                                         mode="prefill", rows=4)
    assert d != p and d.diagram == p.diagram
    assert circuit_for("tiny-llama", "fp8") != circuit_for("tiny-llama")


def test_str_summary() -> None:
    assert str(circuit_for("tiny-llama", "fp8", "prefill", 7)) == (
        "tiny-llama prefill rows=7 quant=fp8 act=bf16: 2 layers, 39 boxes, 30 inputs, 5 outputs")


@pytest.mark.parametrize("kwargs,key", [
    ({"quant": "int4"}, "quant"), ({"mode": "decoder"}, "mode"), ({"rows": 0}, "rows"),
    ({"rows": True}, "rows"), ({"act": "f16"}, "act")])
def test_bad_arguments_name_the_key(kwargs, key) -> None:
    with pytest.raises(ConfigError) as e:
        circuit_for("tiny-llama", **kwargs)
    assert e.value.key == key and "tiny-llama" in str(e.value)


def test_attention_bias_adds_a_bias_after_each_projection() -> None:
    cfg = attrs.evolve(ModelConfig.load("tiny-qwen3"), attention_bias=True)
    c = circuit_for(cfg)
    assert c.op_counts()["bias"] == 8
    assert str(c.input_type("model.layers.1.self_attn.o_proj.bias")) == "bf16[hidden]"
    after = [c.diagram.boxes[j + 1].name for j, b in enumerate(c.diagram.boxes)
             if b.name == "linear" and b.param("role") in ("q_proj", "k_proj", "v_proj",
                                                           "o_proj")]
    assert after == ["bias"] * 8


def test_gpt_oss_circuit_reads_sinks_and_biased_experts() -> None:
    c = circuit_for("tiny-gpt-oss", "mxfp4")
    attention = [b for b in c.diagram.boxes if b.name == "attention"]
    assert [b.param("window") for b in attention] == [8, 0]  # sliding, then full
    assert all(b.param("sinks") and str(b.dom.types[-1]) == "bf16[heads]" for b in attention)
    (moe,) = {b for b in c.diagram.boxes if b.name == "moe"}
    assert (moe.param("router"), moe.param("limit"), moe.param("alpha")) == (
        "topk_softmax", 7.0, 1.702)
    assert str(c.input_type("model.layers.0.mlp.experts.gate_up_proj")) == (
        "mxfp4[experts,moe_gate_up,hidden]")
    assert c.transposed == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
                            for p in ("gate_up_proj", "down_proj")}
    assert circuit_for("tiny-qwen3-moe").transposed == frozenset()


def test_unknown_names_suggest() -> None:
    c = circuit_for("tiny-llama")
    with pytest.raises(PlanError) as e:
        c.input_type("model.layers.0.self_attn.q_proj.weigth")
    assert e.value.suggestion == "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(PlanError):
        c.output_type("logit")
    with pytest.raises(PlanError):
        c.sizes(0)


@given(quant=st.sampled_from(QUANTS), mode=st.sampled_from(("decode", "prefill")),
       rows=st.integers(1, 4096), act=st.sampled_from(("bf16", "f32")),
       name=st.sampled_from(("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")))
def test_parameters_reach_types(quant, mode, rows, act, name) -> None:
    c = circuit_for(name, quant, mode, rows, act=act)
    sizes = c.sizes(max_ctx=128)
    assert c.input_type("tokens").bind(sizes).shape == (rows,)
    logits = c.output_type("logits").bind(sizes)
    assert logits.shape == (rows, c.config.vocab_size) and logits.dtype == F32
    cache = c.output_type("kv.1.v").bind(sizes)
    assert cache.shape == (rows if mode == "decode" else 1, 128, 2, 16)
    assert cache.dtype.name == act
    assert {b.param("act") for b in c.diagram.boxes} == {act}


def test_llama_70b_builds_fast() -> None:
    cfg = ModelConfig.load("llama-3.1-70b")
    best = min(_timed(lambda: circuit_for(cfg)) for _ in range(3))
    assert best < 0.2, f"building llama-3.1-70b took {best:.3f} s"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def test_modules_to_not_convert_keep_their_weights_bf16() -> None:
    """A checkpoint's quantization_config.modules_to_not_convert (fnmatch patterns over module
    names, or their parents) types those weights bf16 in a quantized circuit."""
    qc = {"quant_method": "mxfp4",
          "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.1.mlp.down_proj"]}
    cfg = attrs.evolve(ModelConfig.load("tiny-llama"), quantization_config=qc)
    c = circuit_for(cfg, "mxfp4")
    assert str(c.input_type("model.layers.0.self_attn.q_proj.weight")) == "bf16[q_dim,hidden]"
    assert c.input_type("model.layers.0.mlp.down_proj.weight").fmt == "mxfp4"
    assert c.input_type("model.layers.1.mlp.down_proj.weight").dtype == BF16
    assert c.input_type("model.layers.1.mlp.up_proj.weight").fmt == "mxfp4"
    assert circuit_for(attrs.evolve(cfg, quantization_config=None), "mxfp4").input_type(
        "model.layers.0.self_attn.q_proj.weight").fmt == "mxfp4"
