"""The model-independent half of every GpuBackend: the pointer table, validation, the latch.

Every model (mock, host, CUDA) subclasses :class:`BackendBase`; its public operations check
their inputs here, in one order, and only then call the hooks a model implements, so one
misuse gives one exception class and one text in every model (equation 10 of ``backend``).

>>> from metrale.runtime.host_backend import HostBackend
>>> be = HostBackend()
>>> be.free(be.alloc(8, "w")) is None
True
>>> be.live_bytes()
0
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import attrs
import numpy as np

from metrale.lkb.errors import AllocationError, DeviceFault, LaunchError, UnavailableError
from metrale.runtime.backend import (
    DeviceLimits,
    DevicePtr,
    GraphHandle,
    KernelHandle,
    ModuleHandle,
    PointerError,
    Stream,
    TensorMap,
    buffer_name,
    check_launch,
    device_fault,
    is_int,
    no_such_kernel,
)
from metrale.runtime.fault import FaultLatch

__all__ = ["Allocations", "BackendBase"]


@attrs.define
class _Allocation:
    label: str
    nbytes: int
    storage: Any


class Allocations:
    """The pointer table of one backend: live allocations, their labels, and the freed ones.

    >>> table = Allocations()
    >>> p = table.add(8, "w", storage=bytearray(8))
    >>> table.live_bytes, p
    (8, DevicePtr(alloc_id=1, nbytes=8, offset=0))
    >>> _ = table.remove(p, "free.ptr")
    >>> table.resolve(p, "memset.dst")
    Traceback (most recent call last):
    ...
    metrale.runtime.backend.PointerError: memset.dst: use after free of buffer 'w'
    """

    def __init__(self) -> None:
        self._live: dict[int, _Allocation] = {}
        self._freed: dict[int, str] = {}
        self._next = 1
        self.live_bytes = 0

    def add(self, nbytes: int, label: str, storage: Any) -> DevicePtr:
        """Record a new allocation; its id is the next integer from 1."""
        alloc_id, self._next = self._next, self._next + 1
        self._live[alloc_id] = _Allocation(label, nbytes, storage)
        self.live_bytes += nbytes
        return DevicePtr(alloc_id, nbytes)

    def _find(self, ptr: object, key: str) -> _Allocation:
        if not isinstance(ptr, DevicePtr):
            raise PointerError(
                "not a device pointer", key=key, expected="DevicePtr", found=type(ptr).__name__
            )
        found = self._live.get(ptr.alloc_id)
        if found is None:
            if ptr.alloc_id in self._freed:
                name = buffer_name(self._freed[ptr.alloc_id], ptr.alloc_id)
                raise PointerError(f"use after free of buffer {name!r}", key=key)
            raise PointerError(
                "pointer to no allocation of this backend", key=key, found=f"alloc #{ptr.alloc_id}"
            )
        if ptr.offset < 0 or ptr.nbytes < 0 or ptr.offset + ptr.nbytes > found.nbytes:
            name = buffer_name(found.label, ptr.alloc_id)
            raise PointerError(
                f"pointer outside buffer {name!r}", key=key,
                expected=f"offset + bytes <= {found.nbytes}", found=f"{ptr.offset} + {ptr.nbytes}",
            )
        return found

    def label(self, alloc_id: int) -> str:
        """The display name of a live or freed allocation."""
        entry = self._live.get(alloc_id)
        return buffer_name(entry.label if entry else self._freed.get(alloc_id, ""), alloc_id)

    def resolve(self, ptr: object, key: str, nbytes: int | None = None) -> tuple[Any, int, int]:
        """``(storage, offset, nbytes)`` for an access of ``nbytes`` (default: all) at ``ptr``."""
        entry = self._find(ptr, key)
        assert isinstance(ptr, DevicePtr)
        n = ptr.nbytes if nbytes is None else nbytes
        if not is_int(n) or not 0 <= n <= ptr.nbytes:
            name = buffer_name(entry.label, ptr.alloc_id)
            raise PointerError(
                f"access outside buffer {name!r}", key=key,
                expected=f"at most {ptr.nbytes} bytes at offset {ptr.offset}", found=repr(n),
            )
        return entry.storage, ptr.offset, int(n)

    def check_live(self, alloc_id: int, key: str) -> None:
        """Raise the use-after-free error if ``alloc_id`` is not live."""
        if alloc_id not in self._live:
            self._find(DevicePtr(alloc_id, 0), key)

    def remove(self, ptr: object, key: str) -> Any:
        """Forget a live allocation (the pointer must be its start); return its storage."""
        if isinstance(ptr, DevicePtr) and ptr.alloc_id in self._freed:
            name = buffer_name(self._freed[ptr.alloc_id], ptr.alloc_id)
            raise PointerError(f"double free of buffer {name!r}", key=key)
        entry = self._find(ptr, key)
        assert isinstance(ptr, DevicePtr)
        if ptr.offset != 0:
            name = buffer_name(entry.label, ptr.alloc_id)
            raise PointerError(
                f"free of a pointer inside buffer {name!r}", key=key, expected="offset 0",
                found=f"offset {ptr.offset}",
            )
        del self._live[ptr.alloc_id]
        self._freed[ptr.alloc_id] = entry.label
        self.live_bytes -= entry.nbytes
        return entry.storage

    def forget(self, ptr: object) -> Any:
        """Drop an allocation without checks (after a fault); its storage, or ``None``."""
        if not isinstance(ptr, DevicePtr) or ptr.alloc_id not in self._live:
            return None
        entry = self._live.pop(ptr.alloc_id)
        self._freed[ptr.alloc_id] = entry.label
        self.live_bytes -= entry.nbytes
        return entry.storage

    def drain(self) -> Iterator[Any]:
        """Forget every live allocation, newest first, yielding each storage."""
        for alloc_id in sorted(self._live, reverse=True):
            yield self.forget(DevicePtr(alloc_id, 0))


@attrs.define
class _Capture:
    stream: Stream
    alloc_ids: set[int] = attrs.Factory(set)
    nodes: int = 0


@attrs.frozen
class _Graph:
    handle: GraphHandle
    native: Any
    alloc_ids: frozenset[int]


class BackendBase:
    """The model-independent half of every backend: validation, bookkeeping, the fault latch.

    Public operations check their inputs here, in one order, and call the hooks (``_alloc``,
    ``_launch``, ``_h2d`` …) that a model implements for its memory and device. A hook may
    raise ``DeviceFault`` through :meth:`_fault`, which latches it.
    """

    name: ClassVar[str] = "base"
    binary_format: ClassVar[str] = "host"
    supports_graphs: ClassVar[bool] = True

    def __init__(self, limits: DeviceLimits) -> None:
        self.limits = limits
        self._mem = Allocations()
        self._latch = FaultLatch()
        self._streams: dict[int, Any] = {}
        self._modules: dict[int, tuple[ModuleHandle, Any, tuple[str, ...] | None, dict]] = {}
        self._kernels: dict[KernelHandle, Any] = {}
        self._graphs: dict[int, _Graph] = {}
        self._graph_ids = 0  # ids are never reused: a released graph's handle stays unknown
        self._capture: _Capture | None = None
        self._closed = False
        self._last_kernel: str | None = None

    # -- hooks a model implements ---------------------------------------------------------------

    def _record(self, op: str, args: tuple[Any, ...]) -> None:
        """Called first by every public operation (the mock keeps the list)."""

    def _alloc(self, nbytes: int, label: str) -> Any:
        raise NotImplementedError

    def _free(self, storage: Any) -> None:
        raise NotImplementedError

    def _abandon(self, storage: Any) -> None:
        """Drop storage without touching a dead device (after a fault)."""

    def _load(self, binary: object, label: str) -> tuple[Any, tuple[str, ...] | None, dict]:
        """``(native module, entry names or None, {entry: arity})``."""
        raise NotImplementedError

    def _get_kernel(self, native_module: Any, name: str, module: ModuleHandle) -> Any:
        raise NotImplementedError

    def _pointer_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                     nbytes: int) -> Any:
        raise NotImplementedError

    def _scalar_arg(self, kernel: KernelHandle, index: int, value: Any) -> Any:
        return value

    def _tensor_map_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                        tmap: TensorMap) -> Any:
        """The model's encoding of ``tmap``, whose array starts ``offset`` bytes into
        ``storage`` (its bytes checked to lie inside it)."""
        raise LaunchError("this backend passes no tensor maps", file=kernel.source or None,
                          key=f"launch.{kernel.name}.args[{index}]",
                          expected="a backend with a Tensor Memory Accelerator",
                          found=type(self).__name__)

    def _launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                stream: Any, dependent: bool = False) -> None:
        raise NotImplementedError

    def _captured_launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                         block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                         stream: Any, dependent: bool = False) -> None:
        """A launch on the capturing stream; CUDA records it itself, so by default: launch."""
        self._launch(kernel, native, grid, block, shared_mem, args, stream, dependent)

    def _sync(self, stream: Any) -> None:
        raise NotImplementedError

    def _h2d(self, storage: Any, offset: int, data: np.ndarray, stream: Any) -> None:
        raise NotImplementedError

    def _d2h(self, storage: Any, offset: int, nbytes: int, stream: Any) -> np.ndarray:
        raise NotImplementedError

    def _memset(self, storage: Any, offset: int, value: int, nbytes: int, stream: Any) -> None:
        raise NotImplementedError

    def _captured_memset(self, storage: Any, offset: int, value: int, nbytes: int,
                         stream: Any) -> None:
        self._memset(storage, offset, value, nbytes, stream)

    def _new_stream(self) -> Any:
        raise NotImplementedError

    def _begin_capture(self, stream: Any) -> None:
        raise NotImplementedError

    def _end_capture(self, stream: Any) -> Any:
        raise NotImplementedError

    def _graph_launch(self, native: Any, stream: Any) -> None:
        raise NotImplementedError

    def _shutdown(self) -> None:
        """Release what the model holds beyond allocations (streams, modules, graphs)."""

    # -- shared checks ----------------------------------------------------------------------

    def _fault(self, op: str, cause: object, kernel: str | None = None) -> DeviceFault:
        """Latch a device fault (naming ``kernel``, else the last kernel launched); raise it."""
        return self._latch.latch(device_fault(op, kernel or self._last_kernel, cause))

    def _enter(self, op: str, args: tuple[Any, ...], *, in_capture: bool = False) -> None:
        self._record(op, args)
        self._latch.check()  # a dead device says so even after close
        if self._closed:
            raise UnavailableError("backend is closed", key=op)
        if self._capture is not None and not in_capture:
            self._refuse_in_capture(op)

    def _refuse_in_capture(self, op: str) -> None:
        assert self._capture is not None
        raise LaunchError(
            f"{op} is not allowed while a graph is being captured", key=op,
            found=f"capture open on stream {self._capture.stream.stream_id}",
        )

    def _native_stream(self, stream: object, key: str) -> Any:
        if stream is None:
            return None
        if not isinstance(stream, Stream) or stream.stream_id not in self._streams:
            raise LaunchError(
                "not a stream of this backend", key=key, expected="a Stream from stream() or None",
                found=repr(stream),
            )
        return self._streams[stream.stream_id]

    def _capturing(self, stream: Stream | None) -> bool:
        return self._capture is not None and stream == self._capture.stream

    # -- the operations -----------------------------------------------------------------------

    def alloc(self, nbytes: int, label: str = "") -> DevicePtr:
        """A new allocation of ``nbytes`` (contents unspecified), named ``label`` in errors."""
        self._enter("alloc", (nbytes, label))
        if not is_int(nbytes) or nbytes < 0:
            raise AllocationError(
                "allocation size is not a byte count", key=label or "<unlabelled>",
                expected="an integer >= 0", found=repr(nbytes),
            )
        if not isinstance(label, str):
            raise AllocationError(
                "buffer label is not a string", expected="str", found=type(label).__name__
            )
        storage = self._alloc(int(nbytes), label)
        return self._mem.add(int(nbytes), label, storage)

    def free(self, ptr: DevicePtr) -> None:
        """Release an allocation; after a fault or ``close`` this records and returns quietly."""
        self._record("free", (ptr,))
        if self._closed or self._latch.latched:
            storage = self._mem.forget(ptr)
            if storage is not None:
                self._abandon(storage)
            return
        if self._capture is not None:
            self._refuse_in_capture("free")
        storage = self._mem.remove(ptr, "free.ptr")
        self._free(storage)

    def module(self, binary: object, label: str = "") -> ModuleHandle:
        """Load a binary (see ``binary_format``); ``label`` names it in errors."""
        self._enter("module", (label,))
        native, names, arities = self._load(binary, label)
        handle = ModuleHandle(len(self._modules) + 1, label)
        self._modules[handle.module_id] = (handle, native, names, arities)
        return handle

    def kernel(self, module: ModuleHandle, name: str, arity: int | None = None) -> KernelHandle:
        """The entry ``name`` of ``module``; ``arity`` is required where the binary lacks it."""
        self._enter("kernel", (module, name, arity))
        if not isinstance(module, ModuleHandle) or module.module_id not in self._modules:
            raise LaunchError(
                "not a module of this backend", key=f"kernel.{name}", found=repr(module)
            )
        handle_m, native_m, names, arities = self._modules[module.module_id]
        if names is not None and name not in names:
            raise no_such_kernel(name, handle_m, names)
        native = self._get_kernel(native_m, name, handle_m)
        declared = arities.get(name)
        if arity is None and declared is None:
            raise LaunchError(
                "arity of kernel unknown", file=handle_m.label or None, key=f"kernel.{name}",
                expected="kernel(..., arity=N)", found="a binary that does not declare it",
            )
        if arity is not None and declared is not None and arity != declared:
            raise LaunchError(
                "arity differs from the binary's", file=handle_m.label or None,
                key=f"kernel.{name}", expected=declared, found=arity,
            )
        final = declared if declared is not None else arity
        if not is_int(final) or final < 0:
            raise LaunchError(
                "arity is not a count", key=f"kernel.{name}", expected="an integer >= 0",
                found=repr(final),
            )
        handle = KernelHandle(module.module_id, name, int(final), handle_m.label)
        self._kernels[handle] = native
        return handle

    def _resolve_args(self, kernel: KernelHandle, args: tuple[Any, ...],
                      used: set[int]) -> tuple[Any, ...]:
        out = []
        for i, arg in enumerate(args):
            key = f"launch.{kernel.name}.args[{i}]"
            if isinstance(arg, DevicePtr):
                storage, offset, n = self._mem.resolve(arg, key)
                used.add(arg.alloc_id)
                out.append(self._pointer_arg(kernel, i, storage, offset, n))
            elif isinstance(arg, TensorMap):
                storage, offset, _ = self._mem.resolve(arg.ptr, key, arg.nbytes)
                used.add(arg.ptr.alloc_id)
                out.append(self._tensor_map_arg(kernel, i, storage, offset, arg))
            else:
                out.append(self._scalar_arg(kernel, i, arg))
        return tuple(out)

    def launch(
        self,
        kernel: KernelHandle,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_mem: int,
        args: tuple[Any, ...],
        stream: Stream | None = None,
        *,
        dependent: bool = False,
    ) -> None:
        """Launch ``kernel``; refused before the device (``LaunchError``) if invalid.

        ``dependent``: the launch may begin before the previous launch on ``stream`` ends
        (equation 12); only for kernels that wait for it before touching its memory.
        """
        self._enter("launch", (kernel, grid, block, shared_mem, args, stream), in_capture=True)
        if not isinstance(kernel, KernelHandle) or kernel not in self._kernels:
            raise LaunchError("not a kernel of this backend", key="launch", found=repr(kernel))
        check_launch(kernel, grid, block, shared_mem, args, self.limits)
        native_stream = self._native_stream(stream, f"launch.{kernel.name}.stream")
        used: set[int] = set()
        resolved = self._resolve_args(kernel, tuple(args), used)
        shape = (tuple(map(int, grid)), tuple(map(int, block)))
        native = self._kernels[kernel]
        if self._capturing(stream):
            assert self._capture is not None
            self._capture.alloc_ids |= used
            self._capture.nodes += 1
            self._captured_launch(kernel, native, *shape, int(shared_mem), resolved,
                                  native_stream, bool(dependent))
            return
        self._last_kernel = kernel.name
        self._launch(kernel, native, *shape, int(shared_mem), resolved, native_stream,
                     bool(dependent))

    def resolve(self, ptr: DevicePtr, key: str, nbytes: int | None = None
                ) -> tuple[Any, int, int]:
        """``(storage, offset, nbytes)`` of a live pointer, for an access of ``nbytes``
        (default: all of it): what a library call outside the kernels (NCCL's, through
        ``runtime.nccl``) is given; the same errors as a launch's arguments."""
        return self._mem.resolve(ptr, key, nbytes)

    def synchronize(self, stream: Stream | None = None) -> None:
        """Wait for ``stream`` (or, with ``None``, for all work on the device)."""
        self._enter("synchronize", (stream,))
        self._sync(self._native_stream(stream, "synchronize.stream"))

    def copy_h2d(self, dst: DevicePtr, src: Any, stream: Stream | None = None) -> None:
        """Copy the bytes of ``src`` (bytes-like or a C-contiguous array) to ``dst``."""
        self._enter("copy_h2d", (dst, src, stream))
        data = _host_bytes(src, "copy_h2d.src")
        storage, offset, n = self._mem.resolve(dst, "copy_h2d.dst", data.size)
        native_stream = self._native_stream(stream, "copy_h2d.stream")
        if n:
            self._h2d(storage, offset, data, native_stream)

    def copy_d2h(
        self, src: DevicePtr, nbytes: int | None = None, stream: Stream | None = None
    ) -> np.ndarray:
        """A fresh ``np.uint8`` array with ``nbytes`` (default: all) bytes from ``src``."""
        self._enter("copy_d2h", (src, nbytes, stream))
        storage, offset, n = self._mem.resolve(src, "copy_d2h.src", nbytes)
        native_stream = self._native_stream(stream, "copy_d2h.stream")
        if not n:
            return np.empty(0, np.uint8)
        return self._d2h(storage, offset, n, native_stream)

    def memset(
        self, dst: DevicePtr, value: int, nbytes: int | None = None, stream: Stream | None = None
    ) -> None:
        """Set ``nbytes`` (default: all) bytes at ``dst`` to ``value`` (0..255)."""
        self._enter("memset", (dst, value, nbytes, stream), in_capture=True)
        if not is_int(value) or not 0 <= value <= 255:
            raise LaunchError(
                "memset value is not a byte", key="memset.value", expected="0..255",
                found=repr(value),
            )
        storage, offset, n = self._mem.resolve(dst, "memset.dst", nbytes)
        native_stream = self._native_stream(stream, "memset.stream")
        if self._capturing(stream):
            assert self._capture is not None and isinstance(dst, DevicePtr)
            self._capture.alloc_ids.add(dst.alloc_id)
            self._capture.nodes += 1
            if n:
                self._captured_memset(storage, offset, int(value), n, native_stream)
            return
        if n:
            self._memset(storage, offset, int(value), n, native_stream)

    def stream(self) -> Stream:
        """A new stream; work on it is ordered after earlier work on it only."""
        self._enter("stream", ())
        handle = Stream(len(self._streams) + 1)
        self._streams[handle.stream_id] = self._new_stream()
        return handle

    def begin_capture(self, stream: Stream) -> None:
        """Start recording the work issued on ``stream`` (a stream from ``stream()``)."""
        self._enter("begin_capture", (stream,))
        if not self.supports_graphs:
            raise UnavailableError("graph capture is not supported", key="begin_capture",
                                   found=f"backend {self.name!r}")
        if stream is None:
            raise LaunchError(
                "the default stream cannot be captured", key="begin_capture.stream",
                expected="a Stream from stream()", found="None",
            )
        native_stream = self._native_stream(stream, "begin_capture.stream")
        self._begin_capture(native_stream)
        self._capture = _Capture(stream)

    def end_capture(self, stream: Stream) -> GraphHandle:
        """Stop recording on ``stream``; the graph replays what was recorded."""
        self._enter("end_capture", (stream,), in_capture=True)
        if self._capture is None or self._capture.stream != stream:
            raise LaunchError(
                "stream is not capturing", key="end_capture.stream",
                expected="the stream given to begin_capture", found=repr(stream),
            )
        capture, self._capture = self._capture, None
        native = self._end_capture(self._streams[stream.stream_id])
        self._graph_ids += 1
        handle = GraphHandle(self._graph_ids, stream, capture.nodes)
        self._graphs[handle.graph_id] = _Graph(handle, native, frozenset(capture.alloc_ids))
        return handle

    def release_graph(self, graph: GraphHandle) -> None:
        """Free a captured graph (its native graph goes with it); launching it after is a
        ``LaunchError``. Releasing a graph already released, or after the backend closed or
        faulted (its graphs went with it), does nothing."""
        self._record("release_graph", (graph,))
        if self._closed or self._latch.latched:
            return
        if self._capture is not None:
            self._refuse_in_capture("release_graph")
        if not isinstance(graph, GraphHandle):
            raise LaunchError("not a graph", key="release_graph.graph", found=repr(graph))
        self._graphs.pop(graph.graph_id, None)

    def graph_count(self) -> int:
        """Captured graphs held (not yet released): a long-running server's must stay bounded."""
        return len(self._graphs)

    def graph_launch(self, graph: GraphHandle, stream: Stream | None = None) -> None:
        """Replay a captured graph on ``stream``; every buffer it uses must still be live."""
        self._enter("graph_launch", (graph, stream))
        if not isinstance(graph, GraphHandle) or graph.graph_id not in self._graphs:
            raise LaunchError("not a graph of this backend", key="graph_launch.graph",
                              found=repr(graph))
        entry = self._graphs[graph.graph_id]
        for alloc_id in sorted(entry.alloc_ids):
            self._mem.check_live(alloc_id, "graph_launch.graph")
        native_stream = self._native_stream(stream, "graph_launch.stream")
        self._graph_launch(entry.native, native_stream)

    def live_bytes(self) -> int:
        """Bytes in allocations not yet freed (answers after a fault too)."""
        self._record("live_bytes", ())
        return self._mem.live_bytes

    def close(self) -> None:
        """Release everything; idempotent; after a fault it abandons instead and never raises."""
        self._record("close", ())
        if self._closed:
            return
        self._closed = True
        first: Exception | None = None
        for storage in self._mem.drain():
            if self._latch.latched:
                self._abandon(storage)
                continue
            try:
                self._free(storage)
            except Exception as e:  # keep releasing; the first error surfaces below
                first = first or e
        try:
            self._shutdown()
        except Exception as e:
            first = first or e
        self._capture = None
        if first is not None and not self._latch.latched:
            raise first

    @property
    def faulted(self) -> DeviceFault | None:
        """The latched device fault, or ``None``."""
        return self._latch.fault

    def __enter__(self) -> BackendBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _host_bytes(src: Any, key: str) -> np.ndarray:
    """``src`` as a 1-D ``np.uint8`` array without copying where possible."""
    if isinstance(src, np.ndarray):
        if not src.flags.c_contiguous:
            raise LaunchError("source array is not C-contiguous", key=key,
                              expected="a C-contiguous array", found=f"strides {src.strides}")
        return src.reshape(-1).view(np.uint8)
    if isinstance(src, bytes | bytearray | memoryview):
        return np.frombuffer(src, np.uint8)
    raise LaunchError("source is not host bytes", key=key,
                      expected="bytes, bytearray, memoryview or np.ndarray",
                      found=type(src).__name__)
