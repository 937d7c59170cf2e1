"""Reference semantics of the layout families: ``dequant``, ``split_heads``, ``merge_heads``,
``last_row``.

``dequant`` gives storage-format weights as the f32 values they stand for.

The host realization binds a quantized weight by dequantizing it once at load, with the
format's own rule (``metrale.lkb.quant``: value × block scale (× global scale) in f32), so on
the host the family is the identity on those f32 values. A fused GPU kernel that dequantizes
on the fly in the same f32 arithmetic gives the same bytes, which is why the relation
``dequant_linear`` is declared bit-identical.

The views reinterpret a row's ``heads * d`` values as ``heads`` vectors of ``d`` and back;
no value changes, so any realization aliases the buffer instead of running a kernel.

>>> import numpy as np
>>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
>>> (dequant(w)[0] == w).all() and dequant(w)[0] is not w
True
>>> split_heads(np.arange(8, dtype=np.float32).reshape(1, 8), heads=2)[0].shape
(1, 2, 4)
>>> merge_heads(np.zeros((3, 2, 4), np.float32))[0].shape
(3, 8)
>>> last_row(np.arange(6, dtype=np.float32).reshape(3, 2), act="f32")[0]
array([[4., 5.]], dtype=float32)
"""

from __future__ import annotations

import numpy as np

from .semantics import F32, SemanticsError, _rand, act_dtype, semantics


def _ex_dequant(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    return (rng.standard_normal((24, 64)).astype(np.float32),), {}


@semantics("dequant", rows=(), row_outputs=(), example=_ex_dequant)
def dequant(wq: np.ndarray) -> tuple[np.ndarray]:
    """The f32 values of a weight already dequantized at load (a copy, never the input)."""
    if wq.dtype != F32:
        raise SemanticsError("host weights are f32 (dequantized at load)", key="dequant.wq",
                             expected="f32", found=str(wq.dtype))
    return (wq.copy(),)


def _ex_split(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    return (rng.standard_normal((rows, 64)).astype(np.float32),), {"heads": 4}


@semantics("split_heads", example=_ex_split)
def split_heads(x: np.ndarray, *, heads: int) -> tuple[np.ndarray]:
    """``[rows, heads * d]`` viewed as ``[rows, heads, d]`` (a view of the same memory)."""
    if x.ndim != 2 or x.shape[1] % heads:
        raise SemanticsError("cannot split into heads", key="split_heads.x",
                             expected=f"[rows, a multiple of {heads}]", found=str(x.shape))
    return (x.reshape(x.shape[0], heads, x.shape[1] // heads),)


def _ex_merge(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    return (rng.standard_normal((rows, 4, 16)).astype(np.float32),), {}


@semantics("merge_heads", example=_ex_merge)
def merge_heads(x: np.ndarray) -> tuple[np.ndarray]:
    """``[rows, heads, d]`` viewed as ``[rows, heads * d]`` (a view of the same memory)."""
    if x.ndim != 3:
        raise SemanticsError("cannot merge heads", key="merge_heads.x",
                             expected="[rows, heads, d]", found=str(x.shape))
    return (x.reshape(x.shape[0], -1),)


def _ex_last_row(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    return (_rand(rng, (rows, 64), act_dtype("last_row", act)),), {"act": act}


@semantics("last_row", row_outputs=(), row_invariant=False, example=_ex_last_row)
def last_row(x: np.ndarray, *, act: str) -> tuple[np.ndarray]:
    """Row ``rows - 1`` of ``x`` [rows, h], as [1, h] (a copy): a prefill's only row that
    generation needs past the last layer. Not row-invariant: the row it keeps is the last."""
    dt = act_dtype("last_row", act)
    if x.ndim != 2 or x.shape[0] < 1 or x.dtype != dt:
        raise SemanticsError("bad input", key="last_row.x", expected=f"{dt}[rows >= 1, h]",
                             found=f"{x.dtype}{list(x.shape)}")
    return (x[-1:].copy(),)

