"""Experiment: decode attention and its merge in one launch (attn_merged.cu, a grid barrier
between them) against the plans' two launches, on the GPU, batch 1, bf16, 1024 positions, at
Qwen3-0.6B's and Llama-3.1-8B's heads.

Each runs as in the step: the qkv GEMV before it, o_proj after it (the exact plans' entries at
each model's shapes), programmatic dependent launches captured in a CUDA graph, each iteration
over the next of enough weight and cache copies (more than 300 MB) that L2 holds none; figures
are medians over replays of ``bench_gpu_variants.time_graph`` (24 iterations a graph), per
qkv + attention + o_proj. Variants: the two launches; the merged kernel releasing o_proj only by
ending (as the plans' merge does); the merged kernel releasing it as its wait passes
(``ATTN_MERGED_RELEASE_EARLY``). Timed in turn, twice. Before timing, each runs once on copy 0
from a poisoned output and a poisoned cache row and must write the two launches' bytes
(attention output, o_proj's output, the appended cache rows).

Run on the lent GPU from the repository root (Metrale installed, as device_setup.sh leaves it):
``python3 docs/experiments/tma/bench_attn_merged.py``. Writes
``benchmarks/results/gpu_attn_merged.json``.
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
from _common import write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    bf16_bits,
    build,
    decode_kernel,
    time_graph,
)
from device import dependent_launcher, norm_weight, staged  # noqa: E402

from metrale.lkb.semantics_attention import rope_tables  # noqa: E402

# model: (hidden, q heads, kv heads, head_dim); o_proj splits its loads over a block where n <= 1024
MODELS = {"qwen3-0.6b": (1024, 16, 8, 128), "llama-3.1-8b": (4096, 32, 8, 128)}
MAX_CTX, POS, EPS = 1024, 1023, 1e-6
GEMV = "ACT_BF16 WEIGHT_BF16 K_BLOCK=256 ACROSS_SEQUENTIAL"
SOURCES = ("attn_merged.cu", "grid_barrier.cuh")
VARIANTS = {"merged, o_proj released by ending": "", "merged, o_proj released early":
            "ATTN_MERGED_RELEASE_EARLY"}
ROTATE_BYTES = 300 << 20
ROUNDS = 2


def bench_model(cp, go, f: SimpleNamespace, gemv, hidden: int, hq: int, hkv: int, d: int,
                model: str) -> dict:
    """One model's heads: the two launches and the merged variants, checked then timed."""
    i32, f32, u64 = np.int32, np.float32, np.uint64
    f_decode, f_merge, f_merged, f_qkv = f.decode, f.merge, f.merged, f.qkv
    nq, nk, ho = hq * d, hkv * d, hq * d
    split = hidden <= 1024
    f_o = gemv.get_function("metrale_linear_split" if split else "metrale_linear")
    # the decode launch and its merge as KERNELS.toml's launch rules give them at these sizes
    (grid, block, smem), merge_launch = (launch for _, _, launch in f.attention.launches_for(
        {"rows": 1, "hq": hq, "hkv": hkv, "d": d, "max_ctx": MAX_CTX, "window": 0}))
    for fn in (f_decode, *f_merged.values()):
        fn.max_dynamic_shared_size_bytes = smem
    layer = (nq + 2 * nk) * hidden * 2 + hidden * ho * 2 + 2 * MAX_CTX * nk * 2
    copies = max(2, -(-ROTATE_BYTES // layer))
    ws = [SimpleNamespace(wq=bf16_bits(cp, (nq, hidden), 0.02),
                          wk=bf16_bits(cp, (nk, hidden), 0.02),
                          wv=bf16_bits(cp, (nk, hidden), 0.02),
                          wo=bf16_bits(cp, (hidden, ho), 0.02),
                          kc=bf16_bits(cp, (MAX_CTX, hkv, d)),
                          vc=bf16_bits(cp, (MAX_CTX, hkv, d)))
          for _ in range(copies)]
    y = bf16_bits(cp, (hidden,))
    wqn, wkn = (norm_weight(cp, d) for _ in range(2))
    cos_t, sin_t = (cp.asarray(table) for table in rope_tables(MAX_CTX, d))
    positions, slots = cp.asarray([POS], cp.int32), cp.asarray([0], cp.int32)
    q, k, v, o = (cp.empty(n, cp.uint16) for n in (nq, nk, nk, ho))
    out = cp.empty(hidden, cp.uint16)
    work = cp.empty(hq * (MAX_CTX // 64) * (d + 4), cp.float32)
    sync = cp.zeros(2, cp.uint32)

    def step(attention):
        def run(c: int) -> None:
            w = ws[c]
            go(f_qkv, (-(-(nq + 2 * nk) // 8), 1, 1), (128, 1, 1), 0,
               (y, w.wq, u64(0), u64(0), w.wk, u64(0), u64(0), w.wv, u64(0), u64(0), q, k, v,
                i32(1), i32(hidden), i32(nq), i32(nk), i32(nk)))
            args = (q, k, v, wqn, wkn, w.kc, w.vc, positions, slots, cos_t, sin_t, o, work,
                    i32(1), i32(hq), i32(hkv), i32(d), i32(MAX_CTX), i32(MAX_CTX), f32(EPS),
                    f32(1.0 / math.sqrt(d)), i32(0))
            attention(args)
            if split:
                go(f_o, (hidden, 1, 1), (128, 1, 1), -(-ho // 256) * 32,
                   (o, w.wo, u64(0), u64(0), out, i32(1), i32(ho), i32(hidden)))
            else:
                go(f_o, (-(-hidden // 4), 1, 1), (128, 1, 1), 0,
                   (o, w.wo, u64(0), u64(0), out, i32(1), i32(ho), i32(hidden)))
        return run

    def two_launches(args) -> None:
        go(f_decode, grid, block, smem, args)
        go(f_merge, *merge_launch,
           (positions, o, work, i32(1), i32(hq), i32(d), i32(MAX_CTX), i32(0)))

    def merged_with(label: str):
        return lambda args: go(f_merged[label], grid, block, smem, (*args, sync))

    runs = {"two launches": step(two_launches),
            **{label: step(merged_with(label)) for label in VARIANTS}}

    def one(name: str) -> dict:
        o.fill(0xFFFF)
        out.fill(0xFFFF)
        ws[0].kc[POS].fill(0xFFFF)
        ws[0].vc[POS].fill(0xFFFF)
        with cp.cuda.Stream(non_blocking=True) as stream:
            runs[name](0)
            stream.synchronize()
        return {"o": o.copy(), "out": out.copy(), "k_row": ws[0].kc[POS].copy(),
                "v_row": ws[0].vc[POS].copy()}

    ref = one("two launches")
    same = {name: all(bool((got[key] == ref[key]).all()) for key in ref)
            for name, got in ((name, one(name)) for name in VARIANTS)}
    finite = bool(cp.isfinite((ref["out"].astype(cp.uint32) << 16).view(cp.float32)).all())
    print(f"{model}: output finite {finite}; bytes equal to the two launches' {same}",
          flush=True)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(ROUNDS):
        for name, run in runs.items():
            sec = time_graph(cp, run, copies)
            times[name].append(sec)
            print(f"{model:13} {name:36} {sec * 1e6:7.2f} us per qkv + attention + o_proj",
                  flush=True)
    return {"grid": grid, "same_bytes": same, "finite": finite, "seconds": times}


def main() -> None:
    import cupy as cp

    attention = decode_kernel("qk_norm_rope_kv_append_attention")  # the plan's point
    defines = " ".join(d.removeprefix("-D") for d in attention.defines)
    with tempfile.TemporaryDirectory() as tmp, staged(*SOURCES):
        merged = {label: cp.RawModule(path=str(build("attn_merged.cu", f"{defines} {extra}",
                                                     Path(tmp) / f"merged_{i}.cubin")))
                  for i, (label, extra) in enumerate(VARIANTS.items())}
        attn = cp.RawModule(path=str(build("attention_decode.cu", defines,
                                           Path(tmp) / "a.cubin")))
        qkv = cp.RawModule(path=str(build("gemv.cu", f"{GEMV} GEMV_COLS=2",
                                          Path(tmp) / "q.cubin")))
        gemv = cp.RawModule(path=str(build("gemv.cu", GEMV, Path(tmp) / "g.cubin")))
    f = SimpleNamespace(
        decode=attn.get_function("metrale_qk_norm_rope_kv_append_attention_decode"),
        merge=attn.get_function("metrale_attention_decode_merge"),
        merged={label: m.get_function("metrale_qk_norm_rope_kv_append_attention_merged")
                for label, m in merged.items()},
        qkv=qkv.get_function("metrale_qkv"), attention=attention)
    go = dependent_launcher(cp)
    results = {model: bench_model(cp, go, f, gemv, *dims, model) for model, dims in MODELS.items()}
    write_result("gpu_attn_merged", {
        "what": "decode attention and its merge in one launch (grid barrier) against the plans' "
                "two, between qkv and o_proj, batch 1, bf16, 1024 positions; seconds per "
                "qkv + attention + o_proj",
        "command": "python3 docs/experiments/tma/bench_attn_merged.py",
        "models": results,
    })


if __name__ == "__main__":
    main()
