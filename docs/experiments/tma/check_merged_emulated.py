"""attn_merged.cu against the two launches it replaces (qk_norm_rope_kv_append_attention_decode
and its merge), on the host emulation (tests/host/simt), before any device time: resident grids
(the decode grid itself, every block at once, as the grid barrier needs), with the decode's
release of the next launch kept or made one without it (ATTN_MERGED_RELEASE_EARLY), at: four q
heads on two kv heads over 128 positions, one row and two (distinct slots and positions, so the
merge items span rows); eight q heads on one (a group split over two blocks); and Qwen3-0.6B's
heads (16 on 8, head_dim 128) over 512 positions, 64 blocks. Random bf16 q, k, v and cache rows,
NeoX rope tables, poisoned outputs; the attention output, the chunk records and both caches must
be the two launches' bytes.

Run from the repository root: ``python3 docs/experiments/tma/check_merged_emulated.py``.
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
    defines,
    finite,
    per_case,
    poison,
    report,
)

from metrale.lkb.semantics_attention import rope_tables
from tests.host import simt

EPS = 1e-6


class Case(NamedTuple):
    hq: int
    hkv: int
    d: int
    max_ctx: int
    positions: tuple[int, ...]  # one a row


CASES = (Case(4, 2, 64, 128, (100,)), Case(4, 2, 64, 128, (100, 37)),
         Case(8, 1, 64, 128, (70,)), Case(16, 8, 128, 512, (511,)))


def libraries(build: Path) -> dict:
    attention = decode_attention()
    decode_types = tuple(a.partition(":")[2] for a in dict(attention.calls)[attention.entry])
    here = str(Path(__file__).with_name("attn_merged.cu"))
    return {
        "chain": build_realized(build, attention),
        **{v: simt.build(build, here, (*defines(attention), *((v,) if v else ())),
                         {"metrale_qk_norm_rope_kv_append_attention_merged": (*decode_types,
                                                                               "ptr")})
           for v in ("", "ATTN_MERGED_RELEASE_EARLY")},
    }


def check_case(libs: dict, case: Case, rng: np.random.Generator) -> dict[str, bool]:
    hq, hkv, d, max_ctx = case[:4]
    rows, nch = len(case.positions), -(-max_ctx // 64)
    (decode, _, (grid, block, smem)), (merge, _, merge_launch) = decode_attention().launches_for(
        {"rows": rows, "hq": hq, "hkv": hkv, "d": d, "max_ctx": max_ctx, "window": 0})
    q, k, v = (bf16(rng, (rows, n, d), 1.0) for n in (hq, hkv, hkv))
    wq, wk = bf16(rng, (d,), 0.1, 1.0), bf16(rng, (d,), 0.1, 1.0)
    cache0 = [bf16(rng, (rows * max_ctx, hkv, d), 1.0) for _ in range(2)]
    cos_t, sin_t = rope_tables(max_ctx, d)
    positions = np.array(case.positions, np.int32)
    slots = np.arange(rows, dtype=np.int32)[::-1].copy()  # row r in slot rows - 1 - r
    scale = 1.0 / math.sqrt(d)

    def outputs() -> dict[str, np.ndarray]:
        return {"o": poison(rows * hq * d), "k_cache": cache0[0].copy(),
                "v_cache": cache0[1].copy(),
                "work": np.full(rows * hq * nch * (d + 4), np.nan, np.float32)}

    def args(out: dict) -> list:
        return [q, k, v, wq, wk, out["k_cache"], out["v_cache"], positions, slots, cos_t, sin_t,
                out["o"], out["work"], rows, hq, hkv, d, max_ctx, max_ctx, EPS, scale, 0]

    a = outputs()
    libs["chain"].launch(decode, grid, block, smem, args(a))
    libs["chain"].launch(merge, *merge_launch,
                         [positions, a["o"], a["work"], rows, hq, d, max_ctx, 0])
    name = f"{hq}/{hkv} heads of {d}, {max_ctx} positions, rows at {case.positions}"
    checks = {f"{name}: the two launches' output finite": finite(a["o"])}
    sync = np.zeros(2, np.uint32)
    for n, variant in enumerate(("", "ATTN_MERGED_RELEASE_EARLY"), 1):
        b = outputs()
        libs[variant].launch("metrale_qk_norm_rope_kv_append_attention_merged", grid, block,
                             smem, [*args(b), sync], resident=True)
        label = f"{name}, {variant or 'o_proj released by ending'}"
        for key in ("o", "work", "k_cache", "v_cache"):
            same = np.array_equal(a[key].view(np.uint8), b[key].view(np.uint8))
            checks[f"{label}: {key} equal"] = bool(same)
        checks[f"{label}: grid barrier back to zero, generation {n}"] = barrier_rested(sync, n)
    return checks


checks = per_case(libraries, check_case, CASES, seed=13)


if __name__ == "__main__":
    raise SystemExit(report(checks))
