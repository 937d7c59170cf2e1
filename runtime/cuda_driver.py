"""The CUDA driver calls CuPy does not wrap, through ctypes: a launch with launch attributes.

CuPy launches with ``cuLaunchKernel``, which takes no attributes; a programmatic dependent
launch (the kernel may start while the previous launch on its stream is still running, and
waits for it with ``griddepcontrol.wait``) needs ``cuLaunchKernelEx`` with
``CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION``. Written by hand because no
dependency of the project exposes it; the structures follow ``cuda.h`` (CUDA 12 and 13).

>>> ctypes.sizeof(LaunchAttribute), ctypes.sizeof(LaunchConfig)
(72, 56)
>>> _param(np.int32(-3)).value, _param(np.uint64(2**40)).value, _param(np.float32(0.5)).value
(-3, 1099511627776, 0.5)
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

__all__ = ["DriverLauncher", "LaunchAttribute", "LaunchConfig"]

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


def _param(value: np.generic) -> Any:
    """A kernel argument (a NumPy scalar, as the backend resolves them) as a ctypes value."""
    return _CTYPES[np.dtype(value.dtype)](value.item())


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
                         args: tuple[np.generic, ...]) -> None:
        """Launch ``function`` (a ``CUfunction``) as a programmatic dependent launch on
        ``stream`` (a ``CUstream``; 0 is the legacy default stream); ``DriverError`` if the
        driver refuses. The driver copies the arguments before it returns."""
        values = [_param(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(values)))(
            *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        config = LaunchConfig(*grid, *block, shared_mem, stream, ctypes.pointer(self._attr), 1)
        status = self._launch(ctypes.byref(config), function, params, None)
        if status:
            raise DriverError(status, self._name(status))
