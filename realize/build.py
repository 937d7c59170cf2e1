"""The build: Sources → Binaries for the points a plan uses, through the cache, into the registry.

``build(points, hw, target=...)`` realizes each point on ``hw`` (F_H), groups the kernels that
compile to one binary (same source, defines and arch), and compiles each group once through
the content-addressed :class:`BuildCache` (groups in parallel, one per core, with a progress
bar on a terminal; Ctrl-C stops the running compilers at once, see ``realize.jobs``). A compile
error is recorded against its group's points and the others still build; nothing is cached
for it. Every binary is checked to export each entry that uses it. When every point built,
the target's summand is written to the registry.

The arch is the class's own. A class without one (``cuda``, the common layer) is not
buildable alone: its sources compile for the arch of the descendant class that uses them, so
build for that class. Host classes compile nothing: their kernels are the reference
semantics, recorded by name (and written to the registry as ``module:function`` references).

>>> from metrale.lkb.family import Point
>>> report = build([Point("add", (("act", "f32"),))], "host",
...                target=KernelTarget("host", "tiny", "f32"), progress=False)
>>> report.ok, report.host_entries, report.counts()
(True, ('add',), {'built': 0, 'cached': 0, 'failed': 0, 'not realized': 0, 'host': 1})
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import CompileError, ConfigError
from metrale.lkb.family import Point
from metrale.lkb.target import KernelTarget
from metrale.realize import jobs as _jobs
from metrale.realize.cache import BuildCache, cache_key
from metrale.realize.compute import (
    Binary,
    ComputeTarget,
    HostTarget,
    NvidiaTarget,
    cubin_code_bytes,
)
from metrale.realize.functor import Realization, realization
from metrale.realize.kernel import Kernel, source_identity
from metrale.realize.registry import Registry

BUILT, CACHED, FAILED, NOT_REALIZED, HOST = "built", "cached", "failed", "not realized", "host"
STATUSES = (BUILT, CACHED, FAILED, NOT_REALIZED, HOST)


@attrs.frozen
class BuildItem:
    """One point of the build: its kernel, what happened, and its binary's hash or the error."""

    point: Point
    status: str = attrs.field(validator=attrs.validators.in_(STATUSES))
    kernel: Kernel | None = None
    sha256: str | None = None
    error: str = ""
    code_bytes: int | None = None
    """Machine code of the entry, where the binary is a cubin (``cubin_code_bytes``): a decode
    step fetches each kernel's code again in every layer, so this is a cost it pays."""
    compile_s: float = 0.0
    """Seconds its binary took to compile (0 when the cache had it)."""


@attrs.frozen
class BuildUnit:
    """One distinct binary of a build (a (source, defines, arch) group): its label, its status
    (``built``, ``cached`` or ``failed``) and its own compile time in seconds (0 when cached).

    >>> BuildUnit("rmsnorm.cu [-DACT_BF16] for sm_90a", "built", 1.25)
    BuildUnit(label='rmsnorm.cu [-DACT_BF16] for sm_90a', status='built', seconds=1.25)
    """

    label: str
    status: str
    seconds: float = 0.0


@attrs.frozen
class BuildReport:
    """What a build did: per point, and per compiled binary (``units``: distinct (source,
    defines, arch) groups, each ``built``, ``cached`` or ``failed``, with its compile time).

    ``seconds`` is the wall time of the whole build; ``planning_s`` the part of it spent
    planning (finding the points), when the caller planned (:meth:`with_planning`);
    ``jobs`` the compiles run at once.
    """

    target: KernelTarget
    hw: str
    arch: str | None
    compiler: str
    items: tuple[BuildItem, ...]
    units: tuple[BuildUnit, ...]
    seconds: float
    registry: str | None = None
    """The summand folder written, or ``None`` (no registry given, or the build failed)."""
    errors: tuple[CompileError, ...] = attrs.field(default=(), eq=False)
    planning_s: float = 0.0
    jobs: int = 1

    def count(self, status: str) -> int:
        """Binaries (built, cached, failed) or points (not realized, host) with ``status``."""
        if status in (BUILT, CACHED, FAILED):
            return sum(u.status == status for u in self.units)
        return sum(i.status == status for i in self.items)

    def counts(self) -> dict[str, int]:
        return {s: self.count(s) for s in STATUSES}

    @property
    def ok(self) -> bool:
        """Every point realized and every binary built or cached."""
        return not self.count(FAILED) and not self.count(NOT_REALIZED)

    @property
    def compile_s(self) -> float:
        """The summed compile time of the binaries built (more than the wall time they took
        when several compiled at once)."""
        return sum(u.seconds for u in self.units)

    def with_planning(self, seconds: float) -> BuildReport:
        """This report with ``seconds`` of planning before it, counted in its total."""
        return attrs.evolve(self, planning_s=seconds, seconds=self.seconds + seconds)

    @property
    def host_entries(self) -> tuple[str, ...]:
        """The semantics names of a host build (nothing was compiled)."""
        return tuple(sorted({i.kernel.entry for i in self.items
                             if i.status == HOST and i.kernel is not None}))

    def summary(self) -> str:
        """One line: points, binaries by status, and the total time with its parts.

        >>> t = KernelTarget("sm_90", "m", "bf16")
        >>> r = BuildReport(t, "sm_90", "sm_90a", "nvcc 13.0.88", (),
        ...                 (BuildUnit("a.cu", "built", 3.0), BuildUnit("b.cu", "cached")), 2.5,
        ...                 planning_s=0.5, jobs=2)
        >>> r.summary()
        'build sm_90/m/bf16: 0 points, 1 built, 1 cached, 0 failed in 2.50 s (planning 0.50 s, compiling 3.00 s over 2 jobs; nvcc 13.0.88)'
        """  # noqa: E501
        c = self.counts()
        parts = [f"{c[s]} {s}" for s in STATUSES if c[s] or s in (BUILT, CACHED, FAILED)]
        detail = []
        if self.planning_s:
            detail.append(f"planning {self.planning_s:.2f} s")
        if self.count(BUILT):
            detail.append(f"compiling {self.compile_s:.2f} s over {self.jobs} jobs")
        how = "; ".join([", ".join(detail)] * bool(detail) + [self.compiler])
        return (f"build {self.target}: {len(self.items)} points, " + ", ".join(parts)
                + f" in {self.seconds:.2f} s ({how})")

    def slowest(self, n: int = 5) -> tuple[BuildUnit, ...]:
        """The ``n`` binaries that took longest to compile (built ones only)."""
        built = [u for u in self.units if u.status == BUILT]
        return tuple(sorted(built, key=lambda u: -u.seconds)[:n])

    def compile_table(self, n: int | None = None) -> Any:
        """A rich table of the binaries compiled, slowest first (``n``: only that many)."""
        from rich.table import Table

        built = self.slowest(len(self.units) if n is None else n)
        title = (f"compile time per kernel ({len(built)} slowest of {self.count(BUILT)})"
                 if n is not None and self.count(BUILT) > len(built)
                 else "compile time per kernel")
        t = Table(title=title)
        t.add_column("binary", overflow="fold")
        t.add_column("seconds", justify="right")
        for u in built:
            t.add_row(u.label, f"{u.seconds:.2f}")
        return t

    def table(self) -> Any:
        """A rich table: one row per point."""
        from rich.table import Table

        t = Table(title=self.summary())
        for col in ("point", "status", "kernel", "code", "compile", "detail"):
            t.add_column(col, justify="right" if col in ("code", "compile") else "left")
        for i in self.items:
            kernel = "" if i.kernel is None else f"{i.kernel.entry} ({i.kernel.provenance})"
            detail = i.error.splitlines()[0] if i.error else (i.sha256 or "")[:16]
            code = "" if i.code_bytes is None else f"{i.code_bytes / 1024:.1f} KB"
            took = f"{i.compile_s:.2f} s" if i.status == BUILT else ""
            t.add_row(str(i.point), i.status, kernel, code, took, detail)
        return t

    def to_json(self) -> dict[str, Any]:
        return {"target": str(self.target), "hardware": self.hw, "arch": self.arch,
                "compiler": self.compiler, "seconds": self.seconds,
                "planning_s": self.planning_s, "compile_s": self.compile_s, "jobs": self.jobs,
                "counts": self.counts(), "registry": self.registry,
                "units": [{"binary": u.label, "status": u.status, "seconds": u.seconds}
                          for u in self.units],
                "items": [{"point": str(i.point), "status": i.status, "sha256": i.sha256,
                           "kernel": None if i.kernel is None else i.kernel.key,
                           "code_bytes": i.code_bytes, "compile_s": i.compile_s,
                           "error": i.error} for i in self.items]}


@attrs.frozen
class _Unit:
    source: str
    defines: tuple[str, ...]
    entries: tuple[str, ...] | None  # None: the whole source
    arch: str
    kernels: tuple[Kernel, ...]

    @property
    def key(self) -> UnitKey:
        return self.source, self.defines, self.entries

    @property
    def label(self) -> str:
        only = "" if self.entries is None else f" {self.entries[0]}" + (
            f" +{len(self.entries) - 1}" if len(self.entries) > 1 else "")
        return f"{self.source}{only} [{' '.join(self.defines)}] for {self.arch}"


UnitKey = tuple[str, tuple[str, ...], tuple[str, ...] | None]
"""A compile unit: (source, defines, the entries kept; None for the whole source)."""


def unit_key(kernel: Kernel, cut: bool = True) -> UnitKey:
    """The unit ``kernel``'s binary is compiled in: its source cut to the entries it launches
    (``cut``, what the build and the runtime loader compile: :mod:`metrale.realize.entries`),
    else the whole source (the class-wide compile checks, one binary per source and defines)."""
    return kernel.source, kernel.defines, tuple(sorted(kernel.entries)) if cut else None


def unit_source(kernels_dir: Path | str, kernel: Kernel, cut: bool = True
                ) -> tuple[str, dict[str, str]]:
    """The text and the header texts (by include spelling) that ``kernel``'s binary is compiled
    from (its unit's, :func:`unit_key`): the build's and the runtime loader's one definition,
    so they share cache entries. Cut, an included source (a ``.cu`` header) keeps only the
    kernel's entries it defines."""
    from metrale.realize.entries import entry_names, keep_included_entries

    search = tuple(dict.fromkeys(str(Path(h).parent) for h in kernel.headers))
    text, _, header_texts, _ = source_identity(Path(kernels_dir), kernel.source, search)
    # the source and any source it includes (.cu), each cut to the kernel's entries it
    # defines, where they define them all between them (else whole: the compiler then reports
    # the missing one)
    sources = {n for n in header_texts if n.endswith(".cu")}
    defined = set(entry_names(text)).union(*(entry_names(header_texts[n]) for n in sources))
    if not cut or not defined >= set(kernel.entries):
        return text, header_texts
    return keep_included_entries(text, kernel.entries), {
        n: keep_included_entries(h, kernel.entries) if n in sources else h
        for n, h in header_texts.items()}


def compile_kernels(kernels: Iterable[Kernel], arch: str, *, kernels_dir: Path | str,
                    cache: BuildCache, compute: ComputeTarget, progress: bool = True,
                    jobs: int | None = None, what: str = "kernels", cut: bool = True
                    ) -> dict[UnitKey, tuple[Binary | CompileError, str, float]]:
    """Compile each distinct unit of ``kernels`` (:func:`unit_key`, ``cut`` as it says) for
    ``arch`` through ``cache``, ``jobs`` at a time (default: every core), with a progress bar
    on a terminal: :func:`compile_batches` of one batch.

    Returns ``unit key → (binary or error, status, seconds)``; status is ``built``,
    ``cached`` or ``failed`` and seconds is the unit's own compile time (0 when cached).
    """
    return compile_batches([kernels], arch, kernels_dir=kernels_dir, cache=cache,
                           compute=compute, progress=progress, jobs=jobs, what=what, cut=cut)


def compile_batches(batches: Iterable[Iterable[Kernel]], arch: str, *, kernels_dir: Path | str,
                    cache: BuildCache, compute: ComputeTarget, progress: bool = True,
                    jobs: int | None = None, what: str = "kernels", cut: bool = True,
                    meanwhile: Callable[[], None] | None = None
                    ) -> dict[UnitKey, tuple[Binary | CompileError, str, float]]:
    """:func:`compile_kernels` over batches of kernels that may still be in the making: each
    batch's new units start compiling (longest first) before the next batch is asked for, so
    that a caller making its batches (an engine planning its steps) works while the compilers,
    separate processes, run; ``meanwhile``, called once every batch is on its way and before
    the compiles are waited for, is more of the caller's work done beside them (an engine's
    weights copied to the device). Ctrl-C, or ``meanwhile`` raising, stops every running
    compiler at once (:func:`metrale.realize.jobs.interrupt`), drops the queued ones and
    re-raises."""
    version = compute.version()
    out: dict[UnitKey, tuple[Binary | CompileError, str, float]] = {}
    workers = max(1, jobs or os.cpu_count() or 1)
    pool: ThreadPoolExecutor | None = None
    futures: dict[Any, tuple[UnitKey, Kernel]] = {}
    seen: set[UnitKey] = set()  # units cached, built or on their way

    def one(k: Kernel, text: str, defs: dict, headers: dict, ckey: str
            ) -> tuple[Binary, float]:
        t0 = time.perf_counter()
        extra = {"headers": headers} if headers else {}
        b = compute.compile(text, arch, defs, name=Path(k.source).stem, **extra)
        cache.put(ckey, b)  # a failed compile raises first: nothing is stored for it
        return b, time.perf_counter() - t0

    def collect(done: Iterable[Any], bar: Any) -> None:
        for fut in done:
            key, k = futures.pop(fut)
            try:
                binary, seconds = fut.result()
                out[key] = (binary, BUILT, seconds)
            except CompileError as e:
                out[key] = (e, FAILED, 0.0)
            bar.advance(Path(k.source).name)

    try:
        with _progress(progress, f"compiling {what} ({workers} jobs)") as bar:
            for batch in batches:
                units: dict[UnitKey, Kernel] = {}
                for k in batch:
                    key = unit_key(k, cut)
                    if key not in seen:
                        seen.add(key)
                        units[key] = k
                misses = []
                for key, k in units.items():
                    text, headers = unit_source(kernels_dir, k, cut)
                    defs = k.define_map()
                    ckey = cache_key(text, defs, arch, version, None, headers)
                    hit = cache.get(ckey)
                    if hit is None:
                        misses.append((key, k, text, defs, headers, ckey))
                    else:
                        out[key] = (hit, CACHED, 0.0)
                # longest first (by source size, the best guess before any timing): the last
                # compile to start is a short one, so the cores finish together
                misses.sort(key=lambda m: -(len(m[2]) + sum(map(len, m[4].values()))))
                if misses and pool is None:
                    pool = ThreadPoolExecutor(max_workers=workers,
                                              thread_name_prefix="metrale-compile")
                bar.grow(len(misses))
                for key, k, text, defs, headers, ckey in misses:
                    futures[pool.submit(one, k, text, defs, headers, ckey)] = (key, k)
                collect([f for f in futures if f.done()], bar)
            if meanwhile is not None:
                meanwhile()
            while futures:
                # a short wait, not one until a compile ends: the main thread then runs Python's
                # SIGINT handler within a quarter second, even when the signal reached a
                # compile thread and left the main thread's wait asleep
                done, _ = wait(set(futures), timeout=0.25, return_when=FIRST_COMPLETED)
                collect(done, bar)
    except BaseException:
        # Ctrl-C (or any failure of the loop itself): stop the compilers now, not after the
        # queue has drained, and leave no scratch folder behind.
        if pool is not None:
            _jobs.interrupt()
            try:
                pool.shutdown(wait=True, cancel_futures=True)
            finally:
                _jobs.resume()
        raise
    if pool is not None:
        pool.shutdown(wait=True)
    return out


def build(points: Iterable[Point], hw: str, *, target: KernelTarget,
          kernels_dir: Path | str | None = None, cache: BuildCache | None = None,
          registry: Registry | None = None, progress: bool = True,
          compute: ComputeTarget | None = None, output: str = "cubin",
          jobs: int | None = None, cut: bool = True) -> BuildReport:
    """Compile every realized point's kernel for ``hw`` ahead of time.

    ``compute`` overrides the compiler (default: the vendor's, ``NvidiaTarget(output)``
    for NVIDIA, cubins so nothing is compiled just in time); ``jobs`` caps the parallel
    compiles (default: the CPU count); ``cut``: each kernel's unit is its source cut to its
    entries, as the runtime loader compiles it (else one unit per source and defines, every
    entry in it).
    """
    t0 = time.perf_counter()
    F = realization(hw, kernels_dir=kernels_dir, target=target)
    todo = sorted(set(points))
    kernels = {p: F.realize(p) for p in todo}
    missing = [BuildItem(p, NOT_REALIZED, error=F.why_not(p))
               for p, k in kernels.items() if k is None]
    found = {p: k for p, k in kernels.items() if k is not None}
    if F.by_semantics:
        return _build_host(F, target, found, missing, registry, t0)
    arch = F.hw.arch
    if arch is None:
        below = ", ".join(c.name for c in _descendants(F))
        raise ConfigError(f"class {F.name} has no arch of its own: its sources compile for the "
                          "class that inherits it; build for a descendant class",
                          key="hardware", expected="one of " + (below or "a descendant"),
                          found=F.name)
    compute = compute if compute is not None else NvidiaTarget(output)
    available = compute.available()
    if not available:
        raise CompileError(f"cannot build {target}: {available.reason}")
    cache = cache if cache is not None else BuildCache()
    version = compute.version()
    units: dict[UnitKey, list[Kernel]] = {}
    for k in found.values():
        units.setdefault(unit_key(k, cut), []).append(k)
    plan = [_Unit(s, d, e, arch, tuple(ks)) for (s, d, e), ks in
            sorted(units.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or ()))]
    done = compile_kernels(found.values(), arch, kernels_dir=F.kernels_dir, cache=cache,
                           compute=compute, progress=progress, jobs=jobs, what=str(target),
                           cut=cut)
    results = {u: done[u.key][0] for u in plan}
    status = {u: done[u.key][1] for u in plan}
    seconds = {u: done[u.key][2] for u in plan}
    items, errors = list(missing), []
    for u in plan:
        got = results[u]
        if isinstance(got, CompileError):
            errors.append(got)
            items += [BuildItem(k.point, FAILED, k, error=str(got)) for k in u.kernels]
            continue
        compiled = status[u]
        code = cubin_code_bytes(got.data) if got.format == "cubin" else {}
        for k in u.kernels:
            if k.entry in got.entries:
                items.append(BuildItem(k.point, compiled, k, got.sha256,
                                       code_bytes=code.get(k.entry),
                                       compile_s=seconds[u]))
                continue
            # The binary is sound (others may use it), but this kernel cannot launch from it.
            err = CompileError(f"{u.label}: entry {k.entry!r} is not exported", file=u.source,
                               key=k.entry, expected="one of " + (", ".join(got.entries)
                                                                  or "none"), found=k.entry)
            errors.append(err)
            items.append(BuildItem(k.point, FAILED, k, error=str(err)))
            status[u] = FAILED
    items.sort(key=lambda i: i.point)
    report = BuildReport(target, F.name, arch, version, tuple(items),
                         tuple(BuildUnit(u.label, status[u], seconds[u]) for u in plan), 0.0,
                         None, tuple(errors), jobs=jobs or os.cpu_count() or 1)
    written = None
    if registry is not None and report.ok:
        binaries = {str(k.point): (k.entry, results[u]) for u in plan for k in u.kernels}
        written = str(registry.add(target, binaries).path)
    return attrs.evolve(report, seconds=time.perf_counter() - t0, registry=written)


def _descendants(F: Realization) -> list[Any]:
    from metrale.realize.hardware import load_hardware

    return list(load_hardware(F.kernels_dir).descendants(F.name))


def _build_host(F: Realization, target: KernelTarget, found: dict[Point, Kernel],
                missing: list[BuildItem], registry: Registry | None, t0: float) -> BuildReport:
    from metrale.lkb.semantics import SEMANTICS

    host = HostTarget()
    items = list(missing)
    binaries = {}
    for p, k in found.items():
        fn = SEMANTICS[k.entry]
        b = host.compile(f"{fn.__module__}:{fn.__name__}", "host", {}, name=k.entry,
                         entry=fn.__name__)
        binaries[str(p)] = (fn.__name__, b)
        items.append(BuildItem(p, HOST, k, b.sha256))
    items.sort(key=lambda i: i.point)
    report = BuildReport(target, F.name, None, host.version(), tuple(items), (), 0.0)
    written = None
    if registry is not None and report.ok:
        written = str(registry.add(target, binaries).path)
    return attrs.evolve(report, seconds=time.perf_counter() - t0, registry=written)


class _progress:
    """A rich progress bar over the binaries, on stderr and only when it is a terminal (a
    no-op otherwise); yields an object with ``advance(name)``, which also shows the last binary
    done, and ``grow(n)``, which adds ``n`` binaries to the total."""

    def __init__(self, enabled: bool, what: str) -> None:
        self.enabled, self.total, self.what = enabled, 0, what
        self.bar: Any = None
        self.task: Any = None

    def __enter__(self) -> _progress:
        from rich.console import Console

        console = Console(stderr=True)
        if not self.enabled or not console.is_terminal:
            return self
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(), TimeRemainingColumn(),
                            TextColumn("{task.fields[last]}"), console=console,
                            transient=True)
        self.bar.__enter__()
        self.task = self.bar.add_task(self.what, total=self.total, last="")
        return self

    def advance(self, name: str = "") -> None:
        if self.bar is not None:
            self.bar.advance(self.task)
            self.bar.update(self.task, last=name)

    def grow(self, n: int) -> None:
        self.total += n
        if self.bar is not None:
            self.bar.update(self.task, total=self.total)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
