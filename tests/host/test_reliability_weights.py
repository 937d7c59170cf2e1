"""Issue 53, what a load reads: NaN/Inf weights and non-finite config values refused by name; a
path into a checkpoint loads that checkpoint; one stored-format rule for every backend; typed
errors for transposed experts, unknown quantizations and impossible sizes, each checked before
anything is allocated. Each case runs through the Python API and through ``met``."""

from __future__ import annotations

import json
import time

import ml_dtypes
import numpy as np
import pytest

from metrale.cli import main
from metrale.lkb.errors import AllocationError, CheckpointError, ConfigError
from metrale.plan.models import builtin_config
from metrale.runtime.checkpoint import SINGLE, write_checkpoint
from metrale.runtime.engine import Engine, LongContextWarning, random_weights
from metrale.runtime.host_backend import HostBackend

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"


def tiny_checkpoint(dst, model="tiny-qwen3", *, edit=None, config_edit=None, per_expert=False):
    """A bf16 checkpoint of built-in ``model`` with seeded random weights, written as a
    transformers checkpoint is laid out (MoE experts one tensor each with ``per_expert``)."""
    tensors = {n: w.astype(ml_dtypes.bfloat16) for n, w in random_weights(model).items()}
    if per_expert:
        for name in [n for n in tensors if ".mlp.experts." in n]:
            stacked = tensors.pop(name)
            head, proj = name.rsplit(".mlp.experts.", 1)
            for e in range(stacked.shape[0]):
                tensors[f"{head}.mlp.experts.{e}.{proj}"] = stacked[e]
    if edit:
        edit(tensors)
    config = builtin_config(model)
    if config_edit:
        config_edit(config)
    write_checkpoint(dst, tensors, config, "bf16")
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("c") / "qwen3")


def _met(capsys, *argv):
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


# -- 1. NaN or Inf weights, non-finite config values ------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_nan_or_inf_weight_is_refused_at_load_by_tensor_name(tmp_path, capsys, bad):
    def edit(t):
        t[Q_PROJ] = t[Q_PROJ].copy()
        t[Q_PROJ][3, 5] = bad

    d = tiny_checkpoint(tmp_path / "nan", edit=edit)
    with pytest.raises(CheckpointError) as e:
        Engine.load(d)
    assert e.value.key == Q_PROJ and e.value.file == str(d / SINGLE)
    assert "NaN or inf" in e.value.message and "at [3, 5]" in str(e.value)
    status, out, err = _met(capsys, "run", "--checkpoint", str(d), "--steps", "2")
    assert status == CheckpointError.exit_status == 4
    assert out == "" and Q_PROJ in err and err.count("\n") == 1


def test_a_nan_in_one_expert_names_that_expert(tmp_path):
    name = "model.layers.0.mlp.experts.3.down_proj.weight"

    def edit(t):
        t[name] = t[name].copy()
        t[name][0, 0] = np.nan

    d = tiny_checkpoint(tmp_path / "moe", "tiny-qwen3-moe", edit=edit, per_expert=True)
    with pytest.raises(CheckpointError, match="NaN or inf") as e:
        Engine.load(d)
    assert e.value.key == name


@pytest.mark.parametrize("field,value", [("rms_norm_eps", "Infinity"), ("rope_theta", "NaN"),
                                         ("rms_norm_eps", "-Infinity")])
def test_a_non_finite_config_value_is_refused_by_field(ckpt, tmp_path, capsys, field, value):
    d = tmp_path / "cfg"
    d.mkdir()
    (d / SINGLE).symlink_to(ckpt / SINGLE)
    text = (ckpt / "config.json").read_text()
    config = json.loads(text)
    config[field] = 0.5
    (d / "config.json").write_text(json.dumps(config).replace(f'"{field}": 0.5',
                                                              f'"{field}": {value}'))
    with pytest.raises(ConfigError) as e:
        Engine.load(d)
    assert f"config.json: {field}: number is not finite" in str(e.value)
    status, _, err = _met(capsys, "run", "--checkpoint", str(d), "--steps", "2")
    assert status == 3 and field in err and "not finite" in err


# -- 2. --checkpoint pointing into a checkpoint ------------------------------------------------


def _tokens(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("tokens: "))


@pytest.mark.parametrize("inside", ["config.json", SINGLE])
def test_a_path_into_a_checkpoint_loads_that_checkpoint(ckpt, capsys, inside):
    status, whole, _ = _met(capsys, "run", "--checkpoint", str(ckpt), "--steps", "3")
    assert status == 0 and f"weights from {ckpt}" in whole
    status, out, err = _met(capsys, "run", "--checkpoint", str(ckpt / inside), "--steps", "3")
    assert status == 0, err
    assert f"weights from {ckpt}" in out and "random weights" not in out
    assert _tokens(out) == _tokens(whole)
    with Engine.load(ckpt, max_ctx=16) as a, Engine.load(ckpt / inside, max_ctx=16) as b:
        assert np.array_equal(a.prefill([1, 2, 3]), b.prefill([1, 2, 3]))


def test_checkpoint_without_weights_is_refused_never_random(ckpt, tmp_path, capsys):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "config.json").write_text((ckpt / "config.json").read_text())
    for target in (lone, lone / "config.json"):
        status, out, err = _met(capsys, "run", "--checkpoint", str(target), "--steps", "2")
        assert status == CheckpointError.exit_status and out == ""
        assert "--checkpoint needs weights" in err and SINGLE in err


def test_a_built_in_name_says_its_weights_are_random(capsys):
    status, out, _ = _met(capsys, "run", "tiny-llama", "--steps", "2", "--seed", "7")
    assert status == 0 and "random weights (seed 7)" in out


# -- 4. one format rule for every backend --------------------------------------------------------


@pytest.mark.parametrize("hardware", ["host", "sm_90"])
def test_plain_weights_under_a_quantized_plan_are_refused_before_any_backend(ckpt, hardware):
    with pytest.raises(CheckpointError) as e:
        Engine.load(ckpt, quant="fp8", hardware=hardware, backend=HostBackend())
    assert "is stored bf16 (not quantized), and the plan reads it as fp8" in e.value.message
    assert "met quantize SRC DST --to fp8" in e.value.message


def test_a_config_claiming_fp8_over_bf16_weights_is_refused(ckpt, tmp_path, capsys):
    d = tmp_path / "claims"
    d.mkdir()
    (d / SINGLE).symlink_to(ckpt / SINGLE)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3"}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="plan reads it as fp8"):
        Engine.load(d)
    status, _, err = _met(capsys, "run", "--checkpoint", str(d), "--steps", "2")
    assert status == 4 and "stored bf16 (not quantized)" in err
    status, _, err = _met(capsys, "run", "--checkpoint", str(ckpt), "--quant", "fp8")
    assert status == 4 and "--quant bf16" in err


def test_an_unknown_quantization_names_the_config_file(ckpt, tmp_path, capsys):
    d = tmp_path / "gptq"
    d.mkdir()
    (d / SINGLE).symlink_to(ckpt / SINGLE)
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as e:
        Engine.load(d)
    assert e.value.file == str(d / "config.json") and e.value.key == "quantization_config"
    status, _, err = _met(capsys, "run", "--checkpoint", str(d))
    assert status == 3 and err.startswith(f"met: {d / 'config.json'}: quantization_config: ")


# -- 5. typed errors, sizes checked before allocating ------------------------------------------


def test_an_expert_stored_transposed_is_named(tmp_path, capsys):
    name = "model.layers.1.mlp.experts.5.gate_proj.weight"

    def edit(t):
        t[name] = np.ascontiguousarray(t[name].T)

    d = tiny_checkpoint(tmp_path / "t", "tiny-qwen3-moe", edit=edit, per_expert=True)
    with pytest.raises(CheckpointError) as e:
        Engine.load(d)
    assert e.value.key == name and "expert weight has the wrong shape" in e.value.message
    status, _, err = _met(capsys, "run", "--checkpoint", str(d))
    assert status == 4 and name in err


def test_a_huge_context_is_refused_before_allocating(capsys):
    t0 = time.perf_counter()
    with pytest.raises(AllocationError) as e:
        Engine.load("tiny-qwen3", max_ctx=1_000_000_000)
    assert "not enough memory: context 1000000000" in str(e.value)
    assert "available here" in str(e.value) and "a context of at most" in str(e.value)
    status, out, err = _met(capsys, "run", "--context", "1000000000")
    assert status == AllocationError.exit_status == 7 and out == ""
    assert "KV cache" in err and err.count("\n") == 1
    assert time.perf_counter() - t0 < 10  # refused, not tried: the old code took 20 s and 3.9 GB


def test_a_context_past_int32_is_refused():
    with pytest.raises(ConfigError, match="longer than positions can count"):
        Engine.load("tiny-qwen3", max_ctx=2**31)


def test_a_huge_vocabulary_is_refused_before_random_weights(tmp_path, capsys):
    config = builtin_config("tiny-qwen3")
    config["vocab_size"] = 2**31 - 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AllocationError) as e:
        Engine.load(tmp_path / "config.json")
    assert e.value.key == "weights" and "weights 1024.00 GiB" in str(e.value)
    status, _, err = _met(capsys, "run", str(tmp_path / "config.json"))
    assert status == 7 and "not enough memory" in err


def test_out_of_range_token_ids_are_config_errors_in_the_api():
    with Engine.load("tiny-qwen3", max_ctx=16) as eng:
        with pytest.raises(ConfigError, match="token ids must be ints"):
            eng.prefill([1, 99999999999999999999])
        with pytest.raises(ConfigError, match="token id out of range"):
            eng.prefill([1, 2**40])


def test_a_negative_seed_is_a_config_error_in_the_api():
    with pytest.raises(ConfigError, match="bad seed"):
        random_weights("tiny-qwen3", seed=-1)
    with pytest.raises(ConfigError, match="bad seed"):
        Engine.load("tiny-qwen3", seed=-1)


# -- 8. the smaller ones --------------------------------------------------------------------


def test_a_context_past_max_position_embeddings_warns(capsys):
    with pytest.warns(LongContextWarning, match=r"context 600 is longer than the model's "
                                                r"max_position_embeddings \(512\)"):
        Engine.load("tiny-qwen3", max_ctx=600).close()
    status, _, err = _met(capsys, "run", "--context", "600", "--steps", "2")
    assert status == 0
    assert err == ("met: warning: tiny-qwen3: context 600 is longer than the model's "
                   "max_position_embeddings (512): positions past it were never trained\n")


def test_default_context_stays_within_the_model(recwarn):
    with Engine.load("tiny-qwen3") as eng:
        assert eng.max_ctx == 512
    assert not [w for w in recwarn if issubclass(w.category, LongContextWarning)]


def test_steps_beyond_the_context_fail_before_running(capsys):
    with Engine.load("tiny-qwen3", max_ctx=16) as eng:
        with pytest.raises(ConfigError, match="prompt and steps do not fit the context") as e:
            eng.generate([1, 2, 3, 4], 14)
        assert "at most 13 steps" in str(e.value)
        assert eng.lengths == [0]  # nothing ran
        assert len(eng.generate([1, 2, 3, 4], 13).ids) == 13  # returns a Generation
    status, out, err = _met(capsys, "run", "--context", "16", "--steps", "20")
    assert status == 3 and out == "" and "at most 9 steps" in err


def test_timing_zero_steps_is_a_config_error_in_the_api():
    from metrale.runtime.bench import time_decode

    with Engine.load("tiny-qwen3", max_ctx=16) as eng:
        with pytest.raises(ConfigError, match="bad step count"):
            time_decode(eng, 1, steps=0)
