"""gpt-oss's CUDA kernels on the host emulation (tests/host/simt) where their examples do not
reach: a clamp that binds and NaN through it, sinks that dominate or vanish, a window, router
ties. Outputs are poisoned before each launch (``run`` of test_kernels_emulated)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale.lkb.semantics import SEMANTICS
from tests.host import simt
from tests.host.test_kernels_emulated import P, run
from tests.kernel_cases import compare, inputs, kwargs, sizes_for

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")


def _point(family: str, **params):
    fam = P.family(family)
    want = {**({"act": "bf16"} if any(k == "act" for k, _ in fam.params) else {}), **params}
    return fam, next(p for p in fam.points
                     if all(p.as_dict().get(k) == v for k, v in want.items()))


def _check(build_dir, fam, point, sizes, host, device, attrs=None):
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **{**kwargs(fam, point),
                                                                 **(attrs or {})})
    got = run(build_dir, fam, point, sizes, device, attrs)
    compare(point, fam, ref, got)
    return ref, got


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_clamp_binds_and_nan_passes_through(build_dir, weight):
    """gate/up pre-activations ~ N(0, 12): most exceed the limit of 7 on one side or the other;
    one row of x carries a NaN, which the clamps must not drop (fminf would)."""
    import ml_dtypes

    from metrale.lkb.quant import QuantFormat

    fam, point = _point("moe_gate_up_clamp", weight=weight)
    sizes = sizes_for(fam, 3)
    host, device = inputs(fam, point, sizes, seed=7)
    w = host[2] * np.float32(12.0)
    if weight == "bf16":
        stored = w.astype(ml_dtypes.bfloat16)
        host[2], device["wgu"] = stored.astype(np.float32), (stored,)
    else:
        qt = QuantFormat.parse(weight).quantize(w)
        host[2], device["wgu"] = qt.dequantize().astype(np.float32), (qt.data, qt.scale,
                                                                       qt.global_scale)
    host[0][1, 5] = np.nan
    device["x"] = (host[0],)
    ref, _ = _check(build_dir, fam, point, sizes, host, device)
    h = ref[0].astype(np.float32)
    assert np.isnan(h[1]).all() and not np.isnan(h[[0, 2]]).any()
    # the clamp binds: up + 1 is at most 8 and g * sigma(g) at most 7, so |h| <= 56, and it is
    # reached in the bound's neighbourhood (an unclamped SwiGLU would pass 100)
    finite = np.abs(h[[0, 2]])
    assert finite.max() <= 56.0 and finite.max() > 40.0, finite.max()


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("sink_scale", [0.0, 6.0])
def test_attention_sink_with_strong_sinks_and_windows(build_dir, mode, window, sink_scale):
    """Sinks ~ N(0, 6) (some weigh more than every key) and a window of 5 positions; the fused
    kernel with its appends gives the same outputs and caches."""
    for family in ("attention_sink", "kv_append_attention_sink"):
        fam, point = _point(family, mode=mode)
        sizes = sizes_for(fam, 3)
        host, device = inputs(fam, point, sizes, seed=window * 10 + int(sink_scale))
        s = fam.inputs.index(next(p for p in fam.inputs if p.name == "sinks"))
        import ml_dtypes

        sinks = (np.random.default_rng(3).standard_normal(host[s].shape) * sink_scale
                 ).astype(ml_dtypes.bfloat16)
        host[s], device["sinks"] = sinks.astype(np.float32), (sinks,)
        _check(build_dir, fam, point, sizes, host, device, {"window": window})


def test_a_sink_of_minus_infinity_is_plain_attention_byte_for_byte(build_dir):
    """With every sink -inf the sink kernel's bytes are the attention kernel's (attention.cu,
    prefill point, the same split-KV order), as the semantics' law says."""
    import ml_dtypes

    fam, point = _point("attention_sink", mode="prefill")
    plain, plain_point = _point("attention", mode="prefill")
    sizes = sizes_for(fam, 3)
    host, device = inputs(fam, point, sizes, seed=5)
    sinks = np.full(host[5].shape, -np.inf, ml_dtypes.bfloat16)
    device["sinks"] = (sinks,)
    (got,) = run(build_dir, fam, point, sizes, device)
    (ref,) = run(build_dir, plain, plain_point, sizes_for(plain, 3),
                 {k: v for k, v in device.items() if k != "sinks"})
    assert not np.isnan(got.astype(np.float32)).any()
    assert got.tobytes() == ref.tobytes()


def test_router_ties_and_every_expert_chosen(build_dir):
    """Equal biased logits go to the lower id; top_k = e chooses every expert."""
    import ml_dtypes

    fam, point = _point("topk_softmax")
    sizes = {**sizes_for(fam, 4), "e": 8, "top_k": 8}
    logits = np.array([[1.0, 3.0, 3.0, 0.5, 3.0, -1.0, 2.0, 2.0]] * 4, np.float32)
    logits[1, 7] = 10.0
    bias = np.zeros(8, ml_dtypes.bfloat16)
    host = [logits, bias.astype(np.float32)]
    device = {"logits": (logits,), "bias": (bias,)}
    ref, got = _check(build_dir, fam, point, sizes, host, device, {"top_k": 8})
    assert ref[1][0].tolist() == [1, 2, 4, 6, 7, 0, 3, 5]
    assert got[1].tobytes() == ref[1].tobytes()


def test_the_fused_router_gives_the_two_launches_bytes_launch_after_launch(build_dir):
    """router_topk_softmax (a block an expert, the row's last block selecting) with 72 experts and
    gpt-oss's k of 2880 against lm_head then topk_softmax, each from its own kernel: the same ids
    and weights, byte for byte, ties and all (rows 1 and 2 repeat row 0's x, so their logits
    tie). Three launches in a row on one module, of 3, 2 and 3 rows: each selects right only if
    the one before left every row's arrival counter at zero."""
    fam, point = _point("router_topk_softmax")
    head, head_point = _point("lm_head", weight="bf16", shape="gemv", out="f32")
    topk, topk_point = _point("topk_softmax")
    for seed, rows in ((3, 3), (4, 2), (5, 3)):
        sizes = {"rows": rows, "k": 2880, "e": 72, "top_k": 4}
        host, device = inputs(fam, point, sizes, seed=seed)
        host[0][1:] = host[0][0]
        device["x"] = (host[0],)
        fused = run(build_dir, fam, point, sizes, device, {"top_k": 4})
        (logits,) = run(build_dir, head, head_point, {"rows": rows, "k": 2880, "n": 72},
                        {"x": device["x"], "w": device["w"]})
        two = run(build_dir, topk, topk_point, {"rows": rows, "e": 72, "top_k": 4},
                  {"logits": (logits,), "bias": device["bias"]}, {"top_k": 4})
        assert [a.tobytes() for a in fused] == [b.tobytes() for b in two], seed
        assert fused[1][1].tolist() == fused[1][0].tolist()
        ref = SEMANTICS[fam.semantics](*host, **{**kwargs(fam, point), "top_k": 4})
        compare(point, fam, ref, fused)


@pytest.mark.parametrize("quant", ["bf16", "mxfp4"])
def test_gpt_oss_sm90_plan_on_the_emulation_matches_the_host(build_dir, quant):
    """tiny-gpt-oss (seeded random weights) with its sm_90 plan, every kernel from its CUDA
    source on the emulation, against the host plan: a 24-token prefill (three windows; the
    tensor-core GEMMs) and decode steps, logits within the bf16 tolerance."""
    from metrale.plan.plan import plan_for
    from metrale.runtime.engine import Engine
    from metrale.runtime.host_backend import HostBackend

    families = {k.family for k in plan_for("tiny-gpt-oss", quant, "sm_90").kernels}
    assert families >= {"qkv_bias", "linear_bias", "rope_kv_append_attention_sink",
                        "moe_gate_up_clamp", "moe_down_bias", "moe_combine_add_rmsnorm"}, families
    # the router fused or as its GEMV then topk_softmax, as the evidence prices them (the fused
    # kernel against the two launches: the test above)
    assert families & {"router_topk_softmax", "topk_softmax"}, families
    prompt = [(37 * i + 11) % 251 for i in range(24)]
    with Engine.load("tiny-gpt-oss", hardware="sm_90", quant=quant, max_ctx=64,
                     backend=HostBackend(), loader=simt.plan_loader(build_dir)) as emu, \
            Engine.load("tiny-gpt-oss", hardware="host", quant=quant, max_ctx=64) as host:
        got, want = emu.prefill(prompt), host.prefill(prompt)
        for step in range(3):
            scale = float(np.abs(want).max())
            assert np.isfinite(got).all() and scale > 0.1
            err = float(np.abs(got - want).max())
            assert err <= 1.6e-2 * scale + 1e-5, (quant, step, err, scale)
            token = int(want[-1].argmax())
            got, want = emu.decode([token]), host.decode([token])


@pytest.mark.parametrize("style", ["neox", "interleaved"])
def test_rope_prologue_is_bit_identical_for_rows_of_one_sequence(build_dir, style):
    """Prefill rows of one sequence (one slot, consecutive positions) read each other's new k
    from the launch's inputs, rotated where read: the fused kernel's outputs and caches are the
    bytes of the rope kernel followed by kv_append_attention_sink's."""
    fused, point = _point("rope_kv_append_attention_sink", mode="prefill", style=style)
    sizes = {**sizes_for(fused, 6), "slots": 2, "max_ctx": 40, "max_pos": 40}
    _, device = inputs(fused, point, sizes, seed=17)
    device["slots"] = (np.ones(6, np.int32),)
    device["positions"] = (np.arange(10, 16, dtype=np.int32),)
    o, kc, vc = run(build_dir, fused, point, sizes, device, {"window": 4})
    rope_fam, rope_point = _point("rope", style=style)
    rs = {"rows": 6, "hq": sizes["hq"], "hkv": sizes["hkv"], "d": sizes["d"],
          "half": sizes["half"], "max_pos": 40}
    qr, kr = run(build_dir, rope_fam, rope_point, rs,
                 {n: device[n] for n in ("q", "k", "positions", "cos", "sin")})
    chain, chain_point = _point("kv_append_attention_sink", mode="prefill")
    o2, kc2, vc2 = run(build_dir, chain, chain_point, sizes,
                       {**{n: device[n] for n in ("v", "k_cache", "v_cache", "positions",
                                                  "slots", "sinks")}, "k": (kr,), "q": (qr,)},
                       {"window": 4})
    assert not np.isnan(o.astype(np.float32)).any()
    assert o.tobytes() == o2.tobytes() and kc.tobytes() == kc2.tobytes()
    assert vc.tobytes() == vc2.tobytes()
