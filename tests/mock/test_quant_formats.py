"""Quantization formats: parsing, sizes, nibble packing, exact structured round trips, SQNR on
random data, the exact meaning of a quantized linear layer, and refusal of bad tensors."""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.errors import CheckpointError, ConfigError
from metrale.lkb.quant import (
    FORMATS,
    BF16Format,
    FP8Format,
    MXFP4Format,
    NVFP4Format,
    QuantFormat,
    QuantTensor,
    pack_e2m1,
    quant_linear,
    unpack_e2m1,
)

E2M1 = np.dtype(ml_dtypes.float4_e2m1fn)
GRID = np.arange(16, dtype=np.uint8).view(E2M1).astype(np.float32)  # every e2m1 value
QUANTIZED = [f for f in FORMATS.values() if not isinstance(f, BF16Format)]


def sqnr(w: np.ndarray, d: np.ndarray) -> float:
    w64, d64 = w.astype(np.float64), d.astype(np.float64)
    return 10 * math.log10((w64**2).sum() / ((w64 - d64) ** 2).sum())


def k_for(fmt: QuantFormat) -> int:
    return 256 if isinstance(fmt, FP8Format) and fmt.granularity == "block" else 64


# ------------------------------------------------------------------ names, sizes


def test_parse_canonical_names_and_aliases():
    for name, fmt in FORMATS.items():
        assert QuantFormat.parse(name) is fmt
        assert QuantFormat.parse(name.upper().replace("_", "-")) is fmt
        assert fmt.name == name
    assert QuantFormat.parse("fp8") == FP8Format("channel", "e4m3")
    assert QuantFormat.parse("fp8_block") == FP8Format("block", "e4m3")
    assert QuantFormat.parse("fp8-e5m2") == FP8Format("channel", "e5m2")
    assert QuantFormat.parse("bfloat16") == BF16Format()


def test_parse_unknown_lists_valid_names_and_suggests():
    with pytest.raises(ConfigError) as e:
        QuantFormat.parse("nvfp5", file="cfg.toml", key="target.quant")
    msg = str(e.value)
    assert "cfg.toml" in msg and "target.quant" in msg and "'nvfp5'" in msg
    assert all(name in msg for name in FORMATS)
    assert e.value.suggestion == "nvfp4"


def test_kinds_match_tensor_type_spellings():
    assert {f.kind for f in FORMATS.values()} == {"bf16", "fp8", "mxfp4", "nvfp4"}


def test_bits_per_weight_and_block_sizes():
    assert FORMATS["mxfp4"].bits_per_weight == 4.25 and FORMATS["mxfp4"].block_size == 32
    assert FORMATS["nvfp4"].bits_per_weight == 4.5 and FORMATS["nvfp4"].block_size == 16
    assert FORMATS["bf16"].bits_per_weight == 16 and FORMATS["bf16"].block_size is None
    assert FORMATS["fp8_e4m3_channel"].bits_per_weight == 8
    assert FORMATS["fp8_e4m3_channel"].block_size is None
    assert FORMATS["fp8_e4m3_block"].block_size == 128


def test_weight_bytes_exact_values():
    n, k = 4096, 1024
    assert FORMATS["bf16"].weight_bytes(n, k) == 2 * n * k
    assert FORMATS["mxfp4"].weight_bytes(n, k) == n * k // 2 + n * k // 32
    assert FORMATS["nvfp4"].weight_bytes(n, k) == n * k // 2 + n * k // 16 + 4
    assert FORMATS["fp8_e4m3_tensor"].weight_bytes(n, k) == n * k + 4
    assert FORMATS["fp8_e4m3_channel"].weight_bytes(n, k) == n * k + 4 * n
    assert FORMATS["fp8_e4m3_block"].weight_bytes(300, 200) == 300 * 200 + 4 * 3 * 2


@given(fmt=st.sampled_from(list(FORMATS.values())), n=st.integers(1, 9),
       blocks=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_weight_bytes_equals_stored_bytes(fmt, n, blocks, seed):
    k = blocks * (fmt.block_size or 8)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    qt = fmt.quantize(w)
    assert qt.nbytes == fmt.weight_bytes(n, k)
    assert qt.shape == (n, k)
    if fmt.block_size in (16, 32):
        assert qt.nbytes * 8 == pytest.approx(fmt.bits_per_weight * n * k, abs=32)


# ------------------------------------------------------------------ nibble packing


def test_the_e2m1_maximum_is_ml_dtypes_own():
    from metrale.lkb import quant

    assert quant._E2M1_MAX == float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)


def test_planning_imports_no_ml_dtypes():
    """ml_dtypes takes about half a second to import: `met plan` and `met build`, which touch no
    array of its types, do not import it (lkb.dtype imports it on first use)."""
    import subprocess
    import sys

    code = ("import sys; from metrale.plan.points import plan_points; "
            "plan_points('tiny-qwen3', 'bf16', 'sm_90'); print('ml_dtypes' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_nibble_trap_0x17_is_6_then_half():
    values = unpack_e2m1(np.array([0x17], np.uint8), 2).astype(np.float32)
    assert values.tolist() == [6.0, 0.5]
    # the trap: reading the byte as one e2m1 gives its low nibble with the high bit as sign
    assert np.array([0x17], np.uint8).view(E2M1).astype(np.float32).tolist() == [-6.0]
    assert pack_e2m1(np.array([6.0, 0.5], np.float32)).tolist() == [0x17]


def test_unpack_every_byte_against_the_e2m1_grid():
    b = np.arange(256, dtype=np.uint8)
    values = unpack_e2m1(b).astype(np.float32).reshape(256, 2)
    assert np.array_equal(values[:, 0], GRID[b & 0x0F])
    assert np.array_equal(values[:, 1], GRID[b >> 4])


@given(st.lists(st.integers(0, 15), min_size=1, max_size=64).map(lambda c: c + c[:1] * (len(c) % 2)))
def test_pack_unpack_round_trip_codes(codes):
    values = np.array(codes, np.uint8).view(E2M1)
    packed = pack_e2m1(values)
    assert packed.shape == (len(codes) // 2,)
    back = unpack_e2m1(packed, len(codes))
    assert np.array_equal(back.view(np.uint8), np.array(codes, np.uint8))


def test_unpack_odd_count_and_bytes_input():
    assert unpack_e2m1(b"\x17\x09", 3).astype(np.float32).tolist() == [6.0, 0.5, -0.5]
    with pytest.raises(ConfigError):
        unpack_e2m1(b"\x17", 5)
    with pytest.raises(ConfigError):
        pack_e2m1(np.zeros(3, np.float32))


def test_pack_rounds_through_ml_dtypes_nearest_even():
    # 5 is halfway between 4 and 6: ties go to the even mantissa (4); 0.25 ties to 0
    v = unpack_e2m1(pack_e2m1(np.array([5.0, 0.25, 2.5, 7.0], np.float32)))
    assert v.astype(np.float32).tolist() == [4.0, 0.0, 2.0, 6.0]


# ------------------------------------------------------------------ exact structured inputs


def _identity_blocks(fmt: QuantFormat) -> np.ndarray:
    k = k_for(fmt)
    return np.tile(np.eye(k // 2, dtype=np.float32), (3, 2))  # [3k/2, k]


def _oracle_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Exact product for small integers and dyadic weights (f64 has room to spare)."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.array_equal(y.astype(np.float32).astype(np.float64), y)
    return y.astype(np.float32)


def _x_for(k: int, rows: int = 3) -> np.ndarray:
    rng = np.random.default_rng(k)
    x = rng.integers(1, 9, (rows, k)).astype(np.float32) * rng.choice([-1, 1], (rows, k))
    return x.astype(np.float32)  # never zero


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=str)
@pytest.mark.parametrize("case", ["identity", "ones", "doubled"])
def test_structured_inputs_round_trip_and_multiply_exactly(fmt, case):
    k = k_for(fmt)
    if case == "identity":
        w = _identity_blocks(fmt)
    else:
        w = np.ones((2 * (fmt.block_size or 4), k), np.float32)
        if case == "doubled":
            bn = 128 if (isinstance(fmt, FP8Format) and fmt.granularity == "block") else 1
            bk = fmt.block_size or k
            w[:bn, :bk] = 2.0  # exactly one scale group doubled
            if isinstance(fmt, FP8Format) and fmt.granularity == "tensor":
                w = 2 * w
    qt = fmt.quantize(w)
    deq = qt.dequantize()
    assert deq.dtype == np.float32 and deq.shape == w.shape
    assert np.array_equal(deq, w), f"{fmt} does not round-trip {case}"
    x = _x_for(k)
    for k_block in (16, 32, k):
        assert np.array_equal(quant_linear(x, qt, k_block), _oracle_matmul(x, w))


@pytest.mark.parametrize("fmt", QUANTIZED, ids=str)
def test_doubled_block_has_exactly_double_scale(fmt):
    k = k_for(fmt)
    bn = 128 if fmt.block_size == 128 else 1
    w = np.ones((256 if bn == 128 else 4, k), np.float32)
    w[:bn, : fmt.block_size or k] = 2.0
    base = fmt.quantize(np.ones_like(w))
    qt = fmt.quantize(w)
    s = qt.scale.astype(np.float32)
    if isinstance(fmt, FP8Format) and fmt.granularity == "tensor":
        assert s == 2 * base.scale  # the whole tensor is the group
        return
    if isinstance(fmt, NVFP4Format):
        # the global scale follows the tensor amax, so block scales are relative to it
        assert s.flat[0] == 2 * s.flat[-1] and float(qt.global_scale) == 2 * float(base.global_scale)
    else:
        assert s.flat[0] == 2 * base.scale.astype(np.float32).flat[0]
        assert np.array_equal(s.flat[1:], base.scale.astype(np.float32).flat[1:])


@given(seed=st.integers(0, 2**32 - 1), fmt=st.sampled_from([MXFP4Format(), NVFP4Format()]))
def test_grid_values_with_power_of_two_block_scales_are_exact(seed, fmt):
    rng = np.random.default_rng(seed)
    n, k = 4, 4 * fmt.block_size
    v = GRID[rng.integers(0, 16, (n, k))]
    v[:, :: fmt.block_size] = 6.0  # each block reaches the top of the grid
    exps = rng.integers(-8, 8, (n, k // fmt.block_size))
    if isinstance(fmt, NVFP4Format):
        exps[0, 0] = 0  # with 448 below: tensor amax 6 * 448, global scale exactly 1
        scale = np.ldexp(np.float32(1.0), exps).astype(np.float32)
        scale[0, 0] = 448.0
    else:
        scale = np.ldexp(np.float32(1.0), exps).astype(np.float32)
    w = (v.reshape(n, -1, fmt.block_size) * scale[..., None]).reshape(n, k)
    qt = fmt.quantize(w)
    assert np.array_equal(qt.dequantize(), w)
    assert np.array_equal(unpack_e2m1(qt.data).astype(np.float32), v)


def test_e4m3_saturates_at_448_not_nan():
    fmt = FP8Format("channel")
    w = np.array([[448.0, -448.0, 1.0, 0.5]], np.float32)
    qt = fmt.quantize(w)
    assert float(qt.scale[0, 0]) == 1.0
    assert np.array_equal(qt.dequantize(), w)


def test_zero_tensor_quantizes_to_zero_with_finite_scales():
    for fmt in QUANTIZED:
        w = np.zeros((2, k_for(fmt)), np.float32)
        qt = fmt.quantize(w)
        assert np.array_equal(qt.dequantize(), w), fmt
        for a in (qt.scale, qt.global_scale):
            if a is not None:
                assert np.isfinite(a.astype(np.float32)).all(), fmt
    assert float(NVFP4Format().quantize(np.zeros((1, 16), np.float32)).global_scale) == 1.0


def test_mxfp4_scale_follows_the_ocp_rule():
    w = np.zeros((1, 64), np.float32)
    w[0, 0], w[0, 32] = 5.9, 0.3  # floor(log2 5.9) = 2 -> 2^0; floor(log2 0.3) = -2 -> 2^-4
    s = MXFP4Format().quantize(w).scale.astype(np.float32)
    assert s.tolist() == [[1.0, 2.0**-4]]


def test_nvfp4_scales_follow_amax():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    qt = NVFP4Format().quantize(w)
    amax = np.abs(w).max()
    assert float(qt.global_scale) == np.float32(amax) / np.float32(6 * 448)
    want = (np.abs(w).reshape(8, 4, 16).max(-1) / np.float32(6) / qt.global_scale)
    assert np.array_equal(qt.scale, want.astype(np.float32).astype(ml_dtypes.float8_e4m3fn))


# ------------------------------------------------------------------ random data: SQNR


@pytest.mark.parametrize("dist", ["normal", "uniform", "laplace"])
@pytest.mark.parametrize("fmt,floor", [("mxfp4", 15.0), ("nvfp4", 15.8),
                                       ("fp8_e4m3_channel", 25.0), ("fp8_e4m3_tensor", 25.0),
                                       ("fp8_e4m3_block", 25.0)])
def test_random_sqnr_above_floor(fmt, floor, dist):
    rng = np.random.default_rng(zlib.crc32(f"{fmt}/{dist}".encode()))
    draw = {"normal": rng.standard_normal, "uniform": lambda s: rng.uniform(-1, 1, s),
            "laplace": lambda s: rng.laplace(0, 1, s)}[dist]
    # row magnitudes spread over 2^-6..2^6 as real weight matrices' rows are
    w = (draw((256, 512)) * np.exp2(rng.uniform(-6, 6, (256, 1)))).astype(np.float32)
    deq = FORMATS[fmt].quantize(w).dequantize()
    assert not np.isnan(deq).any()
    assert sqnr(w, deq) > floor


# ------------------------------------------------------------------ quant_linear semantics


def _linear_by_the_docstring(x, w, k_block):
    """The documented order, one f32 operation at a time."""
    rows, k = x.shape
    out = np.zeros((rows, w.shape[0]), np.float32)
    for r in range(rows):
        for j in range(w.shape[0]):
            total = np.float32(0)
            for s in range(0, k, k_block):
                part = np.float32(0)
                for i in range(s, min(s + k_block, k)):
                    part = np.float32(part + np.float32(x[r, i] * w[j, i]))
                total = np.float32(total + part)
            out[r, j] = total
    return out


@given(seed=st.integers(0, 2**32 - 1), k_block=st.sampled_from([1, 3, 16, 32, 64]),
       fmt=st.sampled_from([FORMATS["mxfp4"], FORMATS["nvfp4"], FORMATS["fp8_e4m3_channel"],
                            FORMATS["bf16"]]))
def test_quant_linear_follows_its_documented_order(seed, k_block, fmt):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    qt = fmt.quantize(rng.standard_normal((3, 64)).astype(np.float32))
    got = quant_linear(x, qt, k_block)
    assert got.tobytes() == _linear_by_the_docstring(x, qt.dequantize(), k_block).tobytes()


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(1, 6),
       k_block=st.sampled_from([8, 32, 48, 128]),
       fmt=st.sampled_from([FORMATS["mxfp4"], FORMATS["nvfp4"], FORMATS["fp8_e4m3_block"]]))
def test_quant_linear_row_invariance(seed, rows, k_block, fmt):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    qt = fmt.quantize(rng.standard_normal((40, 256)).astype(np.float32))
    batch = quant_linear(x, qt, k_block)
    for r in range(rows):
        alone = quant_linear(x[r : r + 1], qt, k_block)
        assert alone.tobytes() == batch[r : r + 1].tobytes()


def test_quant_linear_close_to_f64_reference():
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 512)).astype(np.float32)
    qt = FORMATS["nvfp4"].quantize(rng.standard_normal((16, 512)).astype(np.float32))
    ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T
    got = quant_linear(x, qt, 32)
    assert np.allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_quant_linear_rejects_bad_inputs():
    qt = FORMATS["mxfp4"].quantize(np.ones((2, 32), np.float32))
    with pytest.raises(ConfigError):
        quant_linear(np.ones((1, 32), np.float64), qt, 32)
    with pytest.raises(ConfigError):
        quant_linear(np.ones((1, 64), np.float32), qt, 32)
    with pytest.raises(ConfigError):
        quant_linear(np.ones((1, 32), np.float32), qt, 0)


# ------------------------------------------------------------------ bad tensors


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=str)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_or_inf_is_refused_by_name(fmt, bad):
    w = np.ones((4, k_for(fmt)), np.float32)
    w[2, 5] = bad
    with pytest.raises(CheckpointError) as e:
        fmt.quantize(w, name="model.layers.3.mlp.up_proj.weight")
    msg = str(e.value)
    assert "model.layers.3.mlp.up_proj.weight" in msg and "[2, 5]" in msg


@pytest.mark.parametrize("fmt", [MXFP4Format(), NVFP4Format()], ids=str)
def test_k_not_divisible_by_block_is_refused(fmt):
    with pytest.raises(CheckpointError) as e:
        fmt.quantize(np.ones((2, fmt.block_size + 8), np.float32), name="lm_head.weight")
    msg = str(e.value)
    assert "lm_head.weight" in msg and f"K = {fmt.block_size + 8}" in msg


def test_vectors_are_refused():
    with pytest.raises(CheckpointError):
        FORMATS["fp8_e4m3_channel"].quantize(np.ones(8, np.float32), name="v")


def test_fp8_block_allows_partial_edge_tiles():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((130, 200)).astype(np.float32)
    qt = FORMATS["fp8_e4m3_block"].quantize(w)
    assert qt.scale.shape == (2, 2)
    assert sqnr(w, qt.dequantize()) > 25


def test_leading_dims_are_independent_matrices():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((3, 8, 64)).astype(np.float32)
    for fmt in (MXFP4Format(), FP8Format("channel"), FP8Format("block")):
        qt = fmt.quantize(w)
        for e in range(3):
            one = fmt.quantize(w[e])
            assert np.array_equal(qt.dequantize()[e], one.dequantize()), fmt


# ------------------------------------------------------------------ QuantTensor value


def test_quant_tensor_checks_its_arrays():
    fmt = MXFP4Format()
    good = fmt.quantize(np.ones((2, 32), np.float32))
    with pytest.raises(ConfigError) as e:
        QuantTensor(fmt, (2, 32), good.data[:, :8], good.scale)
    assert "data" in str(e.value)
    with pytest.raises(ConfigError):
        QuantTensor(fmt, (2, 32), good.data, good.scale.view(np.uint8))
    with pytest.raises(ConfigError):
        QuantTensor(fmt, (2, 32), good.data, good.scale, np.float32(1))


def test_quant_tensor_equality_is_byte_equality():
    fmt = NVFP4Format()
    w = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    a, b = fmt.quantize(w), fmt.quantize(w.copy())
    assert a == b and hash(a) == hash(b)
    w2 = w.copy()
    w2[0, 0] *= 3
    assert a != fmt.quantize(w2)
    assert a != FORMATS["mxfp4"].quantize(w)
