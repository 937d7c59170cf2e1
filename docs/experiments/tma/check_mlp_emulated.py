"""mlp_tma.cu against the three launches it replaces, on the host emulation (tests/host/simt),
before any device time, with the bulk copies before the dependent-launch wait and after it
(TMA_COPY_LATE): a grid of one block, and a resident grid of three (every block at once, as
the grid barrier needs; their shares of the columns differ in size), at shapes whose weights
fit (hidden 128, intermediate 256), random bf16 inputs, poisoned outputs; s, h and the output
must be the chain's bytes. The device run (bench_mlp_tma.py) checks the same at Qwen3-0.6B's
shapes with every multiprocessor's block.

Run from the repository root: ``python3 docs/experiments/tma/check_mlp_emulated.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from emulated import barrier_rested, bf16, finite, poison, report

from tests.host import simt

HIDDEN, INTER, EPS = 128, 256, 1e-6
GEMV = ("ACT_BF16", "WEIGHT_BF16", "K_BLOCK=256", "ACROSS_SEQUENTIAL")


def checks(build: Path) -> dict[str, bool]:
    rng = np.random.default_rng(7)
    x, r = bf16(rng, (HIDDEN,), 1.0), bf16(rng, (HIDDEN,), 1.0)
    wn = bf16(rng, (HIDDEN,), 0.1, 1.0)
    wg, wu = bf16(rng, (INTER, HIDDEN), 0.05), bf16(rng, (INTER, HIDDEN), 0.05)
    wd = bf16(rng, (HIDDEN, INTER), 0.05)
    s1, y, h, out1, s2, out2, hbuf = (poison(n) for n in (HIDDEN, HIDDEN, INTER, HIDDEN,
                                                          HIDDEN, HIDDEN, INTER))
    sync = np.zeros(2, np.uint32)
    null = 0
    norm = simt.build(build, "cuda/common/norm.cu", ("ACT_BF16", "H_BLOCK=256"),
                      {"metrale_add_rmsnorm": ("ptr",) * 5 + ("i32", "i32", "f32")})
    gemv = simt.build(build, "cuda/common/gemv.cu", GEMV,
                      {"metrale_gate_up_swiglu": ("ptr",) * 8 + ("i32",) * 3,
                       "metrale_linear_split": ("ptr",) * 5 + ("i32",) * 3})
    mlps = {v: simt.build(build, str(Path(__file__).with_name("mlp_tma.cu")),
                          (*GEMV, "H_BLOCK=256", *v),
                          {"metrale_mlp_tma": ("ptr",) * 10 + ("i32", "i32", "f32", "ptr", "i64")})
            for v in ((), ("TMA_COPY_LATE",))}
    norm.launch("metrale_add_rmsnorm", (1, 1, 1), (128, 1, 1), 0,
                [x, r, wn, s1, y, 1, HIDDEN, EPS])
    gemv.launch("metrale_gate_up_swiglu", (-(-INTER // 4), 1, 1), (128, 1, 1), 0,
                [y, wg, null, null, wu, null, null, h, 1, HIDDEN, INTER])
    gemv.launch("metrale_linear_split", (HIDDEN, 1, 1), (128, 1, 1),
                -(-INTER // 256) * 32, [h, wd, null, null, out1, 1, INTER, HIDDEN])
    out = {"chain output finite": finite(out1)}
    n = 0
    for blocks in (1, 3):
        maxp, maxc = -(-INTER // blocks), -(-HIDDEN // blocks)
        smem = (2 * maxp * HIDDEN + maxc * INTER) * 2 + (2 * HIDDEN + INTER) * 2 + 16
        for v, mlp in mlps.items():
            for a in (s2, out2, hbuf):
                a.fill(0xFFFF)
            mlp.launch("metrale_mlp_tma", (blocks, 1, 1), (256, 1, 1), smem,
                       [x, r, wn, s2, wg, wu, wd, out2, hbuf, sync, HIDDEN, INTER, EPS,
                        wg, wg.nbytes],  # "the next weights": any readable bytes
                       resident=blocks > 1)
            n += 1
            name = f"{blocks} block(s), " + (" ".join(v) or "copies before the wait")
            out |= {f"{name}: s equal": bool((s1 == s2).all()),
                    f"{name}: h equal": bool((h == hbuf).all()),
                    f"{name}: output equal": bool((out1 == out2).all()),
                    f"{name}: grid barrier count back to zero, generation {n}":
                    barrier_rested(sync, n)}
    return out


if __name__ == "__main__":
    raise SystemExit(report(checks))
