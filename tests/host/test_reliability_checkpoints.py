"""Damaged checkpoints fail clearly (issue 10, case 8, and what the fuzz tests found).

A file cut short, in its header or in the middle of a tensor, is refused when it is opened,
naming the shard and the tensor whose bytes are missing, with the length expected and found;
``met`` prints that as one line and exits with ``CheckpointError``'s status.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from metrale.cli import main
from metrale.lkb.errors import CheckpointError
from metrale.lkb.quant import FORMATS
from metrale.runtime.checkpoint import INDEX, SINGLE, Checkpoint, write_checkpoint
from metrale.runtime.safetensors import SafetensorsFile

RNG = np.random.default_rng(0)
TENSORS = {f"model.layers.{i}.mlp.down_proj.weight":
           RNG.standard_normal((16, 64)).astype(ml_dtypes.bfloat16) for i in range(4)}


def _layout(path):
    """``(header end, {tensor: (begin, end)})`` in absolute file offsets."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    return 8 + n, {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                   for k, v in header.items()}


@pytest.fixture
def single(tmp_path):
    dst = tmp_path / "ckpt"
    write_checkpoint(dst, TENSORS, {"model_type": "llama"}, FORMATS["bf16"])
    return dst


def test_truncated_mid_tensor_names_file_tensor_expected_and_found(single):
    path = single / SINGLE
    start, spans = _layout(path)
    name, (begin, end) = sorted(spans.items(), key=lambda kv: kv[1])[2]
    cut = (begin + end) // 2
    path.write_bytes(path.read_bytes()[:cut])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(single)
    err = e.value
    assert (err.file, err.key) == (str(path), f"{name}.data_offsets")
    assert err.expected == f"end <= {cut - start}" and err.found == end - start
    assert str(err) == (f"{path}: {name}.data_offsets: tensor runs past the end of the file "
                        f"(expected end <= {cut - start}, found {end - start})")


def test_truncated_at_a_tensor_boundary_names_the_first_missing_tensor(single):
    path = single / SINGLE
    _, spans = _layout(path)
    (first, (_, end)), (second, _) = sorted(spans.items(), key=lambda kv: kv[1])[:2]
    path.write_bytes(path.read_bytes()[:end])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(single)
    assert e.value.key == f"{second}.data_offsets" and "past the end" in str(e.value)


def test_truncated_inside_the_header(single):
    path = single / SINGLE
    start, _ = _layout(path)
    path.write_bytes(path.read_bytes()[:start - 10])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(single)
    assert (e.value.file, e.value.key) == (str(path), "header")
    assert e.value.message == "header length prefix too large"
    assert e.value.found == f"{start - 8} bytes"


def test_a_truncated_shard_is_named_among_several(tmp_path):
    dst = tmp_path / "sharded"
    write_checkpoint(dst, TENSORS, {"model_type": "llama"}, FORMATS["bf16"],
                     max_shard_bytes=2 * 16 * 64 * 2)
    assert (dst / INDEX).is_file()
    shards = sorted(dst.glob("*.safetensors"))
    victim = shards[1]
    _, spans = _layout(victim)
    name, (begin, end) = max(spans.items(), key=lambda kv: kv[1])
    victim.write_bytes(victim.read_bytes()[:end - 1])
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(dst)
    assert (e.value.file, e.value.key) == (str(victim), f"{name}.data_offsets")


def test_met_prints_one_line_and_exits_with_the_checkpoint_status(single, tmp_path, capsys):
    path = single / SINGLE
    _, spans = _layout(path)
    name, (begin, end) = min(spans.items(), key=lambda kv: kv[1])
    path.write_bytes(path.read_bytes()[:begin + 3])
    status = main(["quantize", str(single), str(tmp_path / "out"), "--to", "mxfp4",
                   "--no-progress"])
    assert status == CheckpointError.exit_status == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"met: {path}: {name}.data_offsets: tensor runs past the end")
    assert not (tmp_path / "out").exists()


# -- found by tests/host/test_fuzz_safetensors.py ----------------------------------------------


def _raw(path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}, 32, None])
def test_a_dtype_that_is_not_a_string_is_a_checkpoint_error(tmp_path, dtype):
    path = tmp_path / "x.safetensors"
    _raw(path, json.dumps({"a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}})
         .encode(), bytes(8))
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile.open(path)
    assert (e.value.file, e.value.key) == (str(path), "a.dtype")
    assert "unknown dtype" in str(e.value) and "BF16" in e.value.expected


def test_an_integer_past_the_conversion_limit_is_a_checkpoint_error(tmp_path):
    path = tmp_path / "x.safetensors"
    _raw(path, b'{"a": {"dtype": "F32", "shape": [' + b"7" * 5000 + b'], "data_offsets": [0, 8]}}')
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile.open(path)
    assert (e.value.file, e.value.key) == (str(path), "header")
    assert "4300 digits" in str(e.value)


def test_a_huge_dim_beside_a_zero_one_is_refused(tmp_path):
    # zero elements, but no array of that shape can be made: numpy raised a ValueError
    path = tmp_path / "x.safetensors"
    _raw(path, json.dumps({"a": {"dtype": "U8", "shape": [0, 2**63], "data_offsets": [0, 0]}})
         .encode())
    with pytest.raises(CheckpointError) as e:
        SafetensorsFile.open(path)
    assert (e.value.file, e.value.key) == (str(path), "a.shape")
    assert "shape too large" in str(e.value)


def test_an_index_naming_an_impossible_shard_is_a_checkpoint_error(single):
    # a file name longer than the OS allows once made is_file() raise OSError
    (single / SINGLE).rename(single / "model-00001-of-00001.safetensors")
    long = "m" * 5000 + ".safetensors"
    (single / INDEX).write_text(json.dumps({"weight_map": {"w": long}}))
    with pytest.raises(CheckpointError) as e:
        Checkpoint.open(single)
    assert (e.value.file, e.value.key) == (str(single / INDEX), "weight_map.w")
    assert e.value.message == "index names a missing shard"
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        Checkpoint.open(single / long)
