"""Per-kernel bandwidth of a decode plan on the GPU, against the device-to-device copy rate.

Every distinct launch of the plan (family, point, bound shapes) is timed alone: 100 launches
captured in a CUDA graph, the replay timed (median of 7), inputs rotated across enough copies to exceed L2 so the
weights really come from HBM. Bytes are the plan's declared traffic for that launch. The
sum of the per-launch medians, times their count in the plan, approximates a graph-replayed
step without launch gaps. Writes ``benchmarks/results/gpu_kernels_<model>.json``.

Run on the lent GPU: ``python benchmarks/bench_gpu_kernels.py qwen3-0.6b llama-3.1-8b``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402

from metrale.lkb.presentation import Presentation  # noqa: E402
from metrale.lkb.quant import QuantFormat  # noqa: E402
from metrale.plan.plan import plan_for  # noqa: E402

L2_BYTES = 60 * 2**20


def _array(cp, t, rng, weight: bool):
    shape = tuple(int(d) for d in t.shape)
    if t.dtype.numpy.kind in "iu":
        return (cp.asarray(np.zeros(shape, t.dtype.numpy)),)
    x = rng.standard_normal(shape).astype(np.float32) / (np.sqrt(shape[-1]) if weight else 1)
    if t.fmt:
        qt = QuantFormat.parse(t.fmt).quantize(x)
        return (cp.asarray(qt.data), None if qt.scale is None else cp.asarray(qt.scale),
                None if qt.global_scale is None else cp.asarray(
                    np.asarray(qt.global_scale, np.float32).reshape(1)))
    return (cp.asarray(x.astype(t.dtype.numpy)),)


def bench_model(model: str, quant: str, rows: int, cp, backend, loader, rng) -> dict:
    P = Presentation.load()
    plan = plan_for(model, quant, "sm_90", mode="decode", rows=rows, context=1024)
    sizes = dict(plan.sizes)
    groups: dict[tuple, list] = {}
    for k in plan.launches:
        key = (str(k.point), k.box.dom, k.box.cod, tuple(sorted(k.box.params)))
        groups.setdefault(key, []).append(k)
    rows_out = []
    total_s = 0.0
    for key, ks in groups.items():
        k = ks[0]
        fam = P.family(k.family)
        bound = loader.bind(k.kernel)
        numbers = {**sizes, **{a: v for a, v in k.box.params if a not in fam.domains}}
        for port, t in zip((*fam.inputs, *fam.outputs), (*k.box.dom.types, *k.box.cod.types)):
            for fd, cd in zip(port.dims, t.shape):
                if isinstance(fd, str):
                    numbers[fd] = cd if isinstance(cd, int) else sizes[cd]
        bound_types = [t.bind(sizes) for t in (*k.box.dom.types, *k.box.cod.types)]
        in_bytes = sum(t.nbytes() for t in bound_types[:len(fam.inputs)])
        copies = max(1, min(8, int(4 * L2_BYTES // max(in_bytes, 1)) + 1))
        sets = []
        for _ in range(copies):
            ptrs = {}
            for port, t in zip(fam.inputs, bound_types[:len(fam.inputs)]):
                parts = _array(cp, t, rng, port.name in fam.weights)
                if port.name in ("positions",):
                    parts = (cp.full(parts[0].shape, 1023, cp.int32),)
                if port.name in ("slots",):
                    parts = (cp.arange(parts[0].shape[0], dtype=cp.int32),)
                ptrs[port.name] = parts[0].data.ptr
                if len(parts) > 1:
                    ptrs[port.name + "_scale"] = None if parts[1] is None else parts[1].data.ptr
                    ptrs[port.name + "_global"] = None if parts[2] is None else parts[2].data.ptr
                ptrs.setdefault("_keep", []).append(parts)
            inplace = dict(fam.inplace)
            for port, t in zip(fam.outputs, bound_types[len(fam.inputs):]):
                if port.name in inplace:
                    ptrs[port.name] = ptrs[inplace[port.name]]
                else:
                    out = cp.empty(t.nbytes(), cp.uint8)
                    ptrs[port.name] = out.data.ptr
                    ptrs["_keep"].append(out)
            sets.append(ptrs)
        work = {n: cp.zeros(b, cp.uint8) for n, b in bound.scratch_bytes(numbers).items()}
        for s in sets:  # one zeroed workspace: the launches run in stream order
            s.update({n: a.data.ptr for n, a in work.items()})
        grid, block, shared = k.kernel.launch_for(numbers)
        args = [bound.pack({n: v for n, v in s.items() if n != "_keep"}, numbers) for s in sets]
        fn = bound.handle
        # N launches captured in one graph and replayed: host launch cost stays out of the
        # figure, the per-kernel graph overhead (under a microsecond) stays in, as in a step.
        n = 100
        stream = backend.stream()
        backend.begin_capture(stream)
        for i in range(n):
            backend.launch(fn, grid, block, shared, args[i % len(args)], stream)
        graph = backend.end_capture(stream)
        backend.graph_launch(graph, stream)
        backend.synchronize(stream)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            backend.graph_launch(graph, stream)
            backend.synchronize(stream)
            times.append((time.perf_counter() - t0) / n)
        t_med = statistics.median(times)
        total_s += t_med * len(ks)
        rows_out.append({"point": key[0], "count": len(ks), "bytes": k.bytes_moved,
                         "median_s": t_med, "gb_per_s": k.bytes_moved / t_med / 1e9,
                         "grid": grid, "block": block})
        del sets
    return {"model": model, "quant": quant, "rows": rows, "floor_s": plan.floor_s,
            "bytes_moved": plan.bytes_moved, "sum_of_kernels_s": total_s,
            "launches": plan.kernel_count, "kernels": rows_out}


def main() -> None:
    import cupy as cp

    from metrale.runtime.cuda_loader import CudaLoader
    from metrale.runtime.cupy_backend import CupyBackend

    backend = CupyBackend()
    loader = CudaLoader(backend, "sm_90a")
    rng = np.random.default_rng(0)
    rate = device_copy_rate()
    print(f"device-to-device copy: {rate / 1e12:.2f} TB/s (read + write)")
    results = {"copy_rate_bytes_per_s": rate, "models": []}
    for spec in sys.argv[1:] or ["qwen3-0.6b"]:
        model, _, quant = spec.partition(":")
        for rows in (1,):
            r = bench_model(model, quant or "bf16", rows, cp, backend, loader, rng)
            results["models"].append(r)
            print(f"\n{model} {quant or 'bf16'} rows={rows}: {r['launches']} launches, "
                  f"sum of kernel medians {r['sum_of_kernels_s'] * 1e3:.3f} ms, floor "
                  f"{r['floor_s'] * 1e3:.3f} ms ({r['floor_s'] / r['sum_of_kernels_s']:.0%} "
                  f"of floor)")
            share = Counter()
            for k in r["kernels"]:
                share[k["point"].split("[")[0]] += k["median_s"] * k["count"]
            for name, t in share.most_common():
                print(f"  {name:<22} {t * 1e3:8.3f} ms")
            for k in sorted(r["kernels"], key=lambda k: -k["median_s"] * k["count"])[:8]:
                print(f"  {k['point'][:70]:<70} x{k['count']:<3} {k['median_s'] * 1e6:8.1f} us "
                      f"{k['gb_per_s']:7.0f} GB/s grid {k['grid']}")
    path = write_result("gpu_kernels", results)
    print(f"wrote {path}")
    json.dumps(results)


if __name__ == "__main__":
    main()
