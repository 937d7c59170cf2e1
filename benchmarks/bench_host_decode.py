"""A Qwen3-0.6B-shaped decode step on the host backend vs the same step in transformers float32
on CPU torch, side by side in one run (goal: the engine within 3x of transformers).

Both run batch 1 with random weights after the same prompt; each timed step returns the
logits (the engine copies them back from its buffers; transformers returns them). The engine
runs at ``--act`` (f32 by default, as transformers does). Medians of ``--repeat`` steps.
Writes ``benchmarks/results/host_decode.json``.

    python benchmarks/bench_host_decode.py [--model qwen3-0.6b] [--repeat 7] [--act f32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cache_keyword, write_result  # noqa: E402

from metrale.plan.models import builtin_config  # noqa: E402
from metrale.runtime.engine import Engine  # noqa: E402

PROMPT = list(range(1, 17))


def _steps(step, token: int, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        token = step(token)
        times.append(time.perf_counter() - t0)
    return times


def engine_times(model: str, act: str, repeat: int, context: int) -> tuple[list[float], dict]:
    with Engine.load(model, act=act, max_ctx=context) as eng:
        token = int(eng.prefill(PROMPT)[-1].argmax())
        eng.decode([token])  # builds and captures the decode program
        times = _steps(lambda t: int(eng.decode([t])[0].argmax()), token, repeat)
        info = {"kernels": eng.plan("decode", 1).kernel_count, **eng.memory()}
    return times, info


def torch_times(model: str, repeat: int) -> tuple[list[float], dict]:
    import torch
    import transformers

    data = builtin_config(model)
    classes = {"qwen3": "Qwen3Config", "llama": "LlamaConfig", "qwen3_moe": "Qwen3MoeConfig"}
    config = getattr(transformers, classes[data["model_type"]])(**data)
    with torch.device("cpu"):
        net = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    kw = cache_keyword(net.forward)
    with torch.inference_mode():
        out = net(torch.tensor([PROMPT]), use_cache=True)
        cache = getattr(out, kw)
        token = int(out.logits[0, -1].argmax())

        def step(t: int) -> int:
            nonlocal cache
            o = net(torch.tensor([[t]]), use_cache=True, **{kw: cache})
            cache = getattr(o, kw)
            return int(o.logits[0, -1].float().numpy().argmax())

        step(token)
        times = _steps(step, token, repeat)
    return times, {"threads": torch.get_num_threads(), "torch": torch.__version__,
                   "transformers": transformers.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--act", choices=("bf16", "f32"), default="f32")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    ours, info = engine_times(args.model, args.act, args.repeat, args.context)
    theirs, tinfo = torch_times(args.model, args.repeat)
    m_ours, m_theirs = statistics.median(ours), statistics.median(theirs)
    ratio = m_ours / m_theirs
    payload = {"model": args.model, "act": args.act, "repeat": args.repeat,
               "engine_step_s": m_ours, "transformers_step_s": m_theirs,
               "ratio": ratio, "goal_ratio": 3.0, "within_goal": ratio <= 3.0,
               "engine_all_s": ours, "transformers_all_s": theirs,
               "numpy": np.__version__, "engine": info, **tinfo}
    path = write_result("host_decode", payload)
    print(f"{args.model} decode step, batch 1: engine (host, act {args.act}) "
          f"{m_ours * 1e3:.1f} ms, transformers f32 CPU {m_theirs * 1e3:.1f} ms: "
          f"{ratio:.2f}x (goal <= 3x) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
