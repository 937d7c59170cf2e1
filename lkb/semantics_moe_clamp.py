"""Reference semantics of the biased mixture of experts with a clamped SwiGLU (gpt-oss):
the router that softmaxes the chosen experts' biased logits, the fused gate/up projection with
its clamp, and the biased down projection; registered into ``semantics.SEMANTICS``.

transformers' ``GptOssExperts`` stores gate and up as one matrix whose outputs interleave:
output ``2j`` is gate ``j``, output ``2j + 1`` is up ``j``. The families here take that matrix
as ``wgu`` [experts, 2·inter, k] (rows = outputs, the layout of the mxfp4 checkpoints) and
reduce through :func:`~metrale.lkb.semantics.blocked_matvec`, one gemv per (row, block).

Laws: with ``limit = inf`` and ``alpha = 1`` the activation is ``silu(gate) · (up + 1)``; the
router's weights sum to 1 up to rounding and its ids are those of the largest biased logits.

>>> import numpy as np
>>> w, ids = topk_softmax(np.array([[0.0, 2.0, 1.0]], np.float32),
...                       np.array([0.0, -2.0, 0.5], np.float32), top_k=2)
>>> ids.tolist(), [round(float(v), 4) for v in w[0]]
([[2, 0]], [0.8176, 0.1824])
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import numpy as np

from .semantics import (
    F32,
    Reduction,
    _f32,
    _fail,
    _index,
    _matvec_orders,
    _param,
    _rand,
    _shape,
    act_dtype,
    blocked_matvec,
    linear,
    round_to,
    semantics,
)
from .semantics_moe import _by_expert, _ex_moe


def _router_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("top_k", "f32", 0, "sequential", within="sequential",
                      of="exp(l - max) of the chosen"),)


def _ex_topk_softmax(rng, rows, act):
    return (_rand(rng, (rows, 8), F32, 2.0), _rand(rng, (8,), F32)), {"top_k": 2}


@semantics("topk_softmax", orders=_router_orders, example=_ex_topk_softmax)
def topk_softmax(logits: np.ndarray, bias: np.ndarray, *,
                 top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The gpt-oss router: ``l = logits + bias`` (f32), the ``top_k`` largest of each row
    (descending, ties to the lower id) and the softmax over just those: ``e = exp(v - v[0])``,
    the sum left to right, ``w = e / sum``. Returns (f32 weights, i32 ids) [rows, top_k].

    >>> w, ids = topk_softmax(np.log(np.array([[1.0, 3.0, 1.0]], np.float32)),
    ...                       np.zeros(3, np.float32), top_k=2)
    >>> w.tolist(), ids.tolist()
    ([[0.75, 0.25]], [[1, 0]])
    """
    fam, sizes = "topk_softmax", {}
    _shape(fam, "logits", logits, ("rows", "experts"), sizes, (F32,))
    _shape(fam, "bias", bias, ("experts",), sizes, (F32,))
    _param(fam, "top_k", top_k, int, 1)
    if top_k > sizes["experts"]:
        raise _fail(fam, "top_k", "bad parameter", f"at most experts = {sizes['experts']}",
                    top_k)
    biased = logits + bias[None, :]
    ids = np.argsort(-biased, axis=-1, kind="stable")[:, :top_k]
    v = np.take_along_axis(biased, ids, axis=-1)
    e = np.exp(v - v[:, :1])
    total = e[:, 0]
    for j in range(1, top_k):
        total = total + e[:, j]
    return np.ascontiguousarray(e / total[:, None]), ids.astype(np.int32)


def _ex_router_topk_softmax(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (8, 64), F32, 0.3), _rand(rng, (8,), F32)), {
        "k_block": 16, "across": "sequential", "act": act, "top_k": 2}


def _router_matvec_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return _matvec_orders(p) + _router_orders(p)


@semantics("router_topk_softmax", orders=_router_matvec_orders, example=_ex_router_topk_softmax)
def router_topk_softmax(x: np.ndarray, w: np.ndarray, bias: np.ndarray, *, k_block: int,
                        across: str = "sequential", act: str,
                        top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """The gpt-oss router in one call: the f32 logits ``x · wᵀ`` (:func:`~metrale.lkb.semantics.
    linear` with ``out="f32"``, the ``lm_head`` it replaces) then :func:`topk_softmax` of them
    and ``bias``, byte for byte the two calls.

    >>> w, ids = router_topk_softmax(np.ones((1, 2), np.float32),
    ...                              np.array([[0.5, 0.5], [1.0, 1.0]], np.float32),
    ...                              np.zeros(2, np.float32), k_block=2, act="f32", top_k=1)
    >>> w.tolist(), ids.tolist()
    ([[1.0]], [[1]])
    """
    (logits,) = linear(x, w, k_block=k_block, across=across, out="f32", act=act)
    return topk_softmax(logits, bias, top_k=top_k)


def clamped_swiglu(gate: np.ndarray, up: np.ndarray, limit: float, alpha: float,
                   dt: np.dtype) -> np.ndarray:
    """``(clamp(up, -limit, limit) + 1) · g · σ(alpha · g)`` with ``g = min(gate, limit)``, on
    f32 values, each product, the sigmoid and the ``+ 1`` rounded to ``dt`` as transformers'
    bf16 ``_apply_gate`` rounds them. NaN stays NaN (the clamps propagate it, as torch's).

    >>> clamped_swiglu(np.array([9.0, 0.0], np.float32), np.array([-9.0, 1.0], np.float32),
    ...                7.0, 1.702, np.dtype(np.float32))
    array([-41.999718,   0.      ], dtype=float32)
    """
    lim = np.float32(limit)
    g = np.minimum(gate, lim)
    u = np.clip(up, -lim, lim)
    with np.errstate(over="ignore"):
        sig = round_to(np.float32(1) / (np.float32(1) + np.exp(-round_to(g * np.float32(alpha),
                                                                         dt))), dt)
    glu = round_to(g * sig, dt)
    return round_to(round_to(u + np.float32(1), dt) * glu, dt)


def _clamp_params(fam: str, limit: Any, alpha: Any) -> None:
    _param(fam, "limit", limit, numbers.Real)
    _param(fam, "alpha", alpha, numbers.Real)
    if not limit > 0:
        raise _fail(fam, "limit", "bad parameter", "a number > 0", limit)


def _ex_moe_gate_up_clamp(rng, rows, act):
    ids, x = _ex_moe(rng, rows, act)
    return (x, ids, _rand(rng, (6, 48, 64), F32, 0.6), _rand(rng, (6, 48), F32)), {
        "k_block": 16, "across": "sequential", "act": act, "limit": 7.0, "alpha": 1.702}


@semantics("moe_gate_up_clamp", rows=(0, 1), orders=_matvec_orders,
           example=_ex_moe_gate_up_clamp)
def moe_gate_up_clamp(x: np.ndarray, ids: np.ndarray, wgu: np.ndarray, bgu: np.ndarray, *,
                      k_block: int, across: str = "sequential", act: str, limit: float,
                      alpha: float) -> tuple[np.ndarray]:
    """``h[r, s] = clamped_swiglu(gu[0::2], gu[1::2])`` of ``gu = round(round(x[r] · wgu[e]ᵀ)
    + bgu[e])``, ``e = ids[r, s]``.

    ``x`` act [rows, k], ``ids`` int [rows, top_k], ``wgu`` f32 [E, 2·inter, k] (gate and up
    outputs interleaved), ``bgu`` f32 [E, 2·inter]; ``h`` act [rows, top_k, inter].

    >>> x = np.ones((1, 2), np.float32)
    >>> wgu = np.array([[[1.0, 1.0], [0.5, 0.5]]], np.float32)  # one expert, inter 1
    >>> moe_gate_up_clamp(x, np.array([[0]], np.int32), wgu, np.zeros((1, 2), np.float32),
    ...                   k_block=2, act="f32", limit=7.0, alpha=1.0)[0]
    array([[[3.523188]]], dtype=float32)
    """
    fam, sizes = "moe_gate_up_clamp", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "k"), sizes, (dt,))
    _shape(fam, "ids", ids, ("rows", "top_k"), sizes, "int")
    _shape(fam, "wgu", wgu, ("experts", "gate_up", "k"), sizes, (F32,))
    _shape(fam, "bgu", bgu, ("experts", "gate_up"), sizes, (F32,))
    _clamp_params(fam, limit, alpha)
    if sizes["gate_up"] % 2:
        raise _fail(fam, "wgu", "gate and up interleave: an even number of outputs",
                    "2 · inter rows", sizes["gate_up"])
    idx = _index(fam, "ids", ids, sizes["experts"], "expert id")
    xf = _f32(x)
    h = np.empty((sizes["rows"], sizes["top_k"], sizes["gate_up"] // 2), dt)
    for e, r, s in _by_expert(idx):
        gu = round_to(round_to(blocked_matvec(xf[r], wgu[e], k_block, across), dt)
                      + bgu[e][None, :], dt)
        h[r, s] = clamped_swiglu(gu[:, 0::2], gu[:, 1::2], limit, alpha, dt).astype(dt)
    return (h,)


def _ex_moe_down_bias(rng, rows, act):
    ids, _ = _ex_moe(rng, rows, act)
    return (_rand(rng, (rows, 2, 24), act), ids, _rand(rng, (6, 64, 24), F32, 0.2),
            _rand(rng, (6, 64), F32)), {"k_block": 8, "across": "sequential", "act": act}


@semantics("moe_down_bias", rows=(0, 1), orders=_matvec_orders, example=_ex_moe_down_bias)
def moe_down_bias(h: np.ndarray, ids: np.ndarray, wd: np.ndarray, bd: np.ndarray, *,
                  k_block: int, across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``y[r, s] = round(round(h[r, s] · wd[e]ᵀ) + bd[e])`` with ``e = ids[r, s]``: act
    [rows, top_k, hidden], ``wd`` f32 [E, hidden, inter], ``bd`` f32 [E, hidden].

    >>> h = np.ones((1, 1, 2), np.float32)
    >>> wd = np.full((2, 1, 2), 2.0, np.float32)
    >>> moe_down_bias(h, np.array([[1]], np.int32), wd, np.array([[0.0], [0.5]], np.float32),
    ...               k_block=2, act="f32")[0].tolist()
    [[[4.5]]]
    """
    fam, sizes = "moe_down_bias", {}
    dt = act_dtype(fam, act)
    _shape(fam, "h", h, ("rows", "top_k", "inter"), sizes, (dt,))
    _shape(fam, "ids", ids, ("rows", "top_k"), sizes, "int")
    _shape(fam, "wd", wd, ("experts", "hidden", "inter"), sizes, (F32,))
    _shape(fam, "bd", bd, ("experts", "hidden"), sizes, (F32,))
    idx = _index(fam, "ids", ids, sizes["experts"], "expert id")
    hf = h.astype(F32)
    y = np.empty((sizes["rows"], sizes["top_k"], sizes["hidden"]), dt)
    for e, r, s in _by_expert(idx):
        y[r, s] = round_to(round_to(blocked_matvec(np.ascontiguousarray(hf[r, s]), wd[e],
                                                   k_block, across), dt) + bd[e][None, :],
                           dt).astype(dt)
    return (y,)
