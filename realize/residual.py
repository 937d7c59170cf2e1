"""Residual(H): what a class's own folders add outside the shared image of F_H, named and counted.

Three kinds, each entry with its reason and its evidence status:

- **shadow**: a point realized from ``kernels/<hw>/common/`` while an ancestor also has a
  kernel for it (one entry per point; the reason is the table's ``reason``);
- **class-only source**: a source file in ``kernels/<hw>/common/`` that no table of a
  presentation family claims (or whose table claims no compiled point) and no claimed source
  includes;
- **per-point copy**: a point realized from a leaf target folder
  ``kernels/<hw>/<model>/<quant>/``, and any source file there no table claims.

A shadow inherited from an ancestor class is counted in that class's residual, not again in
each descendant's. The count is the measure of convergence, tracked over time.

>>> r = residual("sm_90")
>>> r.count, {e.kind for e in r.entries}, sorted({e.file for e in r.entries})[0]
(34, {'shadow'}, 'sm_90/common/attention_wgmma.cu')
>>> residual("sm_80").count
0
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.presentation import Presentation
from metrale.lkb.target import KernelTarget
from metrale.realize.compute import target_for
from metrale.realize.evidence import evidence_status, load_all_evidence
from metrale.realize.functor import Realization, realization
from metrale.realize.hardware import default_kernels_dir
from metrale.realize.kernel import KERNELS_FILE

SHADOW = "shadow"
CLASS_ONLY = "class-only source"
PER_POINT_COPY = "per-point copy"
KINDS = (SHADOW, CLASS_ONLY, PER_POINT_COPY)
NO_POINT = "n/a (no point)"
"""The evidence status of a source that realizes no point: nothing it does can be measured."""


@attrs.frozen
class ResidualEntry:
    """One residual item: its kind, what it is (a point, or a file), where, why, and evidence.

    >>> print(ResidualEntry(SHADOW, "rmsnorm[act=bf16,h_block=256]", "sm_90/common/norm.cu",
    ...                     "one warp per row is faster on Hopper", "shared, unmeasured"))
    shadow rmsnorm[act=bf16,h_block=256] (sm_90/common/norm.cu): one warp per row is faster on Hopper [shared, unmeasured]
    """  # noqa: E501

    kind: str = attrs.field(validator=attrs.validators.in_(KINDS))
    name: str
    file: str
    reason: str
    evidence: str

    def to_json(self) -> dict[str, str]:
        return attrs.asdict(self)

    def __str__(self) -> str:
        return f"{self.kind} {self.name} ({self.file}): {self.reason} [{self.evidence}]"


@attrs.frozen
class Residual:
    """Residual(H): the entries, sorted by kind, file and name; ``count`` is their number."""

    hw: str
    entries: tuple[ResidualEntry, ...] = attrs.field(
        converter=lambda es: tuple(sorted(es, key=lambda e: (KINDS.index(e.kind), e.file,
                                                             e.name))))

    @property
    def count(self) -> int:
        return len(self.entries)

    def by_kind(self) -> dict[str, int]:
        """How many entries of each kind (every kind listed)."""
        return {k: sum(e.kind == k for e in self.entries) for k in KINDS}

    def to_json(self) -> dict[str, Any]:
        """``{"hardware", "count", "by_kind", "entries"}``."""
        return {"hardware": self.hw, "count": self.count, "by_kind": self.by_kind(),
                "entries": [e.to_json() for e in self.entries]}

    def table(self) -> Any:
        """A rich table of the entries, titled with the count."""
        from rich.table import Table

        kinds = ", ".join(f"{n} {k}{'s' if n != 1 else ''}" for k, n in self.by_kind().items())
        t = Table(title=f"Residual({self.hw}): {self.count} ({kinds})")
        for col in ("kind", "name", "file", "reason", "evidence"):
            t.add_column(col)
        for e in self.entries:
            t.add_row(e.kind, e.name, e.file, e.reason, e.evidence)
        return t

    def __str__(self) -> str:
        return "\n".join([f"Residual({self.hw}): {self.count}", *(f"  {e}" for e in self.entries)])

    def _repr_html_(self) -> str:
        from metrale.realize.display import residual_html

        return residual_html(self)


def leaf_targets(hw: str, kernels_dir: Path | str | None = None) -> tuple[KernelTarget, ...]:
    """The targets with a leaf folder ``kernels/<hw>/<model>/<quant>/`` (``common`` is not one).

    >>> leaf_targets("sm_90")
    ()
    """
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    base = root / hw
    if not base.is_dir():
        return ()
    out = []
    for model in sorted(p for p in base.iterdir() if p.is_dir() and p.name != "common"
                        and not p.name.startswith((".", "_"))):
        for quant in sorted(q for q in model.iterdir() if q.is_dir()
                            and not q.name.startswith((".", "_"))):
            out.append(KernelTarget(hw, model.name, quant.name))
    return tuple(out)


def residual(hw: str, kernels_dir: Path | str | None = None, *,
             presentation: Presentation | None = None) -> Residual:
    """Residual(``hw``): shadows, class-only sources and per-point copies, each with its reason
    and its evidence status on ``hw`` (the shipped export and the evidence store)."""
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    F = realization(hw, kernels_dir=root, presentation=presentation)
    evidence = load_all_evidence(root)
    ext = target_for(F.hw.vendor).source_extension
    entries: list[ResidualEntry] = []
    own = f"{F.name}/common"
    for k in F.kernels():
        if k.shadow and k.provenance == F.name and k.source and k.source.startswith(own + "/"):
            entries.append(ResidualEntry(SHADOW, str(k.point), k.source, k.residual_reason,
                                         _status(evidence, F.name, k)))
    entries += _unclaimed(F, own, CLASS_ONLY, ext, "claimed by no KERNELS.toml table")
    for target in leaf_targets(F.name, root):
        leaf = realization(F.name, kernels_dir=root, presentation=F.presentation, target=target)
        for k in leaf.kernels():
            if k.residual_kind == PER_POINT_COPY:
                entries.append(ResidualEntry(PER_POINT_COPY, f"{target.model}/{target.quant}: "
                                             f"{k.point}", k.source or "", k.residual_reason,
                                             _status(evidence, F.name, k)))
        entries += _unclaimed(leaf, target.path, PER_POINT_COPY, ext,
                              f"a file in the leaf folder of {target} claimed by no table")
    return Residual(F.name, entries)


def _status(evidence: Any, hw: str, kernel: Any) -> str:
    return evidence_status(evidence, hw, kernel.point.family, str(kernel.point),
                           kernel.source_hash)


def _unclaimed(F: Realization, rel: str, kind: str, ext: str, why: str) -> list[ResidualEntry]:
    """Source files of folder ``rel`` that no usable table claims, with the reason."""
    folder = next((f for f in F.folders if f.path == rel), None)
    path = F.kernels_dir / rel
    if folder is None or not path.is_dir():
        return []
    claimed = {t.source_path for t in folder.tables}
    # a source that a claimed one includes is compiled in its units (weights_bf16.cu's entries
    # in gemm_tma.cu's and gemm_chain.cu's)
    claimed |= {h for k in F.kernels() if k.source in claimed for h in k.headers}
    orphan_reasons: dict[str, list[str]] = {}
    for o in folder.orphans:
        orphan_reasons.setdefault(o.source, []).append(o.reason)
    out = []
    for f in sorted(p for p in path.iterdir() if p.is_file() and p.suffix == ext
                    and p.name != KERNELS_FILE):
        name = f"{rel}/{f.name}"
        if name in claimed:
            continue
        reason = "; ".join(orphan_reasons.get(name, [])) or why
        out.append(ResidualEntry(kind, f.name, name, reason, NO_POINT))
    return out
