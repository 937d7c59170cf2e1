"""The semantic check of a presentation on the host: relations and row-invariance, run for real.

For every relation and every compiled point of its rhs, both sides run on the same inputs of
each kind in :data:`KINDS`: random normal values rounded to each port's dtype (never zeros),
and the adversarial ones: large opposite terms that cancel in every reduction, signed zeros,
denormals, infinities and NaNs of both signs and two payloads (integer inputs stay within
their declared ranges). ``bit_identical`` sides must give equal bytes, NaN payloads and signs
included; ``bounded`` ones stay within their bound,

    |lhs - rhs| <= rel * |lhs| + abs * magnitude        (elementwise)

where ``magnitude`` is the lhs evaluated at the absolute values of the inputs the bound names
(``over``, default all): for a reordered sum, the sum of the magnitudes of its terms, which is
what floating-point error analysis bounds a reassociation by (a bound in |lhs| alone fails
under cancellation). Where the magnitude is not finite (an inf or NaN input, or an overflow)
a bounded relation guarantees nothing. Every row-invariant point must give row ``r`` the same
bytes alone as in a batch.

>>> from metrale.lkb.presentation import Presentation
>>> P = Presentation.load()
>>> [f for f in check_relation(P, P.relation("add_rmsnorm"), seed=1) if not f.ok]
[]
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Collection, Iterator, Mapping
from typing import Any

import attrs
import numpy as np

from . import semantics_layout  # noqa: F401 - registers dequant
from .family import Family, Port
from .presentation import Presentation, _Unifier
from .relation import UNIT_ROUNDOFF, Relation, eval_bound
from .semantics import SEMANTICS


@attrs.frozen
class Finding:
    """The outcome of one check: which relation or family, at which point, and what was seen."""

    subject: str
    point: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'ok  ' if self.ok else 'FAIL'} {self.subject} @ {self.point}: {self.detail}"


def _kwargs(fam: Family, params: Mapping[str, Any]) -> dict[str, Any]:
    fn = SEMANTICS[fam.semantics]
    accepted = inspect.signature(fn).parameters
    merged = {**dict(fam.attr_examples), **params}
    return {k: v for k, v in merged.items() if k in accepted}


def _resolve_dtype(port: Port, params: Mapping[str, Any]) -> np.dtype:
    return port.type(params).dtype.numpy


KINDS = ("normal", "cancel", "signed_zero", "denormal", "inf", "nan")
"""The input sets every relation is tried on (see the module docstring)."""

_NANS = (np.uint32(0x7FC00001), np.uint32(0xFFC00000))


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype, is_weight: bool,
            bound: int | None, kind: str = "normal") -> np.ndarray:
    if dtype.kind in "iu":
        return rng.integers(0, max(bound or 1, 1), size=shape).astype(dtype)
    values = _adversarial(rng, rng.standard_normal(shape).astype(np.float32), is_weight, kind)
    rounded = values.astype(dtype).astype(np.float32)
    if is_weight:  # host weights are f32 (dequantized at load), of the dtype's values
        return rounded / np.float32(np.sqrt(max(shape[-1], 1)))
    return rounded.astype(dtype) if dtype != np.float32 else rounded


def _adversarial(rng: np.random.Generator, v: np.ndarray, is_weight: bool, kind: str
                 ) -> np.ndarray:
    """``v`` (f32) made into an input of ``kind``.

    ``cancel``: the last axis's second half repeats the first, negated on activations and
    as is on weights, both scaled by 2**12, plus small noise: every product of the first half
    meets its opposite in the second, so every k-reduction's terms are large and their sum
    small (and its block sums, too, cancel across blocks)."""
    if kind == "normal" or not v.size:
        return v
    if kind == "cancel":
        n = v.shape[-1] // 2
        if n:
            big = v[..., :n] * np.float32(2.0 ** 12)
            v = v.copy()
            v[..., :n] = big
            v[..., n:2 * n] = big if is_weight else -big
            v = v + rng.standard_normal(v.shape).astype(np.float32)
        return v
    v = v.copy()
    flat = v.reshape(-1)
    pick = rng.random(flat.size) < 0.25
    if kind == "signed_zero":
        flat[pick] = np.where(rng.random(int(pick.sum())) < 0.5, np.float32(0.0), np.float32(-0.0))
    elif kind == "denormal":
        flat[pick] = flat[pick] * np.float32(2.0 ** -133)  # below f32's (and bf16's) normal range
    elif kind == "inf":
        pick = rng.random(flat.size) < 0.02
        flat[pick] = np.where(rng.random(int(pick.sum())) < 0.5, np.float32(np.inf),
                              np.float32(-np.inf))
    elif kind == "nan":
        pick = rng.random(flat.size) < 0.02
        bits = flat.view(np.uint32)
        bits[pick] = np.where(rng.random(int(pick.sum())) < 0.5, _NANS[0], _NANS[1])
    return v


def _distinct_entries(rng: np.random.Generator, positions: np.ndarray, slots: np.ndarray,
                      bound: int) -> np.ndarray:
    """``positions`` with every repeated (slot, position) pair given a fresh position below
    ``bound``: rows that write a KV cache must write distinct entries (kv_append refuses two
    rows at one entry), and random draws repeat a pair now and then.

    >>> _distinct_entries(np.random.default_rng(0), np.array([3, 3, 3]), np.array([0, 1, 0]), 8)
    array([3, 3, 6])
    """
    if bound < len(positions):
        return positions
    out, seen = positions.copy(), set()
    for r in range(len(out)):
        while (int(slots[r]), int(out[r])) in seen:
            out[r] = rng.integers(0, bound)
        seen.add((int(slots[r]), int(out[r])))
    return out


def _point_params(rel: Relation, P: Presentation) -> Iterator[dict[str, Any]]:
    rhs_call = rel.rhs.calls[0]
    fam = P.family(rhs_call.family)
    pins = dict(rhs_call.pins)
    for point in fam.points:
        params = point.as_dict()
        if all(params.get(k) == v for k, v in pins.items()):
            yield params


def _sizes(rel: Relation, P: Presentation) -> tuple[dict[tuple, int], _Unifier]:
    """Unify the dims of every call through the relation's wires; size each class."""
    u = _Unifier()
    wire_dims: dict[tuple[str, str], tuple] = {}
    order = []
    for which, side in (("lhs", rel.lhs), ("rhs", rel.rhs)):
        for idx, c in enumerate(side.calls):
            fam = P.family(c.family)
            order.append((which, idx, fam))
            for arg, port in zip(c.args, fam.inputs):
                wire = (which, arg) if arg in side.defined else ("in", arg)
                dims = tuple((which, idx, d) for d in port.dims)
                if wire in wire_dims:
                    for a, b in zip(wire_dims[wire], dims):
                        u.union(a, b)
                else:
                    wire_dims[wire] = dims
            for out, port in zip(c.outs, fam.outputs):
                wire_dims[(which, out)] = tuple((which, idx, d) for d in port.dims)
    for name in rel.rhs.defined:
        for a, b in zip(wire_dims.get(("lhs", name), ()), wire_dims.get(("rhs", name), ())):
            u.union(a, b)
    sizes: dict[Any, int] = {}
    # The rhs family's example sizes win (it is the point being checked), then the lhs ones.
    for which, idx, fam in sorted(order, key=lambda t: t[0] != "rhs"):
        for d, size in fam.example:
            root = u.find((which, idx, d))
            sizes.setdefault(root, int(size))
    return sizes, u


def _run_side(rel: Relation, which: str, P: Presentation, env: dict[str, np.ndarray],
              params: Mapping[str, Any], attrs: Mapping[str, Any] | None = None
              ) -> dict[str, np.ndarray]:
    side = rel.lhs if which == "lhs" else rel.rhs
    values = {k: v.copy() for k, v in env.items()}
    for c in side.calls:
        fam = P.family(c.family)
        call_params = {k: params[k] for k in fam.domains if k in params}
        call_params.update(dict(c.pins))
        call_params.update(attrs or {})
        outs = SEMANTICS[fam.semantics](*(values[a] for a in c.args), **_kwargs(fam, call_params))
        for name, value in zip(c.outs, outs):
            values[name] = value
    return {name: values[name] for name in rel.rhs.defined}


def check_relation(P: Presentation, rel: Relation, seed: int = 0,
                   kinds: tuple[str, ...] = KINDS) -> list[Finding]:
    """Run both sides of ``rel`` at every compiled rhs point on inputs of every kind."""
    findings = []
    sizes, u = _sizes(rel, P)
    for params, kind in itertools.product(list(_point_params(rel, P)), kinds):
        rng = np.random.default_rng(seed)
        env: dict[str, np.ndarray] = {}
        position_bound: dict[str, int] = {}
        for idx, c in enumerate(rel.lhs.calls):
            fam = P.family(c.family)
            call_params = {**{k: params[k] for k in fam.domains if k in params}, **dict(c.pins)}
            ranges = dict(fam.ranges)
            for arg, port in zip(c.args, fam.inputs):
                if arg in env or arg in rel.lhs.defined:
                    continue
                shape = tuple(sizes[u.find(("lhs", idx, d))] if isinstance(d, str) else d
                              for d in port.dims)
                bound = None
                if port.name in ranges:
                    bound = sizes.get(u.find(("lhs", idx, ranges[port.name])))
                dtype = _resolve_dtype(port, call_params)
                env[arg] = _random(rng, shape, dtype, port.name in fam.weights, bound, kind)
                if port.name == "positions":
                    position_bound[arg] = bound or 1
        for c in rel.lhs.calls:  # rows that append to a cache need distinct entries
            ports = dict(zip((p.name for p in P.family(c.family).inputs), c.args))
            if "positions" in ports and "slots" in ports:
                pos = ports["positions"]
                env[pos] = _distinct_entries(rng, env[pos], env[ports["slots"]],
                                             position_bound.get(pos, 1))
        point = ",".join(f"{k}={v}" for k, v in params.items()) + f" ({kind} inputs)"
        try:
            with np.errstate(all="ignore"):  # overflow and invalid are what some kinds test
                lhs = _run_side(rel, "lhs", P, env, params)
                rhs = _run_side(rel, "rhs", P, env, params)
                mag = None if rel.exact else _run_side(rel, "lhs", P, _absolute(rel, env), params,
                                                       dict(rel.bound.at))
        except Exception as e:  # a side that cannot run is a finding, not a crash
            findings.append(Finding(rel.name, point, False, f"{type(e).__name__}: {e}"))
            continue
        findings.append(_compare(rel, lhs, rhs, params, sizes, u, point, mag))
    return findings


def _absolute(rel: Relation, env: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The inputs with those the bound ranges ``over`` (default: every float input) replaced
    by their absolute values: the lhs at them is the magnitude of what it combines."""
    over = set(rel.bound.over) if rel.bound is not None and rel.bound.over else None
    return {k: np.abs(v) if v.dtype.kind not in "iub" and (over is None or k in over) else v
            for k, v in env.items()}


def _compare(rel: Relation, lhs: dict, rhs: dict, params: Mapping[str, Any], sizes: dict,
             u: _Unifier, point: str, mag: dict | None = None) -> Finding:
    if rel.exact:
        for name in rel.outputs:
            a, b = lhs[name], rhs[name]
            if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
                diff = np.count_nonzero(np.asarray(a, np.float64) != np.asarray(b, np.float64))
                return Finding(rel.name, point, False,
                               f"claimed bit-identical, but output {name} differs in {diff} "
                               f"of {a.size} elements")
        return Finding(rel.name, point, True, "bit-identical")
    env: dict[str, float] = {f"eps_{k}": v for k, v in UNIT_ROUNDOFF.items()}
    env["eps_act"] = UNIT_ROUNDOFF.get(str(params.get("act", "f32")), UNIT_ROUNDOFF["f32"])
    for (side, _idx, d), size in _named(sizes, u):
        if side == "rhs":
            env[d] = float(size)
    assert rel.bound is not None
    rel_b = eval_bound(rel.bound.rel, env, rel.file, f"relation.{rel.name}.bound.rel")
    abs_b = eval_bound(rel.bound.abs, env, rel.file, f"relation.{rel.name}.bound.abs")
    worst = 0.0
    assert mag is not None
    for name in rel.outputs:
        a = np.asarray(lhs[name], np.float64)
        b = np.asarray(rhs[name], np.float64)
        m = np.asarray(mag[name], np.float64)
        guaranteed = np.isfinite(m)  # an inf or NaN input, or an overflow: no guarantee
        with np.errstate(all="ignore"):
            allowed = rel_b * np.abs(a) + abs_b * m
            diff = np.abs(a - b)
        bad = guaranteed & ~(diff <= allowed)
        if np.any(bad):
            excess = float(np.max(np.where(bad, np.nan_to_num(diff - allowed, nan=np.inf), 0)))
            return Finding(rel.name, point, False,
                           f"output {name} outside its bound (rel {rel_b:.3g}, abs {abs_b:.3g} "
                           f"x magnitude) at {int(bad.sum())} of {a.size} elements: worst "
                           f"excess {excess:.3g}")
        if np.any(guaranteed):
            worst = max(worst, float(np.max(diff[guaranteed])))
    return Finding(rel.name, point, True, f"within bound (max |diff| {worst:.3g})")


def _named(sizes: dict, u: _Unifier) -> Iterator[tuple[tuple, int]]:
    for key in list(u.parent):
        if isinstance(key, tuple) and len(key) == 3 and isinstance(key[2], str):
            root = u.find(key)
            if root in sizes:
                yield key, sizes[root]


def check_row_invariance(P: Presentation, fam: Family, seed: int = 0, rows: int = 5,
                         row: int = 2) -> list[Finding]:
    """Row ``row`` computed alone gives the bytes it gives inside a batch of ``rows``.

    Rows that carry a cache slot get distinct slots (decode batches: one sequence per row);
    rows sharing a sequence attend to each other by design, which is causality, not a leak.
    """
    findings = []
    if not fam.row_invariant:
        return findings
    sizes = {**dict(fam.example), "rows": rows}
    if any(p.name == "slots" for p in fam.inputs):
        sizes["slots"] = rows
    ranges = dict(fam.ranges)
    for point in fam.points:
        params = point.as_dict()
        rng = np.random.default_rng(seed)
        args = []
        for port in fam.inputs:
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in port.dims)
            dtype = _resolve_dtype(port, params)
            bound = sizes.get(ranges[port.name]) if port.name in ranges else None
            if port.name == "slots":
                args.append(rng.permutation(rows).astype(dtype))
                continue
            args.append(_random(rng, shape, dtype, port.name in fam.weights, bound))
        fn = SEMANTICS[fam.semantics]
        kwargs = _kwargs(fam, params)
        whole = fn(*(a.copy() for a in args), **kwargs)
        one_args = [a[row:row + 1].copy() if p.dims[:1] == ("rows",) else a.copy()
                    for a, p in zip(args, fam.inputs)]
        alone = fn(*one_args, **kwargs)
        ok = True
        for out, port, a, b in zip(fam.outputs, fam.outputs, whole, alone):
            if port.dims[:1] != ("rows",):
                continue
            if a[row:row + 1].tobytes() != b.tobytes():
                ok = False
                findings.append(Finding(fam.name, str(point), False,
                                        f"claims row-invariance, but output {out.name} of row "
                                        f"{row} differs alone vs in a batch of {rows}"))
        if ok:
            findings.append(Finding(fam.name, str(point), True, "row-invariant"))
    return findings


def check_presentation(P: Presentation, seeds: tuple[int, ...] = (0, 1),
                       only: Collection[str] | None = None) -> list[Finding]:
    """Every relation at every rhs point and every family's row-invariance, for each seed;
    with ``only``, the relations and families of those names alone."""
    findings: list[Finding] = []
    for seed in seeds:
        for rel in P.relations:
            if only is None or rel.name in only:
                findings.extend(check_relation(P, rel, seed))
        for fam in P.generators:
            if only is None or fam.name in only:
                findings.extend(check_row_invariance(P, fam, seed))
    return findings
