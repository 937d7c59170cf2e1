"""Types of wires: ``TensorType`` (a symbolic shape and a dtype) and ``Ty``, their monoidal product.

Dimensions are integers or names (``"rows"``, ``"hidden"``) or small arithmetic over names
(``"heads*head_dim"``); :meth:`TensorType.bind` evaluates them against concrete sizes.

Laws (the monoid of types): ``@`` is associative with unit ``Ty()``.

>>> x = TensorType(("rows", "hidden"), BF16)
>>> w = TensorType(("hidden",), BF16)
>>> print(Ty(x) @ Ty(w))
bf16[rows,hidden] @ bf16[hidden]
>>> (Ty(x) @ Ty()) == Ty(x) == (Ty() @ Ty(x))
True
>>> a, b, c = Ty(x), Ty(w), Ty(x, w)
>>> (a @ b) @ c == a @ (b @ c)
True
>>> x.bind({"rows": 2, "hidden": 8}).shape
(2, 8)
"""

from __future__ import annotations

import ast
import operator
import threading
import types
from collections.abc import Iterator, Mapping
from functools import lru_cache

import attrs

from .dtype import BF16, DType
from .errors import AxiomError

Dim = int | str

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.FloorDiv: operator.floordiv, ast.Div: operator.floordiv}


_PARSE_LOCK = threading.Lock()


def parse_expression(text: str) -> ast.expr:
    """``ast.parse(text, mode="eval").body``, one thread at a time: CPython's AST constructor
    keeps its recursion depth in shared state, and two threads parsing at once (ranks stepping
    in threads) can fail with ``SystemError: AST constructor recursion depth mismatch``."""
    with _PARSE_LOCK:
        return ast.parse(text, mode="eval").body


def compile_expression(source: str) -> types.CodeType:
    """``compile(source, ..., "eval")``, one thread at a time as ``parse_expression`` parses
    (compiling parses the text in the same shared state)."""
    with _PARSE_LOCK:
        return compile(source, "<formula>", "eval")


@lru_cache(maxsize=4096)
def _parse_dim(text: str) -> ast.expr:
    try:
        tree = parse_expression(text)
    except SyntaxError:
        raise AxiomError("bad dimension expression", found=repr(text)) from None
    for node in ast.walk(tree):
        if not isinstance(node, ast.BinOp | ast.Name | ast.Constant | ast.operator | ast.Load):
            raise AxiomError("bad dimension expression", found=repr(text))
    return tree


def eval_dim(dim: Dim, sizes: Mapping[str, int]) -> int:
    """The size of ``dim`` given the sizes of the named dimensions.

    >>> eval_dim("q_heads*head_dim+2*kv_heads*head_dim", {"q_heads": 4, "kv_heads": 2, "head_dim": 8})
    64
    """
    if isinstance(dim, int):
        return dim

    def ev(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            try:
                return int(sizes[node.id])
            except KeyError:
                raise AxiomError("unbound dimension", key=node.id,
                                 expected="a size for it", found="none") from None
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        raise AxiomError("bad dimension expression", found=repr(dim))

    return ev(_parse_dim(dim))


def _dims(value: object) -> tuple[Dim, ...]:
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen(repr=False, cache_hash=True)
class TensorType:
    """A tensor's type: shape over symbolic dims, and element dtype.

    >>> TensorType(("rows", 4), BF16)
    TensorType(('rows', 4), BF16)
    """

    shape: tuple[Dim, ...] = attrs.field(converter=_dims)
    dtype: DType = BF16
    fmt: str = ""
    """Storage format of a quantized weight (``"mxfp4"``, ``"nvfp4"``, ``"fp8"``), else empty."""

    def bind(self, sizes: Mapping[str, int]) -> TensorType:
        """This type with every dimension evaluated to an integer."""
        return TensorType(tuple(eval_dim(d, sizes) for d in self.shape), self.dtype, self.fmt)

    def numel(self, sizes: Mapping[str, int] | None = None) -> int:
        """Element count, with named dims looked up in ``sizes``."""
        n = 1
        for d in self.shape:
            n *= eval_dim(d, sizes or {})
        return n

    def nbytes(self, sizes: Mapping[str, int] | None = None) -> int:
        """Bytes the tensor takes in packed storage."""
        return self.dtype.nbytes(self.numel(sizes))

    def __str__(self) -> str:
        return f"{self.fmt or self.dtype}[{','.join(map(str, self.shape))}]"

    def __repr__(self) -> str:
        fmt = f", fmt={self.fmt!r}" if self.fmt else ""
        return f"TensorType({self.shape!r}, {self.dtype!r}{fmt})"


def _types(value: object) -> tuple[TensorType, ...]:
    return tuple(value)  # type: ignore[arg-type]


@attrs.frozen(repr=False, init=False)
class Ty:
    """An ordered list of tensor types; ``@`` concatenates, ``Ty()`` is the unit.

    >>> len(Ty(TensorType((1,), BF16), TensorType((2,), BF16)))
    2
    """

    types: tuple[TensorType, ...]

    def __init__(self, *types: TensorType) -> None:
        for t in types:
            if not isinstance(t, TensorType):
                raise AxiomError("Ty holds TensorTypes", found=repr(t))
        self.__attrs_init__(tuple(types))

    def __matmul__(self, other: Ty) -> Ty:
        if not isinstance(other, Ty):
            return NotImplemented
        return Ty(*self.types, *other.types)

    def __len__(self) -> int:
        return len(self.types)

    def __iter__(self) -> Iterator[TensorType]:
        return iter(self.types)

    def __getitem__(self, key: int | slice) -> Ty:
        if isinstance(key, slice):
            return Ty(*self.types[key])
        return Ty(self.types[key])

    def __str__(self) -> str:
        return " @ ".join(map(str, self.types)) if self.types else "Ty()"

    def __repr__(self) -> str:
        return f"Ty({', '.join(map(repr, self.types))})"
