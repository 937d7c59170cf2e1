"""Quantization formats as frozen values: how a weight ``[..., n, k]`` is stored in fewer bits.

A format quantizes f32 weights into a :class:`QuantTensor` (packed values, scales) and defines
what those bytes mean (:meth:`QuantFormat.dequantize`, :func:`quant_linear`).

Every element conversion goes through ``ml_dtypes`` (round-to-nearest-even); the only part
written by hand is the nibble packing of e2m1, two values per byte, LOW nibble first:

>>> unpack_e2m1(np.array([0x17], np.uint8), 2).astype(np.float32)   # not -6 (the byte as e2m1)
array([6. , 0.5], dtype=float32)
>>> pack_e2m1(np.array([6.0, 0.5], np.float32))
array([23], dtype=uint8)

Laws. Values on a format's grid survive a round trip exactly, and the stored size is exact:

>>> fmt = QuantFormat.parse("mxfp4")
>>> w = np.tile(np.array([6, -4, 0.5, 1], np.float32), (3, 16))        # [3, 64]: scale 2^0
>>> bool(np.array_equal(fmt.dequantize(fmt.quantize(w)), w))
True
>>> fmt.quantize(w).nbytes == fmt.weight_bytes(3, 64) == 3 * 64 * 4.25 / 8
True
>>> x = np.ones((2, 64), np.float32)
>>> quant_linear(x, fmt.quantize(w), 32)[0].tolist()
[56.0, 56.0, 56.0]
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import attrs
import numpy as np

from .dtype import BF16, E2M1, E4M3, E5M2, E8M0, F32, U8, DType
from .errors import CheckpointError, ConfigError, nearest

_F32 = np.dtype(np.float32)
_E2M1_MAX = 6.0  # e2m1's largest value (tests/mock/test_quant_formats.py checks it)
_E2M1_EMAX = 2  # floor(log2(6)): the OCP MX rule subtracts it from the block's exponent


# ---------------------------------------------------------------- e2m1 nibble packing


def pack_e2m1(values: np.ndarray) -> np.ndarray:
    """Pack e2m1 values two per byte along the last axis, LOW nibble first.

    ``values`` is cast to ``float4_e2m1fn`` first (round-to-nearest-even, saturating at ±6).
    The last axis must have even length; the result has half of it, dtype ``uint8``.

    >>> pack_e2m1(np.array([[0.5, 6.0, -0.5, 0.0]], np.float32))
    array([[113,   9]], dtype=uint8)
    """
    v = np.asarray(values)
    if v.dtype != E2M1.numpy:
        v = v.astype(E2M1.numpy)
    if v.ndim == 0 or v.shape[-1] % 2:
        raise ConfigError("e2m1 packing needs an even count along the last axis",
                          expected="even length", found=f"shape {list(v.shape)}")
    codes = v.view(np.uint8) & np.uint8(0x0F)
    return (codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4))).astype(np.uint8)


def unpack_e2m1(packed: np.ndarray | bytes, count: int | None = None) -> np.ndarray:
    """Unpack bytes into e2m1 values along the last axis (LOW nibble first).

    ``count`` is the number of values along the last axis of the result: twice the packed
    length, or one less (the last high nibble is then padding). The result's dtype is
    ``float4_e2m1fn`` (one value per byte in memory).

    >>> unpack_e2m1(b"\\x17\\x09", 3).astype(np.float32)
    array([ 6. ,  0.5, -0.5], dtype=float32)
    """
    p = np.frombuffer(packed, np.uint8) if isinstance(packed, bytes | bytearray) else packed
    p = np.asarray(p)
    if p.dtype != np.uint8:
        raise ConfigError("packed e2m1 must be uint8", expected="uint8", found=str(p.dtype))
    full = 2 * (p.shape[-1] if p.ndim else 1)
    count = full if count is None else count
    if count not in (full, full - 1):
        raise ConfigError("e2m1 value count does not match the packed bytes",
                          expected=f"{full} or {full - 1}", found=count)
    p = p.reshape(p.shape[:-1] + (-1,)) if p.ndim else p.reshape(1)
    both = np.stack((p & np.uint8(0x0F), p >> np.uint8(4)), axis=-1)
    codes = both.reshape(p.shape[:-1] + (full,))[..., :count]
    return np.ascontiguousarray(codes).view(E2M1.numpy)


# ---------------------------------------------------------------- quantized tensors


def _same(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


@attrs.frozen(eq=False)
class QuantTensor:
    """A weight ``[..., n, k]`` in a format: packed ``data``, ``scale`` and ``global_scale``.

    Equality is byte equality of every array (and same format and logical shape).
    Arrays are checked against :meth:`QuantFormat.array_specs` on construction.

    >>> qt = QuantFormat.parse("nvfp4").quantize(np.ones((2, 16), np.float32))
    >>> qt.data.shape, qt.scale.dtype.name, qt.global_scale == np.float32(1) / np.float32(2688)
    ((2, 8), 'float8_e4m3fn', np.True_)
    >>> qt == QuantFormat.parse("nvfp4").quantize(np.ones((2, 16), np.float32))
    True
    """

    fmt: QuantFormat
    shape: tuple[int, ...] = attrs.field(converter=lambda s: tuple(int(d) for d in s))
    data: np.ndarray
    scale: np.ndarray | None = None
    global_scale: np.ndarray | None = None

    def __attrs_post_init__(self) -> None:
        specs = self.fmt.array_specs(self.shape)
        for field in ("data", "scale", "global_scale"):
            arr, spec = getattr(self, field), specs.get(field)
            if spec is None:
                if arr is not None:
                    raise ConfigError(f"{self.fmt.name} has no {field}", key=field,
                                      expected="None", found=f"array {list(arr.shape)}")
                continue
            shape, dtype = spec
            if arr is None or arr.shape != shape or arr.dtype != dtype.numpy:
                found = "None" if arr is None else f"{arr.dtype}{list(arr.shape)}"
                raise ConfigError(f"{self.fmt.name} {field} has the wrong layout", key=field,
                                  expected=f"{dtype.numpy}{list(shape)}", found=found)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored array together."""
        return sum(a.nbytes for a in (self.data, self.scale, self.global_scale) if a is not None)

    def dequantize(self) -> np.ndarray:
        """The f32 weights these bytes mean (see :meth:`QuantFormat.dequantize`)."""
        return self.fmt.dequantize(self)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QuantTensor):
            return NotImplemented
        return (self.fmt == other.fmt and self.shape == other.shape
                and all(_same(getattr(self, f), getattr(other, f))
                        for f in ("data", "scale", "global_scale")))

    def __hash__(self) -> int:
        return hash((self.fmt, self.shape))


# ---------------------------------------------------------------- formats


def _as_f32(w: np.ndarray, name: str | None, fmt: str) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim < 2:
        raise CheckpointError(f"{fmt} quantizes matrices", key=name,
                              expected="shape [..., n, k]", found=f"shape {list(w.shape)}")
    w32 = w.astype(np.float32, copy=False)
    finite = np.isfinite(w32)
    if not finite.all():
        bad = np.argwhere(~finite)[0].tolist()
        raise CheckpointError("NaN or inf in a tensor being quantized", key=name,
                              expected="finite values",
                              found=f"{int((~finite).sum())} non-finite, first at {bad}")
    return w32


def _check_k(k: int, block: int, name: str | None, fmt: str) -> None:
    if k % block:
        raise CheckpointError(f"{fmt} needs K divisible by its block", key=name,
                              expected=f"K a multiple of {block}", found=f"K = {k}")


def _blocks(a: np.ndarray, block: int) -> np.ndarray:
    """``[..., k]`` viewed as ``[..., k/block, block]``."""
    return a.reshape(a.shape[:-1] + (a.shape[-1] // block, block))


class QuantFormat:
    """A weight storage format. Subclasses are frozen values; ``FORMATS`` lists the shipped ones.

    >>> QuantFormat.parse("NVFP4") is FORMATS["nvfp4"]
    True
    >>> try:
    ...     QuantFormat.parse("mxfp5")
    ... except ConfigError as e:
    ...     print(e.key, "|", e.found, "|", e.suggestion)
    quant | 'mxfp5' | mxfp4
    """

    kind: ClassVar[str]
    """The family of the format: ``bf16``, ``fp8``, ``mxfp4`` or ``nvfp4`` (``TensorType.fmt``)."""

    @property
    def name(self) -> str:
        """The canonical name, a key of ``FORMATS``."""
        raise NotImplementedError

    @property
    def block_size(self) -> int | None:
        """How many consecutive K elements share one scale; ``None`` when a scale spans a row."""
        raise NotImplementedError

    @property
    def bits_per_weight(self) -> float:
        """Storage bits per weight including scales (per-row and per-tensor scales excluded)."""
        raise NotImplementedError

    def array_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], DType]]:
        """The ``(shape, dtype)`` of each stored array of a weight of logical ``shape``."""
        raise NotImplementedError

    def weight_bytes(self, n_out: int, k: int) -> int:
        """Exact bytes of an ``[n_out, k]`` weight, scales included."""
        specs = self.array_specs((n_out, k))
        return sum(dt.nbytes(math.prod(shape)) for shape, dt in specs.values())

    def quantize(self, w: np.ndarray, *, name: str | None = None) -> QuantTensor:
        """Quantize f32 weights ``[..., n, k]``; ``name`` labels errors (NaN/inf, bad K)."""
        raise NotImplementedError

    def dequantize(self, qt: QuantTensor) -> np.ndarray:
        """The f32 weights ``qt`` stands for."""
        raise NotImplementedError

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def parse(text: str, *, file: object = None, key: str = "quant") -> QuantFormat:
        """The format a spelling names (``mxfp4``, ``fp8``, ``FP8-block`` …)."""
        if isinstance(text, QuantFormat):
            return text
        spelled = str(text).strip().lower().replace("-", "_")
        found = FORMATS.get(_ALIASES.get(spelled, spelled))
        if found is None:
            raise ConfigError("unknown quantization format", file=file, key=key,
                              expected="one of " + ", ".join(sorted(FORMATS)),
                              found=repr(text),
                              suggestion=nearest(spelled, list(FORMATS) + list(_ALIASES)))
        return found


@attrs.frozen
class BF16Format(QuantFormat):
    """Plain bfloat16 weights, no scales.

    >>> BF16Format().quantize(np.array([[1.0, 1 / 3]], np.float32)).data.tolist()
    [[1.0, 0.333984375]]
    """

    kind: ClassVar[str] = "bf16"

    @property
    def name(self) -> str:
        return "bf16"

    @property
    def block_size(self) -> int | None:
        return None

    @property
    def bits_per_weight(self) -> float:
        return 16.0

    def array_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {"data": (tuple(shape), BF16)}

    def quantize(self, w: np.ndarray, *, name: str | None = None) -> QuantTensor:
        w32 = _as_f32(w, name, self.name)
        return QuantTensor(self, w32.shape, w32.astype(BF16.numpy))

    def dequantize(self, qt: QuantTensor) -> np.ndarray:
        return qt.data.astype(np.float32)


_FP8_ELEMENTS = {"e4m3": E4M3, "e5m2": E5M2}
_FP8_BLOCK = 128


@attrs.frozen
class FP8Format(QuantFormat):
    """8-bit float weights with f32 scales; ``w ≈ value * scale``, scale = amax / max(element).

    ``granularity``: ``tensor`` (one scale), ``channel`` (one per output row, ``[n, 1]``) or
    ``block`` (one per 128x128 tile, ``[ceil(n/128), ceil(k/128)]``, the ``weight_scale_inv``
    layout; partial edge tiles allowed). ``element``: ``e4m3`` (e4m3fn) or ``e5m2``.

    >>> f = FP8Format("block")
    >>> f.name, f.block_size, f.bits_per_weight
    ('fp8_e4m3_block', 128, 8.001953125)
    >>> f.array_specs((300, 200))["scale"]
    ((3, 2), F32)
    """

    kind: ClassVar[str] = "fp8"
    granularity: str = attrs.field(default="channel",
                                   validator=attrs.validators.in_(("tensor", "channel", "block")))
    element: str = attrs.field(default="e4m3", validator=attrs.validators.in_(("e4m3", "e5m2")))

    @property
    def name(self) -> str:
        return f"fp8_{self.element}_{self.granularity}"

    @property
    def dtype(self) -> DType:
        """The element type (E4M3 or E5M2)."""
        return _FP8_ELEMENTS[self.element]

    @property
    def max_value(self) -> float:
        """The largest finite element (448 for e4m3fn, 57344 for e5m2)."""
        import ml_dtypes  # on first use: lkb.dtype says why

        return float(ml_dtypes.finfo(self.dtype.numpy).max)

    @property
    def block_size(self) -> int | None:
        return _FP8_BLOCK if self.granularity == "block" else None

    @property
    def bits_per_weight(self) -> float:
        return 8.0 + (32 / _FP8_BLOCK**2 if self.granularity == "block" else 0.0)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of the f32 scale of a weight of logical ``shape``."""
        *lead, n, k = shape
        if self.granularity == "tensor":
            return ()
        if self.granularity == "channel":
            return (*lead, n, 1)
        return (*lead, -(-n // _FP8_BLOCK), -(-k // _FP8_BLOCK))

    def array_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], DType]]:
        return {"data": (tuple(shape), self.dtype), "scale": (self.scale_shape(shape), F32)}

    def expand_scale(self, scale: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        """The f32 scale broadcast to one per element of ``shape``."""
        *_, n, k = shape
        s = np.asarray(scale, np.float32)
        if self.granularity == "block":
            s = np.repeat(np.repeat(s, _FP8_BLOCK, axis=-2), _FP8_BLOCK, axis=-1)[..., :n, :k]
        return np.broadcast_to(s, shape)

    def quantize(self, w: np.ndarray, *, name: str | None = None) -> QuantTensor:
        w32 = _as_f32(w, name, self.name)
        *lead, n, k = w32.shape
        a = np.abs(w32)
        if self.granularity == "tensor":
            amax = a.max(initial=0.0)
        elif self.granularity == "channel":
            amax = a.max(axis=-1, keepdims=True, initial=0.0)
        else:
            pn, pk = -n % _FP8_BLOCK, -k % _FP8_BLOCK
            padded = np.pad(a, [(0, 0)] * len(lead) + [(0, pn), (0, pk)])
            tiles = padded.reshape(*lead, (n + pn) // _FP8_BLOCK, _FP8_BLOCK,
                                   (k + pk) // _FP8_BLOCK, _FP8_BLOCK)
            amax = tiles.max(axis=(-3, -1), initial=0.0)
        amax = np.asarray(amax, np.float32)
        # an all-zero group gets scale 1 so that dividing by it stays finite
        scale = np.where(amax > 0, amax / np.float32(self.max_value), np.float32(1.0))
        scale = scale.astype(np.float32).reshape(self.scale_shape(w32.shape))
        top = np.float32(self.max_value)
        # ml_dtypes turns out-of-range into NaN for e4m3fn, so clip before the cast
        q = np.clip(w32 / self.expand_scale(scale, w32.shape), -top, top).astype(self.dtype.numpy)
        return QuantTensor(self, w32.shape, q, scale)

    def dequantize(self, qt: QuantTensor) -> np.ndarray:
        return qt.data.astype(np.float32) * self.expand_scale(qt.scale, qt.shape)


class _BlockFP4(QuantFormat):
    """What the two e2m1 formats share: two values a byte, one 8-bit scale per ``BLOCK``."""

    kind: ClassVar[str]
    BLOCK: ClassVar[int]

    @property
    def name(self) -> str:
        return self.kind

    @property
    def block_size(self) -> int | None:
        return self.BLOCK

    @property
    def bits_per_weight(self) -> float:
        return 4 + 8 / self.BLOCK


@attrs.frozen
class MXFP4Format(_BlockFP4):
    """OCP MX fp4: e2m1 values packed two per byte, one e8m0 scale per 32 along K.

    The scale of a block is ``2^(floor(log2(amax)) - 2)`` (2 is e2m1's emax); values above 6
    after scaling saturate to 6, as the OCP rule accepts. An all-zero block has scale 2^-127.

    >>> MXFP4Format().quantize(np.full((1, 32), 12.0, np.float32)).scale.astype(np.float32)
    array([[2.]], dtype=float32)
    """

    kind: ClassVar[str] = "mxfp4"
    BLOCK: ClassVar[int] = 32

    def array_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], DType]]:
        *lead, n, k = shape
        return {"data": ((*lead, n, k // 2), U8), "scale": ((*lead, n, k // self.BLOCK), E8M0)}

    def quantize(self, w: np.ndarray, *, name: str | None = None) -> QuantTensor:
        w32 = _as_f32(w, name, self.name)
        _check_k(w32.shape[-1], self.BLOCK, name, self.name)
        blocks = _blocks(w32, self.BLOCK)
        amax = np.abs(blocks).max(axis=-1)
        _, e = np.frexp(amax)  # amax = m * 2^e with m in [0.5, 1): floor(log2 amax) = e - 1
        exp = np.where(amax > 0, e - 1 - _E2M1_EMAX, -127).clip(-127, 127).astype(np.int32)
        scaled = np.ldexp(blocks, -exp[..., None]).astype(np.float32)
        values = np.clip(scaled, -_E2M1_MAX, _E2M1_MAX).astype(E2M1.numpy).reshape(w32.shape)
        scale = np.ldexp(np.float32(1.0), exp).astype(np.float32).astype(E8M0.numpy)
        return QuantTensor(self, w32.shape, pack_e2m1(values), scale)

    def dequantize(self, qt: QuantTensor) -> np.ndarray:
        values = _blocks(unpack_e2m1(qt.data).astype(np.float32), self.BLOCK)
        return (values * qt.scale.astype(np.float32)[..., None]).reshape(qt.shape)


@attrs.frozen
class NVFP4Format(_BlockFP4):
    """NVIDIA fp4: e2m1 values packed two per byte, one e4m3 scale per 16 along K, one f32 global.

    ``global = amax(tensor) / (6 * 448)`` (1 for an all-zero tensor); block scale
    ``amax(block) / 6 / global`` rounded to e4m3; ``w ≈ (value * scale) * global`` in f32,
    in that order.

    >>> NVFP4Format().weight_bytes(4, 32)
    76
    """

    kind: ClassVar[str] = "nvfp4"
    BLOCK: ClassVar[int] = 16

    def array_specs(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], DType]]:
        *lead, n, k = shape
        return {"data": ((*lead, n, k // 2), U8), "scale": ((*lead, n, k // self.BLOCK), E4M3),
                "global_scale": ((), F32)}

    def quantize(self, w: np.ndarray, *, name: str | None = None) -> QuantTensor:
        w32 = _as_f32(w, name, self.name)
        _check_k(w32.shape[-1], self.BLOCK, name, self.name)
        import ml_dtypes

        e4m3_max = np.float32(ml_dtypes.finfo(E4M3.numpy).max)
        g = np.float32(np.abs(w32).max(initial=0.0)) / (np.float32(_E2M1_MAX) * e4m3_max)
        g = np.float32(g) if np.isfinite(g) and g > 0 else np.float32(1.0)
        blocks = _blocks(w32, self.BLOCK)
        s = np.abs(blocks).max(axis=-1) / np.float32(_E2M1_MAX) / g
        scale = np.clip(s.astype(np.float32), 0, e4m3_max).astype(E4M3.numpy)
        denom = (scale.astype(np.float32) * g)[..., None]
        scaled = np.divide(blocks, denom, out=np.zeros_like(blocks), where=denom > 0)
        values = np.clip(scaled, -_E2M1_MAX, _E2M1_MAX).astype(E2M1.numpy).reshape(w32.shape)
        return QuantTensor(self, w32.shape, pack_e2m1(values), scale, np.asarray(g, np.float32))

    def dequantize(self, qt: QuantTensor) -> np.ndarray:
        values = _blocks(unpack_e2m1(qt.data).astype(np.float32), self.BLOCK)
        scaled = values * qt.scale.astype(np.float32)[..., None]
        return (scaled * np.float32(qt.global_scale)).astype(np.float32).reshape(qt.shape)


FORMATS: Mapping[str, QuantFormat] = MappingProxyType({
    f.name: f
    for f in (
        BF16Format(),
        *(FP8Format(g, e) for e in ("e4m3", "e5m2") for g in ("tensor", "channel", "block")),
        MXFP4Format(),
        NVFP4Format(),
    )
})
"""Every shipped format by canonical name."""

_ALIASES = {
    "bfloat16": "bf16",
    "fp8": "fp8_e4m3_channel",
    "fp8_e4m3": "fp8_e4m3_channel",
    "fp8_e5m2": "fp8_e5m2_channel",
    **{f"fp8_{g}": f"fp8_e4m3_{g}" for g in ("tensor", "channel", "block")},
}


# ---------------------------------------------------------------- meaning of a quantized linear


def quant_linear(x: np.ndarray, qt: QuantTensor, k_block: int) -> np.ndarray:
    """What a linear layer on quantized weights computes, exactly: ``y[r,j] = Σ_i x[r,i] W[j,i]``.

    The order of every operation, all in f32:

    1. ``W = qt.dequantize()``: each weight is ``value * scale`` (``(value * scale) * global``
       for nvfp4), one f32 rounding per multiply.
    2. Each product ``x[r, i] * W[j, i]`` is rounded to f32.
    3. Along K, blocks of ``k_block`` consecutive products (the last may be shorter) are each
       summed left to right, starting from 0: ``p_b = ((0 + t_0) + t_1) + …``.
    4. The block sums are combined left to right, starting from 0: ``y = ((0 + p_0) + p_1) + …``.

    Every row is computed by itself with the same operations, so a row's result is
    byte-identical whether it is computed alone or in a batch.

    >>> w = FORMATS["bf16"].quantize(np.array([[1, 2, 3, 4]], np.float32))
    >>> quant_linear(np.array([[1, 1, 1, 1]], np.float32), w, 2)
    array([[10.]], dtype=float32)
    """
    x = np.asarray(x)
    if x.dtype != _F32 or x.ndim != 2:
        raise ConfigError("quant_linear takes f32 activations [rows, k]",
                          expected="float32[rows, k]", found=f"{x.dtype}{list(x.shape)}")
    if len(qt.shape) != 2 or qt.shape[1] != x.shape[1]:
        raise ConfigError("weight K does not match activation K", key="k",
                          expected=f"[n, {x.shape[1]}]", found=list(qt.shape))
    if k_block < 1:
        raise ConfigError("k_block must be positive", key="k_block", found=k_block)
    n, k = qt.shape
    wt = np.ascontiguousarray(qt.dequantize().T)  # [k, n]: K-major so each step reads a row
    full = k // k_block * k_block
    out = np.empty((x.shape[0], n), np.float32)
    for r in range(x.shape[0]):
        prod = x[r][:, None] * wt  # [k, n], one f32 rounding per product
        parts = []
        if full:
            blocks = prod[:full].reshape(full // k_block, k_block, n)
            acc = np.zeros((full // k_block, n), np.float32)
            for i in range(k_block):  # every block's sum, left to right within the block
                acc += blocks[:, i]
            parts.extend(acc)
        if full < k:
            tail = np.zeros(n, np.float32)
            for i in range(full, k):
                tail += prod[i]
            parts.append(tail)
        total = np.zeros(n, np.float32)
        for p in parts:  # block sums combined left to right
            total += p
        out[r] = total
    return out
