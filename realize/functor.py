"""F_H: the realization functor LKB → Impl_H of one hardware class H.

A point resolves by walking H's chain of folders, first match wins: the target's leaf folder
``kernels/<hw>/<model>/<quant>/`` (when a target is given), then ``kernels/<hw>/common/``,
then each ancestor's ``common/`` in C3 order. A table whose ``requires`` fails on H is passed
over. A class of the host vendor realizes every point by the reference semantics.

Laws: F_H is a strict monoidal functor on LKB diagrams (``metrale.testing.functor_laws``),
and what it gives a point depends only on the data, never on the class's name.

>>> F = realization("sm_90")
>>> lin = F.presentation.family("linear")
>>> p = lin.point(act="bf16", weight="bf16", shape="gemv", k_block=256, across="pairwise")
>>> F.realize(p).entry, F.realize(p).provenance
('metrale_linear', 'cuda')
>>> image = F.functor(lin.box(p))
>>> image.boxes[0].name, image.boxes[0].param("kernel").split()[1:]
('metrale_linear', ['-DACROSS_PAIRWISE', '-DACT_BF16', '-DK_BLOCK=256', '-DWEIGHT_BF16'])
>>> image.boxes[0].param("kernel").split()[0].split("+")[:2]  # the source's entry, then its chain
['cuda:cuda/common/gemv.cu:metrale_linear', 'metrale_linear_split']
>>> realization("host").realize(p).entry, realization("host").realize(p).source is None
('linear', True)
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.diagram import Box, Diagram
from metrale.lkb.errors import AxiomError, ConfigError, MetraleError, nearest
from metrale.lkb.family import Family, Point
from metrale.lkb.files import raise_all
from metrale.lkb.functor import Functor
from metrale.lkb.presentation import Presentation
from metrale.lkb.target import KernelTarget
from metrale.lkb.vendor import Vendor
from metrale.realize.evidence import hash_source
from metrale.realize.hardware import HardwareClass, default_kernels_dir, load_hardware
from metrale.realize.kernel import Kernel, TableFolder, load_folder, source_identity

VIEW = "view"
"""The ``kernel`` parameter of a view's image: a zero-cost view of a buffer, no launch."""


def canonical_point(fam: Family, params: Any) -> Point:
    """The point of ``fam`` with ``params`` (a mapping or pairs; other keys dropped), in the
    family's parameter order, so that it equals the family's own point.

    >>> from metrale.lkb.presentation import Presentation
    >>> fam = Presentation.load().family("rmsnorm")
    >>> canonical_point(fam, {"h_block": 256, "eps": 1e-6, "act": "f32"}) == fam.points[1]
    True
    """
    values = dict(params)
    return Point(fam.name, tuple((k, values[k]) for k in fam.domains if k in values))


def _presentation_for(kernels_dir: Path | None) -> Presentation:
    """The presentation of ``kernels_dir`` when it has one, else the shipped one; read once
    while its files are unchanged (``realize.target.presentation_at``)."""
    from metrale.realize.target import presentation_at

    return presentation_at(kernels_dir)


@attrs.frozen(eq=False)
class Realization:
    """F_H for one class: ``realize(point)`` gives the :class:`Kernel` or ``None``.

    Built by :func:`realization`; every KERNELS.toml of the chain is read and checked then
    (all violations at once), and every compiled point of the presentation is resolved.
    """

    hw: HardwareClass
    chain: tuple[HardwareClass, ...]
    presentation: Presentation
    kernels_dir: Path
    target: KernelTarget | None
    folders: tuple[TableFolder, ...]
    _memo: dict[Point, tuple[Kernel | None, str]] = attrs.field(factory=dict, repr=False)
    _families: dict[str, Family] = attrs.field(factory=dict, repr=False)
    _sources: dict[str, tuple] = attrs.field(factory=dict, repr=False)
    _by_image: dict[tuple, Kernel] = attrs.field(factory=dict, repr=False)
    functor: Functor = attrs.field(init=False, repr=False)
    """F_H as an ``lkb`` functor ``LKB → Impl_<hw>``, total on what L_H produces: each
    family-point box becomes a one-box diagram whose box is the kernel's entry, carrying
    ``("kernel", kernel.key)`` and the original parameters, with the same dom and cod; a view
    (a family that relabels a buffer) becomes a zero-cost view box, ``("kernel", "view")``,
    which launches nothing. Impl_H's arrows are composites of these; ``kernel_of`` reads the
    kernel back from an image box."""

    def __attrs_post_init__(self) -> None:
        self._families.update({f.name: f for f in self.presentation.generators})
        object.__setattr__(self, "functor", Functor(
            "LKB", f"Impl_{self.hw.name}", ar=self._image, name=f"F_{self.hw.name}",
            key=("realization", self.hw, self.chain, self.presentation, str(self.kernels_dir),
                 self.target)))

    @property
    def name(self) -> str:
        """The class's name."""
        return self.hw.name

    @property
    def by_semantics(self) -> bool:
        """Whether this class realizes points by the reference semantics (the host vendor)."""
        return self.hw.vendor is Vendor.HOST

    # resolution ---------------------------------------------------------------------------

    def realize(self, point: Point) -> Kernel | None:
        """The kernel of ``point`` on this class, or ``None`` when it is not realized here."""
        return self._resolve(point)[0]

    def realizes(self, point: Point) -> bool:
        """Whether ``point`` has a kernel on this class."""
        return self._resolve(point)[0] is not None

    def why_not(self, point: Point) -> str:
        """Why ``point`` is not realized here (or what realizes it, when it is)."""
        kernel, why = self._resolve(point)
        return why if kernel is None else f"{point} is realized on {self.name} by {kernel}"

    def kernels(self) -> tuple[Kernel, ...]:
        """The kernel of every compiled point that is realized, in presentation order."""
        out = []
        for p in self.presentation.points():
            k = self.realize(p)
            if k is not None:
                out.append(k)
        return tuple(out)

    def _chain_words(self) -> str:
        return f"{self.name}'s chain ({', '.join(c.name for c in self.chain)})"

    def _resolve(self, point: Point) -> tuple[Kernel | None, str]:
        hit = self._memo.get(point)
        if hit is None:
            hit = self._memo[point] = self._lookup(point)
        return hit

    def _lookup(self, point: Point) -> tuple[Kernel | None, str]:
        fam = self._families.get(point.family)
        if fam is None:
            hint = nearest(point.family, self._families)
            return None, (f"no family {point.family!r} in the presentation"
                          + (f" (did you mean {hint!r}?)" if hint else ""))
        point = canonical_point(fam, point.params)
        if point not in fam.points:
            return None, f"{point} is not a compiled point of {fam.name}"
        if self.by_semantics:
            return self._host_kernel(fam, point), ""
        if getattr(fam, "view", False):
            return None, f"{fam.name} is a view: it relabels a buffer and launches no kernel"
        passed_over = []
        for i, folder in enumerate(self.folders):
            for table in folder.claiming(point):
                unmet = table.unmet(self.hw.capabilities, self.name)
                if unmet:
                    passed_over.append(f"kernel {table.name} ({folder.path}) "
                                       + "; ".join(unmet))
                    continue
                later = any(not t.unmet(self.hw.capabilities, self.name)
                            for f in self.folders[i + 1:] for t in f.claiming(point))
                kind = ("per-point copy" if folder.kind == "leaf"
                        else "shadow" if later else "")
                _, headers, _, digest = self.source(table.source_path)
                return table.kernel(point, hw=self.name, provenance=folder.owner,
                                    source_hash=digest, headers=headers, shadow=later,
                                    residual_kind=kind,
                                    multiprocessors=self.hw.device.multiprocessors
                                    if self.hw.device else 0), ""
        if passed_over:
            return None, f"{point}: " + "; ".join(passed_over)
        return None, f"no kernel for {point} in {self._chain_words()}"

    def _host_kernel(self, fam: Family, point: Point) -> Kernel:
        from metrale.lkb.semantics import SEMANTICS

        fn = SEMANTICS[fam.semantics]
        try:
            text = inspect.getsource(fn)
        except (OSError, TypeError):
            text = f"{fn.__module__}:{fn.__qualname__}"
        return Kernel(point, self.name, self.name, None, fam.semantics, (), None, (), (),
                      fam.reductions(point), fam.row_invariant, source_hash=hash_source(text),
                      table=fam.name)

    def source(self, source: str) -> tuple[str, tuple[str, ...], dict[str, str], str]:
        """``(text, headers, header_texts, hash)`` of a source path relative to the kernels
        folder, includes resolved through this chain's folders (see ``source_identity``)."""
        hit = self._sources.get(source)
        if hit is None:
            search = tuple(f.path for f in self.folders)
            hit = self._sources[source] = source_identity(self.kernels_dir, source, search)
        return hit

    # the functor ----------------------------------------------------------------------------

    def kernel_of(self, image: Box) -> Kernel | None:
        """The kernel an image box of :attr:`functor` stands for (``None`` for a view).

        >>> F = realization("sm_90")
        >>> p = F.presentation.family("rmsnorm").points[0]
        >>> F.kernel_of(F.functor(F.presentation.family("rmsnorm").box(p)).boxes[0]).entry
        'metrale_rmsnorm'
        """
        key = image.param("kernel")
        if key == VIEW:
            return None
        return self._by_image[(key, tuple(kv for kv in image.params if kv[0] != "kernel"))]

    def _image(self, box: Box) -> Diagram:
        fam = self._families.get(box.name)
        if fam is None:
            raise AxiomError(f"F_{self.name}: {box.name} is not a generator of the LKB",
                             key=box.name, suggestion=nearest(box.name, self._families))
        if fam.view:
            params = (("kernel", VIEW), *((k, v) for k, v in box.params if k != "kernel"))
            return Box(box.name, box.dom, box.cod, params).diagram
        point = canonical_point(fam, box.params)
        kernel, why = self._resolve(point)
        if kernel is None:
            raise AxiomError(f"F_{self.name}: {why}", key=str(point))
        self._by_image[(kernel.key, tuple(kv for kv in box.params if kv[0] != "kernel"))] = kernel
        params = (("kernel", kernel.key), *((k, v) for k, v in box.params if k != "kernel"))
        return Box(kernel.entry, box.dom, box.cod, params).diagram

    def with_leaf(self, target: KernelTarget) -> Realization:
        """F_H resolving first through ``target``'s leaf folder, then this class's folders
        (already read: only the leaf's tables are read now)."""
        if self.target is not None:
            raise ConfigError("a realization with a leaf folder already", key="target",
                              found=str(self.target))
        if target.hw != self.hw.name:
            raise ConfigError("target of another class", key="target",
                              expected=f"{self.hw.name}/<model>/<quant>", found=repr(str(target)))
        errors: list[MetraleError] = []
        leaf = load_folder(self.kernels_dir, target.path, self.hw.name, "leaf",
                           dict(self._families), errors)
        raise_all(errors)
        return Realization(self.hw, self.chain, self.presentation, self.kernels_dir, target,
                           (leaf, *self.folders))

    def __repr__(self) -> str:
        where = f", target={str(self.target)!r}" if self.target else ""
        return f"<Realization F_{self.name}{where}: {len(self.folders)} folders>"

    def _repr_html_(self) -> str:
        from metrale.realize.display import realization_html

        return realization_html(self)


def realization(hw_name: str, *, kernels_dir: Path | str | None = None,
                presentation: Presentation | None = None,
                target: KernelTarget | None = None) -> Realization:
    """F_H for the class ``hw_name``; every kernel table of its chain is checked now.

    >>> realization("sm_80", target=KernelTarget("sm_90", "qwen3-0.6b", "bf16"))
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: target: target of another class (expected sm_80/<model>/<quant>, found 'sm_90/qwen3-0.6b/bf16')
    """  # noqa: E501
    root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
    registry = load_hardware(root)
    hw = registry.get(hw_name)
    if target is not None and target.hw != hw.name:
        raise ConfigError("target of another class", key="target",
                          expected=f"{hw.name}/<model>/<quant>", found=repr(str(target)))
    P = presentation if presentation is not None else _presentation_for(
        Path(kernels_dir) if kernels_dir is not None else None)
    chain = registry.chain(hw)
    families = {f.name: f for f in P.generators}
    errors: list[MetraleError] = []
    folders = []
    if target is not None:
        folders.append(load_folder(root, target.path, hw.name, "leaf", families, errors))
    for c in chain:
        folders.append(load_folder(root, f"{c.name}/common", c.name, "common", families, errors))
    raise_all(errors)
    return Realization(hw, chain, P, root, target, tuple(f for f in folders))
