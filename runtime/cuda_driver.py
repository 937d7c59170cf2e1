"""The CUDA driver calls CuPy does not wrap, through ctypes: a launch with launch attributes,
and the encoding of a tensor map.

CuPy launches with ``cuLaunchKernel``, which takes no attributes; a programmatic dependent
launch (the kernel may start while the previous launch on its stream is still running, and
waits for it with ``griddepcontrol.wait``) needs ``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``; a kernel that copies with the Tensor
Memory Accelerator takes a ``CUtensorMap`` (128 bytes, by value: a NumPy ``V128`` scalar here),
which ``cuTensorMapEncodeTiled`` makes and CuPy's launch cannot pass. Written by hand because
no dependency of the project exposes them; the structures follow ``cuda.h`` (CUDA 12 and 13).

>>> ctypes.sizeof(LaunchAttribute), ctypes.sizeof(LaunchConfig)
(72, 56)
>>> _param(np.int32(-3)).value, _param(np.uint64(2**40)).value, _param(np.float32(0.5)).value
(-3, 1099511627776, 0.5)
>>> bytes(_param(np.void(bytes(range(128)))))[:4]
b'\\x00\\x01\\x02\\x03'
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["DriverLauncher", "LaunchAttribute", "LaunchConfig", "encode_tensor_map"]

PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


class _AttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int), ("p", ctypes.c_void_p)]


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttributeValue)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]


_CTYPES = {
    np.dtype(np.int8): ctypes.c_int8, np.dtype(np.uint8): ctypes.c_uint8,
    np.dtype(np.int16): ctypes.c_int16, np.dtype(np.uint16): ctypes.c_uint16,
    np.dtype(np.int32): ctypes.c_int32, np.dtype(np.uint32): ctypes.c_uint32,
    np.dtype(np.int64): ctypes.c_int64, np.dtype(np.uint64): ctypes.c_uint64,
    np.dtype(np.float32): ctypes.c_float, np.dtype(np.float64): ctypes.c_double,
}


TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
_TENSOR_MAP_TYPES = {"bf16": 9, "f32": 7, "u8": 0}  # CU_TENSOR_MAP_DATA_TYPE_*
_SWIZZLE_128B, _L2_PROMOTION_128B = 3, 2


def _param(value: np.generic) -> Any:
    """A kernel argument (a NumPy scalar, as the backend resolves them) as a ctypes value; a
    ``V128`` scalar is a tensor map's bytes."""
    if value.dtype.kind == "V":
        return (ctypes.c_ubyte * value.dtype.itemsize).from_buffer_copy(value.tobytes())
    return _CTYPES[np.dtype(value.dtype)](value.item())


def encode_tensor_map(address: int, rows: int, cols: int, dtype: str,
                      box: tuple[int, int]) -> np.void:
    """``cuTensorMapEncodeTiled`` of a row-major ``rows`` x ``cols`` array of ``dtype`` at
    device ``address``, in boxes of ``box`` = (columns, rows) with the 128-byte swizzle and
    zeros outside the array (``runtime.backend.TensorMap``), as the 128 bytes a kernel takes.
    A description the driver refuses raises ``DriverError``."""
    from metrale.runtime.backend import TENSOR_MAP_DTYPES

    lib = ctypes.CDLL("libcuda.so.1")
    encode = lib.cuTensorMapEncodeTiled
    encode.restype = ctypes.c_int
    item = TENSOR_MAP_DTYPES[dtype]
    out = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + 64))()
    at = ctypes.addressof(out) + (-ctypes.addressof(out)) % 64  # CUtensorMap is 64-aligned
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    status = encode(ctypes.c_void_p(at), ctypes.c_int(_TENSOR_MAP_TYPES[dtype]), u32(2),
                    ctypes.c_void_p(address), (u64 * 2)(cols, rows), (u64 * 1)(cols * item),
                    (u32 * 2)(*box), (u32 * 2)(1, 1), ctypes.c_int(0),
                    ctypes.c_int(_SWIZZLE_128B), ctypes.c_int(_L2_PROMOTION_128B), ctypes.c_int(0))
    if status:
        text = ctypes.c_char_p()
        lib.cuGetErrorName(status, ctypes.byref(text))
        raise DriverError(status, text.value.decode() if text.value else "CUDA_ERROR")
    return np.void(ctypes.string_at(at, TENSOR_MAP_BYTES))


class DriverError(RuntimeError):
    """A nonzero ``CUresult``: ``status`` and the driver's name for it."""

    def __init__(self, status: int, name: str) -> None:
        super().__init__(f"{name} ({status})")
        self.status = status


class DriverLauncher:
    """``cuLaunchKernelEx`` from the process's ``libcuda`` (the one CuPy loaded)."""

    def __init__(self) -> None:
        self._lib = ctypes.CDLL("libcuda.so.1")
        self._launch = self._lib.cuLaunchKernelEx
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p,
                                 ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        self._attr = LaunchAttribute()
        self._attr.id = PROGRAMMATIC_STREAM_SERIALIZATION
        self._attr.value.i = 1

    def _name(self, status: int) -> str:
        text = ctypes.c_char_p()
        self._lib.cuGetErrorName(status, ctypes.byref(text))
        return text.value.decode() if text.value else "CUDA_ERROR"

    def launch_dependent(self, function: int, grid: tuple[int, int, int],
                         block: tuple[int, int, int], shared_mem: int, stream: int,
                         args: tuple[np.generic, ...], dependent: bool = True) -> None:
        """Launch ``function`` (a ``CUfunction``) on ``stream`` (a ``CUstream``; 0 is the
        legacy default stream), as a programmatic dependent launch unless ``dependent`` is
        false; ``DriverError`` if the driver refuses. The driver copies the arguments before it
        returns."""
        values = [_param(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        config = LaunchConfig(*grid, *block, shared_mem, stream,
                              ctypes.pointer(self._attr) if dependent else None, int(dependent))
        status = self._launch(ctypes.byref(config), function, params, None)
        if status:
            raise DriverError(status, self._name(status))
