"""Kernel cases shared by the tiers that run CUDA kernels (tests/cuda on the GPU, tests/host
through the emulation): a family's inputs at given sizes, the reference's keyword arguments,
and the comparison with the reference's outputs.

Inputs are fresh random values, never zeros; quantized weights are quantized by ``lkb.quant``
and the reference is given the dequantized values.
"""

from __future__ import annotations

import inspect
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from metrale.lkb.errors import LaunchError
from metrale.lkb.family import Family, Point
from metrale.lkb.quant import QuantFormat
from metrale.lkb.semantics import SEMANTICS

TOL = {"bf16": (1.6e-2, 1e-5), "f32": (1e-4, 1e-5)}
"""rtol, atol by output dtype. f32 is looser than 1.3e-6 because the GPU sums in a fixed
tree and the host in BLAS order: the difference of two orders is bounded by ~k·u·Σ|x·w|,
about 1e-4 relative for the example sizes (k ≤ 1280)."""


def seed_of(point: Any) -> int:
    """A point's input seed: the same in every run and process (``hash`` of a str is not)."""
    return zlib.crc32(str(point).encode())


def sizes_for(fam: Family, rows: int) -> dict[str, int]:
    """The family's example sizes at ``rows`` rows (slots grown to hold them)."""
    sizes = {**dict(fam.example), "rows": rows}
    if any(p.name == "slots" for p in fam.inputs):
        sizes["slots"] = max(sizes.get("slots", 1), rows)
    return sizes


def inputs(fam: Family, point: Point, sizes: dict[str, int], seed: int):
    """(host arrays for the semantics, device parts per port name) for one call."""
    rng = np.random.default_rng(seed)
    params = point.as_dict()
    ranges = dict(fam.ranges)
    host, device = [], {}
    for port in fam.inputs:
        t = port.type(params)
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in port.dims)
        if port.name == "slots":
            v = rng.permutation(sizes["slots"])[: shape[0]].astype(np.int32)
            host.append(v)
            device[port.name] = (v,)
            continue
        if port.name == "positions" and "slots" in [p.name for p in fam.inputs]:
            v = rng.integers(1, sizes[ranges["positions"]], size=shape).astype(np.int32)
            host.append(v)
            device[port.name] = (v,)
            continue
        if t.dtype.numpy.kind in "iu":
            lo, hi = ((0, sizes[ranges[port.name]]) if port.name in ranges else  # an index
                      (np.iinfo(t.dtype.numpy).min, np.iinfo(t.dtype.numpy).max))  # bits: keys
            v = rng.integers(lo, hi, size=shape, endpoint=port.name not in ranges
                             ).astype(t.dtype.numpy)
            host.append(v)
            device[port.name] = (v,)
            continue
        x = rng.standard_normal(shape).astype(np.float32)
        if port.name in fam.weights:
            x = x / np.float32(np.sqrt(shape[-1]))
            if t.fmt:
                qt = QuantFormat.parse(t.fmt).quantize(x)
                host.append(np.asarray(qt.dequantize(), np.float32))
                device[port.name] = (qt.data, qt.scale, qt.global_scale)
            else:
                stored = x.astype(t.dtype.numpy)
                host.append(stored.astype(np.float32))
                device[port.name] = (stored,)
        else:
            stored = x.astype(t.dtype.numpy)
            host.append(stored)
            device[port.name] = (stored,)
    return host, device


def kwargs(fam: Family, point: Point) -> dict:
    """The reference's keyword arguments at ``point``: its parameters and example attributes."""
    accepted = inspect.signature(SEMANTICS[fam.semantics]).parameters
    merged = {**dict(fam.attr_examples), **point.as_dict()}
    return {k: v for k, v in merged.items() if k in accepted}


def compare(point: Point, fam: Family, ref, got) -> None:
    """Each output of ``got`` written and within the dtype tolerance of ``ref``'s: NaN exactly
    where the reference has it (an unwritten, poisoned output shows as NaN where it has none),
    the rest within ``rtol`` of each value plus ``atol`` plus the larger of a tenth of ``rtol``
    and one unit in the last place, both at the reference's largest finite magnitude. The unit
    is for a rounded intermediate: within a k-block the reference sums in BLAS's order and a
    kernel in its own, so a matmul rounded to act before a residual add may differ by a unit,
    which a cancelling add keeps while it shrinks the output (linear_add, fp8: 0.1328 against
    0.125, its matmul near 1.1)."""
    for port, r, g in zip(fam.outputs, ref, got):
        assert g.shape == r.shape, port.name
        if g.dtype.kind in "iu":
            np.testing.assert_array_equal(g, r, err_msg=f"{point} {port.name}")
            continue
        g32, r32 = g.astype(np.float32), r.astype(np.float32)
        nan = np.isnan(r32)
        assert (np.isnan(g32) == nan).all(), \
            f"{point}: {port.name} NaN where the reference has none (unwritten?), or the reverse"
        g32, r32 = g32[~nan], r32[~nan]
        rtol, atol = TOL["f32" if g.dtype == np.float32 else "bf16"]
        scale = float(np.abs(r32).max(initial=0.0)) or 1.0
        ulp = float(np.spacing(np.asarray(scale, g.dtype)).astype(np.float32))
        np.testing.assert_allclose(g32, r32, rtol=rtol, atol=atol + max(rtol * scale * 0.1, ulp),
                                   err_msg=f"{point} output {port.name}")


Runner = Callable[..., list]
"""runner(fam, point, sizes, device[, attrs]) -> the outputs of one launch of point's kernel, as
host arrays: ``device`` maps each input port to (data,) or (data, scale, global); ``attrs``
overrides the family's example attributes."""


def split_linear_cases(P: Any, F: Any) -> list[tuple[str, str, str]]:
    """(family, across, weight) of the linear and linear_add points at the gemv shape whose
    kernel in ``F`` has gemv.cu's split launch (bf16 and fp8 weights, and linear's f32; fp4
    keeps one warp a column)."""
    return [(f, a, w) for f in ("linear", "linear_add") for a in ("sequential", "pairwise")
            for w in ("bf16", "fp8", "mxfp4", "nvfp4")
            for p in P.family(f).points
            if p.as_dict() == {**GEMM, "shape": "gemv", "across": a, "weight": w}
            and any(t.entry.endswith("_split") for t in F.realize(p).then)]


def row_invariant_points(points: list[tuple[Family, Point]], F: Any) -> list:
    """The points whose family and kernel declare row invariance and whose outputs have rows."""
    return [(f, p) for f, p in points if f.row_invariant and F.realize(p).row_invariant
            and any(port.dims[:1] == ("rows",) for port in f.outputs)]


def fewest_rows(fam: Family, kernel: Any) -> int:
    """The fewest rows ``kernel`` launches its family's example sizes at: 1, but where its limits
    refuse fewer (gemm_chain.cu: a row tile, 128), found by bisection (a limit on the rows is a
    lower bound); the checks launch a kernel past this."""
    def launches(rows: int) -> bool:
        try:
            kernel.launches_for({**sizes_for(fam, rows), **dict(fam.attr_examples)})
        except LaunchError:
            return False
        return True

    if launches(1):
        return 1
    lo, hi = 1, 4096  # not launches(lo), launches(hi)
    assert launches(hi), kernel
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if launches(mid) else (mid, hi)
    return hi


def check_rows(fam: Family, kernel: Any) -> int:
    """The rows a check launches ``kernel`` at: 3, or two past its fewest (:func:`fewest_rows`)."""
    least = fewest_rows(fam, kernel)
    return 3 if least == 1 else least + 2


def row_window(fam: Family, kernel: Any) -> tuple[int, slice]:
    """(rows, part) for :func:`check_row_invariance`: row 5 of 8, or for a kernel of a row
    floor, that many rows from row 2 of a launch that has two floors and four rows more."""
    least = fewest_rows(fam, kernel)
    return (8, slice(5, 6)) if least == 1 else (2 * least + 4, slice(2, 2 + least))


def check_either_width(fam: Family, point: Point, kernel: Any, runner: Runner,
                       sizes: dict[str, int]) -> None:
    """gemm_chain.cu's plain entries give the same bytes in 256-wide tiles and in 128-wide ones
    (m64n256k16 and m64n128k16 wgmmas: the same chain of 16-wide steps an output), which the
    launch picks by whether the wide tiles fill the multiprocessors (``sms`` bound here to one,
    then to more than any launch has tiles), so a row's bytes do not depend on the rows."""
    _, device = inputs(fam, point, sizes, seed=13)
    numbers = {**sizes, **dict(fam.attr_examples)}
    outs = []
    for sms in (1, 1 << 20):
        assert kernel.sizes({**numbers, "sms": sms})["wide"] == (sms == 1), sms
        outs.append(runner(fam, point, sizes, device, {"sms": sms}))
    for port, wide, narrow in zip(fam.outputs, *outs, strict=True):
        assert np.isfinite(wide.astype(np.float32)).all(), f"{point} {port.name}"
        assert wide.tobytes() == narrow.tobytes(), f"{point} {port.name}"


def check_row_invariance(fam: Family, point: Point, runner: Runner, rows: int = 8,
                         part: slice = slice(5, 6), dims: dict[str, int] | None = None) -> None:
    """Rows ``part`` of a ``rows``-row launch (row 5 of 8 unless told) have the bytes of the
    same rows launched alone; ``dims`` overrides the family's example sizes."""
    sizes = {**sizes_for(fam, rows), **(dims or {})}
    _, device = inputs(fam, point, sizes, seed=11)
    whole = runner(fam, point, sizes, {k: tuple(np.copy(x) if x is not None else None
                                                for x in v) for k, v in device.items()})
    part_device = {}
    for port in fam.inputs:
        parts = device[port.name]
        part_device[port.name] = (parts[0][part],) if port.dims[:1] == ("rows",) else parts
    alone = runner(fam, point, {**sizes, "rows": part.stop - part.start}, part_device)
    for port, w, a in zip(fam.outputs, whole, alone):
        if port.dims[:1] == ("rows",):
            assert w[part].tobytes() == a.tobytes(), f"{point} {port.name}"


GEMM_ROW_WINDOWS = [(150, slice(10, 74)), (70, slice(33, 34)), (130, slice(66, 130))]
"""(rows, part) for check_row_invariance at the gemm points: a launch of 1-64 rows runs blocks
of one warpgroup and a longer one blocks of two (sm_90's KERNELS.toml), so each window's rows
run alone on the one size and in the whole launch on the other, across row tiles too."""


def relation_cases(F: Any) -> list:
    """(relation, rhs point) for every point where the class of ``F`` declares a relation
    bit-identical."""
    from metrale.realize.relations import relations_on

    return [(r.relation, v.rhs) for r in relations_on(F) for v in r.points
            if v.status == "bit_identical"]


def check_relation(rel: Any, rhs: Point, P: Any, runner: Runner,
                   rows: int | None = None) -> None:
    """Both sides of ``rel`` at ``rhs``, run call by call through ``runner`` on the same inputs
    (the rhs call's ports generated as it wants them), give equal bytes; ``rows`` in place of
    the relation's example rows (for kernels with a row floor, :func:`check_rows`)."""
    from metrale.lkb.check import _sizes as relation_sizes

    sizes, u = relation_sizes(rel, P)
    params = rhs.as_dict()

    def call_sizes(which: str, idx: int, fam: Family) -> dict[str, int]:
        out = {}
        for port in (*fam.inputs, *fam.outputs):
            for d in port.dims:
                if isinstance(d, str):
                    out[d] = rows if d == "rows" and rows else sizes[u.find((which, idx, d))]
        return out

    rhs_call = rel.rhs.calls[0]
    rhs_fam = P.family(rhs_call.family)
    rs = call_sizes("rhs", 0, rhs_fam)
    if "slots" in rs:
        rs["slots"] = max(rs["slots"], rs["rows"])
    _, device = inputs(rhs_fam, rhs, rs, seed=5)
    env = {arg: device[port.name] for arg, port in zip(rhs_call.args, rhs_fam.inputs)}

    def run(side: str) -> dict[str, np.ndarray]:
        calls = rel.lhs.calls if side == "lhs" else rel.rhs.calls
        values = {k: tuple(None if x is None else np.copy(x) for x in v) for k, v in env.items()}
        for idx, c in enumerate(calls):
            fam = P.family(c.family)
            point_params = {k: dict(c.pins).get(k, params.get(k)) for k, _ in fam.params}
            if side == "lhs" and fam.name != rhs_fam.name:
                # a parameter the rhs does not have takes the lhs family's only compiled value
                for k, dom in fam.params:
                    if point_params[k] is None:
                        point_params[k] = dom[0]
            point = fam.point(**point_params)
            cs = call_sizes(side, idx, fam)
            if "slots" in cs:
                cs["slots"] = rs["slots"]
            args = {port.name: values[a] for a, port in zip(c.args, fam.inputs)}
            outs = runner(fam, point, cs, args)
            inplace = dict(fam.inplace)
            for name, port, o in zip(c.outs, fam.outputs, outs):
                values[name] = (o,)
                if port.name in inplace:  # the cache written in place: later calls read it
                    src = c.args[[p.name for p in fam.inputs].index(inplace[port.name])]
                    values[src] = (o,)
        return {name: values[name][0] for name in rel.outputs}

    lhs, rhs_out = run("lhs"), run("rhs")
    for name in rel.outputs:
        assert lhs[name].tobytes() == rhs_out[name].tobytes(), f"{rel.name} at {rhs}: {name}"


# (hq, hkv, head_dim, window): Llama-3.1-8B's and Qwen3-0.6B's heads, a group of three with head
# dim 80, head dim 256 (two slices of output columns), one q head a kv head (blocks of four row
# tiles: the whole launch in one block a kv head) and eight (eight warps, one row tile)
PREFILL_SHAPES = [(32, 8, 128, 0), (16, 8, 128, 100), (12, 4, 80, 0), (8, 4, 256, 300),
                  (8, 8, 64, 0), (16, 2, 64, 0)]


PREFILL_FAMILIES = ["attention", "kv_append_attention", "kv_append_attention_online"]
"""The families with tensor-core prefill kernels: the declared two-pass order's and the bounded
policy's online softmax (kv_append only, head dim up to 128)."""


def _stored(a: Any, act: str) -> np.ndarray:
    """``a`` as an act tensor is stored: bf16, or f32 as it is."""
    a = np.asarray(a, np.float32)
    return a.astype(ml_dtypes.bfloat16) if act == "bf16" else a


def check_combine_norm_hard_values(act: str, h: int, top_k: int, P: Any, runner: Runner) -> None:
    """moe_combine_add_rmsnorm against moe_combine then add_rmsnorm, each its own kernel, byte
    for byte, on values that test each rounding: experts whose weighted outputs cancel exactly
    (the sign of the zero), a residual that cancels the combine, ±0, subnormal values, an inf, a
    NaN, and an inf minus an inf. At h = 2880 (gpt-oss) the kernels take their vector path, at a
    width not a multiple of 8 the scalar one. f32 activations keep the products' low bits, so a
    fused multiply-add in place of the rounded product shows there. Row 2's NaN and inf make its
    norm NaN; rows 0 and 1 stay finite, so the check does not pass on NaN alone."""

    fam = P.family("moe_combine_add_rmsnorm")
    rng = np.random.default_rng(11)
    rows = 3
    y = rng.standard_normal((rows, top_k, h)).astype(np.float32)
    weights = rng.dirichlet(np.ones(top_k), rows).astype(np.float32)
    weights[0] = 0.0
    weights[0, :2] = 0.5
    y[0, 1, :40] = -y[0, 0, :40]                       # w·y0 + w·y1 = +0 exactly
    y[1, :, :8] = np.float32(1e-39)                    # subnormal (in bf16's range too)
    y[1, 0, 8:16] = -0.0
    y[2, 0, 5], y[2, 1, 6], y[2, 0, 7], y[2, 1, 7] = np.nan, np.inf, np.inf, np.inf
    y[2, 2, 7] = -np.inf                               # inf - inf: NaN
    y = _stored(y, act)
    combined = np.zeros((rows, h), np.float32)
    for s in range(top_k):
        combined = combined + weights[:, s, None] * y[:, s].astype(np.float32)
    x = _stored(rng.standard_normal((rows, h)), act)
    x[1, 20:60] = _stored(-combined[1, 20:60], act)    # the residual add cancels the combine
    x[0, 60:64] = -0.0
    w = (rng.standard_normal(h) * 0.5 + 1.0).astype(ml_dtypes.bfloat16)
    sizes = {"rows": rows, "top_k": top_k, "h": h}
    fused = runner(fam, fam.point(act=act, h_block=256), sizes,
                   {"x": (x,), "y": (y,), "weights": (weights,), "w": (w,)})
    comb, norm = P.family("moe_combine"), P.family("add_rmsnorm")
    (m,) = runner(comb, comb.point(act=act), sizes, {"y": (y,), "weights": (weights,)})
    two = runner(norm, norm.point(act=act, h_block=256), {"rows": rows, "h": h},
                 {"x": (x,), "r": (m,), "w": (w,)})
    assert [a.tobytes() for a in fused] == [b.tobytes() for b in two]
    s, n = (np.asarray(a, np.float32) for a in fused)
    assert np.isfinite(n[:2]).all() and np.isnan(n[2]).all()
    m0 = np.asarray(m, np.float32)[0, :40]
    assert (m0 == 0).all() and not np.signbit(m0).any()  # x + (-x) rounds to +0
    assert (s[1, 20:60] == 0).all()


def prefill_point(fam: Family) -> Point:
    """``fam``'s bf16 prefill point (its one KV block size: 256, or the online softmax's 64)."""
    return fam.point(act="bf16", mode="prefill", kv_block=fam.domains["kv_block"][0])


def skip_where_the_prefill_kernel_refuses(fam: Family, F: Any, hq: int, hkv: int,
                                          d: int) -> None:
    """Skip a prefill attention case whose heads ``fam``'s kernel on ``F``'s class refuses (its
    KERNELS.toml limits: the online kernel's head dim up to 128), as the fuser declines its
    relation there and the plans keep the two-pass kernel."""
    import pytest

    from metrale.plan.fuser import launch_refusal

    sizes = {**sizes_for(fam, 40), "hq": hq, "hkv": hkv, "d": d, "slots": 2, "max_ctx": 600}
    why = launch_refusal(F.realize(prefill_point(fam)), {**dict(fam.attr_examples), **sizes},
                         F.hw)
    if why:
        pytest.skip(f"{fam.name}'s kernel refuses these heads: {why}")


def check_prefill_attention(fam: Family, hq: int, hkv: int, d: int, window: int,
                            runner: Runner, F: Any, scattered: bool = False) -> None:
    """``fam``'s bf16 prefill point on a prompt's rows: 30 consecutive positions of one slot
    crossing a KV block (490..519), then 10 of another slot from position 0, so one tile of 16
    rows holds both slots; the cache past each slot's last position holds NaN. ``scattered``
    shuffles the rows, so no slot's positions follow the launch's row order (kv_append_attention
    then finds the rows that append a position by scanning, not by offset). Within the
    reference's tolerance, and to the last bf16 bit in all but 1 % of the outputs: the
    two-pass kernel takes exp's weights into its MMAs exactly (in bf16 alone, 35 % of the
    outputs move by a bit), and the online one rounds them to bf16 as its reference does."""
    point = prefill_point(fam)
    tensor_core = F.hw.capabilities.tensor_core != "none"
    assert F.realize(point).entry.endswith("_prefill") == tensor_core, F.realize(point).entry
    sizes = {**sizes_for(fam, 40), "hq": hq, "hkv": hkv, "d": d, "slots": 2, "max_ctx": 600}
    host, device = inputs(fam, point, sizes, seed=hq + d + window)
    positions = np.concatenate([np.arange(490, 520), np.arange(10)]).astype(np.int32)
    slots = np.concatenate([np.ones(30), np.zeros(10)]).astype(np.int32)
    if scattered:
        order = np.random.default_rng(d).permutation(40)
        positions, slots = positions[order], slots[order]
        assert len(set(positions[slots == 1] - np.flatnonzero(slots == 1))) > 1
    names = [port.name for port in fam.inputs]
    host[names.index("positions")], host[names.index("slots")] = positions, slots
    device["positions"], device["slots"] = (positions,), (slots,)
    # cache entries past each slot's prompt were never written: NaN, which no row attends to
    # and which must not reach the output, even with a weight of 0 in an MMA
    for name in ("k_cache", "v_cache"):
        cache = host[names.index(name)]
        cache[1, 520:] = np.nan
        cache[0, 10:] = np.nan
        device[name] = (cache.copy(),)
    attrs = {"window": window, "scale": d ** -0.5}
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **{**kwargs(fam, point), **attrs})
    got = runner(fam, point, sizes, device, attrs)
    compare(point, fam, ref, got)
    moved = float(np.mean(got[0].view(np.uint16) != ref[0].view(np.uint16)))
    assert moved < 0.01, f"{point}: {moved:.1%} of the outputs differ from the reference's bits"


def magnitude(rel: Any, fam: Family, point: Point, host: list, attrs: dict | None = None
              ) -> list:
    """The magnitude a bounded relation's bound scales with: the reference semantics of its
    (one-call) lhs at the absolute values of the inputs the bound ranges ``over`` (all float
    inputs when it names none), e.g. Σ|x||w| for a matmul, Σ p |v| for an attention, with the
    attributes its bound names ``at`` (then ``attrs``)."""
    over = set(rel.bound.over)
    args = []
    for arg, x in zip(rel.lhs.calls[0].args, host, strict=True):
        floating = x is not None and np.asarray(x).dtype.kind not in "iub"
        args.append(np.abs(x) if floating and (not over or arg in over) else x)
    return SEMANTICS[fam.semantics](*args, **{**kwargs(fam, point), **dict(rel.bound.at),
                                              **(attrs or {})})


def assert_within_bound(rel: Any, lhs: np.ndarray, rhs: np.ndarray, dims: dict[str, int],
                        where: str, mag: np.ndarray) -> None:
    """``rhs`` within bounded relation ``rel``'s declared bound of ``lhs``: |lhs - rhs| <= rel
    |lhs| + abs magnitude (``mag``, see :func:`magnitude`), the formulas at ``dims`` with
    eps_act bf16's; both finite, and lhs not all zeros (a bound on zeros says nothing)."""
    from metrale.lkb.relation import UNIT_ROUNDOFF, eval_bound

    env = {**{f"eps_{n}": u for n, u in UNIT_ROUNDOFF.items()}, "eps_act": UNIT_ROUNDOFF["bf16"],
           **dims}
    rel_b, abs_b = eval_bound(rel.bound.rel, env), eval_bound(rel.bound.abs, env)
    a, b = (np.asarray(np.asarray(x).astype(np.float32), np.float64) for x in (lhs, rhs))
    m = np.asarray(np.asarray(mag).astype(np.float32), np.float64)
    assert np.isfinite(a).all() and np.isfinite(b).all() and np.abs(a).max() > 0
    assert np.isfinite(m).all() and (m >= 0).all()
    allowed = rel_b * np.abs(a) + abs_b * m
    worst = float((np.abs(a - b) - allowed).max())
    assert worst <= 0, f"{rel.name} {where}: outside its bound by {worst:.3g}"


def check_online_attention_bound(hq: int, hkv: int, d: int, P: Any, F: Any,
                                 runner: Runner) -> None:
    """The relation online_prefill_attention's two sides on one class, on the same 300-row
    prompt from position 200 (tiles and KV blocks crossed): the online kernel against the
    two-pass one, within the relation's declared bound (assert_within_bound), and their caches
    byte-equal."""
    rel = P.relation("online_prefill_attention")
    lhs_fam, rhs_fam = P.family("kv_append_attention"), P.family("kv_append_attention_online")
    lhs, rhs = prefill_point(lhs_fam), prefill_point(rhs_fam)
    assert F.realize(lhs).entry.endswith("_attention_prefill"), F.realize(lhs)
    assert F.realize(rhs).entry.endswith("_online_prefill"), F.realize(rhs)
    rows = 300
    sizes = {**sizes_for(lhs_fam, rows), "hq": hq, "hkv": hkv, "d": d, "slots": 1,
             "max_ctx": 512}
    host, device = inputs(lhs_fam, lhs, sizes, seed=hq * 13 + d)
    positions = np.arange(200, 200 + rows, dtype=np.int32)
    device["positions"], device["slots"] = (positions,), (np.zeros(rows, np.int32),)
    names = [p.name for p in lhs_fam.inputs]
    host[names.index("positions")], host[names.index("slots")] = positions, np.zeros(
        rows, np.int32)
    attrs = {"window": 0, "scale": d ** -0.5}
    mag = magnitude(rel, lhs_fam, lhs, [np.copy(h) for h in host], attrs)[0]

    def run(fam: Family, point: Point) -> list:
        fresh = {k: tuple(None if x is None else np.copy(x) for x in v) for k, v in device.items()}
        return runner(fam, point, sizes, fresh, attrs)

    a_out, b_out = run(lhs_fam, lhs), run(rhs_fam, rhs)
    assert_within_bound(rel, a_out[0], b_out[0], {"max_ctx": sizes["max_ctx"]},
                        f"at {hq}/{hkv} heads, d {d}", mag)
    assert (a_out[0] != b_out[0]).any(), \
        "the two kernels gave equal outputs: the online one did not run"
    for name, x, y in zip(("k_cache", "v_cache"), a_out[1:], b_out[1:], strict=True):
        assert x.tobytes() == y.tobytes(), name


def check_online_attention_far_scores(P: Any, F: Any, runner: Runner) -> None:
    """The online prefill attention where a row's scores span far more than f32's exponent
    (keys scaled from -4 to 4 along a 160-row prompt, scale 1: a row's largest and smallest
    scores some 700 apart in log2 units), so that most weights fall below 2^-126 of the row's
    largest (sm_90's kernel flushes those to zero, the reference keeps them subnormal) and
    some are exactly zero: within the dtype's tolerance of the reference, all finite, with no
    more than 1 % of the outputs off the reference's bits; and within the relation's declared
    bound of the two-pass kernel."""
    rel = P.relation("online_prefill_attention")
    fam, lhs_fam = P.family("kv_append_attention_online"), P.family("kv_append_attention")
    point, lhs = prefill_point(fam), prefill_point(lhs_fam)
    rows, hq, hkv, d = 160, 8, 2, 64
    sizes = {**sizes_for(fam, rows), "hq": hq, "hkv": hkv, "d": d, "slots": 1, "max_ctx": 256}
    host, device = inputs(fam, point, sizes, seed=5)
    names = [port.name for port in fam.inputs]
    rng = np.random.default_rng(5)
    q = np.abs(rng.standard_normal((rows, hq, d))) + 0.5  # every q · k the sign of the key's
    k = np.linspace(-4, 4, rows)[:, None, None] * (np.abs(rng.standard_normal((rows, hkv, d)))
                                                   + 0.5)
    positions, slots = np.arange(rows, dtype=np.int32), np.zeros(rows, np.int32)
    for name, x in (("q", q), ("k", k), ("positions", positions), ("slots", slots)):
        stored = x if x.dtype.kind == "i" else _stored(x, "bf16")
        host[names.index(name)], device[name] = stored, (stored.copy(),)
    attrs = {"window": 0, "scale": 1.0}
    # the case is what it claims: weights below 2^-126 of their row's largest, and below 2^-149
    qs, ks = (np.asarray(host[names.index(n)], np.float32) for n in ("q", "k"))
    # the first q head of each kv head against its keys, in log2 units
    s2 = np.einsum("rhd,jhd->hrj", qs[:, ::hq // hkv], ks) * np.log2(np.e)
    s2 = np.where(np.tril(np.ones((rows, rows), bool)), s2, -np.inf)
    below = s2 - s2.max(axis=-1, keepdims=True)
    assert ((below < -126) & (below > -149)).any() and (below[np.isfinite(below)] < -149).any()
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **{**kwargs(fam, point), **attrs})
    fresh = {n: tuple(None if x is None else np.copy(x) for x in v) for n, v in device.items()}
    got = runner(fam, point, sizes, fresh, attrs)
    assert np.isfinite(got[0].astype(np.float32)).all()
    compare(point, fam, ref, got)
    moved = float(np.mean(got[0].view(np.uint16) != ref[0].view(np.uint16)))
    assert moved < 0.01, f"{point}: {moved:.1%} of the outputs differ from the reference's bits"
    mag = magnitude(rel, lhs_fam, lhs, [np.copy(h) for h in host], attrs)[0]
    fresh = {n: tuple(None if x is None else np.copy(x) for x in v) for n, v in device.items()}
    two_pass = runner(lhs_fam, lhs, sizes, fresh, attrs)
    assert_within_bound(rel, two_pass[0], got[0], {"max_ctx": sizes["max_ctx"]},
                        "on scores past f32's range", mag)


GEMM = {"act": "bf16", "shape": "gemm", "k_block": 256, "across": "sequential"}
"""The prefill GEMM point's parameters other than the weight format."""


def case_id(x: Any) -> str:
    """A parametrize id for (family, sizes) cases: the family, or the sizes as k544-n40."""
    return x if isinstance(x, str) else "-".join(f"{k}{v}" for k, v in x.items())


def matmul_point(fam: Family, shape: str, weight: str) -> Point:
    """``fam``'s bf16 point of ``shape`` (gemm, gemv or gemv_mma) in ``weight``; lm_head's
    gives f32 logits."""
    return fam.point(**{**GEMM, "shape": shape}, weight=weight,
                     **({"out": "f32"} if fam.name == "lm_head" else {}))


def reduced_dim(fam: Family) -> str:
    """The dim a matmul-like family reduces over: the last of its first weight's (w [n, k]: k;
    an expert's down projection wd [e, k, n]: n)."""
    return next(p for p in fam.inputs if p.name == fam.weights[0]).dims[-1]


def skip_unless_k_fits(weight: str, k: int) -> None:
    """Skip the test where ``weight``'s block (mxfp4 32, nvfp4 16) does not divide ``k``; fp8
    and bf16 take any k."""
    import pytest

    if weight != "bf16" and k % (QuantFormat.parse(weight).block_size or 1):
        pytest.skip(f"{weight} needs k a multiple of its block")


def check_gemm(family: str, dims: dict[str, int], weight: str, P: Any, F: Any,
               runner: Runner, shape: str = "gemm", k_block: int = 256) -> None:
    """``family``'s tensor-core point (``shape`` gemm, or gemv_mma; k in blocks of ``k_block``,
    16 the chain_* relations' one chain) in ``weight`` at ``dims`` (rows and the family's own
    sizes) against the reference on the dequantized weights, in the bf16 tolerance; a format
    whose block does not divide k is skipped (fp8 takes any k)."""
    fam = P.family(family)
    point = matmul_point(fam, shape, weight) if k_block == 256 else chain_point(fam)
    skip_unless_k_fits(weight, dims[reduced_dim(fam)])
    assert any(e.endswith(("_mma", "_wgmma", "_tma", "_chain"))
               for e in F.realize(point).entries), F.realize(point)
    sizes = {**sizes_for(fam, dims["rows"]), **dims}
    host, device = inputs(fam, point, sizes, seed=dims["rows"] * 7 + dims["k"])
    compare(point, fam, SEMANTICS[fam.semantics](*host, **kwargs(fam, point)),
            runner(fam, point, sizes, device))


def chain_point(fam: Family, weight: str = "bf16") -> Point:
    """``fam``'s gemm point in ``weight`` whose k is one chain of 16-wide steps (sm_90's
    gemm_chain.cu); lm_head's gives f32 logits."""
    return fam.point(**{**GEMM, "k_block": 16}, weight=weight,
                     **({"out": "f32"} if fam.name == "lm_head" else {}))


def use_shape(eng: Any, mode: str, rows: int, shape: str) -> None:
    """Make ``eng``'s ``rows``-row step of ``mode`` the plan whose matmuls take their ``shape``
    points, every relation applied in the presentation's priority order (as ``met tune`` imposes
    an alternative), whatever the evidence the engine's store holds would choose: a tiny model's
    prefill, chosen by cost, runs the GEMVs; a device's store with other records may plan a
    bounded decode on the gemm points."""
    from metrale.plan.plan import plan_for
    from metrale.plan.search import alternatives

    chosen = eng.plan(mode, rows)
    alt = next(c for c in alternatives(chosen.choice) if c.shape == shape and not c.skip)
    eng.use_plan(plan_for(eng.config, eng.quant, eng.hardware, mode=mode, rows=rows,
                          act=eng.act, context=eng.max_ctx, policy=eng.policy,
                          cache_slots=eng.slots if mode == "prefill" else None, choice=alt))


def cancelling(fam: Family, host: list, device: dict, k: int, gain: float) -> None:
    """Make every dot of a matmul-like call cancel, in place: the reduced activation's second
    half the negated first (times ``gain``, exact in bf16 for a power of two), each weight row's
    second half a copy of its first (bf16 values; mxfp4 data and scale bytes, whose blocks of 32
    then line up for k a multiple of 64), biases zero. Each dot is then zero in exact arithmetic
    and its computed value only rounding, which a bound in |lhs| alone cannot cover."""
    assert k % 64 == 0, k
    half = k // 2
    floats = [(i, p) for i, p in enumerate(fam.inputs) if host[i] is not None
              and np.asarray(host[i]).dtype.kind == "f"]
    for i, port in floats:
        if port.dims[-1] != reduced_dim(fam):
            if port.name in fam.weights:  # a bias: zero, so the outputs are the rounding alone
                host[i][...] = 0
                device[port.name] = tuple(np.zeros_like(p) for p in device[port.name])
            continue
        if port.name in fam.weights:
            host[i][..., half:] = host[i][..., :half]
            for part in device[port.name]:  # bf16 values, or mxfp4 data and block scales
                if part is not None and np.ndim(part) and part.shape[-1] in (k, k // 2, k // 32):
                    h = part.shape[-1] // 2
                    part[..., h:] = part[..., :h]
        else:
            x = host[i]
            x[..., :half] = (x[..., :half].astype(np.float32) * np.float32(gain)).astype(x.dtype)
            x[..., half:] = -x[..., :half]
            device[port.name] = (x,)


def check_mma_gemv_bound(family: str, dims: dict[str, int], weight: str, P: Any, F: Any,
                         runner: Runner, cancel: bool = False) -> None:
    """The relation mma_gemv_<family>'s two sides on one class, on the same inputs: the CUDA-core
    GEMV (``gemv``) and the tensor-core one (``gemv_mma``) agree within the relation's declared
    bound (assert_within_bound), with k the launch's. ``cancel``: on inputs whose every dot
    cancels (:func:`cancelling`, activations times 8: gates far past a clamp's limit too)."""
    fam = P.family(family)
    rel = P.relation(f"mma_gemv_{family}")
    lhs, rhs = matmul_point(fam, "gemv", weight), matmul_point(fam, "gemv_mma", weight)
    assert F.realize(rhs).entry.endswith("_gemv_mma"), F.realize(rhs)
    assert not F.realize(lhs).entry.endswith("mma"), F.realize(lhs)
    skip_unless_k_fits(weight, dims[reduced_dim(fam)])
    sizes = {**sizes_for(fam, dims["rows"]), **dims}
    host, device = inputs(fam, lhs, sizes, seed=dims["rows"] * 31 + dims["k"])
    if cancel:
        assert weight in ("bf16", "mxfp4"), weight  # the formats cancelling() mirrors
        cancelling(fam, host, device, sizes[reduced_dim(fam)], 8.0)
    mags = magnitude(rel, fam, lhs, host)
    for a, b, m in zip(runner(fam, lhs, sizes, device), runner(fam, rhs, sizes, device), mags,
                       strict=True):
        assert_within_bound(rel, a, b, sizes, f"at {weight}", m)


def mxfp4_scaled_inputs(fam: Family, rows: int, k: int, n: int, seed: int,
                        mark: Callable[[np.ndarray, np.random.Generator], None]):
    """Inputs of a matmul family with mxfp4 weights whose scale bytes are 118-124 except where
    ``mark(scale, rng)`` sets others, and activations near 2^-118 so that products with scales
    up to 2^123 stay finite: (x, the dequantized f32 weights in port order, device parts)."""
    from metrale.lkb.quant import QuantTensor

    fmt = QuantFormat.parse("mxfp4")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, k)) * 2.0 ** -118).astype(ml_dtypes.bfloat16)
    weights, device = [], {"x": (x,)}
    for port in fam.inputs:
        if port.name not in fam.weights:
            continue
        specs = fmt.array_specs((n, k))
        data = rng.integers(0, 256, specs["data"][0], dtype=np.uint8)
        scale = rng.integers(118, 125, specs["scale"][0], dtype=np.uint8)
        mark(scale, rng)
        qt = QuantTensor(fmt, (n, k), data, scale.view(specs["scale"][1].numpy))
        weights.append(np.asarray(qt.dequantize(), np.float32))
        device[port.name] = (qt.data, qt.scale, qt.global_scale)
    return x, weights, device


def check_gemv_mma_mxfp4_scales(family: str, P: Any, F: Any, runner: Runner) -> None:
    """mxfp4 scale bytes past 128 (factors past bf16's 2^127: the tensor-core GEMV's second
    product) and 255 (e8m0's NaN) at the gemv_mma point of ``family``: one load of a row, every
    block of another row, every seventh of a third. Against the reference on the dequantized
    weights, NaN exactly where it has NaN (the row with the NaN scale)."""
    fam = P.family(family)
    point = matmul_point(fam, "gemv_mma", "mxfp4")
    assert F.realize(point).entry.endswith("_gemv_mma"), F.realize(point)
    rows, k, n = 3, 1024, 40

    def mark(scale: np.ndarray, rng: np.random.Generator) -> None:
        scale[5, 3] = 245  # one load of a row
        scale[17, :] = rng.integers(129, 251, k // 32)  # every block of one row
        scale[30, ::7] = 129
        scale[33, 9] = 255  # NaN: row 33's dots are NaN

    x, weights, device = mxfp4_scaled_inputs(fam, rows, k, n, 129, mark)
    (ref,) = SEMANTICS[fam.semantics](x, *weights, **kwargs(fam, point))
    assert np.isnan(ref.astype(np.float32)[:, 33]).all()
    (dots,) = SEMANTICS["linear"](x, weights[0], k_block=256, out="f32", act="bf16")
    assert (np.abs(dots[:, 17]) > 1.0).all()  # the large scales count
    sizes = {**sizes_for(fam, rows), "k": k, "n": n}
    compare(point, fam, (ref,), runner(fam, point, sizes, device))


def check_gemm_exact(weight: str, rows: int, k: int, n: int, P: Any, runner: Runner,
                     shape: str = "gemm") -> None:
    """Small integers in x and weights on the e2m1 grid make every product and partial sum exact
    in f32, whatever the order: linear's tensor-core kernel must give the reference's bytes,
    which pins each output to its row and column (a wrong fragment layout or tile index moves
    values). f32 weights are integers of 18 significant bits against x of ±1 (k under 64 keeps
    the sums below 2^24), so each weight's three bf16 parts (8, 8 and 2 bits) all count."""
    fam = P.family("linear")
    point = matmul_point(fam, shape, weight)
    rng = np.random.default_rng(3)
    if weight == "f32":
        assert k < 64, "18-bit weights keep every sum exact only below 64 columns"
        x = rng.choice(np.array([-1, 1], np.float32), (rows, k))
        w = rng.integers(2**17, 2**18, (n, k)) * rng.choice([-1, 1], (n, k))
        w = w.astype(np.float32)
    else:
        x = rng.integers(-3, 4, (rows, k)).astype(np.float32)
        x[x == 0] = 5  # every product counts
        w = rng.choice(np.array([-6, -4, -2, -1, 1, 1.5, 3, 6], np.float32), (n, k))
    if weight == "f32":
        parts = (w, None, None)
    elif weight == "mxfp4":
        qt = QuantFormat.parse("mxfp4").quantize(w)
        assert np.array_equal(np.asarray(qt.dequantize(), np.float32), w)  # scale 2^0, on grid
        parts = (qt.data, qt.scale, qt.global_scale)
    else:
        parts = (w.astype(ml_dtypes.bfloat16), None, None)
    xb = x.astype(ml_dtypes.bfloat16)
    (y,) = runner(fam, point, {"rows": rows, "k": k, "n": n}, {"x": (xb,), "w": parts})
    (ref,) = SEMANTICS["linear"](xb, w, **kwargs(fam, point))
    assert np.abs(ref.astype(np.float32)).max() > 100  # large sums, exact in f32 (< 2^24)
    assert y.tobytes() == ref.tobytes()



def adversarial_rows(x: np.ndarray) -> None:
    """Rows 0-4 of ``x`` (rows x k, bf16 or f32) made adversarial in place, the rest left as
    drawn: row 0 a NaN, row 1 +inf and -inf (its dots NaN), row 2 subnormals, row 3 signed
    zeros, row 4 large values of alternating sign (sums that cancel)."""
    k = x.shape[1]
    x[0, k // 3] = np.nan
    if len(x) > 1:
        x[1, 1], x[1, k - 1] = np.inf, -np.inf
    if len(x) > 2:
        x[2] = (x[2].astype(np.float32) * np.float32(2.0 ** -130)).astype(x.dtype)
    if len(x) > 3:
        x[3] = np.where(np.arange(k) % 2 == 0, 0.0, -0.0).astype(x.dtype)
    if len(x) > 4:
        x[4] = (np.where(np.arange(k) % 2 == 0, 1.0, -1.0) * 2.0 ** 100
                * (1 + (np.arange(k) % 5) / 8)).astype(x.dtype)


def check_rows_alone(fam: Family, point: Point, runner: Runner, rows: int,
                     dims: dict[str, int] | None = None, seed: int = 5) -> list:
    """Every row of a ``rows``-row launch has the bytes of that row launched alone (one row: the
    one-row entries), on x rows made adversarial (``adversarial_rows``) and outputs poisoned;
    rows 5 and on, drawn at random, are finite. Returns the whole launch's outputs."""
    sizes = {**sizes_for(fam, rows), **(dims or {})}
    _, device = inputs(fam, point, sizes, seed=seed)
    adversarial_rows(device["x"][0])
    whole = runner(fam, point, sizes, {k: tuple(np.copy(x) if x is not None else None
                                                for x in v) for k, v in device.items()})
    for i in range(rows):
        alone_device = {port.name: (device[port.name][0][i:i + 1],)
                        if port.dims[:1] == ("rows",) else device[port.name]
                        for port in fam.inputs}
        alone = runner(fam, point, {**sizes, "rows": 1}, alone_device)
        for port, w, a in zip(fam.outputs, whole, alone, strict=True):
            if port.dims[:1] == ("rows",):
                assert w[i:i + 1].tobytes() == a.tobytes(), f"{point} {port.name} row {i}/{rows}"
    for port, w in zip(fam.outputs, whole, strict=True):
        if port.dims[:1] == ("rows",):
            assert np.isfinite(w[5:].astype(np.float32)).all(), f"{point} {port.name}"
    return whole


MULTI_ROW_FAMILIES = ("linear", "linear_add", "qkv", "gate_up_swiglu", "lm_head", "linear_bias",
                      "qkv_bias")
"""The GEMV-shaped families with gemv.cu's multi-row entries."""


def multi_row_entry(kernel: Any, numbers: dict[str, int]) -> str:
    """The one entry ``kernel`` launches at ``numbers``, which must be a multi-row one."""
    (entry, _, _), = kernel.launches_for(numbers)
    assert "_rows" in entry, (kernel.entry, entry)
    return entry
