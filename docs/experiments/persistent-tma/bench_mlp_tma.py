"""Experiment: Qwen3-0.6B's decode MLP half (add_rmsnorm, gate_up_swiglu, the down linear) as one
launch of resident blocks with TMA-staged weights (mlp_tma.cu), against the three launches the
exact plan makes, on the GPU, batch 1, bf16.

Both run as the step runs them: o_proj (the plan's split linear, whose output is the norm's
residual) then the MLP, programmatic dependent launches captured in a CUDA graph, each iteration
over the next of enough weight copies (more than 256 MB) that L2 holds none of them; each figure
is the median over replays of ``bench_gpu_variants.time_graph`` (a graph of 24 iterations), per
o_proj + MLP. The chain and the kernel's variants (``VARIANTS``: also with its bulk copies after
the dependent-launch wait, which says what staging early is worth) are timed in turn, twice, so a
drift between them shows. Before timing, each runs once on copy 0 with poisoned outputs and must
write the chain's bytes (s, and the MLP's output): the experiment kernel reuses norm.cu's and
gemv.cu's own code for that. A build with phase marks (phase.cuh) then runs once after o_proj and
says when its blocks reached each step, from the first block's entry.

Run on the lent GPU, from the repository root (Metrale installed, as ab_gpu_step.sh leaves it):
``python3 docs/experiments/persistent-tma/bench_mlp_tma.py``. The kernel source is copied
into the installed kernels folder's cuda/common for its build and removed after. Writes
``benchmarks/results/gpu_mlp_tma.json``.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402
from bench_gpu_variants import _arg, _function, bf16_bits, build, time_graph  # noqa: E402

from metrale.realize.hardware import default_kernels_dir  # noqa: E402
from metrale.runtime.cuda_driver import DriverLauncher  # noqa: E402

HIDDEN, INTER, HEADS_DIM, EPS = 1024, 3072, 2048, 1e-6  # Qwen3-0.6B (o_proj's k: 16 x 128)
GEMV = "ACT_BF16 WEIGHT_BF16 K_BLOCK=256 ACROSS_SEQUENTIAL"  # the exact plan's points' defines
ROTATE_BYTES = 300 << 20
ROUNDS = 2
# the experiment kernel's variants: its own, with the bulk copies after the dependent-launch wait
# (what staging before the wait is worth), and with phase marks (phase.cuh; timed separately)
VARIANTS = {"fused": "", "fused, copies after the wait": "MLP_TMA_COPY_LATE"}
MARKS = ["entry", "copies issued", "after the wait", "row normalized", "gate/up rows landed",
         "h written", "grid met", "down rows landed", "done"]
PHASE_MARKS = 16  # phase.cuh


def main() -> None:
    import cupy as cp

    rate = device_copy_rate()
    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    src = Path(__file__).with_name("mlp_tma.cu")
    staged = default_kernels_dir() / "cuda" / "common" / src.name  # where build() looks
    builds = {**VARIANTS, "traced": f"PHASE_TRACE={sms}"}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(src, staged)
        try:
            tma = {name: cp.RawModule(path=str(build(src.name, f"{GEMV} H_BLOCK=256 {extra}",
                                                     Path(tmp) / f"mlp_{i}.cubin")))
                   for i, (name, extra) in enumerate(builds.items())}
        finally:
            staged.unlink()
        norm = cp.RawModule(path=str(build("norm.cu", "ACT_BF16 H_BLOCK=256",
                                           Path(tmp) / "norm.cubin")))
        gemv = cp.RawModule(path=str(build("gemv.cu", GEMV, Path(tmp) / "gemv.cubin")))
    f_norm = norm.get_function("metrale_add_rmsnorm")
    f_gate_up = gemv.get_function("metrale_gate_up_swiglu")
    f_down = gemv.get_function("metrale_linear_split")
    maxp, maxc = -(-INTER // sms), -(-HIDDEN // sms)
    smem = (2 * maxp * HIDDEN + maxc * INTER) * 2 + (2 * HIDDEN + INTER) * 2 + 16
    f_mlps = {name: m.get_function("metrale_mlp_tma") for name, m in tma.items()}
    for f in f_mlps.values():
        f.max_dynamic_shared_size_bytes = smem

    layer_bytes = (3 * INTER * HIDDEN + HIDDEN + HEADS_DIM * HIDDEN) * 2  # with o_proj's
    copies = max(2, -(-ROTATE_BYTES // layer_bytes))

    def norm_weight():  # 1 + noise, as bf16 bits
        w = cp.random.standard_normal(HIDDEN, dtype=cp.float32) * np.float32(0.1) + 1
        return (w.view(cp.uint32) >> 16).astype(cp.uint16)

    ws = [(norm_weight(), bf16_bits(cp, (INTER, HIDDEN), 0.02),
           bf16_bits(cp, (INTER, HIDDEN), 0.02), bf16_bits(cp, (HIDDEN, INTER), 0.02),
           bf16_bits(cp, (HIDDEN, HEADS_DIM), 0.02)) for _ in range(copies)]
    attn, x = bf16_bits(cp, (HEADS_DIM,)), bf16_bits(cp, (HIDDEN,))
    r = cp.empty(HIDDEN, cp.uint16)  # o_proj's output
    s1, y, h, out1 = (cp.empty(n, cp.uint16) for n in (HIDDEN, HIDDEN, INTER, HIDDEN))
    s2, out2, hbuf = (cp.empty(n, cp.uint16) for n in (HIDDEN, HIDDEN, INTER))
    sync = cp.zeros(2, cp.uint32)
    driver = DriverLauncher()
    i32, f32 = np.int32, np.float32

    def go(fn, grid, block, shared, args) -> None:
        stream = cp.cuda.get_current_stream().ptr
        driver.launch_dependent(_function(fn), grid, block, shared, stream,
                                tuple(_arg(a) for a in args))

    def o_proj(wo) -> None:  # the launch before the MLP in a step: its output is the norm's r
        go(f_down, (HIDDEN, 1, 1), (128, 1, 1), -(-HEADS_DIM // 256) * 32,
           (attn, wo, np.uint64(0), np.uint64(0), r, i32(1), i32(HEADS_DIM), i32(HIDDEN)))

    def chain(i: int) -> None:
        wn, wg, wu, wd, wo = ws[i]
        o_proj(wo)
        go(f_norm, (1, 1, 1), (128, 1, 1), 0, (x, r, wn, s1, y, i32(1), i32(HIDDEN), f32(EPS)))
        go(f_gate_up, (-(-INTER // 4), 1, 1), (128, 1, 1), 0,
           (y, wg, np.uint64(0), np.uint64(0), wu, np.uint64(0), np.uint64(0), h, i32(1),
            i32(HIDDEN), i32(INTER)))
        go(f_down, (HIDDEN, 1, 1), (128, 1, 1), -(-INTER // 256) * 32,
           (h, wd, np.uint64(0), np.uint64(0), out1, i32(1), i32(INTER), i32(HIDDEN)))

    def fused_with(name: str):
        def fused(i: int) -> None:
            wn, wg, wu, wd, wo = ws[i]
            o_proj(wo)
            go(f_mlps[name], (sms, 1, 1), (256, 1, 1), smem,
               (x, r, wn, s2, wg, wu, wd, out2, hbuf, sync, i32(HIDDEN), i32(INTER), f32(EPS)))
        return fused

    same: dict[str, dict[str, bool]] = {}
    for name in builds:
        for a in (s1, out1, s2, out2):
            a.fill(0xFFFF)  # poisoned (NaN): each must be written
        with cp.cuda.Stream(non_blocking=True) as stream:
            chain(0)
            fused_with(name)(0)
            stream.synchronize()
        same[name] = {"s": bool((s1 == s2).all()), "out": bool((out1 == out2).all())}
    finite = bool(cp.isfinite((out1.astype(cp.uint32) << 16).view(cp.float32)).all())
    print(f"bytes equal to the chain's: {same}; chain output finite: {finite}", flush=True)

    # where a launch's time goes: the traced kernel after o_proj, its second run read back
    trace = cp.ndarray((sms * PHASE_MARKS * 2,), cp.uint64,
                       tma["traced"].get_global("metrale_phase_trace"))
    with cp.cuda.Stream(non_blocking=True) as stream:
        for _ in range(2):
            trace.fill(0)
            fused_with("traced")(1)
            stream.synchronize()
    t = trace.get().reshape(sms, PHASE_MARKS, 2)[:, :len(MARKS), 1].astype(np.int64)
    t0 = t[:, 0].min()
    phases = [{"mark": m, "median_ns": float(np.median(t[:, i] - t0)),
               "min_ns": float((t[:, i] - t0).min()), "max_ns": float((t[:, i] - t0).max())}
              for i, m in enumerate(MARKS)]
    for ph in phases:
        print(f"  {ph['mark']:22} median {ph['median_ns']:8.0f} ns  (first {ph['min_ns']:8.0f}, "
              f"last {ph['max_ns']:8.0f}) since the first block's entry", flush=True)

    runs = {"chain": chain, **{name: fused_with(name) for name in VARIANTS}}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, launch in runs.items():
            sec = time_graph(cp, launch, copies)
            times[name].append(sec)
            print(f"{name:30} {sec * 1e6:7.2f} us per o_proj + MLP "
                  f"({layer_bytes / sec / 1e12:.2f} TB/s)",
                  flush=True)
    floor = layer_bytes / rate
    print(f"floor at the copy rate: {floor * 1e6:.2f} us", flush=True)
    write_result("gpu_mlp_tma", {
        "what": "Qwen3-0.6B decode o_proj then MLP half, batch 1, bf16: o_proj and the three "
                "MLP launches of the exact plan's kernels, against o_proj and one launch of "
                "resident blocks with TMA-staged weights; seconds per o_proj + MLP",
        "command": "python3 docs/experiments/persistent-tma/bench_mlp_tma.py",
        "copy_rate_bytes_per_s": rate, "multiprocessors": sms, "shared_bytes": smem,
        "bytes_per_iteration": layer_bytes, "floor_s": floor, "same_bytes": same,
        "finite": finite, "seconds": times, "phases_after_o_proj": phases,
    })


if __name__ == "__main__":
    main()
