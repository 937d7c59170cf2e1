"""gemv_mma_tma.cu against gemv_mma.cu's entries (the bounded plans' tensor-core GEMVs), on the
host emulation (tests/host/simt), before any device time: the linear and gate_up_swiglu entries
in fp8, mxfp4 and nvfp4 (bf16's stages are too large to be worth a ring), at 40 output columns
(three blocks, the last partly past n) and k = 5120 (twenty k-blocks, three stages of eight, the
last partial) and 1024 (four k-blocks: one stage, four warps idle), one and three activation
rows, with rings of one and two slots (one: every stage refills the slot the last one used; two:
slot 0 again for stage 2), and two ways of running: the bulk copies landing at the first wait on
their barrier with the warps in step (a read before the wait sees poison), or landing as they
are issued with each warp run as far as it can before the next (a slot refilled before every
warp has read it shows). Random activations, weights quantized by metrale's own formats,
poisoned outputs; the outputs must be gemv_mma.cu's bytes.

Run from the repository root: ``python3 docs/experiments/tma/check_gemv_tma_emulated.py``.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
from bench_gemv_tma import GROUP, WARPS, shared
from emulated import finite, per_case, report

from metrale.lkb.quant import QuantFormat
from tests.host import simt

N = 40
FORMATS = ("fp8", "mxfp4", "nvfp4")
LINEAR = ("ptr",) * 5 + ("i32",) * 3
GATE_UP = ("ptr",) * 8 + ("i32",) * 3
ENTRIES = {"linear": "metrale_linear_gemv_mma", "gate_up": "metrale_gate_up_swiglu_gemv_mma"}


def weight(fmt: str, rng: np.random.Generator, k: int) -> tuple:
    x = (rng.standard_normal((N, k)) / np.sqrt(k)).astype(np.float32)
    if fmt == "bf16":
        return (x.astype(ml_dtypes.bfloat16), 0, 0)
    qt = QuantFormat.parse(fmt).quantize(x)
    return (qt.data, qt.scale, 0 if qt.global_scale is None else qt.global_scale)


def launch(lib, entry: str, smem: int, x: np.ndarray, wargs: list, k: int) -> np.ndarray:
    """One launch over the N columns from a poisoned output (NaN: it must be written)."""
    rows = x.shape[0]
    y = np.full((rows, N), 0xFFFF, np.uint16)
    lib.launch(entry, (-(-N // GROUP), 1, 1), (32 * WARPS, 1, 1), smem, [x, *wargs, y, rows, k, N])
    return y


def check_format(build: Path, fmt: str, rng: np.random.Generator) -> dict[str, bool]:
    here = str(Path(__file__).with_name("gemv_mma_tma.cu"))
    defines = ("ACT_BF16", f"WEIGHT_{fmt.upper()}", "K_BLOCK=256")
    base = simt.build(build, "cuda/common/gemv_mma.cu", defines,
                      {ENTRIES["linear"]: LINEAR, ENTRIES["gate_up"]: GATE_UP})
    rings = {(s, eager): simt.build(
        build, here, (*defines, f"TMA_STAGES={s}", f"METRALE_SIMT_BULK_EAGER={eager}",
                      f"METRALE_SIMT_SKEW={eager}"),
        {ENTRIES["linear"] + "_tma": LINEAR, ENTRIES["gate_up"] + "_tma": GATE_UP})
        for s in (1, 2) for eager in (0, 1)}
    checks = {}
    for k in (5120, 1024):
        for rows in (1, 3):
            x = rng.standard_normal((rows, k)).astype(ml_dtypes.bfloat16)
            ws = [weight(fmt, rng, k) for _ in range(2)]
            for name, entry in ENTRIES.items():
                tiles = 2 if name == "gate_up" else 1
                wargs = [a for w in ws[:tiles] for a in w]
                case = f"{fmt} {name} k={k} rows={rows}"
                want = launch(base, entry, shared(fmt, k, tiles, None), x, wargs, k)
                checks[f"{case}: gemv_mma finite"] = finite(want)
                for (s, eager), lib in rings.items():
                    got = launch(lib, entry + "_tma", shared(fmt, k, tiles, s), x, wargs, k)
                    when = "as issued, warps skewed" if eager else "at the wait, warps in step"
                    checks[f"{case} ring of {s}, copies landing {when}: bytes equal"] = bool(
                        np.array_equal(got, want))
    return checks


checks = per_case(lambda build: build, check_format, FORMATS, seed=5)


if __name__ == "__main__":
    raise SystemExit(report(checks))
