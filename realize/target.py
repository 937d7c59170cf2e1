"""The Target: one memoized value per (class, presentation, kernels folder, policy).

A ``Target`` holds what every plan for one hardware class reads: the presentation, the class's
chain, F_H (one :class:`Realization` per model/quant leaf folder, the class's own without
one), the class's evidence and the numerics policy. :func:`target` builds it once and hands
the same value back while the files it was read from are unchanged (their sizes and
modification times are compared on each call: a few ``stat`` calls, no parsing). Plans carry
their Target, so loaders and executors read kernels and families from the plan and never
reload a registry; a plan made over an extended presentation is read with that presentation.

>>> T = target("sm_90")
>>> T is target("sm_90"), T.hw.name, T.policy
(True, 'sm_90', 'exact')
>>> T.realization().functor == target("sm_90").realization().functor
True
>>> target("sm_90", policy="bounded") is T
False
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.errors import ConfigError
from metrale.lkb.presentation import FAMILIES_FILE, FUSIONS_FILE, Presentation
from metrale.lkb.target import KernelTarget
from metrale.realize.evidence import EVIDENCE_FILE, Evidence, ExportFile
from metrale.realize.functor import Realization, realization
from metrale.realize.hardware import HardwareClass, default_kernels_dir

POLICIES = ("exact", "bounded")
"""``exact``: bit-identical relations only; ``bounded``: also those with a declared bound."""


@attrs.frozen(eq=False)
class Target:
    """What plans for one class read, built once (see the module docstring)."""

    hw: HardwareClass
    kernels_dir: Path
    presentation: Presentation
    policy: str
    _leaves: dict[Any, tuple[tuple, Realization]] = attrs.field(factory=dict, repr=False)
    _evidence: list[tuple[tuple, Evidence]] = attrs.field(factory=list, repr=False)

    def _key(self) -> tuple:
        return (self.hw.name, str(self.kernels_dir), self.presentation, self.policy)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Target) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def chain(self) -> tuple[HardwareClass, ...]:
        """The class and its ancestors, in resolution order."""
        return self.realization().chain

    def realization(self, leaf: KernelTarget | None = None) -> Realization:
        """F_H, resolving through the leaf folder of ``leaf`` (a model/quant target of this
        class) when given; built once per leaf."""
        stamp = () if leaf is None else _stamp((self.kernels_dir / leaf.path / "KERNELS.toml",))
        found = self._leaves.get(leaf)
        if found is None or found[0] != stamp:
            assert leaf is not None  # the class's own is built with the Target
            found = self._leaves[leaf] = (stamp, self._leaves[None][1].with_leaf(leaf))
        return found[1]

    @property
    def evidence(self) -> Evidence:
        """The class's evidence: its shipped export (``<kernels>/<hw>/EVIDENCE.toml``) and the
        user's store (:mod:`metrale.realize.evidence_store`), read lazily by point. A record
        counts only on the class that recorded it, so no other class's export is read. Read
        again when the export or the store changes (a record made since shows), else kept."""
        from metrale.realize.evidence_store import EvidenceStore

        store = EvidenceStore.default()
        export = self.kernels_dir / self.hw.name / EVIDENCE_FILE
        side = (store.path.with_name(store.path.name + "-wal"),)
        stamp = (str(store.path), _stamp((export, store.path, *side)))
        if not self._evidence or self._evidence[0][0] != stamp:
            exports = (ExportFile(export, self.hw.name),) if export.is_file() else ()
            self._evidence[:] = [(stamp, Evidence(exports, store))]
        return self._evidence[0][1]

    def files(self) -> tuple[Path, ...]:
        """The files this Target was read from (whose changes make :func:`target` rebuild)."""
        root = self.kernels_dir
        out = [root / FAMILIES_FILE, root / FUSIONS_FILE, root / self.hw.name / EVIDENCE_FILE]
        for c in self.chain:
            out += [root / c.name / "HARDWARE.toml", root / c.name / "common" / "KERNELS.toml"]
        return tuple(out)

    def __repr__(self) -> str:
        return f"<Target {self.hw.name} policy={self.policy} kernels={self.kernels_dir}>"


def _stamp(paths: tuple[Path, ...]) -> tuple:
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)


_PRESENTATIONS: dict[str, tuple[tuple, Presentation]] = {}
_TARGETS: dict[tuple, tuple[tuple, Target]] = {}


def presentation_at(kernels_dir: Path | str | None = None) -> Presentation:
    """The presentation of ``kernels_dir`` (default: the shipped one), read once while its two
    files are unchanged.

    >>> presentation_at() is presentation_at()
    True
    """
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    if kernels_dir is not None and not (root / FAMILIES_FILE).is_file():
        root = default_kernels_dir()  # a folder of kernels only: the shipped families
    stamp = _stamp((root / FAMILIES_FILE, root / FUSIONS_FILE))
    hit = _PRESENTATIONS.get(str(root))
    if hit is None or hit[0] != stamp:
        hit = _PRESENTATIONS[str(root)] = (stamp, Presentation.load(root))
    return hit[1]


def target(hw_name: str, *, kernels_dir: Path | str | None = None,
           presentation: Presentation | None = None, policy: str = "exact") -> Target:
    """The Target of class ``hw_name`` (memoized; see the module docstring)."""
    if policy not in POLICIES:
        raise ConfigError("unknown numerics policy", key="policy",
                          expected=" or ".join(POLICIES), found=repr(policy))
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    P = presentation if presentation is not None else presentation_at(kernels_dir)
    key = (hw_name, str(root), P, policy)
    hit = _TARGETS.get(key)
    if hit is not None and _stamp(hit[1].files()) == hit[0]:
        return hit[1]
    F = realization(hw_name, kernels_dir=root, presentation=P)
    T = Target(F.hw, root, P, policy)
    T._leaves[None] = ((), F)
    if len(_TARGETS) >= 64:
        _TARGETS.clear()
    _TARGETS[key] = (_stamp(T.files()), T)
    return T
