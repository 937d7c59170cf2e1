"""Reliability cases 9, 10, 17 (``met run``) and 20 (the plan side): checkpoints that do not fit
the plan, unused tensors, a sticky fault under ``met run``, unreadable evidence in a plan."""

from __future__ import annotations

import shutil
import warnings

import numpy as np
import pytest

from metrale.cli import main
from metrale.lkb.errors import CheckpointError
from metrale.runtime.checkpoint import Checkpoint, write_checkpoint
from metrale.runtime.engine import Engine, UnusedTensorWarning

pytest.importorskip("transformers")
from tests.oracle import make_hf_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("c") / "llama")


def _rewrite(src, dst, edit):
    """A copy of checkpoint ``src`` with its tensors passed through ``edit(dict)``."""
    with Checkpoint.open(src) as ck:
        tensors = {n: np.array(ck.raw(n)) for n in ck.names()}
        config = dict(ck.config)
    edit(tensors)
    write_checkpoint(dst, tensors, config, "bf16")
    return dst


def test_a_clean_checkpoint_warns_of_nothing(ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedTensorWarning)
        Engine.load(ckpt).close()


def test_missing_tensor_names_it_and_the_node_that_needs_it(ckpt, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    bad = _rewrite(ckpt, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError) as e:
        Engine.load(bad)
    assert name in str(e.value) and "linear (k_proj) of layer 1" in str(e.value)


def test_wrong_shape_names_tensor_node_expected_and_found(ckpt, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"

    def edit(t):
        t[name] = t[name][:, :-2].copy()

    bad = _rewrite(ckpt, tmp_path / "s", edit)
    with pytest.raises(CheckpointError) as e:
        Engine.load(bad)
    msg = str(e.value)
    assert name in msg and "linear (down_proj) of layer 0" in msg
    assert "expected (" in msg and "found (" in msg


def test_wrong_dtype_names_tensor_and_node(ckpt, tmp_path):
    name = "model.layers.0.input_layernorm.weight"

    def edit(t):
        t[name] = np.arange(t[name].size, dtype=np.int32)

    bad = _rewrite(ckpt, tmp_path / "d", edit)
    with pytest.raises(CheckpointError) as e:
        Engine.load(bad)
    assert name in str(e.value) and "wrong dtype" in str(e.value) and "int32" in str(e.value)


def _quantized_head(src, dst, fmt):
    """``src`` with its linear weights and its ``lm_head`` stored in ``fmt`` (what
    quantize_checkpoint wrote before it kept the head in bf16)."""
    from metrale.lkb.quant import QuantFormat
    from metrale.runtime.quantize import should_quantize

    f = QuantFormat.parse(fmt)
    with Checkpoint.open(src) as ck:
        tensors = {}
        for n in ck.names():
            raw = np.array(ck.raw(n))
            quantize = should_quantize(n, raw.shape) or n == "lm_head.weight"
            tensors[n] = f.quantize(raw.astype(np.float32), name=n) if quantize else raw
        config = dict(ck.config)
    write_checkpoint(dst, tensors, config, f)
    return dst


def test_a_quantized_head_read_as_bf16_that_would_round_is_refused(ckpt, tmp_path):
    """fp8 with a per-row f32 scale dequantizes to values bf16 cannot hold: the plan reads the
    head in bf16, so loading it would silently round the weights; it is refused by name."""
    bad = _quantized_head(ckpt, tmp_path / "q8", "fp8")
    with pytest.raises(CheckpointError) as e:
        Engine.load(bad)
    msg = str(e.value)
    assert "lm_head.weight" in msg and "would round" in msg and "fp8" in msg
    assert "model.safetensors" in msg or str(bad) in msg


def test_a_quantized_head_exact_in_bf16_loads(ckpt, tmp_path):
    """mxfp4 values (e2m1 times a power of two) are exact in bf16: nothing rounds, so the
    head loads, equal to its dequantized values."""
    from metrale.plan.config import ModelConfig
    from metrale.runtime.engine import checkpoint_weights

    good = _quantized_head(ckpt, tmp_path / "q4", "mxfp4")
    w = checkpoint_weights(good, ModelConfig.load(good), "mxfp4")["lm_head.weight"]
    with Checkpoint.open(good) as ck:
        stored = ck.weight("lm_head.weight")
    assert hasattr(stored, "dequantize")
    assert np.array_equal(w, stored.dequantize().astype(np.float32)) and np.abs(w).max() > 0


def test_extra_tensor_is_a_warning_listing_it(ckpt, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.extra_adapter.weight"] = np.ones((4, 4), np.float32)

    extra = _rewrite(ckpt, tmp_path / "x", edit)
    with pytest.warns(UnusedTensorWarning, match="extra_adapter"):
        Engine.load(extra).close()


def test_met_run_exits_with_the_fault_status_naming_the_kernel(monkeypatch, capsys):
    """A sticky fault during ``met run``: exit status 9, one line naming the kernel."""
    import metrale.runtime.engine as engine_mod
    from metrale.runtime.executor import HostLoader

    def backend(hardware="host", kernels_dir=None):
        """The host backend with a device fault injected at the 5th launch."""
        from metrale.runtime.host_backend import HostBackend

        be = HostBackend()
        real_launch = be.launch
        count = {"n": 0}

        def launch(kernel, *args, **kwargs):
            count["n"] += 1
            if count["n"] == 5:
                from metrale.lkb.errors import DeviceFault

                raise DeviceFault(f"illegal address in kernel {kernel.name}")
            return real_launch(kernel, *args, **kwargs)

        be.launch = launch
        return be, HostLoader()

    monkeypatch.setattr(engine_mod, "best_backend", backend)
    status = main(["run", "tiny-llama", "--steps", "2", "--blocking", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 9
    assert len(err) == 1 and err[0].startswith("met: ") and "#" in err[0]


def test_plan_prints_unreadable_evidence(tmp_path):
    from metrale.plan.plan import plan_for
    from metrale.realize.hardware import default_kernels_dir

    root = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), root)
    (root / "sm_90" / "EVIDENCE.toml").write_text("[[record]]\nhw = 'sm_90'\nvalue = 'fast'\n")
    p = plan_for("tiny-llama", "bf16", "sm_90", kernels_dir=root)
    assert {k.evidence for k in p.launches} == {"evidence unreadable"}
    assert "evidence unreadable" in str(p)
