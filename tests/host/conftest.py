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


@pytest.fixture(scope="session")
def build_dir(tmp_path_factory):
    """One folder of emulation builds (tests/host/simt) for the whole run: a kernel source built
    with one define set serves every test module that runs it, the kernels' own tests and the
    whole-model ones alike."""
    return tmp_path_factory.mktemp("simt")


class NvidiaBuilds:
    """Every NVIDIA class's realized points built to PTX once for the whole run, through the
    production build (``realize.build``), with the machine's nvcc: the build tests check each
    class's report, the source tests read the PTX of each (source, define set). Sharing it keeps
    each (source, defines, arch) to one compile per run (and, through :func:`run_build_cache`,
    to one compile until its inputs change): nvcc takes 1.5–2.5 s a unit here, and a class has
    about 80."""

    def __init__(self, root) -> None:
        from metrale.realize.cache import BuildCache
        from metrale.realize.registry import Registry

        self.cache = BuildCache(run_build_cache(root / "cache"))
        self.registry = Registry(root / "registry")
        self._reports: dict = {}
        self._ptx: dict = {}

    def report(self, hw: str):
        """The build report of class ``hw``: every point its realization has a kernel for."""
        if hw not in self._reports:
            from metrale.lkb.target import KernelTarget
            from metrale.realize.build import build
            from metrale.realize.compute import NvidiaTarget
            from metrale.realize.functor import realization

            self._reports[hw] = build(
                [k.point for k in realization(hw).kernels()], hw,
                target=KernelTarget(hw, "all", "all"), cache=self.cache,
                registry=self.registry, progress=False, compute=NvidiaTarget("ptx"),
                jobs=compile_jobs())
        return self._reports[hw]

    def ptx(self, hw: str) -> dict[tuple[str, tuple[str, ...]], str]:
        """(source file name, sorted defines without ``-D``) → the PTX class ``hw`` built (read
        from the registry once)."""
        if hw in self._ptx:
            return self._ptx[hw]
        report = self.report(hw)
        assert report.ok, report.summary() + "".join(f"\n{e}" for e in report.errors)
        summand = self.registry.inject(report.target)
        out: dict[tuple[str, tuple[str, ...]], str] = {}
        for item in report.items:
            key = self.key(item.kernel.source, item.kernel.defines)
            if key not in out:
                out[key] = summand.load(str(item.point)).data.decode()
        self._ptx[hw] = out
        return out

    @staticmethod
    def key(source: str, defines) -> tuple[str, tuple[str, ...]]:
        """A unit's key in :meth:`ptx`: ``("cuda/common/gemv.cu", ("-DACT_BF16",))`` and
        ``("gemv.cu", ("ACT_BF16",))`` alike give ``("gemv.cu", ("ACT_BF16",))``."""
        return source.rsplit("/", 1)[-1], tuple(sorted(d.removeprefix("-D") for d in defines))


@pytest.fixture(scope="session")
def nvidia_builds(tmp_path_factory) -> NvidiaBuilds:
    """The run's one PTX build of every NVIDIA class (:class:`NvidiaBuilds`)."""
    return NvidiaBuilds(tmp_path_factory.mktemp("nvidia"))
