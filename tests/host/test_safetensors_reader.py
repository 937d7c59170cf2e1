"""Safetensors reader and writer: round trips (ml_dtypes included), agreement with the
``safetensors`` package both ways, memory mapping, and every malformed header refused with a
CheckpointError naming the file and the tensor/field."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.lkb.errors import CheckpointError
from metrale.runtime.safetensors import (
    MAX_HEADER_BYTES,
    SafetensorsFile,
    encode_safetensors,
    write_safetensors,
)

DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32,
    "I64": np.int64, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2, "F8_E8M0": ml_dtypes.float8_e8m0fnu,
    "F4": ml_dtypes.float4_e2m1fn,
}


def raw_file(path: Path, header: object, data: bytes = b"", *, prefix: int | None = None,
             header_bytes: bytes | None = None) -> Path:
    text = header_bytes if header_bytes is not None else json.dumps(header).encode()
    n = len(text) if prefix is None else prefix
    path.write_bytes(struct.pack("<Q", n) + text + data)
    return path


def sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if dtype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype in ("U8", "I8", "I16", "I32", "I64"):
        return rng.integers(-100 if dtype[0] == "I" else 0, 100, shape).astype(DTYPES[dtype])
    if dtype == "F8_E8M0":
        return np.ldexp(1.0, rng.integers(-20, 20, shape)).astype(np.float32).astype(DTYPES[dtype])
    return (rng.standard_normal(shape) * 2).astype(np.float32).astype(DTYPES[dtype])


def expect_error(path: Path, *fragments: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile.open(path)
    msg = str(e.value)
    assert str(path) in msg, msg
    for f in fragments:
        assert f in msg, msg
    return e.value


# ------------------------------------------------------------------ round trips


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_round_trip_every_dtype(tmp_path, dtype):
    shape = (3, 4)
    a = sample(dtype, shape)
    p = tmp_path / "x.safetensors"
    write_safetensors(p, {"t": a, "u": np.arange(3, dtype=np.int64)}, {"k": "v"})
    with SafetensorsFile.open(p) as f:
        info = f.info("t")
        assert info.dtype == dtype and info.shape == shape
        got = f.tensor("t")
        assert got.dtype == a.dtype and got.shape == shape
        assert got.tobytes() == a.tobytes()
        assert f.metadata == {"k": "v"}
        assert not got.flags.writeable


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=st.dictionaries(
    st.text("abcxyz._", min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
    st.tuples(st.sampled_from(list(DTYPES)),
              st.lists(st.integers(0, 5), max_size=3).map(tuple)),
    max_size=5))
def test_round_trip_random_files(tmp_path, spec):
    tensors = {}
    for i, (name, (dtype, shape)) in enumerate(spec.items()):
        if dtype == "F4" and np.prod(shape, dtype=int) % 2:
            shape = (*shape, 2)
        tensors[name] = sample(dtype, shape, i)
    p = tmp_path / "r.safetensors"
    write_safetensors(p, tensors)
    raw = p.read_bytes()
    assert (8 + struct.unpack("<Q", raw[:8])[0]) % 8 == 0
    with SafetensorsFile.open(p) as f:
        assert set(f.keys()) == set(tensors)
        for name, a in tensors.items():
            got = f.tensor(name)
            assert got.dtype == a.dtype and got.shape == a.shape
            assert got.tobytes() == a.tobytes()


def test_f4_is_stored_packed_low_nibble_first(tmp_path):
    a = np.array([6.0, 0.5, -0.5, 1.0], np.float32).astype(ml_dtypes.float4_e2m1fn)
    p = tmp_path / "f4.safetensors"
    write_safetensors(p, {"v": a})
    raw = p.read_bytes()
    assert raw[-2:] == bytes([0x17, 0x29])
    with SafetensorsFile.open(p) as f:
        assert f.info("v").nbytes == 2
        assert f.tensor("v").astype(np.float32).tolist() == [6.0, 0.5, -0.5, 1.0]


# ------------------------------------------------------------------ the safetensors package


def test_reads_what_the_safetensors_package_writes(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    ts = {
        "bf16": torch.randn(5, 7, generator=g).to(torch.bfloat16),
        "f32": torch.randn(3, generator=g),
        "e4m3": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "e5m2": torch.randn(4, 8, generator=g).to(torch.float8_e5m2),
        "i64": torch.arange(6).reshape(2, 3),
        "u8": torch.arange(10, dtype=torch.uint8),
    }
    if hasattr(torch, "float8_e8m0fnu"):
        ts["e8m0"] = torch.tensor([0.5, 1, 2, 4.0]).to(torch.float8_e8m0fnu)
    p = tmp_path / "torch.safetensors"
    save_file(ts, str(p), metadata={"format": "pt"})
    with SafetensorsFile.open(p) as f:
        assert f.metadata == {"format": "pt"}
        for name, t in ts.items():
            got = f.tensor(name)
            assert list(got.shape) == list(t.shape)
            assert got.tobytes() == t.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_the_safetensors_package_reads_what_we_write(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file as np_load
    from safetensors.torch import load_file as torch_load

    plain = {"f32": sample("F32", (3, 5)), "i32": sample("I32", (7,)), "u8": sample("U8", (2, 2))}
    p = tmp_path / "plain.safetensors"
    write_safetensors(p, plain)
    back = np_load(str(p))
    assert set(back) == set(plain)
    for k, a in plain.items():
        assert back[k].tobytes() == a.tobytes() and back[k].shape == a.shape

    exotic = {"bf16": sample("BF16", (3, 4)), "e4m3": sample("F8_E4M3", (2, 8))}
    q = tmp_path / "exotic.safetensors"
    write_safetensors(q, exotic)
    tb = torch_load(str(q))
    assert tb["bf16"].dtype == torch.bfloat16 and tb["e4m3"].dtype == torch.float8_e4m3fn
    for k, a in exotic.items():
        assert tb[k].view(torch.uint8).numpy().tobytes() == a.tobytes()


# ------------------------------------------------------------------ mapping, closing


def test_tensor_is_a_view_of_the_map_not_a_copy(tmp_path):
    p = tmp_path / "v.safetensors"
    write_safetensors(p, {"a": np.arange(1000, dtype=np.float32)})
    f = SafetensorsFile.open(p)
    t = f.tensor("a")
    assert not t.flags.owndata and not t.flags.writeable
    with pytest.raises(ValueError):
        t[0] = 1
    f.close()
    assert t[999] == 999  # live views keep the pages mapped after close
    with pytest.raises(CheckpointError, match="closed"):
        f.tensor("a")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc for VmRSS")
def test_one_tensor_of_a_huge_file_reads_only_its_pages(tmp_path):
    def rss() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    big = 3 << 30  # a 3 GiB tensor in a sparse file: no disk, no memory unless read
    header = {"small": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "big": {"dtype": "U8", "shape": [big], "data_offsets": [16, 16 + big]}}
    p = raw_file(tmp_path / "huge.safetensors", header)
    with open(p, "r+b") as fh:
        fh.seek(0, os.SEEK_END)
        fh.write(np.array([1, 2, 3, 4], np.float32).tobytes())
        fh.truncate(fh.tell() + big)
    before = rss()
    with SafetensorsFile.open(p) as f:
        assert f.tensor("small").tolist() == [1, 2, 3, 4]
        assert f.tensor("big").shape == (big,)
        assert rss() - before < 64 << 20


def test_unknown_tensor_suggests_the_nearest(tmp_path):
    p = tmp_path / "n.safetensors"
    write_safetensors(p, {"model.norm.weight": np.ones(2, np.float32)})
    with SafetensorsFile.open(p) as f, pytest.raises(CheckpointError) as e:
        f.info("model.norm.weigth")
    assert e.value.suggestion == "model.norm.weight" and str(p) in str(e.value)


def test_empty_file_of_tensors_and_zero_size_tensor(tmp_path):
    p = tmp_path / "e.safetensors"
    write_safetensors(p, {})
    with SafetensorsFile.open(p) as f:
        assert f.keys() == ()
    write_safetensors(p, {"z": np.zeros((0, 3), np.float32), "a": np.ones(1, np.float32)})
    with SafetensorsFile.open(p) as f:
        assert f.tensor("z").shape == (0, 3)


def test_write_is_atomic_when_encoding_fails(tmp_path):
    p = tmp_path / "keep.safetensors"
    write_safetensors(p, {"a": np.ones(2, np.float32)})
    good = p.read_bytes()
    with pytest.raises(CheckpointError) as e:
        write_safetensors(p, {"b": np.ones(2, np.complex64)})
    assert e.value.key == "b" and str(p) in str(e.value) and "complex64" in str(e.value)
    assert p.read_bytes() == good
    assert sorted(x.name for x in tmp_path.iterdir()) == ["keep.safetensors"]
    with pytest.raises(CheckpointError):
        encode_safetensors({"f4": np.ones(3, ml_dtypes.float4_e2m1fn)})
    with pytest.raises(CheckpointError):
        encode_safetensors({"a": np.ones(1)}, {"k": 1})


# ------------------------------------------------------------------ malformed files


def ok_header(**over):
    h = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]}}
    h.update(over)
    return h


DATA = bytes(12)


def test_file_shorter_than_8_bytes(tmp_path):
    p = tmp_path / "short.safetensors"
    p.write_bytes(b"\x01\x02")
    expect_error(p, "too short", "2 bytes")


def test_missing_file(tmp_path):
    expect_error(tmp_path / "nope.safetensors", "not found")


def test_header_prefix_past_the_file(tmp_path):
    expect_error(raw_file(tmp_path / "p.safetensors", ok_header(), DATA, prefix=10_000),
                 "header", "10000 bytes")


def test_header_prefix_over_100_mb(tmp_path):
    p = raw_file(tmp_path / "cap.safetensors", {}, prefix=MAX_HEADER_BYTES + 1)
    with open(p, "r+b") as fh:
        fh.truncate(MAX_HEADER_BYTES + 64)  # sparse: the prefix fits the file, not the cap
    e = expect_error(p, "header", str(MAX_HEADER_BYTES + 1))
    assert str(MAX_HEADER_BYTES) in str(e.expected)


@pytest.mark.parametrize("text,what", [(b"{not json", "not JSON"), (b"[1, 2]", "not a JSON object"),
                                       (b"\xff\xfe{}", "not UTF-8"), (b"[" * 100_000, "")])
def test_header_not_a_json_object(tmp_path, text, what):
    expect_error(raw_file(tmp_path / "j.safetensors", None, header_bytes=text), what)


def test_duplicate_tensor_key(tmp_path):
    text = (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
            b'"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}')
    expect_error(raw_file(tmp_path / "d.safetensors", None, bytes(2), header_bytes=text),
                 "duplicate", "a:")


def test_duplicate_field_inside_an_entry(tmp_path):
    text = b'{"w":{"dtype":"U8","dtype":"I8","shape":[1],"data_offsets":[0,1]}}'
    expect_error(raw_file(tmp_path / "d2.safetensors", None, bytes(1), header_bytes=text),
                 "duplicate", "dtype")


@pytest.mark.parametrize("meta", [[1], {"k": 1}, "x"])
def test_metadata_not_string_to_string(tmp_path, meta):
    expect_error(raw_file(tmp_path / "m.safetensors", ok_header(__metadata__=meta), DATA),
                 "__metadata__")


@pytest.mark.parametrize("entry,key,frag", [
    ([1, 2], "a", "not an object"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "dtpye": "F32"}, "a.dtpye",
     "did you mean 'dtype'"),
    ({"shape": [2], "data_offsets": [0, 8]}, "a.dtype", "missing"),
    ({"dtype": "F3", "shape": [2], "data_offsets": [0, 8]}, "a.dtype", "unknown dtype"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, "a.shape", "non-negative"),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, "a.shape", "integers"),
    ({"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]}, "a.shape", "integers"),
    ({"dtype": "F32", "shape": "2", "data_offsets": [0, 8]}, "a.shape", "list"),
    ({"dtype": "F32", "shape": [2**40, 2**40], "data_offsets": [0, 8]}, "a.shape", "too large"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [0]}, "a.data_offsets", "[begin, end]"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, "a.data_offsets", "out of order"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}, "a.data_offsets", "non-negative"),
    ({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}, "a.data_offsets", "12 bytes"),
    ({"dtype": "F4", "shape": [3], "data_offsets": [0, 8]}, "a.shape", "even element count"),
])
def test_bad_entry_fields(tmp_path, entry, key, frag):
    e = expect_error(raw_file(tmp_path / "f.safetensors", ok_header(a=entry), DATA), key, frag)
    assert e.key == key


@pytest.mark.parametrize("a_off,b_off,data,key,frag", [
    ([0, 8], [4, 8], 12, "b.data_offsets", "overlaps"),
    ([0, 8], [10, 14], 14, "b.data_offsets", "gap"),
    ([4, 12], [12, 16], 16, "a.data_offsets", "gap"),
    ([0, 8], [8, 12], 10, "b.data_offsets", "past the end"),
    ([0, 8], [8, 12], 20, "header", "bytes after the last tensor"),
])
def test_offsets_must_tile_the_data(tmp_path, a_off, b_off, data, key, frag):
    h = ok_header(a={"dtype": "F32", "shape": [2], "data_offsets": a_off},
                  b={"dtype": "U8", "shape": [4], "data_offsets": b_off})
    e = expect_error(raw_file(tmp_path / "o.safetensors", h, bytes(data)), key, frag)
    assert e.key == key


def test_header_order_need_not_follow_offsets(tmp_path):
    h = {"b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
         "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    p = raw_file(tmp_path / "ord.safetensors", h, np.array([1, 2], np.float32).tobytes() + b"wxyz")
    with SafetensorsFile.open(p) as f:
        assert f.keys() == ("a", "b")
        assert f.tensor("b").tobytes() == b"wxyz"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_corrupted_files_fail_only_with_checkpoint_error(tmp_path, data):
    good = encode_safetensors({"w": sample("BF16", (4, 6)), "s": sample("F8_E8M0", (4,)),
                               "q": sample("F4", (2, 8))}, {"m": "x"})
    raw = bytearray(good)
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(raw[:cut]))
    try:
        f = SafetensorsFile.open(p)
    except CheckpointError as e:
        assert str(p) in str(e)
        return
    with f:
        total = 0
        for name in f.keys():
            info = f.info(name)
            t = f.tensor(name)
            assert t.shape == info.shape
            total += info.nbytes
        assert total == p.stat().st_size - 8 - struct.unpack("<Q", bytes(raw[:8]))[0]
