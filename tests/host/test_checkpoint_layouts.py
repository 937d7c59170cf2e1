"""Checkpoint directories: single and sharded, each quantized layout against an independent
decoder (lookup tables and torch, as gpt-oss and ModelOpt decode), every inconsistency refused
naming the file and the tensor, and write_checkpoint's atomic, byte-exact round trip."""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale.lkb.errors import CheckpointError
from metrale.lkb.quant import FORMATS, FP8Format, MXFP4Format, NVFP4Format, QuantTensor
from metrale.runtime import checkpoint as checkpoint_module
from metrale.runtime.checkpoint import INDEX, Checkpoint, write_checkpoint
from metrale.runtime.safetensors import SafetensorsFile, write_safetensors

torch = pytest.importorskip("torch")

# the e2m1 table as gpt-oss's and transformers' dequantizers spell it (independent of ml_dtypes)
FP4_LUT = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
BF16 = ml_dtypes.bfloat16
E4M3 = ml_dtypes.float8_e4m3fn


def lut_unpack(packed: np.ndarray) -> np.ndarray:
    out = np.empty(packed.shape[:-1] + (2 * packed.shape[-1],), np.float32)
    out[..., 0::2] = FP4_LUT[packed & 0x0F]
    out[..., 1::2] = FP4_LUT[packed >> 4]
    return out


def torch_f32(a: np.ndarray, dtype) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.uint8)).view(dtype).float().numpy()


def save(folder: Path, tensors: dict, name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    write_safetensors(folder / name, tensors)
    return folder


def rng_bytes(shape, seed=0, top=256):
    return np.random.default_rng(seed).integers(0, top, shape).astype(np.uint8)


def expect(folder: Path, weight: str | None, *fragments: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        with Checkpoint.open(folder) as ck:
            ck.weight(weight)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, msg
    return e.value


# ------------------------------------------------------------------ directories


def test_single_file_checkpoint(tmp_path):
    w = np.random.default_rng(0).standard_normal((4, 8)).astype(BF16)
    d = save(tmp_path / "c", {"m.proj.weight": w, "m.norm.weight": np.ones(8, BF16)})
    with Checkpoint.open(d) as ck:
        assert ck.names() == ("m.norm.weight", "m.proj.weight")
        assert ck.config is None
        assert ck.files == (d / "model.safetensors",)
        got = ck.weight("m.proj")
        assert isinstance(got, np.ndarray) and got.tobytes() == w.tobytes()
        assert ck.weight("m.proj.weight").tobytes() == w.tobytes()
        assert ck.nbytes == w.nbytes + 16


def test_sharded_checkpoint_with_index_and_config(tmp_path):
    d = tmp_path / "s"
    save(d, {"a.weight": np.ones((2, 2), np.float32)}, "model-00001-of-00002.safetensors")
    save(d, {"b.weight": np.full((3,), 2, np.float32), "b.bias": np.zeros(3, np.float32)},
         "model-00002-of-00002.safetensors")
    index = {"metadata": {"total_size": 40}, "weight_map": {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
        "b.bias": "model-00002-of-00002.safetensors"}}
    (d / INDEX).write_text(json.dumps(index))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 2}))
    with Checkpoint.open(d) as ck:
        assert ck.names() == ("a.weight", "b.bias", "b.weight")
        assert ck.file_of("b.bias").name == "model-00002-of-00002.safetensors"
        assert ck.config == {"model_type": "qwen3", "hidden_size": 2}
        assert ck.raw("b.weight").tolist() == [2, 2, 2]
        assert ck.weight("b.bias").tolist() == [0, 0, 0]


def _two_shards(d: Path, index: dict | str, second: dict | None = None) -> Path:
    save(d, {"a.weight": np.ones(2, np.float32)}, "s1.safetensors")
    save(d, second or {"b.weight": np.ones(2, np.float32)}, "s2.safetensors")
    (d / INDEX).write_text(index if isinstance(index, str) else json.dumps(index))
    return d


@pytest.mark.parametrize("index,second,key,frag", [
    ({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s3.safetensors"}}, None,
     "weight_map.b.weight", "missing shard"),
    ({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors",
                     "c.weight": "s2.safetensors"}}, None, "weight_map.c.weight", "absent"),
    ({"weight_map": {"a.weight": "s2.safetensors", "b.weight": "s2.safetensors"}}, None,
     "weight_map.a.weight", "a.weight in s2.safetensors, found absent"),
    ({"weight_map": {"a.weight": "s2.safetensors", "b.weight": "s1.safetensors"}}, None,
     "weight_map.a.weight", "found in s1.safetensors"),
    ({"weight_map": {"a.weight": "s1.safetensors", "b.weight": "s2.safetensors"}},
     {"b.weight": np.ones(2, np.float32), "a.weight": np.ones(2, np.float32)}, "a.weight",
     "two shards"),
    ('{"weight_map": {"a.weight": "s1.safetensors", "a.weight": "s2.safetensors"}}', None,
     "weight_map.a.weight", "listed twice"),
    ({"weight_map": ["s1.safetensors"]}, None, "weight_map", "weight_map"),
    ({"weight_map": {"a.weight": "../s1.safetensors"}}, None, "weight_map.a.weight",
     "plain file name"),
])
def test_bad_index(tmp_path, index, second, key, frag):
    d = _two_shards(tmp_path / "bad", index, second)
    e = expect(d, None, frag, key)
    assert e.key == key and e.file is not None and Path(e.file).parent == d


def test_no_checkpoint_here(tmp_path):
    (tmp_path / "other.safetensors").write_bytes(b"")
    e = expect(tmp_path, None, "no checkpoint", "other.safetensors", str(tmp_path))
    assert "model.safetensors" in str(e.expected)
    expect(tmp_path / "missing", None, "not found")


def test_nothing_half_loaded_when_a_later_shard_is_bad(tmp_path, monkeypatch):
    d = _two_shards(tmp_path / "h", {"weight_map": {"a.weight": "s1.safetensors",
                                                     "b.weight": "s2.safetensors"}})
    (d / "s2.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    opened: list[SafetensorsFile] = []
    real_open = SafetensorsFile.open

    def recording(path):
        f = real_open(path)
        opened.append(f)
        return f

    monkeypatch.setattr(checkpoint_module.SafetensorsFile, "open", staticmethod(recording))
    expect(d, None, "s2.safetensors", "not JSON")
    assert len(opened) == 1 and opened[0]._closed and opened[0]._mm is None


def test_unknown_weight_suggests(tmp_path):
    d = save(tmp_path / "u", {"model.layers.0.mlp.up_proj.weight": np.ones((2, 2), BF16)})
    e = expect(d, "model.layers.0.mlp.upp_proj", "no such weight")
    assert e.suggestion == "model.layers.0.mlp.up_proj.weight"


# ------------------------------------------------------------------ layouts vs independent decoders


def _fp8(seed, shape, dtype=E4M3):
    return (np.random.default_rng(seed).standard_normal(shape) * 50).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("scale_shape,gran", [((), "tensor"), ((1,), "tensor"),
                                              ((6, 1), "channel")])
@pytest.mark.parametrize("dtype,tdt", [(E4M3, "float8_e4m3fn"), (ml_dtypes.float8_e5m2,
                                                                  "float8_e5m2")])
def test_fp8_compressed_tensors(tmp_path, scale_shape, gran, dtype, tdt):
    w = _fp8(1, (6, 40), dtype)
    s = np.random.default_rng(2).uniform(0.01, 0.1, scale_shape).astype(np.float32)
    d = save(tmp_path / "f", {"m.q_proj.weight": w, "m.q_proj.weight_scale": s})
    with Checkpoint.open(d) as ck:
        qt = ck.weight("m.q_proj")
        assert isinstance(qt, QuantTensor)
        assert qt.fmt == FP8Format(gran, "e4m3" if dtype is E4M3 else "e5m2")
        want = torch_f32(w, getattr(torch, tdt)) * s.reshape(-1, 1 if s.size > 1 else 1)
        assert qt.dequantize().tobytes() == want.astype(np.float32).tobytes()
        assert ck.weight_names() == ("m.q_proj.weight",)


def test_fp8_block_scale_inv(tmp_path):
    w = _fp8(3, (200, 300))
    s = np.random.default_rng(4).uniform(0.01, 0.1, (2, 3)).astype(np.float32)
    d = save(tmp_path / "b", {"m.o_proj.weight": w, "m.o_proj.weight_scale_inv": s})
    with Checkpoint.open(d) as ck:
        qt = ck.weight("m.o_proj")
        assert qt.fmt == FP8Format("block")
        full = np.kron(s, np.ones((128, 128), np.float32))[:200, :300]
        want = torch_f32(w, torch.float8_e4m3fn) * full
        assert qt.dequantize().tobytes() == want.tobytes()


@pytest.mark.parametrize("blocks_sfx,scales_sfx", [("_blocks", "_scales"),
                                                   (".weight_blocks", ".weight_scales"),
                                                   (".blocks", ".scales")])
def test_mxfp4_gpt_oss_experts(tmp_path, blocks_sfx, scales_sfx):
    e, n, kb = 3, 5, 4  # [experts, n, k/32, 16]
    blocks = rng_bytes((e, n, kb, 16), 5)
    scales = rng_bytes((e, n, kb), 6, top=140) + np.uint8(100)  # exponents -27..12
    x = "model.layers.0.mlp.experts.gate_up_proj"
    d = save(tmp_path / "mx", {x + blocks_sfx: blocks, x + scales_sfx: scales})
    with Checkpoint.open(d) as ck:
        qt = ck.weight(x)
        assert qt.fmt == MXFP4Format() and qt.shape == (e, n, kb * 32)
        # gpt-oss: lut[lo], lut[hi] interleaved, times 2^(scale - 127)
        vals = lut_unpack(blocks)  # [e, n, kb, 32]
        want = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127).reshape(e, n, kb * 32)
        assert qt.dequantize().tobytes() == want.astype(np.float32).tobytes()
        assert ck.weight_names() == (x + ".weight",)
        assert ck.weight(x + ".weight") == qt


def test_mxfp4_matches_transformers_gpt_oss_dequantizer(tmp_path):
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    e, n, kb = 2, 3, 5
    blocks = rng_bytes((e, n, kb, 16), 21)
    scales = rng_bytes((e, n, kb), 22, top=60) + np.uint8(100)
    d = save(tmp_path / "hf", {"model.layers.0.mlp.experts.down_proj_blocks": blocks,
                               "model.layers.0.mlp.experts.down_proj_scales": scales})
    ref = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                        dtype=torch.float32)  # [e, k, n]: transposed for gpt-oss
    with Checkpoint.open(d) as ck:
        ours = ck.weight("model.layers.0.mlp.experts.down_proj").dequantize()
    assert ours.transpose(0, 2, 1).tobytes() == ref.contiguous().numpy().tobytes()


def test_mxfp4_written_by_torch_safetensors(tmp_path):
    from safetensors.torch import save_file

    blocks = torch.from_numpy(rng_bytes((4, 2, 16), 9))
    scales = torch.from_numpy(rng_bytes((4, 2), 10, top=20) + np.uint8(120))
    (tmp_path / "t").mkdir()
    save_file({"x.down_proj_blocks": blocks, "x.down_proj_scales": scales},
              str(tmp_path / "t" / "model.safetensors"))
    with Checkpoint.open(tmp_path / "t") as ck:
        qt = ck.weight("x.down_proj")
        want = np.ldexp(lut_unpack(blocks.numpy()), scales.numpy().astype(np.int32)[..., None] - 127)
        assert qt.dequantize().tobytes() == want.reshape(4, 64).astype(np.float32).tobytes()


def test_nvfp4_modelopt(tmp_path):
    n, k = 6, 64
    w = rng_bytes((n, k // 2), 11)
    s = np.random.default_rng(12).uniform(0.5, 300, (n, k // 16)).astype(np.float32).astype(E4M3)
    g = np.array(0.0123, np.float32)
    d = save(tmp_path / "nv", {"m.gate_proj.weight": w, "m.gate_proj.weight_scale": s,
                               "m.gate_proj.weight_scale_2": g,
                               "m.gate_proj.input_scale": np.array(1.0, np.float32)})
    with Checkpoint.open(d) as ck:
        qt = ck.weight("m.gate_proj")
        assert qt.fmt == NVFP4Format() and qt.shape == (n, k)
        block_scale = np.repeat(torch_f32(s, torch.float8_e4m3fn), 16, axis=1)
        want = (lut_unpack(w) * block_scale) * g
        assert qt.dequantize().tobytes() == want.astype(np.float32).tobytes()
        assert ck.weight_names() == ("m.gate_proj.input_scale", "m.gate_proj.weight")


# ------------------------------------------------------------------ inconsistent layouts


def _fp8_channel(n=4, k=32, scale=None):
    return {"m.p.weight": _fp8(0, (n, k)),
            "m.p.weight_scale": np.ones((n, 1), np.float32) if scale is None else scale}


def _mx(kb=2, n=3, blocks_last=16, scales=None):
    return {"m.p_blocks": rng_bytes((n, kb, blocks_last), 1),
            "m.p_scales": rng_bytes((n, kb), 2, 200) if scales is None else scales}


def _nv(n=4, k=32, scale=None, g=None, drop=()):
    g = np.array(0.5, np.float32) if g is None else g
    t = {"m.p.weight": rng_bytes((n, k // 2), 3),
         "m.p.weight_scale": (np.ones((n, k // 16), np.float32).astype(E4M3)
                              if scale is None else scale),
         "m.p.weight_scale_2": g}
    return {key: v for key, v in t.items() if key not in drop}


BAD = [
    ("fp8 channel rows", _fp8_channel(scale=np.ones((5, 1), np.float32)), "m.p.weight_scale",
     "[4, 1]"),
    ("fp8 scale NaN", _fp8_channel(scale=np.array([[1], [np.nan], [1], [1]], np.float32)),
     "m.p.weight_scale", "nan"),
    ("fp8 scale dtype", _fp8_channel(scale=np.ones((4, 1), np.int32)), "m.p.weight_scale",
     "I32"),
    ("fp8 no scale", {"m.p.weight": _fp8(0, (4, 32))}, "m.p.weight_scale", "missing"),
    ("fp8 block shape", {"m.p.weight": _fp8(0, (130, 10)),
                         "m.p.weight_scale_inv": np.ones((1, 1), np.float32)},
     "m.p.weight_scale_inv", "[2, 1]"),
    ("mx scales shape", _mx(scales=rng_bytes((3, 3), 0)), "m.p_scales", "[3, 2]"),
    ("mx blocks last dim", _mx(blocks_last=8, scales=rng_bytes((3, 2), 0)), "m.p_blocks",
     "k/32, 16"),
    ("mx NaN scale", _mx(scales=np.array([[1, 2], [3, 255], [5, 6]], np.uint8)), "m.p_scales",
     "0xFF at [1, 1]"),
    ("mx scales dtype", _mx(scales=np.ones((3, 2), np.float32)), "m.p_scales", "F32"),
    ("nv scale shape", _nv(scale=np.ones((4, 3), np.float32).astype(E4M3)), "m.p.weight_scale",
     "[4, 2]"),
    ("nv scale dtype", _nv(scale=np.ones((4, 2), np.float32)), "m.p.weight_scale", "F8_E4M3"),
    ("nv K", {**_nv(), "m.p.weight": rng_bytes((4, 12), 0)}, "m.p.weight", "K = 24"),
    ("nv global 0", _nv(g=np.array(0.0, np.float32)), "m.p.weight_scale_2", "> 0"),
    ("nv global inf", _nv(g=np.array(np.inf, np.float32)), "m.p.weight_scale_2", "inf"),
    ("nv global NaN", _nv(g=np.array(np.nan, np.float32)), "m.p.weight_scale_2", "nan"),
    ("nv global shape", _nv(g=np.ones(2, np.float32)), "m.p.weight_scale_2", "scalar"),
    ("nv no global", _nv(drop=("m.p.weight_scale_2",)), "m.p.weight_scale_2", "missing"),
    ("nv block NaN", _nv(scale=np.full((4, 2), np.nan, np.float32).astype(E4M3)),
     "m.p.weight_scale", "NaN"),
]


@pytest.mark.parametrize("case,tensors,key,frag", BAD, ids=[b[0] for b in BAD])
def test_inconsistent_layouts_are_refused(tmp_path, case, tensors, key, frag):
    d = save(tmp_path / "x", tensors)
    e = expect(d, "m.p", frag, key, str(d))
    assert e.key == key


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 6), kb=st.integers(1, 4), dn=st.integers(-1, 1), dk=st.integers(-1, 1))
def test_nvfp4_scale_shape_must_match_exactly(tmp_path, n, kb, dn, dk):
    sn, sk = max(n + dn, 1), max(kb + dk, 1)
    scale = np.ones((sn, sk), np.float32).astype(E4M3)
    d = tmp_path / f"h{n}_{kb}_{dn}_{dk}"
    save(d, {"m.p.weight": rng_bytes((n, kb * 8)), "m.p.weight_scale": scale,
             "m.p.weight_scale_2": np.array(1.0, np.float32)})
    if (sn, sk) == (n, kb):
        with Checkpoint.open(d) as ck:
            assert ck.weight("m.p").shape == (n, kb * 16)
    else:
        e = expect(d, "m.p", "m.p.weight_scale", f"[{n}, {kb}]")
        assert str(d) in str(e)


# ------------------------------------------------------------------ write_checkpoint


def _weights(seed=0):
    rng = np.random.default_rng(seed)
    return {"model.layers.0.self_attn.q_proj.weight": rng.standard_normal((256, 128)),
            "model.layers.0.mlp.experts.down_proj.weight": rng.standard_normal((2, 64, 256)),
            "lm_head.weight": rng.standard_normal((130, 256))}


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=str)
def test_write_then_read_is_byte_exact(tmp_path, fmt):
    quantized = {name: fmt.quantize(w.astype(np.float32)) for name, w in _weights().items()}
    plain = {"model.norm.weight": np.ones(128, BF16), "pos": np.arange(4, dtype=np.int64)}
    write_checkpoint(tmp_path / "out", {**quantized, **plain}, {"model_type": "qwen3"}, fmt)
    with Checkpoint.open(tmp_path / "out") as ck:
        cfg = ck.config
        assert cfg["model_type"] == "qwen3"
        if fmt.kind == "bf16":
            assert "quantization_config" not in cfg
        else:
            assert cfg["quantization_config"]["metrale_format"] == fmt.name
        assert set(ck.weight_names()) == set(quantized) | set(plain)
        for name, qt in quantized.items():
            got = ck.weight(name)
            if fmt.kind == "bf16":
                assert got.tobytes() == qt.data.tobytes() and got.dtype == BF16
            else:
                assert got == qt
                assert got.dequantize().tobytes() == qt.dequantize().tobytes()
        for name, a in plain.items():
            assert ck.weight(name).tobytes() == a.tobytes()


def test_write_shards_and_index(tmp_path):
    fmt = FORMATS["nvfp4"]
    quantized = {name: fmt.quantize(w.astype(np.float32)) for name, w in _weights(1).items()}
    write_checkpoint(tmp_path / "sh", quantized, None, fmt, max_shard_bytes=20_000)
    files = sorted(p.name for p in (tmp_path / "sh").iterdir())
    assert INDEX in files and "model.safetensors" not in files
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    index = json.loads((tmp_path / "sh" / INDEX).read_text())
    with Checkpoint.open(tmp_path / "sh") as ck:
        assert set(index["weight_map"]) == set(ck.names())
        assert index["metadata"]["total_size"] == ck.nbytes
        for name, qt in quantized.items():
            assert ck.weight(name) == qt
            x = name[: -len(".weight")]
            assert len({ck.file_of(x + s) for s in (".weight", ".weight_scale",
                                                    ".weight_scale_2")}) == 1


def test_write_refuses_existing_and_overwrites_when_asked(tmp_path):
    fmt = FORMATS["mxfp4"]
    a = {"m.p.weight": fmt.quantize(np.ones((2, 32), np.float32))}
    b = {"m.p.weight": fmt.quantize(np.full((2, 32), 4.0, np.float32))}
    write_checkpoint(tmp_path / "o", a, None, fmt)
    with pytest.raises(CheckpointError) as e:
        write_checkpoint(tmp_path / "o", b, None, fmt)
    assert str(tmp_path / "o") in str(e.value)
    write_checkpoint(tmp_path / "o", b, None, fmt, overwrite=True)
    with Checkpoint.open(tmp_path / "o") as ck:
        assert ck.weight("m.p") == b["m.p.weight"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_interrupted_write_leaves_nothing(tmp_path):
    fmt = FORMATS["fp8_e4m3_channel"]

    def produce():
        yield "a.weight", fmt.quantize(np.ones((4, 8), np.float32))
        yield "b.weight", np.ones(10_000, np.float32)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(tmp_path / "i", produce(), {"x": 1}, fmt, max_shard_bytes=100)
    assert list(tmp_path.iterdir()) == []


def test_quantized_weight_needs_a_weight_name(tmp_path):
    fmt = FORMATS["mxfp4"]
    with pytest.raises(CheckpointError, match="X.weight"):
        write_checkpoint(tmp_path / "n", {"m.p": fmt.quantize(np.ones((1, 32), np.float32))},
                         None, fmt)
    assert list(tmp_path.iterdir()) == []
