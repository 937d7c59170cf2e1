"""Experiment: a Qwen3-0.6B decode layer (batch 1, bf16, 1024 positions) as the exact plan's eight
launches against the persistent kernels of this folder (attn_tma.cu for the attention half's five
launches, mlp_tma.cu for the MLP half's three), on the GPU.

Each variant runs layers as the step runs them: programmatic dependent launches captured in a
CUDA graph, each iteration the next of enough layer copies (weights and KV cache, more than 300 MB
in all) that L2 holds none of them; each figure is the median over replays of
``bench_gpu_variants.time_graph`` (a graph of 24 layers), per layer. The variants (``VARIANTS``):
the chain; each half fused alone; both fused (two launches a layer); both fused with their bulk
copies after the dependent-launch wait (what staging early is worth); both fused, each asking L2
for the next launch's weights while it runs (``next``: a launch cannot stage its weights before
the one before it leaves the multiprocessors, since neither fits beside the other). They are timed
in turn, twice, so a drift between them shows.

Before timing, each variant runs once on copy 0 from poisoned outputs (and a poisoned cache row
at this step's position) and must write the chain's bytes: s and q, k, v, the attention output,
o_proj's, the MLP's residual and output, and the appended cache rows. A build with phase marks
(phase.cuh) then runs one layer of both kernels and says when their blocks reached each step.

Run on the lent GPU from the repository root (Metrale installed, as device_setup.sh leaves it):
``python3 docs/experiments/tma/bench_layer_tma.py``. The folder's sources are copied
into the installed kernels folder's cuda/common for the build and removed after. Writes
``benchmarks/results/gpu_layer_tma.json``.
"""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    bf16_bits,
    build,
    decode_kernel,
    time_graph,
)
from device import dependent_launcher, norm_weight, staged  # noqa: E402

from metrale.lkb.semantics_attention import rope_tables  # noqa: E402

# Qwen3-0.6B
HIDDEN, INTER, HQ, HKV, D, EPS = 1024, 3072, 16, 8, 128, 1e-6
NQ, NK, HO = HQ * D, HKV * D, HQ * D
MAX_CTX, POS = 1024, 1023  # this step attends over 1024 positions
NCH = MAX_CTX // 64
SCALE = 1.0 / math.sqrt(D)
GEMV = "ACT_BF16 WEIGHT_BF16 K_BLOCK=256 ACROSS_SEQUENTIAL"  # the exact plan's points' defines
TMA = f"{GEMV} H_BLOCK=256 KV_BLOCK=256 CHUNK=64 ROPE_NEOX"
SOURCES = ("attn_tma.cu", "mlp_tma.cu", "persistent.cuh", "tma.cuh")
ROTATE_BYTES = 300 << 20
ROUNDS = 2
ATTN_MARKS = ["entry", "copies issued", "after the wait", "qkv rows landed", "q, k, v written",
              "grid met (qkv)", "attention done", "grid met (attention)", "merged",
              "grid met (merge)", "o_proj rows landed", "done"]
MLP_MARKS = ["entry", "copies issued", "after the wait", "row normalized", "gate/up rows landed",
             "h written", "grid met", "down rows landed", "done"]
PHASE_MARKS = 16  # phase.cuh


def main() -> None:
    import cupy as cp

    rate = device_copy_rate()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    builds = {"": "", "late": "TMA_COPY_LATE", "traced": f"PHASE_TRACE={sms}"}
    with tempfile.TemporaryDirectory() as tmp, staged(*SOURCES):
        tma = {(src, v): cp.RawModule(path=str(build(src, f"{TMA} {extra}",
                                                     Path(tmp) / f"{src}_{v}.cubin")))
               for src in ("attn_tma.cu", "mlp_tma.cu") for v, extra in builds.items()}
        norm = cp.RawModule(path=str(build("norm.cu", "ACT_BF16 H_BLOCK=256",
                                           Path(tmp) / "norm.cubin")))
        qkv = cp.RawModule(path=str(build("gemv.cu", f"{GEMV} GEMV_COLS=2",
                                          Path(tmp) / "qkv.cubin")))
        gemv = cp.RawModule(path=str(build("gemv.cu", GEMV, Path(tmp) / "gemv.cubin")))
        attention = decode_kernel("qk_norm_rope_kv_append_attention")  # the plan's point
        attn = cp.RawModule(path=str(build(
            "attention_decode.cu", " ".join(d.removeprefix("-D") for d in attention.defines),
            Path(tmp) / "attention.cubin")))
    f = SimpleNamespace(
        norm=norm.get_function("metrale_add_rmsnorm"), qkv=qkv.get_function("metrale_qkv"),
        gate_up=gemv.get_function("metrale_gate_up_swiglu"),
        linear=gemv.get_function("metrale_linear_split"),
        attention=attn.get_function("metrale_qk_norm_rope_kv_append_attention_decode"),
        merge=attn.get_function("metrale_attention_decode_merge"))
    # the decode launch and its merge as KERNELS.toml's launch rules give them at these sizes
    decode_launch, merge_launch = (launch for _, _, launch in attention.launches_for(
        {"rows": 1, "hq": HQ, "hkv": HKV, "d": D, "max_ctx": MAX_CTX, "window": 0}))
    f.attention.max_dynamic_shared_size_bytes = decode_launch[2]
    region = -(-decode_launch[2] // 128) * 128
    attn_smem = (region + (-(-(NQ + 2 * NK) // sms) * HIDDEN + -(-HIDDEN // sms) * HO) * 2
                 + (2 * HIDDEN + HO) * 2 + 32)
    mlp_smem = ((2 * -(-INTER // sms) * HIDDEN + -(-HIDDEN // sms) * INTER) * 2
                + (2 * HIDDEN + INTER) * 2 + 16)
    fused = {}
    for (src, v), m in tma.items():
        fn = m.get_function("metrale_attn_tma" if src == "attn_tma.cu" else "metrale_mlp_tma")
        fn.max_dynamic_shared_size_bytes = attn_smem if src == "attn_tma.cu" else mlp_smem
        fused[(src[:4], v)] = fn

    # one layer copy: each half's weights in one buffer (so that `next` is one range), its cache
    attn_bytes = (NQ + 2 * NK) * HIDDEN * 2 + HIDDEN * HO * 2
    mlp_bytes = 3 * INTER * HIDDEN * 2
    cache_bytes = 2 * MAX_CTX * NK * 2
    copies = max(2, -(-ROTATE_BYTES // (attn_bytes + mlp_bytes + cache_bytes)))

    def layer() -> SimpleNamespace:
        a = bf16_bits(cp, (attn_bytes // 2,), 0.02)
        m = bf16_bits(cp, (mlp_bytes // 2,), 0.02)
        wq, wk, wv = a[:NQ * HIDDEN], a[NQ * HIDDEN:(NQ + NK) * HIDDEN], \
            a[(NQ + NK) * HIDDEN:(NQ + 2 * NK) * HIDDEN]
        return SimpleNamespace(
            attn=a, mlp=m, wq=wq, wk=wk, wv=wv, wo=a[(NQ + 2 * NK) * HIDDEN:],
            wg=m[:INTER * HIDDEN], wu=m[INTER * HIDDEN:2 * INTER * HIDDEN],
            wd=m[2 * INTER * HIDDEN:], wn1=norm_weight(cp, HIDDEN), wn2=norm_weight(cp, HIDDEN),
            wqn=norm_weight(cp, D), wkn=norm_weight(cp, D),
            kc=bf16_bits(cp, (MAX_CTX, HKV, D)), vc=bf16_bits(cp, (MAX_CTX, HKV, D)))

    ws = [layer() for _ in range(copies)]
    x, r = bf16_bits(cp, (HIDDEN,)), bf16_bits(cp, (HIDDEN,))
    cos_t, sin_t = (cp.asarray(table) for table in rope_tables(MAX_CTX, D))
    positions, slots = cp.asarray([POS], cp.int32), cp.asarray([0], cp.int32)

    def buffers() -> SimpleNamespace:
        u16 = lambda n: cp.empty(n, cp.uint16)  # noqa: E731
        return SimpleNamespace(
            s1=u16(HIDDEN), y1=u16(HIDDEN), q=u16(NQ), k=u16(NK), v=u16(NK), o=u16(HO),
            work=cp.empty(HQ * NCH * (D + 4), cp.float32), a_out=u16(HIDDEN), s2=u16(HIDDEN),
            y2=u16(HIDDEN), h=u16(INTER), m_out=u16(HIDDEN), sync1=cp.zeros(2, cp.uint32),
            sync2=cp.zeros(2, cp.uint32))

    go = dependent_launcher(cp)
    i32, f32, u64 = np.int32, np.float32, np.uint64

    def attn_chain(c: int, b: SimpleNamespace, _v: str, _next: bool) -> None:
        w = ws[c]
        go(f.norm, (1, 1, 1), (128, 1, 1), 0, (x, r, w.wn1, b.s1, b.y1, i32(1), i32(HIDDEN),
                                                f32(EPS)))
        go(f.qkv, (-(-(NQ + 2 * NK) // 8), 1, 1), (128, 1, 1), 0,
           (b.y1, w.wq, u64(0), u64(0), w.wk, u64(0), u64(0), w.wv, u64(0), u64(0), b.q, b.k,
            b.v, i32(1), i32(HIDDEN), i32(NQ), i32(NK), i32(NK)))
        go(f.attention, *decode_launch,
           (b.q, b.k, b.v, w.wqn, w.wkn, w.kc, w.vc, positions, slots, cos_t, sin_t, b.o,
            b.work, i32(1), i32(HQ), i32(HKV), i32(D), i32(MAX_CTX), i32(MAX_CTX), f32(EPS),
            f32(SCALE), i32(0)))
        go(f.merge, *merge_launch,
           (positions, b.o, b.work, i32(1), i32(HQ), i32(D), i32(MAX_CTX), i32(0)))
        go(f.linear, (HIDDEN, 1, 1), (128, 1, 1), -(-HO // 256) * 32,
           (b.o, w.wo, u64(0), u64(0), b.a_out, i32(1), i32(HO), i32(HIDDEN)))

    def attn_fused(c: int, b: SimpleNamespace, v: str, nxt: bool) -> None:
        w = ws[c]
        after = ws[c].mlp if nxt else None  # the MLP's weights come next
        go(fused[("attn", v)], (sms, 1, 1), (256, 1, 1), attn_smem,
           (x, r, w.wn1, b.s1, w.wq, w.wk, w.wv, b.q, b.k, b.v, w.wqn, w.wkn, w.kc, w.vc,
            positions, slots, cos_t, sin_t, b.o, b.work, w.wo, b.a_out, b.sync1, i32(HIDDEN),
            i32(HQ), i32(HKV), i32(D), i32(MAX_CTX), i32(MAX_CTX), f32(EPS), f32(SCALE), i32(0),
            after if after is not None else u64(0), np.int64(mlp_bytes if nxt else 0)))

    def mlp_chain(c: int, b: SimpleNamespace, _v: str, _next: bool) -> None:
        w = ws[c]
        go(f.norm, (1, 1, 1), (128, 1, 1), 0, (b.a_out, b.s1, w.wn2, b.s2, b.y2, i32(1),
                                                i32(HIDDEN), f32(EPS)))
        go(f.gate_up, (-(-INTER // 4), 1, 1), (128, 1, 1), 0,
           (b.y2, w.wg, u64(0), u64(0), w.wu, u64(0), u64(0), b.h, i32(1), i32(HIDDEN),
            i32(INTER)))
        go(f.linear, (HIDDEN, 1, 1), (128, 1, 1), -(-INTER // 256) * 32,
           (b.h, w.wd, u64(0), u64(0), b.m_out, i32(1), i32(INTER), i32(HIDDEN)))

    def mlp_fused(c: int, b: SimpleNamespace, v: str, nxt: bool) -> None:
        w = ws[c]
        after = ws[(c + 1) % copies].attn if nxt else None  # the next layer's attention
        go(fused[("mlp_", v)], (sms, 1, 1), (256, 1, 1), mlp_smem,
           (b.a_out, b.s1, w.wn2, b.s2, w.wg, w.wu, w.wd, b.m_out, b.h, b.sync2, i32(HIDDEN),
            i32(INTER), f32(EPS), after if after is not None else u64(0),
            np.int64(attn_bytes if nxt else 0)))

    variants = {  # name: (attention half, MLP half, build, next weights into L2)
        "chain (8 launches)": (attn_chain, mlp_chain, "", False),
        "attention fused": (attn_fused, mlp_chain, "", False),
        "MLP fused": (attn_chain, mlp_fused, "", False),
        "both fused (2 launches)": (attn_fused, mlp_fused, "", False),
        "both fused, copies after the wait": (attn_fused, mlp_fused, "late", False),
        "both fused, next weights into L2": (attn_fused, mlp_fused, "", True),
    }

    def runner(name: str, b: SimpleNamespace):
        a_half, m_half, v, nxt = variants[name]

        def run(c: int) -> None:
            a_half(c, b, v, nxt)
            m_half(c, b, v, nxt)
        return run

    # bytes: every variant from poisoned outputs on copy 0, against the chain's
    outputs = ("s1", "q", "k", "v", "o", "a_out", "s2", "m_out")

    def one(name: str) -> dict:
        b = buffers()
        for key in outputs:
            getattr(b, key).fill(0xFFFF)  # NaN: must be written
        ws[0].kc[POS].fill(0xFFFF)
        ws[0].vc[POS].fill(0xFFFF)
        with cp.cuda.Stream(non_blocking=True) as stream:
            runner(name, b)(0)
            stream.synchronize()
        return {**{key: getattr(b, key).copy() for key in outputs},
                "k_row": ws[0].kc[POS].copy(), "v_row": ws[0].vc[POS].copy()}

    ref = one("chain (8 launches)")
    finite = bool(cp.isfinite((ref["m_out"].astype(cp.uint32) << 16).view(cp.float32)).all())
    same = {}
    for name in variants:
        got = one(name)
        same[name] = {key: bool((got[key] == ref[key]).all()) for key in ref}
    print(f"chain output finite: {finite}", flush=True)
    for name, eq in same.items():
        print(f"{name}: bytes equal to the chain's: {all(eq.values())} {eq}", flush=True)

    # where a layer's time goes: the traced kernels, one layer, its second run read back
    b = buffers()
    traces = {half: cp.ndarray((sms * PHASE_MARKS * 2,), cp.uint64,
                               tma[(src, "traced")].get_global("metrale_phase_trace"))
              for half, src in (("attention", "attn_tma.cu"), ("MLP", "mlp_tma.cu"))}
    with cp.cuda.Stream(non_blocking=True) as stream:
        for _ in range(2):
            for t in traces.values():
                t.fill(0)
            attn_fused(1, b, "traced", False)
            mlp_fused(1, b, "traced", False)
            stream.synchronize()
    t0 = min(int(t.get().reshape(sms, PHASE_MARKS, 2)[:, 0, 1].min()) for t in traces.values())
    phases = {}
    for half, marks in (("attention", ATTN_MARKS), ("MLP", MLP_MARKS)):
        t = traces[half].get().reshape(sms, PHASE_MARKS, 2)[:, :len(marks), 1].astype(np.int64)
        phases[half] = [{"mark": m, "median_ns": float(np.median(t[:, i] - t0)),
                         "min_ns": float((t[:, i] - t0).min()),
                         "max_ns": float((t[:, i] - t0).max())} for i, m in enumerate(marks)]
        for ph in phases[half]:
            print(f"  {half:9} {ph['mark']:24} median {ph['median_ns']:8.0f} ns  (first "
                  f"{ph['min_ns']:8.0f}, last {ph['max_ns']:8.0f}) since the first entry",
                  flush=True)

    layer_bytes = attn_bytes + mlp_bytes + cache_bytes + 4 * HIDDEN * 2
    times: dict[str, list[float]] = {name: [] for name in variants}
    b = buffers()
    for _ in range(ROUNDS):
        for name in variants:
            sec = time_graph(cp, runner(name, b), copies)
            times[name].append(sec)
            print(f"{name:36} {sec * 1e6:7.2f} us per layer ({layer_bytes / sec / 1e12:.2f} "
                  f"TB/s; 28 layers {28 * sec * 1e3:.3f} ms)", flush=True)
    floor = layer_bytes / rate
    print(f"floor at the copy rate: {floor * 1e6:.2f} us per layer", flush=True)
    write_result("gpu_layer_tma", {
        "what": "Qwen3-0.6B decode layer, batch 1, bf16, 1024 positions: the exact plan's eight "
                "launches against the persistent TMA-staged attention (five launches in one) "
                "and MLP (three in one) halves; seconds per layer",
        "command": "python3 docs/experiments/tma/bench_layer_tma.py",
        "copy_rate_bytes_per_s": rate, "multiprocessors": sms,
        "shared_bytes": {"attention": attn_smem, "mlp": mlp_smem},
        "bytes_per_layer": layer_bytes, "floor_s": floor, "same_bytes": same, "finite": finite,
        "seconds": times, "phases": phases,
    })


if __name__ == "__main__":
    main()
