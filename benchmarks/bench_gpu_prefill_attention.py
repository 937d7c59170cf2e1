"""The prefill attention kernel alone on the GPU, beside torch's fused attention and, optionally,
the same point's kernel from another kernels folder (an earlier revision).

For each model's heads (Qwen3-0.6B: 16 q heads over 8 kv heads, Llama-3.1-8B: 32 over 8; head
dim 128) and prompt length, one sequence from position 0: the sm_90 realization of
kv_append_attention's bf16 prefill point (what the prefill step launches) on random q, k and v,
its output poisoned first; the median of several CUDA-event-timed runs of back-to-back launches
after warm-up. In the same run: ``torch.nn.functional.scaled_dot_product_attention`` (causal,
grouped heads, on tensors already in its layout) as the peer, the largest difference from it
relative to its largest output, and the tensor-core floor of the attention's FLOPs (4 per q·k
and p·v pair of a row and each position it sees, times heads and head dim).

``--baseline DIR`` also runs the kernel a kernels folder DIR realizes for the same point (for
instance an earlier revision's, ``git archive REV kernels | tar -x -C /tmp/base``, then
``--baseline /tmp/base/kernels``) on the same inputs, with its own launch rule, and says whether
its output bytes equal this tree's: a change that claims to keep the bytes is checked here on
the device, not only on the emulation. ``--warpgroups 1,2`` also runs this tree's kernel (sm_90's
wgmma blocks) with that many warpgroups a block, each a q head (the launch rule's choice is the
kernel's own), and says the same of each. ``--online`` also runs the bounded policy's
online-softmax point (kv_append_attention_online, variant ``online``; its block sizes as
``online_wg<N>``; with ``--baseline``, the baseline folder's as ``baseline_online``, its bytes
compared with ``online``'s).

Run on the lent GPU: ``python3 benchmarks/bench_gpu_prefill_attention.py [--rows 512,2048]
[--baseline DIR] [--warpgroups 1,2]``. Writes ``benchmarks/results/gpu_prefill_attention.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import write_result  # noqa: E402
from bench_gpu_prefill import TENSOR_PEAK  # noqa: E402

LAUNCHES = 5  # launches per timed run
REPEATS = 7
FAMILY = "kv_append_attention"
ONLINE = "kv_append_attention_online"
POINTS = {FAMILY: {"act": "bf16", "mode": "prefill", "kv_block": 256},
          ONLINE: {"act": "bf16", "mode": "prefill", "kv_block": 64}}


def realized(kernels_dir: Path | None, family: str = FAMILY) -> Any:
    """The sm_90 kernel of ``family``'s bf16 prefill point, from ``kernels_dir`` (None: this
    tree's)."""
    from metrale.lkb.presentation import Presentation
    from metrale.realize.functor import realization

    P = Presentation.load()
    return realization("sm_90", kernels_dir=kernels_dir,
                       presentation=P).realize(P.family(family).point(**POINTS[family]))


def load(cp: Any, kernel: Any, kernels_dir: Path | None, tmp: Path) -> Any:
    """``kernel`` compiled for sm_90a as the build compiles it (its defines, its headers found
    along sm_90's chain in ``kernels_dir``), loaded; the function may take 200 KB of shared
    memory."""
    from metrale.realize.compute import NvidiaTarget
    from metrale.realize.hardware import default_kernels_dir
    from metrale.realize.kernel import source_identity

    root = kernels_dir or default_kernels_dir()
    text, _, headers, _ = source_identity(root, kernel.source,
                                          ("sm_90/common", "sm_80/common", "cuda/common"))
    defines = dict((d.removeprefix("-D").split("=") + ["1"])[:2] for d in kernel.defines)
    out = tmp / f"{'base' if kernels_dir else 'tree'}_{kernel.entry}.cubin"
    out.write_bytes(NvidiaTarget("cubin").compile(text, "sm_90a", defines, name=out.stem,
                                                  headers=headers).data)
    fn = cp.RawModule(path=str(out)).get_function(kernel.entry)
    fn.max_dynamic_shared_size_bytes = 200 * 1024
    return fn


def timed(cp: Any, launch: Any) -> float:
    """Median seconds per launch over REPEATS runs of LAUNCHES launches, after two warm runs."""
    times = []
    for i in range(REPEATS + 2):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        for _ in range(LAUNCHES):
            launch()
        e.record()
        e.synchronize()
        if i >= 2:
            times.append(cp.cuda.get_elapsed_time(s, e) / 1e3 / LAUNCHES)
    return statistics.median(times)


def warpgroup_launch(shape: tuple, sizes: dict[str, int], wgs: int, persistent: bool = False,
                     sms: int = 0) -> tuple | None:
    """The table's launch ``shape`` (grid, block, shared) redone with blocks of ``wgs``
    warpgroups that compute, a q head each (grid x: the kv heads times ceil(G / wgs) head
    groups), and the table's one warpgroup that only copies (the producer); ``persistent`` (the
    online entry's blocks, which take the kv heads' groups times the row blocks as items in
    turns): grid x that many items, at most ``sms``. None where that is the table's own or more
    than the group's heads or the kernel's two."""
    (gx, gy, gz), (bx, _, _), shared = shape
    hkv, g = sizes["hkv"], sizes["hq"] // sizes["hkv"]
    own = bx // 128 - 1
    if wgs > min(2, g) or wgs == own:
        return None
    x = hkv * -(-g // wgs)
    grid = (min(sms, x * -(-sizes["rows"] // 64)), 1, gz) if persistent else (x, gy, gz)
    return grid, (bx - 128 * (own - wgs), 1, 1), shared


def kernel_args(kernel: Any, ptrs: dict[str, Any], numbers: dict[str, Any]) -> tuple:
    """``kernel``'s launch arguments in its order: a buffer's address (``ptrs``: name -> tensor)
    for each ``:ptr``, else the number (f32 or i32)."""
    out = []
    for arg in kernel.calls[0][1]:
        name, _, ty = arg.partition(":")
        out.append(np.uint64(ptrs[name].data_ptr()) if ty == "ptr"
                   else np.float32(numbers[name]) if ty == "f32" else np.int32(numbers[name]))
    return tuple(out)


def case(cp: Any, torch: Any, model: str, rows: int, variants: dict[str, tuple],
         warpgroups: list[int]) -> dict:
    """One model's heads at ``rows``: each variant (name -> (function, kernel)) and the peer;
    this tree's kernels (``tree``, and ``online`` where given) also with blocks of each of
    ``warpgroups`` warpgroups (``tree_wg<N>``, ``online_wg<N>``, where the group has the heads),
    which must give the same bytes as the table's blocks."""
    from metrale.plan.config import ModelConfig

    config = ModelConfig.load(model)
    hq, hkv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    g = torch.Generator(device="cuda").manual_seed(rows + hq)

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v = rand(rows, hq, d), rand(rows, hkv, d), rand(rows, hkv, d)
    caches = [torch.empty(1, rows, hkv, d, device="cuda", dtype=torch.bfloat16)
              for _ in range(2)]
    positions = torch.arange(rows, device="cuda", dtype=torch.int32)
    slots = torch.zeros(rows, device="cuda", dtype=torch.int32)
    scale = d ** -0.5
    sizes = {"rows": rows, "hq": hq, "hkv": hkv, "d": d, "slots": 1, "max_ctx": rows}
    flops = 4 * rows * (rows + 1) / 2 * hq * d
    out: dict = {"model": model, "rows": rows, "hq": hq, "hkv": hkv, "d": d, "flops": flops}
    outputs = {}
    runs = [(name, fn, kernel, kernel.launch_for(sizes)) for name, (fn, kernel) in variants.items()]
    for own in ("tree", "online"):
        if own not in variants:
            continue
        fn, kernel = variants[own]
        for wgs in warpgroups:
            shape = warpgroup_launch(kernel.launch_for(sizes), sizes, wgs,
                                     "online" in kernel.entry, kernel.multiprocessors)
            if shape is not None:
                runs.append((f"{own}_wg{wgs}", fn, kernel, shape))
    for name, fn, kernel, (grid, block, shared) in runs:
        o = torch.empty(rows, hq, d, device="cuda", dtype=torch.bfloat16)
        o.view(torch.int16).fill_(-1)  # poison: NaN bits
        args = kernel_args(kernel, {"k": k, "v": v, "q": q, "k_cache": caches[0],
                                    "v_cache": caches[1], "positions": positions,
                                    "slots": slots, "o": o},
                           {**sizes, "scale": scale, "window": 0})

        def launch(fn=fn, grid=grid, block=block, shared=shared, args=args) -> None:
            fn(tuple(grid), tuple(block), args, shared_mem=shared)

        launch()
        torch.cuda.synchronize()
        outputs[name] = o.clone()
        t = timed(cp, launch)
        out[name] = {"entry": kernel.entry, "grid": list(grid), "block": list(block),
                     "shared": shared, "seconds": t, "tflops": flops / t / 1e12,
                     "of_tensor_floor": flops / TENSOR_PEAK / t,
                     "finite": bool(torch.isfinite(o.float()).all())}
    qt, kt, vt = (x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v))

    def peer() -> Any:
        return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                enable_gqa=True, scale=scale)

    ref = peer()[0].transpose(0, 1).float()
    t = timed(cp, peer)
    out["peer"] = {"name": "torch sdpa (causal, gqa)", "seconds": t, "tflops": flops / t / 1e12}
    top = float(ref.abs().max())
    for name, o in outputs.items():
        out[name]["max_rel_err_vs_peer"] = float((o.float() - ref).abs().max()) / top
        out[name]["vs_peer"] = t / out[name]["seconds"]
    for name, o in outputs.items():  # a block-size variant against its kernel's table blocks
        own = (name.split("_wg")[0] if "_wg" in name else "tree" if name == "baseline" else
               "online" if name == "baseline_online" else name)
        if name != own:
            out[name][f"bytes_equal_to_{own}"] = bool(torch.equal(
                o.view(torch.int16), outputs[own].view(torch.int16)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="512,2048")
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--baseline", type=Path, help="another kernels folder's kernel, beside")
    ap.add_argument("--warpgroups", default="",
                    help="also this tree's kernels with blocks of these many warpgroups")
    ap.add_argument("--online", action="store_true",
                    help=f"also the bounded policy's {ONLINE} point (variant `online`)")
    args = ap.parse_args()
    import cupy as cp
    import torch

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        tree = realized(None)
        variants = {"tree": (load(cp, tree, None, Path(tmp)), tree)}
        if args.baseline:
            base = realized(args.baseline)
            variants["baseline"] = (load(cp, base, args.baseline, Path(tmp)), base)
        if args.online:
            online = realized(None, ONLINE)
            variants["online"] = (load(cp, online, None, Path(tmp)), online)
            if args.baseline:
                base = realized(args.baseline, ONLINE)
                variants["baseline_online"] = (load(cp, base, args.baseline, Path(tmp)), base)
        for model in args.models.split(","):
            for rows in (int(r) for r in args.rows.split(",")):
                c = case(cp, torch, model, rows, variants,
                         [int(t) for t in args.warpgroups.split(",") if t])
                results.append(c)
                print(f"{model:<13} rows {rows:>5}: peer {c['peer']['seconds'] * 1e6:8.1f} us "
                      f"{c['peer']['tflops']:5.1f} TFLOP/s", flush=True)
                for name, r in c.items():
                    if isinstance(r, dict) and "entry" in r:
                        same = "".join(f", {k.replace('_', ' ')}: {v}" for k, v in r.items()
                                       if k.startswith("bytes_equal_to_"))
                        print(f"    {name:<9} block {r['block'][0]:>3} grid {r['grid']}: "
                              f"{r['seconds'] * 1e6:8.1f} us {r['tflops']:5.1f} TFLOP/s "
                              f"(x{r['vs_peer']:.2f} of peer; rel err {r['max_rel_err_vs_peer']:.1e}"
                              f"{'' if r['finite'] else ', NOT FINITE'}{same})", flush=True)
    path = write_result("gpu_prefill_attention", {
        "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
        "tensor_peak": TENSOR_PEAK, "launches": LAUNCHES, "repeats": REPEATS,
        "baseline": str(args.baseline) if args.baseline else None, "cases": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
