"""MockBackend: the GpuBackend model that records every call and injects faults on demand.

Memory is one ``bytearray`` per allocation, filled with :data:`POISON` when allocated (so a
read of bytes nobody wrote shows up); kernels follow the host-binary convention of
``HostBackend`` (``{name: HostKernel(fn, arity)}`` or ``{name: (arity, fn)}``; ``fn=None``
only records). Faults: ``oom_at=k`` makes the k-th ``alloc`` raise ``AllocationError``;
``fault_at_launch=k`` and ``fault_at_sync=k`` latch a sticky ``DeviceFault`` at the k-th launch
that reaches the device or the k-th synchronize, naming the kernel that was running. Counters:
``allocs``, ``launches`` (``dependent_launches`` of them dependent, equation 12), ``syncs``.

>>> be = MockBackend(fault_at_sync=1)
>>> k = be.kernel(be.module({"rmsnorm": (0, None)}), "rmsnorm")
>>> be.launch(k, (1, 1, 1), (32, 1, 1), 0, ())
>>> be.synchronize()
Traceback (most recent call last):
...
metrale.lkb.errors.DeviceFault: synchronize: device fault in kernel 'rmsnorm' (expected no fault, found injected fault (fault_at_sync=1))
>>> be.alloc(8)
Traceback (most recent call last):
...
metrale.lkb.errors.DeviceFault: synchronize: device fault in kernel 'rmsnorm' (expected no fault, found injected fault (fault_at_sync=1))
>>> [c.op for c in be.calls]
['module', 'kernel', 'launch', 'synchronize', 'alloc']
"""  # noqa: E501

from __future__ import annotations

from typing import Any

import attrs
import numpy as np

from metrale.runtime.backend import DeviceLimits, KernelHandle, out_of_memory
from metrale.runtime.host_backend import HostBackend

__all__ = ["POISON", "Call", "MockBackend"]

POISON = 0xA5
"""The byte a fresh mock allocation holds everywhere."""


@attrs.frozen
class Call:
    """One recorded call: the operation's name and its arguments.

    >>> Call("alloc", (16, "x"))
    Call(op='alloc', args=(16, 'x'))
    """

    op: str
    args: tuple[Any, ...] = ()


class MockBackend(HostBackend):
    """A backend that records each call in ``calls`` and fails where it is told to.

    ``capacity`` (bytes), when given, makes allocations past it raise ``AllocationError``;
    ``graphs=False`` makes a model without graph capture.

    >>> be = MockBackend(oom_at=2)
    >>> a = be.alloc(64, "a")
    >>> be.alloc(128, "b")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.AllocationError: b: out of device memory (expected 128 bytes free, found injected fault (oom_at=2))
    >>> bytes(be.copy_d2h(be.alloc(2, "c")))
    b'\\xa5\\xa5'
    """  # noqa: E501

    name = "mock"

    def __init__(
        self,
        limits: DeviceLimits | None = None,
        *,
        oom_at: int | None = None,
        fault_at_launch: int | None = None,
        fault_at_sync: int | None = None,
        capacity: int | None = None,
        graphs: bool = True,
    ) -> None:
        self.calls: list[Call] = []
        super().__init__(limits or DeviceLimits(name="mock"))
        self.oom_at = oom_at
        self.fault_at_launch = fault_at_launch
        self.fault_at_sync = fault_at_sync
        self.capacity = capacity
        self.supports_graphs = graphs  # type: ignore[misc]
        self.allocs = self.launches = self.syncs = self.dependent_launches = 0

    def ops(self) -> tuple[str, ...]:
        """The names of the recorded calls, in order."""
        return tuple(c.op for c in self.calls)

    def _record(self, op: str, args: tuple[Any, ...]) -> None:
        self.calls.append(Call(op, args))

    def _alloc(self, nbytes: int, label: str) -> Any:
        self.allocs += 1
        if self.allocs == self.oom_at:
            raise out_of_memory(label, nbytes, f"injected fault (oom_at={self.oom_at})")
        if self.capacity is not None and self._mem.live_bytes + nbytes > self.capacity:
            raise out_of_memory(label, nbytes, f"{self.capacity - self._mem.live_bytes} bytes free")
        return bytearray([POISON]) * nbytes

    def _bytes(self, storage: Any) -> np.ndarray:
        return np.frombuffer(storage, np.uint8)

    def _launch(self, kernel: KernelHandle, native: Any, grid: tuple[int, int, int],
                block: tuple[int, int, int], shared_mem: int, args: tuple[Any, ...],
                stream: Any, dependent: bool = False) -> None:
        self.launches += 1
        self.dependent_launches += dependent
        if self.launches == self.fault_at_launch:
            cause = f"injected fault (fault_at_launch={self.fault_at_launch})"
            raise self._fault("launch", cause, kernel.name)
        super()._launch(kernel, native, grid, block, shared_mem, args, stream)

    def _sync(self, stream: Any) -> None:
        self.syncs += 1
        if self.syncs == self.fault_at_sync:
            raise self._fault("synchronize", f"injected fault (fault_at_sync={self.fault_at_sync})")
