"""benchmarks/bench_gpu_prefill_attention.py's wiring, checked where there is no GPU: the kernel
it times takes every argument from the buffers and numbers the script makes, its row-tile
variants are the launches the table would give at other row tiles, and a baseline kernels folder
brings its own launch rule."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_gpu_prefill_attention as bench  # noqa: E402

from metrale.plan.config import ModelConfig  # noqa: E402
from metrale.realize.hardware import default_kernels_dir  # noqa: E402


class Buffer:
    """A stand-in for a device tensor: only its address."""

    def __init__(self, address: int) -> None:
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def sizes_of(model: str, rows: int) -> dict[str, int]:
    c = ModelConfig.load(model)
    return {"rows": rows, "hq": c.num_attention_heads, "hkv": c.num_key_value_heads,
            "d": c.head_dim, "slots": 1, "max_ctx": rows}


@pytest.mark.parametrize("model", ["qwen3-0.6b", "llama-3.1-8b"])
def test_every_argument_comes_from_the_script(model):
    kernel = bench.realized(None)
    assert kernel.entry == "metrale_kv_append_attention_prefill", kernel
    names = ["k", "v", "q", "k_cache", "v_cache", "positions", "slots", "o"]
    ptrs = {n: Buffer(0x1000 * (i + 1)) for i, n in enumerate(names)}
    sizes = sizes_of(model, 2048)
    args = bench.kernel_args(kernel, ptrs, {**sizes, "scale": 0.125, "window": 0})
    assert len(args) == len(kernel.calls[0][1])
    for arg, value in zip(kernel.calls[0][1], args, strict=True):
        name, _, ty = arg.partition(":")
        expected = {"ptr": np.uint64(ptrs[name].address) if ty == "ptr" else None,
                    "f32": np.float32(0.125), "i32": np.int32(sizes.get(name, 0))}[ty]
        assert value == expected and type(value) is type(expected), (arg, value)


@pytest.mark.parametrize("model,rows", [("qwen3-0.6b", 2048), ("llama-3.1-8b", 2048),
                                        ("qwen3-0.6b", 40)])
def test_row_tile_variants_are_the_launches_of_other_row_tiles(model, rows):
    """Each variant covers the rows with blocks of rt tiles of 16 rows and the group's warps for
    each; the table's own choice, and blocks past 8 warps, are left out."""
    kernel = bench.realized(None)
    sizes = sizes_of(model, rows)
    g = sizes["hq"] // sizes["hkv"]
    own = kernel.launch_for(sizes)
    assert own[1][0] == 32 * g * max(1, 4 // g)  # at least four warps a block
    for rt in (1, 2, 4, 8):
        shape = bench.row_tile_launch(own, sizes, rt)
        if 32 * g * rt == own[1][0] or 32 * g * rt > 256:
            assert shape is None, (rt, shape)
            continue
        (gx, gy, gz), (threads, _, _), shared = shape
        assert (gx, gz, shared) == (own[0][0], own[0][2], own[2])
        assert threads == 32 * g * rt and (gy - 1) * 16 * rt < rows <= gy * 16 * rt


def test_a_baseline_folder_brings_its_own_launch_rule(tmp_path):
    """A kernels folder with another launch rule for the point (here, version 25's one warp a
    q head and no row tiles) realizes with that rule, beside this tree's."""
    base = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), base)
    table = base / "cuda" / "common" / "KERNELS.toml"
    text = table.read_text()
    mine = '"32 * (hq // hkv) * max(1, 4 // (hq // hkv))"'
    assert text.count(mine) == 2
    table.write_text(text.replace(mine, '"32 * (hq // hkv)"').replace(
        '"ceil(rows / (16 * max(1, 4 // (hq // hkv))))"', '"ceil(rows / 16)"'))
    sizes = sizes_of("qwen3-0.6b", 2048)
    theirs, ours = bench.realized(base), bench.realized(None)
    assert theirs.entry == ours.entry
    assert theirs.launch_for(sizes)[:2] == ((8, 128, 1), (64, 1, 1))
    assert ours.launch_for(sizes)[:2] == ((8, 64, 1), (128, 1, 1))
