"""Loading CUDA kernels for a backend: compile through the build cache, load, bind arguments.

A :class:`CudaLoader` turns a realized ``Kernel`` (``realize.kernel``) into a launchable
:class:`BoundKernel`: the source (with its headers) is compiled for the class's arch through
``realize.cache.BuildCache`` (an ``Engine`` compiles its plans' kernels ahead of its first
step, in parallel, through :meth:`CudaPlanLoader.prepare`: then this is a cache hit), loaded
with ``GpuBackend.module`` and looked up by entry. Arguments follow the kernel's ``args`` list
(``name:type``): ports by buffer pointer (a weight ``w`` brings ``w_scale`` and
``w_global``, null where its format has none), dims, attributes and ``values`` formulas by
number, a ``scratch`` argument by the pointer of its slice of one zeroed workspace (a
``values`` formula's bytes, or a table's ``scratch`` tensor; :meth:`BoundKernel.workspace`),
and a ``tmap(C,R)`` argument by the tensor map of its port, or of its scratch tensor there.

>>> spec = parse_args(("x:ptr", "w:ptr", "w_scale:ptr", "rows:i32", "eps:f32"))
>>> [(a.name, a.kind) for a in spec]
[('x', 'ptr'), ('w', 'ptr'), ('w_scale', 'ptr'), ('rows', 'i32'), ('eps', 'f32')]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import LaunchError
from metrale.realize.kernel import DEVICE_SIZE, WorkspaceSlice, box_numbers, tensor_map_box
from metrale.runtime.backend import TensorMap

SCALAR_TYPES = {"i32": np.int32, "i64": np.int64, "f32": np.float32}
"""The NumPy type a scalar kernel argument of each kind is passed as."""


def device_sizes(backend: Any) -> dict[str, int]:
    """The sizes the running device binds in launch formulas (``DEVICE_SIZE``: its
    multiprocessors)."""
    return {DEVICE_SIZE: backend.limits.multiprocessors}


@attrs.frozen
class Arg:
    """One kernel argument: its name and kind (``ptr``, ``i32``, ``i64``, ``f32``, ``scratch``,
    ``tmap``: a tensor map over the port, copied in boxes of ``box``)."""

    name: str
    kind: str
    box: tuple[int, int] | None = None


def parse_args(args: tuple[str, ...]) -> tuple[Arg, ...]:
    """The ``name:type`` list of a kernel table as values.

    >>> parse_args(("x:tmap(64,128)", "rows:i32"))
    (Arg(name='x', kind='tmap', box=(64, 128)), Arg(name='rows', kind='i32', box=None))
    """
    out = []
    for a in args:
        name, _, kind = a.partition(":")
        box = tensor_map_box(kind)
        out.append(Arg(name, "tmap", box) if box is not None else Arg(name, kind))
    return tuple(out)


@attrs.frozen
class BoundKernel:
    """A loaded kernel and how to call it; ``then`` holds the handles and arguments of its
    ``then`` launches, in order."""

    kernel: Any  # realize.kernel.Kernel
    handle: Any  # backend KernelHandle
    args: tuple[Arg, ...]
    then: tuple[tuple[Any, tuple[Arg, ...]], ...] = ()

    def call(self, entry: str) -> tuple[Any, tuple[Arg, ...]]:
        """``(handle, args)`` of the launch of ``entry``: the kernel's own or a ``then`` one."""
        for name, call in zip(self.kernel.entries, ((self.handle, self.args), *self.then),
                              strict=True):
            if name == entry:
                return call
        raise LaunchError(f"kernel {self.kernel.entry} makes no launch of {entry}",
                          key=str(self.kernel.point), expected="one of "
                          + ", ".join(self.kernel.entries), found=entry)

    def workspace(self, numbers: Mapping[str, int | float]) -> dict[str, WorkspaceSlice]:
        """Where each scratch argument of its launches, its own and its ``then`` ones', lies in
        one workspace at these sizes (``Kernel.workspace``; empty when none has one)."""
        return self.kernel.workspace(numbers)

    def pack(self, pointers: Mapping[str, Any], numbers: Mapping[str, int | float],
             args: tuple[Arg, ...] | None = None) -> tuple:
        """The argument tuple of ``args`` (default: the kernel's own): pointers by name
        (``None`` → null; a scratch argument's slice of the workspace too, which the caller
        allocates zeroed and slices as :meth:`workspace` says; a ``tmap`` argument's
        ``TensorMap``, whose pointer a ``ptr`` argument of the same name takes), numbers by
        name."""
        env = self.kernel.sizes(numbers)
        out: list[Any] = []
        for a in self.args if args is None else args:
            if a.kind == "tmap":
                if not isinstance(pointers.get(a.name), TensorMap):
                    raise LaunchError(f"no tensor map for argument {a.name} of "
                                      f"{self.kernel.entry}", key=str(self.kernel.point),
                                      expected=f"a TensorMap of box {a.box}",
                                      found=repr(pointers.get(a.name)))
                out.append(pointers[a.name])
            elif a.kind == "scratch":
                if pointers.get(a.name) is None:
                    nbytes = self.kernel.workspace(numbers)[a.name].nbytes
                    raise LaunchError(f"no workspace for scratch argument {a.name} of "
                                      f"{self.kernel.entry}", key=str(self.kernel.point),
                                      expected=f"a zeroed buffer of {nbytes} bytes",
                                      found="none")
                ptr = pointers[a.name]  # a scratch tensor given as its map: the map's bytes
                out.append(ptr.ptr if isinstance(ptr, TensorMap) else ptr)
            elif a.kind == "ptr":
                if a.name not in pointers and not a.name.endswith(("_scale", "_global")):
                    raise LaunchError(f"no buffer for argument {a.name} of {self.kernel.entry}",
                                      key=str(self.kernel.point), expected="a buffer",
                                      found="none")
                ptr = pointers.get(a.name)
                # a buffer given as its tensor map (another launch of the chain maps it)
                out.append(0 if ptr is None else ptr.ptr if isinstance(ptr, TensorMap) else ptr)
            else:
                if a.name not in env:
                    raise LaunchError(f"no value for argument {a.name} of {self.kernel.entry}",
                                      key=str(self.kernel.point),
                                      expected="a dim, attribute or value formula",
                                      found="none")
                out.append(SCALAR_TYPES[a.kind](env[a.name]))
        return tuple(out)

    def launch(self, backend: Any, pointers: Mapping[str, Any],
               numbers: Mapping[str, int | float], stream: Any = None) -> None:
        """Launch with the kernel's own launch rule at ``numbers``, then its ``then``
        launches (those it makes there)."""
        numbers = {**numbers, **device_sizes(backend)}
        for entry, _, (grid, block, shared) in self.kernel.launches_for(numbers):
            handle, args = self.call(entry)
            backend.launch(handle, grid, block, shared, self.pack(pointers, numbers, args),
                           stream)


class CudaLoader:
    """Compiles (cached), loads and binds the CUDA kernels of one class on one backend."""

    def __init__(self, backend: Any, arch: str, *, kernels_dir: Path | str | None = None,
                 cache: Any = None, output: str = "cubin") -> None:
        from metrale.realize.cache import BuildCache
        from metrale.realize.compute import NvidiaTarget
        from metrale.realize.hardware import default_kernels_dir

        self.backend = backend
        self.arch = arch
        self.root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
        self.cache = cache if cache is not None else BuildCache()
        self.target = NvidiaTarget(output)
        self._modules: dict[tuple, Any] = {}
        self._bound: dict[str, BoundKernel] = {}

    def bind(self, kernel: Any) -> BoundKernel:
        """The loaded, bindable kernel for ``kernel`` (each distinct compile done once)."""
        found = self._bound.get(kernel.key)
        if found is not None:
            return found
        if kernel.source is None:
            raise LaunchError("a host kernel has no CUDA source", key=str(kernel.point))
        from metrale.realize.build import unit_key

        mod_key = unit_key(kernel)
        module = self._modules.get(mod_key)
        if module is None:
            from metrale.lkb.errors import CompileError
            from metrale.realize.build import unit_source

            # the build's own unit (its source cut to the kernel's entries), so `met build` and
            # `prepare` warm it
            source, headers = unit_source(self.root, kernel)
            binary = self.cache.build(self.target, source, self.arch, kernel.define_map(),
                                      name=Path(kernel.source).stem, headers=headers)
            missing = [e for e in kernel.entries if e not in binary.entries]
            if missing:
                raise CompileError(f"entry {missing[0]!r} is not exported", file=kernel.source,
                                   key=str(kernel.point), expected="one of "
                                   + ", ".join(binary.entries), found=missing[0])
            module = self.backend.module(binary.data, label=kernel.source)
            self._modules[mod_key] = module
        # the arity from KERNELS.toml: machine code does not declare it, PTX must agree with it
        (handle, args), *then = ((self.backend.kernel(module, entry, arity=len(parsed)), parsed)
                                 for entry, parsed in ((e, parse_args(a))
                                                       for e, a in kernel.calls))
        bound = BoundKernel(kernel, handle, args, tuple(then))
        self._bound[kernel.key] = bound
        return bound


class CudaPlanLoader:
    """The executor's loader for an NVIDIA class: buffers as the kernels store them, weights in
    their storage format (a quantized weight ``W`` also binds ``W_scale`` and ``W_global``),
    and one compiled, loaded, argument-bound launch per planned kernel (and one per ``then``
    launch of its kernel, right after it).

    >>> from metrale.lkb.quant import QuantFormat
    >>> parts = CudaPlanLoader.__new__(CudaPlanLoader).prepare_parts(
    ...     "w", np.ones((4, 64), np.float32), "mxfp4")
    >>> sorted(parts), parts["w"].dtype
    (['w', 'w_scale'], dtype('uint8'))
    """

    def __init__(self, arch: str, *, kernels_dir: Path | str | None = None, cache: Any = None,
                 dependent_launch: bool = False, output: str = "cubin", comm: Any = None):
        self.arch = arch
        self.comm = comm
        """The rank group of a sharded plan's collectives (``runtime.nccl.NcclTransport`` on
        GPUs; on a host backend, ``runtime.parallel.HostComm``); ``None``: one rank."""
        self.dependent_launch = dependent_launch  # the class's capability
        self.kernels_dir = kernels_dir
        self.cache = cache
        self.output = output
        self._loaders: dict[int, CudaLoader] = {}
        self._prepared: set[Any] = set()  # units prepare compiled or found in the cache

    def prepare(self, plans: Any, *, progress: bool = True,
                meanwhile: Callable[[], None] | None = None) -> None:
        """Compile every kernel ``plans`` launch, in parallel and through the build cache,
        before any step runs (a progress bar on a terminal), so no step compiles on first use;
        a kernel that does not compile raises its ``CompileError`` here. ``plans`` may be made
        as they are asked for: each plan's compiles start before the next plan is (the
        compilers are separate processes, so the planning overlaps them), and ``meanwhile``
        runs once they are all on their way, before they are waited for (an engine copies its
        weights to the device then). Units an earlier call prepared are not looked for again."""
        from metrale.lkb.errors import CompileError
        from metrale.realize.build import compile_batches, unit_key
        from metrale.realize.cache import BuildCache
        from metrale.realize.compute import NvidiaTarget
        from metrale.realize.hardware import default_kernels_dir

        batches = ([k.kernel for k in plan.launches if k.kernel.source is not None
                    and unit_key(k.kernel) not in self._prepared] for plan in plans)
        done = compile_batches(
            batches, self.arch, cache=self.cache if self.cache is not None else BuildCache(),
            kernels_dir=self.kernels_dir if self.kernels_dir is not None
            else default_kernels_dir(), compute=NvidiaTarget(self.output), progress=progress,
            what=f"{self.arch} kernels", meanwhile=meanwhile)
        for got, _, _ in done.values():
            if isinstance(got, CompileError):
                raise got
        self._prepared.update(done)

    def spec(self, buffer: Any) -> Any:
        from metrale.runtime.executor import ArgSpec

        shape = tuple(int(d) for d in buffer.type.shape)
        if buffer.kind == "weight" and buffer.type.fmt:
            from metrale.lkb.quant import QuantFormat

            fmt = QuantFormat.parse(buffer.type.fmt)
            dshape, ddtype = fmt.array_specs(shape)["data"]
            return ArgSpec(buffer.name, np.dtype(ddtype.numpy), tuple(dshape))
        return ArgSpec(buffer.name, np.dtype(buffer.type.dtype.numpy), shape)

    def prepare_parts(self, name: str, values: np.ndarray, fmt: str) -> dict[str, np.ndarray]:
        """The arrays a weight is stored as on the device: ``{name, name_scale, name_global}``.

        Values given as floats (a checkpoint's, dequantized) are quantized again into the
        device layout, which must reproduce them exactly: a checkpoint whose values that layout
        cannot hold (for instance MoE experts stored with a global scale each, where the device
        keeps one per stacked tensor) is a ``CheckpointError`` naming the weight, never weights
        silently changed on the device."""
        if not fmt:
            return {name: values}
        from metrale.lkb.errors import CheckpointError
        from metrale.lkb.quant import QuantFormat, QuantTensor

        if isinstance(values, QuantTensor):  # already stored in its format: used as it is
            qt = values
        else:
            w = np.asarray(values, np.float32)
            qt = QuantFormat.parse(fmt).quantize(w, name=name)
            changed = int(np.count_nonzero(qt.dequantize() != w))
            if changed:
                raise CheckpointError(
                    f"the device stores this weight as one {qt.fmt.name} tensor, which cannot "
                    f"hold its values exactly: {changed} of {w.size} would change",
                    key=name, expected=f"values one {qt.fmt.name} tensor holds exactly",
                    found="values it does not (re-quantize the checkpoint with met quantize)")
        out = {name: np.ascontiguousarray(qt.data)}
        if qt.scale is not None:
            out[f"{name}_scale"] = np.ascontiguousarray(qt.scale)
        if qt.global_scale is not None:
            out[f"{name}_global"] = np.asarray(qt.global_scale, np.float32).reshape(1)
        return out

    def _loader(self, backend: Any) -> CudaLoader:
        found = self._loaders.get(id(backend))
        if found is None:
            found = CudaLoader(backend, self.arch, kernels_dir=self.kernels_dir, cache=self.cache,
                               output=self.output)
            self._loaders[id(backend)] = found
        return found

    def load(self, backend: Any, plan: Any, specs: Mapping[str, Any]) -> tuple:
        from metrale.runtime.executor import Launch

        P = plan.hw_target.presentation  # the plan's own: an extended one is read as made
        sizes = dict(plan.sizes)
        ranks = sizes.get("ranks", 1)
        if ranks > 1 and (self.comm is None or self.comm.size != ranks):
            from metrale.lkb.errors import PlanError

            raise PlanError("a plan of several ranks needs its rank group's transport",
                            key="loader.comm", expected=f"a group of {ranks} ranks",
                            found="none" if self.comm is None else f"{self.comm.size} ranks")
        out = []
        for k in plan.launches:
            fam = P.family(k.family)
            numbers = {**box_numbers(k.box, fam, sizes), **device_sizes(backend)}
            env = k.kernel.sizes(numbers)
            work = k.kernel.workspace(numbers)
            port_buffer = dict(zip((p.name for p in (*fam.inputs, *fam.outputs)),
                                   (*k.inputs, *k.outputs)))
            if k.kernel.transport:  # the rank group's part first, into the kernel's scratch
                out.append(self._transport(backend, k, port_buffer, specs, env))
            for entry, _, (grid, block, shared) in k.kernel.launches_for(numbers):
                handle, args = self.bind(backend, k, grid, block, shared, entry)
                names: list[Any] = []
                for a in args:
                    if a.kind == "ptr":
                        if a.name in port_buffer:
                            names.append(port_buffer[a.name])
                        else:  # a weight's scale or global scale: bound beside it, or null
                            base, _, part = a.name.rpartition("_")
                            names.append(("part", f"{port_buffer[base]}_{part}"))
                    elif a.kind == "scratch":  # the program's workspace, zeroed, stream order
                        names.append(("scratch", work[a.name]))
                    elif a.kind == "tmap" and a.name in work:  # a scratch tensor's map
                        names.append(("scratch_map", work[a.name], a.box))
                    elif a.kind == "tmap":  # the port's tensor, described for the copy engine
                        names.append(("tmap", port_buffer[a.name], a.box))
                    else:
                        names.append(SCALAR_TYPES[a.kind](env[a.name]))
                out.append(Launch(k, handle, grid, block, shared, tuple(names),
                                  self.dependent_launch and k.kernel.dependent_launch))
        return tuple(out)

    def _transport(self, backend: Any, k: Any, port_buffer: Mapping[str, str],
                   specs: Mapping[str, Any], env: Mapping[str, Any]) -> Any:
        """The launch of ``k``'s transport: every rank's input gathered, in rank order, into
        the scratch its kernel reads first (``TRANSPORTS`` in ``realize.kernel``). On a GPU
        the group's ``gather_into`` enqueues it on the program's stream (NCCL, recorded by
        graph capture); on a host backend (the emulation) it is a host kernel over the bytes,
        through the group's ``all_gather``, recorded and replayed like any launch."""
        from metrale.runtime.backend import HostKernel
        from metrale.runtime.executor import Launch

        if k.kernel.transport != "all_gather":
            raise LaunchError("no such transport", key=str(k.point), expected="all_gather",
                              found=k.kernel.transport)
        src = port_buffer["x"]
        nbytes = specs[src].nbytes
        scratch = ("scratch", WorkspaceSlice(0, int(env[k.kernel.args[0].partition(":")[0]])))
        comm = self.comm
        if backend.binary_format == "host":
            def gather(x: np.ndarray, gathered: np.ndarray) -> None:
                parts = comm.all_gather(np.array(x[:nbytes], copy=True))
                gathered[:nbytes * comm.size] = np.concatenate(parts)

            label = f"#{k.index} all_gather transport"
            module = backend.module({label: HostKernel(gather, 2)}, label)
            return Launch(k, backend.kernel(module, label), (1, 1, 1), (1, 1, 1), 0,
                          (src, scratch))

        def all_gather(backend: Any, args: tuple[Any, ...], stream: Any) -> None:
            comm.gather_into(backend, args[0], args[1], nbytes, stream)

        return Launch(k, None, (0, 0, 0), (0, 0, 0), 0, (src, scratch), transport=all_gather)

    def bind(self, backend: Any, k: Any, grid: tuple[int, int, int],
             block: tuple[int, int, int], shared: int, entry: str | None = None
             ) -> tuple[Any, tuple[Any, ...]]:
        """The handle of planned kernel ``k``'s launch of ``entry`` (default its own) on
        ``backend`` (compiled and loaded once per source and defines) and its parsed
        arguments; the launch shape is the planned one."""
        return self._loader(backend).bind(k.kernel).call(entry or k.kernel.entry)
