"""gpt-oss's reference semantics against transformers' own modules (``modeling_gpt_oss``) on
the CPU, and their laws as Hypothesis properties.

f32: rtol 1.3e-6 / atol 1e-5 where both sides take the same order; attention's sums differ in
order (split-KV merge against one softmax), bounded as test_semantics_vs_torch does. bf16: the
clamped SwiGLU rounds where transformers' bf16 ``_apply_gate`` does, within a bf16 ulp.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb.semantics import BF16, F32
from metrale.lkb.semantics_attention import attention
from metrale.lkb.semantics_moe_clamp import (
    clamped_swiglu,
    moe_down_bias,
    moe_gate_up_clamp,
    topk_softmax,
)
from metrale.lkb.semantics_sink import attention_sink, bias_add

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.gpt_oss import modeling_gpt_oss as hf  # noqa: E402

F32_TOL = dict(rtol=1.3e-6, atol=1e-5)


def _config(**kw):
    base = dict(hidden_size=64, intermediate_size=16, num_local_experts=5, num_experts_per_tok=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
                vocab_size=32)
    return transformers.GptOssConfig(**{**base, **kw})


def test_clamped_swiglu_is_transformers_apply_gate_in_f32_and_bf16():
    rng = np.random.default_rng(0)
    gate_up = (rng.standard_normal((64, 32)) * 9).astype(np.float32)  # |.| > 7 often
    gate_up[0, 0], gate_up[0, 1] = np.nan, 3.0
    experts = hf.GptOssExperts(_config())
    for dt, tdt in ((np.dtype(np.float32), torch.float32), (BF16, torch.bfloat16)):
        x = gate_up.astype(dt)
        theirs = experts._apply_gate(torch.from_numpy(x.astype(np.float32)).to(tdt))
        ours = clamped_swiglu(x[:, 0::2].astype(F32), x[:, 1::2].astype(F32), 7.0, 1.702, dt)
        theirs = theirs.float().numpy()
        assert np.isnan(ours[0, 0]) and np.isnan(theirs[0, 0])
        if dt == F32:
            np.testing.assert_allclose(ours, theirs, **F32_TOL)
        else:  # one bf16 ulp where torch's sigmoid and NumPy's exp round differently
            np.testing.assert_allclose(ours, theirs, rtol=2 ** -7, atol=1e-6)
            assert (ours == theirs)[1:].mean() > 0.95
    assert np.nanmax(np.abs(ours)) <= 56.0


def test_router_is_transformers_topk_router():
    rng = np.random.default_rng(1)
    router = hf.GptOssTopKRouter(_config())
    with torch.no_grad():
        router.weight.copy_(torch.randn(5, 64, generator=torch.Generator().manual_seed(2)))
        router.bias.copy_(torch.randn(5, generator=torch.Generator().manual_seed(3)))
    x = rng.standard_normal((7, 64)).astype(np.float32)
    logits, scores, ids = router(torch.from_numpy(x))
    no_bias = (torch.from_numpy(x) @ router.weight.detach().T).numpy()
    w, our_ids = topk_softmax(no_bias, router.bias.detach().numpy(), top_k=2)
    assert our_ids.tolist() == ids.tolist()
    np.testing.assert_allclose(w, scores.detach().numpy(), **F32_TOL)


def test_experts_are_transformers_gpt_oss_experts():
    """gate/up, clamp, down and their biases (HF's combine aside: moe_combine's own tests)."""
    cfg = _config()
    experts = hf.GptOssExperts(cfg)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
                  experts.down_proj_bias):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    ids = np.stack([rng.permutation(5)[:2] for _ in range(6)]).astype(np.int32)
    weights = np.full((6, 2), 0.5, np.float32)
    theirs = experts(torch.from_numpy(x), torch.from_numpy(ids.astype(np.int64)),
                     torch.from_numpy(weights)).detach().numpy()
    wgu = np.ascontiguousarray(experts.gate_up_proj.detach().numpy().transpose(0, 2, 1))
    wd = np.ascontiguousarray(experts.down_proj.detach().numpy().transpose(0, 2, 1))
    (h,) = moe_gate_up_clamp(x, ids, wgu, experts.gate_up_proj_bias.detach().numpy(),
                             k_block=32, act="f32", limit=7.0, alpha=1.702)
    assert (np.abs(h) > 20).any()  # the clamp's range is reached
    (y,) = moe_down_bias(h, ids, wd, experts.down_proj_bias.detach().numpy(), k_block=32,
                         act="f32")
    ours = (y * weights[..., None]).sum(1)
    scale = float(np.abs(y).max())
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * scale)


def test_sink_attention_is_transformers_eager_attention():
    """One sequence of 40 positions, q heads 4, kv heads 2, sinks N(0, 2); full and a window
    of 8: each row's output against HF's eager attention with its sinks and masks."""
    cfg = _config()
    rng = np.random.default_rng(6)
    n, hq, hkv, d = 40, 4, 2, 16
    q = rng.standard_normal((n, hq, d)).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    sinks = (rng.standard_normal(hq) * 2).astype(np.float32)
    kc, vc = k[None], v[None]
    pos = np.arange(n, dtype=np.int32)
    slots = np.zeros(n, np.int32)
    module = hf.GptOssAttention(cfg, 0)
    with torch.no_grad():
        module.sinks.copy_(torch.from_numpy(sinks))
    for window in (0, 8):
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        allowed = (j <= i) & ((j > i - window) if window else True)
        mask = torch.from_numpy(np.where(allowed, 0.0, -np.inf).astype(np.float32))[None, None]
        theirs, _ = hf.eager_attention_forward(
            module, torch.from_numpy(q.transpose(1, 0, 2))[None],
            torch.from_numpy(k.transpose(1, 0, 2))[None],
            torch.from_numpy(v.transpose(1, 0, 2))[None], mask, scaling=d ** -0.5)
        (ours,) = attention_sink(q, kc, vc, pos, slots, sinks, scale=d ** -0.5, window=window,
                                 kv_block=16, act="f32")
        np.testing.assert_allclose(ours, theirs[0].detach().numpy(), rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(1, 4), window=st.sampled_from([0, 3, 9]),
       kv_block=st.sampled_from([1, 4, 16]), act=st.sampled_from(["f32", "bf16"]))
def test_sink_laws(seed, rows, window, kv_block, act):
    """-inf sinks give attention's bytes; huge sinks take (almost) all the weight; a row's
    bytes do not depend on the other rows."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(np.float32) if act == "f32" else BF16
    hq, hkv, d, ctx = 4, 2, 8, 24
    q = rng.standard_normal((rows, hq, d)).astype(dt)
    kc = rng.standard_normal((rows, ctx, hkv, d)).astype(dt)
    vc = rng.standard_normal((rows, ctx, hkv, d)).astype(dt)
    pos = rng.integers(0, ctx, rows).astype(np.int32)
    slots = rng.permutation(rows).astype(np.int32)
    p = dict(scale=0.3, window=window, kv_block=kv_block, act=act)
    minus = np.full(hq, -np.inf, np.float32)
    (a,) = attention_sink(q, kc, vc, pos, slots, minus, **p)
    assert a.tobytes() == attention(q, kc, vc, pos, slots, **p)[0].tobytes()
    (big,) = attention_sink(q, kc, vc, pos, slots, np.full(hq, 80.0, np.float32), **p)
    assert np.abs(big.astype(np.float32)).max() < 1e-20
    sinks = rng.standard_normal(hq).astype(np.float32)
    (whole,) = attention_sink(q, kc, vc, pos, slots, sinks, **p)
    r = rows - 1
    (one,) = attention_sink(q[r:], kc, vc, pos[r:], slots[r:], sinks, **p)
    assert whole[r:].tobytes() == one.tobytes()


def test_bias_add_rounds_once():
    x = np.array([[1.0, 255.0]], BF16)
    b = np.array([2 ** -9, 0.5], np.float32)
    (y,) = bias_add(x, b, act="bf16")
    # 1 + 2^-9 rounds to 1 in bf16 (ties to even at 2^-8 spacing); 255.5 rounds to 256
    assert y.astype(np.float32).tolist() == [[1.0, 256.0]]
