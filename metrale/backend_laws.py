"""The GpuBackend equations as one Hypothesis state machine, to run against any model.

``backend_state_machine(make_backend)`` builds a ``RuleBasedStateMachine`` that drives a fresh
model alongside a ``MockBackend`` (the model taken as right) and a plain-Python shadow of the
bytes that were written. After every step it checks that both backends hold the same live
bytes and, on every byte that was written, the same contents as the shadow. Each rule states
one equation of ``metrale.runtime.backend``: round trips, memset, use after free, invalid
launches refused identically and not sticky, idempotent synchronize, zero-byte allocations,
grid-independent kernels, graph replay and dependent launches. Misuse must raise the same class
with the same text in both backends.

Usage in a test module (bounded settings keep CI fast)::

    from hypothesis import settings
    from metrale.backend_laws import backend_state_machine
    from metrale.runtime.host_backend import HostBackend

    TestHost = backend_state_machine(HostBackend).TestCase
    TestHost.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)

>>> from metrale.runtime.host_backend import HostBackend
>>> backend_state_machine(HostBackend).__name__
'HostBackendLaws'
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from metrale.lkb.errors import CompileError, LaunchError, MetraleError, UnavailableError
from metrale.runtime.backend import (
    DevicePtr,
    GpuBackend,
    HostKernel,
    KernelHandle,
    PointerError,
    describe_error,
)
from metrale.runtime.mock_backend import MockBackend

__all__ = [
    "HOST_LAW_KERNELS",
    "LAW_ARITIES",
    "LAW_CUDA_SOURCE",
    "backend_state_machine",
    "law_binary",
    "nvrtc_ptx",
]

LAW_CUDA_SOURCE = r"""
__device__ __forceinline__ long long law_tid() {
    long long block = blockIdx.x + (long long)gridDim.x * (blockIdx.y + (long long)gridDim.y * blockIdx.z);
    long long lane = threadIdx.x + (long long)blockDim.x * (threadIdx.y + (long long)blockDim.y * threadIdx.z);
    return block * ((long long)blockDim.x * blockDim.y * blockDim.z) + lane;
}
__device__ __forceinline__ long long law_threads() {
    return (long long)gridDim.x * gridDim.y * gridDim.z * blockDim.x * blockDim.y * blockDim.z;
}
__device__ __forceinline__ void law_wait() {  // a dependent launch waits here (equation 12)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
extern "C" __global__ void law_fill(unsigned char* p, int n, int v) {
    law_wait();
    for (long long i = law_tid(); i < n; i += law_threads()) p[i] = (unsigned char)v;
}
extern "C" __global__ void law_add(unsigned char* dst, const unsigned char* src, int n) {
    law_wait();
    for (long long i = law_tid(); i < n; i += law_threads()) dst[i] = (unsigned char)(dst[i] + src[i]);
}
extern "C" __global__ void law_noop() {}
"""  # noqa: E501
"""The law kernels in CUDA: grid-stride loops over the whole 3-D grid (equation 7) that wait for
the previous launch before they touch memory, so they may be launched dependent (equation 12)."""


def _fill(p: np.ndarray, n: int, v: int) -> None:
    p[:n] = v


def _add(dst: np.ndarray, src: np.ndarray, n: int) -> None:
    dst[:n] += src[:n]  # uint8 arithmetic wraps, as the CUDA kernel's does


HOST_LAW_KERNELS = {
    "law_fill": HostKernel(_fill, 3),
    "law_add": HostKernel(_add, 3),
    "law_noop": HostKernel(None, 0),
}
"""The law kernels as a host binary."""

LAW_ARITIES = {name: k.arity for name, k in HOST_LAW_KERNELS.items()}

_CUDA_BINARY: list[bytes] = []


def nvrtc_ptx(source: str, name: str = "laws.cu") -> bytes:
    """PTX for ``source``, compiled by NVRTC through CuPy for the current device's arch.

    PTX rather than cubin, so the CUDA model reads each kernel's parameter types from it.
    """
    import cupy  # only a CUDA model gets here
    from cupy_backends.cuda.libs import nvrtc

    arch = cupy.cuda.Device().compute_capability
    prog = nvrtc.createProgram(source, name, [], [])
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch=compute_{arch}", "-std=c++17"])
        except nvrtc.NVRTCError as e:
            raise CompileError("NVRTC rejected the source", file=name,
                               found=f"{e}: {nvrtc.getProgramLog(prog)}") from None
        ptx = nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)
    return ptx.encode() if isinstance(ptx, str) else bytes(ptx)


def law_binary(backend: GpuBackend) -> object:
    """The law kernels in the binary format ``backend`` loads (CUDA: PTX from NVRTC).

    >>> from metrale.runtime.host_backend import HostBackend
    >>> law_binary(HostBackend()) is HOST_LAW_KERNELS
    True
    """
    if backend.binary_format == "host":
        return HOST_LAW_KERNELS
    if backend.binary_format == "cuda":
        if not _CUDA_BINARY:
            _CUDA_BINARY.append(nvrtc_ptx(LAW_CUDA_SOURCE))
        return _CUDA_BINARY[0]
    raise UnavailableError(
        "no law kernels for this binary format", key="binary_format",
        expected="host or cuda", found=backend.binary_format,
    )


_LABELS = st.sampled_from(["", "a", "kv", "w"])
_STREAMS = st.sampled_from([0, 1, 2])
_INVALID = st.sampled_from(
    ["grid_zero", "grid_y", "grid_shape", "block_x", "block_z", "threads", "shared",
     "shared_negative", "arity"]
)


def backend_state_machine(
    make_backend: Callable[[], GpuBackend], *, max_bytes: int = 64, graphs: bool = True
) -> type[RuleBasedStateMachine]:
    """A state machine checking ``make_backend()`` against ``MockBackend`` and a shadow.

    ``max_bytes`` bounds each allocation; ``graphs=False`` leaves graph capture out even where
    the model supports it.
    """

    class Laws(RuleBasedStateMachine):
        buffers = Bundle("buffers")
        dead = Bundle("dead")

        def __init__(self) -> None:
            super().__init__()
            self.model: Any = make_backend()
            self.mock = MockBackend(self.model.limits)
            self.shadow: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            mod = self.both("module", law_binary(self.model), HOST_LAW_KERNELS, "laws")
            self.kernels: dict[str, KernelHandle] = {
                name: self.both("kernel", mod, name, arity) for name, arity in LAW_ARITIES.items()
            }
            self.streams = [None, self.both("stream"), self.both("stream")]

        def teardown(self) -> None:
            try:
                self.model.close()
            finally:
                self.mock.close()

        # -- the two backends in step ------------------------------------------------------

        def run_both(self, op: str, model_args: tuple, mock_args: tuple,
                     kw: dict[str, Any]) -> tuple[Any, MetraleError | None]:
            """Call ``op`` on both; they must agree on raising, and on the class and text."""
            got: list[Any] = []
            errs: list[MetraleError | None] = []
            for backend, args in ((self.model, model_args), (self.mock, mock_args)):
                try:
                    got.append(getattr(backend, op)(*args, **kw))
                    errs.append(None)
                except MetraleError as e:
                    got.append(None)
                    errs.append(e)
            seen = [None if e is None else describe_error(e) for e in errs]
            assert seen[0] == seen[1], f"{op}: model {seen[0]} but mock {seen[1]}"
            if op not in ("copy_d2h", "module"):
                assert repr(got[0]) == repr(got[1]), f"{op}: model {got[0]!r}, mock {got[1]!r}"
            return got[0], errs[0]

        def both(self, op: str, *args: Any, **kw: Any) -> Any:
            """Call ``op`` on both (the same arguments); it must succeed on both."""
            if op == "module":
                model_bin, mock_bin, label = args
                result, err = self.run_both(op, (model_bin, label), (mock_bin, label), kw)
            else:
                result, err = self.run_both(op, args, args, kw)
            assert err is None, f"{op} raised {err}"
            return result

        def refused(self, op: str, *args: Any, **kw: Any) -> MetraleError:
            """Call ``op`` on both; it must raise the same error on both."""
            _, err = self.run_both(op, args, args, kw)
            assert err is not None, f"{op}{args} was accepted"
            return err

        def read(self, ptr: DevicePtr, n: int | None = None, stream: Any = None) -> bytes:
            """Bytes every one of which was written: both backends must return them alike."""
            a = bytes(self.model.copy_d2h(ptr, n, stream=stream))
            b = bytes(self.mock.copy_d2h(ptr, n, stream=stream))
            assert a == b, f"copy_d2h differs: model {a!r}, mock {b!r}"
            return a

        def write_shadow(self, ptr: DevicePtr, data: np.ndarray) -> None:
            values, known = self.shadow[ptr.alloc_id]
            values[ptr.offset : ptr.offset + data.size] = data
            known[ptr.offset : ptr.offset + data.size] = True

        def ensure_known(self, ptr: DevicePtr, n: int, data: st.DataObject) -> np.ndarray:
            """The first ``n`` bytes at ``ptr``, written now with drawn bytes if any are unknown."""
            values, known = self.shadow[ptr.alloc_id]
            if not known[ptr.offset : ptr.offset + n].all():
                payload = data.draw(st.binary(min_size=n, max_size=n), label="payload")
                self.both("copy_h2d", ptr.take(n), payload)
                self.write_shadow(ptr, np.frombuffer(payload, np.uint8))
            return values[ptr.offset : ptr.offset + n].copy()

        # -- rules -------------------------------------------------------------------------

        @rule(target=buffers, nbytes=st.integers(0, max_bytes), label=_LABELS)
        def alloc(self, nbytes: int, label: str) -> DevicePtr:
            ptr = self.both("alloc", nbytes, label)
            assert ptr.nbytes == nbytes and ptr.offset == 0
            self.shadow[ptr.alloc_id] = (np.zeros(nbytes, np.uint8), np.zeros(nbytes, bool))
            if nbytes == 0:  # equation 3: a zero-byte allocation reads as nothing
                assert self.read(ptr) == b""
            return ptr

        @rule(target=dead, ptr=consumes(buffers))
        def free(self, ptr: DevicePtr) -> DevicePtr:
            self.both("free", ptr)
            del self.shadow[ptr.alloc_id]
            return ptr

        @rule(ptr=dead, op=st.sampled_from(["copy_d2h", "copy_h2d", "memset", "free", "launch"]))
        def use_after_free(self, ptr: DevicePtr, op: str) -> None:
            args: tuple[Any, ...] = {
                "copy_d2h": (ptr,),
                "copy_h2d": (ptr, b""),
                "memset": (ptr, 0),
                "free": (ptr,),
                "launch": (self.kernels["law_fill"], (1, 1, 1), (32, 1, 1), 0, (ptr, 0, 0)),
            }[op]
            err = self.refused(op, *args)
            assert isinstance(err, PointerError)
            assert "after free" in str(err) or "double free" in str(err), str(err)

        @rule(ptr=buffers, data=st.data(), s=_STREAMS)
        def round_trip(self, ptr: DevicePtr, data: st.DataObject, s: int) -> None:
            off = data.draw(st.integers(0, ptr.nbytes), label="offset")
            payload = data.draw(st.binary(max_size=ptr.nbytes - off), label="payload")
            stream = self.streams[s]
            self.both("copy_h2d", ptr + off, payload, stream=stream)
            assert self.read(ptr + off, len(payload), stream) == payload  # equation 1
            self.write_shadow(ptr + off, np.frombuffer(payload, np.uint8))

        @rule(ptr=buffers, data=st.data(), value=st.integers(0, 255), s=_STREAMS)
        def memset(self, ptr: DevicePtr, data: st.DataObject, value: int, s: int) -> None:
            off = data.draw(st.integers(0, ptr.nbytes), label="offset")
            n = data.draw(st.integers(0, ptr.nbytes - off), label="nbytes")
            stream = self.streams[s]
            self.both("memset", ptr + off, value, n, stream=stream)
            assert self.read(ptr + off, n, stream) == bytes([value]) * n  # equation 2
            self.write_shadow(ptr + off, np.full(n, value, np.uint8))

        @rule(
            ptr=buffers, data=st.data(), value=st.integers(0, 255), s=_STREAMS,
            grid=st.tuples(st.integers(1, 3), st.integers(1, 2), st.integers(1, 2)),
            block=st.tuples(st.integers(1, 64), st.integers(1, 2), st.integers(1, 2)),
            dependent=st.booleans(),
        )
        def launch_fill(self, ptr: DevicePtr, data: st.DataObject, value: int, s: int,
                        grid: tuple[int, int, int], block: tuple[int, int, int],
                        dependent: bool) -> None:
            off = data.draw(st.integers(0, ptr.nbytes), label="offset")
            n = data.draw(st.integers(0, ptr.nbytes - off), label="n")
            self.both("launch", self.kernels["law_fill"], grid, block, 0, (ptr + off, n, value),
                      stream=self.streams[s], dependent=dependent)  # equation 12 either way
            self.write_shadow(ptr + off, np.full(n, value, np.uint8))

        @rule(dst=buffers, src=buffers, data=st.data(), s=_STREAMS, dependent=st.booleans())
        def launch_add(self, dst: DevicePtr, src: DevicePtr, data: st.DataObject, s: int,
                       dependent: bool) -> None:
            n = data.draw(st.integers(0, min(dst.nbytes, src.nbytes)), label="n")
            a, b = self.ensure_known(dst, n, data), self.ensure_known(src, n, data)
            if dst.alloc_id == src.alloc_id:
                a = b  # one buffer: the second write (if any) is the one it holds
            self.both("launch", self.kernels["law_add"], (2, 1, 1), (32, 1, 1), 0, (dst, src, n),
                      stream=self.streams[s], dependent=dependent)
            self.write_shadow(dst.take(n), a + b)  # uint8: wraps like the kernel

        @rule(kind=_INVALID, s=_STREAMS)
        def invalid_launch(self, kind: str, s: int) -> None:
            lim = self.model.limits
            grid, block, shared, args = (1, 1, 1), (32, 1, 1), 0, ()
            if kind == "grid_zero":
                grid = (0, 1, 1)
            elif kind == "grid_y":
                grid = (1, lim.max_grid[1] + 1, 1)
            elif kind == "grid_shape":
                grid = (1, 1)  # type: ignore[assignment]
            elif kind == "block_x":
                block = (lim.max_block[0] + 1, 1, 1)
            elif kind == "block_z":
                block = (1, 1, lim.max_block[2] + 1)
            elif kind == "threads":
                block = (lim.max_block[0], 2, 1)
                assert block[0] * block[1] > lim.max_threads_per_block
            elif kind == "shared":
                shared = lim.max_shared_mem + 1
            elif kind == "shared_negative":
                shared = -1
            else:
                args = (1,)
            err = self.refused("launch", self.kernels["law_noop"], grid, block, shared, args,
                               stream=self.streams[s])
            assert isinstance(err, LaunchError) and not isinstance(err, PointerError)
            self.both("synchronize")  # equation 6: not sticky
            self.both("launch", self.kernels["law_noop"], (1, 1, 1), (1, 1, 1), 0, ())

        @rule(ptr=buffers, extra=st.integers(1, 8))
        def out_of_bounds(self, ptr: DevicePtr, extra: int) -> None:
            err = self.refused("copy_d2h", ptr, ptr.nbytes + extra)
            assert isinstance(err, PointerError)
            err = self.refused("copy_h2d", ptr, bytes(ptr.nbytes + extra))
            assert isinstance(err, PointerError)

        @rule(s=_STREAMS)
        def synchronize_twice(self, s: int) -> None:
            self.both("synchronize", self.streams[s])  # equation 5: idempotent; the invariant
            self.both("synchronize", self.streams[s])  # then sees the same bytes as before

        @precondition(lambda self: graphs and self.model.supports_graphs)
        @rule(dst=buffers, data=st.data(), replays=st.integers(1, 3), with_memset=st.booleans(),
              value=st.integers(0, 255), dependent=st.booleans())
        def graph_replay(self, dst: DevicePtr, data: st.DataObject, replays: int,
                         with_memset: bool, value: int, dependent: bool) -> None:
            n = data.draw(st.integers(0, dst.nbytes), label="n")
            src = self.both("alloc", n, "graph_src")
            self.shadow[src.alloc_id] = (np.zeros(n, np.uint8), np.zeros(n, bool))
            a, b = self.ensure_known(dst, n, data), self.ensure_known(src, n, data)
            s = self.streams[1]
            self.both("begin_capture", s)
            if with_memset:
                self.both("memset", dst, value, n, stream=s)
            self.both("launch", self.kernels["law_add"], (1, 1, 1), (64, 1, 1), 0, (dst, src, n),
                      stream=s, dependent=dependent)
            err = self.refused("synchronize")  # refused during capture, capture intact
            assert isinstance(err, LaunchError)
            graph = self.both("end_capture", s)
            assert graph.nodes == 1 + with_memset
            self.both("synchronize")
            assert self.read(dst.take(n)) == a.tobytes()  # equation 8: captured work did not run
            for _ in range(replays):
                self.both("graph_launch", graph, s)
            self.both("synchronize")
            held = self.model.graph_count()
            self.both("release_graph", graph)  # a released graph is refused; again, a no-op
            assert self.model.graph_count() == held - 1
            err = self.refused("graph_launch", graph, s)
            assert isinstance(err, LaunchError)
            self.both("release_graph", graph)
            expected = a
            for _ in range(replays):
                expected = (np.full(n, value, np.uint8) if with_memset else expected) + b
            self.write_shadow(dst.take(n), expected)
            self.both("free", src)
            del self.shadow[src.alloc_id]

        @precondition(lambda self: graphs and self.model.supports_graphs)
        @rule(nbytes=st.integers(1, max_bytes), label=_LABELS)
        def graph_after_free(self, nbytes: int, label: str) -> None:
            tmp = self.both("alloc", nbytes, label)
            s = self.streams[2]
            self.both("begin_capture", s)
            self.both("launch", self.kernels["law_fill"], (1, 1, 1), (32, 1, 1), 0,
                      (tmp, nbytes, 7), stream=s)
            graph = self.both("end_capture", s)
            self.both("free", tmp)
            err = self.refused("graph_launch", graph, s)
            assert isinstance(err, PointerError) and "after free" in str(err)

        # -- the invariant, after every step -------------------------------------------------

        @invariant()
        def same_memory(self) -> None:
            expected = sum(v.size for v, _ in self.shadow.values())
            assert self.model.live_bytes() == self.mock.live_bytes() == expected
            self.both("synchronize")
            for alloc_id, (values, known) in self.shadow.items():
                ptr = DevicePtr(alloc_id, values.size)  # unwritten bytes are unspecified
                for name, backend in (("model", self.model), ("mock", self.mock)):
                    got = backend.copy_d2h(ptr)[known]
                    assert (got == values[known]).all(), (
                        f"{name} buffer #{alloc_id}: {got.tobytes()!r} != "
                        f"{values[known].tobytes()!r}"
                    )

    Laws.__name__ = Laws.__qualname__ = f"{getattr(make_backend, '__name__', 'Backend')}Laws"
    return Laws
