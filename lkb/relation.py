"""Relations of the LKB: fusion rules ``lhs = rhs`` over family points, with a numerics contract.

Each side is written in a small let-syntax, one statement per call, separated by ``;``::

    s = add(x, r); y = rmsnorm(s, w)
    s, y = add_rmsnorm(x, r, w)
    y = linear[k_block=256](x, w)          # pin a parameter with [name=value, ...]

Names used before they are defined are the relation's inputs (in order of first use on the
lhs); the names the rhs defines are its outputs, and the lhs must define them too. Parameters
not pinned are variables shared by name across the relation: ``act`` on ``add`` and ``act`` on
``rmsnorm`` must agree in a match, and the rhs takes its parameters from them.

``numerics`` is ``bit_identical`` (both sides give the same bytes, NaN payloads and signs
included) or ``bounded``, with ``bound = {rel = "...", abs = "...", over = [...]}``: formulas
in the relation's dims (``k`` …), unit roundoffs (``eps_bf16``, ``eps_f32``, ``eps_act``) and
``gamma(n, u)`` such that ``|lhs - rhs| <= rel * |lhs| + abs * magnitude`` elementwise, the
magnitude being the lhs at the absolute values of the inputs in ``over`` (default all): for a
reordered k-term sum, Σ|terms|, so that the bound survives cancellation. ``at = {attr = value}``
evaluates the magnitude with those attributes instead (a clamp's ``limit = inf``: a clamp bounds
the lhs, not the error of the sums it clamps).

>>> side = parse_side("s = add(x, r); y = rmsnorm[h_block=256](s, w)", "F.toml", "lhs")
>>> [c.family for c in side.calls], side.inputs, side.defined
(['add', 'rmsnorm'], ('x', 'r', 'w'), ('s', 'y'))
>>> parse_side("y = rmsnorm(s w)", "F.toml", "relation.bad.lhs")
Traceback (most recent call last):
...
metrale.lkb.errors.ConfigError: F.toml: relation.bad.lhs: col 15: expected ',' or ')' (found 'w')
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import ConfigError
from .ty import parse_expression

NUMERICS = ("bit_identical", "bounded")

_TOKEN = re.compile(r"\s*(?:(?P<name>[A-Za-z_][\w.]*)|(?P<num>-?\d+(?:\.\d*)?(?:e-?\d+)?)"
                    r"|(?P<punct>[=;,()\[\]]))")


@attrs.frozen
class Call:
    """One statement of a side: ``outs = family[pins](args)`` and where it starts (column)."""

    outs: tuple[str, ...]
    family: str
    pins: tuple[tuple[str, Any], ...]
    args: tuple[str, ...]
    col: int

    def __str__(self) -> str:
        pins = f"[{', '.join(f'{k}={v}' for k, v in self.pins)}]" if self.pins else ""
        return f"{', '.join(self.outs)} = {self.family}{pins}({', '.join(self.args)})"


@attrs.frozen
class Side:
    """A parsed side: its calls, its free inputs and the names it defines."""

    text: str
    calls: tuple[Call, ...]
    inputs: tuple[str, ...]
    defined: tuple[str, ...]

    def __str__(self) -> str:
        return "; ".join(map(str, self.calls))


def _tokens(text: str, file: object, key: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if not m:
            raise ConfigError(f"col {pos + 1}: unexpected character {text[pos]!r}", file=file,
                              key=key)
        kind = m.lastgroup or "punct"
        out.append((kind, m.group(kind), m.start(kind) + 1))
        pos = m.end()
    out.append(("end", "", len(text) + 1))
    return out


def _value(tok: tuple[str, str, int]) -> Any:
    kind, text, _ = tok
    if kind == "num":
        return float(text) if any(c in text for c in ".e") else int(text)
    if text in ("true", "false"):
        return text == "true"
    return text


def parse_side(text: str, file: object, key: str) -> Side:
    """Parse one side; a syntax error names the column where it happened."""
    toks = _tokens(text, file, key)
    i = 0

    def peek() -> tuple[str, str, int]:
        return toks[i]

    def take(kind: str | None = None, value: str | None = None, what: str = "") -> tuple:
        nonlocal i
        tok = toks[i]
        if (kind and tok[0] != kind) or (value is not None and tok[1] != value):
            found = repr(tok[1]) if tok[0] != "end" else "end of text"
            raise ConfigError(f"col {tok[2]}: expected {what or repr(value) or kind} "
                              f"(found {found})", file=file, key=key)
        i += 1
        return tok

    calls: list[Call] = []
    while True:
        start = peek()[2]
        outs = [take("name", what="a name")[1]]
        while peek()[1] == ",":
            take(value=",")
            outs.append(take("name", what="a name")[1])
        take(value="=", what="'='")
        family = take("name", what="a family name")[1]
        pins: list[tuple[str, Any]] = []
        if peek()[1] == "[":
            take(value="[")
            while True:
                pname = take("name", what="a parameter name")[1]
                take(value="=", what="'='")
                tok = peek()
                if tok[0] not in ("name", "num"):
                    take("name", what="a value")
                i += 1
                pins.append((pname, _value(tok)))
                if peek()[1] == ",":
                    take(value=",")
                    continue
                take(value="]", what="',' or ']'")
                break
        take(value="(", what="'('")
        args: list[str] = []
        if peek()[1] != ")":
            while True:
                args.append(take("name", what="an argument name")[1])
                if peek()[1] == ",":
                    take(value=",")
                    continue
                take(value=")", what="',' or ')'")
                break
        else:
            take(value=")")
        calls.append(Call(tuple(outs), family, tuple(pins), tuple(args), start))
        if peek()[0] == "end":
            break
        take(value=";", what="';' or end of text")
        if peek()[0] == "end":
            break
    defined: list[str] = []
    inputs: list[str] = []
    for c in calls:
        for a in c.args:
            if a not in defined and a not in inputs:
                inputs.append(a)
        for o in c.outs:
            if o in defined or o in inputs:
                raise ConfigError(f"col {c.col}: name {o!r} is defined twice or shadows an input",
                                  file=file, key=key)
            defined.append(o)
    return Side(text, tuple(calls), tuple(inputs), tuple(defined))


UNIT_ROUNDOFF = {"f64": 2.0 ** -53, "f32": 2.0 ** -24, "f16": 2.0 ** -11, "bf16": 2.0 ** -8,
                 "e4m3": 2.0 ** -4, "e5m2": 2.0 ** -3}

def gamma(n: float, u: float) -> float:
    """Higham's γ_n = n·u / (1 - n·u): a sum of n terms in any order, each addition rounded
    with unit roundoff u, errs by at most γ_{n-1} · Σ|terms| (infinite once n·u >= 1).

    >>> gamma(4, 2.0 ** -24) > 4 * 2.0 ** -24
    True
    """
    return math.inf if n * u >= 1 else n * u / (1 - n * u)


_FUNCS = {"sqrt": math.sqrt, "log2": math.log2, "ceil": math.ceil, "max": max, "min": min,
          "gamma": gamma}
_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
           ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b,
           ast.Pow: lambda a, b: a ** b}


def eval_bound(formula: str, env: Mapping[str, float], file: object = None,
               key: str = "") -> float:
    """Evaluate a bound formula (numbers, names, + - * / **, sqrt log2 ceil max min).

    >>> eval_bound("2 * eps_act + sqrt(k) * eps_f32", {"eps_act": 2**-8, "k": 64, "eps_f32": 2**-24})
    0.007812976837158203
    """
    try:
        tree = parse_expression(str(formula))
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # ValueError: a NUL byte; RecursionError/MemoryError: nesting past the parser's limit
        raise ConfigError("bad bound formula", file=file, key=key,
                          found=repr(formula)[:80]) from None

    def ev(n: ast.expr) -> float:
        if isinstance(n, ast.Constant) and isinstance(n.value, int | float):
            return float(n.value)
        if isinstance(n, ast.Name):
            if n.id not in env:
                raise ConfigError(f"unknown name {n.id!r} in bound formula", file=file, key=key,
                                  expected="one of " + ", ".join(sorted(env)))
            return float(env[n.id])
        if isinstance(n, ast.BinOp) and type(n.op) in _BINOPS:
            return _BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in _FUNCS:
            return float(_FUNCS[n.func.id](*(ev(a) for a in n.args)))
        raise ConfigError("bad bound formula", file=file, key=key, found=repr(formula))

    try:
        return ev(tree)
    except (ArithmeticError, ValueError, TypeError, RecursionError) as e:
        # 1 / 0, 9 ** 9 ** 9, sqrt(-1), max(), a deep unary chain: the formula cannot be a bound
        raise ConfigError(f"bound formula cannot be evaluated: {e}", file=file, key=key,
                          found=repr(formula)[:80]) from None


@attrs.frozen
class Bound:
    """``|lhs - rhs| <= rel * |lhs| + abs * magnitude`` elementwise, as formulas, where
    ``magnitude`` is the lhs evaluated at the absolute values of the inputs named in ``over``
    (all float inputs when empty): for a reordered sum, the sum of its terms' magnitudes.
    It holds wherever the magnitude is finite. ``at``: attributes (name, value) the magnitude's
    lhs is evaluated with in place of the call's (a clamp's limit of inf)."""

    rel: str = "0"
    abs: str = "0"
    over: tuple[str, ...] = ()
    at: tuple[tuple[str, float], ...] = ()


@attrs.frozen
class Relation:
    """A fusion rule: ``lhs`` rewrites to ``rhs`` (one call), with its numerics contract."""

    name: str
    lhs: Side
    rhs: Side
    numerics: str
    bound: Bound | None = None
    doc: str = ""
    priority: int = 0
    file: str = attrs.field(default="", eq=False)
    """Where it was read from (not part of its identity)."""

    @property
    def exact(self) -> bool:
        return self.numerics == "bit_identical"

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.rhs.defined

    @property
    def families(self) -> tuple[str, ...]:
        """The families the lhs is made of, in order."""
        return tuple(c.family for c in self.lhs.calls)

    def __str__(self) -> str:
        return f"{self.lhs}  ==>  {self.rhs}  [{self.numerics}]"

    def _repr_html_(self) -> str:
        from .relation_drawing import relation_html

        return relation_html(self)

    @staticmethod
    def from_table(name: str, table: Any, file: object, errors: list) -> Relation | None:
        from .files import Fields

        key = f"relation.{name}"
        f = Fields(table, file, key, errors)
        doc = f.take("doc", str, default="")
        lhs_text = f.take("lhs", str)
        rhs_text = f.take("rhs", str)
        numerics = f.take("numerics", str, choices=NUMERICS)
        raw_bound = f.take("bound", dict, default=None)
        priority = f.take("priority", int, default=0)
        f.close()
        sides = []
        for which, text in (("lhs", lhs_text), ("rhs", rhs_text)):
            if text is None:
                continue
            try:
                sides.append(parse_side(text, file, f"{key}.{which}"))
            except ConfigError as e:
                errors.append(e)
        bound = None
        if raw_bound is not None:
            bf = Fields(raw_bound, file, f"{key}.bound", errors)
            rel_f = str(bf.take("rel", (str, int, float), default="0"))
            abs_f = str(bf.take("abs", (str, int, float), default="0"))
            over = tuple(bf.take("over", list, default=[]) or ())
            at = bf.take("at", dict, default={}) or {}
            bf.close()
            for attr, value in at.items():
                if isinstance(value, bool) or not isinstance(value, int | float):
                    errors.append(ConfigError("a magnitude attribute is a number", file=file,
                                              key=f"{key}.bound.at.{attr}",
                                              expected="e.g. inf", found=repr(value)))
            bound = Bound(rel_f, abs_f, over, tuple(sorted((k, float(v)) for k, v in at.items()
                                                           if isinstance(v, int | float))))
        if numerics == "bounded" and bound is None:
            errors.append(ConfigError("a bounded relation states its bound", file=file,
                                      key=f"{key}.bound", expected="{rel = ..., abs = ...}"))
        if numerics == "bit_identical" and bound is not None:
            errors.append(ConfigError("a bit-identical relation has no bound", file=file,
                                      key=f"{key}.bound"))
        if len(sides) != 2 or numerics is None:
            return None
        return Relation(name, sides[0], sides[1], numerics, bound, doc or "", priority or 0,
                        str(file))

    def to_table(self) -> dict[str, Any]:
        table: dict[str, Any] = {}
        if self.doc:
            table["doc"] = self.doc
        table["lhs"] = self.lhs.text
        table["rhs"] = self.rhs.text
        table["numerics"] = self.numerics
        if self.bound is not None:
            table["bound"] = {"rel": self.bound.rel, "abs": self.bound.abs}
            if self.bound.over:
                table["bound"]["over"] = list(self.bound.over)
            if self.bound.at:
                table["bound"]["at"] = dict(self.bound.at)
        if self.priority:
            table["priority"] = self.priority
        return table
