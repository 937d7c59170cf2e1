"""The LKB as an explicit presentation: generators (kernel families) and relations (fusions).

``Presentation.load()`` reads ``kernels/KERNEL_FAMILIES.toml`` and ``kernels/FUSIONS.toml``;
every mistake in them is reported at once (file, dotted key, expected, found), and nothing is
half-loaded. ``check()`` returns every structural violation; ``to_toml()`` writes the files
back (tomlkit keeps comments and order when the presentation was loaded from them).

>>> P = Presentation.load()
>>> P.check()
[]
>>> "rmsnorm" in P.family_names and "add_rmsnorm" in P.relation_names
True
>>> P == Presentation.load() and hash(P) == hash(Presentation.load())
True
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import tomlkit

from .errors import ConfigError, MetraleError, nearest
from .family import WEIGHT_FORMATS, Family, Point
from .files import atomic_write, raise_all, read_toml
from .relation import Relation, Side

FAMILIES_FILE = "KERNEL_FAMILIES.toml"
FUSIONS_FILE = "FUSIONS.toml"


def default_kernels_dir() -> Path:
    """The ``kernels/`` folder shipped with the package."""
    return Path(str(importlib.resources.files("metrale.kernels")))


@attrs.frozen(eq=False)
class Presentation:
    """``Presentation(generators, relations)``: immutable, hashable, checkable, extendable."""

    generators: tuple[Family, ...]
    relations: tuple[Relation, ...]
    sources: tuple[tuple[str, str], ...] = ()
    """The TOML texts it was loaded from (file name, text), kept for format-preserving writes."""
    _equations: dict[str, tuple] = attrs.field(factory=dict, eq=False, repr=False)

    def _key(self) -> tuple:
        return (self.generators, self.relations)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Presentation) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    # loading -------------------------------------------------------------------------------

    @staticmethod
    def load(kernels_dir: Path | str | None = None) -> Presentation:
        """Read both registries of ``kernels_dir`` (default: the shipped one)."""
        root = Path(kernels_dir) if kernels_dir is not None else default_kernels_dir()
        return Presentation.from_toml(root / FAMILIES_FILE, root / FUSIONS_FILE)

    @staticmethod
    def from_toml(families_path: Path | str, fusions_path: Path | str) -> Presentation:
        """Load, schema-check and structurally check the two files; raise every violation."""
        errors: list[MetraleError] = []
        families: list[Family] = []
        relations: list[Relation] = []
        texts = []
        for path, top, kind in ((families_path, "family", "families"),
                                (fusions_path, "relation", "relations")):
            path = Path(path)
            data = read_toml(path)
            texts.append((path.name, path.read_text(encoding="utf-8")))
            for extra in data:
                if extra != top:
                    errors.append(ConfigError("unknown top-level table", file=path, key=extra,
                                              suggestion=nearest(extra, [top])))
            tables = data.get(top, {})
            if not isinstance(tables, dict):
                errors.append(ConfigError(f"[{top}.NAME] tables expected", file=path, key=top))
                continue
            for name, table in tables.items():
                if kind == "families":
                    families.append(Family.from_table(name, table, path, errors))
                else:
                    rel = Relation.from_table(name, table, path, errors)
                    if rel is not None:
                        relations.append(rel)
        p = Presentation(tuple(families), tuple(relations), tuple(texts))
        errors.extend(p.check())
        raise_all(errors)
        return p

    # lookups -------------------------------------------------------------------------------

    @property
    def family_names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.generators)

    @property
    def relation_names(self) -> tuple[str, ...]:
        return tuple(r.name for r in self.relations)

    def family(self, name: str) -> Family:
        """The family called ``name``; an error naming the nearest one otherwise."""
        for f in self.generators:
            if f.name == name:
                return f
        raise ConfigError("unknown kernel family", key=name,
                          suggestion=nearest(name, self.family_names))

    def relation(self, name: str) -> Relation:
        for r in self.relations:
            if r.name == name:
                return r
        raise ConfigError("unknown relation", key=name,
                          suggestion=nearest(name, self.relation_names))

    def equation(self, name: str) -> tuple[Any, Any]:
        """Relation ``name`` as ``(lhs, rhs)`` diagrams over the generators
        (:func:`metrale.lkb.equation.equation`), built once.

        >>> lhs, rhs = Presentation.load().equation("linear_residual")
        >>> [b.name for b in lhs.boxes], [b.name for b in rhs.boxes]
        (['linear', 'add'], ['linear_add'])
        """
        found = self._equations.get(name)
        if found is None:
            from .equation import equation

            found = self._equations[name] = equation(self.relation(name), self)
        return found

    def points(self) -> tuple[Point, ...]:
        """Every compiled point of every family."""
        return tuple(p for f in self.generators for p in f.points)

    def extend(self, generators: Iterable[Family] = (), relations: Iterable[Relation] = ()
               ) -> Presentation:
        """A larger presentation; raises every violation the additions bring."""
        p = Presentation(self.generators + tuple(generators), self.relations + tuple(relations))
        raise_all(p.check())
        return p

    # checking ------------------------------------------------------------------------------

    def check(self) -> list[MetraleError]:
        """Every structural violation, in file order (an empty list when sound)."""
        errors: list[MetraleError] = []
        seen: dict[str, str] = {}
        for f in self.generators:
            if f.name in seen:
                errors.append(ConfigError("duplicate family name", file=f.file,
                                          key=f"family.{f.name}"))
            seen[f.name] = f.file
            if not f.points:
                errors.append(ConfigError("a family lists at least one point", file=f.file,
                                          key=f"family.{f.name}.points"))
            for p in f.points:
                try:
                    f.signature(p.as_dict())
                except ConfigError as e:
                    errors.append(e)
            _check_semantics(f, errors)
        rel_seen: set[str] = set()
        families = {f.name: f for f in self.generators}
        for r in self.relations:
            if r.name in rel_seen:
                errors.append(ConfigError("duplicate relation name", file=r.file,
                                          key=f"relation.{r.name}"))
            rel_seen.add(r.name)
            errors.extend(check_relation(r, families))
        return errors

    # writing -------------------------------------------------------------------------------

    def to_toml(self) -> tuple[str, str]:
        """``(KERNEL_FAMILIES.toml, FUSIONS.toml)`` texts.

        Tables that already stood in the loaded files keep their comments and order; new or
        changed ones are written plainly.
        """
        originals = dict(self.sources)
        out = []
        for file_name, top, items in ((FAMILIES_FILE, "family", self.generators),
                                      (FUSIONS_FILE, "relation", self.relations)):
            doc = tomlkit.parse(originals.get(file_name, ""))
            if top not in doc:
                doc[top] = tomlkit.table(is_super_table=True)
            tables = doc[top]
            wanted = {x.name: x for x in items}
            for name in list(tables.keys()):
                if name not in wanted:
                    del tables[name]
            for name, item in wanted.items():
                if name in tables and _reads_as(item, _plain(tables[name])):
                    continue
                tables[name] = item.to_table()
            out.append(tomlkit.dumps(doc))
        return out[0], out[1]

    def write(self, kernels_dir: Path | str) -> None:
        """Write both files into ``kernels_dir`` atomically."""
        fam, fus = self.to_toml()
        atomic_write(Path(kernels_dir) / FAMILIES_FILE, fam)
        atomic_write(Path(kernels_dir) / FUSIONS_FILE, fus)

    # printing ------------------------------------------------------------------------------

    def __str__(self) -> str:
        lines = [f"Presentation: {len(self.generators)} generators, "
                 f"{len(self.relations)} relations"]
        for f in self.generators:
            lines.append(f"  {f.name}: {len(f.points)} points")
        for r in self.relations:
            lines.append(f"  {r.name}: {r}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<Presentation {len(self.generators)} generators, "
                f"{len(self.relations)} relations>")

    def _repr_html_(self) -> str:
        from .presentation_html import presentation_html

        return presentation_html(self)


def _reads_as(item: Family | Relation, table: Any) -> bool:
    """Whether an existing TOML table already says exactly ``item`` (then it is kept as is)."""
    errors: list[MetraleError] = []
    parsed = type(item).from_table(item.name, table, item.file, errors)
    return not errors and parsed == item


def _plain(item: Any) -> Any:
    return item.unwrap() if hasattr(item, "unwrap") else item


def _check_semantics(f: Family, errors: list[MetraleError]) -> None:
    from . import semantics_layout  # noqa: F401 - registers dequant
    from .semantics import ROW_INVARIANT, SEMANTICS

    key = f"family.{f.name}.semantics"
    if f.semantics not in SEMANTICS:
        errors.append(ConfigError("no reference semantics of that name", file=f.file, key=key,
                                  found=repr(f.semantics),
                                  suggestion=nearest(f.semantics, SEMANTICS)))
    elif f.row_invariant and not ROW_INVARIANT.get(f.semantics, False):
        errors.append(ConfigError("claims row-invariance its semantics does not have",
                                  file=f.file, key=f"family.{f.name}.row_invariant"))


# relation typing ---------------------------------------------------------------------------


class _Unifier:
    """Union-find over dims (per call instance) and dtype terms (relation-wide variables)."""

    def __init__(self) -> None:
        self.parent: dict[Any, Any] = {}

    def find(self, x: Any) -> Any:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, a: Any, b: Any) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return True
        ca, cb = isinstance(ra, tuple) and ra[0] == "const", isinstance(rb, tuple) and rb[0] == "const"
        if ca and cb:
            return False
        if ca:
            ra, rb = rb, ra
        self.parent[ra] = rb
        return True


def _term(value: Any) -> Any:
    return ("const", value)


def _call_types(side: str, idx: int, call: Any, fam: Family, bindings: Mapping[str, Any]
                ) -> tuple[list[tuple], list[tuple]]:
    """Port types of one call as (dtype term, dim terms); dims are per-instance variables."""

    def port_type(port: Any) -> tuple:
        if port.dtype.startswith("{"):
            pname = port.dtype[1:-1]
            value = bindings.get(pname)
            if value is None:
                dtype = ("var", pname)
            else:
                dtype = _term(WEIGHT_FORMATS[value][1] or "bf16"
                              if value in WEIGHT_FORMATS else value)
        else:
            dtype = _term(port.dtype)
        dims = tuple(_term(d) if isinstance(d, int) else (side, idx, d) for d in port.dims)
        return (dtype, dims)

    return [port_type(p) for p in fam.inputs], [port_type(p) for p in fam.outputs]


def check_relation(r: Relation, families: Mapping[str, Family]) -> list[MetraleError]:
    """Every violation of one relation: undefined families, arity, pins, typing, interface."""
    errors: list[MetraleError] = []
    key = f"relation.{r.name}"

    def err(message: str, where: str = "", **kw: Any) -> None:
        errors.append(ConfigError(message, file=r.file, key=f"{key}{where}", **kw))

    for which, side in (("lhs", r.lhs), ("rhs", r.rhs)):
        for c in side.calls:
            if c.family not in families:
                err(f"col {c.col}: undefined family {c.family!r}", f".{which}",
                    suggestion=nearest(c.family, families))
    if errors:
        return errors
    if len(r.rhs.calls) != 1:
        err("the rhs must be one generator point (one call)", ".rhs",
            found=f"{len(r.rhs.calls)} calls")
    if set(r.rhs.defined) - set(r.lhs.defined):
        err("the lhs does not define every rhs output", ".lhs",
            expected=", ".join(r.rhs.defined), found=", ".join(r.lhs.defined))
    if set(r.rhs.inputs) != set(r.lhs.inputs):
        err("both sides must read the same inputs", ".rhs",
            expected=", ".join(r.lhs.inputs), found=", ".join(r.rhs.inputs))
    variables: dict[str, set[Any]] = {}
    for which, side in (("lhs", r.lhs), ("rhs", r.rhs)):
        for c in side.calls:
            fam = families[c.family]
            if len(c.args) != len(fam.inputs) or len(c.outs) != len(fam.outputs):
                err(f"col {c.col}: {c.family} takes {len(fam.inputs)} inputs and gives "
                    f"{len(fam.outputs)} outputs", f".{which}",
                    found=f"{len(c.args)} inputs, {len(c.outs)} outputs")
            domains = fam.domains
            for pname, value in c.pins:
                if pname not in domains:
                    err(f"col {c.col}: {c.family} has no parameter {pname!r}", f".{which}",
                        suggestion=nearest(pname, domains))
                elif value not in domains[pname]:
                    err(f"col {c.col}: {c.family}.{pname} outside its domain", f".{which}",
                        expected="one of " + ", ".join(map(str, domains[pname])),
                        found=repr(value))
            for pname in domains:
                if pname not in dict(c.pins):
                    variables.setdefault(pname, set()).add((which, c.family))
    if errors:
        return errors
    rhs_call = r.rhs.calls[0]
    rhs_fam = families[rhs_call.family]
    lhs_params = {p for c in r.lhs.calls for p in families[c.family].domains} | {
        p for c in r.lhs.calls for p, _ in c.pins}
    for pname in rhs_fam.domains:
        if pname not in dict(rhs_call.pins) and pname not in lhs_params:
            err(f"rhs parameter {pname!r} is not determined by the lhs", ".rhs",
                expected="pin it, or a lhs call with that parameter")
    if not any(all(p.as_dict().get(k) == v for k, v in rhs_call.pins) for p in rhs_fam.points):
        err("the rhs is not a compiled point of its family", ".rhs",
            expected=f"one of the points of {rhs_fam.name}", found=str(rhs_call))
    _check_typing(r, families, err)
    _check_connected(r.lhs, key, r.file, errors)
    return errors


def _check_typing(r: Relation, families: Mapping[str, Family], err: Any) -> None:
    u = _Unifier()
    wire_types: dict[tuple[str, str], tuple] = {}

    def unify(a: tuple, b: tuple, where: str, what: str) -> None:
        (da, dims_a), (db, dims_b) = a, b
        ok = u.union(da, db) and len(dims_a) == len(dims_b)
        if ok:
            ok = all(u.union(x, y) for x, y in zip(dims_a, dims_b))
        if not ok:
            err(f"ill-typed side: {what}", where, expected=_show(u, a), found=_show(u, b))

    for which, side in (("lhs", r.lhs), ("rhs", r.rhs)):
        for idx, c in enumerate(side.calls):
            fam = families[c.family]
            ins, outs = _call_types(which, idx, c, fam, dict(c.pins))
            for arg, t in zip(c.args, ins):
                wire = (which, arg) if arg in side.defined else ("in", arg)
                if wire in wire_types:
                    unify(wire_types[wire], t, f".{which}",
                          f"col {c.col}: {arg} into {c.family}")
                else:
                    wire_types[wire] = t
            for out, t in zip(c.outs, outs):
                wire_types[(which, out)] = t
    for name in r.rhs.defined:
        if ("lhs", name) in wire_types and ("rhs", name) in wire_types:
            unify(wire_types[("lhs", name)], wire_types[("rhs", name)], "",
                  f"dom/cod mismatch between sides at output {name}")


def _show(u: _Unifier, t: tuple) -> str:
    dtype, dims = t
    d = u.find(dtype)
    dname = d[1] if d[0] == "const" else "{" + str(d[1]) + "}"
    parts = []
    for x in dims:
        rx = u.find(x)
        parts.append(str(rx[1]) if rx[0] == "const" else str(rx[2]))
    return f"{dname}[{','.join(parts)}]"


def _check_connected(side: Side, key: str, file: str, errors: list[MetraleError]) -> None:
    """The lhs calls must be linked through shared names (a match is found from one anchor)."""
    if len(side.calls) <= 1:
        return
    reached = {0}
    names = set(side.calls[0].args) | set(side.calls[0].outs)
    changed = True
    while changed:
        changed = False
        for i, c in enumerate(side.calls):
            if i not in reached and (set(c.args) | set(c.outs)) & names:
                reached.add(i)
                names |= set(c.args) | set(c.outs)
                changed = True
    if len(reached) != len(side.calls):
        errors.append(ConfigError("the lhs is not connected (its calls share no names)",
                                  file=file, key=f"{key}.lhs"))
