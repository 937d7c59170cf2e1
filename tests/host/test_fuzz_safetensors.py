"""Fuzzing the checkpoint readers: mutated safetensors files and folders give typed errors only.

Three levels of damage, each drawn by Hypothesis from a valid file: raw bytes (flips,
truncations, insertions, deletions, repeats, weighted towards the header), the parsed header
(fields renamed, values swapped for ones of other types or near the boundaries, entries added
or duplicated; the length prefix rewritten or not), and whole checkpoint folders (a shard, the
index or ``config.json`` damaged; or a tensor of a quantized layout replaced by a well-formed
one of another dtype or shape). Whatever is read must either load, and then every tensor and
weight reads back with the shape its header states, or raise a ``MetraleError`` naming the
file; an ``IndexError``, ``KeyError``, ``TypeError``, ``ValueError``, ``MemoryError`` or a hang
(an example past its time budget) fails the test.
"""

from __future__ import annotations

import functools
import json
import os
import struct
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.lkb.errors import MetraleError
from metrale.lkb.quant import FORMATS, QuantTensor
from metrale.runtime.checkpoint import INDEX, Checkpoint, write_checkpoint
from metrale.runtime.safetensors import DTYPES, SafetensorsFile, encode_safetensors
from tests.host.test_fuzz_toml import BUDGET_S, mutate_bytes, mutate_structure, time_budget

DEEP = int(os.environ.get("METRALE_FUZZ_EXAMPLES", "0"))
"""Set ``METRALE_FUZZ_EXAMPLES=5000`` for a long, randomized run; CI runs a fixed, short one."""
FUZZ = settings(max_examples=DEEP or 80, deadline=timedelta(seconds=BUDGET_S),
                derandomize=not DEEP,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _sample(dtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    np_dtype = DTYPES[dtype]
    if dtype == "BOOL":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "F8_E8M0":
        return rng.integers(100, 140, shape).astype(np.uint8).view(np_dtype)
    if np_dtype.kind in "iu":
        return rng.integers(0, 100, shape).astype(np_dtype)
    if dtype == "F4":
        return rng.uniform(-6, 6, shape).astype(ml_dtypes.float4_e2m1fn)
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype)


GOOD_FILE = encode_safetensors(
    {"w": _sample("BF16", (4, 6)), "s": _sample("F8_E8M0", (4,)), "q": _sample("F4", (2, 8)),
     "e": _sample("F8_E4M3", (3, 5)), "ids": _sample("I64", (3,)), "g": _sample("F32", ()),
     "empty": _sample("U8", (0, 4))}, {"format": "pt"})
GOOD_PREFIX = struct.unpack("<Q", GOOD_FILE[:8])[0]


def read_everything(f: SafetensorsFile, path: Path) -> None:
    """Every tensor of an opened file reads back with the shape and bytes its header states."""
    total = 0
    for name in f.keys():
        info = f.info(name)
        t = f.tensor(name)
        assert t.shape == info.shape and t.dtype == info.numpy, name
        total += info.nbytes
    n = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert total == path.stat().st_size - 8 - n  # the tensors tile the data section


def open_or_typed_error(path: Path) -> None:
    with time_budget():
        try:
            f = SafetensorsFile.open(path)
        except MetraleError as e:
            assert e.file == str(path), str(e)
            return
        with f:
            read_everything(f, path)


# -- raw bytes ---------------------------------------------------------------------------------


@FUZZ
@given(data=st.data(), region=st.sampled_from(["prefix", "header", "anywhere"]))
def test_mutated_bytes_give_typed_errors_only(data, region):
    raw = bytearray(GOOD_FILE)
    if region == "prefix":  # the 8-byte length: any value, including past the file and huge
        raw[:8] = struct.pack("<Q", data.draw(st.one_of(
            st.integers(0, 2**64 - 1), st.integers(GOOD_PREFIX - 16, GOOD_PREFIX + 16).filter(
                lambda n: n >= 0))))
    elif region == "header":  # edits confined to the JSON text, prefix left as it was
        header = bytes(raw[8:8 + GOOD_PREFIX])
        raw[8:8 + GOOD_PREFIX] = mutate_bytes(data, header)
    else:
        raw = bytearray(mutate_bytes(data, bytes(raw)))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fuzz.safetensors"
        path.write_bytes(bytes(raw))
        open_or_typed_error(path)


# -- the parsed header -------------------------------------------------------------------------

BOUNDARY = st.one_of(
    st.integers(-2, 40), st.sampled_from([2**31, 2**32 - 1, 2**53 + 1, 2**63 - 1, 2**63, 2**64,
                                          -(2**63), 10**30]),
    st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=8),
    st.sampled_from(list(DTYPES) + ["F3", "bf16", "F8_E4M3FN", "", "__metadata__"]),
    st.lists(st.integers(-2, 2**40), max_size=4), st.dictionaries(st.text(max_size=4),
                                                                  st.integers(), max_size=2),
)


def _header_of(raw: bytes) -> dict[str, Any]:
    return json.loads(raw[8:8 + GOOD_PREFIX])


def _mutate_header(data: st.DataObject, header: dict[str, Any]) -> dict[str, Any]:
    if data.draw(st.booleans(), label="targeted"):
        names = [k for k in header if k != "__metadata__"]
        name = data.draw(st.sampled_from(names), label="tensor")
        field = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", "shape[i]",
                                           "data_offsets[i]", "entry", "metadata"]))
        entry = header[name]
        if field in ("dtype", "shape", "data_offsets"):
            entry[field] = data.draw(BOUNDARY, label=field)
        elif field == "shape[i]" and entry["shape"]:
            i = data.draw(st.integers(0, len(entry["shape"]) - 1))
            entry["shape"][i] = data.draw(BOUNDARY, label="dim")
        elif field == "data_offsets[i]":
            i = data.draw(st.integers(0, 1))
            entry["data_offsets"][i] += data.draw(st.integers(-9, 9), label="shift")
        elif field == "entry":
            header[name] = data.draw(BOUNDARY, label="entry")
        else:
            header["__metadata__"] = data.draw(BOUNDARY, label="metadata")
        return header
    return mutate_structure(data, header)


@FUZZ
@given(data=st.data(), fix_prefix=st.booleans(), pad=st.integers(0, 9))
def test_mutated_headers_give_typed_errors_only(data, fix_prefix, pad):
    header = _mutate_header(data, _header_of(GOOD_FILE))
    text = json.dumps(header, default=str).encode() + b" " * pad
    n = len(text) if fix_prefix else GOOD_PREFIX
    raw = struct.pack("<Q", n) + text + GOOD_FILE[8 + GOOD_PREFIX:]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "header.safetensors"
        path.write_bytes(raw)
        open_or_typed_error(path)


# -- checkpoint folders: shards, index, config, quantized layouts ----------------------------

W = np.random.default_rng(1).standard_normal((8, 64)).astype(np.float32)
WEIGHTS: dict[str, Any] = {
    "m.fp8c.weight": FORMATS["fp8_e4m3_channel"].quantize(W),
    "m.fp8t.weight": FORMATS["fp8_e5m2_tensor"].quantize(W),
    "m.fp8b.weight": FORMATS["fp8_e4m3_block"].quantize(W),
    "m.mx.weight": FORMATS["mxfp4"].quantize(W),
    "m.nv.weight": FORMATS["nvfp4"].quantize(W),
    "m.norm.weight": np.ones(8, ml_dtypes.bfloat16),
    "m.embed.weight": W.astype(ml_dtypes.bfloat16),
}
CONFIG = {"model_type": "toy", "hidden_size": 64}


@functools.cache
def folder_files() -> dict[str, bytes]:
    """The files of a sharded checkpoint of ``WEIGHTS`` (written once, then copied: the
    atomic writer's fsyncs would dominate the run)."""
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "ckpt"
        write_checkpoint(dst, WEIGHTS, CONFIG, FORMATS["mxfp4"], max_shard_bytes=700)
        return {p.name: p.read_bytes() for p in sorted(dst.iterdir())}


def _folder(root: Path, files: dict[str, bytes]) -> Path:
    dst = root / "ckpt"
    dst.mkdir(parents=True)
    for name, raw in files.items():
        (dst / name).write_bytes(raw)
    return dst


def read_checkpoint_or_typed_error(dst: Path) -> None:
    """Open the folder and read every weight; only typed errors, and only ones with a file."""
    with time_budget():
        try:
            ck = Checkpoint.open(dst)
        except MetraleError as e:
            assert e.file is not None and str(dst) in e.file, str(e)
            return
        with ck:
            for name in ck.names():
                assert ck.raw(name).shape == ck.info(name).shape
            for name in ck.weight_names():
                try:
                    w = ck.weight(name)
                except MetraleError as e:
                    assert e.file is not None and str(dst) in e.file, str(e)
                    continue
                if isinstance(w, QuantTensor):
                    with np.errstate(all="ignore"):
                        assert w.dequantize().shape == tuple(w.shape)


def test_the_fuzzed_folder_is_sharded_and_reads_back():
    with tempfile.TemporaryDirectory() as tmp:
        dst = _folder(Path(tmp), folder_files())
        assert (dst / INDEX).is_file() and len(list(dst.glob("*.safetensors"))) >= 3
        with Checkpoint.open(dst) as ck:
            for name, value in WEIGHTS.items():
                got = ck.weight(name)
                assert (got == value) if isinstance(value, QuantTensor) else \
                    np.array_equal(got, value)


@FUZZ
@given(data=st.data())
def test_mutated_checkpoint_files_give_typed_errors_only(data):
    with tempfile.TemporaryDirectory() as tmp:
        dst = _folder(Path(tmp), folder_files())
        files = sorted(p.name for p in dst.iterdir())
        target = dst / data.draw(st.sampled_from(files), label="file")
        raw = target.read_bytes()
        if target.suffix == ".json" and data.draw(st.booleans(), label="structural"):
            doc = mutate_structure(data, json.loads(raw))
            target.write_text(json.dumps(doc, default=str))
        else:
            target.write_bytes(mutate_bytes(data, raw))
        read_checkpoint_or_typed_error(dst)


@functools.cache
def _stored_once() -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp, \
            Checkpoint.open(_folder(Path(tmp), folder_files())) as ck:
        return {n: np.array(ck.raw(n)) for n in ck.names()}


@FUZZ
@given(data=st.data())
def test_inconsistent_layouts_give_typed_errors_only(data):
    # every file is well-formed; what is wrong is a layout (a scale's dtype, a block's shape …)
    with tempfile.TemporaryDirectory() as tmp:
        stored = dict(_stored_once())
        for _ in range(data.draw(st.integers(1, 2), label="edits")):
            name = data.draw(st.sampled_from(sorted(stored)), label="tensor")
            op = data.draw(st.sampled_from(["dtype", "shape", "both", "delete", "rename",
                                            "nan"]))
            old = stored[name]
            if op == "delete":
                del stored[name]
                continue
            if op == "rename":
                stored[name.replace("weight", data.draw(st.sampled_from(
                    ["weight_scale", "weight_blocks", "blocks", "weight_scale_2", "w"])))] = \
                    stored.pop(name)
                continue
            if op == "nan":
                bad = old.copy()
                if bad.size:
                    try:  # a NaN where the dtype has one, else an all-ones byte (e8m0's NaN)
                        bad.reshape(-1)[0] = np.nan
                    except (ValueError, OverflowError, TypeError):
                        bad.reshape(-1).view(np.uint8)[0] = 0xFF
                stored[name] = bad
                continue
            dtype = data.draw(st.sampled_from(sorted(DTYPES)), label="dtype") \
                if op != "shape" else _spelling(old)
            shape = old.shape if op == "dtype" else tuple(data.draw(
                st.lists(st.integers(0, 9), max_size=4), label="shape"))
            if dtype == "F4" and int(np.prod(shape)) % 2:
                shape = (*shape, 2)
            stored[name] = _sample(dtype, shape, seed=len(stored))
        files = {"model.safetensors": encode_safetensors(stored),
                 "config.json": json.dumps(CONFIG).encode()}
        read_checkpoint_or_typed_error(_folder(Path(tmp), files))


def _spelling(a: np.ndarray) -> str:
    return next(k for k, v in DTYPES.items() if v == a.dtype)
