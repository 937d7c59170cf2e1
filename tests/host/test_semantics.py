"""The reference semantics: fused families are their compositions byte for byte, every family is
row-invariant, the declared reduction orders are the ones computed, and the KV cache and
attention read and write exactly what they say."""

from __future__ import annotations

import unittest.mock

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb import semantics as S
from metrale.lkb.errors import ConfigError, LaunchError
from metrale.lkb.semantics import (
    BF16,
    F32,
    SEMANTICS,
    Reduction,
    SemanticsError,
    add,
    add_rmsnorm,
    blocked_matvec,
    blocked_sum,
    combine,
    describe,
    gate_up_swiglu,
    linear,
    linear_add,
    qkv,
    reduction_orders,
    rmsnorm,
    swiglu,
)
from metrale.lkb.semantics_attention import (
    attention,
    kv_append,
    kv_append_attention,
    qk_norm,
    qk_norm_rope,
    qk_norm_rope_kv_append_attention,
    rope,
    rope_kv_append_attention,
    rope_tables,
)
from metrale.lkb.semantics_moe import (
    moe_combine,
    moe_down,
    moe_gate_up_swiglu,
    softmax,
    softmax_topk,
    topk,
)

ACTS = ("bf16", "f32")
U32 = 2.0**-24  # unit roundoff of f32


def rand(rng, shape, dt=F32, scale=1.0):
    dt = S.ACT_DTYPES[dt] if isinstance(dt, str) else dt
    return (rng.standard_normal(shape) * scale).astype(F32).astype(dt)


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-identical: same dtype, shape and bytes."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def copies(args):
    return tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)


def nonzero_finite(*arrays):
    """The comparison was not made on zeros: finite, and zeros only where rounding cancels
    (a sum of two bf16 values can round to exactly 0; a handful in a small tensor is fine)."""
    for a in arrays:
        f = a.astype(np.float64)
        assert np.isfinite(f).all()
        assert np.count_nonzero(f) >= f.size - max(1, f.size // 10)


# ---------------------------------------------------------------------------------------------
# Registry, examples, orders.


def test_every_family_is_registered_with_example_and_orders():
    expected = {
        "embedding", "add", "rmsnorm", "add_rmsnorm", "linear", "linear_add", "qkv", "swiglu",
        "gate_up_swiglu", "qk_norm", "rope", "qk_norm_rope", "kv_append", "attention",
        "kv_append_attention", "rope_kv_append_attention", "qk_norm_rope_kv_append_attention",
        "softmax", "topk", "softmax_topk", "moe_gate_up_swiglu", "moe_down", "moe_combine",
        "argmax",
    }
    assert expected <= set(SEMANTICS)
    # every family but the row selection is row-invariant
    assert {name for name in SEMANTICS if not S.ROW_INVARIANT[name]} == {"last_row"}
    for name in SEMANTICS:
        _, params = S.example(name)
        for r in reduction_orders(name, **params):
            assert isinstance(r, Reduction)
            assert describe(r).startswith(r.axis)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("name", sorted(SEMANTICS))
def test_example_runs_returns_a_tuple_and_mutates_no_input(name, act):
    args, params = S.example(name, rows=4, act=act, seed=1)
    before = copies(args)
    out = SEMANTICS[name](*args, **params)
    assert isinstance(out, tuple) and out
    in_place = {id(a) for a in out}
    for a, b in zip(args, before):
        if id(a) not in in_place:  # only the KV caches are written, and they are returned
            assert same(a, b), f"{name} mutated an input"
    dt = S.ACT_DTYPES[act]
    for o in out:
        assert o.dtype in (dt, F32, np.int32)
        assert np.isfinite(o.astype(np.float64)).all()


def test_describe_and_orders_are_pinned():
    (r,) = reduction_orders("linear", k_block=256)
    assert describe(r) == (
        "k (x·w): f32, blocks of 256, partial sums combined sequentially; "
        "within a block: BLAS sgemv order"
    )
    (r,) = reduction_orders("gate_up_swiglu", k_block=64, across="pairwise")
    assert r == Reduction("k", "f32", 64, "pairwise", within="gemv", of="x·w")
    assert "combined pairwise" in describe(r)
    qk, den, pv = reduction_orders("kv_append_attention", kv_block=128)
    assert (qk.block, den.block, pv.block) == (0, 128, 128)
    assert (den.within, pv.within) == ("pairwise", "gemm")
    assert reduction_orders("softmax_topk", top_k=2, renormalize=False)[0].axis == "experts"
    assert len(reduction_orders("softmax_topk", top_k=2, renormalize=True)) == 2
    assert reduction_orders("add") == ()


def test_orders_errors_name_the_family_and_parameter():
    with pytest.raises(ConfigError, match="did you mean 'linear'"):
        reduction_orders("linaer", k_block=8)
    with pytest.raises(ConfigError, match=r"rmsnorm\.h_block: missing parameter"):
        reduction_orders("rmsnorm", eps=1e-6)
    with pytest.raises(ConfigError, match="Reduction.across"):
        Reduction("k", "f32", 8, "backwards")
    with pytest.raises(ConfigError, match="Reduction.within"):
        Reduction("k", "f32", 8, "sequential", within="gemvv")
    with pytest.raises(ConfigError, match="Reduction.block"):
        Reduction("k", "f32", -1, "sequential")


# ---------------------------------------------------------------------------------------------
# Fused families are their compositions, byte for byte.

acts = st.sampled_from(ACTS)
seeds = st.integers(0, 2**32 - 1)


@given(rows=st.integers(1, 6), h=st.integers(1, 200), h_block=st.integers(1, 80), act=acts,
       seed=seeds)
def test_add_rmsnorm_is_add_then_rmsnorm(rows, h, h_block, act, seed):
    rng = np.random.default_rng(seed)
    x, r, w = rand(rng, (rows, h), act), rand(rng, (rows, h), act), rand(rng, (h,))
    s, y = add_rmsnorm(x, r, w, eps=1e-6, h_block=h_block, act=act)
    (s2,) = add(x, r, act=act)
    (y2,) = rmsnorm(s2, w, eps=1e-6, h_block=h_block, act=act)
    assert same(s, s2) and same(y, y2)
    nonzero_finite(y)


@given(rows=st.integers(1, 5), k=st.integers(1, 160), n=st.integers(1, 40),
       k_block=st.integers(1, 70), across=st.sampled_from(S.ACROSS), act=acts, seed=seeds)
def test_linear_add_is_linear_then_add(rows, k, n, k_block, across, act, seed):
    rng = np.random.default_rng(seed)
    x, w, r = rand(rng, (rows, k), act), rand(rng, (n, k)), rand(rng, (rows, n), act)
    (y,) = linear_add(x, w, r, k_block=k_block, across=across, act=act)
    (lin,) = linear(x, w, k_block=k_block, across=across, act=act)
    assert same(y, add(lin, r, act=act)[0])
    nonzero_finite(y)


@given(rows=st.integers(1, 5), k=st.integers(1, 130), k_block=st.integers(1, 70), act=acts,
       seed=seeds)
def test_qkv_is_three_linears(rows, k, k_block, act, seed):
    rng = np.random.default_rng(seed)
    x = rand(rng, (rows, k), act)
    ws = [rand(rng, (n, k)) for n in (24, 8, 8)]
    out = qkv(x, *ws, k_block=k_block, act=act)
    for o, w in zip(out, ws):
        assert same(o, linear(x, w, k_block=k_block, act=act)[0])


@given(rows=st.integers(1, 5), k=st.integers(1, 130), inter=st.integers(1, 40),
       k_block=st.integers(1, 70), across=st.sampled_from(S.ACROSS), act=acts, seed=seeds)
def test_gate_up_swiglu_is_linear_linear_swiglu(rows, k, inter, k_block, across, act, seed):
    rng = np.random.default_rng(seed)
    x, wg, wu = rand(rng, (rows, k), act), rand(rng, (inter, k), F32, 0.3), rand(rng, (inter, k))
    (h,) = gate_up_swiglu(x, wg, wu, k_block=k_block, across=across, act=act)
    (g,) = linear(x, wg, k_block=k_block, across=across, act=act)
    (u,) = linear(x, wu, k_block=k_block, across=across, act=act)
    assert same(h, swiglu(g, u, act=act)[0])


@given(rows=st.integers(1, 5), heads=st.sampled_from([(2, 1), (4, 2), (6, 6)]),
       half=st.integers(1, 24), h_block=st.integers(1, 40),
       style=st.sampled_from(["neox", "interleaved"]), act=acts, seed=seeds)
def test_qk_norm_rope_is_qk_norm_then_rope(rows, heads, half, h_block, style, act, seed):
    rng = np.random.default_rng(seed)
    hq, hkv = heads
    d = 2 * half
    q, k = rand(rng, (rows, hq, d), act), rand(rng, (rows, hkv, d), act)
    wq, wk = rand(rng, (d,)), rand(rng, (d,))
    cos, sin = rope_tables(32, d, theta=10000.0)
    pos = rng.integers(0, 32, rows).astype(np.int32)
    p = dict(eps=1e-6, h_block=h_block, act=act)
    fq, fk = qk_norm_rope(q, k, wq, wk, pos, cos, sin, style=style, **p)
    nq, nk = qk_norm(q, k, wq, wk, **p)
    rq, rk = rope(nq, nk, pos, cos, sin, style=style, act=act)
    assert same(fq, rq) and same(fk, rk)


def test_qk_norm_is_rmsnorm_of_every_head():
    rng = np.random.default_rng(3)
    q, k = rand(rng, (3, 4, 32), "bf16"), rand(rng, (3, 2, 32), "bf16")
    wq, wk = rand(rng, (32,)), rand(rng, (32,))
    qn, kn = qk_norm(q, k, wq, wk, eps=1e-6, h_block=8, act="bf16")
    (qr,) = rmsnorm(q.reshape(12, 32), wq, eps=1e-6, h_block=8, act="bf16")
    (kr,) = rmsnorm(k.reshape(6, 32), wk, eps=1e-6, h_block=8, act="bf16")
    assert same(qn, qr.reshape(3, 4, 32)) and same(kn, kr.reshape(3, 2, 32))


def _decode_state(rng, rows, ctx, heads, d, act):
    """q, k, v for min(rows, ctx) rows and a random cache of 3 slots; the rows' positions are
    distinct, so no cache entry is written twice."""
    hq, hkv = heads
    rows = min(rows, ctx)
    kc, vc = rand(rng, (3, ctx, hkv, d), act), rand(rng, (3, ctx, hkv, d), act)
    slots = rng.integers(0, 3, rows).astype(np.int32)
    pos = rng.permutation(ctx)[:rows].astype(np.int32)
    k, v, q = rand(rng, (rows, hkv, d), act), rand(rng, (rows, hkv, d), act), rand(
        rng, (rows, hq, d), act)
    return q, k, v, kc, vc, pos, slots


@given(rows=st.integers(1, 6), ctx=st.integers(4, 70), kv_block=st.integers(1, 40),
       window=st.sampled_from([0, 1, 5, 17]), heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]),
       act=acts, seed=seeds)
def test_kv_append_attention_is_kv_append_then_attention(rows, ctx, kv_block, window, heads,
                                                         act, seed):
    rng = np.random.default_rng(seed)
    d = 8
    q, k, v, kc, vc, pos, slots = _decode_state(rng, rows, ctx, heads, d, act)
    p = dict(scale=d**-0.5, window=window, kv_block=kv_block, act=act)
    kc2, vc2 = kc.copy(), vc.copy()
    o, kc_out, vc_out = kv_append_attention(k, v, q, kc, vc, pos, slots, **p)
    assert kc_out is kc and vc_out is vc
    kv_append(k, v, kc2, vc2, pos, slots, act=act)
    (o2,) = attention(q, kc2, vc2, pos, slots, **p)
    assert same(o, o2) and same(kc, kc2) and same(vc, vc2)
    nonzero_finite(o)


@given(rows=st.integers(1, 4), ctx=st.integers(4, 40), kv_block=st.integers(1, 20),
       heads=st.sampled_from([(2, 1), (4, 2), (4, 4)]), norm=st.booleans(),
       style=st.sampled_from(["neox", "interleaved"]), act=acts, seed=seeds)
def test_rope_attention_is_rope_then_kv_append_attention(rows, ctx, kv_block, heads, norm, style,
                                                         act, seed):
    """The two prologue fusions (rope; qk_norm_rope) against their lhs, byte for byte: the
    output, and the rotated (normalized) k in the cache."""
    rng = np.random.default_rng(seed)
    d = 8
    q, k, v, kc, vc, pos, slots = _decode_state(rng, rows, ctx, heads, d, act)
    wq, wk = rand(rng, (d,)), rand(rng, (d,))
    cos, sin = rope_tables(ctx, d, theta=10000.0)
    p = dict(scale=d**-0.5, window=0, kv_block=kv_block, act=act)
    kc2, vc2 = kc.copy(), vc.copy()
    if norm:
        n = dict(eps=1e-6, h_block=4)
        o, kc_out, _ = qk_norm_rope_kv_append_attention(q, k, v, wq, wk, kc, vc, pos, slots,
                                                        cos, sin, style=style, **n, **p)
        qr, kr = qk_norm_rope(q, k, wq, wk, pos, cos, sin, style=style, act=act, **n)
    else:
        o, kc_out, _ = rope_kv_append_attention(q, k, v, kc, vc, pos, slots, cos, sin,
                                                style=style, **p)
        qr, kr = rope(q, k, pos, cos, sin, style=style, act=act)
    assert kc_out is kc
    o2, _, _ = kv_append_attention(kr, v, qr, kc2, vc2, pos, slots, **p)
    assert same(o, o2) and same(kc, kc2) and same(vc, vc2)
    nonzero_finite(o)


@given(rows=st.integers(1, 6), experts=st.integers(2, 12), top_k=st.integers(1, 4),
       renormalize=st.booleans(), seed=seeds, dtype=st.sampled_from([F32, BF16]))
def test_softmax_topk_is_softmax_then_topk(rows, experts, top_k, renormalize, seed, dtype):
    top_k = min(top_k, experts)
    rng = np.random.default_rng(seed)
    logits = rand(rng, (rows, experts), dtype, 2.0)
    w, ids = softmax_topk(logits, top_k=top_k, renormalize=renormalize)
    w2, ids2 = topk(softmax(logits)[0], top_k=top_k, renormalize=renormalize)
    assert same(w, w2) and same(ids, ids2)
    assert ids.dtype == np.int32 and (np.diff(w, axis=-1) <= 0).all()


@given(rows=st.integers(1, 5), k=st.integers(1, 100), k_block=st.integers(1, 50), act=acts,
       seed=seeds)
def test_moe_expert_matmuls_are_linears_with_the_expert_weights(rows, k, k_block, act, seed):
    rng = np.random.default_rng(seed)
    experts, top_k, inter, hidden = 5, 2, 12, 10
    x = rand(rng, (rows, k), act)
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(rows)]).astype(np.int32)
    wg, wu = rand(rng, (experts, inter, k), F32, 0.3), rand(rng, (experts, inter, k))
    wd = rand(rng, (experts, hidden, inter))
    (h,) = moe_gate_up_swiglu(x, ids, wg, wu, k_block=k_block, act=act)
    (y,) = moe_down(h, ids, wd, k_block=max(1, k_block // 3), act=act)
    for r in range(rows):
        for s in range(top_k):
            e = ids[r, s]
            (hr,) = gate_up_swiglu(x[r : r + 1], wg[e], wu[e], k_block=k_block, act=act)
            assert same(h[r, s], hr[0])
            (yr,) = linear(h[r, s][None], wd[e], k_block=max(1, k_block // 3), act=act)
            assert same(y[r, s], yr[0])


# ---------------------------------------------------------------------------------------------
# Row invariance: a row alone gives the bytes it gives inside a batch of 8.


def _row_invariance(name: str, act: str, seed: int, r: int) -> None:
    args, params = S.example(name, rows=8, act=act, seed=seed)
    row_args = S.ROW_ARGS[name]
    batch = SEMANTICS[name](*copies(args), **params)
    alone_args = tuple(a[r : r + 1] if i in row_args else a.copy() for i, a in enumerate(args))
    alone = SEMANTICS[name](*alone_args, **params)
    outs = S.ROW_OUTPUTS.get(name, tuple(range(len(batch))))
    for i in outs:
        assert same(batch[i][r : r + 1], alone[i]), f"{name} output {i} row {r}"
    if name in ("kv_append", "kv_append_attention"):
        slot, pos = args[-1][r], args[-2][r]  # the inputs end (..., positions, slots)
        first = 0 if name == "kv_append" else 1
        for i in (first, first + 1):  # the caches: row r's entry is the same either way
            assert same(batch[i][slot, pos], alone[i][slot, pos])
            assert same(batch[i][slot, pos], args[i - first][r])  # k[r], then v[r]


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("name", sorted(SEMANTICS))
def test_row_invariance_every_family(name, act):
    for seed, r in ((0, 3), (1, 0), (2, 7)):
        _row_invariance(name, act, seed, r)


@pytest.mark.parametrize("across", S.ACROSS)
def test_row_invariance_at_realistic_size(across):
    rng = np.random.default_rng(5)
    x, w = rand(rng, (8, 1024)), rand(rng, (1536, 1024))
    whole = blocked_matvec(x, w, 256, across)
    for r in range(8):
        assert same(whole[r : r + 1], blocked_matvec(x[r : r + 1], w, 256, across))
    h, w1 = rand(rng, (8, 1024)), rand(rng, (1024,))
    (y,) = rmsnorm(h, w1, eps=1e-6, h_block=256, act="f32")
    for r in range(8):
        assert same(y[r : r + 1], rmsnorm(h[r : r + 1], w1, eps=1e-6, h_block=256, act="f32")[0])


def test_row_invariance_attention_at_realistic_size():
    rng = np.random.default_rng(8)
    rows, hq, hkv, d, ctx = 4, 16, 8, 128, 700
    kc, vc = rand(rng, (rows, ctx, hkv, d), "bf16"), rand(rng, (rows, ctx, hkv, d), "bf16")
    q = rand(rng, (rows, hq, d), "bf16")
    pos = np.array([699, 3, 256, 511], np.int32)
    slots = np.arange(rows, dtype=np.int32)
    p = dict(scale=d**-0.5, kv_block=256, act="bf16")
    (o,) = attention(q, kc, vc, pos, slots, **p)
    for r in range(rows):
        (o1,) = attention(q[r : r + 1], kc, vc, pos[r : r + 1], slots[r : r + 1], **p)
        assert same(o[r : r + 1], o1)


# ---------------------------------------------------------------------------------------------
# The declared orders are the computed ones.


@given(rows=st.integers(1, 4), k=st.integers(1, 300), n=st.integers(1, 30),
       k_block=st.integers(1, 100), across=st.sampled_from(S.ACROSS), seed=seeds)
def test_blocked_matvec_follows_its_declared_blocks(rows, k, n, k_block, across, seed):
    rng = np.random.default_rng(seed)
    x, w = rand(rng, (rows, k)), rand(rng, (n, k))
    got = blocked_matvec(x, w, k_block, across)
    for r in range(rows):
        parts = [w[:, b : b + k_block] @ x[r, b : b + k_block] for b in range(0, k, k_block)]
        assert same(got[r], combine(parts, across))
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = k * U32 * (np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)) * 1.01
    assert (np.abs(got - exact) <= bound + 1e-30).all()


@given(rows=st.integers(1, 4), k=st.integers(1, 300), n=st.integers(1, 30),
       k_block=st.integers(1, 40), limit=st.integers(1, 400), seed=seeds)
def test_a_sequential_blocked_matvec_in_groups_gives_the_same_bytes(rows, k, n, k_block, limit,
                                                                     seed):
    """A sequential sum takes its block partials a group at a time (at most ``_PARTIALS``
    floats held), which adds them in the same order: the bytes do not depend on the groups."""
    rng = np.random.default_rng(seed)
    x, w = rand(rng, (rows, k)), rand(rng, (n, k))
    whole = blocked_matvec(x, w, k_block)
    with unittest.mock.patch.object(S, "_PARTIALS", limit):
        assert same(blocked_matvec(x, w, k_block), whole)


@given(h=st.integers(1, 400), block=st.integers(1, 150), seed=seeds)
def test_blocked_sum_follows_its_declared_blocks(h, block, seed):
    a = rand(np.random.default_rng(seed), (3, h))
    got = blocked_sum(a, block)
    for r in range(3):
        parts = [np.add.reduce(a[r, b : b + block]) for b in range(0, h, block)]
        assert same(got[r], combine(parts, "sequential"))


def test_combine_orders_differ_and_are_as_declared():
    p = [np.float32(v) for v in (1e8, 1.0, -1e8, 1.0, 3.0)]
    # f32 spacing at 1e8 is 8, so 1e8 + 1 == 1e8 and -1e8 + 1 == -1e8
    assert float(combine(p, "sequential")) == 4.0  # (((1e8 + 1) - 1e8) + 1) + 3
    assert float(combine(p, "pairwise")) == 3.0  # ((1e8 + 1) + (-1e8 + 1)) + 3


def test_changing_k_block_or_across_changes_bytes():
    rng = np.random.default_rng(11)
    x, w = rand(rng, (4, 1024), "bf16"), rand(rng, (512, 1024))
    y256, = linear(x, w, k_block=256, out="f32", act="bf16")
    y128, = linear(x, w, k_block=128, out="f32", act="bf16")
    y64p, = linear(x, w, k_block=64, across="pairwise", out="f32", act="bf16")
    y64s, = linear(x, w, k_block=64, across="sequential", out="f32", act="bf16")
    assert y256.tobytes() != y128.tobytes()
    assert y64p.tobytes() != y64s.tobytes()
    np.testing.assert_allclose(y256, y128, rtol=1e-4, atol=1e-4)  # same maths, other order


def test_changing_h_block_and_kv_block_changes_bytes():
    rng = np.random.default_rng(12)
    x, w = rand(rng, (16, 1024)), rand(rng, (1024,))
    a, = rmsnorm(x, w, eps=1e-6, h_block=256, act="f32")
    b, = rmsnorm(x, w, eps=1e-6, h_block=32, act="f32")
    assert a.tobytes() != b.tobytes()
    kc, vc = rand(rng, (1, 600, 2, 64)), rand(rng, (1, 600, 2, 64))
    q = rand(rng, (1, 4, 64))
    args = (q, kc, vc, np.array([599], np.int32), np.array([0], np.int32))
    o1, = attention(*args, scale=0.125, kv_block=256, act="f32")
    o2, = attention(*args, scale=0.125, kv_block=64, act="f32")
    assert o1.tobytes() != o2.tobytes()
    np.testing.assert_allclose(o1, o2, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# KV cache and attention: what is read and what is written.


@pytest.mark.parametrize("act", ACTS)
def test_kv_append_writes_exactly_the_addressed_entries(act):
    rng = np.random.default_rng(2)
    slots_n, ctx, hkv, d = 3, 10, 2, 4
    kc = np.full((slots_n, ctx, hkv, d), np.nan, np.float32).astype(S.ACT_DTYPES[act])
    vc = kc.copy()
    k, v = rand(rng, (4, hkv, d), act), rand(rng, (4, hkv, d), act)
    pos = np.array([0, 9, 4, 4], np.int32)
    slots = np.array([0, 0, 1, 2], np.int32)
    out = kv_append(k, v, kc, vc, pos, slots, act=act)
    assert out[0] is kc and out[1] is vc
    written = np.zeros((slots_n, ctx), bool)
    written[slots, pos] = True
    for r in range(4):
        assert same(kc[slots[r], pos[r]], k[r]) and same(vc[slots[r], pos[r]], v[r])
    assert np.isnan(kc[~written].astype(F32)).all() and np.isnan(vc[~written].astype(F32)).all()
    assert not np.isnan(kc[written].astype(F32)).any()


def test_kv_append_refuses_bad_indices_before_writing_anything():
    rng = np.random.default_rng(4)
    kc = np.full((2, 5, 1, 4), np.nan, np.float32)
    vc = kc.copy()
    k = rand(rng, (3, 1, 4))
    good = np.array([0, 1], np.int32)
    with pytest.raises(SemanticsError, match=r"kv_append\.positions\[2\]: position out of range "
                       r"\(expected 0 <= position < 5, found 5\)") as e:
        kv_append(k, k, kc, vc, np.array([0, 1, 5], np.int32), np.array([0, 0, 1], np.int32),
                  act="f32")
    assert isinstance(e.value, ValueError) and isinstance(e.value, LaunchError)
    assert np.isnan(kc).all() and np.isnan(vc).all()
    with pytest.raises(ValueError, match=r"positions\[1\].*found -1"):
        kv_append(k[:2], k[:2], kc, vc, np.array([0, -1], np.int32), good, act="f32")
    with pytest.raises(ValueError, match=r"slots\[0\]: slot out of range"):
        kv_append(k[:2], k[:2], kc, vc, good, np.array([2, 0], np.int32), act="f32")
    with pytest.raises(ValueError, match=r"two rows write one cache entry.*rows 0 and 2"):
        kv_append(k, k, kc, vc, np.array([3, 1, 3], np.int32), np.array([1, 0, 1], np.int32),
                  act="f32")
    with pytest.raises(ValueError, match=r"attention\.positions\[0\]"):
        attention(k[:1].repeat(2, 1), kc, vc, np.array([7], np.int32),
                  np.array([0], np.int32), scale=0.5, act="f32")
    with pytest.raises(SemanticsError, match=r"kv_append_attention\.positions\[0\]"):
        kv_append_attention(k[:1], k[:1], k[:1], kc, vc, np.array([5], np.int32),
                            np.array([0], np.int32), scale=0.5, act="f32")
    assert np.isnan(kc).all()


def _naive_attention(q, kc, vc, pos, slots, scale, window):
    """float64 attention with the GQA map written out head by head."""
    rows, hq, d = q.shape
    g = hq // kc.shape[2]
    out = np.zeros((rows, hq, d))
    for r in range(rows):
        lo = max(0, pos[r] - window + 1) if window else 0
        for h in range(hq):
            ks = kc[slots[r], lo : pos[r] + 1, h // g].astype(np.float64)
            vs = vc[slots[r], lo : pos[r] + 1, h // g].astype(np.float64)
            s = ks @ q[r, h].astype(np.float64) * scale
            p = np.exp(s - s.max())
            out[r, h] = p @ vs / p.sum()
    return out


@pytest.mark.parametrize("window", [0, 1, 7, 40])
def test_attention_reads_only_its_window_and_matches_a_naive_reference(window):
    rng = np.random.default_rng(window)
    rows, hq, hkv, d, ctx = 3, 6, 3, 16, 50
    kc, vc = rand(rng, (2, ctx, hkv, d)), rand(rng, (2, ctx, hkv, d))
    q = rand(rng, (rows, hq, d))
    pos, slots = np.array([49, 20, 3], np.int32), np.array([0, 1, 0], np.int32)
    p = dict(scale=0.25, window=window, kv_block=8, act="f32")
    (o,) = attention(q, kc, vc, pos, slots, **p)
    ref = _naive_attention(q, kc, vc, pos, slots, 0.25, window)
    np.testing.assert_allclose(o, ref, rtol=1e-5, atol=1e-6)
    for r in range(rows):
        # poison everything row r may not read; its output bytes must not move
        lo = max(0, pos[r] - window + 1) if window else 0
        pk, pv = kc.copy(), vc.copy()
        mask = np.ones((2, ctx), bool)
        mask[slots[r], lo : pos[r] + 1] = False
        pk[mask], pv[mask] = np.nan, np.nan
        (o_r,) = attention(q[r : r + 1], pk, pv, pos[r : r + 1], slots[r : r + 1], **p)
        assert same(o_r, o[r : r + 1])
    if window:
        (o_full,) = attention(q, kc, vc, pos, slots, **{**p, "window": 0})
        assert not np.allclose(o_full[0], o[0])  # the window really cuts row 0 (pos 49)


def test_attention_gqa_maps_query_head_h_to_kv_head_h_over_group():
    rng = np.random.default_rng(9)
    hq, hkv, d, ctx = 8, 2, 16, 12
    kc, vc = rand(rng, (1, ctx, hkv, d)), rand(rng, (1, ctx, hkv, d))
    q = np.repeat(rand(rng, (1, 1, d)), hq, axis=1)  # every query head the same
    args = (np.array([11], np.int32), np.array([0], np.int32))
    p = dict(scale=0.3, kv_block=5, act="f32")
    (o,) = attention(q, kc, vc, *args, **p)
    for h in range(hq):
        assert same(o[0, h], o[0, (h // 4) * 4])  # heads of one group read one kv head
    assert not np.allclose(o[0, 0], o[0, 4])
    (o_swapped,) = attention(q, kc[:, :, ::-1].copy(), vc[:, :, ::-1].copy(), *args, **p)
    assert same(o_swapped[0, :4], o[0, 4:]) and same(o_swapped[0, 4:], o[0, :4])
    np.testing.assert_allclose(o, _naive_attention(q, kc, vc, *args, 0.3, 0), rtol=1e-5,
                               atol=1e-6)


def test_attention_one_block_is_the_plain_softmax_in_the_declared_order():
    rng = np.random.default_rng(10)
    kc, vc = rand(rng, (1, 30, 2, 8)), rand(rng, (1, 30, 2, 8))
    q = rand(rng, (1, 4, 8))
    (o,) = attention(q, kc, vc, np.array([29], np.int32), np.array([0], np.int32), scale=0.5,
                     kv_block=64, act="f32")
    qr = q[0].reshape(2, 2, 8)
    s = np.matmul(qr, kc[0].transpose(1, 2, 0)) * np.float32(0.5)
    e = np.exp(s - s.max(-1)[..., None])
    ref = np.matmul(e, vc[0].transpose(1, 0, 2)) / np.add.reduce(e, axis=-1)[..., None]
    assert same(o[0], ref.reshape(4, 8).astype(F32))


# ---------------------------------------------------------------------------------------------
# Meanings of the elementwise and routing families.


def test_embedding_gathers_and_rounds_and_checks_ids():
    rng = np.random.default_rng(0)
    table = rand(rng, (20, 8))
    ids = np.array([3, 3, 19, 0], np.int32)
    (x,) = S.embedding(ids, table, act="bf16")
    assert same(x, table[ids].astype(BF16))
    (x32,) = S.embedding(ids, table.astype(BF16), act="f32")
    assert same(x32, table.astype(BF16)[ids].astype(F32))
    with pytest.raises(SemanticsError, match=r"embedding\.ids\[1\]: id out of range"):
        S.embedding(np.array([0, 20], np.int32), table, act="f32")


def test_bf16_roundings_follow_hugging_face():
    rng = np.random.default_rng(1)
    g, u = rand(rng, (2, 64), "bf16", 3.0), rand(rng, (2, 64), "bf16")
    (h,) = swiglu(g, u, act="bf16")
    gf = g.astype(F32)
    silu = (gf / (1 + np.exp(-gf))).astype(BF16).astype(F32)  # torch silu: bf16 in, bf16 out
    assert same(h, (silu * u.astype(F32)).astype(BF16))
    x, w = rand(rng, (2, 64), "bf16"), rand(rng, (64,)).astype(BF16).astype(F32)
    (y,) = rmsnorm(x, w, eps=1e-6, h_block=64, act="bf16")
    xf = x.astype(F32)
    var = np.add.reduce(xf * xf, axis=-1) / np.float32(64)
    normed = (xf * (np.float32(1) / np.sqrt(var + np.float32(1e-6)))[:, None]).astype(BF16)
    assert same(y, (w * normed.astype(F32)).astype(BF16))


def test_rope_interleaved_is_complex_rotation_of_pairs():
    rng = np.random.default_rng(2)
    cos, sin = rope_tables(16, 8, theta=10000.0)
    q, k = rand(rng, (2, 3, 8)), rand(rng, (2, 1, 8))
    pos = np.array([5, 11], np.int32)
    rq, _ = rope(q, k, pos, cos, sin, style="interleaved", act="f32")
    z = (q[..., 0::2] + 1j * q[..., 1::2]).astype(np.complex128)
    rot = z * (cos[pos] + 1j * sin[pos]).astype(np.complex128)[:, None]
    np.testing.assert_allclose(rq[..., 0::2], rot.real, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rq[..., 1::2], rot.imag, rtol=1e-6, atol=1e-6)
    nq, _ = rope(q, k, pos, cos, sin, style="neox", act="f32")
    assert not np.allclose(nq, rq)
    with pytest.raises(SemanticsError, match=r"rope\.positions\[1\]"):
        rope(q, k, np.array([0, 16], np.int32), cos, sin, act="f32")
    with pytest.raises(SemanticsError, match="did you mean"):
        rope(q, k, pos, cos, sin, style="neoxx", act="f32")


def test_topk_ties_go_to_the_lower_index_and_renormalize_sums_left_to_right():
    p = np.array([[0.2, 0.1, 0.2, 0.2, 0.3]], np.float32)
    w, ids = topk(p, top_k=3, renormalize=False)
    assert ids.tolist() == [[4, 0, 2]] and same(w, p[:, [4, 0, 2]])
    w, _ = topk(p, top_k=3, renormalize=True)
    total = (np.float32(0.3) + np.float32(0.2)) + np.float32(0.2)
    assert same(w, (p[:, [4, 0, 2]] / total).astype(F32))
    assert S.argmax(np.array([[1.0, 5.0, 5.0]], np.float32))[0].tolist() == [1]


def test_moe_combine_sums_in_slot_order_in_f32():
    rng = np.random.default_rng(3)
    y = rand(rng, (3, 4, 16), "bf16")
    w = rng.random((3, 4)).astype(F32)
    (out,) = moe_combine(y, w, act="bf16")
    yf = y.astype(F32)
    acc = w[:, 0, None] * yf[:, 0]
    for s in range(1, 4):
        acc = acc + w[:, s, None] * yf[:, s]
    assert same(out, acc.astype(BF16))
    ref = np.einsum("rs,rsh->rh", w.astype(np.float64), yf.astype(np.float64))
    np.testing.assert_allclose(out.astype(F32), ref, rtol=1.6e-2, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Errors name the family, the input, what was expected and what was found.


def test_bad_inputs_are_refused_with_where_and_what():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(SemanticsError, match=r"add\.a: bad dtype \(expected bfloat16, found float32\)"):
        add(x, x, act="bf16")
    with pytest.raises(SemanticsError, match=r"add\.act: unknown activation dtype.*did you mean 'bf16'"):
        add(x, x, act="bf61")
    with pytest.raises(SemanticsError, match=r"linear\.w: bad shape \(expected k = 8 in axis 1"):
        linear(x, np.ones((3, 9), np.float32), k_block=4, act="f32")
    with pytest.raises(SemanticsError, match=r"linear\.w: bad dtype"):
        linear(x, np.ones((3, 8), BF16), k_block=4, act="f32")
    with pytest.raises(SemanticsError, match=r"blocked_matvec\.k_block: bad parameter"):
        linear(x, np.ones((3, 8), np.float32), k_block=0, act="f32")
    with pytest.raises(SemanticsError, match=r"rmsnorm\.x: bad rank"):
        rmsnorm(x[0], np.ones(8, np.float32), eps=1e-6, h_block=4, act="f32")
    with pytest.raises(SemanticsError, match=r"attention\.q: query heads not a multiple"):
        attention(np.ones((1, 3, 4), np.float32), np.ones((1, 4, 2, 4), np.float32),
                  np.ones((1, 4, 2, 4), np.float32), np.array([1], np.int32),
                  np.array([0], np.int32), scale=1.0, act="f32")
    with pytest.raises(SemanticsError, match=r"moe_down\.ids\[0,1\]: expert id out of range"):
        moe_down(np.ones((1, 2, 4), np.float32), np.array([[0, 3]], np.int32),
                 np.ones((3, 5, 4), np.float32), k_block=2, act="f32")
    with pytest.raises(SemanticsError, match=r"topk\.top_k"):
        topk(np.ones((1, 3), np.float32), top_k=4, renormalize=False)
