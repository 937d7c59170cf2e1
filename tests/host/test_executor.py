"""The executor and the Engine on the host backend: exact-policy claims at run time, liveness.

- fused vs unfused (``fuse=False``) plans give byte-identical logits for every architecture;
- decode rows=1 and rows=8 give byte-identical logits for the same sequence in slot 0;
- placement never lets two live buffers share a byte, and costs less than one buffer each;
- with activations poisoned with NaN before every step, no NaN reaches the logits (every
  buffer is written before it is read), and poisoning changes no byte of the result;
- graph replay, blocking launches and plain launches give the same bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale.lkb.errors import ConfigError
from metrale.plan.plan import plan_for
from metrale.runtime.engine import Engine
from metrale.runtime.executor import place

MODELS = ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe")
PROMPT = [3, 17, 99, 200, 5, 64, 1, 250]
OTHERS = [[7, 8, 9], [11], [250, 1, 2, 3, 4], [42, 42], [5, 6, 7, 8], [9], [100, 101]]


def _run(engine: Engine, steps: int = 3) -> list[np.ndarray]:
    out = [engine.prefill(PROMPT)]
    token = int(out[0][-1].argmax())
    for _ in range(steps):
        out.append(engine.decode([token]))
        token = int(out[-1][0].argmax())
    return out


@pytest.mark.parametrize("model", MODELS)
def test_fused_and_unfused_plans_give_identical_bytes(model):
    fused = plan_for(model, "bf16", "host", rows=1, context=32)
    unfused = plan_for(model, "bf16", "host", rows=1, context=32, fuse=False)
    assert fused.exact and unfused.kernel_count > fused.kernel_count  # the claim is not vacuous
    with Engine.load(model, max_ctx=32) as a, Engine.load(model, max_ctx=32, fuse=False) as b:
        for x, y in zip(_run(a), _run(b)):
            assert np.isfinite(x).all() and np.abs(x).max() > 0
            assert x.tobytes() == y.tobytes()


@pytest.mark.parametrize("model", MODELS)
def test_decode_rows_1_and_8_give_identical_bytes_for_a_row(model):
    assert plan_for(model, "bf16", "host", rows=8, context=32).row_invariant
    with Engine.load(model, max_ctx=32, slots=8) as eng:
        token = int(eng.prefill(PROMPT)[-1].argmax())
        alone = eng.decode([token])[0]
        eng.prefill(PROMPT)  # slot 0 back to the same state
        others = []
        for slot, prompt in enumerate(OTHERS, start=1):
            others.append(int(eng.prefill(prompt, slot=slot)[-1].argmax()))
        batch = eng.decode([token, *others])
        assert batch.shape[0] == 8
        assert batch[0].tobytes() == alone.tobytes()
        assert not np.array_equal(batch[1], batch[0])  # the other rows are other sequences


@given(st.lists(st.tuples(st.integers(1, 300), st.integers(0, 20), st.integers(0, 6)),
                min_size=1, max_size=25))
def test_placement_is_sound_and_no_worse_than_naive(spec):
    items = [(f"b{i}", n, f, f + d) for i, (n, f, d) in enumerate(spec)]
    p = place(items, align=8)
    off = dict(p.offsets)
    for i, (a, na, fa, la) in enumerate(items):
        for b, nb, fb, lb in items[i + 1:]:
            if fa <= lb and fb <= la:  # lifetimes overlap: bytes must not
                assert off[a] + na <= off[b] or off[b] + nb <= off[a], (a, b)
    assert p.live_peak <= p.arena_bytes <= sum(-(-n // 8) * 8 for _, n, _, _ in items)


@pytest.mark.parametrize("model", MODELS)
def test_liveness_reuses_memory_and_every_buffer_is_written_before_read(model):
    with Engine.load(model, max_ctx=32, debug=True) as poisoned, \
            Engine.load(model, max_ctx=32) as clean:
        for x, y in zip(_run(poisoned), _run(clean)):
            assert not np.isnan(x).any()
            assert x.tobytes() == y.tobytes()
        for prog in poisoned._programs.values():
            assert prog.live_peak <= prog.peak_bytes < prog.naive_bytes


def test_poison_is_visible_when_a_kernel_is_skipped():
    """The debug poison does catch a read of unwritten bytes (a kernel dropped from a step)."""
    with Engine.load("tiny-qwen3", max_ctx=32, debug=True, graphs=False) as eng:
        prog = eng.program("decode", 1)
        eng.prefill(PROMPT)
        prog.launches = tuple(ln for ln in prog.launches if ln.kernel.family != "rmsnorm")
        prog._args = [prog._resolve(ln) for ln in prog.launches]
        logits = eng.decode([5])
        assert np.isnan(logits).any()


@pytest.mark.parametrize("mode", ["graph", "blocking", "plain"])
def test_graph_replay_blocking_and_plain_runs_agree(mode):
    kw = {"graph": {}, "blocking": {"blocking": True}, "plain": {"graphs": False}}[mode]
    with Engine.load("tiny-qwen3-moe", max_ctx=32, **kw) as eng, \
            Engine.load("tiny-qwen3-moe", max_ctx=32, graphs=False) as ref:
        got, want = _run(eng, 4), _run(ref, 4)
        assert [g.tobytes() for g in got] == [w.tobytes() for w in want]
        captured = eng.program("decode", 1)._graph is not None
        assert captured == (mode == "graph")


@pytest.mark.parametrize("mode", ["graph", "blocking", "plain"])
def test_prefill_replays_a_graph_captured_for_its_slot(mode):
    """A prefill program is captured at its first run into a slot, and again when a prompt goes
    to another slot; the logits, and the decode steps that read each slot's cache afterwards,
    have the bytes of plain runs."""
    kw = {"graph": {}, "blocking": {"blocking": True}, "plain": {"graphs": False}}[mode]
    with Engine.load("tiny-llama", max_ctx=32, slots=2, **kw) as eng, \
            Engine.load("tiny-llama", max_ctx=32, slots=2, graphs=False) as ref:
        for slot, prompt in [(0, PROMPT), (1, PROMPT[::-1]), (0, PROMPT[1:] + PROMPT[:1])]:
            got, want = eng.prefill(prompt, slot=slot), ref.prefill(prompt, slot=slot)
            assert got.tobytes() == want.tobytes(), slot
            assert eng.program("prefill", len(prompt)).captured == (mode == "graph")
        assert eng.decode([3, 4]).tobytes() == ref.decode([3, 4]).tobytes()


def test_generate_is_greedy_over_prefill_and_decode():
    with Engine.load("tiny-llama", max_ctx=32) as a, Engine.load("tiny-llama", max_ctx=32) as b:
        tokens = list(a.generate(PROMPT, 5).ids)
        logits = b.prefill(PROMPT)
        expect = [int(logits[-1].argmax())]
        for _ in range(4):
            expect.append(int(b.decode([expect[-1]])[0].argmax()))
        assert tokens == expect


def test_prefill_of_the_last_row_runs_the_head_on_that_row_alone():
    """``prefill(last=True)`` plans the final norm and lm_head on the last row only (last_row
    first), and gives the bytes of the full prefill's last row: those kernels are row-invariant."""
    with Engine.load("tiny-llama", max_ctx=32) as eng:
        full = eng.prefill(PROMPT)
        last = eng.prefill(PROMPT, last=True)
        assert last.shape == (1, full.shape[1]) and last.tobytes() == full[-1:].tobytes()
        plan = eng.plan("prefill", len(PROMPT), "last")
        families = [k.family for k in plan.launches]
        assert families[-3:] == ["last_row", "rmsnorm", "lm_head"], families[-4:]
        assert eng.program("prefill", len(PROMPT), "last").specs["logits"].shape == (1, full.shape[1])
    with pytest.raises(ConfigError, match="decode rows are sequences"):
        plan_for("tiny-llama", mode="decode", logits="last")


def test_prefill_programs_are_bounded_and_results_unchanged():
    """Many prompt lengths: at most MAX_PREFILL_PROGRAMS programs stay; a dropped one is rebuilt
    with the same bytes."""
    from metrale.runtime.engine import MAX_PREFILL_PROGRAMS, Engine

    with Engine.load("tiny-llama", max_ctx=64) as eng:
        first = eng.prefill([1, 2, 3])
        for n in range(4, 4 + MAX_PREFILL_PROGRAMS + 2):
            eng.prefill(list(range(1, n + 1)))
        kept = [k for k in eng._programs if k[0] == "prefill"]
        assert len(kept) == MAX_PREFILL_PROGRAMS and ("prefill", 3, "all") not in kept
        again = eng.prefill([1, 2, 3])
        assert again.tobytes() == first.tobytes()


def test_the_prefill_budget_counts_each_program_s_workspace_too(monkeypatch):
    """A prefill program's workspace (a quantized prefill holds its weights made bf16 there)
    counts toward PREFILL_ARENA_BYTES with its arena: programs whose arenas fit the budget but
    whose workspaces do not are closed, the newest kept."""
    from metrale.runtime import engine as engine_module
    from metrale.runtime.executor import Program

    monkeypatch.setattr(Program, "workspace_bytes", property(lambda self: 1 << 20))
    monkeypatch.setattr(engine_module, "PREFILL_ARENA_BYTES", (1 << 20) + (1 << 19))
    with engine_module.Engine.load("tiny-llama", max_ctx=32) as eng:
        eng.prefill([1, 2, 3])
        eng.prefill([1, 2, 3, 4])
        assert [k for k in eng._programs if k[0] == "prefill"] == [("prefill", 4, "all", False)]
        assert eng.memory()["workspaces"] >= 1 << 20


def test_prefill_programs_past_the_arena_budget_close_and_keep_their_plans(monkeypatch):
    """Past PREFILL_ARENA_BYTES only the newest prefill program stays; a closed program's plan
    is kept, so the rebuild plans nothing and gives the same bytes."""
    from metrale.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFILL_ARENA_BYTES", 1)
    with engine_module.Engine.load("tiny-llama", max_ctx=32) as eng:
        first = eng.prefill([1, 2, 3])
        eng.prefill([1, 2, 3, 4])
        assert [k for k in eng._programs if k[0] == "prefill"] == [("prefill", 4, "all", False)]
        plan = eng._plans[("prefill", 3, "all", False)]
        assert eng.prefill([1, 2, 3]).tobytes() == first.tobytes()
        assert eng.program("prefill", 3).plan is plan


def test_a_prompt_in_a_slot_seen_before_replays_that_slot_graph():
    """Prefills alternating between two slots capture one graph per slot, then replay them: the
    backend's graph count stops growing (a server's prefills would otherwise leak a graph each),
    and each slot's cache gets the bytes a prefill alone gives."""
    with Engine.load("tiny-llama", max_ctx=32, slots=2) as eng:
        alone = eng.prefill([5, 6, 7], slot=0)
        counts = []
        for slot in (1, 0, 1, 0):
            assert eng.prefill([5, 6, 7], slot=slot).tobytes() == alone.tobytes()
            counts.append(eng.backend.graph_count())
        assert counts[1:] == [counts[0]] * 3
        k = {s: eng.backend.copy_d2h(eng._cache_ptr("kv.0.k", s, 1)) for s in (0, 1)}
        assert k[0].tobytes() == k[1].tobytes() and k[0].any()


def test_a_config_variant_loads_as_its_name_does():
    """Engine.load takes a ModelConfig (a built-in's variant) as it takes the name: the same
    seeded weights, so the built-in's own config gives its bytes, and a variant with one layer
    fewer plans fewer launches."""
    import attrs

    from metrale.plan.config import ModelConfig

    cfg = ModelConfig.load("tiny-qwen3")
    short = attrs.evolve(cfg, num_hidden_layers=cfg.num_hidden_layers - 1)
    with Engine.load("tiny-qwen3", max_ctx=32) as a, Engine.load(cfg, max_ctx=32) as b, \
            Engine.load(short, max_ctx=32) as c:
        assert a.prefill(PROMPT).tobytes() == b.prefill(PROMPT).tobytes()
        assert c.config.num_hidden_layers == cfg.num_hidden_layers - 1
        assert len(c.program("decode", 1).launches) < len(b.program("decode", 1).launches)
