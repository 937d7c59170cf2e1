"""The registry as a coproduct of per-target summands, and the build that writes it (with a fake
compiler, so the logic is tested without nvcc: dedupe, cache, failures, atomic summands)."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

import pytest

from metrale.lkb.errors import CacheError, CompileError, ConfigError
from metrale.lkb.presentation import Presentation
from metrale.lkb.target import KernelTarget
from metrale.lkb.vendor import Vendor
from metrale.realize.build import build, unit_key
from metrale.realize.cache import BuildCache, cache_key
from metrale.realize.compute import Availability, Binary, HostTarget
from metrale.realize.functor import realization
from metrale.realize.hardware import default_kernels_dir
from metrale.realize.registry import MANIFEST, Registry
from metrale.testing import coproduct_laws

P = Presentation.load()
A = KernelTarget("sm_90", "qwen3-0.6b", "bf16")
B = KernelTarget("sm_90", "llama-3.1-8b", "bf16")
C = KernelTarget("sm_80", "qwen3-0.6b", "bf16")


class FakeNvidia:
    """A compiler that "compiles" to a PTX-like text listing the source's extern "C" kernels;
    a source containing ``BROKEN`` fails. Counts its compiles."""

    vendor = Vendor.NVIDIA
    source_extension = ".cu"
    output_extension = ".ptx"
    output_is_text = True

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    def available(self) -> Availability:
        return Availability(True, "fake")

    def version(self) -> str:
        return "fake 1.0"

    def compile(self, source: str, arch: str, defines: Mapping[str, str | int], *, name: str,
                entry: str | None = None, headers: Mapping[str, str] | None = None) -> Binary:
        self.calls.append((name, tuple(sorted(f"{k}={v}" for k, v in defines.items()))))
        if "BROKEN" in source:
            raise CompileError(f"fake: {name}.cu does not compile", file=f"{name}.cu")
        entries = re.findall(r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?'
                             r'(\w+)\s*\(', source)
        text = f"// {arch} {sorted(defines.items())} {len(headers or {})} headers\n" + "".join(
            f".visible .entry {e}(\n" for e in entries)
        return Binary(text.encode(), arch, entries, "ptx", self.version())


def points(*families: str, act: str = "bf16") -> list:
    out = []
    for name in families:
        for p in P.family(name).points:
            params = dict(p.params)
            if params.get("act", act) == act and params.get("weight", "bf16") == "bf16":
                out.append(p)
    return out


def tree_hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), root,
                    ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    return root


# ------------------------------------------------------------------------------ registry


def fake_binary(entry: str, arch: str = "sm_90a", tag: str = "") -> Binary:
    return Binary(f".visible .entry {entry}( // {tag}".encode(), arch, [entry], "ptx", "fake")


def test_summands_inject_and_load(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    assert reg.summands() == ()
    a = reg.add(A, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add"))})
    reg.add(C, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add", "sm_80"))})
    assert reg.summands() == (C, A)  # sorted by (hw, model, quant)
    assert a.points == ("add[act=bf16]",)
    b = reg.inject(A).load("add[act=bf16]")
    assert b.data == fake_binary("metrale_add").data and b.entries == ("metrale_add",)
    manifest = json.loads((reg.path(A) / MANIFEST).read_text())
    e = manifest["kernels"]["add[act=bf16]"]
    assert set(e) == {"file", "entry", "sha256", "arch", "compiler", "format"}
    assert e["arch"] == "sm_90a" and e["sha256"] == b.sha256
    coproduct_laws(reg.coproduct())
    # nothing temporary is left behind (the writers' lock files stay, empty)
    assert not [p for p in (tmp_path / "reg").rglob(".*") if not p.name.endswith(".lock")]
    assert all(p.stat().st_size == 0 for p in (tmp_path / "reg").rglob(".*.lock"))


def test_adding_a_target_leaves_every_other_summand_byte_identical(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(A, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add"))})
    reg.add(C, {"argmax[]": ("metrale_argmax", fake_binary("metrale_argmax", "sm_80"))})
    before = tree_hashes(reg.path(A)), tree_hashes(reg.path(C))
    reg.add(B, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add", tag="B"))})
    reg.add(B, {"add[act=f32]": ("metrale_add", fake_binary("metrale_add", tag="B2"))})
    assert (tree_hashes(reg.path(A)), tree_hashes(reg.path(C))) == before
    assert reg.inject(B).points == ("add[act=f32]",)  # a summand is replaced whole


def test_a_failed_add_keeps_the_previous_summand(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    reg.add(A, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add"))})
    before = tree_hashes(reg.path(A))
    with pytest.raises(CacheError, match="does not export 'metrale_rmsnorm'"):
        reg.add(A, {"rmsnorm[act=bf16,h_block=256]": ("metrale_rmsnorm",
                                                      fake_binary("metrale_add"))})
    assert tree_hashes(reg.path(A)) == before


def test_damaged_or_missing_summands_are_errors(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    s = reg.add(A, {"add[act=bf16]": ("metrale_add", fake_binary("metrale_add"))})
    with pytest.raises(CacheError, match="no summand for sm_90/llama-3.1-8b/bf16"):
        reg.inject(B)
    with pytest.raises(CacheError, match="no kernel for add.act=f32. .*did you mean"):
        s.load("add[act=f32]")
    binary = s.path / s.entry("add[act=bf16]").file
    binary.write_bytes(binary.read_bytes() + b"!")
    with pytest.raises(CacheError, match="does not match its manifest hash"):
        s.load("add[act=bf16]")
    with pytest.raises(ConfigError, match="plain folder name"):
        reg.path(KernelTarget("sm_90", "../escape", "bf16"))


# --------------------------------------------------------------------------------- build


def test_build_dedupes_caches_and_writes_the_summand(tmp_path: Path) -> None:
    fake = FakeNvidia()
    cache, reg = BuildCache(tmp_path / "cache"), Registry(tmp_path / "reg")
    pts = points("embedding", "add", "swiglu", "rmsnorm", "linear")
    cold = build(pts, "sm_90", target=A, cache=cache, registry=reg, progress=False,
                 compute=fake)
    assert cold.ok and cold.count("built") == len(fake.calls) and cold.count("cached") == 0
    # one compile per distinct unit (source, defines, entries), none twice
    units = {unit_key(i.kernel) for i in cold.items}
    assert len(fake.calls) == len(units) <= len(pts)
    summand = reg.inject(A)
    assert set(summand.points) == {str(p) for p in pts}
    for i in cold.items:
        b = summand.load(str(i.point))
        assert i.kernel.entry in b.entries and b.sha256 == i.sha256 and b.arch == "sm_90a"
    warm = build(pts, "sm_90", target=A, cache=BuildCache(tmp_path / "cache"), registry=reg,
                 progress=False, compute=fake)
    assert warm.ok and warm.count("built") == 0 and warm.count("cached") == cold.count("built")
    assert len(fake.calls) == cold.count("built")  # nothing compiled again
    assert [i.sha256 for i in warm.items] == [i.sha256 for i in cold.items]


def test_a_compile_error_is_recorded_and_the_others_build(tree: Path, tmp_path: Path) -> None:
    rope = tree / "cuda" / "common" / "rope.cu"
    rope.write_text(rope.read_text() + "\nBROKEN\n")
    fake, cache, reg = FakeNvidia(), BuildCache(tmp_path / "cache"), Registry(tmp_path / "reg")
    pts = points("rope", "rmsnorm", "add")
    report = build(pts, "sm_90", target=A, kernels_dir=tree, cache=cache, registry=reg,
                   progress=False, compute=fake)
    assert not report.ok and report.registry is None and reg.summands() == ()
    failed = [i for i in report.items if i.status == "failed"]
    assert {i.point.family for i in failed} == {"rope"}
    assert all("does not compile" in i.error for i in failed)
    assert {i.point.family for i in report.items if i.status == "built"} == {"rmsnorm", "add"}
    assert report.count("failed") == len({i.kernel.defines for i in failed})
    assert len(report.errors) == report.count("failed")
    # nothing is cached for the failed binaries
    F = realization("sm_90", kernels_dir=tree, target=A)
    for i in failed:
        text, _, headers, _ = F.source(i.kernel.source)
        key = cache_key(text, i.kernel.define_map(), "sm_90a", fake.version(), None, headers)
        assert cache.get(key) is None


def test_an_entry_the_binary_lacks_fails_that_kernel(tree: Path, tmp_path: Path) -> None:
    toml = tree / "cuda" / "common" / "KERNELS.toml"
    toml.write_text(toml.read_text().replace('entry = "metrale_argmax"',
                                             'entry = "metrale_argmax_v2"'))
    report = build(points("argmax", "add"), "sm_90", target=A, kernels_dir=tree,
                   cache=BuildCache(tmp_path / "c"), progress=False, compute=FakeNvidia())
    bad = [i for i in report.items if i.status == "failed"]
    assert [str(i.point) for i in bad] == ["argmax[]"]
    assert "entry 'metrale_argmax_v2' is not exported" in bad[0].error
    assert "metrale_argmax" in bad[0].error  # what the binary does export
    assert not report.ok


def test_building_a_target_never_touches_another_summand(tmp_path: Path) -> None:
    cache, reg = BuildCache(tmp_path / "cache"), Registry(tmp_path / "reg")
    build(points("add", "rmsnorm"), "sm_90", target=A, cache=cache, registry=reg,
          progress=False, compute=FakeNvidia())
    build(points("add"), "sm_80", target=C, cache=cache, registry=reg, progress=False,
          compute=FakeNvidia())
    before = tree_hashes(reg.path(A)), tree_hashes(reg.path(C))
    report = build(points("linear", "argmax"), "sm_90", target=B, cache=cache, registry=reg,
                   progress=False, compute=FakeNvidia())
    assert report.ok and report.registry == str(reg.path(B))
    assert (tree_hashes(reg.path(A)), tree_hashes(reg.path(C))) == before
    assert reg.summands() == (C, B, A)
    coproduct_laws(reg.coproduct())


def test_not_realized_points_are_reported(tree: Path, tmp_path: Path) -> None:
    toml = tree / "cuda" / "common" / "KERNELS.toml"
    toml.write_text(toml.read_text().replace('entry = "metrale_argmax"\n',
                                             'entry = "metrale_argmax"\nrequires = ["fp4"]\n'))
    report = build(points("argmax", "add"), "sm_90", target=A, kernels_dir=tree,
                   cache=BuildCache(tmp_path / "c"), progress=False, compute=FakeNvidia())
    missing = [i for i in report.items if i.status == "not realized"]
    assert [str(i.point) for i in missing] == ["argmax[]"]
    assert "requires fp4, which sm_90 lacks" in missing[0].error
    assert not report.ok and report.count("not realized") == 1


def test_the_common_layer_is_not_buildable_alone(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no arch of its own.*sm_100"):
        build(points("add"), "cuda", target=KernelTarget("cuda", "m", "bf16"),
              cache=BuildCache(tmp_path), progress=False, compute=FakeNvidia())


def test_host_build_records_the_semantics(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg")
    t = KernelTarget("host", "qwen3-0.6b", "bf16")
    report = build(points("attention", "lm_head"), "host", target=t, registry=reg,
                   progress=False)
    assert report.ok and report.host_entries == ("attention", "linear")
    b = reg.inject(t).load(str(points("lm_head")[0]))
    from metrale.lkb.semantics import linear

    assert HostTarget.load(b) is linear


# ------------------------------------------------------------- interrupted adds (issue 53)


class _Interrupt:
    """Raises ``KeyboardInterrupt`` at the ``at``-th file-system mutation (``os.replace``,
    ``os.rename``, ``os.unlink``, ``shutil.rmtree``) and lets the others through: an interrupt
    injected between any two steps of ``Registry.add``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int) -> None:
        import os

        self.at, self.seen = at, 0
        for module, name in ((os, "replace"), (os, "rename"), (os, "unlink"),
                             (shutil, "rmtree")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, self._wrap(real))

    def _wrap(self, real):
        def step(*args, **kwargs):
            self.seen += 1
            if self.seen == self.at:
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        return step


def test_an_interrupt_anywhere_in_add_leaves_the_old_summand_or_the_new(tmp_path: Path) -> None:
    """Fault injection: for every step k of replacing a summand, an interrupt at k leaves a
    summand that loads whole, the old one or the new one (never nothing: the old one must
    not be deleted before the new one is in place), and the next add collects the leftovers."""
    old = {f"add[act=f{i}]": ("metrale_add", fake_binary("metrale_add", tag=f"old{i}"))
           for i in range(3)}
    new = {f"add[act=f{i}]": ("metrale_add", fake_binary("metrale_add", tag=f"new{i}"))
           for i in range(1, 5)}

    def loaded(reg: Registry) -> dict[str, bytes]:
        s = reg.inject(A)
        return {p: s.load(p).data for p in s.points}

    want_old = {p: b.data for p, (_, b) in old.items()}
    want_new = {p: b.data for p, (_, b) in new.items()}
    outcomes = []
    for at in range(1, 40):
        reg = Registry(tmp_path / f"reg{at}")
        reg.add(A, old)
        with pytest.MonkeyPatch.context() as mp:
            fault = _Interrupt(mp, at)
            try:
                reg.add(A, new)
            except KeyboardInterrupt:
                interrupted = True
            else:
                interrupted = False
        got = loaded(reg)
        assert got in (want_old, want_new), at
        outcomes.append(got == want_new)
        reg.add(A, new)  # a clean add after the interrupted one: the new summand, nothing else
        assert loaded(reg) == want_new
        files = {p.name for p in reg.path(A).iterdir()}
        assert files == {MANIFEST} | {e.file for _, e in reg.inject(A).kernels}, at
        if not interrupted:
            assert fault.seen < at  # past the last step: every interrupt point was tried
            break
    else:
        raise AssertionError("Registry.add took more steps than the test tries")
    assert not outcomes[0] and outcomes[-1]  # both sides of the commit were hit


def test_a_checkpoint_folder_with_a_space_builds(tmp_path: Path) -> None:
    """Issue 53 item 8: the registry takes ``my model`` as a model coordinate."""
    t = KernelTarget("host", "my model", "bf16")
    reg = Registry(tmp_path / "reg")
    report = build(points("add"), "host", target=t, registry=reg, progress=False)
    assert report.ok and report.registry == str(tmp_path / "reg" / "host" / "my model" / "bf16")
    assert reg.summands() == (t,) and reg.inject(t).points == tuple(str(p) for p in points("add"))
    for bad in ("../x", "a/b", ".hidden", "trailing ", " leading", ""):
        with pytest.raises(ConfigError, match="plain folder name"):
            reg.path(KernelTarget("host", bad, "bf16"))


def test_each_batch_compiles_while_the_next_is_made(tmp_path: Path) -> None:
    """compile_batches starts a batch's compiles before it asks for the next batch (an engine
    plans its next step while the compilers run), compiles each unit once across batches, and
    gives every unit's result: here the second batch is not made until the first batch's
    compile has started, which fails if the batches were all made first."""
    import threading

    from metrale.realize.build import compile_batches, unit_key

    F = realization("sm_90")
    first = [F.realize(p) for p in points("rmsnorm")]
    second = [F.realize(p) for p in points("rmsnorm", "swiglu")]
    started = threading.Event()

    class Slow(FakeNvidia):
        def compile(self, *args, **kwargs):
            started.set()
            return super().compile(*args, **kwargs)

    fake = Slow()

    def batches():
        yield first
        assert started.wait(10), "the first batch's compile had not started"
        yield second

    done = compile_batches(batches(), "sm_90a", kernels_dir=default_kernels_dir(),
                           cache=BuildCache(tmp_path / "cache"), compute=fake, progress=False)
    units = {unit_key(k) for k in first + second}
    assert set(done) == units and len(fake.calls) == len(units)  # rmsnorm's once
    assert all(status == "built" for _, status, _ in done.values())


def test_meanwhile_runs_beside_the_compiles_and_stops_them_when_it_fails(tmp_path: Path) -> None:
    """compile_batches calls ``meanwhile`` once every batch's compiles are on their way and
    before it waits for them (an engine copies its weights to the device beside its
    compilers): here each compile waits for ``meanwhile`` to start, so a ``meanwhile`` called
    after the wait would deadlock (the compiles give up after ten seconds and fail the test).
    A ``meanwhile`` that raises stops the compiles and re-raises."""
    import threading

    from metrale.realize.build import compile_batches

    F = realization("sm_90")
    kernels = [F.realize(p) for p in points("rmsnorm", "swiglu")]
    beside = threading.Event()
    order: list[str] = []

    class Held(FakeNvidia):
        def compile(self, *args, **kwargs):
            assert beside.wait(10), "meanwhile did not run while the compiles were held"
            return super().compile(*args, **kwargs)

    def meanwhile() -> None:
        order.append("meanwhile")
        beside.set()

    fake = Held()
    done = compile_batches([kernels], "sm_90a", kernels_dir=default_kernels_dir(),
                           cache=BuildCache(tmp_path / "cache"), compute=fake, progress=False,
                           meanwhile=meanwhile)
    assert order == ["meanwhile"] and len(fake.calls) == len(done) > 1
    assert all(status == "built" for _, status, _ in done.values())

    def fails() -> None:
        raise RuntimeError("weights failed to copy")

    with pytest.raises(RuntimeError, match="weights failed"):
        compile_batches([kernels], "sm_90a", kernels_dir=default_kernels_dir(),
                        cache=BuildCache(tmp_path / "other"), compute=FakeNvidia(),
                        progress=False, meanwhile=fails)
