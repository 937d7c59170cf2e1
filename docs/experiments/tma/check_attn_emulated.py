"""attn_tma.cu against the five launches it replaces (add_rmsnorm, qkv, qk_norm_rope_kv_append_
attention_decode, its merge, the split o_proj), on the host emulation (tests/host/simt), before any
device time: grids of one block and resident grids of several (every block at once, as the grid
barriers need), with the bulk copies before the dependent-launch wait and after it
(TMA_COPY_LATE), at shapes whose weights fit: four q heads on two kv heads (Qwen3's group of
two) and eight on one (a group split over two attention blocks), head_dim 64, hidden 64, a cache of
128 positions with this step's at 100; and Qwen3-0.6B's heads (16 on 8, head_dim 128) over 1024
positions with hidden 256, a resident grid of 64 blocks, each taking two of the attention launch's
128 blocks. Random bf16 inputs and cache rows, NeoX rope tables, poisoned outputs. s, q, k, v, the
attention output, o_proj's output and both caches must be the chain's bytes. The device run
(bench_layer_tma.py) checks the same at Qwen3-0.6B's shapes with every multiprocessor's block.

Run from the repository root: ``python3 docs/experiments/tma/check_attn_emulated.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
from emulated import (
    barrier_rested,
    bf16,
    build_realized,
    decode_attention,
    finite,
    per_case,
    poison,
    report,
)

from metrale.lkb.semantics_attention import rope_tables
from tests.host import simt

GEMV = ("ACT_BF16", "WEIGHT_BF16", "K_BLOCK=256", "ACROSS_SEQUENTIAL")
TMA_ARGS = ("ptr",) * 23 + ("i32",) * 6 + ("f32", "f32", "i32", "ptr", "i64")
EPS = 1e-6


class Case(NamedTuple):
    hq: int  # q heads
    hkv: int  # kv heads
    hidden: int
    d: int  # head_dim
    max_ctx: int  # cache positions; this step's is pos
    pos: int
    grids: tuple[int, ...]  # blocks of the fused launch (more than one: resident)


CASES = (Case(4, 2, 64, 64, 128, 100, (1, 3, 5)), Case(8, 1, 64, 64, 128, 100, (1, 3, 5)),
         # Qwen3-0.6B's heads over 1024 positions; 64 blocks take two of the 128 attention items
         Case(16, 8, 256, 128, 1024, 1023, (64,)))

def libraries(build: Path) -> dict:
    tma_defines = (*GEMV, "H_BLOCK=256", "KV_BLOCK=256", "CHUNK=64", "ROPE_NEOX")
    here = str(Path(__file__).with_name("attn_tma.cu"))
    return {
        "norm": simt.build(build, "cuda/common/norm.cu", ("ACT_BF16", "H_BLOCK=256", "ROPE_NEOX"),
                           {"metrale_add_rmsnorm": ("ptr",) * 5 + ("i32", "i32", "f32")}),
        "qkv": simt.build(build, "cuda/common/gemv.cu", (*GEMV, "GEMV_COLS=2"),
                          {"metrale_qkv": ("ptr",) * 13 + ("i32",) * 5}),
        "linear": simt.build(build, "cuda/common/gemv.cu", GEMV,
                             {"metrale_linear_split": ("ptr",) * 5 + ("i32",) * 3}),
        "attention": build_realized(build, decode_attention()),
        **{f"tma{v}": simt.build(build, here, (*tma_defines, *v), {"metrale_attn_tma": TMA_ARGS})
           for v in ((), ("TMA_COPY_LATE",))},
    }


def check_case(libs: dict, case: Case, rng: np.random.Generator) -> dict[str, bool]:
    hq, hkv, HIDDEN, D, MAX_CTX, POS = case[:6]  # noqa: N806
    nq, nk, ho = hq * D, hkv * D, hq * D
    nch = -(-MAX_CTX // 64)
    x, r = bf16(rng, (HIDDEN,), 1.0), bf16(rng, (HIDDEN,), 1.0)
    wn, wqn, wkn = (bf16(rng, (n,), 0.1, 1.0) for n in (HIDDEN, D, D))
    wq, wk, wv = (bf16(rng, (n, HIDDEN), 0.1) for n in (nq, nk, nk))
    wo = bf16(rng, (HIDDEN, ho), 0.05)
    cache0 = [bf16(rng, (MAX_CTX, hkv, D), 1.0) for _ in range(2)]
    cos_t, sin_t = rope_tables(MAX_CTX, D)
    (decode, _, decode_launch), (merge, _, merge_launch) = decode_attention().launches_for(
        {"rows": 1, "hq": hq, "hkv": hkv, "d": D, "max_ctx": MAX_CTX, "window": 0})
    positions, slots = np.array([POS], np.int32), np.array([0], np.int32)
    scale = 1.0 / math.sqrt(D)
    work_floats = hq * nch * (D + 4)

    def outputs() -> dict[str, np.ndarray]:
        return {"s": poison(HIDDEN), "y": poison(HIDDEN), "q": poison(nq), "k": poison(nk),
                "v": poison(nk), "o": poison(ho), "out": poison(HIDDEN),
                "k_cache": cache0[0].copy(), "v_cache": cache0[1].copy(),
                "work": np.full(work_floats, np.nan, np.float32)}

    a = outputs()  # the chain's
    libs["norm"].launch("metrale_add_rmsnorm", (1, 1, 1), (32, 1, 1), 0,
                        [x, r, wn, a["s"], a["y"], 1, HIDDEN, EPS])
    libs["qkv"].launch("metrale_qkv", (-(-(nq + 2 * nk) // 8), 1, 1), (128, 1, 1), 0,
                       [a["y"], wq, 0, 0, wk, 0, 0, wv, 0, 0, a["q"], a["k"], a["v"], 1, HIDDEN,
                        nq, nk, nk])
    libs["attention"].launch(
        decode, *decode_launch,
        [a["q"], a["k"], a["v"], wqn, wkn, a["k_cache"], a["v_cache"], positions, slots, cos_t,
         sin_t, a["o"], a["work"], 1, hq, hkv, D, MAX_CTX, MAX_CTX, EPS, scale, 0])
    libs["attention"].launch(merge, *merge_launch,
                             [positions, a["o"], a["work"], 1, hq, D, MAX_CTX, 0])
    libs["linear"].launch("metrale_linear_split", (HIDDEN, 1, 1), (128, 1, 1),
                          -(-ho // 256) * 32, [a["o"], wo, 0, 0, a["out"], 1, ho, HIDDEN])
    checks = {"chain's o_proj output finite": finite(a["out"])}
    sync = np.zeros(2, np.uint32)
    met = 0
    for blocks in case.grids:
        n3 = nq + 2 * nk
        region = (decode_launch[2] + 127) // 128 * 128  # the decode launch's shared memory
        smem = (region + (-(-n3 // blocks) * HIDDEN + -(-HIDDEN // blocks) * ho) * 2
                + (2 * HIDDEN + ho) * 2 + 16 + 16)
        for variant in ("", "TMA_COPY_LATE"):
            b = outputs()
            libs[f"tma{(variant,) if variant else ()}"].launch(
                "metrale_attn_tma", (blocks, 1, 1), (256, 1, 1), smem,
                [x, r, wn, b["s"], wq, wk, wv, b["q"], b["k"], b["v"], wqn, wkn, b["k_cache"],
                 b["v_cache"], positions, slots, cos_t, sin_t, b["o"], b["work"], wo, b["out"],
                 sync, HIDDEN, hq, hkv, D, MAX_CTX, MAX_CTX, EPS, scale, 0,
                 wq, wq.nbytes],  # "the next weights": any readable bytes
                resident=blocks > 1)
            met += 3
            name = (f"{hq}/{hkv} heads of {D}, {MAX_CTX} positions, {blocks} block(s), "
                    f"{variant or 'copies before the wait'}")
            for key in ("s", "q", "k", "v", "o", "out", "k_cache", "v_cache"):
                checks[f"{name}: {key} equal"] = bool(np.array_equal(a[key], b[key]))
            checks[f"{name}: grid barrier back to zero, generation {met}"] = barrier_rested(
                sync, met)
    return checks


checks = per_case(libraries, check_case, CASES, seed=11)


if __name__ == "__main__":
    raise SystemExit(report(checks))
