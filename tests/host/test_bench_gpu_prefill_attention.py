"""benchmarks/bench_gpu_prefill_attention.py's wiring, checked where there is no GPU: the kernel
it times takes every argument from the buffers and numbers the script makes, its block-size
variants are the launches of other warpgroups a block, and a baseline kernels folder brings its
own launch rule."""

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
    assert kernel.entry == "metrale_kv_append_wgmma_attention_prefill", kernel
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


@pytest.mark.parametrize("family", [bench.FAMILY, bench.ONLINE])
@pytest.mark.parametrize("model,rows", [("qwen3-0.6b", 2048), ("llama-3.1-8b", 2048),
                                        ("qwen3-0.6b", 40)])
def test_warpgroup_variants_are_the_launches_of_other_block_sizes(model, rows, family):
    """Each variant takes the group's heads wgs at a time, a computing warpgroup each, over the
    same rows and slices, beside the table's warpgroup that only copies (the producer); the
    table's own choice (two), and more than the group's heads or two, are left out."""
    copiers = 1
    kernel = bench.realized(None, family)
    sizes = sizes_of(model, rows)
    g = sizes["hq"] // sizes["hkv"]
    own = kernel.launch_for(sizes)
    persistent = "online" in kernel.entry  # its blocks take (head group, row block) items
    items = sizes["hkv"] * -(-g // 2) * -(-rows // 64)
    assert own[1][0] == 128 * (2 + copiers)
    assert own[0][:2] == ((min(kernel.multiprocessors, items), 1) if persistent
                          else (sizes["hkv"] * -(-g // 2), -(-rows // 64)))
    sms = kernel.multiprocessors
    assert bench.warpgroup_launch(own, sizes, 2, persistent, sms) is None
    assert bench.warpgroup_launch(own, sizes, 3, persistent, sms) is None
    (gx, gy, gz), (threads, _, _), shared = bench.warpgroup_launch(own, sizes, 1, persistent,
                                                                   sms)
    assert (gz, shared) == (own[0][2], own[2]) == (1, own[2])
    assert threads == 128 * (1 + copiers)
    assert (gx, gy) == ((min(sms, sizes["hkv"] * g * -(-rows // 64)), 1) if persistent
                        else (sizes["hkv"] * g, -(-rows // 64)))


def test_a_baseline_folder_brings_its_own_launch_rule(tmp_path):
    """A kernels folder with another launch rule for the point (here, one computing warpgroup a
    block, beside the producer) realizes with that rule, beside this tree's."""
    base = tmp_path / "kernels"
    shutil.copytree(default_kernels_dir(), base)
    table = base / "sm_90" / "common" / "KERNELS.toml"
    text = table.read_text()
    mine = 'wgs = "min(min(2, hq // hkv), 1 + max(0, 256 - d) // 128)"'
    assert text.count(mine) == 2
    table.write_text(text.replace(mine, 'wgs = "1"'))
    sizes = sizes_of("qwen3-0.6b", 2048)
    theirs, ours = bench.realized(base), bench.realized(None)
    assert theirs.entry == ours.entry
    assert theirs.launch_for(sizes)[:2] == ((16, 32, 1), (256, 1, 1))
    assert ours.launch_for(sizes)[:2] == ((8, 32, 1), (384, 1, 1))
