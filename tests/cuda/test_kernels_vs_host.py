"""Every CUDA kernel against the host reference semantics, on the device (sm_90 realization).

For each family point realized on sm_90: fresh random inputs (never zeros; quantized weights
quantized by ``lkb.quant`` and the reference given the dequantized values), outputs poisoned
with NaN before the launch, then compared with dtype tolerances; integer outputs exactly.
Every relation that holds bit-identically on sm_90 is checked byte-equal on the device, and
every row-invariant kernel gives row r the same bytes alone as in a batch of 8.
"""

from __future__ import annotations

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")

from metrale.lkb.family import Family, Point  # noqa: E402
from metrale.lkb.presentation import Presentation  # noqa: E402
from metrale.lkb.quant import QuantFormat  # noqa: E402
from metrale.lkb.semantics import SEMANTICS  # noqa: E402
from metrale.realize.functor import realization  # noqa: E402
from metrale.realize.kernel import workspace_bytes  # noqa: E402
from metrale.runtime.backend import TensorMap  # noqa: E402
from metrale.runtime.cuda_loader import CudaLoader  # noqa: E402
from metrale.runtime.cupy_backend import CupyBackend  # noqa: E402
from tests.kernel_cases import (  # noqa: E402
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
    relation_cases,
    row_invariant_points,
    row_window,
    seed_of,
    sizes_for,
    skip_unless_k_fits,
    skip_where_the_prefill_kernel_refuses,
    split_linear_cases,
)

ok, why = CupyBackend.available()
if not ok:
    pytest.skip(f"no CUDA device: {why}", allow_module_level=True)

P = Presentation.load()
F = realization("sm_90", presentation=P)


@pytest.fixture(scope="module")
def gpu():
    from metrale.realize.build import compile_kernels

    backend = CupyBackend()
    loader = CudaLoader(backend, F.hw.arch)
    # every point's binary at once, one compile per core, before the first test binds one
    compile_kernels(F.kernels(), F.hw.arch, cache=loader.cache,
                    kernels_dir=loader.root, compute=loader.target, progress=False)
    yield backend, loader
    backend.close()


def _points() -> list[tuple[Family, Point]]:
    out = []
    for fam in P.generators:
        if fam.view:
            continue
        for point in fam.points:
            if F.realize(point) is not None:
                out.append((fam, point))
    return out


def _run_gpu(gpu, fam: Family, point: Point, sizes: dict[str, int], device: dict,
             launches: int = 1, attrs: dict | None = None,
             launch: tuple[str, tuple] | None = None):
    """The outputs of ``launches`` launches (outputs poisoned before each, one zeroed workspace
    for the kernel's scratch arguments across them), as host arrays; ``attrs`` overrides the
    family's example attributes; ``launch`` (entry, (grid, block, shared)) makes that one
    launch of any entry of the kernel's chain in place of the rule's launches."""
    backend, loader = gpu
    bound = loader.bind(F.realize(point))
    params = point.as_dict()
    ptrs, owned = {}, []

    def upload(a: np.ndarray):
        a = np.ascontiguousarray(a)
        ptr = backend.alloc(max(a.nbytes, 1), label="in")
        owned.append(ptr)
        backend.copy_h2d(ptr, a.view(np.uint8).reshape(-1))
        return ptr

    for name, parts in device.items():
        ptrs[name] = upload(parts[0])
        if len(parts) > 1:
            ptrs[f"{name}_scale"] = None if parts[1] is None else upload(np.asarray(parts[1]))
            ptrs[f"{name}_global"] = (None if parts[2] is None else
                                      upload(np.asarray(parts[2], np.float32).reshape(1)))
    inplace = dict(fam.inplace)
    outs = []
    for port in fam.outputs:
        if port.name in inplace:
            ptrs[port.name] = ptrs[inplace[port.name]]
            outs.append((port, ptrs[port.name]))
            continue
        t = port.type(params)
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in port.dims)
        nbytes = int(np.prod(shape)) * t.dtype.numpy.itemsize
        ptr = backend.alloc(max(nbytes, 1), label=port.name)
        owned.append(ptr)
        backend.memset(ptr, 0xFF, nbytes)  # poison: NaN for floats, -1 for ints
        ptrs[port.name] = ptr
        outs.append((port, ptr))
    numbers = {**sizes, **dict(fam.attr_examples), **(attrs or {})}
    # one zeroed workspace, each scratch argument at its slice (a scratch tensor as its map
    # where a launch takes that), as the executor lays them out
    slices = bound.workspace(numbers)
    if slices:
        work = backend.alloc(max(workspace_bytes(slices), 1), label="workspace")
        owned.append(work)
        backend.memset(work, 0)
        for name, s in slices.items():
            ptrs[name] = (work + s.offset).take(s.nbytes)
    for a in (*bound.args, *(a for _, args in bound.then for a in args)):
        if a.kind == "tmap" and not isinstance(ptrs[a.name], TensorMap):  # its array's map
            if a.name in slices:
                s = slices[a.name]
                ptrs[a.name] = TensorMap(ptrs[a.name], s.rows, s.cols, s.dtype, a.box)
                continue
            arr = np.asarray(device[a.name][0])
            ptrs[a.name] = TensorMap(ptrs[a.name], arr.size // arr.shape[-1], arr.shape[-1],
                                     "bf16", a.box)
    kernel = F.realize(point)
    if kernel.transport:  # a collective of one rank: its transport gathers its own x alone
        assert kernel.transport == "all_gather" and numbers["ranks"] == 1, kernel
    for i in range(launches):
        if i:
            for port, ptr in outs:
                if port.name not in inplace:
                    backend.memset(ptr, 0xFF)
        if kernel.transport:  # before each launch, as the loader launches it
            x = np.ascontiguousarray(device["x"][0])
            backend.copy_h2d(ptrs[kernel.args[0].partition(":")[0]],
                             x.view(np.uint8).reshape(-1))
        if launch is None:
            bound.launch(backend, ptrs, numbers)
        else:
            handle, args = bound.call(launch[0])
            backend.launch(handle, *launch[1], bound.pack(ptrs, numbers, args))
        backend.synchronize()
    results = []
    for port, ptr in outs:
        t = port.type(params)
        shape = tuple(sizes[d] if isinstance(d, str) else d for d in port.dims)
        raw = backend.copy_d2h(ptr, int(np.prod(shape)) * t.dtype.numpy.itemsize)
        results.append(raw.view(t.dtype.numpy).reshape(shape))
    for ptr in owned:
        backend.free(ptr)
    return results


@pytest.mark.parametrize("fam,point", _points(), ids=lambda x: str(x) if isinstance(x, Point)
                         else "")
def test_kernel_matches_reference(gpu, fam, point):
    sizes = sizes_for(fam, check_rows(fam, F.realize(point)))
    host, device = inputs(fam, point, sizes, seed=seed_of(point))
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **kwargs(fam, point))
    got = _run_gpu(gpu, fam, point, sizes, device)
    compare(point, fam, ref, got)


# (hq, hkv, d): Llama-3.1-8B and Qwen3-0.6B, one q head per kv head, Qwen3-MoE's eight, and
# a group of three with head_dim 96 (neither a power of two)
DECODE_SHAPES = [(32, 8, 128), (16, 8, 128), (8, 8, 64), (32, 4, 128), (12, 4, 96)]


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("hq,hkv,d", DECODE_SHAPES)
@pytest.mark.parametrize("family", ["attention", "rope_kv_append_attention",
                                    "qk_norm_rope_kv_append_attention"])
def test_decode_attention_at_model_shapes_matches_reference(gpu, family, hq, hkv, d, window):
    """Decode attention at model head shapes and a 1100-position cache: rows at positions
    spread over many chunks and KV blocks (the merge's order), with and without a window."""
    fam = P.family(family)
    point = next(p for p in fam.points if p.as_dict()["act"] == "bf16"
                 and p.as_dict()["mode"] == "decode" and p.as_dict().get("style", "neox") == "neox")
    sizes = {**sizes_for(fam, 4), "hq": hq, "hkv": hkv, "d": d, "max_ctx": 1100, "slots": 5}
    sizes.update({k: v for k, v in (("half", d // 2), ("max_pos", 1100)) if k in sizes})
    host, device = inputs(fam, point, sizes, seed=hq * 1000 + d + window)
    call = {**kwargs(fam, point), "window": window, "scale": d ** -0.5}
    ref = SEMANTICS[fam.semantics](*[h.copy() for h in host], **call)
    got = _run_gpu(gpu, fam, point, sizes, device,
                   attrs={"window": window, "scale": d ** -0.5})
    compare(point, fam, ref, got)


GEMV = {"act": "bf16", "shape": "gemv", "k_block": 256, "across": "sequential"}
"""The decode GEMV point's parameters other than the weight format."""


def _dequantized_gemv(gpu, family: str, sizes: dict[str, int], x: tuple, weights: list):
    """What a quantized ``family`` GEMV must give, byte for byte, by the dequant_linear relation:
    linear with f32 weights on each dequantized weight (the dots), then, for gate_up_swiglu,
    swiglu of the two. Returns (dots, wanted outputs)."""
    linear, swiglu = P.family("linear"), P.family("swiglu")
    plain = linear.point(**GEMV, weight="f32")
    dots = [_run_gpu(gpu, linear, plain, sizes, {"x": x, "w": (w,)})[0] for w in weights]
    if family == "linear":
        return dots, dots
    return dots, _run_gpu(gpu, swiglu, swiglu.point(act="bf16"), sizes,
                          {"g": (dots[0],), "u": (dots[1],)})


# k of the decode GEMVs (Qwen3-MoE's experts, Qwen3-0.6B, Llama-3.1-8B), then two ragged ones:
# 1056 ends in a k-block of 32 columns (fp4's wide loads cover four blocks, fp8's two), 1032
# is a multiple of 8 but not of 16 (fp8 falls back to one chunk per load; fp4 cannot have it)
QUANT_K = [768, 1024, 2048, 3072, 4096, 14336, 1056, 1032]
QUANT_CASES = [(fmt, k) for fmt in ("fp8", "mxfp4", "nvfp4") for k in QUANT_K
               if k % (QuantFormat.parse(fmt).block_size or 1) == 0]


@pytest.mark.parametrize("fmt,k", QUANT_CASES)
@pytest.mark.parametrize("family", ["linear", "gate_up_swiglu"])
def test_quantized_gemv_gives_the_dequantized_bytes_at_model_k(gpu, family, fmt, k):
    """A GEMV reading quantized weights gives, byte for byte, what linear gives on the same
    weights dequantized to f32 (the dequant_linear relation; for gate_up_swiglu, one linear per
    weight and then swiglu) at the model sizes of k, where the wide loads of fp8 and fp4 cover
    several k-blocks (f32 weights take one chunk per load); and it agrees with the reference."""
    fam = P.family(family)
    quant = fam.point(**GEMV, weight=fmt)
    sizes = {**sizes_for(fam, 3), "k": k, "n": 72}
    host, device = inputs(fam, quant, sizes, seed=k)
    got = _run_gpu(gpu, fam, quant, sizes, device)
    weights = [h for port, h in zip(fam.inputs, host) if port.name in fam.weights]
    _, want = _dequantized_gemv(gpu, family, sizes, device["x"], weights)
    assert got[0].tobytes() == want[0].tobytes(), f"{quant} k={k}"
    compare(quant, fam, SEMANTICS[fam.semantics](*host, **kwargs(fam, quant)), got)


@pytest.mark.parametrize("family", ["linear", "gate_up_swiglu"])
def test_mxfp4_scales_past_one_product_give_the_dequantized_bytes(gpu, family):
    """mxfp4 scale bytes above 240 (factors 2^114 and up) overflow the one-product
    dequantization, and a warp with such a scale in a load takes the two-product path for that
    load: rows with them in some blocks, one row with them in every block, the rest ordinary; the
    activations are tiny so that every product stays finite. Byte-equal to linear on the f32
    dequantized weights."""
    fam = P.family(family)
    quant = fam.point(**GEMV, weight="mxfp4")
    k, n = 4096, 72
    sizes = {**sizes_for(fam, 3), "k": k, "n": n}

    def mark(scale: np.ndarray, rng: np.random.Generator) -> None:
        scale[5, 3] = scale[40, 100] = 245  # one load of a row, another row's last load
        scale[17, :] = rng.integers(241, 251, k // 32)  # every block of one row
        scale[60, ::7] = 250

    x, weights, device = mxfp4_scaled_inputs(fam, 3, k, n, 240, mark)
    got = _run_gpu(gpu, fam, quant, sizes, device)
    dots, want = _dequantized_gemv(gpu, family, sizes, (x,), weights)
    assert np.isfinite(want[0].astype(np.float32)).all()
    assert (np.abs(dots[0].astype(np.float32)[:, 17]) > 1.0).all()  # the large scales count
    assert got[0].tobytes() == want[0].tobytes(), quant


@pytest.mark.parametrize("rows,suffix", [(1, ""), (5, "_rows8"), (19, "_rows16")])
@pytest.mark.parametrize("family,across,weight", split_linear_cases(P, F))
def test_split_linear_gives_the_one_warp_bytes_on_device(gpu, family, across, weight, rows,
                                                         suffix):
    """linear and linear_add make their split launch (a block a column, or two past one row, the
    k-block partials combined in order) up to n = 1024 and the one-warp launch above (one row,
    or the multi-row entries' warp of two columns). A column's bytes depend only on its weight
    row and x, so on the same weights the 1024 columns of the split launch equal, byte for
    byte, the first 1024 of the launch at n = 1025: k = 14336 (56 k-blocks, down_proj's), 1, 5
    or 19 rows (two tiles of rows)."""
    fam = P.family(family)
    point = fam.point(**{**GEMV, "across": across}, weight=weight)
    kernel = F.realize(point)
    sizes = {**sizes_for(fam, rows), "k": 14336, "n": 1025}
    numbers = {**sizes, **dict(fam.attr_examples)}
    assert [e for e, _, _ in kernel.launches_for(numbers)] == [kernel.entry + suffix]
    assert [e for e, _, _ in kernel.launches_for({**numbers, "n": 1024})] == [
        kernel.entry + "_split" + suffix]
    _, device = inputs(fam, point, sizes, seed=1025)
    whole = _run_gpu(gpu, fam, point, sizes, device)
    cut = {}
    for port in fam.inputs:  # every input along n cut to its first 1024
        axis = port.dims.index("n") if "n" in port.dims else None
        cut[port.name] = tuple(
            p if axis is None or p is None or np.ndim(p) <= axis or np.shape(p)[axis] != 1025
            else np.take(p, np.arange(1024), axis=axis) for p in device[port.name])
    split = _run_gpu(gpu, fam, point, {**sizes, "n": 1024}, cut)
    assert whole[0][:, :1024].tobytes() == split[0].tobytes(), point
    assert np.isfinite(split[0].astype(np.float32)).all()


def _row_invariant_points():
    return row_invariant_points(_points(), F)


@pytest.mark.parametrize("fam,point", _row_invariant_points(),
                         ids=lambda x: str(x) if isinstance(x, Point) else "")
def test_row_invariance_on_device(gpu, fam, point):
    check_row_invariance(fam, point, lambda *a: _run_gpu(gpu, *a),
                         *row_window(fam, F.realize(point)))


@pytest.mark.parametrize("rel,rhs", relation_cases(F),
                         ids=lambda x: str(x) if isinstance(x, Point) else x.name)
def test_bit_identical_relations_hold_on_device(gpu, rel, rhs):
    """Both sides of a relation sm_90 declares bit-identical give equal bytes on the device."""
    check_relation(rel, rhs, P, lambda *a: _run_gpu(gpu, *a),
                   rows=check_rows(P.family(rhs.family), F.realize(rhs)))


@pytest.mark.parametrize("family,dims", [
    ("linear", {"rows": 130, "k": 1096, "n": 300}),
    ("lm_head", {"rows": 300, "k": 4096, "n": 520}),
    ("linear_add", {"rows": 257, "k": 136, "n": 264}),
    ("qkv", {"rows": 130, "k": 288, "nq": 264, "nk": 24, "nv": 40}),
], ids=case_id)
def test_chain_gemm_gives_the_same_bytes_in_either_tile_width(gpu, family, dims):
    """gemm_chain.cu's m64n256k16 and m64n128k16 wgmmas give each output the same bytes on the
    device: its tile width follows the rows, so the row invariance it declares rests on this."""
    fam = P.family(family)
    point = chain_point(fam)
    check_either_width(fam, point, F.realize(point),
                       lambda *a: _run_gpu(gpu, *a[:4], attrs=a[4]),
                       {**sizes_for(fam, dims["rows"]), **dims})


def _scratch_points():
    return [(f, p) for f, p in _points()
            if any(a.endswith(":scratch") for a in F.realize(p).args)]


@pytest.mark.parametrize("act", ["bf16", "f32"])
@pytest.mark.parametrize("h,top_k", [(2880, 4), (100, 3)])
def test_moe_combine_add_rmsnorm_gives_the_two_launches_bytes_on_hard_values(gpu, h, top_k,
                                                                              act):
    check_combine_norm_hard_values(act, h, top_k, P, lambda *a: _run_gpu(gpu, *a))


@pytest.mark.parametrize("fam,point", _scratch_points(),
                         ids=lambda x: str(x) if isinstance(x, Point) else "")
def test_a_kernel_leaves_its_workspace_ready_for_the_next_launch(gpu, fam, point):
    """A kernel with scratch leaves it as the next launch needs it (decode attention's records are
    written before they are read): a second launch on the same workspace writes every output
    again, to the same bytes (at rows the kernel takes: the mxfp4 chain's from 256)."""
    sizes = sizes_for(fam, check_rows(fam, F.realize(point)))
    _, device = inputs(fam, point, sizes, seed=5)
    once = _run_gpu(gpu, fam, point, sizes, device)
    twice = _run_gpu(gpu, fam, point, sizes, device, launches=2)
    for port, a, b in zip(fam.outputs, once, twice):
        assert a.tobytes() == b.tobytes(), f"{point}: {port.name} differs on the second launch"


# (family, sizes): several row tiles with a ragged last one (200 = 3 x 64 + 8), column tiles
# with ragged ends (qkv's parts each end mid-tile), k with a short last k-block (1056) or rows
# that are not 16-byte aligned (1036: the tile loads take the element path)
GEMM_SHAPES = [
    ("linear", {"rows": 200, "k": 1056, "n": 200}),
    ("linear", {"rows": 70, "k": 1036, "n": 136}),
    ("lm_head", {"rows": 65, "k": 1024, "n": 300}),
    ("linear_add", {"rows": 200, "k": 1056, "n": 136}),
    ("qkv", {"rows": 130, "k": 1024, "nq": 264, "nk": 72, "nv": 72}),
    ("gate_up_swiglu", {"rows": 200, "k": 1056, "n": 100}),
]


# past 384 rows (the quantized tables' threshold) an fp8 or fp4 weight is made bf16 first
GEMM_TMA_SHAPES = [
    ("linear", {"rows": 400, "k": 1056, "n": 200}),
    ("gate_up_swiglu", {"rows": 390, "k": 1056, "n": 100}),
    ("qkv", {"rows": 520, "k": 1024, "nq": 264, "nk": 72, "nv": 72}),
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMM_SHAPES + GEMM_TMA_SHAPES, ids=case_id)
def test_gemm_at_prefill_shapes_matches_reference(gpu, family, dims, weight):
    """The tensor-core GEMM over many tiles with ragged edges in rows, columns and k."""
    check_gemm(family, dims, weight, P, F, lambda *a: _run_gpu(gpu, *a))


# 1-64 rows: blocks of one warpgroup on sm_90, one row tile (ragged), k split over the grid
# where the column tiles are few (KERNELS.toml)
GEMM_SMALL_SHAPES = [
    ("linear", {"rows": 64, "k": 1056, "n": 200}),
    ("linear", {"rows": 9, "k": 1036, "n": 136}),
    ("lm_head", {"rows": 33, "k": 1024, "n": 300}),
    ("linear_add", {"rows": 17, "k": 1056, "n": 136}),
    ("qkv", {"rows": 40, "k": 1024, "nq": 264, "nk": 72, "nv": 72}),
    ("gate_up_swiglu", {"rows": 64, "k": 1056, "n": 100}),
    ("linear", {"rows": 5, "k": 512, "n": 264 * 128 - 5}),  # enough column tiles: k not split
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMM_SMALL_SHAPES, ids=case_id)
def test_gemm_at_small_row_counts_matches_reference(gpu, family, dims, weight):
    check_gemm(family, dims, weight, P, F, lambda *a: _run_gpu(gpu, *a))


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", [(f, {k: v for k, v in d.items() if k != "rows"})
                                         for f, d in GEMM_SHAPES], ids=case_id)
@pytest.mark.parametrize("rows,part", GEMM_ROW_WINDOWS, ids=["150-10-74", "70-33", "130-66-130"])
def test_gemm_rows_have_the_same_bytes_in_either_block_size(gpu, family, dims, weight, rows,
                                                            part):
    """Rows launched alone (up to 64: blocks of one warpgroup) give the bytes they have in a
    longer launch (blocks of two): the same wgmmas on the same rows, on the hardware."""
    fam = P.family(family)
    skip_unless_k_fits(weight, dims["k"])
    check_row_invariance(fam, matmul_point(fam, "gemm", weight), lambda *a: _run_gpu(gpu, *a),
                         rows, part, dims)


@pytest.mark.parametrize("weight", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMM_TMA_SHAPES, ids=case_id)
def test_quantized_weights_made_bf16_first_give_the_tiles_conversion_bytes_on_device(
        gpu, family, dims, weight):
    """Past its threshold a quantized GEMM makes its weights bf16 in the workspace and runs the
    Tensor Memory Accelerator's blocks on them; gemm_wgmma.cu launched alone at the same rows
    converts each tile in shared memory instead: the same bytes on the hardware."""
    fam = P.family(family)
    skip_unless_k_fits(weight, dims["k"])
    point = matmul_point(fam, "gemm", weight)
    kernel = F.realize(point)
    sizes = {**sizes_for(fam, dims["rows"]), **dims, "sms": 132}
    assert [e for e, _, _ in kernel.launches_for(sizes)] == list(kernel.entries[:2])
    _, device = inputs(fam, point, sizes, seed=17)
    got = _run_gpu(gpu, fam, point, sizes, device)
    wgmma = kernel.then[1]
    want = _run_gpu(gpu, fam, point, sizes, device,
                    launch=(wgmma.entry, wgmma.launch.bind({**kernel.sizes(sizes), "tma": 0})))
    for port, w, g in zip(fam.outputs, want, got, strict=True):
        assert np.isfinite(g.astype(np.float32)).all(), port.name
        assert w.tobytes() == g.tobytes(), f"{point}: {port.name}"


@pytest.mark.parametrize("weight", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("part", [slice(300, 310), slice(100, 164)], ids=["10", "64"])
def test_quantized_gemm_rows_keep_their_bytes_across_the_threshold_on_device(gpu, weight, part):
    """Rows of a launch past the threshold (weights made bf16 first) have the bytes they have
    launched alone below it (gemm_wgmma.cu, k split over the grid), on the hardware."""
    fam = P.family("linear")
    check_row_invariance(fam, matmul_point(fam, "gemm", weight), lambda *a: _run_gpu(gpu, *a),
                         400, part, {"k": 1056, "n": 200})


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_gemm_is_exact_where_every_sum_is(gpu, weight):
    check_gemm_exact(weight, 150, 1280, 200, P, lambda *a: _run_gpu(gpu, *a))


def test_gemm_of_f32_weights_is_exact_where_every_sum_is(gpu):
    """All three bf16 parts of each weight reach the sum (k 48: one tile and a half)."""
    check_gemm_exact("f32", 150, 48, 200, P, lambda *a: _run_gpu(gpu, *a))


# The tensor-core GEMV (gemv_mma) at decode shapes: Llama-3.1-8B's k (4096, 14336 over 56
# k-blocks), one and eight rows, nine (two row groups), ragged column groups
GEMV_MMA_SHAPES = [
    ("linear", {"rows": 1, "k": 4096, "n": 1024}),
    ("linear", {"rows": 9, "k": 1056, "n": 200}),
    ("linear_add", {"rows": 8, "k": 14336, "n": 136}),
    ("qkv", {"rows": 3, "k": 4096, "nq": 264, "nk": 72, "nv": 72}),
    ("gate_up_swiglu", {"rows": 8, "k": 4096, "n": 520}),
    ("lm_head", {"rows": 1, "k": 1024, "n": 2000}),
    # gpt-oss-20b's k (2880: 11.25 k-blocks), its experts (32 there; fewer here) and biases, and
    # Qwen3-30B-A3B's experts (hidden 2048, moe_inter 768, eight a token)
    ("linear_bias", {"rows": 1, "k": 4096, "n": 2880}),
    ("qkv_bias", {"rows": 2, "k": 2880, "nq": 4096, "nk": 512, "nv": 512}),
    ("moe_gate_up_clamp", {"rows": 1, "top_k": 4, "e": 6, "k": 2880, "n2": 1440, "n": 720}),
    ("moe_down_bias", {"rows": 3, "top_k": 4, "e": 6, "n": 2880, "k": 728}),
    ("moe_gate_up_swiglu", {"rows": 2, "top_k": 8, "e": 10, "k": 2048, "n": 776}),
    ("moe_down", {"rows": 1, "top_k": 8, "e": 10, "n": 768, "k": 2056}),
]


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("family,dims", GEMV_MMA_SHAPES, ids=case_id)
def test_gemv_mma_at_decode_shapes_matches_reference(gpu, family, dims, weight):
    check_gemm(family, dims, weight, P, F, lambda *a: _run_gpu(gpu, *a), shape="gemv_mma")


@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("family,dims", [(f, d) for f, d in GEMV_MMA_SHAPES
                                         if f != "linear"] +
                         [("linear", {"k": 4096, "n": 1024})],
                         ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}{v}" for k, v in x.items() if k != "rows"))
def test_mma_gemv_relations_hold_their_declared_bound_on_device(gpu, family, dims, rows, weight):
    check_mma_gemv_bound(family, {**dims, "rows": rows}, weight, P, F,
                         lambda *a: _run_gpu(gpu, *a))


@pytest.mark.parametrize("family", ["linear", "gate_up_swiglu"])
def test_gemv_mma_mxfp4_scales_past_one_product_and_nan(gpu, family):
    check_gemv_mma_mxfp4_scales(family, P, F, lambda *a: _run_gpu(gpu, *a))


@pytest.mark.parametrize("weight", ["bf16", "mxfp4"])
def test_gemv_mma_is_exact_where_every_sum_is(gpu, weight):
    check_gemm_exact(weight, 8, 1280, 200, P, lambda *a: _run_gpu(gpu, *a), shape="gemv_mma")


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
@pytest.mark.parametrize("hq,hkv,d,window", PREFILL_SHAPES)
def test_prefill_attention_on_tensor_cores(gpu, family, hq, hkv, d, window):
    skip_where_the_prefill_kernel_refuses(P.family(family), F, hq, hkv, d)
    check_prefill_attention(P.family(family), hq, hkv, d, window,
                            lambda f, p, sz, dev, attrs=None: _run_gpu(gpu, f, p, sz, dev,
                                                                       attrs=attrs), F)


@pytest.mark.parametrize("family", PREFILL_FAMILIES)
def test_prefill_attention_over_rows_out_of_position_order(gpu, family):
    check_prefill_attention(P.family(family), 16, 8, 128, 100,
                            lambda f, p, sz, dev, attrs=None: _run_gpu(gpu, f, p, sz, dev,
                                                                       attrs=attrs), F,
                            scattered=True)


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (16, 8, 128), (32, 8, 128)])
def test_online_prefill_attention_holds_its_declared_bound_on_device(gpu, hq, hkv, d):
    check_online_attention_bound(hq, hkv, d, P, F,
                                 lambda f, p, sz, dev, attrs=None: _run_gpu(gpu, f, p, sz, dev,
                                                                            attrs=attrs))


def test_online_prefill_attention_on_scores_past_f32_s_range_on_device(gpu):
    check_online_attention_far_scores(
        P, F, lambda f, p, sz, dev, attrs=None: _run_gpu(gpu, f, p, sz, dev, attrs=attrs))


MULTI_ROW_CASES = (
    [(f, "bf16", {"k": 4096, "n": 4096}, r) for f in MULTI_ROW_FAMILIES for r in (2, 8, 16)]
    + [(f, "bf16", {"k": 14336, "n": 1024}, r) for f in ("linear", "linear_add") for r in (8, 16)]
    + [(f, w, {"k": 1024, "n": 3072}, r) for f in ("linear", "gate_up_swiglu")
       for w in ("fp8", "mxfp4", "nvfp4") for r in (8, 16)])
"""(family, weight, sizes, rows): bf16 at Llama-3.1-8B's o_proj shape (a warp two columns) in
every family, at down_proj's k with n = 1024 (the split entries), and the other formats at
Qwen3-0.6B's gate_up shape."""


@pytest.mark.parametrize("family,weight,dims,rows", MULTI_ROW_CASES,
                         ids=lambda x: str(x) if isinstance(x, int) else case_id(x))
def test_multi_row_entries_give_each_row_its_one_row_bytes_on_device(gpu, family, weight, dims,
                                                                     rows):
    """Past one row the GEMVs load each weight chunk once for all of a tile's rows (gemv.cu's
    `_rows8` and `_rows16` entries); at decode shapes each row's output has the bytes of that
    row launched alone (the one-row entries), on x rows holding NaN, infinities, subnormals,
    signed zeros and cancelling sums, outputs poisoned."""
    fam = P.family(family)
    point = matmul_point(fam, "gemv", weight)
    sizes = {**sizes_for(fam, rows), **dims}
    if family == "qkv":
        n = sizes.pop("n")
        sizes.update(nq=n // 2, nk=n // 4, nv=n // 4)
    multi_row_entry(F.realize(point), {**sizes, **dict(fam.attr_examples)})
    check_rows_alone(fam, point, lambda *a: _run_gpu(gpu, *a), rows, sizes)
