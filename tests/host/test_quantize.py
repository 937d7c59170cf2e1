"""quantize_checkpoint end to end, and the element decoders checked against torch's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from metrale.lkb.errors import CheckpointError
from metrale.lkb.quant import FORMATS, QuantTensor, pack_e2m1, unpack_e2m1
from metrale.runtime.checkpoint import Checkpoint
from metrale.runtime.quantize import quantize_checkpoint, should_quantize, sqnr_db
from metrale.runtime.safetensors import write_safetensors

torch = pytest.importorskip("torch")
BF16 = ml_dtypes.bfloat16

LINEAR = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
          "model.layers.0.mlp.down_proj.weight")
KEPT = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight", "model.norm.weight", "lm_head.weight")


def make_source(folder: Path, seed: int = 0, **override: np.ndarray) -> Path:
    rng = np.random.default_rng(seed)

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(BF16)

    t = {"model.embed_tokens.weight": w(96, 128),
         "model.layers.0.self_attn.q_proj.weight": w(256, 128),
         "model.layers.0.self_attn.k_proj.weight": w(128, 128),
         "model.layers.0.mlp.down_proj.weight": w(128, 384),
         "model.layers.0.input_layernorm.weight": (1 + w(128)).astype(BF16),
         "model.layers.0.self_attn.q_norm.weight": (1 + w(32)).astype(BF16),
         "model.norm.weight": (1 + w(128)).astype(BF16),
         "lm_head.weight": w(96, 128)}
    t.update(override)
    folder.mkdir(parents=True)
    write_safetensors(folder / "model.safetensors", t)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 128}))
    (folder / "tokenizer.json").write_text('{"model": {}}')
    return folder


@pytest.mark.parametrize("fmt", ["fp8_e4m3_channel", "fp8_e4m3_block", "mxfp4", "nvfp4",
                                 "bf16"])
def test_quantize_checkpoint_end_to_end(tmp_path, fmt):
    src = make_source(tmp_path / "src")
    report = quantize_checkpoint(src, tmp_path / "dst", fmt, progress=False)
    f = FORMATS[fmt]
    assert report.fmt == f.name
    by_name = {r.name: r for r in report.tensors}
    assert set(by_name) == set(LINEAR) | set(KEPT)
    floor = {"fp8": 25.0, "mxfp4": 15.0, "nvfp4": 15.8, "bf16": 40.0}[f.kind]
    with Checkpoint.open(src) as s, Checkpoint.open(tmp_path / "dst") as d:
        assert d.config["hidden_size"] == 128
        assert (d.config.get("quantization_config") or {}).get("metrale_format",
                                                                "bf16") == f.name
        assert (tmp_path / "dst" / "tokenizer.json").read_text() == '{"model": {}}'
        for name in KEPT:
            assert by_name[name].sqnr_db is None and by_name[name].fmt == "copy"
            assert d.weight(name).tobytes() == s.raw(name).tobytes()
        for name in LINEAR:
            r = by_name[name]
            w32 = s.raw(name).astype(np.float32)
            in_memory = f.quantize(w32)
            loaded = d.weight(name)
            if isinstance(loaded, QuantTensor):
                assert loaded == in_memory
                deq = loaded.dequantize()
            else:
                deq = loaded.astype(np.float32)
            # round trip: quantize -> write -> load -> dequantize equals in memory, bytewise
            assert deq.tobytes() == in_memory.dequantize().tobytes()
            assert r.bytes_after == f.weight_bytes(*w32.shape) == in_memory.nbytes
            assert r.bytes_before == w32.size * 2
            assert r.sqnr_db == sqnr_db(w32, deq) and r.sqnr_db > floor
    assert report.bytes_after <= report.bytes_before
    assert "lm_head.weight" in str(report) and "total" in str(report)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["model.layers.0.mlp.down_proj.weight", "model.norm.weight"])
def test_non_finite_tensor_is_refused_by_name(tmp_path, bad, where):
    t = np.ones((128, 384) if "proj" in where else (128,), np.float32)
    t.flat[77] = bad
    src = make_source(tmp_path / "src", **{where: t.astype(BF16)})
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(src, tmp_path / "dst", "mxfp4", progress=False)
    msg = str(e.value)
    assert where in msg and "model.safetensors" in msg
    assert not (tmp_path / "dst").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_k_not_divisible_is_refused_by_name(tmp_path):
    name = "model.layers.0.self_attn.k_proj.weight"
    src = make_source(tmp_path / "src", **{name: np.ones((8, 48), BF16)})
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(src, tmp_path / "dst", "mxfp4", progress=False)
    assert name in str(e.value) and "K = 48" in str(e.value)
    assert str(src / "model.safetensors") in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_quantized_source_is_refused(tmp_path):
    src = make_source(tmp_path / "src")
    quantize_checkpoint(src, tmp_path / "q", "nvfp4", progress=False)
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq", "mxfp4", progress=False)
    assert "not a plain float checkpoint" in str(e.value)


def test_progress_bar_runs(tmp_path, capsys):
    src = make_source(tmp_path / "src")
    report = quantize_checkpoint(src, tmp_path / "dst", "nvfp4", progress=True)
    assert report.min_sqnr_db > 15.8
    assert capsys.readouterr().out == ""  # the bar goes to stderr


def test_which_tensors_are_quantized():
    assert should_quantize("model.layers.3.mlp.experts.7.gate_proj.weight", (8, 4))
    assert should_quantize("model.layers.3.mlp.gate_proj.weight", (8, 4))
    assert not should_quantize("model.layers.3.mlp.gate.weight", (8, 4))  # a router: read in bf16
    assert not should_quantize("lm_head.weight", (8, 4))  # the head: read in bf16
    assert not should_quantize("model.layers.3.post_attention_layernorm.weight", (4,))
    assert not should_quantize("model.layers.3.self_attn.k_norm.weight", (1, 4))
    assert not should_quantize("model.embed_tokens.weight", (8, 4))
    assert not should_quantize("model.layers.3.self_attn.q_proj.bias", (8, 4))


def test_sqnr_db_definition():
    assert sqnr_db(np.ones(4), np.ones(4)) == math.inf
    assert sqnr_db(np.array([1.0, 0.0]), np.array([1.1, 0.0])) == pytest.approx(20.0)


# ------------------------------------------------------------------ against torch's decoders


ALL_BYTES = np.arange(256, dtype=np.uint8)


@pytest.mark.parametrize("ours,theirs", [
    (ml_dtypes.float8_e4m3fn, "float8_e4m3fn"), (ml_dtypes.float8_e5m2, "float8_e5m2"),
    (ml_dtypes.float8_e8m0fnu, "float8_e8m0fnu"), (ml_dtypes.bfloat16, "bfloat16")])
def test_decoding_matches_torch_byte_for_byte(ours, theirs):
    tdt = getattr(torch, theirs, None)
    if tdt is None:
        pytest.skip(f"torch {torch.__version__} has no {theirs}")
    raw = ALL_BYTES if np.dtype(ours).itemsize == 1 else np.arange(65536, dtype=np.uint16)
    mine = raw.view(ours).astype(np.float32)
    ref = torch.from_numpy(raw.view(np.uint8).copy()).view(tdt).float().numpy()
    nan = np.isnan(mine)
    assert np.array_equal(nan, np.isnan(ref))  # NaN at the same codes (payloads differ)
    assert nan.sum() < raw.size
    assert mine[~nan].tobytes() == ref[~nan].tobytes()


@pytest.mark.parametrize("ours,theirs,top", [(ml_dtypes.float8_e4m3fn, "float8_e4m3fn", 448),
                                             (ml_dtypes.float8_e5m2, "float8_e5m2", 57344)])
def test_encoding_matches_torch_in_range(ours, theirs, top):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(100_000) * np.exp2(rng.uniform(-12, 8, 100_000))).astype(np.float32)
    x = np.clip(x, -top, top)
    mine = x.astype(ours).view(np.uint8)
    ref = torch.from_numpy(x).to(getattr(torch, theirs)).view(torch.uint8).numpy()
    assert mine.tobytes() == ref.tobytes()


def test_quantized_fp8_bytes_decode_the_same_in_torch():
    w = np.random.default_rng(5).standard_normal((64, 96)).astype(np.float32)
    qt = FORMATS["fp8_e4m3_channel"].quantize(w)
    ref = torch.from_numpy(qt.data.view(np.uint8).copy()).view(torch.float8_e4m3fn).float()
    ref = (ref * torch.from_numpy(qt.scale)).numpy()
    assert ref.tobytes() == qt.dequantize().tobytes()


def test_e2m1_against_torch_float4_x2():
    tdt = getattr(torch, "float4_e2m1fn_x2", None)
    if tdt is None:
        pytest.skip(f"torch {torch.__version__} has no float4_e2m1fn_x2")
    packed = torch.from_numpy(ALL_BYTES.copy()).view(tdt)
    try:
        decoded = packed.to(torch.float32)
    except (RuntimeError, NotImplementedError) as e:
        pytest.skip(f"torch {torch.__version__} cannot convert float4_e2m1fn_x2 on CPU "
                    f"({str(e).splitlines()[0]}); nothing to compare the nibble order against")
    if decoded.numel() != 512:
        pytest.skip(f"torch converts float4_e2m1fn_x2 to {decoded.numel()} values per 256 "
                    "bytes; no per-nibble decoding to compare with")
    mine = unpack_e2m1(ALL_BYTES).astype(np.float32)
    assert decoded.numpy().reshape(-1).tobytes() == mine.tobytes()
    assert pack_e2m1(mine).tobytes() == ALL_BYTES.tobytes()


def _moe_source(folder: Path, experts: int = 4) -> Path:
    """A source with one layer's experts, each expert's weights at its own magnitude (so that
    a tensor-wide scale taken per expert differs from one taken over the stack)."""
    rng = np.random.default_rng(3)
    t = {f"model.layers.0.mlp.experts.{e}.{p}.weight":
         (rng.standard_normal((32, 64)) * 0.05 * (e + 1)).astype(BF16)
         for e in range(experts) for p in ("gate_proj", "up_proj")}
    t["model.layers.0.mlp.gate.weight"] = (rng.standard_normal((experts, 64)) * 0.05).astype(BF16)
    return make_source(folder, **t)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_e4m3_tensor", "mxfp4", "fp8_e4m3_channel"])
def test_experts_are_quantized_as_the_stack_the_plans_read(tmp_path, fmt):
    """A layer's experts of one projection are quantized as one stacked tensor, so a format's
    tensor-wide arrays (nvfp4's global scale, fp8's per-tensor scale) are one per stack, as the
    device stores them; per-row formats come out as if quantized one expert at a time."""
    src = _moe_source(tmp_path / "src")
    quantize_checkpoint(src, tmp_path / "dst", fmt, progress=False)
    f = FORMATS[fmt]
    names = [f"model.layers.0.mlp.experts.{e}.up_proj.weight" for e in range(4)]
    with Checkpoint.open(src) as s, Checkpoint.open(tmp_path / "dst") as d:
        got = [d.weight(n) for n in names]
        w = np.stack([s.raw(n).astype(np.float32) for n in names])
        assert not hasattr(d.weight("model.layers.0.mlp.gate.weight"), "dequantize")  # router
    stacked = f.quantize(w)
    assert np.array_equal(np.stack([g.dequantize() for g in got]), stacked.dequantize())
    alone = [f.quantize(w[e]) for e in range(4)]
    if fmt in ("mxfp4", "fp8_e4m3_channel"):
        assert got == alone
    else:  # one expert at a time would have given each its own scale
        assert got != alone
        assert len({np.asarray(g.global_scale if g.global_scale is not None else g.scale)
                    .tobytes() for g in got}) == 1


def test_device_layout_refuses_values_it_cannot_hold(tmp_path):
    """Experts quantized one at a time (nvfp4, a global scale each) cannot be stored as the one
    stacked tensor the device keeps: re-quantizing them would change values, which is refused
    by name; the stack quantize_checkpoint writes is accepted and stored byte for byte."""
    from metrale.lkb.errors import CheckpointError
    from metrale.runtime.cuda_loader import CudaPlanLoader

    f = FORMATS["nvfp4"]
    rng = np.random.default_rng(4)
    w = np.stack([(rng.standard_normal((32, 64)) * (e + 1)).astype(np.float32)
                  for e in range(4)])
    per_expert = np.stack([f.quantize(w[e]).dequantize() for e in range(4)])
    loader = CudaPlanLoader("sm_90")
    name = "model.layers.0.mlp.experts.up_proj.weight"
    with pytest.raises(CheckpointError) as e:
        loader.prepare_parts(name, per_expert, "nvfp4")
    assert name in str(e.value) and "would change" in str(e.value)
    together = f.quantize(w)
    parts = loader.prepare_parts(name, together.dequantize(), "nvfp4")
    assert parts[name].tobytes() == together.data.tobytes()
    assert parts[f"{name}_scale"].tobytes() == together.scale.tobytes()


@pytest.mark.parametrize("bad", ["nan", "shape"])
def test_a_bad_expert_in_a_stacked_group_is_refused_by_name(tmp_path, bad):
    """The stack is read when its first expert comes up; a later expert that is not finite, or
    not of the group's shape, is refused by its own name before anything is written."""
    src = _moe_source(tmp_path / "src")
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    with Checkpoint.open(src) as ck:
        tensors = {n: np.array(ck.raw(n)) for n in ck.names()}
    tensors[name] = (np.full((32, 64), np.nan, np.float32) if bad == "nan"
                     else np.ones((16, 64), np.float32)).astype(BF16)
    write_safetensors(src / "model.safetensors", tensors)
    with pytest.raises(CheckpointError) as e:
        quantize_checkpoint(src, tmp_path / "dst", "nvfp4", progress=False)
    assert name in str(e.value) and "model.safetensors" in str(e.value)
    assert not (tmp_path / "dst").exists()
