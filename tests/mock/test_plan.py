"""Plans: the acceptance shapes, determinism, reasons for declined fusions, printers, CLI."""

import json
import math
from collections import Counter

import pytest

from metrale.cli import main
from metrale.lkb.errors import ConfigError
from metrale.plan.plan import plan_for


@pytest.fixture(scope="module")
def qwen_sm90():
    return plan_for("qwen3-0.6b", "bf16", "sm_90", mode="decode", rows=1)


def test_qwen3_decode_has_7_kernels_per_layer(qwen_sm90):
    p = qwen_sm90
    per_layer = Counter(k.layer for k in p.launches if k.layer is not None)
    assert len(per_layer) == 28
    assert max(per_layer.values()) == 7
    layer = [k.family for k in p.layer_kernels(3)]
    assert layer == ["add_rmsnorm", "qkv", "qk_norm_rope_kv_append_attention", "linear",
                     "add_rmsnorm", "gate_up_swiglu", "linear"]
    assert p.exact and p.row_invariant


def test_floor_matches_the_published_bytes(qwen_sm90):
    # weights (tied table read once by lm_head) + a 1024-token bf16 KV cache: 1.31 GB, 0.30 ms
    assert 1.28e9 < qwen_sm90.bytes_moved < 1.36e9
    assert 0.29e-3 < qwen_sm90.floor_s < 0.32e-3
    assert qwen_sm90.device == "NVIDIA H200"


def test_llama_8b_floor():
    p = plan_for("llama-3.1-8b", "bf16", "sm_90")
    assert 14.8e9 < p.bytes_moved < 15.4e9  # 15.1 GB published
    assert max(Counter(k.layer for k in p.launches if k.layer is not None).values()) == 7


def test_moe_layers_are_planned():
    p = plan_for("qwen3-30b-a3b", "mxfp4", "sm_90")
    families = Counter(k.family for k in p.launches)
    assert families["softmax_topk"] == 48 and families["moe_gate_up_swiglu"] == 48
    # the combine folds into the next residual add and norm (moe_combine_add_rmsnorm)
    assert families["moe_down"] == 48 and families["moe_combine_add_rmsnorm"] == 48
    assert families["moe_combine"] == 0
    assert all(k.point.param("weight") == "mxfp4" for k in p.launches if k.family == "qkv")
    assert any(a.relation == "dequant_linear" for a in p.applied)


def test_planning_is_deterministic(qwen_sm90):
    again = plan_for("qwen3-0.6b", "bf16", "sm_90", mode="decode", rows=1)
    assert again == qwen_sm90
    assert json.dumps(again.to_json(), sort_keys=True) == json.dumps(qwen_sm90.to_json(),
                                                                      sort_keys=True)


def test_every_declined_match_has_a_reason(qwen_sm90):
    assert qwen_sm90.declined
    reasons = {d.relation: d.reason for d in qwen_sm90.declined}
    assert reasons["splitk_pairwise"] in ("bounded relation under the exact policy",) or \
        reasons["splitk_pairwise"].startswith("overlaps")
    assert reasons["linear_residual"].startswith("overlaps a higher-priority match")


def test_bounded_policy_applies_bounded_relations_and_carries_the_bound():
    p = plan_for("tiny-llama", "bf16", "host", policy="bounded")
    mma = {a.relation for a in p.applied if a.relation.startswith("mma_gemv_")}
    assert mma >= {"mma_gemv_qkv", "mma_gemv_gate_up_swiglu", "mma_gemv_lm_head"}, mma
    assert not p.exact and p.bound is not None and p.bound[0] > 0
    exact = plan_for("tiny-llama", "bf16", "host")
    assert exact.exact and not any(a.relation.startswith("mma_gemv_") for a in exact.applied)


def test_the_bounded_plan_runs_gemv_shaped_matmuls_on_tensor_cores_where_the_class_has_them(
        analytic):
    """sm_90 realizes the gemv_mma points with gemv_mma.cu; the cuda class (no mma.sync)
    realizes them with the CUDA-core GEMV, whose order is the exact point's."""
    for hw, entry in (("sm_90", "metrale_qkv_gemv_mma"), ("cuda", "metrale_qkv")):
        p = plan_for("tiny-llama", "fp8", hw, policy="bounded", rows=8, kernels_dir=analytic)
        qkv = [k for k in p.kernels if k.family == "qkv"]
        assert qkv and all(k.kernel.entry == entry for k in qkv), (hw, qkv[0].kernel.entry)


def test_a_kernel_any_bounded_relation_made_is_bounded_whatever_fused_it_after(analytic):
    """gpt-oss's qkv_bias: the bit-identical qkv_bias fuses qkv and its biases, then the
    bounded mma_gemv_qkv_bias moves it onto tensor cores; the experts take mma_gemv_moe_*. Under
    the exact policy the same fusions leave every kernel exact."""
    bounded = plan_for("gpt-oss-20b", "mxfp4", "sm_90", policy="bounded", kernels_dir=analytic)
    by_family = {k.family: k for k in bounded.kernels if k.layer == 0}
    for fam in ("qkv_bias", "linear_bias", "moe_gate_up_clamp", "moe_down_bias"):
        assert by_family[fam].numerics == "bounded", fam
        assert by_family[fam].point.param("shape") == "gemv_mma", fam
    assert "bias_add" not in by_family
    exact = plan_for("gpt-oss-20b", "mxfp4", "sm_90", kernels_dir=analytic)
    fams = {k.family: k for k in exact.kernels if k.layer == 0}
    assert {"qkv_bias", "linear_bias"} <= set(fams) and "bias_add" not in fams
    assert all(k.numerics == "exact" for k in exact.kernels)


def test_a_bit_identical_relation_bounded_on_the_class_states_no_bound():
    """fp8's prefill GEMM applies the row scale to the finished sum, an order of its own, so
    dequant_linear holds on sm_90 only up to a bound it never declared: the plan says so rather
    than printing a zero bound."""
    from metrale.plan.config import ModelConfig
    from metrale.plan.printers import plan_json, summary_lines
    from metrale.plan.search import alternatives, choose
    from metrale.realize.target import target

    # the GEMM-shaped plan, imposed: whether the search prefers it at these shapes is the
    # evidence's call, not this test's
    found = choose(ModelConfig.load("tiny-llama"), "fp8", "prefill", 512,
                   T=target("sm_90", policy="bounded"))
    gemm = next(a for a in alternatives(found) if a.shape == "gemm")
    p = plan_for("tiny-llama", "fp8", "sm_90", mode="prefill", rows=512, policy="bounded",
                 choice=gemm)
    assert any(a.relation == "dequant_linear" and a.numerics == "bounded" for a in p.applied)
    assert not p.exact and p.bound == (math.inf, math.inf)
    assert "per-kernel bound: not stated" in "\n".join(summary_lines(p))
    assert plan_json(p)["bound"] == {"stated": False, "rel": None, "abs_times_magnitude": None,
                                     "scope": "per kernel"}
    exact = plan_for("tiny-llama", "fp8", "sm_90", mode="prefill", rows=512)
    # under the exact policy the GEMM-shaped fusion is declined; the search may still take
    # the GEMV-shaped matmuls, where dequant_linear holds bit for bit
    assert exact.exact and all(a.numerics == "bit_identical" for a in exact.applied)
    assert not any(a.relation == "dequant_linear" and dict(a.fused.params)["shape"] == "gemm"
                   for a in exact.applied)


def test_unrealized_rhs_point_is_declined_with_why(tmp_path):
    import shutil

    from metrale.realize.hardware import default_kernels_dir
    root = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), root)
    for folder in ("cuda", "sm_90"):  # every table of the qkv family, GEMV and GEMM shaped
        toml = root / folder / "common" / "KERNELS.toml"
        text = toml.read_text()
        while "\n[kernel.qkv" in text:
            start = text.index("\n[kernel.qkv") + 1
            end = text.find("\n[kernel.", start + 1)
            text = text[:start] + (text[end + 1:] if end >= 0 else "")
        toml.write_text(text)
    p = plan_for("tiny-qwen3", "bf16", "sm_90", kernels_dir=root)
    why = [d.reason for d in p.declined if d.relation == "qkv_concat"]
    assert why and "not realized on sm_90" in why[0]
    assert not any(k.family == "qkv" for k in p.launches)


def test_fusion_off_plan_has_more_kernels():
    fused = plan_for("tiny-llama")
    plain = plan_for("tiny-llama", fuse=False)
    assert plain.kernel_count > fused.kernel_count and not plain.applied


def test_buffers_have_lifetimes_and_peak_is_below_naive(qwen_sm90):
    acts = [b for b in qwen_sm90.buffers if b.kind == "activation" and b.alias is None]
    assert acts and all(b.first <= b.last for b in acts)
    assert qwen_sm90.peak_bytes() < sum(b.nbytes for b in acts)
    caches = [b for b in qwen_sm90.buffers if b.kind == "cache"]
    assert len(caches) == 56


def test_text_printer_shows_totals(qwen_sm90):
    text = str(qwen_sm90)
    assert "floor on NVIDIA H200" in text and "7 per decoder layer" in text
    assert "qkv ⟵ qkv_concat" in text


def test_html_and_dot(qwen_sm90):
    html = qwen_sm90._repr_html_()
    assert html.count("<rect") < 40  # collapsed by layer: one layer drawn, not 28
    assert "collapsed" in html and "declined fusions" in html
    dot = qwen_sm90.to_dot()
    assert dot.startswith("digraph plan {") and "->" in dot


def test_small_plan_html_snapshot():
    p = plan_for("tiny-llama", "bf16", "host")
    html = p._repr_html_()
    assert html.startswith("<div><div>plan host/tiny-llama/bf16 decode rows=1 context=1024")
    assert html.count("<rect") == len([k for k in p.launches
                                       if k.layer in (None, 0)])


def test_diff_between_quants():
    d = plan_for("tiny-llama", "bf16", "sm_90").diff(plan_for("tiny-llama", "mxfp4", "sm_90"))
    text = str(d)
    assert "weight=bf16" in text and "weight=mxfp4" in text


def test_bad_policy_and_unknown_model():
    with pytest.raises(ConfigError, match="policy"):
        plan_for("tiny-llama", policy="loose")
    with pytest.raises(ConfigError, match="did you mean"):
        plan_for("qwen3-0.6")


def test_met_plan_cli(capsys):
    assert main(["plan", "qwen3-0.6b", "--quant", "bf16", "--hardware", "sm_90", "--mode",
                 "decode", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "floor on NVIDIA H200" in out and "0.305 ms" in out
    assert main(["plan", "tiny-qwen3", "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "metrale.plan/1" and doc["kernel_count"] > 0
    assert main(["plan", "tiny-qwen3", "--hardware", "sm_90", "--diff", "sm_80"]) == 0
    assert "vs" in capsys.readouterr().out
    assert main(["plan", "tiny-qwen3", "--why"]) == 0
    assert "declined" in capsys.readouterr().out


def test_met_relations_on_a_class(capsys):
    assert main(["relations", "--hardware", "sm_90", "--format", "json"]) == 0
    doc = {r["relation"]: r for r in json.loads(capsys.readouterr().out)}
    assert doc["add_rmsnorm"]["status"] == "bit_identical"
    assert doc["splitk_pairwise"]["status"] == "bounded"


def test_a_plan_says_when_it_gives_the_last_rows_logits_only():
    from metrale.plan.printers import plan_json, summary_lines

    last = plan_for("tiny-llama", "bf16", "host", mode="prefill", rows=40, logits="last")
    full = plan_for("tiny-llama", "bf16", "host", mode="prefill", rows=40)
    assert last.logits == "last" and full.logits == "all" and last != full
    assert summary_lines(last)[0].endswith("logits=last")
    assert "logits=" not in summary_lines(full)[0]
    assert plan_json(last)["logits"] == "last" and plan_json(full)["logits"] == "all"


def test_a_plan_whose_launch_the_class_cannot_serve_is_refused_naming_the_kernel():
    """sm_90's prefill attention takes whole k steps of 16 head-dim columns; a model with a head
    of 24 is refused when planned, not trapped on the device, and the generic cuda class plans
    it. The fused kv_append_attention is declined at those sizes, so the refusal names the
    attention kernel left unfused, which has the same limit."""
    import attrs

    from metrale.lkb.errors import LaunchError
    from metrale.plan.config import ModelConfig

    wide = attrs.evolve(ModelConfig.load("tiny-llama"), head_dim=24)
    with pytest.raises(LaunchError, match="cannot serve these sizes") as e:
        plan_for(wide, "bf16", "sm_90", mode="prefill", rows=40)
    assert e.value.key.startswith("kernel #") and "attention[act=bf16,mode=prefill" in e.value.key
    assert e.value.expected == "d % 16 == 0" and "d=24" in e.value.found
    assert plan_for(wide, "bf16", "cuda", mode="prefill", rows=40).kernel_count > 0
    assert plan_for(wide, "bf16", "sm_90", mode="decode", rows=1).kernel_count > 0


def test_a_relation_whose_kernel_cannot_serve_the_sizes_is_declined_and_the_plan_runs(analytic):
    """The tensor-core GEMV needs k a multiple of 32. At an intermediate size of 200, the
    bounded plan declines mma_gemv_linear for down_proj, saying why, and keeps a GEMV that
    serves it, where it used to refuse the whole plan; o_proj (k 64) still takes it."""
    import attrs

    from metrale.plan.config import ModelConfig

    odd = attrs.evolve(ModelConfig.load("tiny-llama"), intermediate_size=200)
    p = plan_for(odd, "bf16", "sm_90", mode="decode", rows=1, policy="bounded",
                 kernels_dir=analytic)
    why = {x.reason for x in p.declined if x.relation == "mma_gemv_linear"}
    assert "rhs kernel cannot serve these sizes: k % 32 == 0 does not hold (k=200)" in why
    shapes = [k.point.param("shape") for k in p.kernels if k.family == "linear"]
    assert shapes.count("gemv_mma") == 2 and shapes.count("gemv") == 2, shapes


def test_the_bounded_prefill_takes_the_online_attention_where_a_kernel_serves_it():
    """Under the bounded policy the prefill attention is the online softmax (relation
    online_prefill_attention): sm_90's on wgmma, sm_80's on mma.sync, the cuda class's plain
    one. The exact
    policy and decode keep their own attention. At a head dim past the tensor-core kernels' 128
    the relation is declined, saying why, and the two-pass kernel stays."""
    import attrs

    from metrale.plan.config import ModelConfig

    def attention(p):
        return [k for k in p.kernels if "attention" in k.family]

    for hw, entry in (("sm_90", "metrale_kv_append_attention_wgmma_online_prefill"),
                      ("sm_80", "metrale_kv_append_attention_online_prefill"),
                      ("cuda", "metrale_kv_append_attention_online")):
        p = plan_for("tiny-llama", "bf16", hw, mode="prefill", rows=40, policy="bounded")
        assert attention(p) and all(k.family == "kv_append_attention_online" and
                                    k.kernel.entry == entry for k in attention(p)), hw
        assert {a.numerics for a in p.applied if a.relation == "online_prefill_attention"} == \
            {"bounded"}
        assert not p.exact
    exact = plan_for("tiny-llama", "bf16", "sm_90", mode="prefill", rows=40)
    assert {k.family for k in attention(exact)} == {"kv_append_attention"}
    decode = plan_for("tiny-llama", "bf16", "sm_90", mode="decode", rows=1, policy="bounded")
    assert "kv_append_attention_online" not in {k.family for k in decode.kernels}
    wide = attrs.evolve(ModelConfig.load("tiny-llama"), head_dim=256)
    p = plan_for(wide, "bf16", "sm_90", mode="prefill", rows=40, policy="bounded")
    assert {k.family for k in attention(p)} == {"kv_append_attention"}
    why = {x.reason for x in p.declined if x.relation == "online_prefill_attention"}
    assert "rhs kernel cannot serve these sizes: d <= 128 does not hold (d=256)" in why, why


def test_the_plan_json_names_the_launches_after_a_kernel():
    """A kernel that is a chain of launches shows the entries after its own: decode attention's
    merge, and nothing for the rest."""
    from metrale.plan.printers import plan_json

    kernels = plan_json(plan_for("tiny-llama", "bf16", "sm_90", mode="decode", rows=1))["kernels"]
    then = {k["family"]: k["then"] for k in kernels if not k["view"]}
    assert then.pop("rope_kv_append_attention") == ["metrale_attention_decode_merge"]
    assert then and all(v == [] for v in then.values())


@pytest.mark.parametrize("model,entry", [("qwen3-0.6b", "metrale_linear_split"),
                                         ("llama-3.1-8b", "metrale_linear")])
def test_the_plan_json_names_the_entry_a_linear_launches_at_its_sizes(model, entry):
    """gemv.cu's linear launches its split entry (a block a column) where n <= 1024 and its own
    (a warp a column) above: the plan JSON's `entry` is the one made, with nothing after it.
    Qwen3-0.6B's o_proj and down_proj (n = 1024) split; Llama-3.1-8B's (n = 4096) do not."""
    from metrale.plan.printers import plan_json

    p = plan_for(model, "bf16", "sm_90", mode="decode", rows=1)
    linear = [k for k in plan_json(p)["kernels"] if k["family"] == "linear"]
    assert linear and all((k["entry"], k["then"]) == (entry, []) for k in linear), linear[:1]


@pytest.mark.parametrize("rows,combined", [(17, True), (2048, False)])
def test_the_plan_json_names_a_gemm_combine_only_where_the_plan_launches_it(rows, combined,
                                                                           analytic):
    """The launches after a kernel's own are the ones made at the plan's sizes: Llama-3.1-8B's
    bf16 prefill GEMMs at 17 rows are gemm_wgmma.cu's one-warpgroup blocks (gemm_tma.cu's own
    launch empty) splitting k over the grid, their combine launch after them; at 2048 the
    kernel's own launch (gemm_tma.cu's) does it all, and neither is launched."""
    from metrale.plan.printers import plan_json

    p = plan_for("llama-3.1-8b", "bf16", "sm_90", mode="prefill", rows=rows, kernels_dir=analytic)
    kernels = plan_json(p)["kernels"]
    qkv = [k for k in kernels if k["family"] == "qkv"]
    made = (["metrale_qkv_wgmma", "metrale_qkv_wgmma_combine"] if combined else
            ["metrale_qkv_tma"])
    assert qkv and all([k["entry"], *k["then"]] == made for k in qkv), qkv[:1]
    assert list([k.launched for k in p.launches if k.family == "qkv"][0]) == made


def test_a_plan_of_known_kernels_parses_no_formula_again():
    """Every launch binds its kernel's formulas and limits; they are parsed once per process,
    not once per launch (re-parsing them put Llama-3.1-70B's planning past its 0.5 s goal;
    ``benchmarks/bench_plan.py`` measures the goal itself)."""
    from metrale.realize.formula import _checked_tree, _split_limit

    plan_for("llama-3.1-8b", "bf16", "sm_90")
    before = _checked_tree.cache_info().misses, _split_limit.cache_info().misses
    plan_for("llama-3.1-70b", "bf16", "sm_90")  # the same kernels at other sizes
    assert (_checked_tree.cache_info().misses, _split_limit.cache_info().misses) == before
    assert _checked_tree.cache_info().hits > 1000


def test_launch_refusal_names_the_limit_or_the_shared_memory():
    """Why a kernel cannot be launched at a box's sizes, in words: the limit that fails, or
    the launch asking more shared memory than the class allows; nothing for one that can, or
    for a host callable."""
    import attrs

    from metrale.lkb.presentation import Presentation
    from metrale.plan.fuser import launch_refusal
    from metrale.realize.functor import realization

    P = Presentation.load()
    point = P.family("linear").point(act="bf16", weight="bf16", shape="gemv_mma", k_block=256,
                                     across="sequential")
    F = realization("sm_90", presentation=P)
    kernel, at = F.realize(point), {"rows": 1, "k": 4096, "n": 1024}
    assert launch_refusal(kernel, at, F.hw) == ""
    assert launch_refusal(kernel, {**at, "k": 200}, F.hw) == \
        "k % 32 == 0 does not hold (k=200)"
    small = attrs.evolve(F.hw, capabilities=attrs.evolve(F.hw.capabilities,
                                                         max_shared_mem_per_block=4096))
    assert launch_refusal(kernel, at, small) == \
        "metrale_linear_gemv_mma needs 8192 bytes of shared memory, sm_90 allows 4096"
    host = realization("host", presentation=P)
    assert launch_refusal(host.realize(point), at, host.hw) == ""


def test_a_step_is_held_to_the_floor_of_the_device_it_ran_on():
    """A plan costed for a peer device (an engine on an H100 under sm_90) holds its steps to
    that device's bandwidth; a device the class does not know falls back to the class's own."""
    # a model whose kernels the two devices' prices choose alike (tiny-llama's 1-row matmuls go
    # to the GEMM on an H100's records and to the GEMV on the H200's: other bytes)
    h100 = plan_for("qwen3-0.6b", "bf16", "sm_90", device="NVIDIA H100 80GB HBM3")
    own = plan_for("qwen3-0.6b", "bf16", "sm_90")
    other = plan_for("qwen3-0.6b", "bf16", "sm_90", device="a device sm_90 does not list")
    assert h100.bytes_moved == own.bytes_moved == other.bytes_moved > 0
    assert h100.cost_floor_s == pytest.approx(h100.bytes_moved / 3030e9)
    assert own.cost_floor_s == own.floor_s == pytest.approx(own.bytes_moved / 4300e9)
    assert other.cost_floor_s == other.floor_s
