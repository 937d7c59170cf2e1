"""The compiled registry, a coproduct ∐ Binaries(H, M, q): one summand per target.

A summand is the folder ``<root>/<hw>/<model>/<quant>/``: ``manifest.json`` (each point →
binary file, entry, sha256, arch, compiler, format) and the binaries, named by their hash.
The manifest is the summand: ``add`` first writes the binaries it lacks (each atomically,
under its content hash, so no file the old manifest names ever changes), then replaces the
manifest atomically (the commit), and only then deletes the files no manifest names any more.
An interrupt anywhere leaves the old summand or the new one, whole; the next ``add`` collects
what an interrupted one left. Writers of one summand take turns (a lock file beside it);
building one target never touches another summand's bytes. Loading checks every binary
against its manifest hash.

>>> import tempfile
>>> from metrale.realize.compute import HostTarget
>>> reg = Registry(tempfile.mkdtemp())
>>> b = HostTarget().compile("numpy:add", "host", {}, name="add")
>>> s = reg.add(KernelTarget("host", "tiny", "bf16"), {"add[act=f32]": ("add", b)})
>>> reg.summands(), reg.inject(KernelTarget("host", "tiny", "bf16")).load("add[act=f32]") == b
((KernelTarget(hw='host', model='tiny', quant='bf16'),), True)

Law (coproduct): the injections are disjoint; a summand's contents are its own.

>>> reg.coproduct().objects()[0]
Tagged(summand=0, value='add[act=f32]')
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.category import Coproduct, Discrete
from metrale.lkb.errors import CacheError, ConfigError, nearest
from metrale.lkb.files import atomic_write, exclusive, read_json
from metrale.lkb.target import KernelTarget
from metrale.realize.cache import default_cache_root
from metrale.realize.compute import FORMATS, Binary

MANIFEST = "manifest.json"
LAYOUT = "v1"
_EXT = {"ptx": ".ptx", "cubin": ".cubin", "host": ".ref"}
_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.+ -]*[A-Za-z0-9_.+-])?")
"""A target coordinate is one plain folder name: a checkpoint folder ``my model`` is fine,
``..``, ``a/b`` and names that start with a dot or end in a space are not."""


def default_registry_root() -> Path:
    """``$METRALE_REGISTRY``, else ``registry/`` inside the build cache's root."""
    if os.environ.get("METRALE_REGISTRY"):
        return Path(os.environ["METRALE_REGISTRY"]).expanduser()
    return default_cache_root() / "registry"


def _holds(path: Path, data: bytes) -> bool:
    """Whether ``path`` already holds exactly ``data`` (then it is not written again)."""
    try:
        return path.stat().st_size == len(data) and path.read_bytes() == data
    except OSError:
        return False


def _collect(folder: Path, keep: set[str]) -> None:
    """Delete the files of ``folder`` outside ``keep``: binaries an older manifest named, and
    whatever an interrupted ``add`` left (its temporary files included)."""
    for p in folder.iterdir():
        if p.name not in keep and p.is_file():
            p.unlink(missing_ok=True)


def _writer_lock(dest: Path) -> contextlib.AbstractContextManager[None]:
    """Writers of one summand take turns: an exclusive lock on ``.<quant>.lock`` beside it
    (readers never lock)."""
    return exclusive(dest.parent / f".{dest.name}.lock")


def _check_target(target: KernelTarget) -> None:
    for field in ("hw", "model", "quant"):
        value = getattr(target, field)
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise ConfigError("a target coordinate must be a plain folder name", key=field,
                              expected="letters, digits, spaces and _ . + -", found=repr(value))


@attrs.frozen
class ManifestEntry:
    """Where a point's binary is and what it is."""

    file: str
    entry: str
    sha256: str
    arch: str
    compiler: str
    format: str


@attrs.frozen
class Summand:
    """One target's binaries, as its manifest describes them."""

    target: KernelTarget
    path: Path
    kernels: tuple[tuple[str, ManifestEntry], ...]

    @property
    def points(self) -> tuple[str, ...]:
        return tuple(p for p, _ in self.kernels)

    def entry(self, point: str) -> ManifestEntry:
        """The manifest entry of ``point``; an unknown point names the nearest."""
        for p, e in self.kernels:
            if p == point:
                return e
        raise CacheError(f"no kernel for {point} in the registry summand {self.target}",
                         file=self.path / MANIFEST, key=point,
                         suggestion=nearest(point, self.points))

    def load(self, point: str) -> Binary:
        """The binary of ``point``, checked against the manifest's hash."""
        e = self.entry(point)
        path = self.path / e.file
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CacheError(f"registry binary unreadable: {err}", file=path, key=point) from None
        if hashlib.sha256(data).hexdigest() != e.sha256:
            raise CacheError("registry binary does not match its manifest hash (rebuild the "
                             "target)", file=path, key=point, expected=e.sha256[:16],
                             found=hashlib.sha256(data).hexdigest()[:16])
        return Binary(data, e.arch, (e.entry,), e.format, e.compiler)


class Registry:
    """The folder of summands under ``root`` (default: :func:`default_registry_root`)."""

    def __init__(self, root: os.PathLike | str | None = None) -> None:
        self.root = Path(root) if root is not None else default_registry_root()

    def __repr__(self) -> str:
        return f"Registry({str(self.root)!r})"

    def path(self, target: KernelTarget) -> Path:
        """The summand folder of ``target``."""
        _check_target(target)
        return self.root / target.hw / target.model / target.quant

    def summands(self) -> tuple[KernelTarget, ...]:
        """Every target with a manifest, sorted."""
        if not self.root.is_dir():
            return ()
        out = []
        for manifest in self.root.glob(f"*/*/*/{MANIFEST}"):
            hw, model, quant = manifest.parent.relative_to(self.root).parts
            if not any(part.startswith(".") for part in (hw, model, quant)):
                out.append(KernelTarget(hw, model, quant))
        return tuple(sorted(out, key=KernelTarget.as_tuple))

    def inject(self, target: KernelTarget) -> Summand:
        """ι_target: the summand of ``target``, read from its manifest."""
        path = self.path(target)
        manifest = path / MANIFEST
        if not manifest.is_file():
            raise CacheError(f"no summand for {target} in the registry (run `met build`)",
                             file=manifest, expected="one of " + (", ".join(
                                 map(str, self.summands())) or "(none)"), found=str(target))
        data = read_json(manifest)
        try:
            if data["layout"] != LAYOUT or data["target"] != list(target.as_tuple()):
                raise KeyError("layout/target")
            kernels = tuple((p, ManifestEntry(**e)) for p, e in sorted(data["kernels"].items()))
        except (KeyError, TypeError, AttributeError) as e:
            raise CacheError(f"registry manifest malformed: {e}", file=manifest,
                             expected=f"layout {LAYOUT} for {target}") from None
        return Summand(target, path, kernels)

    def add(self, target: KernelTarget, binaries: Mapping[str, tuple[str, Binary]]) -> Summand:
        """Write the summand of ``target``: ``binaries`` maps each point to ``(entry, binary)``.

        Atomic: the new binaries are written beside the old ones (files named by content hash,
        so none the old manifest names is changed), the manifest is replaced in one rename, and
        only then are the files it no longer names deleted. Interrupted anywhere, the folder
        holds the old summand or the new one, whole.
        """
        dest = self.path(target)
        kernels: dict[str, dict[str, Any]] = {}
        files: dict[str, bytes] = {}
        for point, (entry, b) in sorted(binaries.items()):
            if b.format not in FORMATS:
                raise CacheError("unknown binary format", key=point, found=b.format)
            if entry not in b.entries:
                raise CacheError(f"binary for {point} does not export {entry!r}", key=point,
                                 expected=entry, found=", ".join(b.entries))
            name = b.sha256[:32] + _EXT[b.format]
            files[name] = b.data
            kernels[point] = {"file": name, "entry": entry, "sha256": b.sha256,
                              "arch": b.arch, "compiler": b.compiler, "format": b.format}
        manifest = {"layout": LAYOUT, "target": list(target.as_tuple()), "kernels": kernels}
        try:
            dest.mkdir(parents=True, exist_ok=True)
            with _writer_lock(dest):
                for name, data in files.items():
                    if not _holds(dest / name, data):
                        atomic_write(dest / name, data)
                atomic_write(dest / MANIFEST,
                             json.dumps(manifest, indent=1, sort_keys=True) + "\n")  # commit
                _collect(dest, keep={*files, MANIFEST})
        except OSError as e:
            raise CacheError(f"could not write the registry summand: {e}", file=dest) from None
        return self.inject(target)

    def coproduct(self) -> Coproduct:
        """The registry as an ``lkb`` coproduct of discrete categories, one per summand (its
        points), with injections ι_i (``coproduct_laws`` checks them)."""
        return Coproduct(tuple(Discrete(str(t), self.inject(t).points)
                               for t in self.summands()))
