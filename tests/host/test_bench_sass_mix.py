"""benchmarks/bench_sass_mix.py: its reading of nvdisasm's listing, and, where nvcc and nvdisasm
are, the multi-row GEMVs' hot loops held to what they issue today (they are bound by issue: a
change that fattens the loop slows the exact batched steps, and this says so before a device
call)."""

from __future__ import annotations

import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_sass_mix as bench  # noqa: E402

NVCC, NVDISASM = bench.shutil.which("nvcc"), bench.find_nvdisasm()
DEFINES = ["WEIGHT_BF16", "K_BLOCK=256", "ACROSS_SEQUENTIAL"]


def gemv_functions(tmp_path: Path, act: str) -> dict[str, list]:
    """gemv.cu's bf16-weight entries at ``act`` activations, by function: compiled through the
    CUDA source tests' build cache (the same flags as the bench's, so the same machine code),
    then read as the bench reads it."""
    from tests.host.test_cuda_sources import _sm90a_cubin

    cubin, _ = _sm90a_cubin(tmp_path, "gemv.cu", f"ACT_{act.upper()}", *DEFINES)
    path = tmp_path / f"gemv_{act}.cubin"
    path.write_bytes(cubin)
    return bench.functions(bench.listing(path, NVDISASM))


def test_the_listing_laws_hold():
    assert doctest.testmod(bench).failed == 0


def test_the_hot_loop_is_the_one_with_the_most_arithmetic_not_the_longest():
    """A loop with more instructions but fewer FFMA (a fallback path) is not the hot loop; of
    two with as many FFMA the shorter is (an outer loop that holds the hot one)."""
    text = "\n".join([
        ".text.metrale_linear_rows8:",
        "        /*0000*/                   LDG.E R2, desc[UR4][R4.64] ;",
        ".L_x_1:",
        "        /*0010*/                   FFMA R1, R2, R3, R1 ;",
        "        /*0020*/                   IMAD R5, R5, 0x2, RZ ;",
        "        /*0030*/                   IMAD R6, R6, 0x2, RZ ;",
        "        /*0040*/              @!P0 BRA `(.L_x_1) ;",
        ".L_x_2:",
        "        /*0050*/                   FFMA R1, R2, R3, R1 ;",
        "        /*0060*/                   FFMA R7, R2, R3, R7 ;",
        "        /*0070*/               @P1 BRA `(.L_x_2) ;",
        "        /*0080*/               @P2 BRA `(.L_x_2) ;",
        "        /*0090*/                   EXIT ;",
    ])
    insns = bench.functions(text)["metrale_linear_rows8"]
    loop = bench.hot_loop("metrale_linear_rows8", insns)
    assert (loop.start, loop.end, loop.ffma, loop.issued) == (0x50, 0x70, 2, 3)
    r = bench.row(loop, "bf16", "")
    assert r["floor_per_kib"] == 128 and r["issued_per_kib"] == pytest.approx(192)
    assert r["of_floor"] == pytest.approx(2 / 3)


@pytest.mark.skipif(not (NVCC and NVDISASM), reason="needs nvcc and nvdisasm")
def test_the_multi_row_loops_issue_what_they_issue_today(tmp_path):
    """gemv.cu's 8- and 16-row loops in bf16: every FFMA the one-row order asks for (a lane's 8
    rows x 8 columns of each of its k-blocks' weight chunks) and at most the instructions they
    issue today a KiB of weights (2026-12, nvcc 13.0: 288-300 at 8 rows, 552-555 at 16), the
    FFMA 40 % or more of them. The H100 measured the 8-row gate_up at 313 a KiB, prologue and
    epilogue included, and bound by issue."""
    fns = gemv_functions(tmp_path, "bf16")
    budget = {8: 310, 16: 570}
    for family in ("linear", "linear_add", "qkv", "gate_up_swiglu"):
        for rows in (8, 16):
            entry = f"metrale_{family}_rows{rows}"
            loop = bench.hot_loop(entry, fns[entry])
            r = bench.row(loop, "bf16", "")
            assert loop.ffma % (rows * 8 * 2) == 0, (entry, loop)  # whole chunks of 2 columns
            assert r["floor_per_kib"] == 16 * rows
            assert r["issued_per_kib"] <= budget[rows], (entry, r["issued_per_kib"], r["mix"])
            assert r["of_floor"] >= 0.40, (entry, r["of_floor"], r["mix"])


@pytest.mark.skipif(not (NVCC and NVDISASM), reason="needs nvcc and nvdisasm")
def test_the_committed_reading_is_todays_machine_code(tmp_path):
    """docs/performance.md's table comes from benchmarks/results/sass_mix.json: with the
    compiler that made it, each of its bf16 rows counts what today's source compiles to, so a
    kernel change that moves a loop asks for the reading again (`python
    benchmarks/bench_sass_mix.py --weights bf16 --acts bf16,f32`)."""
    import json

    doc = json.loads((Path(bench.__file__).parent / "results" / "sass_mix.json").read_text())
    if doc["nvcc"] != bench.nvcc_version(NVCC):
        pytest.skip(f"the reading is {doc['nvcc']}'s, this compiler is another")
    by_act: dict[str, dict] = {}
    for r in doc["rows"]:
        assert r["weight"] == "bf16" and not r["variant"], r
        by_act.setdefault(r["act"], {})[r["entry"]] = r
    assert set(by_act) == {"bf16", "f32"} and len(by_act["bf16"]) >= 6, by_act.keys()
    assert doc["source"] == "gemv.cu"
    for act, rows in by_act.items():
        fns = gemv_functions(tmp_path, act)
        for entry, r in rows.items():
            loop = bench.hot_loop(entry, fns[entry])
            assert (loop.issued, loop.ffma) == (r["issued"], r["ffma"]), (act, entry)
