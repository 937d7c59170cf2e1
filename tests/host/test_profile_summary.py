"""The Nsight Compute summary of benchmarks/profile_gpu_step.py reads ncu's raw page right:
units to seconds and bytes, stall reasons largest first, a page with no units row."""

from __future__ import annotations

import argparse
import doctest
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import profile_gpu_step  # noqa: E402
from profile_gpu_step import (  # noqa: E402
    STALL,
    STALL_END,
    labelled,
    second_layer,
    summarize,
    target,
)

HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_read.sum",
          "launch__registers_per_thread", f"{STALL}long_scoreboard{STALL_END}",
          f"{STALL}barrier{STALL_END}", f"{STALL}membar{STALL_END}"]


def _csv(*rows: list[str]) -> str:
    return "\n".join(",".join(f'"{c}"' for c in row) for row in (HEADER, *rows)) + "\n"


def test_the_module_examples_hold():
    assert doctest.testmod(profile_gpu_step).failed == 0


def test_units_become_seconds_and_bytes_and_stalls_sort_largest_first():
    text = _csv(["", "", "ms", "Mbyte", "register/thread", "", "", ""],
                ["0", "metrale_qkv", "0.0171", "50.3", "63", "6.23", "0.5", "0"],
                ["1", "metrale_linear", "13.4", "33.5", "64", "8", "", "1.5"])
    first, second = summarize(text)
    assert first["name"] == "metrale_qkv"
    assert first["seconds"] == pytest.approx(17.1e-6)
    assert first["dram_read_bytes"] == pytest.approx(50.3e6)
    assert first["registers"] == 63
    assert first["stalls"] == [["long_scoreboard", 6.23], ["barrier", 0.5]]  # zero dropped
    assert second["seconds"] == pytest.approx(13.4e-3)
    (us,) = summarize(_csv(["", "", "us", "", "", "", "", ""],
                           ["0", "k", "14.69", "", "", "", "", ""]))
    assert us["seconds"] == pytest.approx(14.69e-6)  # ncu 2025.3's raw page spells it "us"
    assert second["stalls"] == [["long_scoreboard", 8.0], ["membar", 1.5]]  # empty dropped
    assert second["dram_pct"] is None  # a metric the page lacks


def test_a_page_without_a_units_row_keeps_the_numbers():
    (k,) = summarize(_csv(["3", "metrale_rmsnorm", "1,250", "2", "84", "1", "2", "3"]))
    assert k["seconds"] == 1250.0 and k["stalls"][0] == ["membar", 3.0]


def test_targets_are_model_quant_pairs():
    assert target("llama-3.1-8b:mxfp4") == ("llama-3.1-8b", "mxfp4")
    for bad in ("llama-3.1-8b", ":bf16", "qwen3-0.6b:", "a:b:c"):
        with pytest.raises(argparse.ArgumentTypeError, match="MODEL:QUANT"):
            target(bad)


def test_kernels_take_their_launch_labels_only_when_the_counts_agree():
    kernels = [{"name": "metrale_linear"}, {"name": "metrale_linear"}]
    launches = [{"kernel": "#8 linear", "point": "p8"}, {"kernel": "#11 linear", "point": "p11"}]
    assert [k["kernel"] for k in labelled(kernels, launches)] == ["#8 linear", "#11 linear"]
    assert labelled(kernels, launches[:1]) == kernels


@pytest.mark.parametrize("mode", ["decode", "prefill"])
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "tiny-qwen3-moe"])
def test_the_profiled_window_is_one_whole_layer(model, mode):
    """On the host plans of the built-in tiny models, for the decode step and a prompt's prefill
    (``--prefill``): the window starts at the second layer's input norm and holds exactly the
    launches one layer repeats."""
    from metrale.runtime.bench import decode_program, prefill_program
    from metrale.runtime.engine import Engine

    with Engine.load(model, max_ctx=40) as eng:
        prog = decode_program(eng, 1) if mode == "decode" else prefill_program(eng, 24)
        families = [ln.kernel.family for ln in prog.launches]
        lo, hi = second_layer([ln.kernel.layer for ln in prog.launches])
    # the second layer's input norm; a MoE layer's combine folds into it (moe_combine_add_rmsnorm)
    assert families[lo] == ("moe_combine_add_rmsnorm" if "moe" in model else "add_rmsnorm")
    assert families[lo + 1:hi] == families[2:2 + hi - lo - 1]  # the first layer, norm aside
    assert families[lo:hi].count(families[2]) == 1


@pytest.mark.parametrize("quant", ["bf16", "fp8"])
def test_the_window_of_an_sm_90_prefill_is_its_second_layer(quant):
    """sm_90's prefill plans at 2048 rows, where fp8 (exact policy) dequantizes before every
    GEMM, so a layer's first family repeats inside it: the window is layer 1, from its norm."""
    from metrale.plan.config import ModelConfig
    from metrale.plan.plan import plan_for

    plan = plan_for(ModelConfig.load("llama-3.1-8b"), quant, "sm_90", mode="prefill", rows=2048,
                    act="bf16", context=2048, fuse=True, policy="exact", logits="all")
    families = [k.family for k in plan.launches]
    lo, hi = second_layer([k.layer for k in plan.launches])
    # the layer's input norm: the search chooses by cost whether the residual add before it
    # fuses into the GEMM (linear_add, then rmsnorm) or into the norm (add_rmsnorm)
    norm = families[lo]
    assert norm == "add_rmsnorm" or (norm == "rmsnorm" and families[lo - 1] == "linear_add")
    # one attention a layer, fused with the cache append or after it, as the records price them
    assert sum("attention" in f for f in families[lo:hi]) == 1
    assert families[hi] == norm and hi - lo == (len(families) - 3) // 32
