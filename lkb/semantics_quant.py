"""Reference semantics of ``dequant``: storage-format weights as the f32 values they stand for.

The host realization binds a quantized weight by dequantizing it once at load, with the
format's own rule (``metrale.lkb.quant``: value × block scale (× global scale) in f32), so on
the host the family is the identity on those f32 values. A fused GPU kernel that dequantizes
on the fly in the same f32 arithmetic gives the same bytes, which is why the relation
``dequant_linear`` is declared bit-identical.

>>> import numpy as np
>>> w = np.arange(6, dtype=np.float32).reshape(2, 3)
>>> (dequant(w)[0] == w).all() and dequant(w)[0] is not w
True
"""

from __future__ import annotations

import numpy as np

from .semantics import F32, SemanticsError, semantics


def _ex_dequant(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    return (rng.standard_normal((24, 64)).astype(np.float32),), {}


@semantics("dequant", rows=(), row_outputs=(), example=_ex_dequant)
def dequant(wq: np.ndarray) -> tuple[np.ndarray]:
    """The f32 values of a weight already dequantized at load (a copy, never the input)."""
    if wq.dtype != F32:
        raise SemanticsError("host weights are f32 (dequantized at load)", key="dequant.wq",
                             expected="f32", found=str(wq.dtype))
    return (wq.copy(),)
