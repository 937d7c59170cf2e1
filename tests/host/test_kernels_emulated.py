"""Every CUDA kernel of the sm_90 plans, run from its own source on the host (tests/host/simt).

The emulation runs each kernel as the GPU would be asked to: the realization's defines, launch
rule, argument order and scratch workspace; inputs from ``tests.kernel_cases`` (never zeros),
outputs poisoned before the launch; then the reference's tolerance, as tests/cuda applies on the
device. The points are those with bf16 activations (each weight format, each mode and style);
f32 activations take the same code with another type. Beyond that, the tensor-core GEMM at
shapes with ragged tiles, exactly where every sum is exact, and the emulation's own check: a
pipeline that waits one cp.async group short reads poison.
"""

from __future__ import annotations

import functools
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from metrale.lkb.errors import LaunchError
from metrale.lkb.family import Family, Point
from metrale.lkb.presentation import Presentation
from metrale.lkb.semantics import SEMANTICS
from metrale.realize.functor import realization
from metrale.realize.kernel import tensor_map_box, workspace_bytes
from metrale.runtime.backend import DevicePtr, TensorMap
from metrale.runtime.host_backend import host_tensor_map
from tests.host import simt
from tests.kernel_cases import (
    GEMM,
    GEMM_ROW_WINDOWS,
    MULTI_ROW_FAMILIES,
    PREFILL_FAMILIES,
    PREFILL_SHAPES,
    case_id,
    chain_point,
    check_combine_norm_hard_values,
    check_either_width,
    check_gemm,
    check_gemm_exact,
    check_gemv_mma_mxfp4_scales,
    check_mma_gemv_bound,
    check_online_attention_bound,
    check_online_attention_far_scores,
    check_prefill_attention,
    check_relation,
    check_row_invariance,
    check_rows,
    check_rows_alone,
    compare,
    inputs,
    kwargs,
    matmul_point,
    multi_row_entry,
    mxfp4_scaled_inputs,
    prefill_point,
    relation_cases,
    row_invariant_points,
    row_window,
    seed_of,
    sizes_for,
    skip_where_the_prefill_kernel_refuses,
    split_linear_cases,
)
from tests.tiers import sampled

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")

P = Presentation.load()
F = realization("sm_90", presentation=P)
F_CUDA = realization("cuda", presentation=P)
"""The common layer alone: a class with no tensor cores, which runs the plain kernels."""


@functools.cache
def class_entries(hw: str) -> dict:
    """simt.class_entries, once a class (it realizes every point of the presentation)."""
    return simt.class_entries(hw)


def library(build_dir, point: Point, extra: tuple[str, ...] = (), F_: Any = F) -> simt.Library:
    k = F_.realize(point)
    return simt.build(build_dir, k.source, tuple(d.removeprefix("-D") for d in k.defines) + extra,
                      class_entries(F_.hw.name)[(k.source, k.defines)])


def run(build_dir, fam: Family, point: Point, sizes: dict[str, int], device: dict,
        attrs: dict | None = None, extra: tuple[str, ...] = (),
        launch_shape: tuple | None = None, F_: Any = F,
        launch: tuple[str, tuple] | None = None) -> list[np.ndarray]:
    """``point``'s kernel on the emulation (the one realization ``F_`` gives: sm_90's unless
    told): inputs from ``device`` (port -> data, scale, global), outputs poisoned, scratch
    zeroed; returns the outputs. ``launch_shape`` (grid, block, shared), for a kernel of one
    launch, replaces its launch rule's; ``launch`` (entry, (grid, block, shared)) makes that
    one launch of any entry of the kernel's chain in place of the rule's launches."""
    kernel = F_.realize(point)
    lib = library(build_dir, point, extra, F_)
    params = point.as_dict()
    arrays: dict[str, np.ndarray | None] = {}
    for name, parts in device.items():
        arrays[name] = np.ascontiguousarray(parts[0]).copy()
        if len(parts) > 1:
            arrays[f"{name}_scale"] = None if parts[1] is None else np.ascontiguousarray(parts[1])
            arrays[f"{name}_global"] = (None if parts[2] is None else
                                        np.asarray(parts[2], np.float32).reshape(1))
    inplace = dict(fam.inplace)
    outs = []
    for port in fam.outputs:
        if port.name in inplace:
            arrays[port.name] = arrays[inplace[port.name]]
        else:
            shape = tuple(sizes[d] if isinstance(d, str) else d for d in port.dims)
            out = np.empty(shape, port.type(params).dtype.numpy)
            out.reshape(-1).view(np.uint8)[:] = 0xFF  # poison: NaN for floats, -1 for ints
            arrays[port.name] = out
        outs.append(arrays[port.name])
    numbers = {**sizes, **dict(fam.attr_examples), **(attrs or {})}
    env = kernel.sizes(numbers)
    # one zeroed workspace for the kernel's scratch arguments, each at its slice, as the
    # executor lays them out
    slices = kernel.workspace(numbers)
    work = np.zeros(max(workspace_bytes(slices), 1), np.uint8)
    launches = kernel.launches_for(numbers)
    if launch_shape is not None:
        assert len(launches) == 1, f"{kernel.entry}: a launch shape for each of its launches"
        launches = ((launches[0][0], launches[0][1], launch_shape),)
    if launch is not None:
        launches = ((launch[0], dict(kernel.calls)[launch[0]], launch[1]),)
    gathered = None
    if kernel.transport:  # a collective of one rank: its transport gathers its own x alone
        assert kernel.transport == "all_gather" and numbers["ranks"] == 1, kernel
        s = slices[kernel.args[0].partition(":")[0]]
        gathered = work[s.offset:s.end]
        x = arrays["x"].reshape(-1).view(np.uint8)
        gathered[:x.size] = x
    for entry, args, shape in launches:
        values = []
        for a in args:
            name, _, ty = a.partition(":")
            box = tensor_map_box(ty)
            if ty == "scratch":
                values.append(work[slices[name].offset:slices[name].end])
            elif ty == "ptr":
                values.append(arrays.get(name))
            elif box is not None and name in slices:  # a scratch tensor's map
                s = slices[name]
                tmap = TensorMap(DevicePtr(0, s.nbytes), s.rows, s.cols, s.dtype, box)
                values.append(host_tensor_map(work[s.offset:s.end], tmap))
            elif box is not None:  # the port's array, as the host maps it
                arr = arrays[name]
                tmap = TensorMap(DevicePtr(0, arr.nbytes), arr.size // arr.shape[-1],
                                 arr.shape[-1], "bf16", box)
                assert arr.dtype.itemsize == 2, (name, arr.dtype)
                values.append(host_tensor_map(arr.reshape(-1).view(np.uint8), tmap))
            else:
                values.append(env[name])
        lib.launch(entry, *shape, values)
    if gathered is not None:  # the workspace's contract: what the kernel read, left zero
        assert not gathered.any(), f"{kernel.entry} left its gathered scratch written"
    return outs


def _cases() -> list[tuple[Family, Point]]:
    out = []
    for fam in P.generators:
        if fam.view:
            continue
        for point in fam.points:
            k = F.realize(point)
            if k is not None and k.source is not None and point.as_dict().get("act") != "f32":
                out.append((fam, point))
    return out


@pytest.mark.parametrize("fam,point", _cases(),
                         ids=lambda x: str(x) if isinstance(x, Point) else "")
def test_kernel_matches_reference_on_the_emulation(build_dir, fam, point):
    sizes = sizes_for(fam, check_rows(fam, F.realize(point)))
    host, device = inputs(fam, point, sizes, seed=seed_of(point))
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **kwargs(fam, point))
    compare(point, fam, ref, run(build_dir, fam, point, sizes, device))


def test_qkv_pairs_straddle_q_k_v_and_the_end(build_dir):
    """bf16 qkv takes two columns a warp (KERNELS.toml's qkv_pairs): at nq = 33, nk = 16,
    nv = 16 the pairs (32, 33) and (48, 49) straddle q|k and k|v, and the last, (64, 65), has a
    column past the end. Each of q, k_, v has the bytes linear (one column a warp) gives on its
    own weight: the bit-identical relation qkv_concat, at sizes its example does not reach."""
    qkv, lin = P.family("qkv"), P.family("linear")
    point = matmul_point(qkv, "gemv", "bf16")
    assert "-DGEMV_COLS=2" in F.realize(point).defines, F.realize(point)
    widths = {"wq": 33, "wk": 16, "wv": 16}
    sizes = {**sizes_for(qkv, 3), "k": 640, "nq": 33, "nk": 16, "nv": 16}
    _, device = inputs(qkv, point, sizes, seed=33)
    got = run(build_dir, qkv, point, sizes, device)
    one = matmul_point(lin, "gemv", "bf16")
    assert "-DGEMV_COLS=2" not in F.realize(one).defines, F.realize(one)
    for out, (w, n) in zip(got, widths.items(), strict=True):
        (ref,) = run(build_dir, lin, one, {**sizes_for(lin, 3), "k": 640, "n": n},
                     {"x": device["x"], "w": device[w]})
        assert out.shape == ref.shape and out.tobytes() == ref.tobytes(), w


SPLIT_LAUNCHES = {1: ("_split", (37, 1, 1), 9 * 32), 5: ("_split_rows8", (19, 1, 1), 9 * 64),
                  11: ("_split_rows16", (19, 1, 1), 9 * 128)}
"""rows -> (the split entry's suffix, its grid, its shared bytes) at n = 37, k = 2304."""


@pytest.mark.parametrize("rows", sorted(SPLIT_LAUNCHES))
@pytest.mark.parametrize("family,across,weight", split_linear_cases(P, F))
def test_split_linear_gives_the_one_warp_bytes(build_dir, family, across, weight, rows):
    """Where n <= 1024, linear and linear_add make a split launch only: a block a column (two
    columns past one row), the loads split over its four warps, the k-block partials combined
    in order (gemv.cu's split_column and split_columns_multi). At n = 37, k = 2304 (9 k-blocks,
    not a multiple of the four warps; fp8's loads of two leave the last load one block) and 1, 5
    or 11 rows, its outputs are byte-equal to the one-warp entry's at the same sizes, in each
    weight format that has the split and either declared combine."""
    fam = P.family(family)
    point = fam.point(**{**GEMM, "shape": "gemv", "across": across}, weight=weight)
    kernel = F.realize(point)
    sizes = {**sizes_for(fam, rows), "k": 2304, "n": 37}
    numbers = {**sizes, **dict(fam.attr_examples)}
    (entry, _, (grid, block, shared)), = kernel.launches_for(numbers)
    suffix, want_grid, want_shared = SPLIT_LAUNCHES[rows]
    assert entry == kernel.entry + suffix, kernel
    assert grid == want_grid and shared == want_shared, (grid, shared)
    (big, *_), = kernel.launches_for({**numbers, "n": 1025})
    assert big == kernel.entry + {1: "", 5: "_rows8", 11: "_rows16"}[rows]
    _, device = inputs(fam, point, sizes, seed=37)
    split = run(build_dir, fam, point, sizes, device)
    one = run(build_dir, fam, point, sizes, device,
              launch=(kernel.entry, ((10, (rows + 7) // 8, 1), (128, 1, 1), 0)))
    for a, b in zip(split, one, strict=True):
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), (point, a, b)


@pytest.mark.parametrize("across,want", [("sequential", 16.0), ("pairwise", 22.0)])
def test_split_linear_combines_in_the_declared_order(build_dir, across, want):
    """Inputs on which the order of the k-block partials shows in the bf16 output (each
    block's own sum exact): with x = 1, block 0 sums to 2^24, blocks 1-7 to 1 each and block 8
    to 16 - 2^24. In order, 2^24 + 1 rounds back to 2^24 and the row gives 16; pairwise,
    ((p0 + p1) + (p2 + p3)) + ... gives 22; in reverse it would be 23. The split launch, the
    one-warp launch and the reference all give the declared order's value."""
    fam = P.family("linear")
    point = fam.point(**{**GEMM, "shape": "gemv", "across": across}, weight="bf16")
    rows, k, n = 3, 9 * 256, 20
    w = np.zeros((n, k), np.float32)
    w[:, 0:128] = 2.0 ** 17
    w[:, 256:2048:256] = 1.0
    w[:, 2048:2176] = -(2.0 ** 17)
    w[:, 2176] = 16.0
    x = np.ones((rows, k), ml_dtypes.bfloat16)
    wb = w.astype(ml_dtypes.bfloat16)
    assert (wb.astype(np.float32) == w).all()
    device = {"x": (x,), "w": (wb,)}
    sizes = {**sizes_for(fam, rows), "k": k, "n": n}
    (ref,) = SEMANTICS[fam.semantics](x, w, **kwargs(fam, point))
    (split,) = run(build_dir, fam, point, sizes, device)
    entry = F.realize(point).entry
    (one,) = run(build_dir, fam, point, sizes, device,
                 launch=(entry, ((5, 1, 1), (128, 1, 1), 0)))
    assert (np.asarray(ref, np.float32) == want).all(), ref
    assert (split.astype(np.float32) == want).all(), split
    assert one.tobytes() == split.tobytes()


def test_split_linear_traps_on_too_little_shared_memory(build_dir):
    """The split entry keeps each row's k-block partials in the launch's shared memory (32 bytes
    a k-block): launched with 32 bytes less than the table gives, the launch fails (the kernel
    checks its size and traps; the emulation would also fault on a write past it) instead of
    writing past it, and with the table's it runs."""
    fam = P.family("linear")
    point = matmul_point(fam, "gemv", "bf16")
    sizes = {**sizes_for(fam, 3), "k": 1280, "n": 20}
    _, device = inputs(fam, point, sizes, seed=20)
    entry = F.realize(point).then[0].entry
    run(build_dir, fam, point, sizes, device, launch=(entry, ((20, 1, 1), (128, 1, 1), 160)))
    with pytest.raises(AssertionError, match=r"refused the launch \(2"):
        run(build_dir, fam, point, sizes, device,
            launch=(entry, ((20, 1, 1), (128, 1, 1), 128)))


@pytest.mark.parametrize("family", ["rope", "qk_norm", "qk_norm_rope"])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (12, 2, 64)])
def test_per_head_kernels_write_every_head_past_one_block(build_dir, family, hq, hkv, d):
    """rope and the per-head norms take eight heads a block (a warp each): at a model's head
    count (40 heads, five blocks) and at one that leaves the last block part empty (14), every
    head of every row is written as the reference's. The families' example shapes have six
    heads, one block."""
    fam = P.family(family)
    point = next(p for p in fam.points if p.as_dict()["act"] == "bf16")
    sizes = sizes_for(fam, 3)
    sizes.update({k: v for k, v in {"hq": hq, "hkv": hkv, "d": d, "half": d // 2}.items()
                  if k in sizes})
    host, device = inputs(fam, point, sizes, seed=hq * 1000 + hkv)
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **kwargs(fam, point))
    compare(point, fam, ref, run(build_dir, fam, point, sizes, device))


@pytest.mark.parametrize("family", ["rope", "qk_norm_rope"])
def test_per_head_kernels_trap_on_another_block_size(build_dir, family):
    """The per-head kernels' grid counts eight heads a block (warp_head.cuh): launched with four
    warps a block, which would leave half the heads unwritten, they trap; with the table's eight
    they write every head."""
    fam = P.family(family)
    point = next(p for p in fam.points if p.as_dict()["act"] == "bf16")
    sizes = sizes_for(fam, 3)
    sizes.update({k: v for k, v in {"hq": 10, "hkv": 6}.items() if k in sizes})
    host, device = inputs(fam, point, sizes, seed=11)
    grid, block, shared = F.realize(point).launch_for({**sizes, **dict(fam.attr_examples)})
    assert block == (256, 1, 1), block
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **kwargs(fam, point))
    compare(point, fam, ref, run(build_dir, fam, point, sizes, device))
    with pytest.raises(AssertionError, match=r"refused the launch \(2"):
        run(build_dir, fam, point, sizes, device, launch_shape=(grid, (128, 1, 1), shared))


def _runner(build_dir):
    return lambda fam, point, sizes, device, attrs=None: run(build_dir, fam, point, sizes,
                                                             device, attrs)


# (family, sizes): two row tiles, the last ragged (70 = 64 + 6); column tiles with ragged ends;
# k with a short last k-block (544 = 2 x 256 + 32), or rows not 16-byte aligned (300; for
# nvfp4, whose rows take k / 2 bytes, 336) in blocks of one warpgroup and of two (where fp8 and
# fp4 weights are staged raw)
GEMM_CASES = [
    ("linear", {"rows": 70, "k": 544, "n": 136}),
    ("linear", {"rows": 9, "k": 300, "n": 40}),
    ("linear", {"rows": 70, "k": 300, "n": 40}),
    ("linear", {"rows": 70, "k": 336, "n": 40}),
    ("lm_head", {"rows": 20, "k": 288, "n": 130}),
    ("linear_add", {"rows": 70, "k": 288, "n": 136}),
    ("qkv", {"rows": 33, "k": 288, "nq": 136, "nk": 24, "nv": 40}),
    ("gate_up_swiglu", {"rows": 70, "k": 544, "n": 72}),
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMM_CASES, ids=case_id)
def test_gemm_over_ragged_tiles_matches_reference(build_dir, family, dims, weight):
    """The tensor-core GEMM over many tiles with ragged edges in rows, columns and k."""
    check_gemm(family, dims, weight, P, F, _runner(build_dir))


@pytest.mark.parametrize("weight", ["bf16", "nvfp4"])
@pytest.mark.parametrize("family,dims", [("linear", {"k": 544, "n": 136}),
                                         ("gate_up_swiglu", {"k": 288, "n": 72}),
                                         ("qkv", {"k": 288, "nq": 136, "nk": 24, "nv": 40})],
                         ids=case_id)
@pytest.mark.parametrize("rows,part", GEMM_ROW_WINDOWS[1:], ids=["70-33", "130-66-130"])
def test_gemm_rows_have_the_same_bytes_in_either_block_size(build_dir, family, dims, weight,
                                                            rows, part):
    """Rows launched alone (up to 64: blocks of one warpgroup) give the bytes they have in a
    longer launch (blocks of two warpgroups; in bf16, of two fed by a third through the Tensor
    Memory Accelerator, gemm_tma.cu), wherever they sit in its row tiles."""
    fam = P.family(family)
    point = matmul_point(fam, "gemm", weight)
    assert {F.realize(point).launches_for({**sizes_for(fam, r), **dims})[0][2][1][0]
            for r in (rows, part.stop - part.start)} == {128, 384 if weight == "bf16" else 256}
    check_row_invariance(fam, point, _runner(build_dir), rows, part, dims)


@pytest.mark.parametrize("family,dims", [("linear", {"k": 800, "n": 300}),
                                         ("gate_up_swiglu", {"k": 288, "n": 136}),
                                         ("qkv", {"k": 544, "nq": 136, "nk": 24, "nv": 40})],
                         ids=case_id)
def test_tma_gemm_gives_the_same_bytes_on_any_grid(build_dir, family, dims):
    """gemm_tma.cu's blocks take the launch's tiles in turn, so a grid smaller than the tiles
    (one block, three) gives the bytes of the table's grid (a block a tile): the stages and their
    barriers' phases run on from one tile to the next (five stages against 13, 5 and 9 k-tiles a
    tile: each phase parity taken more than once), and a k-block's partial lands in the
    accumulator set of its parity (odd and even counts of k-blocks: 4, 2, 3)."""
    fam = P.family(family)
    point = matmul_point(fam, "gemm", "bf16")
    ((entry, _, _),) = F.realize(point).launches_for({**sizes_for(fam, 200), **dims})
    assert entry.endswith("_tma"), entry
    check_any_grid(build_dir, fam, point, {**sizes_for(fam, 200), **dims})


def check_any_grid(build_dir, fam: Family, point: Point, sizes: dict[str, int]) -> None:
    """The kernel of one launch, whose blocks take its tiles in turn, gives the bytes of its
    table's grid (at least six blocks) on a grid of one block and of three."""
    ((_, _, (grid, block, shared)),) = F.realize(point).launches_for(sizes)
    assert grid[0] * grid[1] >= 6, grid
    _, device = inputs(fam, point, sizes, seed=5)
    want = run(build_dir, fam, point, sizes, device)
    for blocks in (1, 3):
        got = run(build_dir, fam, point, sizes, device,
                  launch_shape=((blocks, 1, 1), block, shared))
        for w, g in zip(want, got, strict=True):
            assert np.isfinite(g.astype(np.float32)).all()
            assert w.tobytes() == g.tobytes(), (fam.name, blocks)


# (family, sizes) for gemm_chain.cu: rows past one tile of 128, ragged; columns past one tile of
# 256 (gate_up_swiglu: 128), ragged, and odd (rows of an odd length: unaligned column pairs), or
# whole 16-byte runs (n % 8 == 0: the quads' transposed stores); k with a short last stage (200
# = 3 x 64 + 8), one stage, or many (1096: 18, so the four stages' barriers turn their phases
# over several times)
CHAIN_CASES = [
    ("linear", {"rows": 130, "k": 200, "n": 300}),
    ("linear", {"rows": 130, "k": 200, "n": 296}),
    ("gate_up_swiglu", {"rows": 140, "k": 136, "n": 296}),
    ("linear", {"rows": 129, "k": 64, "n": 301}),
    ("linear", {"rows": 200, "k": 1096, "n": 300}),
    ("lm_head", {"rows": 128, "k": 288, "n": 520}),
    ("linear_add", {"rows": 257, "k": 136, "n": 264}),
    ("qkv", {"rows": 130, "k": 288, "nq": 264, "nk": 24, "nv": 40}),
    ("gate_up_swiglu", {"rows": 140, "k": 544, "n": 300}),
]


@pytest.mark.parametrize("family,dims", CHAIN_CASES, ids=case_id)
def test_chain_gemm_matches_reference(build_dir, family, dims):
    """gemm_chain.cu against the reference of its point (k in blocks of 16 combined
    sequentially) over ragged tiles in rows, columns and k, every output written."""
    check_gemm(family, dims, "bf16", P, F, _runner(build_dir), k_block=16)


@pytest.mark.parametrize("family,dims", [CHAIN_CASES[4], CHAIN_CASES[7], CHAIN_CASES[8],
                                         CHAIN_CASES[2]],
                         ids=case_id)
def test_chain_gemm_gives_the_same_bytes_on_any_grid(build_dir, family, dims):
    """A block takes the launch's tiles in turn, its producer running into the next tile (row
    invariance: the generic test, at row_window's rows)."""
    fam = P.family(family)
    check_any_grid(build_dir, fam, chain_point(fam), {**sizes_for(fam, dims["rows"]), **dims})


@pytest.mark.parametrize("family,dims", [CHAIN_CASES[3], CHAIN_CASES[5], CHAIN_CASES[6],
                                         CHAIN_CASES[7], CHAIN_CASES[1]], ids=case_id)
def test_chain_gemm_gives_the_same_bytes_in_either_tile_width(build_dir, family, dims):
    fam = P.family(family)
    point = chain_point(fam)
    check_either_width(fam, point, F.realize(point), _runner(build_dir),
                       {**sizes_for(fam, dims["rows"]), **dims})


@pytest.mark.parametrize("weight,least", [("bf16", 128), ("mxfp4", 256)])
def test_chain_gemm_is_refused_below_a_row_tile(weight, least):
    """Fewer rows than a tile (mxfp4: than the rows its one pass over the weights pays at) are
    refused before anything runs (the blocked kernels split k there), so the bounded relations
    leave those matmuls to them."""
    fam = P.family("linear")
    kernel = F.realize(chain_point(fam, weight))
    with pytest.raises(LaunchError, match=f"rows >= {least}"):
        kernel.launches_for({**sizes_for(fam, least - 1), "k": 256, "n": 256})
    assert kernel.launches_for({**sizes_for(fam, least), "k": 256, "n": 256})


@pytest.mark.parametrize("family,dims", [
    ("linear", {"rows": 257, "k": 160, "n": 300}),
    ("lm_head", {"rows": 256, "k": 96, "n": 264}),
    ("linear_add", {"rows": 260, "k": 96, "n": 264}),
    ("qkv", {"rows": 258, "k": 288, "nq": 264, "nk": 24, "nv": 40}),
    ("gate_up_swiglu", {"rows": 257, "k": 160, "n": 136})], ids=case_id)
def test_chain_gemm_of_mxfp4_weights_gives_the_bytes_of_their_bf16_values(build_dir, family,
                                                                          dims):
    """mxfp4 weights at the chain's points are made bf16 first (each value exactly) and the
    chain runs on that copy: the bytes of the bf16 point given the same values, every output
    written and within the dtype's tolerance of the reference."""
    fam = P.family(family)
    point = chain_point(fam, "mxfp4")
    kernel = F.realize(point)
    assert kernel.entries[0].startswith("metrale_weight"), kernel.entries
    assert kernel.entries[1].endswith("_chain"), kernel.entries
    sizes = {**sizes_for(fam, dims["rows"]), **dims}
    host, device = inputs(fam, point, sizes, seed=dims["rows"] + dims["k"])
    got = run(build_dir, fam, point, sizes, device)
    values = dict(zip((p.name for p in fam.inputs), host, strict=True))
    as_bf16 = dict(device)
    for name in fam.weights:
        b = values[name].astype(ml_dtypes.bfloat16)
        assert (b.astype(np.float32) == values[name]).all(), name  # mxfp4 values are bf16's
        as_bf16[name] = (b,)
    want = run(build_dir, fam, chain_point(fam), sizes, as_bf16)
    for w, g in zip(want, got, strict=True):
        assert np.isfinite(g.astype(np.float32)).all()
        assert w.tobytes() == g.tobytes(), family
    compare(point, fam, SEMANTICS[fam.semantics](*host, **kwargs(fam, point)), got)


def test_chain_gemm_of_mxfp4_weights_at_the_scales_ends_gives_the_bytes_of_their_bf16_values(
        build_dir):
    """The same at e8m0's ends: 0 (2^-127: subnormal weights, kept), 250 (2^123, six of which
    f32 still holds) over a whole row, 255 (NaN) in one block; activations near 2^-118 keep the
    large products finite. The copy is the bf16 values (NaN where the scale is), and the
    outputs the bf16 point's bytes, NaN in the NaN block's column alone."""
    fam = P.family("linear")
    point = chain_point(fam, "mxfp4")
    rows, k, n = 257, 160, 136

    def mark(scale: np.ndarray, rng: np.random.Generator) -> None:
        scale[5, 2] = 0
        scale[17, :] = 250
        scale[30, 1] = 255

    x, (w,), device = mxfp4_scaled_inputs(fam, rows, k, n, 81, mark)
    tiny = np.abs(w[5, 64:96])
    assert ((tiny > 0) & (tiny < 2.0 ** -126)).any()  # subnormal values among them
    b = w.astype(ml_dtypes.bfloat16)
    same = (b.astype(np.float32) == w) | (np.isnan(b.astype(np.float32)) & np.isnan(w))
    assert same.all() and np.isnan(w[30]).any()
    sizes = {**sizes_for(fam, rows), "k": k, "n": n}
    (got,) = run(build_dir, fam, point, sizes, device)
    (want,) = run(build_dir, fam, chain_point(fam), sizes, {"x": (x,), "w": (b,)})
    nan = np.isnan(got.astype(np.float32))
    assert (nan == np.isnan(want.astype(np.float32))).all() and nan[:, 30].all()
    assert nan.sum() == rows, "NaN in the NaN block's column alone"
    assert got[~nan].tobytes() == want[~nan].tobytes()
    assert (np.abs(got[:, 17].astype(np.float32)) > 1.0).all()  # the large scales count


@pytest.mark.parametrize("weight", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", [("linear", {"k": 544, "n": 136}),
                                         ("linear_add", {"k": 288, "n": 40}),
                                         ("lm_head", {"k": 288, "n": 72}),
                                         ("gate_up_swiglu", {"k": 288, "n": 72}),
                                         ("qkv", {"k": 288, "nq": 136, "nk": 24, "nv": 40})],
                         ids=case_id)
def test_quantized_weights_made_bf16_first_give_the_bytes_of_the_tiles_conversion(
        build_dir, family, dims, weight):
    """Past its threshold a quantized GEMM makes its weights bf16 in the workspace and runs the
    Tensor Memory Accelerator's blocks on them (gemm_tma.cu); gemm_wgmma.cu, launched alone at
    the same rows, converts each tile in shared memory instead. The outputs are the same bytes
    (the same wgmmas on the same bf16 operands, fp8's row scale and nvfp4's global scale on the
    finished sum), and within the dtype's tolerance of the reference semantics."""
    fam = P.family(family)
    point = matmul_point(fam, "gemm", weight)
    kernel = F.realize(point)
    rows = next(r for r in range(65, 1024) if kernel.sizes({**sizes_for(fam, r), **dims})["tma"])
    sizes = {**sizes_for(fam, rows + 5), **dims}
    assert rows + 5 > 256 and [e for e, _, _ in kernel.launches_for(sizes)] == list(
        kernel.entries[:2]), kernel.entries
    host, device = inputs(fam, point, sizes, seed=rows)
    got = run(build_dir, fam, point, sizes, device)
    wgmma = kernel.then[1]  # gemm_wgmma.cu's blocks of two warpgroups, as below the threshold
    shape = wgmma.launch.bind({**kernel.sizes(sizes), "tma": 0})
    assert shape[1][0] == 256, shape
    want = run(build_dir, fam, point, sizes, device, launch=(wgmma.entry, shape))
    for w, g in zip(want, got, strict=True):
        assert np.isfinite(g.astype(np.float32)).all()
        assert w.tobytes() == g.tobytes(), (family, weight)
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **kwargs(fam, point))
    compare(point, fam, ref, got)


@pytest.mark.parametrize("weight", ["fp8", "mxfp4"])
@pytest.mark.parametrize("part", [slice(300, 310), slice(100, 164)], ids=["10", "64"])
def test_quantized_gemm_rows_keep_their_bytes_across_the_threshold(build_dir, weight, part):
    """Rows of a launch past the threshold (their weights made bf16 first, gemm_tma.cu) have the
    bytes they have launched alone, below it: gemm_wgmma.cu's blocks of one warpgroup, k split
    over the grid and the splits summed in k order. The exact plans stay row-invariant across
    the switch."""
    fam = P.family("linear")
    point = matmul_point(fam, "gemm", weight)
    dims = {"k": 544, "n": 136}
    assert F.realize(point).launches_for({**sizes_for(fam, 400), **dims})[0][0].startswith(
        "metrale_weight")
    check_row_invariance(fam, point, _runner(build_dir), 400, part, dims)


@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_gemm_of_many_column_tiles_at_few_rows_does_not_split_k(build_dir, weight):
    """Up to 64 rows with 264 column tiles or more, k is not split (one launch does it all, the
    combine launch has nothing to do); the outputs match the reference."""
    fam, dims = P.family("linear"), {"rows": 3, "k": 96, "n": 264 * 128 - 5}
    point = matmul_point(fam, "gemm", weight)
    kernel = F.realize(point)
    numbers = {**sizes_for(fam, 3), **dims}
    assert kernel.sizes(numbers)["splits"] == 1
    assert [block[0] for _, _, (_, block, _) in kernel.launches_for(numbers)] == [128]
    check_gemm("linear", dims, weight, P, F, _runner(build_dir))


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_gemm_is_exact_where_every_sum_is(build_dir, weight):
    check_gemm_exact(weight, 70, 544, 136, P, _runner(build_dir))


def test_gemm_of_f32_weights_is_exact_where_every_sum_is(build_dir):
    """All three bf16 parts of each weight reach the sum (k 48: one tile and a half)."""
    check_gemm_exact("f32", 70, 48, 136, P, _runner(build_dir))


# (family, sizes) for the tensor-core GEMV: one and two row groups (8 rows each, the second
# ragged), column groups of 16 with a ragged last one, k-blocks shared by 8 warps unevenly
# (k = 14 x 256 + 32: the last short, warps 0-5 two each, 6 and 7 one)
GEMV_MMA_CASES = [
    ("linear", {"rows": 1, "k": 3616, "n": 40}),
    ("linear", {"rows": 8, "k": 544, "n": 24}),
    ("lm_head", {"rows": 11, "k": 288, "n": 130}),
    ("linear_add", {"rows": 5, "k": 512, "n": 48}),
    ("qkv", {"rows": 2, "k": 288, "nq": 40, "nk": 16, "nv": 24}),
    ("gate_up_swiglu", {"rows": 9, "k": 544, "n": 40}),
    # gpt-oss's biased projections
    ("linear_bias", {"rows": 9, "k": 544, "n": 40}),
    ("qkv_bias", {"rows": 2, "k": 3616, "nq": 40, "nk": 16, "nv": 24}),
    # the experts': a block per 16 outputs of one (row, slot), its expert's rows
    ("moe_gate_up_swiglu", {"rows": 3, "top_k": 2, "e": 5, "k": 544, "n": 40}),
    ("moe_gate_up_clamp", {"rows": 2, "top_k": 3, "e": 4, "k": 3616, "n2": 48, "n": 24}),
    ("moe_down", {"rows": 3, "top_k": 2, "e": 5, "n": 544, "k": 40}),
    ("moe_down_bias", {"rows": 2, "top_k": 2, "e": 3, "n": 288, "k": 72}),
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMV_MMA_CASES, ids=case_id)
def test_gemv_mma_over_groups_matches_reference(build_dir, family, dims, weight):
    """The tensor-core GEMV over row groups, column groups and k-blocks with ragged ends."""
    check_gemm(family, dims, weight, P, F, _runner(build_dir), shape="gemv_mma")


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMV_MMA_CASES, ids=case_id)
def test_mma_gemv_relations_hold_their_declared_bound(build_dir, family, dims, weight):
    check_mma_gemv_bound(family, dims, weight, P, F, _runner(build_dir))


# every family of GEMV_MMA_CASES with a reduced dim of whole 64s (cancelling() mirrors halves);
# gpt-oss's experts at its k of 2880
GEMV_MMA_CANCEL_CASES = [
    ("linear", {"rows": 3, "k": 1024, "n": 40}),
    ("lm_head", {"rows": 3, "k": 640, "n": 130}),
    ("linear_add", {"rows": 5, "k": 512, "n": 48}),
    ("qkv", {"rows": 2, "k": 576, "nq": 40, "nk": 16, "nv": 24}),
    ("gate_up_swiglu", {"rows": 2, "k": 576, "n": 24}),
    ("linear_bias", {"rows": 2, "k": 640, "n": 40}),
    ("qkv_bias", {"rows": 2, "k": 2880, "nq": 40, "nk": 16, "nv": 24}),
    ("moe_gate_up_swiglu", {"rows": 3, "top_k": 2, "e": 5, "k": 1024, "n": 40}),
    ("moe_gate_up_clamp", {"rows": 2, "top_k": 3, "e": 4, "k": 2880, "n2": 48, "n": 24}),
    ("moe_down", {"rows": 1, "top_k": 4, "e": 5, "n": 768, "k": 40}),
    ("moe_down_bias", {"rows": 2, "top_k": 2, "e": 3, "n": 2880, "k": 40}),
]


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
@pytest.mark.parametrize("family,dims", GEMV_MMA_CANCEL_CASES, ids=case_id)
def test_mma_gemv_bounds_hold_where_every_sum_cancels(build_dir, family, dims, weight):
    """The bounds are in the magnitude Σ|terms|, not |lhs|: on sums that cancel to rounding,
    with activations large enough to push gpt-oss's gates past the clamp, they still hold."""
    check_mma_gemv_bound(family, dims, weight, P, F, _runner(build_dir), cancel=True)


@pytest.mark.parametrize("family", ["linear", "gate_up_swiglu"])
def test_gemv_mma_mxfp4_scales_past_one_product_and_nan(build_dir, family):
    check_gemv_mma_mxfp4_scales(family, P, F, _runner(build_dir))


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_gemv_mma_is_exact_where_every_sum_is(build_dir, weight):
    check_gemm_exact(weight, 8, 544, 40, P, _runner(build_dir), shape="gemv_mma")


def test_a_pipeline_one_wait_short_reads_poison(build_dir):
    """The emulation's cp.async copies land only at the wait that completes their group: built
    to leave one group more in flight than the kernel asks (METRALE_SIMT_WAIT_SLACK=1), the GEMM
    reads tiles still in flight, which hold the poison shared memory starts with, so none of its
    outputs is finite. A wait missing from a kernel would fail the tests above the same way."""
    fam = P.family("linear")
    point = fam.point(**GEMM, weight="bf16")
    sizes = {"rows": 16, "k": 544, "n": 128}
    _, device = inputs(fam, point, sizes, seed=1)
    (good,) = run(build_dir, fam, point, sizes, device)
    (short,) = run(build_dir, fam, point, sizes, device, extra=("METRALE_SIMT_WAIT_SLACK=1",))
    assert np.isfinite(good.astype(np.float32)).all()
    assert not np.isfinite(short.astype(np.float32)).any()


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
def test_the_attention_ring_says_a_tile_landed_only_once_it_has(build_dir, family):
    """sm_90's prefill attention: the producer arrives on a buffer's full barrier only after the
    wait that completes its copies, and the computing warpgroups read a buffer only once that
    barrier's phase completes. Built with one cp.async group more left in flight at every wait
    (METRALE_SIMT_WAIT_SLACK=1), the producer says tiles landed that have not, the wgmmas read
    the poison shared memory starts with, and rows come out non-finite; as built, none does. A
    prompt of 300 rows from position 0: five tiles a row at most, past the ring's buffers."""
    fam = P.family(family)
    point = prefill_point(fam)
    assert F.realize(point).source == "sm_90/common/attention_wgmma.cu"
    rows, d = 300, 64
    sizes = {**sizes_for(fam, rows), "hq": 4, "hkv": 2, "d": d, "slots": 1, "max_ctx": rows}
    _, device = inputs(fam, point, sizes, seed=11)
    device["positions"], device["slots"] = (np.arange(rows, dtype=np.int32),), \
        (np.zeros(rows, np.int32),)
    attrs = {"window": 0, "scale": d ** -0.5}
    (good,) = run(build_dir, fam, point, sizes, device, attrs)[:1]
    (short,) = run(build_dir, fam, point, sizes, device, attrs,
                   extra=("METRALE_SIMT_WAIT_SLACK=1",))[:1]
    assert np.isfinite(good.astype(np.float32)).all()
    assert not np.isfinite(short.astype(np.float32)).all()


@pytest.mark.parametrize("rows,entry", [(16, "metrale_linear_wgmma"), (130, "metrale_linear_tma")])
def test_wgmma_reads_its_operands_through_the_swizzle(build_dir, rows, entry):
    """The emulated wgmma decodes the 128-byte swizzle of its descriptors: built to read without
    it (METRALE_SIMT_NO_SWIZZLE=1), the GEMM, whose tiles are stored swizzled (by its threads'
    copies up to 64 rows, by the emulated Tensor Memory Accelerator past them), reads the wrong
    columns, and its outputs move far from the reference's."""
    fam = P.family("linear")
    point = fam.point(**GEMM, weight="bf16")
    sizes = {"rows": rows, "k": 544, "n": 128}
    assert F.realize(point).launches_for({**sizes_for(fam, rows), **sizes})[0][0] == entry
    host, device = inputs(fam, point, sizes, seed=3)
    want = SEMANTICS[fam.semantics](*host, **kwargs(fam, point))[0].astype(np.float32)
    (good,) = run(build_dir, fam, point, sizes, device)
    (plain,) = run(build_dir, fam, point, sizes, device, extra=("METRALE_SIMT_NO_SWIZZLE=1",))
    scale = np.abs(want).max()
    assert np.abs(good.astype(np.float32) - want).max() < 0.02 * scale
    assert np.abs(plain.astype(np.float32) - want).max() > 0.2 * scale


def test_shared_memory_past_the_launch_size_faults(build_dir):
    """The emulation faults where the GPU would: the GEMM (sm_90's, on wgmma) launched with 2 KiB
    less dynamic shared memory than its table gives writes past it once k fills its stages and
    the mxfp4 weight's two raw slots after them (the table's 1024 bytes past those only align
    the first stage, and the emulation's shared memory starts aligned), and the launch reports
    a fault. At 16 rows the launch splits k (three splits of a k-block: four tiles, the four
    stages), its workspace given."""
    fam = P.family("linear")
    point = fam.point(**GEMM, weight="mxfp4")
    kernel = F.realize(point)
    sizes = {"rows": 16, "k": 544, "n": 128}
    _, device = inputs(fam, point, sizes, seed=2)
    # up to its threshold of rows the quantized chain's first launch made is gemm_wgmma.cu's
    ((entry, _, (grid, block, shared)), _combine) = kernel.launches_for(sizes)
    env = kernel.sizes(sizes)
    assert entry == "metrale_linear_wgmma" and grid[2] == env["splits"] == 3
    assert shared == 4 * (8192 + 16384) + 2 * 128 * 32 + 1024
    args = [device["x"][0], device["w"][0], device["w"][1], None,
            np.empty((16, 128), ml_dtypes.bfloat16), 16, 544, 128,
            np.zeros(env["ws"] // 4, np.float32), env["splits"]]
    lib = library(build_dir, point)
    assert lib.run(entry, grid, block, shared, args) == 0
    assert lib.run(entry, grid, block, shared - 1024, args) == 0
    assert lib.run(entry, grid, block, shared - 2048, args) == 2


@pytest.mark.parametrize("fam,point", row_invariant_points(_cases(), F),
                         ids=lambda x: str(x) if isinstance(x, Point) else "")
def test_row_invariance_on_the_emulation(build_dir, fam, point):
    check_row_invariance(fam, point, _runner(build_dir), *row_window(fam, F.realize(point)))


@pytest.mark.parametrize("rel,rhs", [(r, p) for r, p in relation_cases(F)
                                     if p.as_dict().get("act") != "f32"],
                         ids=lambda x: str(x) if isinstance(x, Point) else x.name)
def test_bit_identical_relations_hold_on_the_emulation(build_dir, rel, rhs):
    """Both sides of a relation sm_90 declares bit-identical give equal bytes on the emulation
    too (the device tests are the authority: the host compiler contracts no products into fused
    multiply-adds, nvcc may)."""
    check_relation(rel, rhs, P, _runner(build_dir),
                   rows=check_rows(P.family(rhs.family), F.realize(rhs)))

@pytest.mark.parametrize("act", ["bf16", "f32"])
@pytest.mark.parametrize("h,top_k", [(2880, 4), (100, 3)])
def test_moe_combine_add_rmsnorm_gives_the_two_launches_bytes_on_hard_values(build_dir, h,
                                                                              top_k, act):
    check_combine_norm_hard_values(act, h, top_k, P, _runner(build_dir))


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
@pytest.mark.parametrize("hq,hkv,d,window", sampled(PREFILL_SHAPES, keep=range(1, len(PREFILL_SHAPES))))
def test_prefill_attention_over_tiles_blocks_and_slots(build_dir, family, hq, hkv, d, window):
    skip_where_the_prefill_kernel_refuses(P.family(family), F, hq, hkv, d)
    check_prefill_attention(P.family(family), hq, hkv, d, window, _runner(build_dir), F)


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
def test_prefill_attention_over_rows_out_of_position_order(build_dir, family):
    check_prefill_attention(P.family(family), 16, 8, 128, 100, _runner(build_dir), F,
                            scattered=True)


@pytest.mark.parametrize("hq,hkv,d,window", [(16, 8, 128, 100), (8, 4, 256, 300)])
def test_online_prefill_attention_without_tensor_cores_matches_reference(build_dir, hq, hkv, d,
                                                                          window):
    """The common layer's plain online softmax (attention.cu, for a class with no tensor cores;
    head dims past 128 too) against its semantics, as the tensor-core kernel is checked."""
    fam = P.family("kv_append_attention_online")
    assert F_CUDA.realize(prefill_point(fam)).entry == "metrale_kv_append_attention_online"
    check_prefill_attention(fam, hq, hkv, d, window,
                            lambda f, p, sz, dev, attrs=None: run(build_dir, f, p, sz, dev, attrs,
                                                                  F_=F_CUDA), F_CUDA)


@pytest.mark.parametrize("hq,hkv,d", sampled([(8, 2, 64), (16, 8, 128)], keep=[0]))
def test_online_prefill_attention_holds_its_declared_bound(build_dir, hq, hkv, d):
    check_online_attention_bound(hq, hkv, d, P, F, _runner(build_dir))


def test_online_prefill_attention_on_scores_past_f32_s_range(build_dir):
    check_online_attention_far_scores(P, F, _runner(build_dir))


F_SM80 = realization("sm_80", presentation=P)


@pytest.mark.parametrize("check", [*PREFILL_FAMILIES, "bound", "far_scores"])
def test_the_mma_sync_prefill_attention_of_the_classes_without_wgmma(build_dir, check):
    """attention_prefill.cu and attention_online.cu, the prefill attention of sm_80 and the
    classes that have mma.sync but not sm_90's wgmma (which sm_90's attention_wgmma.cu shadows),
    on the same cases as sm_90's: each family's tiles, blocks and slots against the reference,
    the online relation's bound against the two-pass kernel, and scores past f32's range."""
    fam = P.family("kv_append_attention_online")
    assert F_SM80.realize(prefill_point(fam)).source == "cuda/common/attention_online.cu"
    assert F_SM80.realize(prefill_point(P.family("attention"))).source == \
        "cuda/common/attention_prefill.cu"

    def runner(f, p, sz, dev, attrs=None):
        return run(build_dir, f, p, sz, dev, attrs, F_=F_SM80)

    if check in PREFILL_FAMILIES:
        check_prefill_attention(P.family(check), 16, 8, 128, 100, runner, F_SM80)
    elif check == "bound":
        check_online_attention_bound(16, 8, 128, P, F_SM80, runner)
    else:
        check_online_attention_far_scores(P, F_SM80, runner)


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
@pytest.mark.parametrize("hq,hkv", sampled([(8, 8), (16, 8), (32, 8), (12, 4)], keep=[0, 3]))
def test_prefill_attention_bytes_do_not_depend_on_the_rows_a_block_takes(build_dir, family, hq,
                                                                         hkv):
    """The prefill attention with blocks of 1 to 4 tiles of 16 rows (as many as 8 warps take),
    the table's choice among them, gives the same bytes: a warp's computation is its own rows',
    whatever else its block holds (the online kernel's tiles that none of a warp's rows attends
    to included); sm_90's wgmma kernel (64 rows a block) the same with one q head's warpgroup a
    block or two. A 70-row prompt from position 0, so that blocks are partly past the rows, then
    the same across two slots."""
    fam = P.family(family)
    point = prefill_point(fam)
    kernel = F.realize(point)
    rows, d, g = 70, 64, hq // hkv
    wgmma = "wgmma" in kernel.entry
    if wgmma and g == 1:
        pytest.skip("one warpgroup a block is the wgmma kernel's only shape at one q head a kv "
                    "head")
    for case, positions, slots in (
            ("prompt", np.arange(rows), np.zeros(rows)),
            ("slots", np.concatenate([np.arange(250, 290), np.arange(30)]),
             np.concatenate([np.ones(40), np.zeros(30)]))):
        sizes = {**sizes_for(fam, rows), "hq": hq, "hkv": hkv, "d": d, "slots": 2,
                 "max_ctx": 300}
        _, device = inputs(fam, point, sizes, seed=hq * 7 + hkv)
        device["positions"], device["slots"] = (positions.astype(np.int32),), \
            (slots.astype(np.int32),)
        attrs = {"window": 0, "scale": d ** -0.5}
        (gx, gy, gz), (own, _, _), shared = kernel.launch_for(
            {**sizes, **dict(fam.attr_examples), **attrs})
        outs = {}
        if wgmma:  # a producer warpgroup and w that compute; the online entry's blocks take
            # the X Y items in turns (grid y 1): as many blocks, or fewer, give the same bytes
            shapes = {}
            for w in (1, 2):
                x, y = hkv * -(-g // w), -(-rows // 64)
                grids = [(x * y, 1, gz), (3, 1, gz), (1, 1, gz)] if gy == 1 else [(x, y, gz)]
                for grid in grids:
                    shapes[128 * w + 128, grid] = (grid, (128 * w + 128, 1, 1), shared)
            mine = (own, (gx, gy, gz))
        else:
            shapes = {(32 * g * rt, None): ((gx, -(-rows // (16 * rt)), gz), (32 * g * rt, 1, 1),
                                            shared)
                      for rt in (1, 2, 4) if 32 * g * rt <= 256}
            mine = (own, None)
        for key, shape in shapes.items():
            outs[key] = run(build_dir, fam, point, sizes, device, attrs, launch_shape=shape)[0]
        if mine not in outs:  # the table's own grid (the online entry's: min(sms, items))
            outs[mine] = run(build_dir, fam, point, sizes, device, attrs,
                             launch_shape=((gx, gy, gz), (own, 1, 1), shared))[0]
        assert len(outs) > 1, sorted(outs)
        assert np.isfinite(outs[mine].astype(np.float32)).all(), case
        for key, out in outs.items():
            assert out.tobytes() == outs[mine].tobytes(), (case, key, mine)


# (hq, hkv, d): groups of more than four q heads, which decode attention splits over blocks of
# the same kv head (eight: two blocks of four; nine: four and five; twelve: three of four)
SPLIT_GROUPS = [(16, 2, 64), (9, 1, 64), (12, 1, 32)]


@pytest.mark.parametrize("window", [0, 100])
@pytest.mark.parametrize("hq,hkv,d", SPLIT_GROUPS)
@pytest.mark.parametrize("family", ["attention", "rope_kv_append_attention",
                                    "qk_norm_rope_kv_append_attention"])
def test_decode_attention_over_split_groups_matches_reference(build_dir, family, hq, hkv, d,
                                                              window):
    """Each block of a split group stages, scores and records only its own q heads, and the merge
    launch writes every head; the appending entries write the new k and v once: rows at
    positions over several chunks and KV blocks, with and without a window, against the
    reference."""
    fam = P.family(family)
    point = next(p for p in fam.points if p.as_dict()["act"] == "bf16"
                 and p.as_dict()["mode"] == "decode" and p.as_dict().get("style", "neox") == "neox")
    kernel = F.realize(point)
    sizes = {**sizes_for(fam, 3), "hq": hq, "hkv": hkv, "d": d, "max_ctx": 300, "slots": 4}
    sizes.update({k: v for k, v in (("half", d // 2), ("max_pos", 300)) if k in sizes})
    numbers = {**sizes, **dict(fam.attr_examples)}
    assert kernel.launch_for(numbers)[0][0] == hkv * max(1, hq // hkv // 4)
    host, device = inputs(fam, point, sizes, seed=hq * 1000 + d + window)
    call = {**kwargs(fam, point), "window": window, "scale": d ** -0.5}
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **call)
    got = run(build_dir, fam, point, sizes, device, {"window": window, "scale": d ** -0.5})
    compare(point, fam, ref, got)


MULTI_ROW_CASES = [(f, w, d) for f in MULTI_ROW_FAMILIES for w in ("bf16", "fp8", "mxfp4", "nvfp4")
                   for d in ({}, {"k": 288})] + [
    ("linear", "bf16", {"k": 200}), ("linear", "bf16", {"k": 264, "n": 1030}),
    ("gate_up_swiglu", "bf16", {"k": 200}), ("linear_add", "fp8", {"k": 1032, "n": 1025}),
    ("qkv", "bf16", {"k": 200})]
"""(family, weight, sizes): the example sizes and k = 288 (a last k-block of one load) in every
format; bf16 at k = 200 (not a multiple of 8: the multi-row entries' one-row-at-a-time path);
linear and linear_add past n = 1024 (a warp two columns rather than the split)."""


@pytest.mark.parametrize("rows", [2, 8, 16, 19])
@pytest.mark.parametrize("family,weight,dims", MULTI_ROW_CASES, ids=case_id)
def test_multi_row_entries_give_each_row_its_one_row_bytes(build_dir, family, weight, dims,
                                                           rows):
    """A launch of 2 to 8 rows makes the `_rows8` entries, one of more the `_rows16` ones (19
    rows: a tile of 16 and one of 3), which load each weight chunk once for all the tile's rows;
    every row's output has the bytes of that row launched alone (the one-row entries), on x
    rows holding NaN, infinities, subnormals, signed zeros and cancelling sums."""
    fam = P.family(family)
    point = matmul_point(fam, "gemv", weight)
    sizes = {**sizes_for(fam, rows), **dims}
    want = multi_row_entry(F.realize(point), {**sizes, **dict(fam.attr_examples)})
    assert want.endswith("_rows8" if rows <= 8 else "_rows16"), want
    check_rows_alone(fam, point, lambda *a: run(build_dir, *a), rows, dims)


@pytest.mark.parametrize("n", [20, 1030])
def test_multi_row_tree_is_the_one_row_tree(build_dir, n):
    """Inputs on which the pairing of a k-block's 32 chunk sums shows in the output (w all ones,
    every chunk sum exact): row r's chunk r sums to 2^24, chunk r ^ 16 (r even) or r ^ 1 (r odd)
    to -2^24, and each other chunk r ^ 2^i to 1. The butterfly adds chunk l to chunk l ^ 16
    first and l ^ 1 last, so the ones survive (even rows: 4) or are rounded away next to 2^24
    (odd rows: 0). Each of the 8 rows of the multi-row launch (n = 20: the split entry; 1030: a
    warp two columns) gives the tree's value, and the one-row launch's bytes."""
    fam = P.family("linear")
    point = matmul_point(fam, "gemv", "bf16")
    rows, k = 8, 256
    x = np.zeros((rows, k), np.float32)
    for r in range(rows):
        x[r, 8 * r] = 2.0 ** 24
        x[r, 8 * (r ^ (16 if r % 2 == 0 else 1))] = -(2.0 ** 24)
        for b in (16, 8, 4, 2, 1):
            if x[r, 8 * (r ^ b)] == 0:
                x[r, 8 * (r ^ b)] = 1.0
    xb = x.astype(ml_dtypes.bfloat16)
    wb = np.ones((n, k), ml_dtypes.bfloat16)
    device = {"x": (xb,), "w": (wb,)}
    sizes = {**sizes_for(fam, rows), "k": k, "n": n}
    tree = x[:, 0::8].copy()  # the chunk sums, then gemv.cuh's butterfly in f32
    for o in (16, 8, 4, 2, 1):
        tree = tree + tree[:, np.arange(32) ^ o]
    want = tree[:, 0]
    (multi,) = run(build_dir, fam, point, sizes, device)
    for r in range(rows):
        (one,) = run(build_dir, fam, point, {**sizes, "rows": 1},
                     {"x": (xb[r:r + 1],), "w": (wb,)})
        assert multi[r].tobytes() == one[0].tobytes(), r
    assert (want[0::2] == 4.0).all() and (want[1::2] == 0.0).all(), want
    assert (multi.astype(np.float32) == want[:, None]).all(), (multi[:, 0], want)


@pytest.mark.parametrize("rows", sampled([8, 16], keep=[0]))
@pytest.mark.parametrize("params", [
    {"act": "bf16", "weight": "bf16", "across": "pairwise"},
    {"act": "bf16", "weight": "f32", "across": "sequential"},
    {"act": "f32", "weight": "bf16", "across": "sequential"},
    {"act": "f32", "weight": "f32", "across": "sequential"},
    {"act": "f32", "weight": "bf16", "across": "pairwise"}], ids=lambda p: "-".join(p.values()))
@pytest.mark.parametrize("n", [40, 1030])
def test_multi_row_entries_in_the_other_orders_and_types(build_dir, params, n, rows):
    """The multi-row entries at linear's other points: the pairwise combine, f32 weights and f32
    activations (the tests' type), a warp two columns (n = 1030) and the split (n = 40), at
    k = 2304 (9 k-blocks): each row's bytes are the one-row launch's."""
    fam = P.family("linear")
    point = fam.point(shape="gemv", k_block=256, **params)
    dims = {"k": 2304, "n": n}
    multi_row_entry(F.realize(point), {**sizes_for(fam, rows), **dims})
    check_rows_alone(fam, point, lambda *a: run(build_dir, *a), rows, dims)
