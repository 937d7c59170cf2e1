"""Launch formulas and limits: arithmetic over named sizes, never code.

A KERNELS.toml table gives its launch shape, workspace bytes and limits as formulas over the
family's dims, attributes and parameters; this module parses and evaluates them, refusing
anything but numbers, names, arithmetic and a few functions (hand-written: about 40 lines of
``ast`` walking; no library evaluates a restricted expression language without also allowing
attribute access). A formula that passes that check is also compiled once into a Python
function of the sizes (no builtins, each name a lookup in the sizes), which evaluates it; the
walk gives the typed error wherever that function cannot.

>>> eval_formula("ceil(n / 4) * 2", {"n": 1030}), sorted(formula_names("hq // hkv * d"))
(516, ['d', 'hkv', 'hq'])
>>> limit_holds("hq % hkv == 0", {"hq": 32, "hkv": 8})
True
"""

from __future__ import annotations

import ast
import functools
import math
import operator
from collections.abc import Mapping
from typing import Any

from metrale.lkb.errors import ConfigError, LaunchError, nearest
from metrale.lkb.ty import compile_expression, parse_expression

__all__ = ["eval_formula", "formula_names", "limit_holds", "limit_names", "parse_formula"]

_FUNCS = {"ceil": math.ceil, "floor": math.floor, "min": min, "max": max}
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
        ast.Div: lambda a, b: a / b, ast.FloorDiv: lambda a, b: a // b,
        ast.Mod: lambda a, b: a % b}
_FORMULA_WORDS = "only numbers, names, + - * / // %, ceil, floor, min, max"
_NUMBERS = frozenset((int, float))  # the sizes' types the compiled formulas take (bool is not)


def parse_formula(text: Any, file: object = None, key: str = "") -> ast.expr:
    if not isinstance(text, str) or len(text) > 500 or (tree := _checked_tree(text)) is None:
        raise ConfigError(f"not a launch formula: {_FORMULA_WORDS}", file=file, key=key,
                          expected="arithmetic over sizes", found=repr(text)[:80])
    return tree


@functools.lru_cache(maxsize=4096)
def _checked_tree(text: str) -> ast.expr | None:
    """The parsed formula, or None when it is not one. Cached: a plan binds the same few
    hundred formulas at every layer, and parsing them again was most of the planning time.
    The trees are only read, never changed."""
    try:
        tree = parse_expression(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        # ValueError: a NUL byte; RecursionError/MemoryError: nesting past the parser's limit
        return None
    for n in ast.walk(tree):
        ok = (isinstance(n, ast.Constant) and type(n.value) in (int, float)
              or isinstance(n, ast.Name | ast.Load)
              or isinstance(n, ast.BinOp) and type(n.op) in _OPS
              or isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub | ast.UAdd)
              or type(n) in _OPS or isinstance(n, ast.USub | ast.UAdd)
              or isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in _FUNCS and not n.keywords)
        if not ok:
            return None
    return tree


def formula_names(text: str, file: object = None, key: str = "") -> frozenset[str]:
    """The sizes a formula reads (its function names left out); a bad formula raises.

    >>> sorted(formula_names("ceil((nq + nk) / 4) * rows"))
    ['nk', 'nq', 'rows']
    """
    tree = parse_formula(text, file, key)
    funcs = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in funcs)


@functools.lru_cache(maxsize=4096)
def _compiled(text: str) -> tuple[Any, Any] | None:
    """A checked formula as a Python function of the sizes, and a function reading the sizes it
    reads (a tuple; KeyError when one is missing); None when it is not a formula or does not
    compile (nesting past the compiler's limit). The function is the tree itself, each name
    read from the mapping and each call one of ``_FUNCS``, so it computes what the walk
    (``_walk``) computes, operation for operation: a plan binds a few hundred formulas a few
    hundred thousand times, and walking the tree was most of the planning time."""
    if len(text) > 500 or _checked_tree(text) is None:  # parse_formula's refusals: the walk's
        return None
    names = formula_names(text)

    class Sizes(ast.NodeTransformer):
        def visit_Call(self, n: ast.Call) -> ast.Call:
            n.args = [self.visit(a) for a in n.args]
            return n  # its function name stays a name: one of _FUNCS, the globals below

        def visit_Name(self, n: ast.Name) -> ast.expr:
            return ast.Subscript(ast.Name("sizes", ast.Load()), ast.Constant(n.id), ast.Load())

    try:
        body = ast.unparse(Sizes().visit(parse_expression(text)))
        code = compile_expression(f"lambda sizes: {body}")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    fn = eval(code, {"__builtins__": {}, **_FUNCS})  # noqa: S307
    if not names:
        return fn, lambda sizes: ()
    get = operator.itemgetter(*sorted(names))
    return fn, (get if len(names) > 1 else lambda sizes: (get(sizes),))


def eval_formula(text: str, env: Mapping[str, int | float], file: object = None,
                 key: str = "") -> int | float:
    """Evaluate a launch formula; ``/`` is true division, so ``ceil(n / 4)`` rounds up.

    >>> eval_formula("max(1, rows // 2) + k % 3", {"rows": 5, "k": 7})
    3
    """
    fast = _compiled(text) if isinstance(text, str) else None
    if fast is not None:
        fn, read = fast
        try:
            if _NUMBERS.issuperset(map(type, read(env))):
                return fn(env)
        except (LookupError, ArithmeticError, ValueError, TypeError, RecursionError):
            pass  # the walk says what went wrong, and where
    return _walk(text, env, file, key)


def _walk(text: str, env: Mapping[str, int | float], file: object, key: str) -> int | float:
    """``eval_formula`` by walking the tree: every bad formula and size, its typed error."""
    tree = parse_formula(text, file, key)

    def ev(n: ast.expr) -> int | float:
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            if n.id not in env:
                raise LaunchError(f"size {n.id!r} is not bound", file=file, key=key,
                                  expected="one of " + ", ".join(sorted(env)) if env else "a size",
                                  found=text, suggestion=nearest(n.id, env))
            value = env[n.id]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise LaunchError(f"size {n.id!r} is not a number", file=file, key=key,
                                  expected="an int or float", found=repr(value)[:80])
            return value
        if isinstance(n, ast.BinOp):
            try:
                return _OPS[type(n.op)](ev(n.left), ev(n.right))
            except ZeroDivisionError:
                raise LaunchError("division by zero in a launch formula", file=file, key=key,
                                  expected="a non-zero divisor", found=repr(text)[:80]) from None
        if isinstance(n, ast.UnaryOp):
            return -ev(n.operand) if isinstance(n.op, ast.USub) else ev(n.operand)
        assert isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        return _FUNCS[n.func.id](*(ev(a) for a in n.args))

    try:
        return ev(tree)
    except (ArithmeticError, ValueError, TypeError, RecursionError) as e:
        # ceil(1e400), max(), a deep unary chain: no launch dimension comes out
        raise LaunchError(f"launch formula cannot be evaluated: {e}", file=file, key=key,
                          expected="a number", found=repr(text)[:80]) from None


_LIMIT_OPS = {ast.Lt: lambda a, b: a < b, ast.LtE: lambda a, b: a <= b,
              ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b,
              ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b}


def _parse_limit(text: Any, file: object = None, key: str = "") -> tuple[str, Any, str]:
    """``"A op B"`` (one comparison of two launch formulas) as (A, op, B); else ConfigError."""
    parts = _split_limit(text) if isinstance(text, str) and len(text) <= 500 else None
    if parts is None:
        raise ConfigError("not a limit: one comparison (< <= > >= == !=) of two launch formulas",
                          file=file, key=key, expected="e.g. \"hq / hkv <= 8\"",
                          found=repr(text)[:80])
    left, op, right = parts
    for side in (left, right):
        parse_formula(side, file, key)
    return left, op, right


@functools.lru_cache(maxsize=1024)
def _split_limit(text: str) -> tuple[str, Any, str] | None:
    """A limit's two sides and comparison, or None when it is not one comparison (cached as
    the formulas are)."""
    try:
        tree = parse_expression(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (isinstance(tree, ast.Compare) and len(tree.ops) == 1
            and type(tree.ops[0]) in _LIMIT_OPS):
        return None
    return ast.unparse(tree.left), _LIMIT_OPS[type(tree.ops[0])], ast.unparse(tree.comparators[0])


def limit_names(text: str, file: object = None, key: str = "") -> frozenset[str]:
    """The sizes a limit reads.

    >>> sorted(limit_names("hq / hkv <= 8"))
    ['hkv', 'hq']
    """
    left, _, right = _parse_limit(text, file, key)
    return formula_names(left, file, key) | formula_names(right, file, key)


def limit_holds(text: str, env: Mapping[str, int | float], file: object = None,
                key: str = "") -> bool:
    """Whether a limit holds at these sizes.

    >>> limit_holds("d % 16 == 0", {"d": 80}), limit_holds("d % 16 == 0", {"d": 72})
    (True, False)
    """
    left, op, right = _parse_limit(text, file, key)
    return bool(op(eval_formula(left, env, file, key), eval_formula(right, env, file, key)))
