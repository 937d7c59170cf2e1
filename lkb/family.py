"""Kernel families: the generators of the LKB, with typed parameters, a signature and points.

A family's signature maps a parameter assignment to its ``dom``/``cod`` types; a *point* is an
assignment of every parameter, and the points a family lists are the ones that get compiled.
Runtime scalars (``eps``, ``scale`` …) are *attributes*: they travel as kernel arguments and
do not make new points.

>>> fam = Family.from_table("rmsnorm", {
...     "doc": "y = x / rms(x) * w", "inputs": ["x: {act}[rows, h]", "w: f32[h]"],
...     "outputs": ["y: {act}[rows, h]"], "attrs": {"eps": 1e-6},
...     "params": {"act": ["bf16", "f32"], "h_block": [256]},
...     "points": [{"act": ["bf16", "f32"], "h_block": 256}]}, "F.toml", [])
>>> [str(p) for p in fam.points]
['rmsnorm[act=bf16,h_block=256]', 'rmsnorm[act=f32,h_block=256]']
>>> str(fam.box(fam.points[0]).dom)
'bf16[rows,h] @ f32[h]'
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from itertools import product
from typing import Any

import attrs
from attrs import field

from .diagram import Box
from .dtype import BF16, E2M1, E4M3, DType
from .errors import ConfigError, MetraleError
from .files import Fields
from .ty import TensorType, Ty

WEIGHT_FORMATS: Mapping[str, tuple[DType, str]] = {
    "bf16": (BF16, ""), "fp8": (E4M3, "fp8"), "mxfp4": (E2M1, "mxfp4"), "nvfp4": (E2M1, "nvfp4"),
}
"""How a weight-format parameter value becomes a wire type: element dtype and format tag."""

_PORT = re.compile(r"^\s*(\w+)\s*:\s*(\{\w+\}|\w+)\s*\[([^\]]*)\]\s*$")


@attrs.frozen
class Port:
    """One input or output of a family: a name, a dtype (literal or ``{param}``) and dims."""

    name: str
    dtype: str
    dims: tuple[str | int, ...]

    @staticmethod
    def parse(text: str, file: object, key: str) -> Port:
        m = _PORT.match(text) if isinstance(text, str) else None
        if not m:
            raise ConfigError("bad port", file=file, key=key,
                              expected="'name: dtype[dim, ...]' (dtype may be {param})",
                              found=repr(text))
        dims = tuple(int(d) if d.strip().isdigit() else d.strip()
                     for d in m.group(3).split(",") if d.strip())
        return Port(m.group(1), m.group(2), dims)

    def type(self, params: Mapping[str, Any], file: object = None, key: str = "") -> TensorType:
        """The port's tensor type at a point."""
        spelled = self.dtype
        if spelled.startswith("{"):
            pname = spelled[1:-1]
            if pname not in params:
                raise ConfigError(f"dtype of port {self.name} names parameter {pname!r}, "
                                  "which the point does not set", file=file, key=key)
            spelled = str(params[pname])
        if spelled in WEIGHT_FORMATS and spelled != "bf16":
            dtype, fmt = WEIGHT_FORMATS[spelled]
            return TensorType(self.dims, dtype, fmt)
        return TensorType(self.dims, DType.parse(spelled, file=file, key=key))

    def __str__(self) -> str:
        return f"{self.name}: {self.dtype}[{', '.join(map(str, self.dims))}]"


@attrs.frozen(order=True, cache_hash=True)
class Point:
    """A family at one parameter assignment: what gets compiled.

    >>> str(Point("linear", (("act", "bf16"), ("k_block", 256))))
    'linear[act=bf16,k_block=256]'
    """

    family: str
    params: tuple[tuple[str, Any], ...]

    def param(self, key: str) -> Any:
        return dict(self.params)[key]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.params)

    def __str__(self) -> str:
        return f"{self.family}[{','.join(f'{k}={v}' for k, v in self.params)}]"


def _expand(assignment: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``{a: [1, 2], b: 3}`` → ``[{a: 1, b: 3}, {a: 2, b: 3}]``."""
    keys = list(assignment)
    values = [v if isinstance(v, list) else [v] for v in assignment.values()]
    return [dict(zip(keys, combo)) for combo in product(*values)]


@attrs.frozen
class Family:
    """A generator of the LKB: signature, parameter domains, compiled points, attributes."""

    name: str
    doc: str
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    params: tuple[tuple[str, tuple[Any, ...]], ...]
    points: tuple[Point, ...]
    attrs: tuple[str, ...] = ()
    semantics: str = ""
    row_invariant: bool = True
    weights: tuple[str, ...] = ()
    """Input ports bound from a checkpoint; the host holds them dequantized in f32."""
    inplace: tuple[tuple[str, str], ...] = ()
    """Outputs that alias an input (``("k_cache_out", "k_cache")``): written in place."""
    example: tuple[tuple[str, Any], ...] = ()
    """Sizes of the signature's dims for a small example (``rows``, ``k`` …)."""
    ranges: tuple[tuple[str, str], ...] = ()
    """Integer inputs and the dim bounding their values (``positions`` < ``max_ctx``)."""
    attr_examples: tuple[tuple[str, Any], ...] = ()
    """An example value of each runtime attribute."""
    view: bool = False
    """A reinterpretation: the output aliases the input and no kernel runs."""
    traffic: tuple[tuple[str, str], ...] = ()
    """Port → elements one call really moves (a formula of dims and ``context``)."""
    collective: bool = False
    """Carried by the rank group's transport (all ranks at once), not by a kernel of one."""
    file: str = field(default="", eq=False)
    """Where it was read from (not part of its identity)."""

    @property
    def domains(self) -> dict[str, tuple[Any, ...]]:
        return dict(self.params)

    def point(self, **params: Any) -> Point:
        """The point with these parameters; an error when it is outside the domains."""
        errors: list[MetraleError] = []
        p = self._point(params, self.file, f"family.{self.name}", errors)
        if errors:
            raise errors[0]
        return p

    def _point(self, params: Mapping[str, Any], file: object, key: str,
               errors: list[MetraleError]) -> Point:
        domains = self.domains
        for name, value in params.items():
            if name not in domains:
                errors.append(ConfigError("unknown parameter", file=file, key=f"{key}.{name}",
                                          expected="one of " + ", ".join(domains)))
            elif value not in domains[name]:
                errors.append(ConfigError("point outside its parameter domain", file=file,
                                          key=f"{key}.{name}",
                                          expected="one of " + ", ".join(map(str, domains[name])),
                                          found=repr(value)))
        for name in domains:
            if name not in params:
                errors.append(ConfigError("point does not set a parameter", file=file,
                                          key=f"{key}.{name}"))
        return Point(self.name, tuple((k, params[k]) for k in domains if k in params))

    def signature(self, params: Mapping[str, Any]) -> tuple[Ty, Ty]:
        """``(dom, cod)`` at a parameter assignment."""
        key = f"family.{self.name}"  # a bad dtype is reported at its port: family.f.inputs[0]
        dom = Ty(*(p.type(params, self.file, f"{key}.inputs[{i}]")
                   for i, p in enumerate(self.inputs)))
        cod = Ty(*(p.type(params, self.file, f"{key}.outputs[{i}]")
                   for i, p in enumerate(self.outputs)))
        return dom, cod

    def box(self, point: Point, attrs_: Mapping[str, Any] | None = None,
            dims: Mapping[str, str | int] | None = None) -> Box:
        """The LKB generator of ``point``: a box typed by the signature.

        ``dims`` renames the family's dims to the circuit's (``k`` → ``hidden``); ``attrs_``
        adds runtime attributes to the box's parameters.
        """
        dom, cod = self.signature(point.as_dict())
        if dims:
            dom, cod = rename_dims(dom, dims), rename_dims(cod, dims)
        return Box(self.name, dom, cod, {**point.as_dict(), **(attrs_ or {})})

    def reductions(self, point: Point) -> tuple[str, ...]:
        """The declared order of every reduction at ``point``, in words (from the semantics).

        >>> from metrale.lkb.presentation import Presentation
        >>> fam = Presentation.load().family("linear")
        >>> fam.reductions(fam.points[0])[0]
        'k (x·w): f32, blocks of 256, partial sums combined sequentially; within a block: BLAS sgemv order'
        """
        from .semantics import describe, reduction_orders

        return tuple(describe(r) for r in reduction_orders(self.semantics, **point.as_dict()))

    def point_of(self, box: Box) -> Point:
        """The point a box of this family stands for: its parameters in the family's order
        (the same ``Point`` as the family's own), its attributes dropped.

        >>> from metrale.lkb.presentation import Presentation
        >>> fam = Presentation.load().family("rmsnorm")
        >>> fam.point_of(fam.box(fam.points[0], {"eps": 1e-6})) == fam.points[0]
        True
        """
        params = dict(box.params)
        return Point(self.name, tuple((k, params[k]) for k, _ in self.params if k in params))

    @staticmethod
    def from_table(name: str, table: Any, file: object, errors: list[MetraleError]) -> Family:
        key = f"family.{name}"
        f = Fields(table, file, key, errors)
        doc = f.take("doc", str, default="")
        semantics = f.take("semantics", str, default=name)
        row_invariant = f.take("row_invariant", bool, default=True)
        raw_inputs = f.take("inputs", list, default=[])
        raw_outputs = f.take("outputs", list, default=[])
        raw_attrs = f.take("attrs", dict, default={})
        raw_params = f.take("params", dict, default={})
        raw_points = f.take("points", list, default=[])
        raw_inplace = f.take("inplace", dict, default={})
        raw_weights = f.take("weights", list, default=[])
        raw_example = f.take("example", dict, default={})
        raw_ranges = f.take("ranges", dict, default={})
        view = f.take("view", bool, default=False)
        raw_traffic = f.take("traffic", dict, default={})
        collective = f.take("collective", bool, default=False)
        f.close()
        # Values kept inside the frozen Family must be hashable scalars, or hash(P) fails later.
        raw_example = _scalar_table(raw_example, (int,), "a dim size is an integer", file,
                                    f"{key}.example", errors)
        raw_attrs = _scalar_table(raw_attrs, _SCALARS, "an attribute's example is a scalar",
                                  file, f"{key}.attrs", errors)

        def ports(raw: list, which: str) -> tuple[Port, ...]:
            out = []
            for i, text in enumerate(raw or []):
                try:
                    out.append(Port.parse(text, file, f"{key}.{which}[{i}]"))
                except ConfigError as e:
                    errors.append(e)
            return tuple(out)

        inputs, outputs = ports(raw_inputs, "inputs"), ports(raw_outputs, "outputs")
        params = []
        for pname, domain in (raw_params or {}).items():
            if not isinstance(domain, list) or not domain:
                errors.append(ConfigError("a parameter's domain is a non-empty list", file=file,
                                          key=f"{key}.params.{pname}", found=repr(domain)))
                continue
            kinds = {type(v) for v in domain}
            if not all(isinstance(v, _SCALARS) for v in domain):
                errors.append(ConfigError("a parameter's values are scalars", file=file,
                                          key=f"{key}.params.{pname}",
                                          expected="strings, integers, floats or booleans",
                                          found=repr(domain)[:80]))
                continue
            if len(kinds) != 1:
                errors.append(ConfigError("a parameter's values share one type", file=file,
                                          key=f"{key}.params.{pname}",
                                          found=", ".join(sorted(k.__name__ for k in kinds))))
            params.append((pname, tuple(domain)))
        fam = Family(name, doc, inputs, outputs, tuple(params), (), tuple(raw_attrs or {}),
                     semantics, bool(row_invariant), tuple(map(str, raw_weights or ())),
                     tuple((str(k), str(v)) for k, v in (raw_inplace or {}).items()),
                     tuple((raw_example or {}).items()),
                     tuple((str(k), str(v)) for k, v in (raw_ranges or {}).items()),
                     tuple((raw_attrs or {}).items()), bool(view),
                     tuple((str(k), str(v)) for k, v in (raw_traffic or {}).items()),
                     bool(collective), str(file))
        points: list[Point] = []
        for i, raw in enumerate(raw_points or []):
            pkey = f"{key}.points[{i}]"
            if not isinstance(raw, dict):
                errors.append(ConfigError("a point is a table", file=file, key=pkey))
                continue
            for assignment in _expand(raw):
                points.append(fam._point(assignment, file, pkey, errors))
        names = [p.name for p in inputs + outputs]
        for dup in {n for n in names if names.count(n) > 1}:
            errors.append(ConfigError("duplicate port name", file=file, key=f"{key}.{dup}"))
        for w in fam.weights:
            if w not in [p.name for p in inputs]:
                errors.append(ConfigError("a weight is one of the inputs", file=file,
                                          key=f"{key}.weights", found=w))
        for out_name, in_name in fam.inplace:
            if out_name not in [p.name for p in outputs] or in_name not in [p.name for p in inputs]:
                errors.append(ConfigError("inplace pairs an output with an input", file=file,
                                          key=f"{key}.inplace.{out_name}", found=in_name))
        return attrs.evolve(fam, points=tuple(points))

    def to_table(self) -> dict[str, Any]:
        """The TOML table of this family (points written one per assignment)."""
        table: dict[str, Any] = {}
        if self.doc:
            table["doc"] = self.doc
        if self.semantics != self.name:
            table["semantics"] = self.semantics
        if not self.row_invariant:
            table["row_invariant"] = False
        table["inputs"] = [str(p) for p in self.inputs]
        table["outputs"] = [str(p) for p in self.outputs]
        if self.weights:
            table["weights"] = list(self.weights)
        if self.attr_examples:
            table["attrs"] = dict(self.attr_examples)
        if self.inplace:
            table["inplace"] = dict(self.inplace)
        if self.example:
            table["example"] = dict(self.example)
        if self.ranges:
            table["ranges"] = dict(self.ranges)
        if self.view:
            table["view"] = True
        if self.traffic:
            table["traffic"] = dict(self.traffic)
        if self.collective:
            table["collective"] = True
        table["params"] = {k: list(v) for k, v in self.params}
        table["points"] = [p.as_dict() for p in self.points]
        return table


_SCALARS = (str, int, float, bool)


def _scalar_table(raw: Any, types: tuple[type, ...], message: str, file: object, key: str,
                  errors: list[MetraleError]) -> dict[str, Any]:
    """The entries of ``raw`` whose values have one of ``types`` (never a bool for ``int``);
    an error for each other one."""
    out = {}
    for name, value in (raw or {}).items():
        if isinstance(value, types) and not (isinstance(value, bool) and bool not in types):
            out[name] = value
        else:
            errors.append(ConfigError(message, file=file, key=f"{key}.{name}",
                                      expected="/".join(t.__name__ for t in types),
                                      found=repr(value)[:80]))
    return out


def rename_dims(ty: Ty, dims: Mapping[str, str | int]) -> Ty:
    """``ty`` with named dims replaced through ``dims`` (others kept)."""
    return Ty(*(TensorType(tuple(dims.get(d, d) if isinstance(d, str) else d for d in t.shape),
                           t.dtype, t.fmt) for t in ty))


def families_by_name(families: Iterable[Family]) -> dict[str, Family]:
    return {f.name: f for f in families}
