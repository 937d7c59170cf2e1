"""Reference semantics of the kernel families: NumPy functions that define each result exactly.

Every reduction's order is declared as data (:class:`Reduction`) and followed by the code, so
"bit-identical" means equal bytes; the host hardware class runs these functions as its kernels.

Conventions. A family is a plain function registered in :data:`SEMANTICS` by
``@semantics("name")``: input arrays positionally, point parameters as keywords, a *tuple* of
outputs. Activations have the dtype named by the keyword ``act`` (``"bf16"`` or ``"f32"``);
inputs of the wrong dtype are refused, never converted. Math is f32; an output is rounded to
``act`` once, by ``astype`` (round to nearest even), and wherever Hugging Face rounds an
intermediate to the activation dtype, the family rounds it too (each docstring says where).
Weights arrive in f32 (the host realization upcasts or dequantizes them once at load; bf16 to
f32 is exact); embedding tables may be bf16 or f32. Inputs are never mutated, except the KV
caches of ``kv_append`` and ``kv_append_attention``, which are written in place and returned.

Every matmul-like family reduces through :func:`blocked_matvec`: ``k`` is cut into blocks of
``k_block``; within a block the order is that of the BLAS ``sgemv`` NumPy calls for
``w_block @ x_block_row``, once per row (so the result is row-invariant: a row's bytes do not
depend on the other rows); the block partial sums are then combined sequentially or pairwise.
The within-block order is that of the BLAS kernel for this CPU (OpenBLAS picks one per
micro-architecture), so bytes are reproducible for one BLAS build and kernel set;
bit-identity claims compare runs on one machine.

Laws, checked here and by Hypothesis in ``tests/host/test_semantics.py``:

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> x = rng.standard_normal((3, 64)).astype(np.float32)
>>> r = rng.standard_normal((3, 64)).astype(np.float32)
>>> w = rng.standard_normal(64).astype(np.float32)
>>> s, y = add_rmsnorm(x, r, w, eps=1e-6, h_block=16, act="f32")
>>> s.tobytes() == add(x, r, act="f32")[0].tobytes()
True
>>> y.tobytes() == rmsnorm(s, w, eps=1e-6, h_block=16, act="f32")[0].tobytes()
True

Row invariance: row 1 alone gives the bytes it gives inside the batch.

>>> wl = rng.standard_normal((5, 64)).astype(np.float32)
>>> whole = linear(x, wl, k_block=16, act="f32")[0]
>>> whole[1:2].tobytes() == linear(x[1:2], wl, k_block=16, act="f32")[0].tobytes()
True
>>> describe(reduction_orders("linear", k_block=256)[0])
'k (x·w): f32, blocks of 256, partial sums combined sequentially; within a block: BLAS sgemv order'
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np

from .dtype import BF16 as _BF16_TYPE
from .errors import ConfigError, LaunchError, nearest

F32 = np.dtype(np.float32)


def _bf16() -> np.dtype:
    """ml_dtypes' bfloat16, which lkb.dtype imports on first use (the import takes about
    0.7 s, which planning and building never need)."""
    return _BF16_TYPE.numpy


@functools.cache
def _act_dtypes() -> Mapping[str, np.dtype]:
    """The activation dtypes a family accepts, by the spelling of its ``act`` keyword."""
    return {"bf16": _bf16(), "f32": F32}


def __getattr__(name: str) -> Any:
    # BF16 and ACT_DTYPES ({"bf16": BF16, "f32": F32}) as module constants, made when asked
    if name == "BF16":
        return _bf16()
    if name == "ACT_DTYPES":
        return _act_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

ACROSS = ("sequential", "pairwise")
WITHIN: Mapping[str, str] = {
    "": "",
    "gemv": "BLAS sgemv order",
    "gemm": "BLAS sgemm order",
    "pairwise": "NumPy pairwise summation",
    "sequential": "left to right",
    "mma": "tensor-core MMA order",
    "wgmma": "tensor-core MMA order (wgmma)",
    "wgmma_scaled": "tensor-core MMA order (wgmma), the row's f32 scale times the finished sum",
    "mma_scaled": "tensor-core MMA order, the row's f32 scale times the finished sum",
}
"""Within-block orders, by code, with the words :func:`describe` uses for them."""


class SemanticsError(LaunchError, ValueError):
    """A family call refused before it computed anything: bad shape, dtype, parameter or index.

    The key is ``family.input`` (or ``family.input[row]``); it is a ``ValueError`` too.

    >>> try:
    ...     add(np.ones((1, 2), np.float32), np.ones((1, 3), np.float32), act="f32")
    ... except SemanticsError as e:
    ...     print(e)
    add.b: bad shape (expected h = 2 in axis 1 of (rows, h), found (1, 3))
    """


@attrs.frozen
class Reduction:
    """The order of one reduction: its axis, accumulator, block size and how blocks combine.

    ``block`` 0 means the whole axis is one block. ``within`` names the order inside a block
    (a key of :data:`WITHIN`; empty when a realization leaves it unstated) and ``of`` says what
    is being summed.

    >>> Reduction("k", "f32", 256, "sequential", within="gemv", of="x·w").block
    256
    >>> Reduction("k", "f32", 256, "backwards")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: Reduction.across: unknown order (expected one of sequential, pairwise, found 'backwards')
    """

    axis: str
    accumulate: str
    block: int
    across: str
    within: str = ""
    of: str = ""

    def __attrs_post_init__(self) -> None:
        if self.across not in ACROSS:
            raise ConfigError("unknown order", key="Reduction.across",
                              expected="one of " + ", ".join(ACROSS), found=repr(self.across),
                              suggestion=nearest(self.across, ACROSS))
        if self.within not in WITHIN:
            raise ConfigError("unknown order", key="Reduction.within",
                              expected="one of " + ", ".join(k for k in WITHIN if k),
                              found=repr(self.within), suggestion=nearest(self.within, WITHIN))
        if not isinstance(self.block, int) or self.block < 0:
            raise ConfigError("bad block size", key="Reduction.block",
                              expected="an int >= 0", found=repr(self.block))


def describe(r: Reduction) -> str:
    """The order of ``r`` in words.

    >>> describe(Reduction("h", "f32", 0, "sequential", within="pairwise"))
    'h: f32, one block; within it: NumPy pairwise summation'
    """
    head = f"{r.axis} ({r.of})" if r.of else r.axis
    text = f"{head}: {r.accumulate}, "
    if r.block:
        text += f"blocks of {r.block}, partial sums combined {_ACROSS_WORDS[r.across]}"
        inside = "within a block"
    else:
        text += "one block"
        inside = "within it"
    if r.within:
        text += f"; {inside}: {WITHIN[r.within]}"
    return text


_ACROSS_WORDS = {"sequential": "sequentially", "pairwise": "pairwise"}

Family = Callable[..., tuple[np.ndarray, ...]]
SEMANTICS: dict[str, Family] = {}
"""Every family's reference semantics, by family name."""
ROW_INVARIANT: dict[str, bool] = {}
"""Whether a family's row ``r`` output bytes are independent of the other rows (all but
``last_row``, which keeps the last row)."""
ROW_ARGS: dict[str, tuple[int, ...]] = {}
"""Positions of the inputs that carry a leading ``rows`` axis, by family."""
ROW_OUTPUTS: dict[str, tuple[int, ...]] = {}
"""Positions of the outputs with a leading ``rows`` axis, where not all are (KV caches have none)."""
_ORDERS: dict[str, Callable[[Mapping[str, Any]], tuple[Reduction, ...]]] = {}
_EXAMPLES: dict[str, Callable[[np.random.Generator, int, str], tuple[tuple, dict]]] = {}


def semantics(
    name: str,
    *,
    rows: tuple[int, ...] = (0,),
    row_outputs: tuple[int, ...] | None = None,
    orders: Callable[[Mapping[str, Any]], tuple[Reduction, ...]] | None = None,
    example: Callable[[np.random.Generator, int, str], tuple[tuple, dict]] | None = None,
    row_invariant: bool = True,
) -> Callable[[Family], Family]:
    """Register a family's semantics under ``name``, with its orders and a small example.

    ``rows`` lists the inputs with a leading rows axis, ``row_outputs`` the outputs with one
    (default: all of them); ``orders(params)`` returns the family's reductions; ``example(rng,
    rows, act)`` returns ``(args, params)`` for a small random call.

    >>> sorted(SEMANTICS)[:3]
    ['add', 'add_rmsnorm', 'all_gather']
    """

    def register(fn: Family) -> Family:
        if name in SEMANTICS:
            raise ConfigError("family registered twice", key=name)
        SEMANTICS[name] = fn
        ROW_INVARIANT[name] = row_invariant
        ROW_ARGS[name] = rows
        if row_outputs is not None:
            ROW_OUTPUTS[name] = row_outputs
        _ORDERS[name] = orders or (lambda params: ())
        if example is not None:
            _EXAMPLES[name] = example
        return fn

    return register


def _family(name: str) -> None:
    if name not in SEMANTICS:
        raise ConfigError("unknown kernel family", key=name, expected="a registered family",
                          found=repr(name), suggestion=nearest(name, SEMANTICS))


def reduction_orders(family: str, **params: Any) -> tuple[Reduction, ...]:
    """The reductions ``family`` performs at the point ``params``, in the order it performs them.

    >>> [r.axis for r in reduction_orders("attention", kv_block=64)]
    ['head_dim', 'kv_len', 'kv_len']
    >>> reduction_orders("linear")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: linear.k_block: missing parameter (expected an int >= 1, found none)
    """
    _family(family)
    return _ORDERS[family](_Params(family, params))


class _Params(dict):
    """Point parameters of one family; a missing one is a ``ConfigError`` naming it."""

    def __init__(self, family: str, params: Mapping[str, Any]):
        super().__init__(params)
        self.family = family

    def __missing__(self, key: str) -> Any:
        expected = "an int >= 1" if key.endswith("block") else "a value"
        raise ConfigError("missing parameter", key=f"{self.family}.{key}", expected=expected,
                          found="none")


def example(family: str, *, rows: int = 3, act: str = "f32", seed: int = 0) -> tuple[tuple, dict]:
    """Small random inputs and parameters for ``family``: ``fn(*args, **params)`` runs.

    >>> args, params = example("rmsnorm", rows=2, act="bf16")
    >>> [a.shape for a in args], params["h_block"]
    ([(2, 64), (64,)], 16)
    """
    _family(family)
    if family not in _EXAMPLES:
        raise ConfigError("family has no example", key=family)
    return _EXAMPLES[family](np.random.default_rng(seed), rows, act)


# ---------------------------------------------------------------------------------------------
# Checking inputs: every refusal names family.input, what was expected and what was found.


def _fail(family: str, name: str, message: str, expected: Any, found: Any,
          suggestion: str | None = None) -> SemanticsError:
    return SemanticsError(message, key=f"{family}.{name}", expected=expected, found=found,
                          suggestion=suggestion)


def act_dtype(family: str, act: str) -> np.dtype:
    """The NumPy dtype that ``act`` names; anything else is a ``SemanticsError``.

    >>> act_dtype("add", "bf16").name
    'bfloat16'
    """
    try:
        return _act_dtypes()[act]
    except (KeyError, TypeError):
        raise _fail(family, "act", "unknown activation dtype", "one of bf16, f32", repr(act),
                    nearest(str(act), _act_dtypes())) from None


def _shape(family: str, name: str, a: Any, dims: tuple[str, ...], sizes: dict[str, int],
           dtypes: tuple[np.dtype, ...] | str) -> np.ndarray:
    """Check ``a`` against named dims (binding new names in ``sizes``) and its dtype.

    ``dtypes`` is a tuple of allowed dtypes, or ``"int"`` for any integer dtype.
    """
    if not isinstance(a, np.ndarray):
        raise _fail(family, name, "not an array", "numpy.ndarray", type(a).__name__)
    pattern = "(" + ", ".join(dims) + ")"
    if a.ndim != len(dims):
        raise _fail(family, name, "bad rank", f"{len(dims)} axes {pattern}", a.shape)
    for axis, (dim, n) in enumerate(zip(dims, a.shape)):
        if dim in sizes and sizes[dim] != n:
            raise _fail(family, name, "bad shape", f"{dim} = {sizes[dim]} in axis {axis} of "
                        f"{pattern}", a.shape)
        sizes.setdefault(dim, n)
    if dtypes == "int":
        if a.dtype.kind not in "iu":
            raise _fail(family, name, "bad dtype", "an integer dtype", a.dtype.name)
    elif a.dtype not in dtypes:
        raise _fail(family, name, "bad dtype", " or ".join(d.name for d in dtypes), a.dtype.name)
    return a


def _index(family: str, name: str, a: np.ndarray, bound: int, what: str) -> np.ndarray:
    """``a`` as int64, every entry in ``[0, bound)``; else an error naming the first bad row."""
    a = a.astype(np.int64, copy=False)
    bad = np.flatnonzero((a < 0) | (a >= bound))
    if bad.size:
        i = int(bad[0])
        where = np.unravel_index(i, a.shape)
        at = ",".join(map(str, where))
        raise _fail(family, f"{name}[{at}]", f"{what} out of range", f"0 <= {what} < {bound}",
                    int(a.reshape(-1)[i]))
    return a


def _param(family: str, name: str, value: Any, kind: type | tuple[type, ...],
           minimum: int | None = None) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    what = "/".join(k.__name__ for k in kinds)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise _fail(family, name, "bad parameter", what, repr(value))
    if minimum is not None and value < minimum:
        raise _fail(family, name, "bad parameter", f"{what} >= {minimum}", repr(value))
    return value


def _choice(family: str, name: str, value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise _fail(family, name, "bad parameter", "one of " + ", ".join(choices), repr(value),
                    nearest(str(value), choices))
    return value


def round_to(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``a`` (f32) rounded to ``dt`` and widened back to f32: the value a ``dt`` tensor holds.

    >>> from metrale.lkb.semantics import BF16
    >>> round_to(np.array([1.00390625], np.float32), BF16)
    array([1.], dtype=float32)
    """
    return a if dt == F32 else a.astype(dt).astype(F32)


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=F32)


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: np.dtype | str,
          scale: float = 1.0) -> np.ndarray:
    """Random normal values (never zeros) in ``dt``."""
    dt = _act_dtypes()[dt] if isinstance(dt, str) else dt
    return (rng.standard_normal(shape) * scale).astype(F32).astype(dt)


# ---------------------------------------------------------------------------------------------
# The shared reduction orders.


def combine(parts: list[np.ndarray], across: str) -> np.ndarray:
    """Partial sums combined in f32: ``sequential`` is ((p0 + p1) + p2) + …; ``pairwise`` adds
    adjacent pairs level by level, an odd last partial carried up unchanged.

    >>> p = [np.float32(x) for x in (1e8, 1.0, -1e8, 1.0)]
    >>> float(combine(p, "sequential")), float(combine(p, "pairwise"))
    (1.0, 0.0)
    """
    if across == "sequential":
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc
    while len(parts) > 1:
        nxt = [parts[i] + parts[i + 1] for i in range(0, len(parts) - 1, 2)]
        if len(parts) % 2:
            nxt.append(parts[-1])
        parts = nxt
    return parts[0]


_PARTIALS = 1 << 24
"""The most block partials (floats) a sequential :func:`blocked_matvec` holds at once."""


def blocked_matvec(x: np.ndarray, w: np.ndarray, k_block: int,
                   across: str = "sequential") -> np.ndarray:
    """``x @ w.T`` in f32 with a declared order: ``x`` f32[rows, k], ``w`` f32[n, k] → f32[rows, n].

    ``k`` is cut into blocks of ``k_block`` (the last may be shorter). Block ``b`` of row ``r``
    is one BLAS ``sgemv``, ``w[:, block] @ x[r, block]``, the same call whatever the other rows
    are (NumPy's stacked ``matmul`` calls gemv once per stack item); the block partials are
    combined by :func:`combine`. Every matmul-like family reduces through this function.

    >>> x = np.arange(1, 9, dtype=np.float32).reshape(1, 8)
    >>> blocked_matvec(x, np.ones((2, 8), np.float32), 3)
    array([[36., 36.]], dtype=float32)
    """
    fam = "blocked_matvec"
    sizes: dict[str, int] = {}
    _shape(fam, "x", x, ("rows", "k"), sizes, (F32,))
    _shape(fam, "w", w, ("n", "k"), sizes, (F32,))
    _param(fam, "k_block", k_block, int, 1)
    _choice(fam, "across", across, ACROSS)
    rows, k = x.shape
    n = w.shape[0]
    x = np.ascontiguousarray(x)
    if w.strides[1] != w.itemsize:
        w = np.ascontiguousarray(w)
    nb, tail = divmod(k, k_block)
    # Blocks outermost so each weight block stays in cache while every row passes over it; a
    # sequential sum takes them a group at a time, so that small blocks (k_block = 16) do not
    # hold every partial at once: (nb, rows, n) floats would be 1.6 GB for a 2048-row matmul of
    # k 1024 and n 3072.
    step = max(1, nb if across != "sequential" else _PARTIALS // max(1, rows * n))
    parts: list[np.ndarray] = []
    for b0 in range(0, nb, step):
        b1 = min(nb, b0 + step)
        wv = w[:, b0 * k_block: b1 * k_block].reshape(n, b1 - b0, k_block).transpose(1, 0, 2)
        xv = x[:, b0 * k_block: b1 * k_block].reshape(rows, b1 - b0, k_block).transpose(1, 0, 2)
        group = list(np.matmul(wv[:, None], xv[..., None])[..., 0])  # (b1 - b0, rows, n)
        parts = [combine(parts + group, across)] if across == "sequential" else parts + group
    if tail:
        parts.append(np.matmul(w[None, :, nb * k_block:], x[:, nb * k_block:, None])[..., 0])
    return np.ascontiguousarray(combine(parts, across))


def blocked_sum(a: np.ndarray, block: int, across: str = "sequential") -> np.ndarray:
    """Sum over the last axis of f32 ``a`` in blocks of ``block``: each block by NumPy's pairwise
    summation (``np.add.reduce`` over the contiguous block), block partials by :func:`combine`.

    >>> float(blocked_sum(np.array([1e8, 1, -1e8, 1], np.float32), 2)[()])
    0.0
    """
    h = a.shape[-1]
    nb, tail = divmod(h, block)
    parts: list[np.ndarray] = []
    if nb:
        full = np.add.reduce(a[..., : nb * block].reshape(*a.shape[:-1], nb, block), axis=-1)
        parts = [full[..., b] for b in range(nb)]
    if tail:
        parts.append(np.add.reduce(a[..., nb * block:], axis=-1))
    return combine(parts, across)


def rms_normalize(xf: np.ndarray, w: np.ndarray, eps: float, h_block: int,
                  dt: np.dtype) -> np.ndarray:
    """RMS norm over the last axis of f32 ``xf``, as Hugging Face's Llama/Qwen3 RMSNorm orders it.

    ``ss`` = :func:`blocked_sum` of ``xf*xf`` in blocks of ``h_block`` (combined sequentially);
    ``inv = 1 / sqrt(ss / h + eps)``; ``y = round(round(xf * inv) * w)``, every product in f32
    and each rounding to ``dt`` (HF: ``hidden * rsqrt(var + eps)``, ``.to(input_dtype)``,
    ``weight * that``). Returns f32 values holding ``dt`` values.
    """
    h = xf.shape[-1]
    ss = blocked_sum(xf * xf, h_block)
    inv = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
    return round_to(round_to(xf * inv[..., None], dt) * w, dt)


def _norm_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("h", "f32", p["h_block"], "sequential", within="pairwise", of="x²"),)


def _matvec_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("k", "f32", p["k_block"], p.get("across", "sequential"), within="gemv",
                      of="x·w"),)


# ---------------------------------------------------------------------------------------------
# Elementwise, norm and matmul-like families.


def _ex_embedding(rng, rows, act):
    vocab, hidden = 50, 64
    return (rng.integers(0, vocab, rows).astype(np.int32), _rand(rng, (vocab, hidden), act)), {
        "act": act}


@semantics("embedding", example=_ex_embedding)
def embedding(ids: np.ndarray, table: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """Gather rows of ``table`` (bf16 or f32 [vocab, hidden]) for i32 ``ids`` [rows], cast to act.

    >>> table = np.arange(6, dtype=np.float32).reshape(3, 2)
    >>> embedding(np.array([2, 0], np.int32), table, act="f32")[0]
    array([[4., 5.],
           [0., 1.]], dtype=float32)
    """
    fam, sizes = "embedding", {}
    dt = act_dtype(fam, act)
    _shape(fam, "ids", ids, ("rows",), sizes, "int")
    _shape(fam, "table", table, ("vocab", "hidden"), sizes, (_bf16(), F32))
    idx = _index(fam, "ids", ids, sizes["vocab"], "id")
    return (table[idx].astype(dt),)


def _ex_add(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (rows, 64), act)), {"act": act}


@semantics("add", rows=(0, 1), example=_ex_add)
def add(a: np.ndarray, b: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """``round(f32(a) + f32(b))``: the residual add (one rounding, as torch's bf16 add).

    >>> from metrale.lkb.semantics import BF16
    >>> add(np.ones((1, 2), BF16), np.full((1, 2), 2**-9, BF16), act="bf16")[0].astype(F32)
    array([[1., 1.]], dtype=float32)
    """
    fam, sizes = "add", {}
    dt = act_dtype(fam, act)
    _shape(fam, "a", a, ("rows", "h"), sizes, (dt,))
    _shape(fam, "b", b, ("rows", "h"), sizes, (dt,))
    return ((a.astype(F32) + b.astype(F32)).astype(dt),)


def _ex_rmsnorm(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (64,), F32)), {
        "eps": 1e-6, "h_block": 16, "act": act}


@semantics("rmsnorm", orders=_norm_orders, example=_ex_rmsnorm)
def rmsnorm(x: np.ndarray, w: np.ndarray, *, eps: float, h_block: int,
            act: str) -> tuple[np.ndarray]:
    """RMS norm of each row of ``x`` [rows, h] with f32 weight ``w`` [h]; see :func:`rms_normalize`.

    >>> y, = rmsnorm(np.full((1, 4), 3.0, np.float32), np.full(4, 2.0, np.float32),
    ...              eps=0.0, h_block=2, act="f32")
    >>> y
    array([[2., 2., 2., 2.]], dtype=float32)
    """
    fam, sizes = "rmsnorm", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "h"), sizes, (dt,))
    _shape(fam, "w", w, ("h",), sizes, (F32,))
    _param(fam, "eps", eps, numbers.Real)
    _param(fam, "h_block", h_block, int, 1)
    return (rms_normalize(x.astype(F32), w, eps, h_block, dt).astype(dt),)


def _ex_add_rmsnorm(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (rows, 64), act), _rand(rng, (64,), F32)), {
        "eps": 1e-6, "h_block": 16, "act": act}


@semantics("add_rmsnorm", rows=(0, 1), orders=_norm_orders, example=_ex_add_rmsnorm)
def add_rmsnorm(x: np.ndarray, r: np.ndarray, w: np.ndarray, *, eps: float, h_block: int,
                act: str) -> tuple[np.ndarray, np.ndarray]:
    """``s = add(x, r)``, ``y = rmsnorm(s, w)``: both outputs, byte-identical to the two families.

    >>> one = np.ones((1, 4), np.float32)
    >>> [a.tolist() for a in add_rmsnorm(one, one, np.ones(4, np.float32), eps=0.0, h_block=4,
    ...                                  act="f32")]
    [[[2.0, 2.0, 2.0, 2.0]], [[1.0, 1.0, 1.0, 1.0]]]
    """
    (s,) = add(x, r, act=act)
    return s, rmsnorm(s, w, eps=eps, h_block=h_block, act=act)[0]


def _ex_linear(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (24, 64), F32, 0.1)), {
        "k_block": 16, "across": "sequential", "out": "act", "act": act}


@semantics("linear", orders=_matvec_orders, example=_ex_linear)
def linear(x: np.ndarray, w: np.ndarray, *, k_block: int, across: str = "sequential",
           out: str = "act", act: str) -> tuple[np.ndarray]:
    """``y = x @ w.T`` by :func:`blocked_matvec`, rounded to act (``out="act"``) or kept f32.

    ``x`` act [rows, k], ``w`` f32 [n, k]. ``out="f32"`` serves logits (lm_head).

    >>> from metrale.lkb.semantics import BF16
    >>> x = np.ones((1, 4), BF16)
    >>> linear(x, np.full((2, 4), 0.5, np.float32), k_block=2, out="f32", act="bf16")[0]
    array([[2., 2.]], dtype=float32)
    """
    fam, sizes = "linear", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "k"), sizes, (dt,))
    _shape(fam, "w", w, ("n", "k"), sizes, (F32,))
    _choice(fam, "out", out, ("act", "f32"))
    y = blocked_matvec(_f32(x), w, k_block, across)
    return (y if out == "f32" else y.astype(dt),)


def _ex_linear_add(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (24, 64), F32, 0.1),
            _rand(rng, (rows, 24), act)), {"k_block": 16, "across": "sequential", "act": act}


@semantics("linear_add", rows=(0, 2), orders=_matvec_orders, example=_ex_linear_add)
def linear_add(x: np.ndarray, w: np.ndarray, r: np.ndarray, *, k_block: int,
               across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``add(r, linear(x, w))``: the matmul result is rounded to act first, then ``r`` plus it
    is rounded again (HF: ``residual + o_proj(h)``), byte-identical to ``t = linear(x, w);
    add(r, t)``, NaN payloads included (the residual is the first operand, whose NaN the host
    keeps; a GPU's adds give one canonical NaN either way).

    >>> x = np.ones((1, 4), np.float32)
    >>> linear_add(x, np.ones((2, 4), np.float32), x[:, :2], k_block=4, act="f32")[0]
    array([[5., 5.]], dtype=float32)
    """
    (y,) = linear(x, w, k_block=k_block, across=across, act=act)
    return add(r, y, act=act)


def _ex_qkv(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (32, 64), F32, 0.1),
            _rand(rng, (16, 64), F32, 0.1), _rand(rng, (16, 64), F32, 0.1)), {
        "k_block": 16, "across": "sequential", "act": act}


@semantics("qkv", orders=_matvec_orders, example=_ex_qkv)
def qkv(x: np.ndarray, wq: np.ndarray, wk: np.ndarray, wv: np.ndarray, *, k_block: int,
        across: str = "sequential", act: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The q, k and v projections of ``x``: three :func:`linear` calls on the one input
    (never one call on the stacked weights, whose BLAS order could differ).

    >>> x = np.ones((1, 2), np.float32)
    >>> [a.tolist() for a in qkv(x, *(np.full((1, 2), v, np.float32) for v in (1, 2, 3)),
    ...                          k_block=2, act="f32")]
    [[[2.0]], [[4.0]], [[6.0]]]
    """
    fam, sizes = "qkv", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "k"), sizes, (dt,))
    for name, w in (("wq", wq), ("wk", wk), ("wv", wv)):
        _shape(fam, name, w, (f"n_{name[1]}", "k"), sizes, (F32,))
    xf = _f32(x)
    return tuple(blocked_matvec(xf, w, k_block, across).astype(dt) for w in (wq, wk, wv))


def silu_mul(gf: np.ndarray, uf: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``round(round(silu(g)) * u)`` on f32 values, ``silu(g) = g / (1 + exp(-g))`` in f32.

    The silu output is rounded to act before the multiply, as HF's bf16
    ``act_fn(gate_proj(x)) * up_proj(x)`` does (torch's silu has act-dtype input and output).
    """
    with np.errstate(over="ignore"):
        s = gf / (np.float32(1.0) + np.exp(-gf))
    return round_to(round_to(s, dt) * uf, dt)


def _ex_swiglu(rng, rows, act):
    return (_rand(rng, (rows, 48), act, 2.0), _rand(rng, (rows, 48), act)), {"act": act}


@semantics("swiglu", rows=(0, 1), example=_ex_swiglu)
def swiglu(g: np.ndarray, u: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """``round(round(silu(f32 g)) * f32 u)``; see :func:`silu_mul`.

    >>> swiglu(np.array([[0.0, 1.0]], np.float32), np.array([[3.0, 2.0]], np.float32),
    ...        act="f32")[0]
    array([[0.       , 1.4621172]], dtype=float32)
    """
    fam, sizes = "swiglu", {}
    dt = act_dtype(fam, act)
    _shape(fam, "g", g, ("rows", "inter"), sizes, (dt,))
    _shape(fam, "u", u, ("rows", "inter"), sizes, (dt,))
    return (silu_mul(g.astype(F32), u.astype(F32), dt).astype(dt),)


def _ex_gate_up_swiglu(rng, rows, act):
    return (_rand(rng, (rows, 64), act), _rand(rng, (48, 64), F32, 0.2),
            _rand(rng, (48, 64), F32, 0.2)), {"k_block": 16, "across": "sequential", "act": act}


@semantics("gate_up_swiglu", orders=_matvec_orders, example=_ex_gate_up_swiglu)
def gate_up_swiglu(x: np.ndarray, wg: np.ndarray, wu: np.ndarray, *, k_block: int,
                   across: str = "sequential", act: str) -> tuple[np.ndarray]:
    """``swiglu(linear(x, wg), linear(x, wu))``: gate and up rounded to act before the silu.

    >>> x = np.ones((1, 2), np.float32)
    >>> gate_up_swiglu(x, np.full((1, 2), 0.5, np.float32), np.ones((1, 2), np.float32),
    ...                k_block=2, act="f32")[0]
    array([[1.4621172]], dtype=float32)
    """
    fam, sizes = "gate_up_swiglu", {}
    dt = act_dtype(fam, act)
    _shape(fam, "x", x, ("rows", "k"), sizes, (dt,))
    _shape(fam, "wg", wg, ("inter", "k"), sizes, (F32,))
    _shape(fam, "wu", wu, ("inter", "k"), sizes, (F32,))
    xf = _f32(x)
    g = round_to(blocked_matvec(xf, wg, k_block, across), dt)
    u = round_to(blocked_matvec(xf, wu, k_block, across), dt)
    return (silu_mul(g, u, dt).astype(dt),)


def _ex_argmax(rng, rows, act):
    return (_rand(rng, (rows, 40), F32),), {}


@semantics("argmax", example=_ex_argmax)
def argmax(logits: np.ndarray) -> tuple[np.ndarray]:
    """The i32 index of each row's largest logit (bf16 or f32), the first one on ties.

    >>> argmax(np.array([[1.0, 3.0, 3.0], [2.0, 0.0, 1.0]], np.float32))[0]
    array([1, 0], dtype=int32)
    """
    _shape("argmax", "logits", logits, ("rows", "vocab"), {}, (_bf16(), F32))
    return (np.argmax(logits, axis=-1).astype(np.int32),)


# The attention and MoE families live in their own modules and register themselves here.
from . import (  # noqa: E402, F401
    semantics_attention,
    semantics_collective,
    semantics_layout,
    semantics_moe,
    semantics_moe_clamp,
    semantics_sample,
    semantics_sink,
)
