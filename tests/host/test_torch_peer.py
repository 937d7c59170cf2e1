"""The plain-torch decode peer (benchmarks/torch_peer.py) computes what transformers computes.

Token by token through its static cache, the peer's logits match transformers' float32
prefill logits at every position of a prompt, for the dense architectures it covers; so the
torch.compile figure it gives on the GPU is the time of the same model. The GPU benchmark's
peer timings (transformers and this peer, eager and compiled) also run here, on the CPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from metrale.plan.config import ModelConfig
from tests.oracle import load_hf_model, make_hf_checkpoint

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from torch_peer import TorchDecode  # noqa: E402

PROMPT = [3, 17, 99, 200, 5, 64, 1, 250, 7, 31]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_peer_matches_transformers_position_by_position(arch, tmp_path):
    ckpt = make_hf_checkpoint(arch, tmp_path / arch, dtype="float32", seed=3)
    hf = load_hf_model(ckpt)
    with torch.inference_mode():
        want = hf(torch.tensor([PROMPT])).logits[0].numpy()
        peer = TorchDecode(ModelConfig.load(ckpt), dict(hf.state_dict()), batch=2,
                           max_ctx=len(PROMPT) + 3)
        for t, tok in enumerate(PROMPT):  # row 1 feeds another sequence: rows stay apart
            got = peer(torch.tensor([tok, (tok * 7 + 1) % 256]), torch.tensor(t)).numpy()
            scale = float(np.abs(want[t]).max())
            np.testing.assert_allclose(got[0], want[t], rtol=1e-4, atol=1e-4 * scale,
                                       err_msg=f"{arch} position {t}")
    assert not np.allclose(want[0], want[-1])  # the prompt's logits really differ by position


def test_peer_refuses_moe_models():
    from torch_peer import random_state

    c = ModelConfig.load("tiny-qwen3-moe")
    with pytest.raises(ValueError, match="dense llama and qwen3"):
        TorchDecode(c, random_state(ModelConfig.load("tiny-qwen3"), torch.float32), batch=1,
                    max_ctx=4)


def test_the_benchmark_times_both_peers_eager_and_compiled_without_overflowing_the_cache(
        monkeypatch):
    """The GPU benchmark's peer timings, run on the CPU: transformers' static cache advances
    at every timed step, and the compiled run (3 + 5 + 100 steps after 55 eager ones) must stay
    inside it (with 64 positions of room its 65th step indexed past the cache). Compiled by
    TorchDynamo's graph capture alone (``backend="eager"``): the steps are the benchmark's, and
    Inductor's C++ took 30 s of the test's 37 on a 2-core machine."""
    import bench_gpu_decode as bench

    monkeypatch.setattr(bench, "COMPILE", {"backend": "eager"})

    hf: dict = {}
    bench.hf_steps("tiny-qwen3", 2, True, hf, device="cpu")
    peer: dict = {}
    bench.torch_peer_steps("tiny-llama", 1, peer, device="cpu")
    for out, prefix in ((hf, ""), (peer, "peer_")):
        assert {f"{prefix}eager_s", f"{prefix}compiled_s"} <= set(out), out
        assert all(v > 0 for v in out.values())
