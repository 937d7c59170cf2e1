"""The reference semantics against torch and Hugging Face transformers on the CPU.

f32 activations: rtol 1.3e-6 / atol 1e-5 where the two sides compute in the same order; where
the order differs the test derives a bound from the reduction lengths and states it. bf16
activations: rtol 1.6e-2 / atol 1e-5. Inputs are random normals (never zeros); the seeds are
fixed so that top-k ids, which a near tie could swap, are compared exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from metrale.lkb.semantics import (
    BF16,
    F32,
    linear,
    rmsnorm,
    swiglu,
)
from metrale.lkb.semantics_attention import attention, kv_append, rope, rope_tables
from metrale.lkb.semantics_moe import moe_combine, moe_down, moe_gate_up_swiglu, softmax_topk

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

U32 = 2.0**-24  # f32 unit roundoff
F32_TOL = dict(rtol=1.3e-6, atol=1e-5)
BF16_TOL = dict(rtol=1.6e-2, atol=1e-5)


def gamma(n: int) -> float:
    """Higham's gamma_n = n·u / (1 - n·u): the relative error bound of an n-term f32 sum."""
    return n * U32 / (1 - n * U32)


def rand(rng, shape, dt=F32, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(F32).astype(dt)


def t(a: np.ndarray) -> torch.Tensor:
    """A torch tensor holding ``a``'s values, in bf16 when ``a`` is bf16."""
    if a.dtype == BF16:
        return torch.from_numpy(a.astype(F32)).to(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(a))


def n(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().numpy()


def close(ours: np.ndarray, theirs: np.ndarray, **tol) -> None:
    assert np.isfinite(ours.astype(F32)).all()
    assert np.count_nonzero(theirs) > 0.9 * theirs.size  # never compare on zeros
    np.testing.assert_allclose(ours.astype(F32), theirs, **tol)


@pytest.fixture(autouse=True)
def _torch_seed():
    torch.manual_seed(0)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("h", [256, 1024])
@pytest.mark.parametrize("scale", [1.0, 1e-3])  # 1e-3: variance ~ eps, so eps matters
def test_rmsnorm_f32_vs_llama_rmsnorm(h, scale):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(h)
    x, w = rand(rng, (6, h), F32, scale), rand(rng, (h,))
    ref = LlamaRMSNorm(h, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(t(w))
        theirs = n(ref(t(x)))
    (ours,) = rmsnorm(x, w, eps=1e-6, h_block=128, act="f32")
    # The sum of squares runs in another order: each side is within gamma_h of the exact sum of
    # positive terms, so rsqrt differs by at most gamma_h relative; 4u more for the rsqrt, the
    # two products and the division by h.
    close(ours, theirs, rtol=gamma(h) + 4 * U32, atol=1e-5 * scale)


def test_rmsnorm_bf16_vs_llama_rmsnorm():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    rng = np.random.default_rng(1)
    x, w = rand(rng, (6, 512), BF16), rand(rng, (512,), BF16)
    ref = LlamaRMSNorm(512, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(t(w))
        theirs = n(ref(t(x)))
    (ours,) = rmsnorm(x, w.astype(F32), eps=1e-6, h_block=128, act="bf16")
    assert ours.dtype == BF16
    close(ours, theirs, **BF16_TOL)


def _hf_rope(q, k, cos_half, sin_half, pos, dtype):
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb

    cos = torch.from_numpy(np.concatenate([cos_half, cos_half], -1)[pos])[None].to(dtype)
    sin = torch.from_numpy(np.concatenate([sin_half, sin_half], -1)[pos])[None].to(dtype)
    # HF layout: (batch, heads, seq, d); ours: (rows = seq, heads, d)
    qe, ke = apply_rotary_pos_emb(t(q).transpose(0, 1)[None], t(k).transpose(0, 1)[None], cos,
                                  sin)
    return n(qe[0].transpose(0, 1)), n(ke[0].transpose(0, 1))


@pytest.mark.parametrize("act", ["f32", "bf16"])
def test_rope_neox_vs_hf_apply_rotary_pos_emb(act):
    rng = np.random.default_rng(2)
    dt = F32 if act == "f32" else BF16
    q, k = rand(rng, (9, 4, 64), dt), rand(rng, (9, 2, 64), dt)
    cos, sin = rope_tables(512, 64, theta=1e6)
    pos = rng.integers(0, 512, 9).astype(np.int32)
    qo, ko = rope(q, k, pos, cos, sin, style="neox", act=act)
    qt, kt = _hf_rope(q, k, cos, sin, pos, torch.float32 if act == "f32" else torch.bfloat16)
    tol = F32_TOL if act == "f32" else BF16_TOL
    close(qo, qt, **tol)
    close(ko, kt, **tol)
    # Stronger, and true on torch 2.13: the same elementwise ops and roundings in the same
    # order (tables rounded to act, each product and the sum rounded to act) give equal bytes.
    assert np.array_equal(qo.astype(F32), qt) and np.array_equal(ko.astype(F32), kt)


def _fill_cache(rng, dt, ctx, hkv, d):
    k, v = rand(rng, (ctx, hkv, d), dt), rand(rng, (ctx, hkv, d), dt)
    kc = np.full((1, ctx, hkv, d), np.nan, F32).astype(dt)
    vc = kc.copy()
    pos = np.arange(ctx, dtype=np.int32)
    kv_append(k, v, kc, vc, pos, np.zeros(ctx, np.int32), act="f32" if dt == F32 else "bf16")
    return k, v, kc, vc, pos


def _sdpa(q, k, v, mask=None, causal=False):
    """torch SDPA on (rows, h, d) arrays; GQA by repeat_interleave of the kv heads."""
    g = q.shape[1] // k.shape[1]
    qt = torch.from_numpy(q.astype(F32)).transpose(0, 1)[None]
    kt = torch.from_numpy(k.astype(F32)).transpose(0, 1)[None].repeat_interleave(g, dim=1)
    vt = torch.from_numpy(v.astype(F32)).transpose(0, 1)[None].repeat_interleave(g, dim=1)
    out = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask,
                                                           is_causal=causal)
    return n(out[0].transpose(0, 1))


def _attention_bound(q, k, v, scale, kv_block):
    """|ours - SDPA| bound: scores differ by at most 2·gamma_d·scale·sum|q||k| (each side within
    gamma_d of exact), exp by 4u, the denominators and value sums by 2·gamma_n (n keys) plus
    one merge rounding per block; the output is a convex combination of v, so the relative
    weight error times 2·max|v| bounds the absolute error."""
    d, ctx = q.shape[-1], k.shape[0]
    qk = np.abs(q.astype(np.float64)).sum(-1).max() * np.abs(k.astype(np.float64)).max()
    weights = 2 * gamma(d) * scale * qk + 4 * U32 + 2 * gamma(ctx) + 4 * U32 * (
        ctx // kv_block + 1)
    return 2 * weights * np.abs(v.astype(np.float64)).max()


@pytest.mark.parametrize("heads", [(8, 2), (4, 4)])
def test_attention_f32_prefill_vs_sdpa_causal_gqa(heads):
    rng = np.random.default_rng(3)
    hq, hkv = heads
    ctx, d = 300, 64
    k, v, kc, vc, pos = _fill_cache(rng, F32, ctx, hkv, d)
    q = rand(rng, (ctx, hq, d))
    scale = d**-0.5
    (ours,) = attention(q, kc, vc, pos, np.zeros(ctx, np.int32), scale=scale, kv_block=128,
                        act="f32")
    theirs = _sdpa(q, k, v, causal=True)
    close(ours, theirs, rtol=0, atol=_attention_bound(q, k, v, scale, 128))


def test_attention_f32_sliding_window_vs_sdpa_mask():
    rng = np.random.default_rng(4)
    hq, hkv, ctx, d, window = 4, 2, 80, 32, 16
    k, v, kc, vc, pos = _fill_cache(rng, F32, ctx, hkv, d)
    q = rand(rng, (ctx, hq, d))
    i, j = np.arange(ctx)[:, None], np.arange(ctx)[None, :]
    mask = torch.from_numpy((j <= i) & (j > i - window))
    (ours,) = attention(q, kc, vc, pos, np.zeros(ctx, np.int32), scale=d**-0.5, window=window,
                        kv_block=32, act="f32")
    theirs = _sdpa(q, k, v, mask=mask)
    close(ours, theirs, rtol=0, atol=_attention_bound(q, k[:window], v, d**-0.5, 32))


def test_attention_bf16_decode_vs_sdpa():
    rng = np.random.default_rng(5)
    hq, hkv, ctx, d = 16, 8, 700, 128
    k, v, kc, vc, pos = _fill_cache(rng, BF16, ctx, hkv, d)
    q = rand(rng, (1, hq, d), BF16)
    (ours,) = attention(q, kc, vc, pos[-1:], np.zeros(1, np.int32), scale=d**-0.5,
                        kv_block=256, act="bf16")
    assert ours.dtype == BF16
    close(ours, _sdpa(q, k, v), **BF16_TOL)


@pytest.mark.parametrize("act", ["f32", "bf16"])
def test_swiglu_vs_torch_silu_times_up(act):
    rng = np.random.default_rng(6)
    dt = F32 if act == "f32" else BF16
    g, u = rand(rng, (5, 300), dt, 4.0), rand(rng, (5, 300), dt)
    (ours,) = swiglu(g, u, act=act)
    theirs = n(torch.nn.functional.silu(t(g)) * t(u))
    # f32: exp within 2 ulp on each side, then +1, /, * one rounding each: 2·7u < 1.3e-6
    close(ours, theirs, **(F32_TOL if act == "f32" else BF16_TOL))


def test_linear_f32_vs_torch_linear():
    rng = np.random.default_rng(7)
    x, w = rand(rng, (4, 1024)), rand(rng, (384, 1024))
    (ours,) = linear(x, w, k_block=256, out="f32", act="f32")
    theirs = n(torch.nn.functional.linear(t(x), t(w)))
    # each side within gamma_k·sum|x||w| of the exact dot product
    bound = 2 * gamma(1024) * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64))
    assert (np.abs(ours - theirs) <= bound).all()
    close(ours, theirs, rtol=0, atol=float(bound.max()))


@pytest.mark.parametrize("renormalize", [False, True])
def test_softmax_topk_vs_torch_topk_of_softmax(renormalize):
    rng = np.random.default_rng(8)
    experts, top_k = 64, 8
    logits = rand(rng, (16, experts), F32, 2.0)
    w, ids = softmax_topk(logits, top_k=top_k, renormalize=renormalize)
    probs = torch.softmax(t(logits), dim=-1, dtype=torch.float32)
    tw, tids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        tw = tw / tw.sum(dim=-1, keepdim=True)
    assert np.array_equal(ids, tids.numpy().astype(np.int32))
    # the softmax denominators are E-term sums in other orders (gamma_E each side), exp 2u
    # each, one division; renormalizing adds two k-term sums and one division
    rtol = 2 * gamma(experts) + 6 * U32 + (2 * gamma(top_k) + 2 * U32 if renormalize else 0)
    close(w, n(tw), rtol=rtol, atol=0)


def test_moe_pipeline_f32_vs_hf_qwen3_moe_block():
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hidden, inter, experts, top_k, rows = 64, 32, 8, 2, 6
    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter,
                            num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(config).float()
    rng = np.random.default_rng(9)
    w_router = rand(rng, (experts, hidden), F32, hidden**-0.5)
    gate_up = rand(rng, (experts, 2 * inter, hidden), F32, hidden**-0.5)
    down = rand(rng, (experts, hidden, inter), F32, inter**-0.5)
    with torch.no_grad():
        block.gate.weight.copy_(t(w_router))
        block.experts.gate_up_proj.copy_(t(gate_up))
        block.experts.down_proj.copy_(t(down))
        x = rand(rng, (rows, hidden))
        theirs = n(block(t(x)[None]))[0]
    (logits,) = linear(x, w_router, k_block=32, out="f32", act="f32")
    weights, ids = softmax_topk(logits, top_k=top_k, renormalize=True)
    (h,) = moe_gate_up_swiglu(x, ids, np.ascontiguousarray(gate_up[:, :inter]),
                              np.ascontiguousarray(gate_up[:, inter:]), k_block=32, act="f32")
    (y,) = moe_down(h, ids, down, k_block=16, act="f32")
    (ours,) = moe_combine(y, weights, act="f32")
    # Same maths, other orders (k-sums of length 64 and 32, expert sum in expert order there,
    # slot order here): a few gamma_64 relative to the magnitudes, far inside the oracle's 1e-3.
    close(ours, theirs, rtol=1e-5, atol=1e-5)
