"""What a dependent launch may touch before its wait, checked on the CUDA emulation.

On a class with dependent launches (sm_90) a kernel may start while the launches before it in
its step still run: only its ``griddepcontrol.wait`` (grid.cuh) orders it after them. So what a
kernel does before that wait may read only bytes no launch of the step writes: weights, tables,
the host's inputs, cache rows of earlier steps. Every kernel's comment says what it reads early;
this checks it, launch by launch, for whole sm_90 plans: each dependent launch runs once as it
is and once with the step's bytes (the activation arena, the workspace, and the cache bytes the
step writes) poisoned until its block waits (``simt.dependent_launch_guard``), from the same
state; the two must write the same bytes, and a write before the wait traps.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import attrs
import numpy as np
import pytest

from metrale.lkb.errors import DeviceFault
from metrale.plan.config import ModelConfig
from metrale.runtime.engine import Engine
from metrale.runtime.host_backend import HostBackend
from tests.host import simt
from tests.tiers import sampled

ok, why = simt.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no host emulation: {why}")

PROMPT = [5, 17, 3, 99, 42, 7, 1, 250]


def _runs(changed: np.ndarray, gap: int = 64) -> list[tuple[int, int]]:
    """Runs [start, end) of the True entries, joined where fewer than ``gap`` False ones part
    them (an element of a written row that kept its bytes is still the step's)."""
    at = np.flatnonzero(changed)
    if at.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(at) > gap)
    starts = np.concatenate([[at[0]], at[breaks + 1]])
    ends = np.concatenate([at[breaks], [at[-1]]]) + 1
    return list(zip(starts.tolist(), ends.tolist()))


def check_step(engine: Engine, mode: str, rows: int, inputs: Mapping[str, np.ndarray],
               also: Sequence[str] = ()) -> int:
    """Run one step of ``engine``'s (mode, rows) program twice, launch by launch, as the module
    docstring says; ``also`` guards more of the program's buffers (the test that the check can
    fail). Returns how many launches ran guarded."""
    prog = engine.program(mode, rows)
    for name, values in inputs.items():
        prog.write(name, values)
    host = engine.backend.host_bytes  # views of the emulation's memory
    memory = {label: host(p) for label, p in prog.step_memory}
    caches = {name: host(p) for name, p in engine.caches.items()}
    memory.update(caches)
    start = {k: v.copy() for k, v in memory.items()}
    be = engine.backend

    def launch(ln, args) -> None:
        be.launch(ln.handle, ln.grid, ln.block, ln.shared_mem, args, dependent=ln.dependent)

    after = []
    for ln, args in zip(prog.launches, prog.arguments):
        launch(ln, args)
        after.append({k: v.copy() for k, v in memory.items()})
    ranges = [(v.ctypes.data, v.size) for k, v in memory.items() if k not in caches]
    for name, v in caches.items():
        ranges += [(v.ctypes.data + a, b - a) for a, b in _runs(v != start[name])]
    ranges += [(p.ctypes.data, p.size) for p in (host(prog.ptrs[n]) for n in also)]
    assert any(n for _, n in ranges), "the step wrote nothing: nothing was checked"
    for k, v in memory.items():
        v[...] = start[k]
    guarded = 0
    for i, (ln, args) in enumerate(zip(prog.launches, prog.arguments)):
        what = f"{mode} rows={rows}, launch {i} ({ln.kernel.family}, {ln.handle.name})"
        if ln.dependent:
            try:
                with simt.dependent_launch_guard(ranges):
                    launch(ln, args)
            except DeviceFault as e:
                pytest.fail(f"{what} faulted with the step's bytes poisoned until its wait: it "
                            f"touches them before griddepcontrol.wait ({e})")
            guarded += 1
        else:
            launch(ln, args)
        for k, v in memory.items():
            if not np.array_equal(v, after[i][k]):
                first = int(np.flatnonzero(v != after[i][k])[0])
                buffers = [n for n, off in prog.placement.offsets  # its outputs there
                           if k == "activations" and n in ln.kernel.outputs
                           and off <= first < off + prog.specs[n].nbytes]
                pytest.fail(f"{what} wrote other bytes to {k} {buffers or ''} (byte {first}) "
                            "with the step's bytes poisoned until its wait: it reads them "
                            "before griddepcontrol.wait")
    return guarded


def _engine(build_dir, model: str | ModelConfig, quant: str, policy: str = "exact",
            slots: int = 1) -> Engine:
    return Engine.load(model, hardware="sm_90", quant=quant, max_ctx=64, slots=slots,
                       policy=policy, backend=HostBackend(), blocking=True,
                       loader=simt.plan_loader(build_dir, dependent_launch=True))


@pytest.mark.parametrize("model,quant,policy", sampled([("tiny-llama", "bf16", "exact"),
                                                        ("tiny-qwen3", "mxfp4", "exact"),
                                                        ("tiny-qwen3", "bf16", "bounded"),
                                                        ("tiny-qwen3-moe", "fp8", "exact")],
                                                       keep=[2]))
def test_dependent_launches_touch_only_earlier_bytes_before_their_wait(build_dir, model, quant,
                                                                      policy):
    with _engine(build_dir, model, quant, policy, slots=2) as emu:
        for slot in range(2):
            emu.prefill(PROMPT[slot:], slot=slot)
        positions = np.array(emu.lengths[:2], np.int32)
        guarded = check_step(emu, "decode", 2, {"tokens": np.array([11, 12], np.int32),
                                               "positions": positions,
                                               "slots": np.arange(2, dtype=np.int32)})
        assert guarded == len(emu.program("decode", 2).launches)  # every one, on sm_90
        guarded = check_step(emu, "decode", 1, {"tokens": np.array([13], np.int32),
                                               "positions": positions[:1] + 1,
                                               "slots": np.zeros(1, np.int32)})
        assert guarded > 0


# (model, mode, rows, policy) at one decoder layer of the model's own shapes; the first two run
# every time (about 40 s together), the rest with METRALE_DEEP_SHAPES=1 (1-5 minutes each here)
SHAPE_CASES = [("qwen3-0.6b", "decode", 1, "exact"), ("qwen3-0.6b", "decode", 1, "bounded")]
DEEP_SHAPE_CASES = [("llama-3.1-8b", "decode", 1, "exact"), ("qwen3-30b-a3b", "decode", 1, "exact"),
                    ("qwen3-0.6b", "decode", 8, "exact"), ("qwen3-0.6b", "prefill", 40, "exact"),
                    ("llama-3.1-8b", "prefill", 64, "exact")]
DEEP = os.environ.get("METRALE_DEEP_SHAPES") == "1"


@pytest.mark.parametrize("model,mode,rows,policy", SHAPE_CASES + [
    pytest.param(*case, marks=pytest.mark.skipif(not DEEP, reason="METRALE_DEEP_SHAPES=1 runs it"))
    for case in DEEP_SHAPE_CASES])
def test_one_layer_at_model_shapes(build_dir, model, mode, rows, policy):
    """The tiny models' sizes take the same entries, but a path taken only at a real size would
    escape them: one decoder layer at the model's shapes (the vocabulary cut to 512), decode after
    a prompt in each slot, or a prefill (at 64 rows Llama-3.1-8B's GEMMs are sm_90's wgmma)."""
    cfg = ModelConfig.load(model)
    cfg = attrs.evolve(cfg, num_hidden_layers=1, vocab_size=512,
                       layer_types=cfg.layer_types[:1] if cfg.layer_types else cfg.layer_types)
    with _engine(build_dir, cfg, "bf16", policy, slots=rows if mode == "decode" else 1) as emu:
        if mode == "decode":
            for slot in range(rows):
                emu.prefill([5 + slot, 17, 3, 99], slot=slot)
            inputs = {"tokens": np.arange(11, 11 + rows, dtype=np.int32),
                      "positions": np.full(rows, 4, np.int32),
                      "slots": np.arange(rows, dtype=np.int32)}
        else:
            inputs = {"tokens": np.array([(37 * i + 11) % 511 for i in range(rows)], np.int32),
                      "positions": np.arange(rows, dtype=np.int32),
                      "slots": np.zeros(rows, np.int32)}
        guarded = check_step(emu, mode, rows, inputs)
        assert guarded == len(emu.program(mode, rows).launches)


@pytest.mark.parametrize("tokens", [8, 40])  # GEMV-shaped, then the tensor-core GEMM
def test_prefill_launches_touch_only_earlier_bytes_before_their_wait(build_dir, tokens):
    prompt = [(37 * i + 11) % 251 for i in range(tokens)]
    with _engine(build_dir, "tiny-qwen3", "bf16") as emu:
        guarded = check_step(emu, "prefill", tokens,
                             {"tokens": np.array(prompt, np.int32),
                              "positions": np.arange(tokens, dtype=np.int32),
                              "slots": np.zeros(tokens, np.int32)})
        assert guarded > 0


@pytest.mark.parametrize("buffer,shows", [("positions", "faulted"),
                                           ("rope.sin", "wrote other bytes")])
def test_the_check_finds_a_read_before_the_wait(build_dir, buffer, shows):
    """Decode attention reads the rows' positions and its RoPE table rows before its wait, as
    it may (the host writes them before the step). Guarded as if a launch wrote them, each
    read must show at that launch: a poisoned position traps, a poisoned sine changes the
    bytes written."""
    with _engine(build_dir, "tiny-llama", "bf16") as emu:
        emu.prefill(PROMPT)
        with pytest.raises(pytest.fail.Exception, match=rf"launch \d+ \(\w*attention.*{shows}"):
            check_step(emu, "decode", 1, {"tokens": np.array([11], np.int32),
                                          "positions": np.array([len(PROMPT)], np.int32),
                                          "slots": np.zeros(1, np.int32)},
                       also=(buffer,))
