"""Element types: one frozen ``DType`` per storage format, backed by ``ml_dtypes``.

Sizes are in **bits** (``element_size_bits``), because e2m1 is half a byte.

>>> BF16.element_size_bits, E2M1.element_size_bits
(16, 4)
>>> DType.parse("bfloat16") is BF16
True
>>> E2M1.numpy.name
'float4_e2m1fn'
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from .errors import ConfigError, nearest


@attrs.frozen(repr=False, cache_hash=True)
class DType:
    """A storage element type: its canonical name, its width in bits and its NumPy dtype.

    >>> import ml_dtypes
    >>> F8E4M3.numpy == np.dtype(ml_dtypes.float8_e4m3fn)
    True
    """

    name: str
    element_size_bits: int
    numpy_name: str
    is_float: bool = True

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype holding one element (e2m1 is unpacked: one element per byte)."""
        return _numpy_dtype(self.numpy_name)

    @property
    def itemsize(self) -> float:
        """Bytes per element in packed storage (0.5 for e2m1)."""
        return self.element_size_bits / 8

    def nbytes(self, count: int) -> int:
        """Bytes that ``count`` packed elements take (rounded up to whole bytes)."""
        return (count * self.element_size_bits + 7) // 8

    @staticmethod
    def parse(text: str, *, file: object = None, key: str | None = None) -> DType:
        """The dtype a spelling names (``bf16``, ``bfloat16``, ``fp8_e4m3`` …).

        >>> DType.parse("fp9", key="dtype")
        Traceback (most recent call last):
        ...
        metrale.lkb.errors.ConfigError: dtype: unknown dtype (expected one of bf16, e2m1, e4m3, e5m2, e8m0, f16, f32, f64, i16, i32, i64, i8, u8, found 'fp9'); did you mean 'fp8'?
        """
        found = DType.named(text)
        if found is None:
            raise ConfigError(
                "unknown dtype",
                file=file,
                key=key,
                expected="one of " + ", ".join(sorted(d.name for d in ALL)),
                found=repr(text),
                suggestion=nearest(str(text).lower(), _SPELLINGS),
            )
        return found

    @staticmethod
    def named(text: object) -> DType | None:
        """The dtype a spelling names, or None where it names none (:meth:`parse` raises).

        >>> DType.named("bf16").element_size_bits, DType.named("decode")
        (16, None)
        """
        return _SPELLINGS.get(str(text).lower())

    @staticmethod
    def of(array: np.ndarray) -> DType:
        """The dtype of a NumPy array's elements."""
        for d in ALL:
            if d.numpy == array.dtype:
                return d
        raise ConfigError("array dtype has no Metrale dtype", found=str(array.dtype))

    def __repr__(self) -> str:
        return self.name.upper() if self.name.upper() in globals() else f"DType.parse({self.name!r})"

    def __str__(self) -> str:
        return self.name


# NumPy's own dtypes by name; the others are ml_dtypes', imported on first use: importing
# ml_dtypes takes about 0.7 s, which a command that never touches an array (met plan, met build)
# should not pay.
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn", "float8_e8m0fnu")


@functools.cache
def _numpy_dtype(name: str) -> np.dtype:
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


F64 = DType("f64", 64, "float64")
F32 = DType("f32", 32, "float32")
F16 = DType("f16", 16, "float16")
BF16 = DType("bf16", 16, "bfloat16")
E4M3 = DType("e4m3", 8, "float8_e4m3fn")
E5M2 = DType("e5m2", 8, "float8_e5m2")
E2M1 = DType("e2m1", 4, "float4_e2m1fn")
E8M0 = DType("e8m0", 8, "float8_e8m0fnu")
I64 = DType("i64", 64, "int64", is_float=False)
I32 = DType("i32", 32, "int32", is_float=False)
I16 = DType("i16", 16, "int16", is_float=False)
I8 = DType("i8", 8, "int8", is_float=False)
U8 = DType("u8", 8, "uint8", is_float=False)

ALL = (F64, F32, F16, BF16, E4M3, E5M2, E2M1, E8M0, I64, I32, I16, I8, U8)
F8E4M3, F8E5M2 = E4M3, E5M2

_SPELLINGS: dict[str, DType] = {}
for _d in ALL:
    _SPELLINGS[_d.name] = _d
    _SPELLINGS[_d.numpy_name] = _d
_SPELLINGS.update(
    {
        "fp64": F64, "double": F64, "fp32": F32, "float": F32, "fp16": F16, "half": F16,
        "fp8": E4M3, "fp8_e4m3": E4M3, "f8e4m3": E4M3, "float8_e4m3": E4M3, "f8_e4m3": E4M3,
        "fp8_e5m2": E5M2, "f8e5m2": E5M2, "f8_e5m2": E5M2, "fp4": E2M1, "fp4_e2m1": E2M1,
        "f4e2m1": E2M1, "float4_e2m1": E2M1, "ue8m0": E8M0, "int64": I64, "int32": I32,
        "int16": I16, "int8": I8, "uint8": U8, "F64": F64,
        # safetensors header spellings
        "f8_e8m0": E8M0, "f4": E2M1,
    }
)
