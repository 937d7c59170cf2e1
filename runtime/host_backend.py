"""HostBackend: the GpuBackend model in NumPy memory, where a kernel is a Python function.

It runs everywhere (the embedded default, and the model every host test runs on). One
``np.ndarray[uint8]`` holds each allocation; a host kernel runs once per launch, vectorized.

A *host binary* is a mapping ``{entry_name: HostKernel(fn, arity)}`` (a pair ``(arity, fn)``
is accepted for an entry too). A launch resolves every ``DevicePtr`` argument into a 1-D
``np.uint8`` view of its bytes from the pointer's offset, a ``TensorMap`` into the 128 bytes
:func:`host_tensor_map` describes it with (what the kernels' SIMT emulation reads), passes
other arguments unchanged, and calls ``fn(*resolved)``. Grid and block are validated, then
ignored. Streams exist; their ordering is program order. Graph capture records the launches and memsets issued on the
capturing stream (they do not run), and ``graph_launch`` replays them in order.

>>> import numpy as np
>>> def scale(out, x, n, factor):
...     out.view(np.float32)[:n] = x.view(np.float32)[:n] * factor
>>> be = HostBackend()
>>> k = be.kernel(be.module({"scale": HostKernel(scale, 4)}), "scale")
>>> x, y = be.alloc(16, "x"), be.alloc(16, "y")
>>> be.copy_h2d(x, np.arange(4, dtype=np.float32))
>>> be.launch(k, (1, 1, 1), (128, 1, 1), 0, (y, x, 4, 2.0))
>>> be.copy_d2h(y).view(np.float32)
array([0., 2., 4., 6.], dtype=float32)
>>> be.live_bytes()
32
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from metrale.lkb.errors import LaunchError, MetraleError
from metrale.runtime.backend import (
    DeviceLimits,
    DevicePtr,
    HostKernel,
    KernelHandle,
    ModuleHandle,
    TensorMap,
    out_of_memory,
)
from metrale.runtime.backend_base import BackendBase

__all__ = ["HostBackend", "HostKernel", "host_binary", "host_tensor_map"]

HOST_TENSOR_MAP = np.dtype([("address", "<u8"), ("rows", "<u8"), ("cols", "<u8"),
                            ("row_bytes", "<u8"), ("box_cols", "<u4"), ("box_rows", "<u4"),
                            ("item_bytes", "<u4"), ("magic", "<u4"), ("pad", "V80")])
"""A tensor map on the host: 128 bytes, as ``CUtensorMap`` is (``tests/host/simt`` reads it)."""
HOST_TENSOR_MAP_MAGIC = 0x4D455441


def host_tensor_map(array: np.ndarray, tmap: TensorMap) -> np.void:
    """The 128 bytes that describe ``tmap`` over ``array`` (its bytes, in host memory that
    stays alive while the launch runs): the host address, the array's rows, columns and row
    bytes, the box and the element bytes, and a magic number.

    >>> from metrale.runtime.backend import DevicePtr
    >>> m = host_tensor_map(np.zeros(64, np.uint8), TensorMap(DevicePtr(1, 64), 2, 16, "bf16",
    ...                                                      (16, 2)))
    >>> m.dtype.itemsize, int(m["rows"]), int(m["row_bytes"]), int(m["box_cols"])
    (128, 2, 32, 16)
    """
    from metrale.runtime.backend import TENSOR_MAP_DTYPES

    item = TENSOR_MAP_DTYPES[tmap.dtype]
    out = np.zeros((), HOST_TENSOR_MAP)
    out["address"], out["rows"], out["cols"] = array.ctypes.data, tmap.rows, tmap.cols
    out["row_bytes"], out["item_bytes"], out["magic"] = tmap.cols * item, item, HOST_TENSOR_MAP_MAGIC
    out["box_cols"], out["box_rows"] = tmap.box
    return out[()]


def host_binary(binary: object, label: str = "") -> dict[str, HostKernel]:
    """Check a host binary and normalise its entries to ``HostKernel`` values.

    >>> sorted(host_binary({"noop": (0, None)}))
    ['noop']
    >>> host_binary({"noop": 3}, "m")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.LaunchError: m: module.noop: not a host kernel (expected HostKernel(fn, arity) or (arity, fn), found int)
    """  # noqa: E501
    file = label or None
    if not isinstance(binary, Mapping):
        raise LaunchError(
            "not a host binary", file=file, key="module",
            expected="a mapping {entry name: HostKernel}", found=type(binary).__name__,
        )
    out: dict[str, HostKernel] = {}
    for name, entry in binary.items():
        if isinstance(entry, tuple) and len(entry) == 2:
            entry = HostKernel(entry[1], entry[0])
        if (
            not isinstance(name, str)
            or not isinstance(entry, HostKernel)
            or not (entry.fn is None or callable(entry.fn))
            or not isinstance(entry.arity, int)
            or entry.arity < 0
        ):
            raise LaunchError(
                "not a host kernel", file=file, key=f"module.{name}",
                expected="HostKernel(fn, arity) or (arity, fn)", found=type(entry).__name__,
            )
        out[name] = entry
    return out


class HostBackend(BackendBase):
    """The NumPy model of GpuBackend (see the module docstring for the conventions).

    >>> be = HostBackend()
    >>> be.name, be.binary_format, be.supports_graphs
    ('host', 'host', True)
    """

    name = "host"
    binary_format = "host"
    supports_graphs = True

    def __init__(self, limits: DeviceLimits | None = None) -> None:
        super().__init__(limits or DeviceLimits(name="host"))
        self._recording: list[tuple[Any, ...]] | None = None

    # memory ---------------------------------------------------------------------------------

    def _alloc(self, nbytes: int, label: str) -> Any:
        try:
            return np.zeros(nbytes, np.uint8)  # calloc: zero pages cost nothing, runs repeat
        except MemoryError:
            raise out_of_memory(label, nbytes, "host memory exhausted") from None

    def _bytes(self, storage: Any) -> np.ndarray:
        """The ``np.uint8`` array over an allocation's storage."""
        return storage

    def _free(self, storage: Any) -> None:
        pass  # the array goes when its last view does

    def host_bytes(self, ptr: DevicePtr) -> np.ndarray:
        """The bytes ``ptr`` spans, as a writable ``np.uint8`` view of this backend's memory:
        what a host emulation of the kernels reads and writes through.

        >>> be = HostBackend()
        >>> p = be.alloc(4)
        >>> be.host_bytes(p + 1)[:] = 7
        >>> be.copy_d2h(p, 4).tolist()
        [0, 7, 7, 7]
        """
        storage, offset, n = self._mem.resolve(ptr, "host_bytes.ptr")
        return self._bytes(storage)[offset:offset + n]

    def _pointer_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                     nbytes: int) -> np.ndarray:
        return self._bytes(storage)[offset : offset + nbytes]

    def _tensor_map_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                        tmap: TensorMap) -> np.void:
        return host_tensor_map(self._bytes(storage)[offset:offset + tmap.nbytes], tmap)

    def _h2d(self, storage: Any, offset: int, data: np.ndarray, stream: Any) -> None:
        self._bytes(storage)[offset : offset + data.size] = data

    def _d2h(self, storage: Any, offset: int, nbytes: int, stream: Any) -> np.ndarray:
        return self._bytes(storage)[offset : offset + nbytes].copy()

    def _memset(self, storage: Any, offset: int, value: int, nbytes: int, stream: Any) -> None:
        self._bytes(storage)[offset : offset + nbytes] = value

    def _captured_memset(self, storage: Any, offset: int, value: int, nbytes: int,
                         stream: Any) -> None:
        assert self._recording is not None
        self._recording.append(("memset", storage, offset, value, nbytes))

    # kernels --------------------------------------------------------------------------------

    def _load(self, binary: object, label: str) -> tuple[Any, tuple[str, ...], dict]:
        entries = host_binary(binary, label)
        return entries, tuple(entries), {name: k.arity for name, k in entries.items()}

    def _get_kernel(self, native_module: Any, name: str, module: ModuleHandle) -> Any:
        return native_module[name]

    def _launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                stream: Any, dependent: bool = False) -> None:
        if native.fn is None:
            return
        try:
            native.fn(*args)
        except Exception as e:  # a kernel that throws is a kernel that faulted: sticky
            cause = f"{type(e).__name__}: {e}" if not isinstance(e, MetraleError) else str(e)
            raise self._fault("launch", cause, kernel.name) from e

    def _captured_launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                         block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                         stream: Any, dependent: bool = False) -> None:
        assert self._recording is not None
        self._recording.append(("launch", kernel, native, grid, block, shared_mem, args,
                                dependent))

    # streams and graphs -----------------------------------------------------------------------

    def _sync(self, stream: Any) -> None:
        pass  # host work is done when its call returns

    def _new_stream(self) -> Any:
        return None

    def _begin_capture(self, stream: Any) -> None:
        self._recording = []

    def _end_capture(self, stream: Any) -> Any:
        recorded, self._recording = tuple(self._recording or ()), None
        return recorded

    def _graph_launch(self, native: Any, stream: Any) -> None:
        for node in native:
            if node[0] == "launch":
                _, kernel, fn, grid, block, shared_mem, args, dependent = node
                self._last_kernel = kernel.name
                self._launch(kernel, fn, grid, block, shared_mem, args, stream, dependent)
            else:
                _, storage, offset, value, nbytes = node
                self._memset(storage, offset, value, nbytes, stream)

    def _shutdown(self) -> None:
        self._graphs.clear()
        self._kernels.clear()
        self._modules.clear()
