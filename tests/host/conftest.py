"""Fixtures of the host tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

TEST_CACHE_ENV = "METRALE_TEST_CACHE"
"""Where the NVIDIA builds of the test run are cached across runs: a folder, or ``off`` for a
fresh cache every run (default: ``test-builds/`` in the user's build cache folder)."""


def nvidia_group(hw: str) -> pytest.MarkDecorator:
    """The ``xdist_group`` of the tests that read class ``hw``'s build: one group per class, so
    ``--dist loadgroup`` builds each class once, on one worker, and the classes spread over the
    workers (one group for them all ran every NVIDIA compile of the run on one worker)."""
    return pytest.mark.xdist_group(f"nvidia-{hw}")


def run_build_cache(fallback: Path) -> Path:
    """The build cache folder of the run's NVIDIA builds: ``$METRALE_TEST_CACHE``, else
    ``test-builds/`` in the user's build cache (content-addressed by source, headers, defines,
    arch, compiler version and flags, and safe with concurrent writers, so a second run, or
    another worker, compiles only what changed); ``fallback`` (the run's own) when that is
    ``off``."""
    from metrale.realize.cache import default_cache_root

    chosen = os.environ.get(TEST_CACHE_ENV)
    if chosen == "off":
        return fallback
    return Path(chosen).expanduser() if chosen else default_cache_root() / "test-builds"


def compile_jobs() -> int:
    """Compiles one worker runs at once: the cores shared among the xdist workers."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    return max(1, (os.cpu_count() or 1) // workers)


def run_temp(tmp_path_factory) -> Path:
    """The run's own temporary folder, which its xdist workers share (each worker's base
    temporary folder is inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory) -> Path:
    """The folder of emulation builds (tests/host/simt), shared by the run's workers and kept
    across runs (``simt/`` in :func:`run_build_cache`): a kernel source built with one define set
    serves every test that runs it, on any worker, and is built again only when its inputs
    change (each library is keyed by them and built under a lock by the first worker that needs
    it)."""
    return run_build_cache(run_temp(tmp_path_factory) / "cache") / "simt"


MEASURED_CLASS = "sm_90"
"""The NVIDIA class whose kernels the shipped evidence measures: the default tier builds its every
compile unit."""


class Unit:
    """One compile of the run's NVIDIA build: a source at one define set, cut to every entry the
    class's points launch from it there (the union of those kernels' entries). The build and the
    runtime loader compile each kernel's own cut (:func:`metrale.realize.build.unit_source`);
    this is their union, so every entry a point of the class can launch compiles, and no entry
    that none can: compiling each source whole took twice as long (sm_90: 245 s of a 2-core
    run's 700). Quacks as the kernel :func:`metrale.realize.build.compile_kernels` takes."""

    def __init__(self, kernels: list) -> None:
        first = kernels[0]
        self.point, self.source, self.defines = first.point, first.source, first.defines
        self.headers, self.define_map = first.headers, first.define_map
        self.entries = tuple(sorted({e for k in kernels for e in k.entries}))


class ClassBuild:
    """What the run's build of one class gave: ``(source, defines) → (PTX text or the
    CompileError, status)``, status ``built`` or ``cached`` (or ``failed``), and the units'
    entries."""

    def __init__(self, arch: str, done: dict, units: dict) -> None:
        self.arch = arch
        self.results = {key: (got, status) for key, (got, status, _) in done.items()}
        self.units = units

    @property
    def errors(self) -> list:
        return [got for got, status in self.results.values() if status == "failed"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def count(self, status: str) -> int:
        return sum(s == status for _, s in self.results.values())


class NvidiaBuilds:
    """NVIDIA classes' realized points built to PTX once for the whole run, with the machine's
    nvcc, the production compile (``realize.build.compile_kernels``) of its units (:class:`Unit`):
    the build tests check each class's result, the source tests read the PTX of each (source,
    define set). Sharing it keeps each unit to one compile per run (and, through
    :func:`run_build_cache`, to one compile until its inputs change): nvcc takes 0.4–1.5 s a
    unit here, and a class has about 100.

    Which units (:meth:`kernels`): every one of :data:`MEASURED_CLASS`, and of every class in the
    full tier (``--full``: some 700 compiles); in the default tier every other class compiles
    each of its sources once, with one of the source's define sets, rotating over the classes so
    that together they compile several of each source's sets (a compile error guarded by an
    arch shows with any define set; one guarded by a define, on sm_90). :meth:`ptx_of` builds
    one more unit on demand."""

    def __init__(self, root: Path, full: bool) -> None:
        from metrale.realize.cache import BuildCache

        self.cache_root = run_build_cache(root / "cache")
        self.cache = BuildCache(self.cache_root)
        self.full = full
        self._builds: dict = {}
        self._ptx: dict = {}

    def kernels(self, hw: str) -> list:
        """The realized kernels the run builds for class ``hw``: one per compile unit (source,
        defines), the first point's by point order."""
        from metrale.realize.functor import realization
        from metrale.realize.hardware import load_hardware

        units: dict = {}
        for k in sorted(realization(hw).kernels(), key=lambda k: str(k.point)):
            units.setdefault((k.source, k.defines), k)
        if self.full or hw == MEASURED_CLASS:
            return list(units.values())
        others = sorted(c.name for c in load_hardware() if c.vendor.value == "nvidia"
                        and c.arch is not None and c.name != MEASURED_CLASS)
        turn = others.index(hw) if hw in others else 0
        by_source: dict = {}
        for (source, _), k in sorted(units.items()):
            by_source.setdefault(source, []).append(k)
        return [ks[turn % len(ks)] for _, ks in sorted(by_source.items())]

    def report(self, hw: str) -> ClassBuild:
        """The build of class ``hw``'s units (:meth:`kernels`)."""
        if hw not in self._builds:
            self._builds[hw] = self._build(hw, [self.key(k.source, k.defines)
                                                for k in self.kernels(hw)])
        return self._builds[hw]

    def _build(self, hw: str, keys: list) -> ClassBuild:
        """Build the units of ``keys`` of class ``hw``, one worker at a time per class: the
        ``xdist_group`` of :func:`nvidia_group` keeps a class's tests on one worker, and where it
        does not (a pytest that xdist's grouping misses), the second worker waits for the first
        and finds its compiles in the shared cache instead of compiling them again."""
        from metrale.lkb.files import exclusive
        from metrale.realize.build import compile_kernels
        from metrale.realize.compute import NvidiaTarget
        from metrale.realize.functor import realization

        F, wanted = realization(hw), set(keys)
        grouped: dict = {}
        for k in F.kernels():
            if (key := self.key(k.source, k.defines)) in wanted:
                grouped.setdefault(key, []).append(k)
        units = {key: Unit(ks) for key, ks in grouped.items()}
        assert set(units) == wanted, (hw, "realizes no point at", sorted(wanted - set(units)))
        self.cache_root.mkdir(parents=True, exist_ok=True)
        with exclusive(self.cache_root / f".nvidia-{hw}.lock"):
            done = compile_kernels(units.values(), F.hw.arch, kernels_dir=F.kernels_dir,
                                   cache=self.cache, compute=NvidiaTarget("ptx"),
                                   progress=False, jobs=compile_jobs())
        return ClassBuild(F.hw.arch, {self.key(s, d): got for (s, d, _), got in done.items()},
                          units)

    def ptx(self, hw: str) -> dict[tuple[str, tuple[str, ...]], str]:
        """(source file name, sorted defines without ``-D``) → the PTX class ``hw`` built."""
        if hw not in self._ptx:
            self._ptx[hw] = self._load(self.report(hw))
        return self._ptx[hw]

    def ptx_of(self, hw: str, source: str, defines) -> str:
        """The PTX of one unit of class ``hw`` (``source`` and ``defines`` as :meth:`key`
        takes them), built now if the class's units (:meth:`kernels`) left it out."""
        built, key = self.ptx(hw), self.key(source, defines)
        if key not in built:
            built.update(self._load(self._build(hw, [key])))
        return built[key]

    @staticmethod
    def _load(build: ClassBuild) -> dict[tuple[str, tuple[str, ...]], str]:
        assert build.ok, "\n".join(str(e) for e in build.errors)
        return {key: got.data.decode() for key, (got, _) in build.results.items()}

    @staticmethod
    def key(source: str, defines) -> tuple[str, tuple[str, ...]]:
        """A unit's key in :meth:`ptx`: ``("cuda/common/gemv.cu", ("-DACT_BF16",))`` and
        ``("gemv.cu", ("ACT_BF16",))`` alike give ``("gemv.cu", ("ACT_BF16",))``."""
        return source.rsplit("/", 1)[-1], tuple(sorted(d.removeprefix("-D") for d in defines))


@pytest.fixture(scope="session")
def nvidia_builds(tmp_path_factory, request) -> NvidiaBuilds:
    """The run's one PTX build of the NVIDIA classes (:class:`NvidiaBuilds`)."""
    from tests.conftest import full_tier

    return NvidiaBuilds(tmp_path_factory.mktemp("nvidia"), full_tier(request.config))


def run_met(argv: list[str]) -> tuple[int, str]:
    """``met *argv`` in this process: its exit status (a ``SystemExit`` that carries no int,
    such as a message, counts as 2, argparse's) and its stdout and stderr together."""
    import contextlib
    import io

    from metrale import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = cli.main(argv)
        except SystemExit as e:
            status = e.code if isinstance(e.code, int) else 0 if e.code is None else 2
    return status, out.getvalue() + err.getvalue()
