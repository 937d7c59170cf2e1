"""GpuBackend, an algebraic theory: device operations, the values they exchange, their equations.

The operations are ``alloc free module kernel launch synchronize copy_h2d copy_d2h memset
stream begin_capture end_capture graph_launch live_bytes close``. Three models implement them:
``MockBackend`` (records, injects faults), ``HostBackend`` (NumPy) and ``CupyBackend`` (CUDA).
Each subclasses ``backend_base.BackendBase``, which does every check that needs no device,
so the same misuse raises the same exception class with the same text in every model.

Equations (tested as one Hypothesis state machine, ``metrale.backend_laws``):

1. ``copy_d2h(p, len(b))`` after ``copy_h2d(p, b)``, with no write to ``p`` between, returns ``b``.
2. ``copy_d2h(p, n)`` after ``memset(p, v, n)`` returns ``n`` bytes equal to ``v``.
3. ``live_bytes()`` is the sum of the sizes of the allocations not yet freed; ``alloc(0)``
   returns a pointer of zero bytes that adds nothing, and can be freed like any other.
4. After ``free(p)``, any operation given ``p`` or a pointer derived from it raises
   ``PointerError`` ("use after free of buffer 'label'") and changes nothing.
5. Operations issued on one stream take effect in issue order; ``synchronize(s)`` waits for
   stream ``s``, ``synchronize()`` for all of them; ``synchronize`` is idempotent.
6. A launch that :func:`check_launch` refuses raises ``LaunchError`` before anything reaches the
   device; its text depends only on the kernel, the launch shape, the arguments and the limits,
   and it is not sticky.
7. A kernel written as a grid-stride loop has the same effect for every valid grid and block.
8. Work issued on a capturing stream does not run; ``graph_launch(end_capture(s))`` re-issues
   it, in order, with the same arguments, as often as it is called.
9. Once a ``DeviceFault`` is raised, every later operation except ``free``, ``live_bytes`` and
   ``close`` raises a ``DeviceFault`` with the same text; ``free`` and ``close`` return quietly.
10. An ``AllocationError`` (out of memory) is not sticky: earlier allocations stay valid and
    later allocations may succeed.
11. Pointers are deterministic values: the k-th allocation of every model is
    ``DevicePtr(k, n)``, so one program drives every model with the same pointers.
12. ``launch(..., dependent=True)`` has the effect of the plain launch. On CUDA it is a
    programmatic dependent launch: the kernel may start while the previous launch on its stream
    is still running, so it must wait (``griddepcontrol.wait``, ``grid_dependency_sync`` in
    ``metrale.cuh``) before it touches memory that earlier work wrote or reads; the host and
    mock models run it as the plain launch.

>>> from metrale.runtime.host_backend import HostBackend, HostKernel
>>> be = HostBackend()
>>> p = be.alloc(4, "x")
>>> be.copy_h2d(p, b"\\x01\\x02\\x03\\x04")
>>> bytes(be.copy_d2h(p + 2))
b'\\x03\\x04'
>>> be.free(p)
>>> be.copy_d2h(p)
Traceback (most recent call last):
...
metrale.runtime.backend.PointerError: copy_d2h.src: use after free of buffer 'x'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np

from metrale.lkb.errors import (
    AllocationError,
    DeviceFault,
    LaunchError,
    MetraleError,
    nearest,
)


class PointerError(LaunchError):
    """A pointer that names no live allocation, or an access outside the buffer it names."""


# ---------------------------------------------------------------------------------------------
# Values


@attrs.frozen(cache_hash=True)  # looked up on every launch
class DevicePtr:
    """A pointer into one allocation: which one, where in it, and how many bytes it spans.

    ``ptr + k`` is the sub-pointer ``k`` bytes further on (``0 <= k <= nbytes``);
    ``ptr.take(n)`` keeps the first ``n`` bytes. Pointers are values: backends give the k-th
    allocation the id ``k``, and resolve a pointer only while its allocation is live.

    >>> p = DevicePtr(1, 16)
    >>> p + 4
    DevicePtr(alloc_id=1, nbytes=12, offset=4)
    >>> (p + 4).take(2)
    DevicePtr(alloc_id=1, nbytes=2, offset=4)
    >>> p + 17
    Traceback (most recent call last):
    ...
    metrale.runtime.backend.PointerError: pointer offset outside its range (expected 0..16, ...)
    """

    alloc_id: int
    nbytes: int
    offset: int = 0

    def __add__(self, k: int) -> DevicePtr:
        if not is_int(k) or not 0 <= k <= self.nbytes:
            raise PointerError(
                "pointer offset outside its range", expected=f"0..{self.nbytes}", found=k
            )
        return DevicePtr(self.alloc_id, self.nbytes - k, self.offset + k)

    def take(self, n: int) -> DevicePtr:
        """The pointer to the first ``n`` bytes of this one."""
        if not is_int(n) or not 0 <= n <= self.nbytes:
            raise PointerError(
                "pointer length outside its range", expected=f"0..{self.nbytes}", found=n
            )
        return DevicePtr(self.alloc_id, n, self.offset)


TENSOR_MAP_DTYPES = {"bf16": 2, "f32": 4, "u8": 1}
"""The element types a :class:`TensorMap` may describe, by name, with their bytes."""


@attrs.frozen(cache_hash=True)  # looked up on every launch
class TensorMap:
    """A launch argument: the Tensor Memory Accelerator's description of a row-major array of
    ``rows`` x ``cols`` elements of ``dtype`` at ``ptr``, which a kernel copies into shared
    memory in boxes of ``box`` = (columns, rows) elements, 128 bytes a box row, laid out with
    the 128-byte swizzle (16-byte piece p of box row r at piece p ^ (r % 8)); elements outside
    the array land as zeros. Each model encodes it for its device (CUDA: ``CUtensorMap``,
    ``runtime.cuda_driver.encode_tensor_map``); the launch checks that the array lies inside
    ``ptr``'s allocation, as for a pointer.

    >>> TensorMap(DevicePtr(1, 4096), 16, 128, "bf16", (64, 16)).nbytes
    4096
    """

    ptr: DevicePtr
    rows: int
    cols: int
    dtype: str
    box: tuple[int, int]

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * TENSOR_MAP_DTYPES[self.dtype]


@attrs.frozen(cache_hash=True)  # looked up on every launch
class Stream:
    """A stream of one backend; ``None`` in its place means the default stream.

    >>> Stream(1)
    Stream(stream_id=1)
    """

    stream_id: int


@attrs.frozen
class ModuleHandle:
    """A loaded module (a compiled binary): its id in the backend and the label it was given.

    >>> ModuleHandle(1, "rmsnorm.ptx")
    ModuleHandle(module_id=1, label='rmsnorm.ptx')
    """

    module_id: int
    label: str = ""


@attrs.frozen(cache_hash=True)  # looked up on every launch
class KernelHandle:
    """A kernel entry of a loaded module, with its declared arity (number of arguments).

    ``source`` is the module's label; launch errors name it as the file.

    >>> KernelHandle(1, "rmsnorm", 4)
    KernelHandle(module_id=1, name='rmsnorm', arity=4, source='')
    """

    module_id: int
    name: str
    arity: int
    source: str = ""


@attrs.frozen
class GraphHandle:
    """A captured graph: its id, the stream it was captured on and how many operations it holds.

    >>> GraphHandle(1, Stream(1), 3)
    GraphHandle(graph_id=1, stream=Stream(stream_id=1), nodes=3)
    """

    graph_id: int
    stream: Stream
    nodes: int


@attrs.frozen
class DeviceLimits:
    """What a launch may ask of a device. Defaults are those of Hopper (sm_90: H100, H200).

    ``max_shared_mem`` is the dynamic shared memory one block may ask for (the opt-in
    maximum); ``total_memory`` and ``compute_capability`` (major, minor) are ``None`` where
    unknown.

    >>> DeviceLimits().max_block
    (1024, 1024, 64)
    """

    name: str = "generic"
    max_threads_per_block: int = 1024
    max_block: tuple[int, int, int] = (1024, 1024, 64)
    max_grid: tuple[int, int, int] = (2**31 - 1, 65535, 65535)
    max_shared_mem: int = 227 * 1024
    multiprocessors: int = 1
    total_memory: int | None = None
    compute_capability: tuple[int, int] | None = None


@attrs.frozen
class HostKernel:
    """One entry of a *host binary* (a mapping ``{entry_name: HostKernel}``).

    ``fn`` is called once per launch with every ``DevicePtr`` argument replaced by a 1-D
    ``np.uint8`` view of its bytes (the function reinterprets it with ``.view(dtype)``) and
    every other argument as given; ``fn=None`` makes a kernel that does nothing.

    >>> k = HostKernel(lambda out, v: out.fill(v), 2)
    >>> k.arity
    2
    """

    fn: Callable[..., Any] | None
    arity: int


# ---------------------------------------------------------------------------------------------
# The theory


@runtime_checkable
class GpuBackend(Protocol):
    """The operations every model provides (see the module docstring for the equations).

    ``binary_format`` says what ``module`` loads: ``"host"`` (a mapping of ``HostKernel``) or
    ``"cuda"`` (PTX text or cubin bytes).

    >>> from metrale.runtime.host_backend import HostBackend
    >>> isinstance(HostBackend(), GpuBackend)
    True
    """

    name: str
    limits: DeviceLimits
    binary_format: str
    supports_graphs: bool

    def alloc(self, nbytes: int, label: str = "") -> DevicePtr: ...
    def free(self, ptr: DevicePtr) -> None: ...
    def module(self, binary: object, label: str = "") -> ModuleHandle: ...
    def kernel(self, module: ModuleHandle, name: str, arity: int | None = None) -> KernelHandle: ...
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
    ) -> None: ...
    def synchronize(self, stream: Stream | None = None) -> None: ...
    def copy_h2d(self, dst: DevicePtr, src: Any, stream: Stream | None = None) -> None: ...
    def copy_d2h(
        self, src: DevicePtr, nbytes: int | None = None, stream: Stream | None = None
    ) -> np.ndarray: ...
    def memset(
        self, dst: DevicePtr, value: int, nbytes: int | None = None, stream: Stream | None = None
    ) -> None: ...
    def stream(self) -> Stream: ...
    def begin_capture(self, stream: Stream) -> None: ...
    def end_capture(self, stream: Stream) -> GraphHandle: ...
    def graph_launch(self, graph: GraphHandle, stream: Stream | None = None) -> None: ...
    def release_graph(self, graph: GraphHandle) -> None: ...
    def live_bytes(self) -> int: ...
    def close(self) -> None: ...


# ---------------------------------------------------------------------------------------------
# Message templates: every model raises through these, so the texts agree.


def is_int(x: object) -> bool:
    """Whether ``x`` is an integer (Python or NumPy), not a bool.

    >>> is_int(3), is_int(np.int64(3)), is_int(True)
    (True, True, False)
    """
    t = type(x)
    if t is int:  # the common case first: launches check many of these
        return True
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def buffer_name(label: str, alloc_id: int) -> str:
    """How errors name a buffer: its label, else ``#id``.

    >>> buffer_name("", 3)
    '#3'
    """
    return label or f"#{alloc_id}"


def out_of_memory(label: str, nbytes: int, found: object) -> AllocationError:
    """The error for an allocation the device cannot satisfy.

    >>> print(out_of_memory("kv_cache", 1 << 20, "512 bytes free"))
    kv_cache: out of device memory (expected 1048576 bytes free, found 512 bytes free)
    """
    return AllocationError(
        "out of device memory", key=label or "<unlabelled>", expected=f"{nbytes} bytes free",
        found=found,
    )


def device_fault(op: str, kernel: str | None, cause: object) -> DeviceFault:
    """The error for a fault of the device; it names the kernel that ran last.

    >>> print(device_fault("synchronize", "rmsnorm", "illegal memory access"))
    synchronize: device fault in kernel 'rmsnorm' (expected no fault, found illegal memory access)
    """
    where = f"in kernel {kernel!r}" if kernel else "before any kernel ran"
    return DeviceFault(f"device fault {where}", key=op, expected="no fault", found=cause)


def no_such_kernel(name: str, module: ModuleHandle, known: tuple[str, ...] | None) -> LaunchError:
    """The error for a kernel name a module does not define."""
    return LaunchError(
        f"module has no kernel {name!r}",
        file=module.label or None,
        key=f"kernel.{name}",
        expected=None if known is None else "one of " + ", ".join(sorted(known)),
        found=repr(name),
        suggestion=None if known is None else nearest(name, known),
    )


def _dims(value: object, what: str, limit: tuple[int, int, int], where: str, file: str | None):
    if type(value) is tuple and len(value) == 3:
        x, y, z = value
        if (type(x) is int and type(y) is int and type(z) is int
                and 1 <= x <= limit[0] and 1 <= y <= limit[1] and 1 <= z <= limit[2]):
            return  # the fast path of every valid launch
    if (
        not isinstance(value, tuple | list)
        or len(value) != 3
        or not all(is_int(v) for v in value)
    ):
        raise LaunchError(
            f"{what} is not three integers", file=file, key=f"{where}.{what}",
            expected="(x, y, z)", found=repr(value),
        )
    for axis, v, top in zip("xyz", value, limit):
        if not 1 <= v <= top:
            raise LaunchError(
                f"{what} dimension out of range", file=file, key=f"{where}.{what}.{axis}",
                expected=f"1..{top}", found=int(v),
            )


def check_launch(
    kernel: KernelHandle,
    grid: object,
    block: object,
    shared_mem: object,
    args: object,
    limits: DeviceLimits,
) -> None:
    """Refuse a launch that no device would run, before it reaches one; every model calls this.

    Checks, in this order: grid (three integers, each in ``1..max_grid``), block (each in
    ``1..max_block``, product at most ``max_threads_per_block``), dynamic shared memory
    (``0..max_shared_mem``) and the argument count against the kernel's arity.

    >>> k = KernelHandle(1, "rmsnorm", 3, "rmsnorm.ptx")
    >>> check_launch(k, (4, 1, 1), (256, 1, 1), 0, (1, 2, 3), DeviceLimits())
    >>> def refused(*shape_and_args):
    ...     try:
    ...         check_launch(k, *shape_and_args, DeviceLimits())
    ...     except LaunchError as e:
    ...         print(e)
    >>> refused((4, 0, 1), (256, 1, 1), 0, (1, 2, 3))
    rmsnorm.ptx: launch.rmsnorm.grid.y: grid dimension out of range (expected 1..65535, found 0)
    >>> refused((4, 1, 1), (64, 4, 8), 0, (1, 2, 3))  # doctest: +NORMALIZE_WHITESPACE
    rmsnorm.ptx: launch.rmsnorm.block: too many threads per block
    (expected at most 1024, found 2048 = 64x4x8)
    >>> refused((4, 1, 1), (256, 1, 1), 0, (1, 2))
    rmsnorm.ptx: launch.rmsnorm.args: wrong number of arguments (expected 3, found 2)
    """
    where = f"launch.{kernel.name}"
    file = kernel.source or None
    _dims(grid, "grid", limits.max_grid, where, file)
    _dims(block, "block", limits.max_block, where, file)
    threads = math.prod(int(v) for v in block)  # type: ignore[union-attr]
    if threads > limits.max_threads_per_block:
        x, y, z = block  # type: ignore[misc]
        raise LaunchError(
            "too many threads per block", file=file, key=f"{where}.block",
            expected=f"at most {limits.max_threads_per_block}", found=f"{threads} = {x}x{y}x{z}",
        )
    if not is_int(shared_mem) or not 0 <= shared_mem <= limits.max_shared_mem:  # type: ignore[operator]
        raise LaunchError(
            "dynamic shared memory out of range", file=file, key=f"{where}.shared_mem",
            expected=f"0..{limits.max_shared_mem} bytes", found=repr(shared_mem),
        )
    if not isinstance(args, tuple | list):
        raise LaunchError(
            "arguments are not a tuple", file=file, key=f"{where}.args",
            expected="a tuple", found=type(args).__name__,
        )
    if len(args) != kernel.arity:
        raise LaunchError(
            "wrong number of arguments", file=file, key=f"{where}.args",
            expected=kernel.arity, found=len(args),
        )


def describe_error(err: MetraleError) -> tuple[str, str]:
    """``(class name, text)``: what two models must agree on for the same misuse.

    >>> describe_error(PointerError("use after free of buffer 'x'", key="free.ptr"))
    ('PointerError', "free.ptr: use after free of buffer 'x'")
    """
    return type(err).__name__, str(err)


__all__ = [
    "DeviceLimits",
    "DevicePtr",
    "GpuBackend",
    "GraphHandle",
    "HostKernel",
    "KernelHandle",
    "ModuleHandle",
    "PointerError",
    "Stream",
    "TensorMap",
    "check_launch",
    "describe_error",
    "device_fault",
    "no_such_kernel",
    "out_of_memory",
]
