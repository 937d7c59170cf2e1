"""S_n, tensor-parallel sharding: its laws on configs, circuits, plans and weights."""

from __future__ import annotations

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale.lkb.errors import ConfigError
from metrale.lkb.quant import QuantFormat
from metrale.lkb.target import KernelTarget
from metrale.plan.circuit import circuit_for
from metrale.plan.config import ModelConfig
from metrale.plan.fuser import fuser
from metrale.plan.plan import plan_for
from metrale.plan.shard import SPLITS, Sharding
from metrale.realize.target import target
from metrale.runtime.engine import random_weights

# tiny configs with 4 KV heads, so that 1, 2 and 4 ranks all split them
WIDE = {name: attrs.evolve(ModelConfig.load(name), num_attention_heads=8,
                           num_key_value_heads=4)
        for name in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe", "tiny-gpt-oss")}

ranks = st.sampled_from([1, 2, 4])
models = st.sampled_from(sorted(WIDE))
steps = st.tuples(st.sampled_from(["decode", "prefill"]), st.integers(1, 6))


@given(models, steps)
def test_one_rank_is_the_identity(model, step):
    c = circuit_for(WIDE[model], "bf16", step[0], step[1])
    assert Sharding(1)(c) == c
    assert Sharding(1).config(WIDE[model]) == WIDE[model]


@settings(max_examples=20, deadline=None)
@given(models, ranks, steps)
def test_a_rank_circuit_is_the_step_in_one_ranks_sizes(model, n, step):
    c = circuit_for(WIDE[model], "bf16", step[0], step[1])
    s = Sharding(n)(c)
    whole, part = c.sizes(64), s.sizes(64)
    for dim in ("heads", "kv_heads", "q_dim", "kv_dim", "inter"):
        assert part[dim] * n == whole[dim], dim
    assert part["hidden"] == whole["hidden"] and part["vocab"] == whole["vocab"]
    assert s.output_type("logits") == c.output_type("logits")  # gathered: the whole vocabulary
    counts = s.op_counts()
    if n > 1:
        # the embedding's rows, then after attention and after the MLP in each layer; the
        # logits gathered once
        assert counts["all_reduce"] == 2 * c.layers + 1 and counts["all_gather"] == 1
        assert part["vocab_part"] * n == whole["vocab"]
    else:
        assert "all_reduce" not in counts


@settings(max_examples=10, deadline=None)
@given(models, st.sampled_from([2, 4]))
def test_a_rank_plan_is_the_composite_of_the_rank_circuit(model, n):
    """plan_for on S_n's config plans (L_H ≫ F_H)(S_n(circuit)): the same kernels whether the
    rank's circuit is asked for through the config or sharded from the whole circuit."""
    rank = Sharding(n).config(WIDE[model])
    p = plan_for(rank, "bf16", "host", rows=2)
    c = Sharding(n)(circuit_for(WIDE[model], "bf16", "decode", 2))
    F = target("host").realization(KernelTarget("host", rank.name, "bf16"))
    image = (fuser(c, F) >> F.functor)(c.diagram)
    assert [b.param("kernel") for b in image.boxes] == [
        "view" if k.view else k.kernel.key for k in p.kernels]
    fams = [k.family for k in p.kernels]
    # the all-reduces fused (all_gather ≫ rank_sum = all_reduce, bit for bit); the logits'
    # gather alone stays
    assert fams.count("all_reduce") == 2 * rank.num_hidden_layers + 1
    assert fams.count("all_gather") == 1 and "rank_sum" not in fams
    assert fams.count("embedding_part") == 1
    assert p.row_invariant  # every kernel of a rank keeps rows apart; so do the collectives


@settings(max_examples=10, deadline=None)
@given(models, st.sampled_from([2, 4]), st.sampled_from(["bf16", "mxfp4"]))
def test_the_ranks_weights_put_back_together_are_the_models(model, n, quant):
    """Every split weight is its ranks' slices concatenated along its axis; every replicated
    one is the same on each rank; the experts' down bias is rank 0's alone."""
    config = WIDE[model]
    w = random_weights(config, quant)
    parts = [Sharding(n).weights(w, config, r) for r in range(n)]
    for name, full in w.items():
        axis = next((ax for suffix, ax in SPLITS if name.endswith(suffix)), None)
        got = [p[name] for p in parts]
        if axis is not None:
            assert np.array_equal(np.concatenate(got, axis=axis), full), name
        elif name.endswith("down_proj_bias"):
            assert np.array_equal(got[0], full) and not any(g.any() for g in got[1:]), name
        else:
            assert all(g is full for g in got), name
    part = config.vocab_size // n
    assert [int(p["tp.vocab_first"][0]) for p in parts] == [r * part for r in range(n)]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("axis", [-2, -1])
def test_a_quantized_weight_splits_along_its_blocks(fmt, axis):
    """A packed weight's slices dequantize to the slices of the weight (rows, or columns in
    whole blocks), and a cut through a block is refused by name."""
    rng = np.random.default_rng(0)
    f = QuantFormat.parse(fmt)
    w = rng.standard_normal((3, 8, 128)).astype(np.float32)
    qt = f.quantize(w)
    from metrale.plan.shard import _slice

    full = qt.dequantize()
    got = [_slice(qt, axis, r, 2, "w").dequantize() for r in range(2)]
    assert np.array_equal(np.concatenate(got, axis=axis), full)
    if fmt != "fp8":  # per-row scales: any columns cut whole
        with pytest.raises(ConfigError, match="w.scale: does not split into 4"):
            _slice(f.quantize(w[..., :96]), -1, 0, 4, "w")  # 24 columns: not whole blocks


def test_sizes_that_do_not_split_are_refused_by_name():
    with pytest.raises(ConfigError, match="num_key_value_heads: does not split into 4 ranks"):
        Sharding(4).config("tiny-llama")
    with pytest.raises(ConfigError, match="--tp"):
        Sharding(0)
    with pytest.raises(ConfigError, match="already one rank"):
        Sharding(2).config(Sharding(2).config(WIDE["tiny-llama"]))
    with pytest.raises(ConfigError, match="rank"):
        Sharding(2).weights({}, "tiny-llama", 2)


def test_the_docs_example_says_what_it_computes():
    """docs/parallel.md's Python block runs, and each ``expression  # value: words`` line
    evaluates to the value it states."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "parallel.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", doc, re.S)
    env: dict = {}
    checked = 0
    for line in block.splitlines():
        code, _, comment = line.partition("  # ")
        if "=" in code.replace("==", "") or not comment:
            exec(code, env)
            continue
        stated = comment.split(":", 1)[0]
        assert repr(eval(code, env)) == stated, line
        checked += 1
    assert checked == 2


def test_a_collective_costs_its_links_where_the_class_states_them():
    """On sm_90 each all-reduce of a rank's plan costs the interconnect's latency and the bytes
    the rank sends; on the host (no links) only its kernel; one rank has no collective."""
    rank = Sharding(2).config("llama-3.1-8b")
    gpu = plan_for(rank, "bf16", "sm_90")
    [c] = {k.cost for k in gpu.kernels if k.family == "all_reduce"}
    link = target("sm_90").hw.interconnect
    sent = 4096 * 2  # one row of hidden, bf16, to the one other rank
    assert "links:" in c.source and c.us >= link.latency_us + sent / (link.bandwidth_gbs * 1e3)
    host = plan_for(Sharding(2).config("tiny-llama"), "bf16", "host")
    assert all("links:" not in k.cost.source for k in host.kernels if k.family == "all_reduce")
    whole = plan_for("llama-3.1-8b", "bf16", "sm_90")
    assert gpu.predicted_us < whole.predicted_us  # half the weights each, plus the links
