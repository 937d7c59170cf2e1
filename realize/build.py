"""The build: Sources → Binaries for the points a plan uses, through the cache, into the registry.

``build(points, hw, target=...)`` realizes each point on ``hw`` (F_H), groups the kernels that
compile to one binary (same source, defines and arch), and compiles each group once through
the content-addressed :class:`BuildCache` (groups in parallel, one per core). A compile
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
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import CompileError, ConfigError
from metrale.lkb.family import Point
from metrale.lkb.target import KernelTarget
from metrale.realize.cache import BuildCache, cache_key
from metrale.realize.compute import (
    Binary,
    ComputeTarget,
    HostTarget,
    NvidiaTarget,
    cubin_code_bytes,
)
from metrale.realize.functor import Realization, realization
from metrale.realize.kernel import Kernel
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


@attrs.frozen
class BuildReport:
    """What a build did: per point, and per compiled binary (``units``: distinct (source,
    defines, arch) groups, each ``built``, ``cached`` or ``failed``); the seconds it took."""

    target: KernelTarget
    hw: str
    arch: str | None
    compiler: str
    items: tuple[BuildItem, ...]
    units: tuple[tuple[str, str], ...]
    """``(unit label, status)`` for each distinct binary."""
    seconds: float
    registry: str | None = None
    """The summand folder written, or ``None`` (no registry given, or the build failed)."""
    errors: tuple[CompileError, ...] = attrs.field(default=(), eq=False)

    def count(self, status: str) -> int:
        """Binaries (built, cached, failed) or points (not realized, host) with ``status``."""
        if status in (BUILT, CACHED, FAILED):
            return sum(s == status for _, s in self.units)
        return sum(i.status == status for i in self.items)

    def counts(self) -> dict[str, int]:
        return {s: self.count(s) for s in STATUSES}

    @property
    def ok(self) -> bool:
        """Every point realized and every binary built or cached."""
        return not self.count(FAILED) and not self.count(NOT_REALIZED)

    @property
    def host_entries(self) -> tuple[str, ...]:
        """The semantics names of a host build (nothing was compiled)."""
        return tuple(sorted({i.kernel.entry for i in self.items
                             if i.status == HOST and i.kernel is not None}))

    def summary(self) -> str:
        c = self.counts()
        parts = [f"{c[s]} {s}" for s in STATUSES if c[s] or s in (BUILT, CACHED, FAILED)]
        return (f"build {self.target}: {len(self.items)} points, " + ", ".join(parts)
                + f" in {self.seconds:.2f} s ({self.compiler})")

    def table(self) -> Any:
        """A rich table: one row per point."""
        from rich.table import Table

        t = Table(title=self.summary())
        for col in ("point", "status", "kernel", "code", "detail"):
            t.add_column(col, justify="right" if col == "code" else "left")
        for i in self.items:
            kernel = "" if i.kernel is None else f"{i.kernel.entry} ({i.kernel.provenance})"
            detail = i.error.splitlines()[0] if i.error else (i.sha256 or "")[:16]
            code = "" if i.code_bytes is None else f"{i.code_bytes / 1024:.1f} KB"
            t.add_row(str(i.point), i.status, kernel, code, detail)
        return t

    def to_json(self) -> dict[str, Any]:
        return {"target": str(self.target), "hardware": self.hw, "arch": self.arch,
                "compiler": self.compiler, "seconds": self.seconds, "counts": self.counts(),
                "registry": self.registry,
                "items": [{"point": str(i.point), "status": i.status, "sha256": i.sha256,
                           "kernel": None if i.kernel is None else i.kernel.key,
                           "code_bytes": i.code_bytes, "error": i.error} for i in self.items]}


@attrs.frozen
class _Unit:
    source: str
    defines: tuple[str, ...]
    arch: str
    kernels: tuple[Kernel, ...]

    @property
    def label(self) -> str:
        return f"{self.source} [{' '.join(self.defines)}] for {self.arch}"


def build(points: Iterable[Point], hw: str, *, target: KernelTarget,
          kernels_dir: Path | str | None = None, cache: BuildCache | None = None,
          registry: Registry | None = None, progress: bool = True,
          compute: ComputeTarget | None = None, output: str = "cubin",
          jobs: int | None = None) -> BuildReport:
    """Compile every realized point's kernel for ``hw`` ahead of time.

    ``compute`` overrides the compiler (default: the vendor's, ``NvidiaTarget(output)``
    for NVIDIA, cubins so nothing is compiled just in time); ``jobs`` caps the parallel
    compiles (default: the CPU count).
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
    units: dict[tuple[str, tuple[str, ...]], list[Kernel]] = {}
    for k in found.values():
        units.setdefault((k.source, k.defines), []).append(k)
    plan = [_Unit(s, d, arch, tuple(ks)) for (s, d), ks in sorted(units.items())]
    results: dict[_Unit, Binary | CompileError] = {}
    status: dict[_Unit, str] = {}
    with _progress(progress, len(plan), str(target)) as advance:
        misses = []
        for u in plan:
            text, _, header_texts, _ = F.source(u.source)
            defs = u.kernels[0].define_map()
            hit = cache.get(cache_key(text, defs, arch, version, None, header_texts))
            if hit is None:
                misses.append((u, text, defs, header_texts))
            else:
                results[u], status[u] = hit, CACHED
                advance()
        if misses:
            with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
                futures = {pool.submit(cache.build, compute, text, arch, defs,
                                       Path(u.source).stem, None, header_texts): u
                           for u, text, defs, header_texts in misses}
                for fut in as_completed(futures):
                    u = futures[fut]
                    try:
                        results[u], status[u] = fut.result(), BUILT
                    except CompileError as e:
                        results[u], status[u] = e, FAILED
                    advance()
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
                                       code_bytes=code.get(k.entry)))
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
                         tuple((u.label, status[u]) for u in plan), 0.0, None, tuple(errors))
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
    """A rich progress bar over the binaries (a no-op when disabled); yields ``advance``."""

    def __init__(self, enabled: bool, total: int, what: str) -> None:
        self.enabled, self.total, self.what = enabled, total, what
        self.bar: Any = None

    def __enter__(self) -> Any:
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self.bar = Progress("[progress.description]{task.description}", BarColumn(),
                            MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task(f"building {self.what}", total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)
