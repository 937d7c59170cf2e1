"""The executor: a plan made runnable on one GpuBackend — buffers placed by liveness, launches.

A :class:`Program` takes a :class:`~metrale.plan.plan.Plan` and a backend, places every
activation in one arena by liveness (two buffers share bytes only when their kernel-index
lifetimes ``[first, last]`` do not overlap; views take their root's bytes), binds the external
buffers it is given (weights, KV caches, RoPE tables), allocates the step inputs, and gets one
kernel handle per launch from a backend *loader* (host: a ``HostKernel`` closure over the
reference semantics; a CUDA loader would load compiled modules). ``run()`` launches in plan
order, or replays a graph captured once when the backend supports capture.

Laws, checked below and in ``tests/host/test_executor.py``:

1. Placement is sound: buffers whose lifetimes overlap never share a byte.
2. ``peak_bytes <= naive_bytes`` (the arena is never larger than one allocation per buffer).
3. Blocking and graph-replay runs write the same bytes as a plain run.

>>> from metrale.plan.plan import plan_for
>>> from metrale.runtime.host_backend import HostBackend
>>> from metrale.runtime.engine import random_weights
>>> plan = plan_for("tiny-llama", "bf16", "host", rows=1, act="f32", context=16)
>>> be = HostBackend()
>>> bound = bind_externals(plan, be, random_weights(plan.target.model, seed=0))
>>> prog = Program(plan, be, bindings=bound)
>>> prog.peak_bytes < prog.naive_bytes
True
>>> prog.write("tokens", [3]); prog.write("positions", [0]); prog.write("slots", [0])
>>> prog.run()
>>> logits = prog.read("logits")
>>> logits.shape, bool(np.isfinite(logits).all())
((1, 256), True)
>>> prog.close(); be.live_bytes() > 0   # the bound weights and caches are the caller's
True
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from metrale.lkb.errors import CheckpointError, PlanError
from metrale.lkb.semantics import SEMANTICS
from metrale.plan.plan import Buffer, Plan, PlannedKernel
from metrale.runtime.backend import (
    DevicePtr,
    GpuBackend,
    GraphHandle,
    HostKernel,
    KernelHandle,
    Stream,
    TensorMap,
)
from metrale.runtime.fault import Teardown

__all__ = [
    "ALIGN",
    "POISON_BYTE",
    "ArgSpec",
    "HostLoader",
    "Launch",
    "Loader",
    "Placement",
    "Program",
    "bind_externals",
    "host_spec",
    "place",
]

ALIGN = 64
"""Byte alignment of every buffer in the arena (a cache line; what vector loads want)."""

POISON_BYTE = 0xFF
"""Debug poison of the arena: ``0xFF…`` is NaN in f32 and bf16 and -1 as an integer index."""


@attrs.frozen
class ArgSpec:
    """How a kernel sees one buffer: its NumPy dtype and shape on this backend.

    >>> ArgSpec("t0", np.dtype(np.float32), (2, 4)).nbytes
    32
    """

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def host_spec(b: Buffer) -> ArgSpec:
    """The host class's view of a plan buffer: float weights are f32 (dequantized or upcast
    once at load, see ``lkb/semantics.py``), everything else (an integer one such as a rank's
    ``tp.vocab_first`` too) keeps the plan's dtype.

    >>> from metrale.plan.plan import plan_for
    >>> p = plan_for("tiny-llama", "bf16", "host", context=16)
    >>> host_spec(next(b for b in p.buffers if b.kind == "weight")).dtype
    dtype('float32')
    """
    shape = tuple(int(d) for d in b.type.shape)
    dtype = np.dtype(b.type.dtype.numpy)
    if b.kind == "weight" and dtype.kind != "i":
        dtype = np.dtype(np.float32)
    return ArgSpec(b.name, dtype, shape)


# -- placement ---------------------------------------------------------------------------------


@attrs.frozen
class Placement:
    """Arena offsets of the activations: ``offsets[name]``, the arena's bytes, the naive sum.

    ``live_peak`` is the largest sum of bytes live at one kernel (a lower bound of any arena).
    """

    offsets: tuple[tuple[str, int], ...]
    arena_bytes: int
    naive_bytes: int
    live_peak: int

    def offset(self, name: str) -> int:
        return dict(self.offsets)[name]


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def place(items: Sequence[tuple[str, int, int, int]], align: int = ALIGN) -> Placement:
    """Place ``(name, nbytes, first, last)`` intervals in one arena: greedy by size, each at the
    lowest offset that no lifetime-overlapping buffer occupies (lifetimes are inclusive).

    >>> p = place([("a", 100, 0, 1), ("b", 100, 2, 3), ("c", 50, 1, 2)], align=1)
    >>> p.offset("a") == p.offset("b"), p.arena_bytes, p.naive_bytes, p.live_peak
    (True, 150, 250, 150)
    """
    order = sorted(items, key=lambda t: (-t[1], t[2], t[0]))
    placed: list[tuple[int, int, int, int]] = []  # offset, size, first, last
    offsets: dict[str, int] = {}
    for name, nbytes, first, last in order:
        size = _round_up(max(nbytes, 1), align)
        busy = sorted((o, s) for o, s, f, la in placed if f <= last and first <= la)
        at = 0
        for o, s in busy:
            if at + size <= o:
                break
            at = max(at, o + s)
        placed.append((at, size, first, last))
        offsets[name] = at
    arena = max((o + s for o, s, _, _ in placed), default=0)
    events = sorted([(f, n) for _, n, f, _ in items] + [(la + 1, -n) for _, n, _, la in items])
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return Placement(tuple(sorted(offsets.items())), arena, sum(n for _, n, _, _ in items), peak)


def _root(name: str, by_name: Mapping[str, Buffer]) -> str:
    while by_name[name].alias is not None:
        name = by_name[name].alias  # type: ignore[assignment]
    return name


# -- loaders ----------------------------------------------------------------------------------


def _workspace_end(name: Any) -> int:
    """The workspace bytes a launch argument needs (0 for one that is not in the workspace)."""
    if isinstance(name, tuple) and name[0] in ("scratch", "scratch_map"):
        return name[1].end
    return 0


def tensor_map(ptr: DevicePtr, spec: ArgSpec, box: tuple[int, int]) -> TensorMap:
    """The tensor map of a buffer of ``spec`` (its shape as rows x its last dim) at ``ptr``.

    >>> import ml_dtypes
    >>> tensor_map(DevicePtr(1, 96), ArgSpec("x", np.dtype(ml_dtypes.bfloat16), (3, 16)),
    ...            (16, 2))  # doctest: +NORMALIZE_WHITESPACE
    TensorMap(ptr=DevicePtr(alloc_id=1, nbytes=96, offset=0), rows=3, cols=16, dtype='bf16',
              box=(16, 2))
    """
    names = {"bfloat16": "bf16", "float32": "f32", "uint8": "u8"}
    if spec.dtype.name not in names or not spec.shape:
        raise PlanError("no tensor map of this buffer", key=spec.name,
                        expected="a bf16, f32 or u8 tensor", found=f"{spec.dtype.name}"
                        f"{list(spec.shape)}")
    cols = int(spec.shape[-1])
    rows = int(np.prod(spec.shape[:-1], dtype=np.int64))
    return TensorMap(ptr.take(spec.nbytes), rows, cols, names[spec.dtype.name], box)


@attrs.frozen
class Launch:
    """One launch of a program: the planned kernel, its handle, shape and arguments.

    ``arg_names`` holds buffer names (bound to pointers at run time), ``("part", name)`` for a
    binding beside the buffers (a weight's scales), ``("tmap", name, box)`` for a tensor map of
    a buffer (``runtime.backend.TensorMap``), ``("scratch", slice)`` for a slice of the program's
    workspace (``realize.kernel.WorkspaceSlice``; zeroed when allocated, shared by the launches
    in stream order: a kernel leaves the zero bytes it relies on zero), ``("scratch_map", slice,
    box)`` for the tensor map of a scratch tensor there, or plain numbers (dims, attributes).
    """

    kernel: PlannedKernel
    handle: KernelHandle
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int
    arg_names: tuple[Any, ...]
    dependent: bool = False
    """Launched as a dependent launch (backend equation 12): the kernel declares that it waits,
    and the class can start it before the previous launch ends."""
    transport: Callable[..., None] | None = None
    """A collective's transport (``handle`` is then ``None``): called as ``transport(backend,
    args, stream)`` in the launch's place, it enqueues the rank group's operation on the
    program's stream (see ``runtime.nccl``)."""


class Loader(Protocol):
    """Turns the planned kernels of one program into kernel handles on one backend."""

    def spec(self, buffer: Buffer) -> ArgSpec: ...

    def load(self, backend: GpuBackend, plan: Plan,
             specs: Mapping[str, ArgSpec]) -> tuple[Launch, ...]: ...


def _keywords(fn: Callable[..., Any], params: Mapping[str, Any]) -> dict[str, Any]:
    sig = inspect.signature(fn).parameters
    kw = {p.name for p in sig.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    return {k: v for k, v in params.items() if k in kw}


def _host_fn(entry: str, n_in: int, specs: tuple[ArgSpec, ...],
             kwargs: Mapping[str, Any]) -> Callable[..., None]:
    fn = SEMANTICS[entry]
    views = tuple((s.dtype, s.shape) for s in specs)

    def run(*raw: np.ndarray) -> None:
        arrays = [r.view(dt).reshape(shape) for r, (dt, shape) in zip(raw, views)]
        results = fn(*arrays[:n_in], **kwargs)
        for out, res in zip(arrays[n_in:], results):
            if res is out or (res.ctypes.data == out.ctypes.data and res.shape == out.shape):
                continue  # written in place (the KV caches)
            np.copyto(out, res, casting="no")

    return run


class HostLoader:
    """The host class's loader: each launch is a ``HostKernel`` running ``SEMANTICS[entry]`` on
    typed views of its buffers, with the box's parameters the function accepts as keywords.

    >>> HostLoader().spec(Buffer("x", __import__("metrale.lkb.ty", fromlist=["TensorType"])
    ...     .TensorType((2,), __import__("metrale.lkb.dtype", fromlist=["I32"]).I32), 8,
    ...     "input", -1, 0)).dtype
    dtype('int32')
    """

    def __init__(self, comm: Any = None) -> None:
        self.comm = comm
        """The rank group's communicator, for the collectives of a sharded plan (``None``: one
        rank; see ``runtime.parallel``)."""

    def spec(self, buffer: Buffer) -> ArgSpec:
        return host_spec(buffer)

    def load(self, backend: GpuBackend, plan: Plan,
             specs: Mapping[str, ArgSpec]) -> tuple[Launch, ...]:
        entries: dict[str, HostKernel] = {}
        pending = []
        ranks = dict(plan.sizes).get("ranks", 1)
        if ranks > 1 and (self.comm is None or self.comm.size != ranks):
            raise PlanError("a plan of several ranks needs its rank group's communicator",
                            key="loader.comm", expected=f"a group of {ranks} ranks",
                            found="none" if self.comm is None else f"{self.comm.size} ranks")
        for k in plan.launches:
            entry = k.kernel.entry
            if entry not in SEMANTICS:
                raise PlanError(f"the host has no semantics for entry {entry!r}",
                                key=f"kernels[{k.index}]", found=repr(entry))
            names = (*k.inputs, *k.outputs)
            kwargs = _keywords(SEMANTICS[entry], dict(k.box.params))
            if "comm" in inspect.signature(SEMANTICS[entry]).parameters:
                kwargs["comm"] = self.comm
            fn = _host_fn(entry, len(k.inputs), tuple(specs[n] for n in names), kwargs)
            label = kernel_label(k)
            entries[label] = HostKernel(fn, len(names))
            pending.append((k, label, names))
        module = backend.module(entries, f"{plan.target}:{plan.mode}:{plan.rows}")
        return tuple(Launch(k, backend.kernel(module, label), (1, 1, 1), (1, 1, 1), 0, names)
                     for k, label, names in pending)


def kernel_label(k: PlannedKernel) -> str:
    """How errors name a launch: ``#index family`` plus the layer, e.g. ``#7 attention@L0``."""
    layer = "" if k.layer is None else f"@L{k.layer}"
    return f"#{k.index} {k.family}{layer}"


# -- externals ---------------------------------------------------------------------------------


def bind_externals(plan: Plan, backend: GpuBackend, weights: Mapping[str, np.ndarray], *,
                   loader: Loader | None = None, rope: tuple[np.ndarray, np.ndarray] | None = None,
                   teardown: Teardown | None = None) -> dict[str, DevicePtr]:
    """Allocate and fill the weights, zeroed caches and RoPE tables ``plan`` reads.

    A convenience for one-plan use (the Engine shares them across plans itself). ``rope``
    defaults to the model's tables for ``plan``'s context. Allocations are registered with
    ``teardown`` when given.
    """
    from metrale.plan.config import ModelConfig
    from metrale.plan.rope import rope_table

    loader = loader or HostLoader()
    out: dict[str, DevicePtr] = {}
    if rope is None:
        rope = rope_table(ModelConfig.load(plan.target.model), plan.context)
    tables = {"rope.cos": rope[0], "rope.sin": rope[1]}
    for b in plan.buffers:
        if b.alias is not None or b.kind not in ("weight", "cache") and b.name not in tables:
            continue
        spec = loader.spec(b)
        ptr = backend.alloc(spec.nbytes, b.name)
        if teardown is not None:
            teardown.callback(backend.free, ptr)
        if b.kind == "cache":
            backend.memset(ptr, 0)
        else:
            data = tables[b.name] if b.name in tables else weights.get(b.name)
            if data is None:
                raise CheckpointError("the plan reads a weight the checkpoint lacks", key=b.name)
            backend.copy_h2d(ptr, np.ascontiguousarray(data, spec.dtype).reshape(-1).view(np.uint8))
        out[b.name] = ptr
    return out


# -- the program -------------------------------------------------------------------------------


class Program:
    """A plan bound to a backend: arena, inputs, external bindings, one handle per launch.

    ``bindings`` maps buffer names to pointers the caller owns (weights, caches, RoPE tables);
    the program owns the step inputs it allocates and the activation arena, and frees them, in
    reverse order, on :meth:`close`. An allocation failure frees what was taken and re-raises.
    ``debug`` poisons the arena with NaN before every step, so a read of unwritten bytes shows.
    """

    def __init__(self, plan: Plan, backend: GpuBackend, *, bindings: Mapping[str, DevicePtr],
                 loader: Loader | None = None, debug: bool = False) -> None:
        self.plan = plan
        self.backend = backend
        self.loader = loader or HostLoader()
        self.debug = debug
        self._teardown = Teardown()
        self._graph: GraphHandle | None = None
        self._stream: Stream | None = None
        by_name = {b.name: b for b in plan.buffers}
        self.specs = {b.name: self.loader.spec(b) for b in plan.buffers}
        acts = [b for b in plan.buffers if b.kind == "activation" and b.alias is None]
        self.placement = place([(b.name, self.specs[b.name].nbytes, b.first, b.last)
                                for b in acts])
        self.ptrs: dict[str, DevicePtr] = {}
        names = {b.name for b in plan.buffers}
        self.extra = {n: p for n, p in bindings.items() if n not in names}
        """Bindings beside the plan's buffers (weights' scales), passed to kernels as they are."""
        try:
            self._arena = None
            self._workspace: DevicePtr | None = None
            if self.placement.arena_bytes:
                self._arena = self._alloc(self.placement.arena_bytes, "activations")
            offsets = dict(self.placement.offsets)
            for b in plan.buffers:
                if b.alias is not None:
                    continue
                if b.name in bindings:
                    self.ptrs[b.name] = bindings[b.name]
                elif b.kind == "activation":
                    assert self._arena is not None
                    self.ptrs[b.name] = (self._arena + offsets[b.name]).take(
                        self.specs[b.name].nbytes)
                elif b.kind == "input":
                    self.ptrs[b.name] = self._alloc(self.specs[b.name].nbytes, b.name)
                else:
                    raise PlanError(f"no memory bound for {b.kind} buffer", key=b.name,
                                    expected="a binding from the caller", found="none")
            for b in plan.buffers:
                if b.alias is not None:
                    self.ptrs[b.name] = self.ptrs[_root(b.name, by_name)].take(
                        self.specs[b.name].nbytes)
            for name, ptr in self.ptrs.items():
                if ptr.nbytes < self.specs[name].nbytes:
                    raise PlanError("bound buffer too small", key=name,
                                    expected=f"{self.specs[name].nbytes} bytes",
                                    found=f"{ptr.nbytes} bytes")
            self.launches = self.loader.load(backend, plan, self.specs)
            work = max((_workspace_end(n) for ln in self.launches for n in ln.arg_names),
                       default=0)
            if work:
                self._workspace = self._alloc(work, "workspace")
                backend.memset(self._workspace, 0)
        except BaseException:
            self._release_quietly()
            raise
        self._args = [self._resolve(ln) for ln in self.launches]

    def _alloc(self, nbytes: int, label: str) -> DevicePtr:
        ptr = self.backend.alloc(nbytes, label)
        self._teardown.callback(self.backend.free, ptr)
        return ptr

    def _release_quietly(self) -> None:
        try:
            self._teardown.close()
        except Exception:  # the allocation error is the one to surface, not a free's
            pass

    def _resolve(self, ln: Launch) -> tuple[Any, ...]:
        """Launch arguments: buffer names become pointers; a ``("part", name)`` is a weight's
        scale or global scale (null, ``0``, where it has none); a ``("scratch", slice)`` that slice
        of the workspace, a ``("scratch_map", slice, box)`` its tensor map; numbers pass as they
        are."""
        out: list[Any] = []
        for n in ln.arg_names:
            if isinstance(n, str):
                out.append(self.ptrs[n].take(self.specs[n].nbytes))
            elif isinstance(n, tuple) and n[0] == "scratch":
                assert self._workspace is not None
                out.append((self._workspace + n[1].offset).take(n[1].nbytes))
            elif isinstance(n, tuple) and n[0] == "scratch_map":
                assert self._workspace is not None
                s = n[1]
                out.append(TensorMap((self._workspace + s.offset).take(s.nbytes), s.rows, s.cols,
                                     s.dtype, n[2]))
            elif isinstance(n, tuple) and n[0] == "tmap":
                out.append(tensor_map(self.ptrs[n[1]], self.specs[n[1]], n[2]))
            elif isinstance(n, tuple):
                out.append(self.extra.get(n[1], 0))
            else:
                out.append(n)
        return tuple(out)

    @property
    def arguments(self) -> tuple[tuple[Any, ...], ...]:
        """The resolved arguments of every launch, in launch order."""
        return tuple(self._args)

    @property
    def step_memory(self) -> tuple[tuple[str, DevicePtr], ...]:
        """The memory this program owns and its launches write: the activation arena and the
        workspace, labelled (the caches they write are the caller's bindings)."""
        own = (("activations", self._arena), ("workspace", self._workspace))
        return tuple((label, ptr) for label, ptr in own if ptr is not None)

    # -- memory figures ---------------------------------------------------------------------

    @property
    def peak_bytes(self) -> int:
        """Bytes of the activation arena (what liveness-based reuse costs)."""
        return self.placement.arena_bytes

    @property
    def workspace_bytes(self) -> int:
        """Bytes of the program's workspace (its kernels' scratch, a quantized prefill's weights
        made bf16 among them); 0 where no kernel takes one."""
        return 0 if self._workspace is None else self._workspace.nbytes

    @property
    def naive_bytes(self) -> int:
        """Bytes one allocation per activation would cost."""
        return self.placement.naive_bytes

    @property
    def live_peak(self) -> int:
        """The largest sum of activation bytes live at one kernel (no arena can be smaller)."""
        return self.placement.live_peak

    # -- I/O ----------------------------------------------------------------------------------

    def bind(self, name: str, ptr: DevicePtr) -> None:
        """Point buffer ``name`` at other memory; a captured graph is released."""
        if name not in self.ptrs:
            raise PlanError("no such buffer in the plan", key=name)
        if ptr.nbytes < self.specs[name].nbytes:
            raise PlanError("bound buffer too small", key=name,
                            expected=f"{self.specs[name].nbytes} bytes", found=f"{ptr.nbytes}")
        if self.ptrs[name] == ptr:
            return
        self.ptrs[name] = ptr
        self._args = [self._resolve(ln) for ln in self.launches]
        self._release_graph()

    def _release_graph(self) -> None:
        graph, self._graph = self._graph, None
        if graph is not None:
            self.backend.release_graph(graph)

    def write(self, name: str, values: Any) -> None:
        """Copy ``values`` (cast to the buffer's dtype and shape) into buffer ``name``."""
        spec = self.specs[name]
        arr = np.ascontiguousarray(np.asarray(values).astype(spec.dtype).reshape(spec.shape))
        self.backend.copy_h2d(self.ptrs[name], arr.reshape(-1).view(np.uint8), self._stream)

    def read(self, name: str) -> np.ndarray:
        """Buffer ``name`` copied to the host, typed and shaped."""
        spec = self.specs[name]
        raw = self.backend.copy_d2h(self.ptrs[name], spec.nbytes, self._stream)
        return raw.view(spec.dtype).reshape(spec.shape)

    # -- running ------------------------------------------------------------------------------

    def _issue(self, blocking: bool) -> None:
        be, stream = self.backend, self._stream
        if self.debug and self._arena is not None:
            be.memset(self._arena, POISON_BYTE, None, stream)
        for ln, args in zip(self.launches, self._args):
            if ln.transport is not None:
                ln.transport(be, args, stream)
            else:
                be.launch(ln.handle, ln.grid, ln.block, ln.shared_mem, args, stream,
                          dependent=ln.dependent)
            if blocking:
                be.synchronize(stream)

    @property
    def captured(self) -> bool:
        """Whether a captured graph is held (``run`` replays it)."""
        return self._graph is not None

    def capture(self) -> bool:
        """Capture the step once as a graph, when the backend can; whether it did."""
        if not self.backend.supports_graphs:
            return False
        if self._stream is None:
            self._stream = self.backend.stream()
        self.backend.begin_capture(self._stream)
        try:
            self._issue(False)
        finally:
            graph = self.backend.end_capture(self._stream)
        self._release_graph()
        self._graph = graph
        return True

    def run(self, *, blocking: bool = False, replay: bool = True) -> None:
        """Launch every kernel in plan order (or replay the captured graph), then synchronize.

        ``blocking`` synchronizes after each launch, so a fault names the kernel that caused
        it; it never replays a graph, nor does a run told not to ``replay`` (a benchmark's
        launches from the host).
        """
        if self._graph is not None and replay and not blocking:
            self.backend.graph_launch(self._graph, self._stream)
        else:
            self._issue(blocking)
        self.backend.synchronize(self._stream)

    def close(self) -> None:
        """Free what the program allocated and its graph, newest first (a no-op the second
        time)."""
        try:
            self._release_graph()
        finally:
            self._teardown.close()

    def __enter__(self) -> Program:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.close()
        except Exception:
            if exc[0] is None:
                raise
