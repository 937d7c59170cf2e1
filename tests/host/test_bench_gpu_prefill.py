"""benchmarks/bench_gpu_prefill.py's wiring, checked where there is no GPU: every kernel it
launches takes its arguments from the buffers the script makes, at every shape it runs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_prefill as bench  # noqa: E402


@pytest.mark.parametrize("shape", ["gemm", "gemv"])
@pytest.mark.parametrize("weight", ["bf16", "fp8", "mxfp4", "nvfp4", "f32"])
def test_every_launch_finds_its_buffers_and_a_grid(weight, shape):
    for _model, _name, family, dims in bench.SHAPES:
        if not bench.runs_in(family, weight):
            continue
        kernel = bench.realized(family, weight, shape)
        assert any(e.endswith(("_mma", "_wgmma", "_tma")) for e in kernel.entries) == (
            shape == "gemm"), kernel
        if shape == "gemm":  # sm_90's own GEMM (wgmma), timed beside the gemm.cu one it shadows
            own = "gemm_wgmma.cu" if weight == "f32" else "gemm_tma.cu"
            assert kernel.source == f"sm_90/common/{own}", kernel
            shadowed = bench.shadowed(family, weight)
            assert shadowed.entry.endswith("_mma") and shadowed.source == "cuda/common/gemm.cu"
            assert bench.gemm_cu(family, weight) == shadowed
        buffers = {"x", "r", *bench.OUT_PORTS[family]}
        for port in bench.WEIGHT_PORTS[family]:
            buffers |= {port, f"{port}_scale", f"{port}_global"}
        tensors = {t.name for t in kernel.scratch}  # in the workspace the launcher makes
        for rows in (8, 64, 2048):
            sizes = {"rows": rows, **dims}
            env = kernel.sizes(sizes)  # the sizes and the table's values (a workspace's bytes)
            chain = bench.launch_chain(kernel, sizes, lambda k=kernel, s=sizes: k.launch_for(s))
            # the kernel's own entry launches on its variant's tile only where it is launched:
            # past one row a GEMV's first launch is its multi-row entry (the script raised there)
            # (bf16's own gemm entry, gemm_tma.cu's, launches past 64 rows: up to 64 its first
            # launch is gemm_wgmma.cu's one-warpgroup block, a `then` of the table; fp8's and
            # fp4's, the weight made bf16, past a few hundred)
            made = rows == 1 if shape == "gemv" else (
                rows > 64 if weight == "bf16" else rows > 512 or weight == "f32")
            assert [own for *_, own in chain] == [
                i == 0 and made for i in range(len(chain))], chain
            for entry, args, (grid, block, shared), _own in chain:
                for arg in args:
                    name, _, ty = arg.partition(":")
                    ported = ty == "ptr" or ty.startswith("tmap(")  # a buffer, or its tensor map
                    assert (name in buffers | tensors) if ported else (
                        name in env or name in tensors), (entry, arg)
                assert min(grid) >= 1 and block[0] % 32 == 0 and shared >= 0
        assert len(bench.widths(family, dims)) == len(bench.WEIGHT_PORTS[family])


@pytest.mark.parametrize("rows", [128, 512, 2048])
def test_the_chain_points_find_their_buffers_and_a_grid(rows):
    """--k-blocks 16: gemm_chain.cu's one launch takes its arguments from the script's buffers
    (tensor maps of x and the weights; `wide` from the table's values), at most a block an SM."""
    for _model, _name, family, dims in bench.SHAPES:
        if not bench.runs_in(family, "bf16"):
            continue
        kernel = bench.realized(family, "bf16", "gemm", k_block=16)
        assert kernel.source == "sm_90/common/gemm_chain.cu", kernel
        buffers = {"x", "r", *bench.OUT_PORTS[family], *bench.WEIGHT_PORTS[family]}
        sizes = {"rows": rows, **dims}
        env = kernel.sizes(sizes)
        ((entry, args, (grid, block, _), own),) = bench.launch_chain(
            kernel, sizes, lambda k=kernel, s=sizes: k.launch_for(s))
        assert own and block == (384, 1, 1) and 1 <= grid[0] <= kernel.multiprocessors, grid
        for arg in args:
            name, _, ty = arg.partition(":")
            ported = ty == "ptr" or ty.startswith("tmap(")
            assert name in buffers if ported else name in env, (entry, arg)


def test_prefill_flops_count_the_matmuls_attention_and_logits():
    from metrale.plan.config import ModelConfig

    c = ModelConfig.load("llama-3.1-8b")
    one = bench.prefill_flops(c, 1)
    # one token: twice the matmul weights (7.0e9 in the layers, 0.5e9 in lm_head), plus its
    # own position in every head of every layer
    assert 2 * 7.4e9 < one < 2 * 7.6e9
    # the attention term grows with the square of the prompt
    attention = lambda r: bench.prefill_flops(c, r) - r * (one - 4 * c.num_hidden_layers *  # noqa: E731
                                                             c.num_attention_heads * c.head_dim)
    assert attention(2048) == pytest.approx(4 * 2048 * 2049 / 2 * 32 * 32 * 128, rel=1e-9)


def test_time_prefill_runs_the_prompt_into_the_cache():
    from metrale.runtime.bench import time_prefill
    from metrale.runtime.engine import Engine

    with Engine.load("tiny-llama", max_ctx=64) as eng:
        t = time_prefill(eng, 40, steps=2, warmup=1)
        assert t.step_s > 0 and t.rows == 40 and t.launches == eng.plan("prefill", 40).kernel_count
        assert np.isfinite(eng.prefill_program(40).read("logits")).all()
        last = time_prefill(eng, 40, steps=2, warmup=1, logits="last")
        assert last.launches == t.launches + 1  # last_row; the norm stays unfused from the add


@pytest.mark.parametrize("policy", ["exact", "bounded"])
@pytest.mark.parametrize("logits", ["all", "last"])
def test_the_matmul_launches_are_the_prefill_plans_own(logits, policy):
    """The bench times the gemm kernels the sm_90 prefill plans launch (o_proj and down_proj
    plain, their residual going to add_rmsnorm, except the last layer's down_proj where only the
    last row's logits are kept; the head in bf16; linear on f32 weights, after dequant, in the
    exact policy's fp8 and nvfp4 prefill; in bf16 and mxfp4 under the bounded policy, the points
    of the chain_* relations), so its evidence lands on the plans' points."""
    from metrale.plan.plan import plan_for

    for model in ("qwen3-0.6b", "llama-3.1-8b"):
        for quant in ("bf16", "fp8", "mxfp4", "nvfp4"):
            plan = plan_for(model, quant, "sm_90", mode="prefill", rows=512, logits=logits,
                            policy=policy)
            launched = {str(k.point) for k in plan.launches if "shape=gemm" in str(k.point)}
            timed = {str(bench.realized(family, w, "gemm", k_block=kb).point)
                     for _m, _n, family, _d in bench.SHAPES
                     for w in (quant, "bf16", "f32") if bench.runs_in(family, w)
                     for kb in ((256, 16) if bench.chain_kernel(family, w) else (256,))}
            assert launched <= timed, (model, quant, launched - timed)


@pytest.mark.parametrize("weight", ["bf16", "f32", "mxfp4"])
def test_variant_tiles_follow_the_source_defaults(weight):
    """A variant with no defines launches exactly as KERNELS.toml launches the source's own
    choice (tile_shape mirrors gemm.cu's defaults), and a 128-row tile halves the row blocks."""
    families = ["linear"] if weight == "f32" else ["linear", "qkv", "gate_up_swiglu"]
    sizes = {"rows": 1000, "k": 4096, "n": 14336, "nq": 4096, "nk": 1024, "nv": 1024}
    for family in families:
        kernel = bench.gemm_cu(family, weight)
        v = bench.Variant.__new__(bench.Variant)
        v.family, v.tile = family, bench.tile_shape("", weight)
        assert v.launch_shape(sizes) == kernel.launch_for(sizes), family
        v.tile = bench.tile_shape("MI=4", weight)
        assert v.launch_shape(sizes)[0][0] == -(-1000 // 128)


@pytest.mark.parametrize("rows", [1000, 64])
@pytest.mark.parametrize("weight", ["fp8", "mxfp4", "nvfp4", "f32"])  # gemm_wgmma.cu's own
def test_wgmma_variants_launch_as_the_table_with_their_stages_shared_memory(weight, rows):
    """A wgmma variant launches on KERNELS.toml's grid and block, with the shared memory its
    stages take (STAGES for blocks of two warpgroups, SMALL_STAGES for one); with no defines,
    exactly as KERNELS.toml launches the source's own choice."""
    family = "linear" if weight == "f32" else "gate_up_swiglu"
    sizes = {"rows": rows, "k": 4096, "n": 14336}
    kernel = bench.wgmma_kernel(bench.realized(family, weight))
    want = kernel.launch_for(sizes)
    assert kernel.entry.endswith("_wgmma") and not kernel.scratch, kernel
    warpgroups = want[1][0] // 128
    assert warpgroups == (1 if rows <= 64 and weight != "f32" else 2)
    for defines in ("", "STAGES=2", "STAGES=5", "SMALL_STAGES=6", "RAW_SMALL=0"):
        v = bench.WgmmaVariant.__new__(bench.WgmmaVariant)
        v.kernel, v.weight, v.defines = kernel, weight, defines
        grid, block, shared = v.launch_shape(sizes)
        assert (grid, block) == want[:2]
        d = bench.parse_defines(defines)
        stages = int(d.get("STAGES", 3 if weight == "f32" else 4) if warpgroups == 2 else
                     d.get("SMALL_STAGES", 4))
        planes = 3 if weight == "f32" else 1
        raw = {"fp8": 64, "nvfp4": 64, "mxfp4": 32, "bf16": 32, "f32": 0}[weight] * 128
        slots = (stages - 2) * raw
        assert shared == stages * (8192 * warpgroups + 16384 * planes) + 1024 + slots
        if not defines:
            assert shared == want[2]


def test_a_built_kernel_launches_its_then_launches_on_one_workspace(monkeypatch):
    """Where the table splits k (up to 64 rows, few column tiles), Built's launcher makes the
    split launch and the combine launch, both handed the same workspace of the table's bytes and
    the table's split count."""
    kernel = bench.realized("linear", "bf16")
    sizes = {"rows": 16, "k": 14336, "n": 4096}
    env = kernel.sizes(sizes)
    assert env["splits"] > 1 and env["ws"] == env["nkb"] * env["tiles"] * 16 * 512
    calls = []

    class Fn:
        def __init__(self, name):
            self.name, self.max_dynamic_shared_size_bytes = name, 0

        def __call__(self, grid, block, args, shared_mem):
            calls.append((self.name, grid, block, args, shared_mem))

    class Module:
        def get_function(self, name):
            return Fn(name)

    class Zeros:
        def __init__(self, n, dtype, at=0):
            self.nbytes, self.at = n, at

        def __getitem__(self, s):  # a slice of the workspace: its start and bytes
            return Zeros(s.stop - s.start, None, s.start)

        def __eq__(self, other):
            return (self.at, self.nbytes) == (other.at, other.nbytes)

    b = bench.Built.__new__(bench.Built)
    b.kernel, b.module, b.fn = kernel, Module(), Fn(kernel.entry)
    monkeypatch.setitem(sys.modules, "cupy", type("cp", (), {"zeros": Zeros, "uint8": "uint8"}))
    b.launcher(sizes, {"x": 1, "w": 2, "y": 3})()
    assert [c[0] for c in calls] == ["metrale_linear_wgmma", "metrale_linear_wgmma_combine"]
    (_, grid, block, args, _), (_, cgrid, _, cargs, _) = calls
    assert grid == (1, env["tiles"], env["splits"]) and block == (128, 1, 1)
    work = [a for a in args if isinstance(a, Zeros)]
    assert len(work) == 1 and work[0].nbytes == env["ws"]
    assert [a for a in cargs if isinstance(a, Zeros)] == work
    assert int(args[-1]) == int(cargs[-1]) == env["splits"]
    assert cgrid == (env["tiles"], 4, 1)


def test_kernel_times_cover_every_kernel_of_a_prefill():
    from metrale.runtime.bench import kernel_times
    from metrale.runtime.engine import Engine

    with Engine.load("tiny-llama", max_ctx=64) as eng:
        ks = kernel_times(eng, 40, mode="prefill", repeats=2)
        plan = eng.plan("prefill", 40)
        assert {k.point for k in ks} == {str(k.point) for k in plan.launches}
        assert sum(k.count for k in ks) == plan.kernel_count
        assert all(k.seconds > 0 for k in ks)


def test_kernel_times_of_the_last_row_plan_include_its_own_kernels(capsys):
    """The plan that keeps the last row's logits launches kernels the full one does not
    (last_row); timed, and passed over where the full plan's timing has them already."""
    from metrale.runtime.bench import kernel_times
    from metrale.runtime.engine import Engine

    with Engine.load("tiny-llama", max_ctx=64) as eng:
        ks = kernel_times(eng, 40, mode="prefill", repeats=2, logits="last")
        plan = eng.plan("prefill", 40, logits="last")
        assert {k.point for k in ks} == {str(k.point) for k in plan.launches}
        full = {str(k.point) for k in eng.plan("prefill", 40).launches}
        own = bench.step_kernels(eng, eng.config, 40, 1.0, None, logits="last",
                                 skip=frozenset(full))
    assert own and {k["point"] for k in own} == {k.point for k in ks} - full
    assert any(k["point"].startswith("last_row[") for k in own)


def test_step_kernels_give_attention_its_throughput(capsys):
    from metrale.runtime.engine import Engine

    with Engine.load("tiny-llama", max_ctx=64) as eng:
        kernels = bench.step_kernels(eng, eng.config, 40, 1.0, None)
    attention = [k for k in kernels if "attention" in k["point"]]
    assert attention and all(k["tflops"] > 0 for k in attention)
    assert all("tflops" not in k for k in kernels if "attention" not in k["point"])
    assert "sum of kernel medians" in capsys.readouterr().out


@pytest.mark.parametrize("name,ok", [("gpu_prefill_late_v30", True), ("gpu-prefill.v2", True),
                                     ("../gpu_prefill", False), (".hidden", False),
                                     ("a/b", False), ("", False)])
def test_a_results_name_stays_a_file_in_the_results_folder(name, ok):
    """--name NAME writes benchmarks/results/NAME.json: a name that would leave the folder, or
    hide the file, is refused by the parser before anything runs."""
    import argparse

    from _common import result_name

    if ok:
        assert result_name(name) == name
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="results name"):
            result_name(name)


def test_a_step_planned_over_an_edited_source_names_its_unmeasured_points(tmp_path):
    """After a kernel source changes, its records no longer count and the planner prices its
    points by the model alone, which chose other GEMMs for Llama-3.1-8B's bounded prefill than
    the recorded chain: the benchmark's steps say which points were unmeasured."""
    import shutil

    from stale_evidence import unmeasured_kernels

    from metrale.plan.plan import plan_for
    from metrale.realize.hardware import default_kernels_dir

    def points(kernels_dir):
        plan = plan_for("qwen3-0.6b", "bf16", "sm_90", mode="prefill", rows=512,
                        policy="bounded", kernels_dir=kernels_dir)
        return sorted(str(k.point) for k in unmeasured_kernels(plan))

    assert points(None) == []
    edited = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), edited)
    chain = edited / "sm_90" / "common" / "gemm_chain.cu"
    chain.write_text(chain.read_text() + "// edited\n")
    left = points(edited)
    assert left and all("k_block=16" in p for p in left if "gemm" in p), left
    assert not any("attention" in p for p in left), left


def test_the_chain_cases_are_the_chain_tables_own():
    """The bench times the k chain in the formats its tables take, from the rows their limits
    take (read from KERNELS.toml, not kept beside it)."""
    assert bench.chain_kernel("linear", "fp8") is None
    for fmt, least in (("bf16", 128), ("mxfp4", 256)):
        kernel = bench.chain_kernel("qkv", fmt)
        sizes = {"k": 1024, "nq": 2048, "nk": 1024, "nv": 1024}
        assert not bench.takes(kernel, {"rows": least - 1, **sizes})
        assert bench.takes(kernel, {"rows": least, **sizes})
