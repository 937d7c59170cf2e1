"""Reference semantics of the mixture-of-experts families: router softmax and top-k, expert
matmuls with SwiGLU, and the weighted combine; registered into ``semantics.SEMANTICS``.

Expert matmuls reduce through :func:`~metrale.lkb.semantics.blocked_matvec`, one gemv per
(row, block), so grouping rows by expert changes no byte. Hugging Face's Qwen3-MoE (5.x)
differs in two places, both at rounding level only: it casts the routing weights to the
activation dtype and accumulates the experts' weighted outputs in that dtype in ascending
expert order (``index_add_``); here weights stay f32 and the sum runs in f32 in slot order.

Laws: ``softmax_topk`` is ``softmax`` then ``topk``, byte for byte.

>>> import numpy as np
>>> from metrale.lkb.semantics import example
>>> (logits,), p = example("softmax_topk", rows=4)
>>> w, ids = softmax_topk(logits, **p)
>>> w2, ids2 = topk(softmax(logits)[0], **p)
>>> w.tobytes() == w2.tobytes() and ids.tobytes() == ids2.tobytes()
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .semantics import (
    F32,
    Reduction,
    _bf16,
    _f32,
    _fail,
    _index,
    _matvec_orders,
    _norm_orders,
    _param,
    _rand,
    _shape,
    act_dtype,
    add_rmsnorm,
    blocked_matvec,
    round_to,
    semantics,
    silu_mul,
)


def _softmax_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("experts", "f32", 0, "sequential", within="pairwise",
                      of="exp(l - max)"),)


def _topk_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    if not p.get("renormalize", False):
        return ()
    return (Reduction("top_k", "f32", 0, "sequential", within="sequential",
                      of="selected weights"),)


def _softmax_topk_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _softmax_orders(p) + _topk_orders(p)


def _combine_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("top_k", "f32", 0, "sequential", within="sequential", of="weight·y"),)


def _ex_logits(rng, rows, act):
    return (_rand(rng, (rows, 8), F32, 2.0),), {}


@semantics("softmax", orders=_softmax_orders, example=_ex_logits)
def softmax(logits: np.ndarray) -> tuple[np.ndarray]:
    """f32 softmax over the last axis of ``logits`` [rows, E] (bf16 or f32, widened exactly):
    ``e = exp(l - max l)``, ``p = e / sum(e)``, the sum NumPy's pairwise one.

    >>> softmax(np.log(np.array([[1.0, 3.0]], np.float32)))[0]
    array([[0.25, 0.75]], dtype=float32)
    """
    _shape("softmax", "logits", logits, ("rows", "experts"), {}, (_bf16(), F32))
    lf = logits.astype(F32)
    e = np.exp(lf - lf.max(axis=-1, keepdims=True))
    return (e / np.add.reduce(e, axis=-1, keepdims=True),)


def _ex_topk(rng, rows, act):
    (logits,), _ = _ex_logits(rng, rows, act)
    return softmax(logits), {"top_k": 2, "renormalize": True}


@semantics("topk", orders=_topk_orders, example=_ex_topk)
def topk(p: np.ndarray, *, top_k: int, renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The ``top_k`` largest of each row of f32 ``p`` [rows, E], descending, ties to the lower
    index (a stable sort), with their i32 ids; ``renormalize`` divides them by their sum, taken
    left to right in f32 (HF ``routing_weights /= routing_weights.sum(-1)``, norm_topk_prob).

    >>> w, ids = topk(np.array([[0.1, 0.3, 0.3, 0.3]], np.float32), top_k=2, renormalize=True)
    >>> w.tolist(), ids.tolist()
    ([[0.5, 0.5]], [[1, 2]])
    """
    fam, sizes = "topk", {}
    _shape(fam, "p", p, ("rows", "experts"), sizes, (F32,))
    _param(fam, "top_k", top_k, int, 1)
    if top_k > sizes["experts"]:
        raise _fail(fam, "top_k", "bad parameter", f"at most experts = {sizes['experts']}",
                    top_k)
    ids = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, axis=-1)
    if renormalize:
        total = w[:, 0]
        for j in range(1, top_k):
            total = total + w[:, j]
        w = w / total[:, None]
    return np.ascontiguousarray(w), ids.astype(np.int32)


def _ex_softmax_topk(rng, rows, act):
    (logits,), _ = _ex_logits(rng, rows, act)
    return (logits,), {"top_k": 2, "renormalize": True}


@semantics("softmax_topk", orders=_softmax_topk_orders, example=_ex_softmax_topk)
def softmax_topk(logits: np.ndarray, *, top_k: int,
                 renormalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """The router: ``topk(softmax(logits))`` → (f32 weights, i32 ids) [rows, top_k].

    >>> w, ids = softmax_topk(np.log(np.array([[1.0, 2.0, 5.0]], np.float32)), top_k=2,
    ...                       renormalize=False)
    >>> w.round(4).tolist(), ids.tolist()
    ([[0.625, 0.25]], [[2, 1]])
    """
    (p,) = softmax(logits)
    return topk(p, top_k=top_k, renormalize=renormalize)


def _by_expert(ids: np.ndarray):
    """(expert, row indices, slot indices) for each expert used, in ascending expert order."""
    flat = ids.reshape(-1)
    order = np.argsort(flat, kind="stable")
    experts, starts = np.unique(flat[order], return_index=True)
    bounds = list(starts[1:]) + [flat.size]
    top_k = ids.shape[1]
    for e, a, b in zip(experts, starts, bounds):
        sel = order[a:b]
        yield int(e), sel // top_k, sel % top_k


def _ex_moe(rng, rows, act, experts=6, top_k=2, k=64):
    ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(rows)]).astype(np.int32)
    return ids, _rand(rng, (rows, k), act)


def _ex_moe_gate_up(rng, rows, act):
    ids, x = _ex_moe(rng, rows, act)
    return (x, ids, _rand(rng, (6, 24, 64), F32, 0.2), _rand(rng, (6, 24, 64), F32, 0.2)), {
        "k_block": 16, "across": "sequential", "act": act}


@semantics("moe_gate_up_swiglu", rows=(0, 1), orders=_matvec_orders, example=_ex_moe_gate_up)
def moe_gate_up_swiglu(x: np.ndarray, ids: np.ndarray, wg: np.ndarray, wu: np.ndarray, *,
                       k_block: int, across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``h[r, s] = swiglu(linear(x[r], wg[e]), linear(x[r], wu[e]))`` with ``e = ids[r, s]``.

    ``x`` act [rows, k], ``ids`` int [rows, top_k], ``wg``, ``wu`` f32 [E, inter, k] (HF's
    fused ``gate_up_proj`` split in its two halves); ``h`` act [rows, top_k, inter].

    >>> x = np.ones((1, 2), np.float32)
    >>> w = np.stack([np.full((1, 2), v, np.float32) for v in (0.5, 1.0)])
    >>> moe_gate_up_swiglu(x, np.array([[1, 0]], np.int32), w, w, k_block=2, act="f32")[0]
    array([[[3.523188 ],
            [0.7310586]]], dtype=float32)
    """
    fam, sizes = "moe_gate_up_swiglu", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "k"), sizes, (dt,))
    _shape(fam, "ids", ids, ("rows", "top_k"), sizes, "int")
    _shape(fam, "wg", wg, ("experts", "inter", "k"), sizes, (F32,))
    _shape(fam, "wu", wu, ("experts", "inter", "k"), sizes, (F32,))
    idx = _index(fam, "ids", ids, sizes["experts"], "expert id")
    xf = _f32(x)
    h = np.empty((sizes["rows"], sizes["top_k"], sizes["inter"]), dt)
    for e, r, s in _by_expert(idx):
        g = round_to(blocked_matvec(xf[r], wg[e], k_block, across), dt)
        u = round_to(blocked_matvec(xf[r], wu[e], k_block, across), dt)
        h[r, s] = silu_mul(g, u, dt).astype(dt)
    return (h,)


def _ex_moe_down(rng, rows, act):
    ids, _ = _ex_moe(rng, rows, act)
    return (_rand(rng, (rows, 2, 24), act), ids, _rand(rng, (6, 64, 24), F32, 0.2)), {
        "k_block": 8, "across": "sequential", "act": act}


@semantics("moe_down", rows=(0, 1), orders=_matvec_orders, example=_ex_moe_down)
def moe_down(h: np.ndarray, ids: np.ndarray, wd: np.ndarray, *, k_block: int,
             across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``y[r, s] = linear(h[r, s], wd[ids[r, s]])``: act [rows, top_k, hidden], ``wd`` f32
    [E, hidden, inter].

    >>> h = np.ones((1, 2, 2), np.float32)
    >>> wd = np.stack([np.full((1, 2), v, np.float32) for v in (1.0, 2.0)])
    >>> moe_down(h, np.array([[1, 0]], np.int32), wd, k_block=2, act="f32")[0].tolist()
    [[[4.0], [2.0]]]
    """
    fam, sizes = "moe_down", {}
    dt = act_dtype(fam, act)
    _shape(fam, "h", h, ("rows", "top_k", "inter"), sizes, (dt,))
    _shape(fam, "ids", ids, ("rows", "top_k"), sizes, "int")
    _shape(fam, "wd", wd, ("experts", "hidden", "inter"), sizes, (F32,))
    idx = _index(fam, "ids", ids, sizes["experts"], "expert id")
    hf = h.astype(F32)
    y = np.empty((sizes["rows"], sizes["top_k"], sizes["hidden"]), dt)
    for e, r, s in _by_expert(idx):
        y[r, s] = blocked_matvec(np.ascontiguousarray(hf[r, s]), wd[e], k_block,
                                 across).astype(dt)
    return (y,)


def _ex_moe_combine(rng, rows, act):
    (p,), _ = _ex_logits(rng, rows, act)
    w, _ = topk(softmax(p)[0], top_k=2, renormalize=True)
    return (_rand(rng, (rows, 2, 64), act), w), {"act": act}


@semantics("moe_combine", rows=(0, 1), orders=_combine_orders, example=_ex_moe_combine)
def moe_combine(y: np.ndarray, weights: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """``out[r] = round(sum_s weights[r, s] · f32(y[r, s]))``, the sum in f32 in slot order
    0..top_k-1 (``((t0 + t1) + t2) + …``); ``y`` act [rows, top_k, hidden], weights f32.

    >>> y = np.array([[[1.0], [3.0]]], np.float32)
    >>> moe_combine(y, np.array([[0.75, 0.25]], np.float32), act="f32")[0]
    array([[1.5]], dtype=float32)
    """
    fam, sizes = "moe_combine", {}
    dt = act_dtype(fam, act)
    _shape(fam, "y", y, ("rows", "top_k", "hidden"), sizes, (dt,))
    _shape(fam, "weights", weights, ("rows", "top_k"), sizes, (F32,))
    yf = y.astype(F32)
    acc = weights[:, 0, None] * yf[:, 0]
    for s in range(1, sizes["top_k"]):
        acc = acc + weights[:, s, None] * yf[:, s]
    return (acc.astype(dt),)


def _combine_norm_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _combine_orders(p) + _norm_orders(p)


def _ex_moe_combine_add_rmsnorm(rng, rows, act):
    (y, weights), _ = _ex_moe_combine(rng, rows, act)
    return (_rand(rng, (rows, 64), act), y, weights, _rand(rng, (64,), F32)), {
        "eps": 1e-6, "h_block": 16, "act": act}


@semantics("moe_combine_add_rmsnorm", rows=(0, 1, 2), orders=_combine_norm_orders,
           example=_ex_moe_combine_add_rmsnorm)
def moe_combine_add_rmsnorm(x: np.ndarray, y: np.ndarray, weights: np.ndarray, w: np.ndarray, *,
                            eps: float, h_block: int, act: str) -> tuple[np.ndarray, np.ndarray]:
    """The experts' weighted combine as the residual add's second term, then the norm:
    ``s, n = add_rmsnorm(x, moe_combine(y, weights), w)``, byte for byte the two calls.

    >>> y = np.array([[[1.0, 1.0], [3.0, 3.0]]], np.float32)
    >>> s, n = moe_combine_add_rmsnorm(np.ones((1, 2), np.float32), y,
    ...                                np.array([[0.75, 0.25]], np.float32),
    ...                                np.ones(2, np.float32), eps=0.0, h_block=2, act="f32")
    >>> s.tolist(), n.tolist()
    ([[2.5, 2.5]], [[1.0, 1.0]])
    """
    (m,) = moe_combine(y, weights, act=act)
    return add_rmsnorm(x, m, w, eps=eps, h_block=h_block, act=act)
