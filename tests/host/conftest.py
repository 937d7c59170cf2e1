"""Fixtures of the host tier."""

from __future__ import annotations

import pytest


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
    each (source, defines, arch) to one compile per run: nvcc takes 1.5–2.5 s a unit here, and
    a class has about 80."""

    def __init__(self, root) -> None:
        from metrale.realize.cache import BuildCache
        from metrale.realize.registry import Registry

        self.cache = BuildCache(root / "cache")
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
                registry=self.registry, progress=False, compute=NvidiaTarget("ptx"), jobs=2)
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
