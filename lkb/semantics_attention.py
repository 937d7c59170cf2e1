"""Reference semantics of the attention families: qk_norm, rope, the KV cache append, attention.

They register into :data:`metrale.lkb.semantics.SEMANTICS`, under that module's conventions.

Attention is split-KV: the positions a row attends to are cut at multiples of ``kv_block``
(absolute positions, so the cut does not depend on the window); each block gives
``(max m, sum l, acc)`` and the blocks merge left to right by the log-sum-exp rule
``m' = max(m, m_b)``, ``l' = l·exp(m - m') + l_b·exp(m_b - m')``,
``acc' = acc·exp(m - m') + acc_b·exp(m_b - m')``; the output is ``acc / l`` rounded to act.

Laws: the fused families are the compositions, byte for byte.

>>> import numpy as np
>>> from metrale.lkb.semantics import example
>>> args, p = example("kv_append_attention", rows=2, act="bf16")
>>> k, v, q, kc, vc, pos, slots = args
>>> kc2, vc2 = kc.copy(), vc.copy()
>>> o, _, _ = kv_append_attention(k, v, q, kc, vc, pos, slots, **p)
>>> _ = kv_append(k, v, kc2, vc2, pos, slots, act="bf16")
>>> o2, = attention(q, kc2, vc2, pos, slots, **p)
>>> o.tobytes() == o2.tobytes() and kc.tobytes() == kc2.tobytes()
True
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from .semantics import (
    F32,
    Reduction,
    _choice,
    _fail,
    _index,
    _param,
    _rand,
    _shape,
    act_dtype,
    rms_normalize,
    round_to,
    semantics,
)

ROPE_STYLES = ("neox", "interleaved")


def _head_norm_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("head_dim", "f32", p["h_block"], "sequential", within="pairwise",
                      of="x²"),)


def _kv_orders(kv_block: int, combine: str) -> tuple[Reduction, ...]:
    """q·k over head_dim, then the softmax denominator and p·v over kv_len in blocks of
    ``kv_block``, the blocks combined as ``combine`` says."""
    return (
        Reduction("head_dim", "f32", 0, "sequential", within="gemm", of="q·k"),
        Reduction("kv_len", "f32", kv_block, "sequential", within="pairwise",
                  of=f"softmax denominator, {combine}"),
        Reduction("kv_len", "f32", kv_block, "sequential", within="gemm", of=f"p·v, {combine}"),
    )


def _attention_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _kv_orders(p.get("kv_block", 256), "log-sum-exp merge")


def rope_tables(max_pos: int, head_dim: int, theta: float = 1e6) -> tuple[np.ndarray, np.ndarray]:
    """The f32 ``cos`` and ``sin`` tables [max_pos, head_dim/2] of default RoPE, computed as HF's
    rotary embedding does (``inv_freq = 1 / theta**(arange(0, d, 2)/d)`` in f32, angle in f32).

    >>> cos, sin = rope_tables(4, 8)
    >>> cos.shape, float(cos[0, 0]), float(sin[1, 0]) == float(np.sin(np.float32(1.0)))
    ((4, 4), 1.0, True)
    """
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** (
        np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))).astype(F32)
    angle = np.arange(max_pos, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(F32), np.sin(angle).astype(F32)


def _ex_qk_norm(rng, rows, act):
    return (_rand(rng, (rows, 4, 16), act), _rand(rng, (rows, 2, 16), act),
            _rand(rng, (16,), F32), _rand(rng, (16,), F32)), {
        "eps": 1e-6, "h_block": 8, "act": act}


@semantics("qk_norm", rows=(0, 1), orders=_head_norm_orders, example=_ex_qk_norm)
def qk_norm(q: np.ndarray, k: np.ndarray, wq: np.ndarray, wk: np.ndarray, *, eps: float,
            h_block: int, act: str) -> tuple[np.ndarray, np.ndarray]:
    """RMS norm of every head of ``q`` [rows, hq, d] and ``k`` [rows, hkv, d] over ``d``, with
    f32 weights ``wq``, ``wk`` [d]; the order and roundings of ``rmsnorm`` (Qwen3's q/k norm).

    >>> q = np.full((1, 2, 4), 3.0, np.float32)
    >>> qn, kn = qk_norm(q, q[:, :1], np.ones(4, np.float32), np.ones(4, np.float32),
    ...                  eps=0.0, h_block=4, act="f32")
    >>> qn.shape, float(qn[0, 1, 3]), kn.shape
    ((1, 2, 4), 1.0, (1, 1, 4))
    """
    fam, sizes = "qk_norm", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    _shape(fam, "k", k, ("rows", "hkv", "d"), sizes, (dt,))
    _shape(fam, "wq", wq, ("d",), sizes, (F32,))
    _shape(fam, "wk", wk, ("d",), sizes, (F32,))
    _param(fam, "eps", eps, numbers.Real)
    _param(fam, "h_block", h_block, int, 1)
    return (rms_normalize(q.astype(F32), wq, eps, h_block, dt).astype(dt),
            rms_normalize(k.astype(F32), wk, eps, h_block, dt).astype(dt))


def _rotate(xf: np.ndarray, c: np.ndarray, s: np.ndarray, style: str,
            dt: np.dtype) -> np.ndarray:
    """``round(round(x·C) + round(rot(x)·S))`` for f32 heads ``xf`` [rows, heads, d] and the
    rows' f32 tables ``c``, ``s`` [rows, d/2] (already rounded to act)."""
    half = xf.shape[-1] // 2
    if style == "neox":
        cc, ss = np.concatenate((c, c), -1)[:, None], np.concatenate((s, s), -1)[:, None]
        rot = np.concatenate((-xf[..., half:], xf[..., :half]), -1)
    else:
        cc, ss = np.repeat(c, 2, -1)[:, None], np.repeat(s, 2, -1)[:, None]
        rot = np.stack((-xf[..., 1::2], xf[..., 0::2]), -1).reshape(xf.shape)
    return round_to(round_to(xf * cc, dt) + round_to(rot * ss, dt), dt)


def _ex_rope(rng, rows, act):
    cos, sin = rope_tables(64, 16)
    return (_rand(rng, (rows, 4, 16), act), _rand(rng, (rows, 2, 16), act),
            rng.integers(0, 64, rows).astype(np.int32), cos, sin), {"style": "neox", "act": act}


@semantics("rope", rows=(0, 1, 2), example=_ex_rope)
def rope(q: np.ndarray, k: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray,
         *, style: str = "neox", act: str) -> tuple[np.ndarray, np.ndarray]:
    """Rotary position embedding of ``q`` [rows, hq, d] and ``k`` [rows, hkv, d] at ``positions``.

    ``cos``, ``sin`` are f32 [max_pos, d/2]. ``neox`` rotates the two halves (HF
    ``apply_rotary_pos_emb`` with ``cat(freqs, freqs)``): ``x·C + rotate_half(x)·S``;
    ``interleaved`` rotates the pairs ``(x[2i], x[2i+1])``. Math in f32; as HF in bf16, the
    tables are first rounded to act (``cos.to(x.dtype)``) and each of the two products and
    their sum is rounded to act (torch's bf16 ops); for f32 the roundings are the identity.

    >>> cos, sin = np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32)
    >>> q = np.array([[[1.0, 2.0]]], np.float32)
    >>> rope(q, q, np.array([1], np.int32), cos, sin, act="f32")[0]
    array([[[-2.,  1.]]], dtype=float32)
    """
    fam, sizes = "rope", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    _shape(fam, "k", k, ("rows", "hkv", "d"), sizes, (dt,))
    _shape(fam, "positions", positions, ("rows",), sizes, "int")
    _shape(fam, "cos", cos, ("max_pos", "half"), sizes, (F32,))
    _shape(fam, "sin", sin, ("max_pos", "half"), sizes, (F32,))
    _choice(fam, "style", style, ROPE_STYLES)
    if 2 * sizes["half"] != sizes["d"]:
        raise _fail(fam, "cos", "bad shape", f"half = d/2 = {sizes['d'] / 2} columns",
                    cos.shape)
    pos = _index(fam, "positions", positions, sizes["max_pos"], "position")
    c, s = round_to(cos[pos], dt), round_to(sin[pos], dt)
    return (_rotate(q.astype(F32), c, s, style, dt).astype(dt),
            _rotate(k.astype(F32), c, s, style, dt).astype(dt))


def _ex_qk_norm_rope(rng, rows, act):
    (q, k, wq, wk), p = _ex_qk_norm(rng, rows, act)
    cos, sin = rope_tables(64, 16)
    return (q, k, wq, wk, rng.integers(0, 64, rows).astype(np.int32), cos, sin), {
        **p, "style": "neox"}


@semantics("qk_norm_rope", rows=(0, 1, 4), orders=_head_norm_orders,
           example=_ex_qk_norm_rope)
def qk_norm_rope(q: np.ndarray, k: np.ndarray, wq: np.ndarray, wk: np.ndarray,
                 positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, eps: float,
                 h_block: int, style: str = "neox", act: str) -> tuple[np.ndarray, np.ndarray]:
    """``rope(qk_norm(q, k))``: byte-identical to the two families in turn.

    >>> q = np.full((1, 1, 2), 3.0, np.float32)
    >>> one = np.ones(2, np.float32)
    >>> qk_norm_rope(q, q, one, one, np.array([0], np.int32), one[None, :1], 0 * one[None, :1],
    ...              eps=0.0, h_block=2, act="f32")[0]
    array([[[1., 1.]]], dtype=float32)
    """
    qn, kn = qk_norm(q, k, wq, wk, eps=eps, h_block=h_block, act=act)
    return rope(qn, kn, positions, cos, sin, style=style, act=act)


def _cache_args(family: str, dt: np.dtype, k, v, k_cache, v_cache, positions, slots,
                sizes: dict[str, int]) -> tuple[np.ndarray, np.ndarray]:
    """Check the cache inputs; return positions and slots as validated int64 arrays."""
    if k is not None:
        _shape(family, "k", k, ("rows", "hkv", "d"), sizes, (dt,))
        _shape(family, "v", v, ("rows", "hkv", "d"), sizes, (dt,))
    _shape(family, "k_cache", k_cache, ("slots", "max_ctx", "hkv", "d"), sizes, (dt,))
    _shape(family, "v_cache", v_cache, ("slots", "max_ctx", "hkv", "d"), sizes, (dt,))
    _shape(family, "positions", positions, ("rows",), sizes, "int")
    _shape(family, "slots", slots, ("rows",), sizes, "int")
    return (_index(family, "positions", positions, sizes["max_ctx"], "position"),
            _index(family, "slots", slots, sizes["slots"], "slot"))


def _ex_kv(rng, rows, act, hq=4, hkv=2, d=16, max_ctx=40):
    """Decode-like cache state: each row its own slot, random positions, random cache."""
    return dict(
        q=_rand(rng, (rows, hq, d), act), k=_rand(rng, (rows, hkv, d), act),
        v=_rand(rng, (rows, hkv, d), act),
        k_cache=_rand(rng, (rows + 1, max_ctx, hkv, d), act),
        v_cache=_rand(rng, (rows + 1, max_ctx, hkv, d), act),
        positions=rng.integers(0, max_ctx, rows).astype(np.int32),
        slots=rng.permutation(rows + 1)[:rows].astype(np.int32),
    )


def _ex_kv_append(rng, rows, act):
    e = _ex_kv(rng, rows, act)
    return (e["k"], e["v"], e["k_cache"], e["v_cache"], e["positions"], e["slots"]), {
        "act": act}


@semantics("kv_append", rows=(0, 1, 4, 5), row_outputs=(), example=_ex_kv_append)
def kv_append(k: np.ndarray, v: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray,
              positions: np.ndarray, slots: np.ndarray, *,
              act: str) -> tuple[np.ndarray, np.ndarray]:
    """Write ``cache[slots[r], positions[r]] = k[r]`` (and ``v``) IN PLACE; return the caches.

    The caches are [slots, max_ctx, hkv, d] in act; the host realization aliases the cache
    outputs to their inputs. Every index is checked before anything is written: a position or
    slot out of range, or two rows addressing one entry, raise ``SemanticsError`` (a
    ``ValueError``) naming the row.

    >>> kc = np.zeros((1, 3, 1, 2), np.float32)
    >>> k = np.ones((1, 1, 2), np.float32)
    >>> kc2, _ = kv_append(k, k, kc, kc.copy(), np.array([1], np.int32), np.array([0], np.int32),
    ...                    act="f32")
    >>> kc2 is kc, kc[0, :, 0, 0].tolist()
    (True, [0.0, 1.0, 0.0])
    >>> kv_append(k, k, kc, kc, np.array([3], np.int32), np.array([0], np.int32), act="f32")
    Traceback (most recent call last):
    ...
    metrale.lkb.semantics.SemanticsError: kv_append.positions[0]: position out of range (expected 0 <= position < 3, found 3)
    """
    fam, sizes = "kv_append", {}
    dt = act_dtype(fam, act)
    pos, slot = _cache_args(fam, dt, k, v, k_cache, v_cache, positions, slots, sizes)
    entry = slot * sizes["max_ctx"] + pos
    _, first = np.unique(entry, return_index=True)
    if first.size != entry.size:
        r = int(np.setdiff1d(np.arange(entry.size), first)[0])
        q = int(np.flatnonzero(entry == entry[r])[0])
        raise _fail(fam, f"positions[{r}]", "two rows write one cache entry",
                    "distinct (slot, position) pairs",
                    f"rows {q} and {r} at slot {int(slot[r])}, position {int(pos[r])}")
    k_cache[slot, pos] = k
    v_cache[slot, pos] = v
    return k_cache, v_cache


def _row_blocks(qf: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: np.ndarray,
                slot: np.ndarray, window: int, kv_block: int):
    """For each row r of f32 ``qf`` [rows, hq, d]: ``(r, q, blocks)``, its q heads grouped by the
    kv head they read [hkv, hq / hkv, d] and an iterator over the blocks of the positions it
    attends to, cut at absolute multiples of ``kv_block`` (so the cut does not depend on the
    window), each as f32 keys [hkv, d, n] and values [hkv, n, d]."""
    rows, hq, d = qf.shape
    hkv = k_cache.shape[2]
    for r in range(rows):
        p = int(pos[r])
        lo = max(0, p - window + 1) if window else 0
        ks = k_cache[slot[r], lo : p + 1].astype(F32)  # (n, hkv, d)
        vs = v_cache[slot[r], lo : p + 1].astype(F32)

        def blocks(p: int = p, lo: int = lo, ks: np.ndarray = ks, vs: np.ndarray = vs):
            start = lo
            while start <= p:
                end = min(p + 1, (start // kv_block + 1) * kv_block)
                yield (ks[start - lo : end - lo].transpose(1, 2, 0),  # (hkv, d, n)
                       vs[start - lo : end - lo].transpose(1, 0, 2))  # (hkv, n, d)
                start = end

        # q head h reads kv head h // (hq / hkv)
        yield r, qf[r].reshape(hkv, hq // hkv, d), blocks()


def _attend(qf: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: np.ndarray,
            slot: np.ndarray, scale: float, window: int, kv_block: int,
            dt: np.dtype) -> np.ndarray:
    """Split-KV attention of f32 ``qf`` [rows, hq, d], one row at a time (row-invariant)."""
    out = np.empty(qf.shape, dt)
    sc = np.float32(scale)
    for r, qr, blocks in _row_blocks(qf, k_cache, v_cache, pos, slot, window, kv_block):
        m = l = acc = None
        for kb, vb in blocks:
            s = np.matmul(qr, kb) * sc
            mb = s.max(axis=-1)
            e = np.exp(s - mb[..., None])
            lb = np.add.reduce(e, axis=-1)
            ab = np.matmul(e, vb)
            if m is None:
                m, l, acc = mb, lb, ab
            else:
                mn = np.maximum(m, mb)
                a, b = np.exp(m - mn), np.exp(mb - mn)
                l = l * a + lb * b
                acc = acc * a[..., None] + ab * b[..., None]
                m = mn
        out[r] = (acc / l[..., None]).reshape(qf.shape[1:]).astype(dt)
    return out


def _attention_params(fam: str, sizes: dict[str, int], scale: Any, window: Any,
                      kv_block: Any) -> None:
    _param(fam, "scale", scale, numbers.Real)
    _param(fam, "window", window, int, 0)
    _param(fam, "kv_block", kv_block, int, 1)
    if sizes["hq"] % sizes["hkv"]:
        raise _fail(fam, "q", "query heads not a multiple of kv heads",
                    f"a multiple of hkv = {sizes['hkv']}", f"hq = {sizes['hq']}")


def _ex_attention(rng, rows, act):
    e = _ex_kv(rng, rows, act)
    return (e["q"], e["k_cache"], e["v_cache"], e["positions"], e["slots"]), {
        "scale": 0.25, "window": 0, "kv_block": 8, "act": act}


@semantics("attention", rows=(0, 3, 4), orders=_attention_orders, example=_ex_attention)
def attention(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray,
              slots: np.ndarray, *, scale: float, window: int = 0, kv_block: int = 256,
              act: str) -> tuple[np.ndarray]:
    """Causal attention of ``q`` [rows, hq, d] over the cached keys and values of its slot.

    Row ``r`` attends to ``cache[slots[r], j]`` for ``j`` in ``[max(0, pos - window + 1), pos]``
    (``window`` 0: from 0); GQA: q head ``h`` reads kv head ``h // (hq / hkv)``. Scores
    ``(q·k)·scale``, softmax and values in f32, split-KV as the module docstring says; within a
    block ``q·k`` and ``p·v`` are one NumPy matmul (BLAS) and the denominator a pairwise sum.
    Probabilities are not rounded to act (HF eager rounds them in bf16; flash kernels do not).

    >>> kc = np.zeros((1, 4, 1, 2), np.float32)
    >>> kc[0, :, 0, 1] = [1.0, 2.0, 3.0, 4.0]
    >>> q = np.ones((1, 2, 2), np.float32)
    >>> attention(q, kc, kc, np.array([1], np.int32), np.array([0], np.int32), scale=0.0,
    ...           kv_block=1, act="f32")[0]
    array([[[0. , 1.5],
            [0. , 1.5]]], dtype=float32)
    """
    fam, sizes = "attention", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    pos, slot = _cache_args(fam, dt, None, None, k_cache, v_cache, positions, slots, sizes)
    _attention_params(fam, sizes, scale, window, kv_block)
    return (_attend(q.astype(F32), k_cache, v_cache, pos, slot, scale, window, kv_block, dt),)


def _ex_kv_append_attention(rng, rows, act):
    e = _ex_kv(rng, rows, act)
    return (e["k"], e["v"], e["q"], e["k_cache"], e["v_cache"], e["positions"], e["slots"]), {
        "scale": 0.25, "window": 0, "kv_block": 8, "act": act}


@semantics("kv_append_attention", rows=(0, 1, 2, 5, 6), row_outputs=(0,),
           orders=_attention_orders, example=_ex_kv_append_attention)
def kv_append_attention(k: np.ndarray, v: np.ndarray, q: np.ndarray, k_cache: np.ndarray,
                        v_cache: np.ndarray, positions: np.ndarray, slots: np.ndarray, *,
                        scale: float, window: int = 0, kv_block: int = 256,
                        act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``kv_append`` (in place) then ``attention``: returns ``(o, k_cache, v_cache)``.

    Every row's k and v are written before any row attends, so prefill rows of one sequence
    see each other; all checks run before the caches are touched.

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> x = np.ones((1, 1, 2), np.float32)
    >>> o, kc2, _ = kv_append_attention(x, 2 * x, x, kc, kc.copy(), np.array([0], np.int32),
    ...                                 np.array([0], np.int32), scale=1.0, act="f32")
    >>> o.tolist(), kc2 is kc
    ([[[2.0, 2.0]]], True)
    """
    fam, sizes = "kv_append_attention", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    _cache_args(fam, dt, k, v, k_cache, v_cache, positions, slots, sizes)
    _attention_params(fam, sizes, scale, window, kv_block)
    kv_append(k, v, k_cache, v_cache, positions, slots, act=act)
    (o,) = attention(q, k_cache, v_cache, positions, slots, scale=scale, window=window,
                     kv_block=kv_block, act=act)
    return o, k_cache, v_cache


def _online_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _kv_orders(p.get("kv_block", 64), "online: weights against the running max, in act")


def _attend_online(qf: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, pos: np.ndarray,
                   slot: np.ndarray, scale: float, window: int, kv_block: int,
                   dt: np.dtype) -> np.ndarray:
    """Attention of f32 ``qf`` [rows, hq, d] with an online softmax, one row at a time: blocks
    cut as :func:`_attend` cuts them, each folded into the running state once."""
    out = np.empty(qf.shape, dt)
    sc = np.float32(scale)
    for r, qr, blocks in _row_blocks(qf, k_cache, v_cache, pos, slot, window, kv_block):
        m = np.full(qr.shape[:2], -np.inf, F32)
        l = np.zeros(qr.shape[:2], F32)
        acc = np.zeros(qr.shape, F32)
        for kb, vb in blocks:
            s = np.matmul(qr, kb) * sc
            mn = np.maximum(m, s.max(axis=-1))
            a = np.exp(m - mn)  # 0 at the first block (m = -inf), where l and acc are 0
            e = round_to(np.exp(s - mn[..., None]), dt)
            l = l * a + np.add.reduce(e, axis=-1)
            acc = acc * a[..., None] + np.matmul(e, vb)
            m = mn
        out[r] = (acc / l[..., None]).reshape(qf.shape[1:]).astype(dt)
    return out


def _ex_kv_append_attention_online(rng, rows, act):
    args, p = _ex_kv_append_attention(rng, rows, act)
    return args, {**p, "kv_block": 4}


@semantics("kv_append_attention_online", rows=(0, 1, 2, 5, 6), row_outputs=(0,),
           orders=_online_orders, example=_ex_kv_append_attention_online)
def kv_append_attention_online(k: np.ndarray, v: np.ndarray, q: np.ndarray, k_cache: np.ndarray,
                               v_cache: np.ndarray, positions: np.ndarray, slots: np.ndarray, *,
                               scale: float, window: int = 0, kv_block: int = 64,
                               act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``kv_append`` (in place) then attention with an online softmax: returns ``(o, k_cache,
    v_cache)``, the caches byte-identical to ``kv_append_attention``'s.

    Each block of ``kv_block`` positions (cut as ``attention`` cuts them) is seen once: its scores
    raise the running max ``m' = max(m, max s)``, the state so far is scaled by ``exp(m - m')``,
    and its weights ``exp(s - m')``, rounded to act, add to the sum ``l`` and weigh its values
    into ``acc``; the output is ``acc / l`` rounded to act. Against ``attention``'s exact weights
    the output moves by about a unit of act's roundoff (the relation online_prefill_attention).

    >>> kc = np.zeros((1, 4, 1, 2), np.float32)
    >>> x = np.ones((1, 1, 2), np.float32)
    >>> o, kc2, _ = kv_append_attention_online(x, 2 * x, x, kc, kc.copy(),
    ...                                        np.array([0], np.int32), np.array([0], np.int32),
    ...                                        scale=1.0, act="f32")
    >>> o.tolist(), kc2 is kc
    ([[[2.0, 2.0]]], True)
    """
    fam, sizes = "kv_append_attention_online", {}
    dt = act_dtype(fam, act)
    _shape(fam, "q", q, ("rows", "hq", "d"), sizes, (dt,))
    pos, slot = _cache_args(fam, dt, k, v, k_cache, v_cache, positions, slots, sizes)
    _attention_params(fam, sizes, scale, window, kv_block)
    kv_append(k, v, k_cache, v_cache, positions, slots, act=act)
    return (_attend_online(q.astype(F32), k_cache, v_cache, pos, slot, scale, window, kv_block,
                           dt), k_cache, v_cache)


def _ex_rope_attention(rng, rows, act):
    e = _ex_kv(rng, rows, act)
    cos, sin = rope_tables(40, 16)
    return (e["q"], e["k"], e["v"], e["k_cache"], e["v_cache"], e["positions"], e["slots"], cos,
            sin), {"scale": 0.25, "window": 0, "kv_block": 8, "style": "neox", "act": act}


@semantics("rope_kv_append_attention", rows=(0, 1, 2, 5, 6), row_outputs=(0,),
           orders=_attention_orders, example=_ex_rope_attention)
def rope_kv_append_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, k_cache: np.ndarray,
                             v_cache: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                             cos: np.ndarray, sin: np.ndarray, *, scale: float, window: int = 0,
                             kv_block: int = 256, style: str = "neox",
                             act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``rope`` then ``kv_append_attention``: the rotated k is appended (in place), the rotated
    q attends; returns ``(o, k_cache, v_cache)``, byte-identical to the two families in turn.

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> x = np.ones((1, 1, 2), np.float32)
    >>> cos, sin = np.zeros((2, 1), np.float32), np.ones((2, 1), np.float32)
    >>> o, kc2, _ = rope_kv_append_attention(x, x, 2 * x, kc, kc.copy(), np.array([1], np.int32),
    ...                                      np.array([0], np.int32), cos, sin, scale=1.0,
    ...                                      act="f32")
    >>> kc2[0, 1].tolist()  # (1, 1) rotated a quarter turn
    [[-1.0, 1.0]]
    """
    qr, kr = rope(q, k, positions, cos, sin, style=style, act=act)
    return kv_append_attention(kr, v, qr, k_cache, v_cache, positions, slots, scale=scale,
                               window=window, kv_block=kv_block, act=act)


def _ex_qk_norm_rope_attention(rng, rows, act):
    (q, k, v, kc, vc, pos, slots, cos, sin), p = _ex_rope_attention(rng, rows, act)
    wq, wk = _rand(rng, (16,), F32), _rand(rng, (16,), F32)
    return (q, k, v, wq, wk, kc, vc, pos, slots, cos, sin), {**p, "eps": 1e-6, "h_block": 8}


def _qk_norm_attention_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _head_norm_orders(p) + _attention_orders(p)


@semantics("qk_norm_rope_kv_append_attention", rows=(0, 1, 2, 7, 8), row_outputs=(0,),
           orders=_qk_norm_attention_orders, example=_ex_qk_norm_rope_attention)
def qk_norm_rope_kv_append_attention(
        q: np.ndarray, k: np.ndarray, v: np.ndarray, wq: np.ndarray, wk: np.ndarray,
        k_cache: np.ndarray, v_cache: np.ndarray, positions: np.ndarray, slots: np.ndarray,
        cos: np.ndarray, sin: np.ndarray, *, eps: float, h_block: int, scale: float,
        window: int = 0, kv_block: int = 256, style: str = "neox",
        act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``qk_norm_rope`` then ``kv_append_attention`` (Qwen3): byte-identical to the two in turn.

    >>> kc = np.zeros((1, 2, 1, 2), np.float32)
    >>> x = np.full((1, 1, 2), 3.0, np.float32)
    >>> one = np.ones(2, np.float32)
    >>> cos, sin = np.ones((2, 1), np.float32), np.zeros((2, 1), np.float32)
    >>> o, kc2, _ = qk_norm_rope_kv_append_attention(
    ...     x, x, x, one, one, kc, kc.copy(), np.array([0], np.int32), np.array([0], np.int32),
    ...     cos, sin, eps=0.0, h_block=2, scale=1.0, act="f32")
    >>> kc2[0, 0].tolist(), o.tolist()  # k normalized to 1s; one position: o is v
    ([[1.0, 1.0]], [[[3.0, 3.0]]])
    """
    qr, kr = qk_norm_rope(q, k, wq, wk, positions, cos, sin, eps=eps, h_block=h_block,
                          style=style, act=act)
    return kv_append_attention(kr, v, qr, k_cache, v_cache, positions, slots, scale=scale,
                               window=window, kv_block=kv_block, act=act)
