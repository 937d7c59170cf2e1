"""Kernels: the image of a family point under F_H, and the KERNELS.toml tables they are read from.

A ``[kernel.NAME]`` table (header comment of ``kernels/cuda/common/KERNELS.toml``) claims the
points of one family that its ``when`` admits; at a point it renders to a :class:`Kernel`:
source, entry, ``-D`` defines, a launch rule, arguments, declared reduction orders. Tables
may add ``requires`` (capabilities the class asked must have) and ``reason`` (why a shadow or
a per-point copy exists). Launch formulas are arithmetic over the bound sizes, never code
(``realize.formula``):

>>> rule = LaunchRule(("ceil(n / 4)", "rows", "1"), ("128", "1", "1"), "4 * e")
>>> rule.bind({"n": 1030, "rows": 2, "e": 8})
((258, 2, 1), (128, 1, 1), 32)
>>> eval_formula("__import__('os')", {})
Traceback (most recent call last):
...
metrale.lkb.errors.ConfigError: not a launch formula: only numbers, names, + - * / // %, ceil, floor, min, max (expected arithmetic over sizes, found "__import__('os')")

Templates: ``{p}`` is the parameter's value as written, ``{P}`` its upper-cased value.

>>> render("ACT_{ACT}", {"act": "bf16"}), render("K_BLOCK={k_block}", {"k_block": 256})
('ACT_BF16', 'K_BLOCK=256')
"""  # noqa: E501

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.dtype import DType
from metrale.lkb.errors import ConfigError, LaunchError, MetraleError, nearest
from metrale.lkb.family import Family, Point
from metrale.lkb.files import Fields, read_toml
from metrale.lkb.semantics import WITHIN, describe, reduction_orders
from metrale.realize.evidence import hash_source
from metrale.realize.formula import eval_formula, formula_names, limit_holds, limit_names
from metrale.realize.hardware import TENSOR_CORE_PROVIDES, TENSOR_CORES, Capabilities

KERNELS_FILE = "KERNELS.toml"
ARG_TYPES = ("ptr", "i32", "i64", "f32", "scratch")
"""A kernel argument's type in KERNELS.toml: a pointer, a number, the program's workspace; or
``tmap(C,R)`` (:func:`tensor_map_box`), a tensor map over a port (``runtime.backend.TensorMap``: the port's tensor as
rows x its last dim, copied in boxes of C columns and R rows, 128 bytes a box row)."""
_TMAP = re.compile(r"tmap\((\d+),(\d+)\)")


def tensor_map_box(kind: str) -> tuple[int, int] | None:
    """The box of a ``tmap(C,R)`` argument type, or None for any other type.

    >>> tensor_map_box("tmap(64,128)"), tensor_map_box("ptr")
    ((64, 128), None)
    """
    m = _TMAP.fullmatch(kind)
    return (int(m.group(1)), int(m.group(2))) if m else None

SCRATCH_DTYPES = {"bf16": 2, "f32": 4, "u8": 1}
"""The element types of a table's ``scratch`` tensors, with their bytes (those a tensor map
describes)."""
WORKSPACE_ALIGN = 1024
"""Where a scratch tensor may start in the program's workspace: a multiple of this many bytes."""


@attrs.frozen
class ScratchTensor:
    """A tensor in the program's workspace that a kernel's launches share (KERNELS.toml's
    ``scratch``): one launch writes it, a later one reads it, through a ``scratch`` argument (its
    bytes) or a ``tmap(C,R)`` one (its tensor map). ``shape`` is two formulas of the launch's
    sizes, rows and columns; 0 rows where the kernel does not make it."""

    name: str
    dtype: str
    shape: tuple[str, str] = attrs.field(converter=tuple)


@attrs.frozen
class WorkspaceSlice:
    """Where one scratch argument of a kernel lies in the program's workspace: ``offset`` and
    ``nbytes``; for a scratch tensor also its ``rows``, ``cols`` and ``dtype`` (a byte scratch
    has 0, 0 and ``""``)."""

    offset: int
    nbytes: int
    rows: int = 0
    cols: int = 0
    dtype: str = ""

    @property
    def end(self) -> int:
        """The workspace bytes it needs: its offset and its bytes."""
        return self.offset + self.nbytes


def workspace_bytes(slices: Mapping[str, WorkspaceSlice]) -> int:
    """The bytes a workspace must have to hold every one of ``slices``.

    >>> workspace_bytes({"ws": WorkspaceSlice(0, 16), "wb": WorkspaceSlice(1024, 64, 2, 16, "bf16")})
    1088
    """
    return max((s.end for s in slices.values()), default=0)


def _aligned(n: int) -> int:
    return -(-n // WORKSPACE_ALIGN) * WORKSPACE_ALIGN


TRANSPORTS = ("all_gather",)
"""The rank group's operations a collective's kernel table may name (``transport``):
``all_gather`` puts every rank's input ``x`` [rows, n], in rank order, into the kernel's
first argument as ``[ranks, rows, n]``, before the kernel runs."""
NO_REASON = "no reason given"
DEVICE_SIZE = "sms"
"""The one size a launch formula may read that the running device gives, not the plan: its
streaming multiprocessors (a persistent kernel's grid). Plans are made at the class device's
count (``Kernel.multiprocessors``); the loader binds the device's own."""


@functools.cache
def _reads_device_size(rule: LaunchRule) -> bool:
    """Whether a launch rule's formulas read ``DEVICE_SIZE`` (once per rule: plans bind the same
    few rules at every layer)."""
    return any(DEVICE_SIZE in formula_names(f) for f in (*rule.grid, *rule.block, rule.shared))


def box_numbers(box: Any, fam: Any, sizes: Mapping[str, int]) -> dict[str, int | float]:
    """The numbers a kernel's launch formulas read at one box of a plan: the circuit's
    ``sizes``, the box's runtime attributes, and the dims of the family's ports at the box
    (``k`` = the circuit's ``hidden`` …)."""
    domains = fam.domains
    env: dict[str, int | float] = dict(sizes)
    env.update({a: v for a, v in box.params if a not in domains
                and isinstance(v, int | float) and not isinstance(v, bool)})
    for port, t in zip((*fam.inputs, *fam.outputs), (*box.dom.types, *box.cod.types)):
        for fd, cd in zip(port.dims, t.shape):
            if isinstance(fd, str):
                env[fd] = cd if isinstance(cd, int) else sizes[cd]
    return env


def _integral(value: int | float, low: int, text: str, key: str) -> int:
    if isinstance(value, float):
        if not value.is_integer():
            raise LaunchError("launch formula is not a whole number", key=key,
                              expected="an integer (use ceil or //)", found=f"{text} = {value}")
        value = int(value)
    if value < low:
        raise LaunchError("launch dimension out of range", key=key, expected=f">= {low}",
                          found=f"{text} = {value}")
    return value


@attrs.frozen
class LaunchRule:
    """Grid, block (three formulas each) and dynamic shared memory (bytes) of a launch."""

    grid: tuple[str, str, str] = attrs.field(converter=tuple)
    block: tuple[str, str, str] = attrs.field(converter=tuple)
    shared: str = "0"

    def names(self) -> frozenset[str]:
        """Every size the rule reads."""
        return frozenset().union(*(formula_names(f) for f in (*self.grid, *self.block,
                                                               self.shared)))

    def bind(self, sizes: Mapping[str, int | float], *, empty: bool = False
             ) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """``(grid, block, shared)`` at these sizes; grid and block are >= 1, shared >= 0. With
        ``empty``, a grid dimension may be 0: a launch of no blocks, which is not made."""
        grid = tuple(_integral(eval_formula(f, sizes, key=f"launch.grid[{i}]"), 0 if empty else 1,
                               f, f"launch.grid[{i}]") for i, f in enumerate(self.grid))
        block = tuple(_integral(eval_formula(f, sizes, key=f"launch.block[{i}]"), 1, f,
                                f"launch.block[{i}]") for i, f in enumerate(self.block))
        shared = _integral(eval_formula(self.shared, sizes, key="launch.shared"), 0,
                           self.shared, "launch.shared")
        return grid, block, shared  # type: ignore[return-value]


@attrs.frozen
class ThenLaunch:
    """A launch that follows the kernel's own, from the same compiled module: ``entry`` with its
    launch rule and arguments, formulas and argument names read as the kernel's. A kernel whose
    work ends in a reduction over its blocks (decode attention's merge of its chunks) may hand
    that to a second launch spread over more blocks, instead of to its last block.

    Its grid may be 0 at some sizes: there it has nothing to do (a GEMM's combine of k splits
    when k is not split) and the launch is left out, not made empty. So may the kernel's own
    launch, where a ``then`` launch does the work instead (gemv.cu's split linear)."""

    entry: str
    launch: LaunchRule
    args: tuple[str, ...]


def render(template: str, params: Mapping[str, Any]) -> str:
    """A define or reduction template at a point: ``{p}`` the value, ``{P}`` it upper-cased."""

    def sub(m: re.Match) -> str:
        name = m.group(1)
        if name in params:
            return str(params[name])
        if name.lower() in params and name == name.upper():
            return str(params[name.lower()]).upper()
        return m.group(0)

    return re.sub(r"\{(\w+)\}", sub, template)


_PLACEHOLDER = re.compile(r"\{(\w+)\}")


# ---------------------------------------------------------------------------------------------
# Kernel: the value F_H gives a point


@attrs.frozen
class Kernel:
    """The image of a point under F_H: what to compile, how to launch it, what it promises.

    ``source`` is relative to the kernels folder (``None`` on the host, whose kernels are the
    reference semantics, named by ``entry``); ``provenance`` is the class whose folder
    supplied it; ``shadow`` says it replaces an inherited kernel for the same point;
    ``residual_kind`` is "shadow" or "per-point copy" for residual kernels, with the table's
    declared ``residual_reason``. ``source_hash`` covers the source and the headers it
    includes (the hash evidence records are compared on).

    >>> from metrale.realize.functor import realization
    >>> k = realization("sm_90").realize(Point("rmsnorm", (("act", "bf16"), ("h_block", 256))))
    >>> k.source, k.entry, k.defines, k.provenance, k.residual
    ('cuda/common/norm.cu', 'metrale_rmsnorm', ('-DACT_BF16', '-DH_BLOCK=256'), 'cuda', False)
    >>> grid, block, shared = k.launch_for({"rows": 3, "h": 1024})
    >>> grid
    (3, 1, 1)
    """

    point: Point
    hw: str
    provenance: str
    source: str | None
    entry: str
    defines: tuple[str, ...]
    launch: LaunchRule | None
    args: tuple[str, ...]
    values: tuple[tuple[str, str], ...]
    reduction: tuple[str, ...]
    row_invariant: bool
    shadow: bool = False
    residual: bool = False
    residual_kind: str = ""
    residual_reason: str = ""
    source_hash: str = ""
    table: str = ""
    """The ``[kernel.NAME]`` table it came from (the family name on the host)."""
    headers: tuple[str, ...] = ()
    """Headers the source includes (paths relative to the kernels folder), transitively."""
    dependent_launch: bool = False
    """The kernel waits for the previous launch on its stream (``grid_dependency_sync``) before
    it touches memory, so a class with the capability may launch it before that one ends."""
    limits: tuple[str, ...] = ()
    """Conditions on the sizes the kernel can serve (``"hq / hkv <= 8"``), checked before a
    launch is bound: outside them the launch is refused, not run."""
    then: tuple[ThenLaunch, ...] = ()
    """Launches made right after the kernel's own, in order, from the same module: the kernel's
    result is written when the last of them ends. Where a kernel has them, any launch of the
    chain, its own included, may have an empty grid at some sizes and is then not made (gemv.cu's
    linear: the one-warp-a-column launch or the split one, by n); at least one is made."""
    transport: str = ""
    """A collective's operation of the rank group (``all_gather``): it runs before the kernel's
    own launch, every rank's input gathered, in rank order, into the kernel's first argument
    (a scratch); the kernel then lays the result out (see ``TRANSPORTS``)."""
    traffic: tuple[tuple[str, str], ...] = ()
    """Port -> elements this kernel really moves, as a launch formula: where its tiling reads a
    port other than its family's ``traffic`` says (a prefill attention reads each cached row
    once per tile of query rows, not once per row). Unlisted ports keep the family's."""
    multiprocessors: int = 0
    """The ``sms`` its launch formulas read unless the sizes bind it: the class's device's
    (HARDWARE.toml's ``[device] multiprocessors``); the loader binds the running device's."""
    scratch: tuple[ScratchTensor, ...] = ()
    """Tensors its launches share in the program's workspace (:meth:`workspace` places them)."""

    @property
    def key(self) -> str:
        """The kernel's identity in Impl_H: ``provenance:source:entry``, the entries of its
        ``then`` launches (``+entry`` each: one source's decode launch ends in the plain merge
        for one family and in the sink's merge for another), and its defines.

        >>> from metrale.realize.functor import realization
        >>> realization("sm_80").realize(Point("argmax", ())).key
        'cuda:cuda/common/misc.cu:metrale_argmax'
        """
        return f"{self.provenance}:{self.source or ''}:{self.entry}" + "".join(
            f"+{t.entry}" for t in self.then) + "".join(f" {d}" for d in self.defines)

    def define_map(self) -> dict[str, str | int]:
        """The defines as a compiler mapping (``-DX`` is ``X=1``, as the compiler reads it).

        >>> from metrale.realize.functor import realization
        >>> k = realization("sm_80").realize(Point("add", (("act", "f32"),)))
        >>> k.define_map()
        {'ACT_F32': 1}
        """
        out: dict[str, str | int] = {}
        for d in self.defines:
            name, eq, value = d[2:].partition("=")
            out[name] = value if eq else 1
        return out

    def sizes(self, sizes: Mapping[str, int | float]) -> dict[str, int | float]:
        """``sizes`` plus the point's numeric parameters, ``P_bytes`` for each parameter P that
        names a dtype (its element's bytes: ``act_bytes`` is 2 at ``act = "bf16"``) and the
        ``values`` formulas."""
        env: dict[str, int | float] = {DEVICE_SIZE: self.multiprocessors} \
            if self.multiprocessors else {}
        for k, v in self.point.params:
            if isinstance(v, int | float) and not isinstance(v, bool):
                env[k] = v
            elif isinstance(v, str) and (dt := DType.named(v)) is not None:
                env[f"{k}_bytes"] = dt.element_size_bits / 8
        env.update(sizes)
        for name, formula in self.values:
            env[name] = eval_formula(formula, env, key=f"values.{name}")
        return env

    def workspace(self, sizes: Mapping[str, int | float]) -> dict[str, WorkspaceSlice]:
        """Where each scratch argument of its launches lies in the program's workspace at these
        sizes: byte scratches (a ``values`` formula's bytes) from offset 0, where the program's
        other kernels' lie too (a workspace serves its launches in stream order); then the
        ``scratch`` tensors, in the table's order, each at a multiple of ``WORKSPACE_ALIGN``.

        >>> from metrale.realize.functor import realization
        >>> k = realization("sm_90").realize(Point("linear", (("act", "bf16"),
        ...     ("weight", "fp8"), ("shape", "gemm"), ("k_block", 256), ("across", "sequential"))))
        >>> k.workspace({"rows": 1024, "k": 4096, "n": 1024})
        {'ws': WorkspaceSlice(offset=0, nbytes=16, rows=0, cols=0, dtype=''), 'wb': WorkspaceSlice(offset=1024, nbytes=8388608, rows=1024, cols=4096, dtype='bf16')}
        """  # noqa: E501
        env = self.sizes(sizes)
        tensors = {t.name for t in self.scratch}
        out = {name: WorkspaceSlice(0, int(env[name])) for _, args in self.calls for a in args
               for name, _, ty in (a.partition(":"),) if ty == "scratch" and name not in tensors}
        at = _aligned(workspace_bytes(out))
        for t in self.scratch:
            rows, cols = (_integral(eval_formula(f, env, key=f"scratch.{t.name}.shape[{i}]"), 0,
                                    f, f"scratch.{t.name}.shape[{i}]")
                          for i, f in enumerate(t.shape))
            out[t.name] = WorkspaceSlice(at, rows * cols * SCRATCH_DTYPES[t.dtype], rows, cols,
                                         t.dtype)
            at = _aligned(out[t.name].end)
        return out

    def launch_for(self, sizes: Mapping[str, int | float]
                   ) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """``(grid, block, shared)`` at the bound sizes (dims and attrs)."""
        env = self._launch_env(sizes)  # first: a host callable has no launch rule to bind
        return self.launch.bind(env)

    def launches_for(self, sizes: Mapping[str, int | float]
                     ) -> tuple[tuple[str, tuple[str, ...], tuple], ...]:
        """Every launch the kernel makes at these sizes, in order: ``(entry, args, (grid,
        block, shared))``, its own first, then its ``then`` launches, less those whose grid is
        0 there (nothing to do: not launched).

        >>> from metrale.realize.functor import realization
        >>> k = realization("sm_90").realize(Point("rmsnorm", (("act", "bf16"), ("h_block", 256))))
        >>> [(e, shape[0]) for e, _, shape in k.launches_for({"rows": 3, "h": 1024})]
        [('metrale_rmsnorm', (3, 1, 1))]
        """
        shapes = self.chain_shapes(sizes)
        made = tuple((entry, args, shape) for (entry, args), shape
                     in zip(self.calls, shapes, strict=True) if 0 not in shape[0])
        if not made:
            raise LaunchError(f"kernel {self.entry} on {self.hw} makes no launch at these sizes: "
                              "every grid of its chain is empty", key=str(self.point),
                              expected="one launch with a grid of at least one block",
                              found=", ".join(f"{e}{s[0]}" for (e, _), s
                                              in zip(self.calls, shapes, strict=True)))
        return made

    def chain_shapes(self, sizes: Mapping[str, int | float]
                     ) -> tuple[tuple[tuple[int, int, int], tuple[int, int, int], int], ...]:
        """``(grid, block, shared)`` of every launch of the chain at these sizes, in the order of
        :attr:`calls`, those with an empty grid (not made there) included."""
        env = self._launch_env(sizes)
        return (self.launch.bind(env, empty=bool(self.then)),
                *(t.launch.bind(env, empty=True) for t in self.then))

    def _launch_env(self, sizes: Mapping[str, int | float]) -> dict[str, int | float]:
        """:meth:`sizes`, once the kernel's limits are found to hold there."""
        if self.launch is None:
            raise LaunchError(f"kernel {self.entry} on {self.hw} is a host callable; it is "
                              "called, not launched", key=str(self.point))
        env = self.sizes(sizes)
        if DEVICE_SIZE not in env and any(
                _reads_device_size(r) for r in (self.launch, *(t.launch for t in self.then))):
            raise LaunchError(f"kernel {self.entry} on {self.hw}: its launch reads the device's "
                              f"multiprocessors ({DEVICE_SIZE}), which nothing gives",
                              key=str(self.point),
                              expected=f"[device] multiprocessors in {self.hw}'s HARDWARE.toml "
                              "(plans), or a running device's (the loader)", found="none")
        for limit in self.limits:
            if not limit_holds(limit, env, key=str(self.point)):
                used = ", ".join(f"{n}={env[n]}" for n in sorted(limit_names(limit)))
                raise LaunchError(f"kernel {self.entry} on {self.hw} cannot serve these sizes",
                                  key=str(self.point), expected=limit, found=used)
        return env

    @property
    def calls(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """``(entry, args)`` of each launch the kernel makes, its own first, then its ``then``
        launches'.

        >>> from metrale.realize.functor import realization
        >>> k = realization("sm_90").realize(Point("attention", (("act", "bf16"),
        ...     ("mode", "decode"), ("kv_block", 256))))
        >>> [entry for entry, _ in k.calls]
        ['metrale_attention_decode', 'metrale_attention_decode_merge']
        """
        return ((self.entry, self.args), *((t.entry, t.args) for t in self.then))

    @property
    def entries(self) -> tuple[str, ...]:
        """The entries the kernel launches, its own first."""
        return tuple(entry for entry, _ in self.calls)

    def __str__(self) -> str:
        where = self.source or "semantics"
        return f"{self.point} -> {self.entry} ({self.provenance}: {where})"


# ---------------------------------------------------------------------------------------------
# Kernel tables (KERNELS.toml)


_CAPABILITIES = tuple(f.name for f in attrs.fields(Capabilities))


@attrs.frozen
class KernelTable:
    """One ``[kernel.NAME]`` table, checked against its family; renders kernels at points.

    ``folder`` is the table's folder relative to the kernels folder (``cuda/common``).
    """

    name: str
    family: str
    when: tuple[tuple[str, tuple[Any, ...]], ...]
    source: str
    entry: str
    defines: tuple[tuple[str, str], ...]
    fixed: tuple[str, ...]
    launch: LaunchRule
    args: tuple[str, ...]
    values: tuple[tuple[str, str], ...]
    reduction: tuple[str, ...]
    row_invariant: bool
    requires: tuple[tuple[str, Any], ...] = ()
    reason: str | None = None
    folder: str = ""
    file: str = attrs.field(default="", eq=False)
    dependent_launch: bool = False
    limits: tuple[str, ...] = ()
    then: tuple[ThenLaunch, ...] = ()
    transport: str = ""
    traffic: tuple[tuple[str, str], ...] = ()
    scratch: tuple[ScratchTensor, ...] = ()

    @property
    def source_path(self) -> str:
        """The source relative to the kernels folder."""
        return f"{self.folder}/{self.source}" if self.folder else self.source

    def claims(self, point: Point) -> bool:
        """Whether ``when`` admits ``point`` (a point of this table's family)."""
        if point.family != self.family:
            return False
        params = dict(point.params)
        return all(k in params and params[k] in vs for k, vs in self.when)

    def defines_at(self, point: Point) -> tuple[str, ...]:
        """The ``-D`` flags at ``point``, sorted (a true bool parameter gives its template)."""
        params = dict(point.params)
        out = list(self.fixed)
        for pname, template in self.defines:
            value = params[pname]
            if isinstance(value, bool):
                if value:
                    out.append(template)
            else:
                out.append(render(template, params))
        return tuple(sorted(f"-D{d}" for d in out))

    def reduction_at(self, point: Point) -> tuple[str, ...]:
        """The declared reduction orders at ``point``."""
        return tuple(render(r, dict(point.params)) for r in self.reduction)

    def unmet(self, caps: Capabilities, hw: str) -> tuple[str, ...]:
        """The requirements ``caps`` fails, in words ("requires fp4, which sm_80 lacks").

        >>> from metrale.realize.hardware import load_hardware
        >>> t = attrs.evolve(_EXAMPLE, requires=(("fp4", True), ("tensor_core", "wgmma")))
        >>> t.unmet(load_hardware().get("sm_80").capabilities, "sm_80")
        ('requires fp4, which sm_80 lacks', 'requires tensor_core wgmma, which sm_80 lacks (it has mma.sync)')
        """  # noqa: E501
        out = []
        for cap, want in self.requires:
            have = getattr(caps, cap)
            if want is False:
                if have:
                    out.append(f"requires no {cap}, which {hw} has")
                continue
            if want is True:
                ok, words = bool(have), cap
            elif isinstance(want, str):  # tensor_core: a kind the class can run
                ok, words = want in TENSOR_CORE_PROVIDES[have], f"{cap} {want}"
            elif isinstance(want, tuple):
                ok, words = have is not None and tuple(have) >= want, f"{cap} >= {list(want)}"
            else:
                ok, words = have >= want, f"{cap} >= {want}"
            if not ok:
                it_has = "" if isinstance(want, bool) else f" (it has {have})"
                out.append(f"requires {words}, which {hw} lacks{it_has}")
        return tuple(out)

    def kernel(self, point: Point, *, hw: str, provenance: str, source_hash: str,
               headers: tuple[str, ...], shadow: bool, residual_kind: str,
               multiprocessors: int = 0) -> Kernel:
        """The kernel this table gives ``point`` on ``hw`` (whose device has
        ``multiprocessors``, 0 where its class does not say)."""
        return Kernel(point, hw, provenance, self.source_path, self.entry,
                      self.defines_at(point), self.launch, self.args, self.values,
                      self.reduction_at(point), self.row_invariant, shadow,
                      bool(residual_kind), residual_kind,
                      (self.reason or NO_REASON) if residual_kind else "", source_hash,
                      self.name, headers, self.dependent_launch, self.limits, self.then,
                      self.transport, self.traffic, multiprocessors, self.scratch)


_EXAMPLE = KernelTable("k", "f", (), "k.cu", "k", (), (), LaunchRule(("1",) * 3, ("1",) * 3),
                       (), (), (), True)


def family_dims(fam: Family) -> frozenset[str]:
    """The named dims of a family's ports (the sizes a launch formula may read)."""
    return frozenset(d for p in fam.inputs + fam.outputs for d in p.dims if isinstance(d, str))


def _allowed_names(fam: Family, values: Mapping[str, str]) -> frozenset[str]:
    # P_bytes where every value of parameter P names a dtype (Kernel.sizes binds it)
    dtypes = {f"{p}_bytes" for p, vs in fam.domains.items()
              if vs and all(isinstance(v, str) and DType.named(v) for v in vs)}
    return (family_dims(fam) | set(fam.attrs) | set(fam.domains) | set(values) | dtypes
            | {DEVICE_SIZE})


def _str_list(f: Fields, key: str, default: Any = None) -> tuple[str, ...] | None:
    value = f.take(key, list) if default is None else f.take(key, list, default=default)
    if value is None:
        return None
    if not all(isinstance(v, str) for v in value):
        f.fail(key, "every entry must be a string", "a list of strings", repr(value))
        return None
    return tuple(value)


def _str_table(f: Fields, key: str, default: Any = None) -> dict[str, str] | None:
    value = f.take(key, dict) if default is None else f.take(key, dict, default=default)
    if value is None:
        return None
    bad = [k for k, v in value.items() if not isinstance(v, str)]
    if bad:
        f.fail(f"{key}.{bad[0]}", "must be a string", "a string", repr(value[bad[0]]))
        return None
    return dict(value)


def _read_launch(raw: Any, f: Fields, names: frozenset[str]) -> LaunchRule | None:
    if raw is None:
        return None
    lf = Fields(raw, f.file, f.key("launch"), f.errors)
    grid = _str_list(lf, "grid")
    block = _str_list(lf, "block")
    shared = lf.take("shared", str, default="0")
    lf.close()
    for which, formulas in (("grid", grid), ("block", block)):
        if formulas is not None and len(formulas) != 3:
            lf.fail(which, "three formulas (x, y, z)", "3 strings", f"{len(formulas)}")
    if not lf.ok:
        return None
    parts = [(f"grid[{i}]", x) for i, x in enumerate(grid)] + [
        (f"block[{i}]", x) for i, x in enumerate(block)] + [("shared", shared)]
    for where, text in parts:
        _check_formula(lf, where, text, names)
    return LaunchRule(grid, block, shared) if lf.ok else None


def _check_formula(f: Fields, where: str, text: str, names: frozenset[str],
                   what: str = "formula") -> None:
    """A launch formula (or, with ``what="limit"``, a limit) that reads only ``names``."""
    read = limit_names if what == "limit" else formula_names
    try:
        used = read(text, f.file, f.key(where))
    except ConfigError as e:
        f.fail(where, e.message, e.expected, e.found)
        return
    for n in sorted(used - names):
        f._fail(f.key(where), f"unknown size {n!r} in {what}",
                "a dim, attr or parameter of the family, P_bytes of a dtype parameter P, "
                f"{DEVICE_SIZE} (the device's multiprocessors), or a "
                "name in `values`", repr(text),
                nearest(n, names))


def _read_requires(raw: Any, f: Fields) -> tuple[tuple[str, Any], ...]:
    """``["fp8", "fp4"]`` (each must be true) or ``{tensor_core = "wgmma", fp8 = true, ...}``."""
    if raw is None:
        return ()
    if isinstance(raw, list):
        if not all(isinstance(x, str) for x in raw):
            f.fail("requires", "a list of capability names", "strings", repr(raw))
            return ()
        raw = {x: True for x in raw}
    if not isinstance(raw, dict):
        f.fail("requires", "wrong type", "a list of capability names or a table",
               type(raw).__name__)
        return ()
    out = []
    for cap, want in raw.items():
        key = f"requires.{cap}"
        if cap not in _CAPABILITIES:
            f._fail(f.key(key), "unknown capability", "one of " + ", ".join(_CAPABILITIES),
                    repr(cap), nearest(cap, _CAPABILITIES))
            continue
        field = attrs.fields_dict(Capabilities)[cap]
        if cap == "tensor_core":
            if want not in TENSOR_CORES:
                f._fail(f.key(key), "unknown tensor-core kind", "one of " + ", ".join(
                    TENSOR_CORES), repr(want), nearest(str(want), TENSOR_CORES))
                continue
        elif cap == "compute_capability":
            if not (isinstance(want, list) and len(want) == 2
                    and all(type(x) is int and x >= 0 for x in want)):
                f._fail(f.key(key), "wrong type", "[major, minor]", repr(want))
                continue
            want = tuple(want)
        elif field.type in (bool, "bool"):  # the number formats, dependent_launch
            if not isinstance(want, bool):
                f._fail(f.key(key), "wrong type", "true or false", repr(want))
                continue
        elif type(want) is not int or type(field.default) is not int:
            f._fail(f.key(key), "wrong type", "an integer (a minimum)", repr(want))
            continue
        out.append((cap, want))
    return tuple(out)


def read_table(name: str, raw: Any, family: Family, file: Path, folder: str, source_dir: Path,
               errors: list[MetraleError], dependent: bool = False) -> KernelTable | None:
    """Check one ``[kernel.NAME]`` table against its family; every violation into ``errors``.
    ``dependent`` is the file's ``dependent_launch``, the table's default."""
    f = Fields(raw, file, f"kernel.{name}", errors)
    f.take("family", str, default=name)  # read by the caller; taken so close() accepts it
    when_raw = f.take("when", dict, default={})
    source = f.take("source", str)
    entry = f.take("entry", str)
    defines = _str_table(f, "defines", default={})
    fixed = _str_list(f, "fixed", default=[])
    launch_raw = f.take("launch", dict)
    values = _str_table(f, "values", default={})
    args = _str_list(f, "args")
    reduction = _str_list(f, "reduction")
    row_inv = f.take("row_invariant", bool, default=family.row_invariant)
    requires = _read_requires(f.take("requires", (list, dict), default=None), f)
    reason = f.take("reason", str, default=None)
    dependent = f.take("dependent_launch", bool, default=dependent)
    limits = _str_list(f, "limits", default=[])
    then_raw = f.take("then", list, default=[])
    transport = f.take("transport", str, default="")
    traffic = _str_table(f, "traffic", default={})
    scratch_raw = f.take("scratch", dict, default={})
    f.close()
    domains = family.domains
    if transport and transport not in TRANSPORTS:
        f.fail("transport", "unknown transport", "one of " + ", ".join(TRANSPORTS),
               repr(transport), nearest(transport, TRANSPORTS))
    if bool(transport) != family.collective:
        f.fail("transport", "a collective family's kernel names its transport, and only it",
               "a transport" if family.collective else "none", repr(transport) or "none")
    if transport and not (args and args[0].endswith(":scratch")):
        f.fail("args", "a transport writes the gathered inputs into the first argument",
               "a scratch argument first", repr(args[0]) if args else "none")
    when: list[tuple[str, tuple[Any, ...]]] = []
    for pname, allowed in (when_raw or {}).items():
        if pname not in domains:
            f._fail(f.key(f"when.{pname}"), f"{family.name} has no such parameter",
                    "one of " + ", ".join(domains), repr(pname), nearest(pname, domains))
        elif not isinstance(allowed, list) or not allowed:
            f._fail(f.key(f"when.{pname}"), "a non-empty list of values", "a list",
                    repr(allowed))
        else:
            for v in allowed:
                if v not in domains[pname]:
                    f._fail(f.key(f"when.{pname}"), "value outside the parameter's domain",
                            "one of " + ", ".join(map(str, domains[pname])), repr(v))
            when.append((pname, tuple(allowed)))
    if source is not None:
        if not (source_dir / source).is_file() or Path(source).is_absolute() or ".." in source:
            here = sorted(p.name for p in source_dir.iterdir() if p.is_file()) \
                if source_dir.is_dir() else []
            f.fail("source", f"source not found in {folder or source_dir}", "a file next to "
                   f"{file.name}", repr(source))
            if nearest(source, here):
                f.errors[-1].suggestion = nearest(source, here)
    if entry is not None and not re.fullmatch(r"[A-Za-z_]\w*", entry):
        f.fail("entry", "not a symbol", "an identifier (an extern \"C\" kernel)", repr(entry))
    for pname in defines or {}:
        if pname not in domains:
            f._fail(f.key(f"defines.{pname}"), f"{family.name} has no such parameter",
                    "one of " + ", ".join(domains), repr(pname), nearest(pname, domains))
    for where, texts in (("defines", (defines or {}).values()), ("reduction", reduction or ())):
        for text in texts:
            for ph in _PLACEHOLDER.findall(text):
                if ph not in domains and ph.lower() not in domains:
                    f._fail(f.key(where), f"template names {{{ph}}}, not a parameter",
                            "{param} or {PARAM} of " + family.name, repr(text),
                            nearest(ph.lower(), domains))
    names = _allowed_names(family, values or {})
    for vname, formula in (values or {}).items():
        _check_formula(f, f"values.{vname}", formula, names - {vname})
    launch = _read_launch(launch_raw, f, names)
    for i, limit in enumerate(limits or ()):
        _check_formula(f, f"limits[{i}]", limit, names, what="limit")
    scratch = _read_scratch(scratch_raw or {}, f, names, family)
    tensors = frozenset(t.name for t in scratch)
    _check_args(f, args or (), family, values or {}, tensors)
    ports = [p.name for p in family.inputs + family.outputs]
    for port, formula in (traffic or {}).items():
        if port not in ports:
            f._fail(f.key(f"traffic.{port}"), f"{family.name} has no such port",
                    "one of " + ", ".join(ports), repr(port), nearest(port, ports))
        else:
            _check_formula(f, f"traffic.{port}", formula, names | {"context"})
    then: list[ThenLaunch] = []
    for i, raw_t in enumerate(then_raw or []):
        taken = {entry, *(t.entry for t in then)}
        if (t := _read_then(raw_t, f, i, names, family, values or {}, taken,
                            tensors)) is not None:
            then.append(t)
    used = {a.partition(":")[0] for a in (*(args or ()), *(a for t in then for a in t.args))}
    for t in scratch:
        if t.name not in used:
            f.fail(f"scratch.{t.name}", "a scratch tensor no launch takes",
                   "an argument of one of the kernel's launches", "none")
    if row_inv and not family.row_invariant:
        f.fail("row_invariant", "claims row-invariance its family does not have", "false",
               "true")
    if not f.ok:
        return None
    table = KernelTable(name, family.name, tuple(when), source, entry,
                        tuple((defines or {}).items()), fixed, launch, args,
                        tuple((values or {}).items()), reduction, row_inv, requires, reason,
                        folder, str(file), bool(dependent), tuple(limits or ()), tuple(then),
                        transport or "", tuple((traffic or {}).items()), scratch)
    claimed = [p for p in family.points if table.claims(p)]
    for p in claimed:
        _check_reduction(f, table, family, p)
    return table if f.ok else None


def _read_then(raw: Any, f: Fields, i: int, names: frozenset[str], fam: Family,
               values: Mapping[str, str], taken: set[str | None],
               tensors: frozenset[str] = frozenset()) -> ThenLaunch | None:
    """One ``then`` launch: ``{entry, launch, args}``, checked as the table's own are; its entry
    is none of ``taken`` (the kernel's launches are told apart by their entries)."""
    if not isinstance(raw, dict):
        f.fail(f"then[{i}]", "wrong type", "a table {entry, launch, args}", type(raw).__name__)
        return None
    tf = Fields(raw, f.file, f.key(f"then[{i}]"), f.errors)
    entry = tf.take("entry", str)
    launch_raw = tf.take("launch", dict)
    args = _str_list(tf, "args")
    tf.close()
    if entry is not None and not re.fullmatch(r"[A-Za-z_]\w*", entry):
        tf.fail("entry", "not a symbol", "an identifier (an extern \"C\" kernel)", repr(entry))
    elif entry is not None and entry in taken:
        tf.fail("entry", "launched twice", "an entry the kernel does not launch already",
                repr(entry))
    launch = _read_launch(launch_raw, tf, names)
    _check_args(tf, args or (), fam, values, tensors)
    if not tf.ok or entry is None or launch is None or args is None:
        f.ok = False
        return None
    return ThenLaunch(entry, launch, args)


def _read_scratch(raw: Mapping[str, Any], f: Fields, names: frozenset[str],
                  fam: Family) -> tuple[ScratchTensor, ...]:
    """The ``scratch`` tensors: ``NAME = { dtype = "bf16", shape = ["ROWS", "COLS"] }``, each
    named apart from the family's ports and the table's sizes."""
    out = []
    taken = names | {p.name for p in fam.inputs + fam.outputs}
    for name, spec in raw.items():
        where = f"scratch.{name}"
        if not re.fullmatch(r"[A-Za-z_]\w*", name) or name in taken:
            f.fail(where, "a scratch tensor's name is a new identifier",
                   "a name no port, size or value of the table has", repr(name))
            continue
        if not isinstance(spec, dict):
            f.fail(where, "wrong type", "a table { dtype, shape }", type(spec).__name__)
            continue
        sf = Fields(spec, f.file, f.key(where), f.errors)
        dtype = sf.take("dtype", str)
        shape = _str_list(sf, "shape")
        sf.close()
        if dtype is not None and dtype not in SCRATCH_DTYPES:
            sf._fail(sf.key("dtype"), "unknown scratch dtype",
                     "one of " + ", ".join(SCRATCH_DTYPES), repr(dtype),
                     nearest(dtype, SCRATCH_DTYPES))
        if shape is not None and len(shape) != 2:
            sf.fail("shape", "two formulas (rows, columns)", "2 strings", f"{len(shape)}")
        elif shape is not None:
            for i, text in enumerate(shape):
                _check_formula(sf, f"shape[{i}]", text, names)
        if sf.ok and dtype is not None and shape is not None:
            out.append(ScratchTensor(name, dtype, shape))
        else:
            f.ok = False
    return tuple(out)


def _check_args(f: Fields, args: tuple[str, ...], fam: Family, values: Mapping[str, str],
                tensors: frozenset[str] = frozenset()) -> None:
    """Each ``name:type`` names something the launch can pass: a port, attr, dim or value; a
    ``scratch`` argument a ``values`` formula's bytes or a scratch tensor; a ``tmap(C,R)`` an
    input port or a scratch tensor."""
    ports = {p.name for p in fam.inputs + fam.outputs}
    names = ports | set(fam.attrs) | family_dims(fam) | set(values) | set(tensors) | {
        f"{w}_{s}" for w in fam.weights for s in ("scale", "global")}
    seen = set()
    for i, a in enumerate(args):
        arg, _, ty = a.partition(":")
        box = tensor_map_box(ty)
        if box is not None:
            if arg not in {p.name for p in fam.inputs} | tensors:
                f._fail(f.key(f"args[{i}]"), "a tensor map describes an input port or a "
                        "scratch tensor", "an input of " + fam.name + " or a name in `scratch`",
                        repr(a))
            if not 1 <= box[0] <= 256 or not 1 <= box[1] <= 256:
                f._fail(f.key(f"args[{i}]"), "a tensor map's box is 1..256 by 1..256",
                        "tmap(C,R) within it", repr(a))
        elif ty not in ARG_TYPES:
            f._fail(f.key(f"args[{i}]"), "unknown argument type",
                    "one of " + ", ".join(ARG_TYPES) + ", tmap(C,R)", repr(a),
                    nearest(ty, ARG_TYPES))
        if arg not in names:
            f._fail(f.key(f"args[{i}]"), "argument is not a port, attr, dim or value",
                    "a name of " + fam.name, repr(a), nearest(arg, names))
        if ty == "scratch" and arg not in values and arg not in tensors:
            f._fail(f.key(f"args[{i}]"), "a scratch argument needs its bytes",
                    f"a formula values.{arg} or a tensor scratch.{arg}", repr(a))
        elif arg in tensors and ty != "scratch" and box is None:
            f._fail(f.key(f"args[{i}]"), "a scratch tensor is passed as its bytes or its "
                    "tensor map", f"{arg}:scratch or {arg}:tmap(C,R)", repr(a))
        if arg in seen:
            f._fail(f.key(f"args[{i}]"), "duplicate argument", "distinct names", repr(a))
        seen.add(arg)


def _check_reduction(f: Fields, table: KernelTable, fam: Family, point: Point) -> None:
    """The declared orders are the semantics' own in ``describe`` words; only the within-block
    order may differ (named or left unstated), since a GPU cannot follow BLAS's."""
    want = reduction_orders(fam.semantics, **point.as_dict())
    got = table.reduction_at(point)
    if len(got) != len(want):
        f.fail("reduction", f"{len(want)} reductions at {point}",
               [describe(r) for r in want], list(got))
        return
    for g, r in zip(got, want):
        allowed = {describe(attrs.evolve(r, within=w)) for w in WITHIN}
        if g not in allowed:
            f.fail("reduction", f"order differs from the semantics at {point}",
                   describe(attrs.evolve(r, within="")) + " (with any within-block order)",
                   repr(g))


@attrs.frozen
class Orphan:
    """A table that claims nothing F_H can use: its family is not in the presentation, or its
    ``when`` admits no compiled point. Its source counts as class-only in the residual."""

    name: str
    source: str
    reason: str


@attrs.frozen
class TableFolder:
    """One folder of a chain (``cuda/common``, ``sm_90/qwen3-0.6b/bf16``) and its tables."""

    owner: str
    path: str
    kind: str
    """``"common"`` or ``"leaf"`` (a target's per-point copies)."""
    tables: tuple[KernelTable, ...] = ()
    orphans: tuple[Orphan, ...] = ()

    def claiming(self, point: Point) -> tuple[KernelTable, ...]:
        """The tables of this folder that claim ``point``, in file order."""
        return tuple(t for t in self.tables if t.claims(point))


def load_folder(kernels_dir: Path, rel: str, owner: str, kind: str,
                families: Mapping[str, Family], errors: list[MetraleError]) -> TableFolder:
    """Read ``<kernels_dir>/<rel>/KERNELS.toml`` (none: an empty folder)."""
    folder = kernels_dir / rel
    path = folder / KERNELS_FILE
    if not path.is_file():
        return TableFolder(owner, rel, kind)
    try:
        data = read_toml(path)
    except ConfigError as e:
        errors.append(e)
        return TableFolder(owner, rel, kind)
    top = Fields(data, path, "", errors)
    raw_tables = top.take("kernel", dict, default={})
    dependent = top.take("dependent_launch", bool, default=False)
    top.close()
    tables, orphans = [], []
    for name, raw in (raw_tables or {}).items():
        fam_name = raw.get("family", name) if isinstance(raw, dict) else name
        source = raw.get("source") if isinstance(raw, dict) else None
        source = f"{rel}/{source}" if isinstance(source, str) else f"{rel}/?"
        if not isinstance(fam_name, str) or fam_name not in families:
            hint = nearest(str(fam_name), families)
            orphans.append(Orphan(name, source, f"table {name!r} names family {fam_name!r}, "
                                  "which is not in the presentation"
                                  + (f" (did you mean {hint!r}?)" if hint else "")))
            continue
        t = read_table(name, raw, families[fam_name], path, rel, folder, errors,
                       bool(dependent))
        if t is None:
            continue
        if not any(t.claims(p) for p in families[fam_name].points):
            orphans.append(Orphan(name, t.source_path, f"table {name!r} claims no compiled "
                                  f"point of {fam_name}"))
            continue
        tables.append(t)
    _check_overlaps(tables, families, path, errors)
    return TableFolder(owner, rel, kind, tuple(tables), tuple(orphans))


def _check_overlaps(tables: list[KernelTable], families: Mapping[str, Family], path: Path,
                    errors: list[MetraleError]) -> None:
    """Two tables of one folder may claim one point only under different requirements
    (the first whose requirements hold wins); otherwise the second is dead."""
    for i, a in enumerate(tables):
        for b in tables[i + 1:]:
            if a.family != b.family or a.requires != b.requires:
                continue
            both = [p for p in families[a.family].points if a.claims(p) and b.claims(p)]
            if both:
                errors.append(ConfigError(
                    f"tables {a.name!r} and {b.name!r} both claim {both[0]}"
                    + (f" and {len(both) - 1} more points" if len(both) > 1 else ""),
                    file=path, key=f"kernel.{b.name}.when",
                    expected="disjoint `when`, or different `requires`"))


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def source_identity(kernels_dir: Path, source: str, search: tuple[str, ...]
                    ) -> tuple[str, tuple[str, ...], dict[str, str], str]:
    """``(text, headers, header_texts, hash)`` of a source: quoted includes are looked up in
    the source's folder, then in ``search`` (the chain's folders, in order), transitively;
    the hash covers the source and every header found (``#include <...>`` is the toolchain's).

    ``header_texts`` maps the include spelling to its text, as a compiler's ``-I`` would.
    """
    src = kernels_dir / source
    text = src.read_text(encoding="utf-8")
    folders = (str(Path(source).parent), *search)
    found: dict[str, tuple[str, str]] = {}  # spelling -> (path relative to kernels_dir, text)
    todo = _INCLUDE.findall(text)
    while todo:
        name = todo.pop()
        if name in found:
            continue
        for d in folders:
            p = kernels_dir / d / name
            if p.is_file():
                body = p.read_text(encoding="utf-8")
                found[name] = (f"{d}/{name}", body)
                todo.extend(_INCLUDE.findall(body))
                break
    parts = [text] + [f"\0{name}\0{body}" for name, (_, body) in sorted(found.items())]
    headers = tuple(sorted(path for path, _ in found.values()))
    return text, headers, {n: b for n, (_, b) in found.items()}, hash_source("".join(parts))
