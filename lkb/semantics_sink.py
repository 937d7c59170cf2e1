"""Reference semantics of attention with learned sinks and of the bias add (gpt-oss's attention).

They register into :data:`metrale.lkb.semantics.SEMANTICS`, under that module's conventions.

A *sink* is one learned logit per query head that joins the softmax's denominator and weighs no
value (transformers' ``GptOssAttention``: ``cat([scores, sinks])``, softmax, the sink's column
dropped). Here it is the first block of the split-KV merge of
:mod:`~metrale.lkb.semantics_attention`: the state starts at ``m = sink``, ``l = 1``,
``acc = 0`` and the key blocks merge into it left to right by the log-sum-exp rule, so the
sink costs no pass of its own and a row's bytes do not depend on the other rows.

Laws: a sink of ``-inf`` is plain ``attention``, byte for byte; the weights a row gives its
keys sum to ``1 - exp(sink - m) / l`` (less than one, the rest is the sink's).

>>> import numpy as np
>>> from metrale.lkb.semantics import example
>>> from metrale.lkb.semantics_attention import attention
>>> (q, kc, vc, pos, slots, sinks), p = example("attention_sink", rows=2)
>>> o, = attention_sink(q, kc, vc, pos, slots, np.full_like(sinks, -np.inf), **p)
>>> o.tobytes() == attention(q, kc, vc, pos, slots, **p)[0].tobytes()
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .semantics import (
    F32,
    Reduction,
    _ex_linear,
    _ex_qkv,
    _matvec_orders,
    _rand,
    _shape,
    act_dtype,
    linear,
    qkv,
    round_to,
    semantics,
)
from .semantics_attention import (
    _attention_params,
    _cache_args,
    _ex_kv,
    _kv_orders,
    _row_blocks,
    kv_append,
    rope,
    rope_tables,
)


def _sink_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _kv_orders(p.get("kv_block", 256), "the sink first, then log-sum-exp merge")


def _attend_sink(qf: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: np.ndarray,
                 slot: np.ndarray, sinks: np.ndarray, scale: float, window: int, kv_block: int,
                 dt: np.dtype) -> np.ndarray:
    """Split-KV attention of f32 ``qf`` [rows, hq, d] whose softmax starts from the sinks."""
    out = np.empty(qf.shape, dt)
    sc = np.float32(scale)
    rows, hq, d = qf.shape
    hkv = k_cache.shape[2]
    sink = sinks.astype(F32).reshape(hkv, hq // hkv)
    for r, qr, blocks in _row_blocks(qf, k_cache, v_cache, pos, slot, window, kv_block):
        m = sink.copy()
        l = np.ones_like(m)
        acc = np.zeros(qr.shape, F32)
        for kb, vb in blocks:
            s = np.matmul(qr, kb) * sc
            mb = s.max(axis=-1)
            e = np.exp(s - mb[..., None])
            lb = np.add.reduce(e, axis=-1)
            ab = np.matmul(e, vb)
            mn = np.maximum(m, mb)
            with np.errstate(invalid="ignore"):  # -inf - -inf: a sink of -inf and no keys
                a, b = np.exp(m - mn), np.exp(mb - mn)
            a = np.where(m == mn, np.float32(1), a)  # exp(0) even where m = mn = -inf
            l = l * a + lb * b
            acc = acc * a[..., None] + ab * b[..., None]
            m = mn
        out[r] = (acc / l[..., None]).reshape(qf.shape[1:]).astype(dt)
    return out


def _ex_attention_sink(rng, rows, act):
    e = _ex_kv(rng, rows, act)
    return (e["q"], e["k_cache"], e["v_cache"], e["positions"], e["slots"],
            _rand(rng, (4,), F32, 2.0)), {"scale": 0.25, "window": 0, "kv_block": 8, "act": act}


@semantics("attention_sink", rows=(0, 3, 4), orders=_sink_orders, example=_ex_attention_sink)
def attention_sink(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
                   positions: np.ndarray, slots: np.ndarray, sinks: np.ndarray, *, scale: float,
                   window: int = 0, kv_block: int = 256, act: str) -> tuple[np.ndarray]:
    """``attention`` whose softmax denominator also holds ``exp(sinks[h])`` for query head ``h``.

    ``sinks`` f32 [hq]; the rest as :func:`~metrale.lkb.semantics_attention.attention`
    (window, GQA, split-KV blocks). The sink is the merge's first state, ``m = sink``,
    ``l = 1``, ``acc = 0``.

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> kc[0, :, 0, 1] = [1.0, 3.0]
    >>> q = np.ones((1, 1, 2), np.float32)
    >>> pos, slot = np.array([1], np.int32), np.array([0], np.int32)
    >>> attention_sink(q, kc, kc, pos, slot, np.zeros(1, np.float32), scale=0.0, act="f32")[0]
    array([[[0.       , 1.3333334]]], dtype=float32)
    """
    fam, sizes = "attention_sink", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    pos, slot = _cache_args(fam, dt, None, None, k_cache, v_cache, positions, slots, sizes)
    _shape(fam, "sinks", sinks, ("hq",), sizes, (F32,))
    _attention_params(fam, sizes, scale, window, kv_block)
    return (_attend_sink(q.astype(F32), k_cache, v_cache, pos, slot, sinks, scale, window,
                         kv_block, dt),)


def _ex_bias_add(rng, rows, act):
    return (_rand(rng, (rows, 48), act), _rand(rng, (48,), F32)), {"act": act}


@semantics("bias_add", rows=(0,), example=_ex_bias_add)
def bias_add(x: np.ndarray, b: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """``round(f32 x + b)`` with the f32 bias ``b`` [n] added to every row of ``x`` [rows, n]
    (a projection's bias: transformers' bf16 ``F.linear`` rounds the product, then the sum).

    >>> bias_add(np.array([[1.0, 2.0]], np.float32), np.array([0.5, -2.0], np.float32),
    ...          act="f32")[0]
    array([[1.5, 0. ]], dtype=float32)
    """
    fam, sizes = "bias_add", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "n"), sizes, (dt,))
    _shape(fam, "b", b, ("n",), sizes, (F32,))
    return (round_to(x.astype(F32) + b[None, :], dt).astype(dt),)


def _ex_linear_bias(rng, rows, act):
    (x, w), p = _ex_linear(rng, rows, act)
    return (x, w, _rand(rng, (w.shape[0],), F32)), {k: v for k, v in p.items() if k != "out"}


@semantics("linear_bias", rows=(0,), orders=_matvec_orders, example=_ex_linear_bias)
def linear_bias(x: np.ndarray, w: np.ndarray, b: np.ndarray, *, k_block: int,
                across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``bias_add(linear(x, w), b)``: the product rounded to act, then the bias added and the
    sum rounded (transformers' bf16 ``F.linear`` with a bias), byte for byte the two calls.

    >>> x = np.ones((1, 2), np.float32)
    >>> linear_bias(x, np.ones((2, 2), np.float32), np.array([0.5, -1.0], np.float32),
    ...             k_block=2, act="f32")[0]
    array([[2.5, 1. ]], dtype=float32)
    """
    (y,) = linear(x, w, k_block=k_block, across=across, act=act)
    return bias_add(y, b, act=act)


def _ex_qkv_bias(rng, rows, act):
    (x, wq, wk, wv), p = _ex_qkv(rng, rows, act)
    return (x, wq, wk, wv, *(_rand(rng, (w.shape[0],), F32) for w in (wq, wk, wv))), p


@semantics("qkv_bias", orders=_matvec_orders, example=_ex_qkv_bias)
def qkv_bias(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, bq: np.ndarray,
             bk: np.ndarray, bv: np.ndarray, *, k_block: int, across: str = "sequential",
             act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q, k and v projections of ``x`` each with its bias (gpt-oss): :func:`qkv`, then
    :func:`bias_add` on each, byte for byte.

    >>> x = np.ones((1, 2), np.float32)
    >>> ws = [np.full((1, 2), v, np.float32) for v in (1, 2, 3)]
    >>> bs = [np.full(1, v, np.float32) for v in (0.5, 0.0, -6.0)]
    >>> [a.tolist() for a in qkv_bias(x, *ws, *bs, k_block=2, act="f32")]
    [[[2.5]], [[4.0]], [[0.0]]]
    """
    ys = qkv(x, wq, wk, wv, k_block=k_block, across=across, act=act)
    return tuple(bias_add(y, b, act=act)[0] for y, b in zip(ys, (bq, bk, bv), strict=True))


def _ex_kv_append_attention_sink(rng, rows, act):
    (q, kc, vc, pos, slots, sinks), p = _ex_attention_sink(rng, rows, act)
    e = _ex_kv(rng, rows, act)
    return (e["k"], e["v"], q, kc, vc, pos, slots, sinks), p


@semantics("kv_append_attention_sink", rows=(0, 1, 2, 5, 6), row_outputs=(0,),
           orders=_sink_orders, example=_ex_kv_append_attention_sink)
def kv_append_attention_sink(k: np.ndarray, v: np.ndarray, q: np.ndarray, k_cache: np.ndarray,
                             v_cache: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                             sinks: np.ndarray, *, scale: float, window: int = 0,
                             kv_block: int = 256,
                             act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``kv_append`` (in place) then ``attention_sink``: returns ``(o, k_cache, v_cache)``,
    byte-identical to the two in turn (the relation ``kv_append_attention_sink``); every check
    runs before the caches are touched.

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> x = np.ones((1, 1, 2), np.float32)
    >>> o, kc2, _ = kv_append_attention_sink(x, 2 * x, x, kc, kc.copy(), np.array([0], np.int32),
    ...                                      np.array([0], np.int32), np.zeros(1, np.float32),
    ...                                      scale=0.0, act="f32")
    >>> o.tolist(), kc2 is kc  # the sink weighs as much as the one key, and no value
    ([[[1.0, 1.0]]], True)
    """
    fam, sizes = "kv_append_attention_sink", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    _cache_args(fam, dt, k, v, k_cache, v_cache, positions, slots, sizes)
    _shape(fam, "sinks", sinks, ("hq",), sizes, (F32,))
    _attention_params(fam, sizes, scale, window, kv_block)
    kv_append(k, v, k_cache, v_cache, positions, slots, act=act)
    (o,) = attention_sink(q, k_cache, v_cache, positions, slots, sinks, scale=scale,
                          window=window, kv_block=kv_block, act=act)
    return o, k_cache, v_cache


def _ex_rope_kv_append_attention_sink(rng, rows, act):
    (k, v, q, kc, vc, pos, slots, sinks), p = _ex_kv_append_attention_sink(rng, rows, act)
    cos, sin = rope_tables(kc.shape[1], q.shape[-1])
    return (q, k, v, kc, vc, pos, slots, cos, sin, sinks), {**p, "style": "neox"}


@semantics("rope_kv_append_attention_sink", rows=(0, 1, 2, 5, 6), row_outputs=(0,),
           orders=_sink_orders, example=_ex_rope_kv_append_attention_sink)
def rope_kv_append_attention_sink(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
        positions: np.ndarray, slots: np.ndarray, cos: np.ndarray, sin: np.ndarray,
        sinks: np.ndarray, *, scale: float, window: int = 0, kv_block: int = 256,
        style: str = "neox", act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rope`` then ``kv_append_attention_sink``: the rotated k is appended (in place), the
    rotated q attends; byte-identical to the two in turn (the relation rope_attention_sink).

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> x = np.ones((1, 1, 2), np.float32)
    >>> cos, sin = np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32)
    >>> o, kc2, _ = rope_kv_append_attention_sink(
    ...     x, x, 2 * x, kc, kc.copy(), np.array([1], np.int32), np.array([0], np.int32), cos,
    ...     sin, np.full(1, -np.inf, np.float32), scale=1.0, act="f32")
    >>> kc2[0, 1].tolist()  # (1, 1) turned a quarter
    [[-1.0, 1.0]]
    >>> round(float(o[0, 0, 0]), 4)  # scores 0 (the empty entry 0) and 2: 2 e² / (1 + e²)
    1.7616
    """
    qr, kr = rope(q, k, positions, cos, sin, style=style, act=act)
    return kv_append_attention_sink(kr, v, qr, k_cache, v_cache, positions, slots, sinks,
                                    scale=scale, window=window, kv_block=kv_block, act=act)
