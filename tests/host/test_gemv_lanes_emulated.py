"""gemv.cu's multi-row entries built with LANE_COLS (eight lanes a weight row, x staged in shared
memory as f32 broadcasts, lane_units in gemv_rows.cuh) on the SIMT emulation: every row of a
launch has the bytes of that row launched alone by the one-row entries."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from tests.host.test_kernels_emulated import P, run
from tests.kernel_cases import check_rows_alone, matmul_point, sizes_for

LANES = ("LANE_COLS=2", "MULTI_MIN_BLOCKS_8=3")


def lane_launch(family: str, rows: int, dims: dict[str, int], cols: int = 2) -> tuple:
    """(entry, (grid, block, shared)) of a lane launch: four units a warp, four warps a block."""
    tile = 8 if rows <= 8 else 16
    if family == "gate_up_swiglu":
        units = dims["n"]
    elif family == "qkv":
        units = -(-(dims["nq"] + dims["nk"] + dims["nv"]) // cols)
    else:
        units = -(-dims["n"] // cols)
    return (f"metrale_{family}_rows{tile}", ((-(-units // 16), -(-rows // tile), 1),
                                            (128, 1, 1), 0))


CASES = [("linear", {"k": 256, "n": 1030}), ("linear", {"k": 2304, "n": 1030}),
         ("linear", {"k": 288, "n": 1100}), ("linear", {"k": 200, "n": 1030}),
         ("linear_add", {"k": 1032, "n": 1025}), ("gate_up_swiglu", {"k": 2304, "n": 40}),
         ("gate_up_swiglu", {"k": 200, "n": 24}), ("qkv", {"k": 640, "nq": 32, "nk": 16, "nv": 16})]


@pytest.mark.parametrize("rows", [2, 8, 16, 19])
@pytest.mark.parametrize("family,dims", CASES, ids=lambda c: str(c))
def test_lane_entries_give_each_row_its_one_row_bytes(build_dir, family, dims, rows):
    fam = P.family(family)
    point = matmul_point(fam, "gemv", "bf16")
    full = {**dict(fam.example), **dims}

    def runner(fam_, point_, sizes, device):
        if sizes["rows"] == 1:
            return run(build_dir, fam_, point_, sizes, device)
        return run(build_dir, fam_, point_, sizes, device, extra=LANES,
                   launch=lane_launch(family, sizes["rows"], full))

    check_rows_alone(fam, point, runner, rows, dims)


@pytest.mark.parametrize("rows", [8, 16])
def test_lane_tree_is_the_one_row_tree(build_dir, rows):
    """Inputs on which the pairing of a k-block's 32 chunk sums shows in the output (w all ones,
    every chunk sum exact; test_kernels_emulated's tree test): row r's chunk r % 32 sums to
    2^24, chunk (r % 32) ^ 16 (r even) or ^ 1 (r odd) to -2^24, and each other chunk r ^ 2^i to
    1, so the ones survive the butterfly (even rows: 4) or are rounded away (odd rows: 0). Each
    row of the lane launch gives the tree's value and the one-row launch's bytes."""
    fam = P.family("linear")
    point = matmul_point(fam, "gemv", "bf16")
    k, n = 512, 1030
    x = np.zeros((rows, k), np.float32)
    for r in range(rows):
        at = 256 * (r % 2)  # odd rows in the second k-block, their first all zeros
        x[r, at + 8 * r] = 2.0 ** 24
        x[r, at + 8 * (r ^ (16 if r % 2 == 0 else 1))] = -(2.0 ** 24)
        for b in (16, 8, 4, 2, 1):
            if x[r, at + 8 * (r ^ b)] == 0:
                x[r, at + 8 * (r ^ b)] = 1.0
    xb = x.astype(ml_dtypes.bfloat16)
    wb = np.ones((n, k), ml_dtypes.bfloat16)
    sizes = {**sizes_for(fam, rows), "k": k, "n": n}
    chunks = x.reshape(rows, 2, 32, 8).sum(axis=3)  # exact: one nonzero a chunk
    for o in (16, 8, 4, 2, 1):
        chunks = chunks + chunks[:, :, np.arange(32) ^ o]
    want = chunks[:, 0, 0] + chunks[:, 1, 0]
    (multi,) = run(build_dir, fam, point, sizes, {"x": (xb,), "w": (wb,)}, extra=LANES,
                   launch=lane_launch("linear", rows, sizes))
    for r in range(rows):
        (one,) = run(build_dir, fam, point, {**sizes, "rows": 1},
                     {"x": (xb[r:r + 1],), "w": (wb,)})
        assert multi[r].tobytes() == one[0].tobytes(), r
    assert (want[0::2] == 4.0).all() and (want[1::2] == 0.0).all(), want
    assert (multi.astype(np.float32) == want[:, None]).all(), (multi[:, 0], want)
