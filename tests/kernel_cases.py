"""Kernel cases shared by the tiers that run CUDA kernels (tests/cuda on the GPU, tests/host
through the emulation): a family's inputs at given sizes, the reference's keyword arguments,
and the comparison with the reference's outputs.

Inputs are fresh random values, never zeros; quantized weights are quantized by ``lkb.quant``
and the reference is given the dequantized values.
"""

from __future__ import annotations

import inspect

import numpy as np

from metrale.lkb.family import Family, Point
from metrale.lkb.quant import QuantFormat
from metrale.lkb.semantics import SEMANTICS

TOL = {"bf16": (1.6e-2, 1e-5), "f32": (1e-4, 1e-5)}
"""rtol, atol by output dtype. f32 is looser than 1.3e-6 because the GPU sums in a fixed
tree and the host in BLAS order: the difference of two orders is bounded by ~k·u·Σ|x·w|,
about 1e-4 relative for the example sizes (k ≤ 1280)."""


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
            v = rng.integers(0, sizes[ranges[port.name]], size=shape).astype(t.dtype.numpy)
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
    """Each output of ``got`` written and within the dtype tolerance of ``ref``'s."""
    for port, r, g in zip(fam.outputs, ref, got):
        assert g.shape == r.shape, port.name
        if g.dtype.kind in "iu":
            np.testing.assert_array_equal(g, r, err_msg=f"{point} {port.name}")
            continue
        g32, r32 = g.astype(np.float32), r.astype(np.float32)
        assert not np.isnan(g32).any() or np.isnan(r32).any(), f"{point}: {port.name} unwritten"
        rtol, atol = TOL["f32" if g.dtype == np.float32 else "bf16"]
        scale = float(np.abs(r32).max()) or 1.0
        np.testing.assert_allclose(g32, r32, rtol=rtol, atol=atol + rtol * scale * 0.1,
                                   err_msg=f"{point} output {port.name}")
