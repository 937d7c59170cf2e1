"""CupyBackend: the GpuBackend model on a CUDA device, through CuPy (imported only when used).

Memory is plain device memory from ``cudaMalloc`` (``cupy.cuda.runtime.malloc``), released
with ``cudaFree`` on ``free``: not CuPy's pool, so a freed buffer is never handed to another
stream while a kernel still reads it (``cudaFree`` waits for the device), and not managed
memory. Modules load from PTX text or cubin/fatbin bytes (``cuModuleLoadData``). A kernel's
parameter widths are read from its PTX ``.entry`` where the binary is PTX (PTX does not say
signed or pointer: ``int`` reads as ``.u32``, a pointer as ``.u64``); a cubin needs
``kernel(..., arity=N)``.

Argument convention for ``launch``: a ``DevicePtr`` is passed as its 64-bit address; a NumPy
scalar is passed as it is (its width must match the PTX parameter where known); a Python
``int`` takes the width of the PTX parameter (signed, or unsigned where only that holds it),
else ``int32``; a Python ``float`` takes the PTX parameter's float type, else ``float32``. ``stream=None`` is CUDA's legacy default stream;
streams from :meth:`stream` are non-blocking, so work on two streams is ordered only by
``synchronize``. A ``dependent`` launch goes through ``cuLaunchKernelEx`` as a programmatic
dependent launch (``cuda_driver``). A CUDA error from the device latches a sticky ``DeviceFault`` (the context is
dead); an out-of-memory ``cudaMalloc`` raises ``AllocationError`` and is not sticky.

>>> ok, why = CupyBackend.available()
>>> isinstance(ok, bool) and isinstance(why, str)
True
>>> sorted(ptx_params('''
... .visible .entry fill(
...     .param .u64 fill_param_0,
...     .param .u32 fill_param_1
... )
... .visible .entry noop()
... ''').items())
[('fill', ('u64', 'u32')), ('noop', ())]
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from metrale.lkb.errors import CompileError, LaunchError, UnavailableError
from metrale.runtime.backend import (
    DeviceLimits,
    KernelHandle,
    ModuleHandle,
    TensorMap,
    is_int,
    no_such_kernel,
    out_of_memory,
)
from metrale.runtime.backend_base import BackendBase
from metrale.runtime.cuda_driver import DriverError, DriverLauncher, encode_tensor_map

__all__ = ["CupyBackend", "ptx_params"]

_CUDA_OOM = 2  # cudaErrorMemoryAllocation
_REFUSALS = {1, 701}  # CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: not faults
_STATIC_SHARED = 48 * 1024  # more dynamic shared memory than this needs the opt-in attribute
_ELF = b"\x7fELF"
_DEAD_CONTEXT: list[Any] = []
_INTS = {1: (np.int8, np.uint8), 2: (np.int16, np.uint16), 4: (np.int32, np.uint32),
         8: (np.int64, np.uint64)}  # CUDA objects of faulted backends, never destroyed
_FATBIN = b"\x50\xed\x55\xba"

_ENTRY = re.compile(r"\.entry\s+([A-Za-z_$][\w$]*)\s*\(([^)]*)\)")
_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.(\w+)\s+[\w$]+\s*(\[\s*\d+\s*\])?")
_PTX_DTYPES = {
    "u8": "u1", "s8": "i1", "b8": "u1", "u16": "u2", "s16": "i2", "b16": "u2", "f16": "f2",
    "u32": "u4", "s32": "i4", "b32": "i4", "f32": "f4",
    "u64": "u8", "s64": "i8", "b64": "u8", "f64": "f8",
}


def ptx_params(ptx: str) -> dict[str, tuple[str, ...]]:
    """The parameter types of every ``.entry`` of a PTX text (``'u64'``, ``'f32'`` …).

    An array parameter (a struct passed by value) reads as ``'b8[16]'``.
    """
    out: dict[str, tuple[str, ...]] = {}
    for m in _ENTRY.finditer(ptx):
        out[m.group(1)] = tuple(
            p.group(1) + (p.group(2) or "").replace(" ", "") for p in _PARAM.finditer(m.group(2))
        )
    return out


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise UnavailableError(
            "CuPy is not installed", key="cuda",
            expected="pip install 'metrale[cuda]' (CUDA 12) or 'metrale[cuda13]' (CUDA 13)",
            found=str(e),
        ) from None
    except Exception as e:  # a broken CUDA install fails CuPy's import in many ways
        raise UnavailableError(
            "CuPy failed to import", key="cuda", found=f"{type(e).__name__}: {e}"
        ) from None
    return cupy


def _param_dtype(ptype: str | None) -> np.dtype | None:
    if ptype is None or "[" in ptype or ptype not in _PTX_DTYPES:
        return None
    return np.dtype(_PTX_DTYPES[ptype])


def _width_error(kernel: KernelHandle, index: int, ptype: str, found: str) -> LaunchError:
    return LaunchError(
        "argument does not fit the kernel's parameter", file=kernel.source or None,
        key=f"launch.{kernel.name}.args[{index}]", expected=f".{ptype}", found=found,
    )


class CupyBackend(BackendBase):
    """The CUDA model of GpuBackend (see the module docstring for the conventions).

    Constructing one without CuPy or without a device raises ``UnavailableError`` saying which.
    """

    name = "cuda"
    binary_format = "cuda"
    supports_graphs = True

    @staticmethod
    def available() -> tuple[bool, str]:
        """``(True, what)`` where a CUDA device can be used here, else ``(False, why not)``."""
        try:
            cupy = _import_cupy()
        except UnavailableError as e:
            return False, str(e)
        try:
            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as e:  # no driver, driver too old, no device node …
            return False, f"CUDA driver error: {type(e).__name__}: {e}"
        if count == 0:
            return False, "no CUDA device"
        return True, f"{count} CUDA device{'s' if count != 1 else ''}"

    def __init__(self, device: int = 0) -> None:
        ok, why = self.available()
        if not ok:
            raise UnavailableError("CUDA backend unavailable", key="cuda", found=why)
        cp = _import_cupy()
        self._cp = cp
        self._rt = cp.cuda.runtime
        self._errors = (cp.cuda.runtime.CUDARuntimeError, cp.cuda.driver.CUDADriverError)
        try:
            self._device = cp.cuda.Device(device)
            with self._device:
                a = self._device.attributes
                props = self._rt.getDeviceProperties(self._device.id)
                total = self._rt.memGetInfo()[1]
        except self._errors as e:
            raise UnavailableError(
                "CUDA device unusable", key="cuda", found=f"device {device}: {e}"
            ) from None
        name = props["name"]
        limits = DeviceLimits(
            name=name.decode() if isinstance(name, bytes) else str(name),
            max_threads_per_block=a["MaxThreadsPerBlock"],
            max_block=(a["MaxBlockDimX"], a["MaxBlockDimY"], a["MaxBlockDimZ"]),
            max_grid=(a["MaxGridDimX"], a["MaxGridDimY"], a["MaxGridDimZ"]),
            max_shared_mem=a.get("MaxSharedMemoryPerBlockOptin", a["MaxSharedMemoryPerBlock"]),
            multiprocessors=a["MultiProcessorCount"],
            total_memory=int(total),
            compute_capability=(int(props["major"]), int(props["minor"])),
        )
        super().__init__(limits)
        self._opted_in: dict[int, int] = {}  # function pointer -> dynamic shared bytes allowed
        # (address, rows, cols, dtype, box) -> encoded map: a program's buffers keep their
        # addresses, so each of its maps is encoded once (an address reused by another buffer
        # of the same description has the same map)
        self._tensor_maps: dict[tuple, np.void] = {}
        self._driver: DriverLauncher | None = None  # dependent launches, made on first use

    @contextmanager
    def _cuda(self, op: str, kernel: str | None = None) -> Iterator[None]:
        """Run CUDA calls on this device; a CUDA error becomes the sticky ``DeviceFault``."""
        try:
            with self._device:
                yield
        except self._errors as e:
            raise self._fault(op, f"{type(e).__name__}: {e}", kernel) from e

    def _stream(self, stream: Any) -> Any:
        return stream if stream is not None else self._cp.cuda.Stream.null

    # memory ---------------------------------------------------------------------------------

    def _alloc(self, nbytes: int, label: str) -> Any:
        if nbytes == 0:
            return 0
        try:
            with self._device:
                return self._rt.malloc(nbytes)
        except self._rt.CUDARuntimeError as e:
            if e.status == _CUDA_OOM:
                with self._cuda("alloc"):
                    free = self._rt.memGetInfo()[0]
                raise out_of_memory(label, nbytes, f"{free} bytes free") from None
            raise self._fault("alloc", f"{type(e).__name__}: {e}") from e

    def _free(self, storage: Any) -> None:
        if storage:
            with self._cuda("free"):
                self._rt.free(storage)

    def _h2d(self, storage: Any, offset: int, data: np.ndarray, stream: Any) -> None:
        kind = self._rt.memcpyHostToDevice
        with self._cuda("copy_h2d"):
            if stream is None:
                self._rt.memcpy(storage + offset, data.ctypes.data, data.size, kind)
            else:
                self._rt.memcpyAsync(storage + offset, data.ctypes.data, data.size, kind,
                                     stream.ptr)
                stream.synchronize()  # the host buffer may go as soon as we return

    def _d2h(self, storage: Any, offset: int, nbytes: int, stream: Any) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        kind = self._rt.memcpyDeviceToHost
        with self._cuda("copy_d2h"):
            if stream is None:
                self._rt.memcpy(out.ctypes.data, storage + offset, nbytes, kind)
            else:
                self._rt.memcpyAsync(out.ctypes.data, storage + offset, nbytes, kind, stream.ptr)
                stream.synchronize()
        return out

    def _memset(self, storage: Any, offset: int, value: int, nbytes: int, stream: Any) -> None:
        with self._cuda("memset"):
            self._rt.memsetAsync(storage + offset, value, nbytes, self._stream(stream).ptr)

    # kernels --------------------------------------------------------------------------------

    def _load(self, binary: object, label: str) -> tuple[Any, tuple[str, ...] | None, dict]:
        if isinstance(binary, str):
            data = binary.encode()
        elif isinstance(binary, bytes | bytearray | memoryview):
            data = bytes(binary)
        else:
            raise LaunchError(
                "not a CUDA binary", file=label or None, key="module",
                expected="PTX text or cubin/fatbin bytes", found=type(binary).__name__,
            )
        params: dict[str, tuple[str, ...]] | None = None
        if not (data.startswith(_ELF) or data.startswith(_FATBIN)):
            params = ptx_params(data.decode("utf-8", errors="replace"))
            if not data.endswith(b"\0"):
                data += b"\0"  # cuModuleLoadData reads PTX as a C string
        module = self._cp.cuda.function.Module()
        try:
            with self._device:
                module.load(data)
        except self._errors as e:
            raise CompileError(
                "module failed to load", file=label or None, key="module",
                found=f"{type(e).__name__}: {e}",
            ) from None
        names = None if params is None else tuple(params)
        arities = {} if params is None else {n: len(p) for n, p in params.items()}
        return (module, params or {}), names, arities

    def _get_kernel(self, native_module: Any, name: str, module: ModuleHandle) -> Any:
        cu_module, params = native_module
        try:
            with self._device:
                fn = cu_module.get_function(name)
        except self._errors:
            raise no_such_kernel(name, module, None) from None
        return fn, params.get(name)

    def _ptype(self, kernel: KernelHandle, index: int) -> str | None:
        params = self._kernels[kernel][1]
        return params[index] if params is not None and index < len(params) else None

    def _pointer_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                     nbytes: int) -> Any:
        ptype = self._ptype(kernel, index)
        dtype = _param_dtype(ptype)
        if ptype is not None and (dtype is None or dtype.kind != "u" or dtype.itemsize != 8):
            raise _width_error(kernel, index, ptype, "a DevicePtr (64-bit address)")
        return np.uint64(storage + offset)

    def _tensor_map_arg(self, kernel: KernelHandle, index: int, storage: Any, offset: int,
                        tmap: TensorMap) -> Any:
        key = (storage + offset, tmap.rows, tmap.cols, tmap.dtype, tmap.box)
        found = self._tensor_maps.get(key)
        if found is None:
            try:
                found = encode_tensor_map(*key)
            except DriverError as e:
                raise LaunchError("the driver refused the tensor map", file=kernel.source or None,
                                  key=f"launch.{kernel.name}.args[{index}]",
                                  expected="a row-major array with 16-byte rows and a box of "
                                  "128-byte rows", found=f"{tmap} ({e})") from None
            self._tensor_maps[key] = found
        return found

    def _scalar_arg(self, kernel: KernelHandle, index: int, value: Any) -> Any:
        ptype = self._ptype(kernel, index)
        dtype = _param_dtype(ptype)
        if isinstance(value, np.generic):
            if dtype is not None and value.dtype.itemsize != dtype.itemsize:
                assert ptype is not None
                raise _width_error(kernel, index, ptype, f"{value.dtype} ({value!r})")
            return value
        if isinstance(value, bool):
            value = int(value)
        if is_int(value):
            target = np.dtype(np.int32) if dtype is None else dtype
            if target.kind not in "iu":
                raise _width_error(kernel, index, ptype or "?", f"int {value}")
            # PTX writes `int` as .u32 and `long long` as .u64: take either signedness
            signed, unsigned = _INTS[target.itemsize]
            half = 1 << (8 * target.itemsize - 1)
            if -half <= value < half:
                return signed(value)
            if half <= value < 2 * half:
                return unsigned(value)
            raise _width_error(kernel, index, ptype or "s32", f"int {value} (out of range)")
        if isinstance(value, float):
            target = np.dtype(np.float32) if dtype is None else dtype
            if target.kind != "f":
                raise _width_error(kernel, index, ptype or "?", f"float {value}")
            return target.type(value)
        raise LaunchError(
            "unsupported kernel argument", file=kernel.source or None,
            key=f"launch.{kernel.name}.args[{index}]",
            expected="DevicePtr, int, float or a NumPy scalar", found=type(value).__name__,
        )

    def _launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                stream: Any, dependent: bool = False) -> None:
        fn = native[0]
        try:
            with self._device:
                if shared_mem > _STATIC_SHARED and self._opted_in.get(fn.ptr, 0) < shared_mem:
                    driver = self._cp.cuda.driver
                    attribute = getattr(driver, "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES", 8)
                    driver.funcSetAttribute(fn.ptr, attribute, shared_mem)
                    self._opted_in[fn.ptr] = shared_mem
                # CuPy's launch passes no tensor map (a 128-byte argument): the driver's does
                if dependent or any(isinstance(a, np.void) for a in args):
                    if self._driver is None:
                        self._driver = DriverLauncher()
                    self._driver.launch_dependent(fn.ptr, grid, block, shared_mem,
                                                  self._stream(stream).ptr, args, dependent)
                else:
                    fn(grid, block, args, shared_mem=shared_mem, stream=self._stream(stream))
        except (self._cp.cuda.driver.CUDADriverError, DriverError) as e:
            if e.status in _REFUSALS:
                raise LaunchError(
                    "the driver refused the launch", file=kernel.source or None,
                    key=f"launch.{kernel.name}", found=str(e),
                ) from None
            raise self._fault("launch", f"{type(e).__name__}: {e}", kernel.name) from e
        except self._errors as e:
            raise self._fault("launch", f"{type(e).__name__}: {e}", kernel.name) from e

    # streams and graphs -----------------------------------------------------------------------

    def _sync(self, stream: Any) -> None:
        with self._cuda("synchronize"):
            if stream is None:
                self._rt.deviceSynchronize()
            else:
                stream.synchronize()

    def _new_stream(self) -> Any:
        with self._cuda("stream"):
            return self._cp.cuda.Stream(non_blocking=True)

    def _begin_capture(self, stream: Any) -> None:
        with self._cuda("begin_capture"):
            stream.begin_capture()

    def _end_capture(self, stream: Any) -> Any:
        with self._cuda("end_capture"):
            return stream.end_capture()

    def _graph_launch(self, native: Any, stream: Any) -> None:
        with self._cuda("graph_launch"):
            native.launch(stream=self._stream(stream))

    def _shutdown(self) -> None:
        try:
            if not self._latch.latched:
                with self._cuda("close"):
                    self._rt.deviceSynchronize()
            else:
                # their destructors would call into a dead context and print errors; keep them
                _DEAD_CONTEXT.append((self._graphs.copy(), self._kernels.copy(),
                                      self._modules.copy(), self._streams.copy()))
        finally:
            self._graphs.clear()
            self._kernels.clear()
            self._modules.clear()
            self._streams.clear()
