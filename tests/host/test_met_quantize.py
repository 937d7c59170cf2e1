"""`met quantize` on a checkpoint built by transformers: fp8, mxfp4, nvfp4 load back above floors."""

import numpy as np
import pytest

from metrale.cli import main
from metrale.lkb.quant import QuantTensor
from metrale.runtime.checkpoint import Checkpoint
from metrale.runtime.quantize import sqnr_db

pytest.importorskip("transformers")
from tests.oracle import make_hf_checkpoint  # noqa: E402

FLOORS = {"fp8": 25.0, "mxfp4": 15.0, "nvfp4": 15.8}


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("src") / "ckpt")


@pytest.mark.parametrize("fmt", sorted(FLOORS))
def test_met_quantize_round_trip_meets_sqnr_floor(bf16_checkpoint, tmp_path, fmt, capsys):
    dst = tmp_path / f"q-{fmt}"
    assert main(["quantize", str(bf16_checkpoint), str(dst), "--to", fmt,
                 "--no-progress"]) == 0
    assert "lowest SQNR" in capsys.readouterr().out
    quantized = 0
    with Checkpoint.open(bf16_checkpoint) as src, Checkpoint.open(dst) as out:
        assert out.config is not None and "quantization_config" in out.config
        for name in src.weight_names():
            w = out.weight(name)
            if isinstance(w, QuantTensor):
                quantized += 1
                original = np.asarray(src.weight(name), np.float32)
                assert sqnr_db(original, w.dequantize()) > FLOORS[fmt], name
                assert not np.isnan(w.dequantize()).any()
    assert quantized >= 7  # every projection of every layer at least


def test_met_quantize_refuses_an_unknown_format(bf16_checkpoint, tmp_path, capsys):
    assert main(["quantize", str(bf16_checkpoint), str(tmp_path / "x"), "--to", "fp9",
                 "--no-progress"]) == 3
    assert "fp9" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
