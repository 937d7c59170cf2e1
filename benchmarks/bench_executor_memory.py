"""The executor's memory for a Qwen3-0.6B decode step vs weights + KV cache + the largest live
activation set (goal: within 1.2x).

The engine holds the weights in the host's representation (f32: the host semantics take f32
weights), a KV cache of ``--context`` positions for one sequence, the RoPE tables, the step
inputs and the decode program's activation arena (placed by liveness). The reference is the
weights and KV cache in that same representation plus the plan's largest set of activations
live at one kernel; the naive arena (one allocation per activation) is printed beside it.
Writes ``benchmarks/results/executor_memory.json``.

    python benchmarks/bench_executor_memory.py [--model qwen3-0.6b] [--context 1024]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402

from metrale.runtime.engine import Engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--act", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--context", type=int, default=1024)
    args = ap.parse_args(argv)
    with Engine.load(args.model, act=args.act, max_ctx=args.context) as eng:
        eng.decode([1])  # only the decode program exists: its step is what is measured
        prog = eng.program("decode", 1)
        peak = eng.backend.live_bytes()
        plan = eng.plan("decode", 1)
        live_set = plan.peak_bytes()
        reference = eng.weight_bytes + eng.kv_bytes + live_set
        plan_weights = sum(b.nbytes for b in plan.buffers if b.kind == "weight")
        payload = {
            "model": args.model, "act": args.act, "context": args.context,
            "executor_peak_bytes": peak, "weights_bytes": eng.weight_bytes,
            "weights_bytes_as_stored": plan_weights, "kv_cache_bytes": eng.kv_bytes,
            "largest_live_activation_set_bytes": live_set, "arena_bytes": prog.peak_bytes,
            "naive_activation_bytes": prog.naive_bytes, "reference_bytes": reference,
            "ratio": peak / reference, "goal_ratio": 1.2, "within_goal": peak / reference <= 1.2,
        }
    path = write_result("executor_memory", payload)
    print(f"{args.model} decode step (act {args.act}, context {args.context}): executor peak "
          f"{peak / 2**20:.1f} MiB vs weights {eng.weight_bytes / 2**20:.1f} + KV "
          f"{eng.kv_bytes / 2**20:.1f} + live activations {live_set / 2**10:.1f} KiB = "
          f"{reference / 2**20:.1f} MiB: {peak / reference:.4f}x (goal <= 1.2x); arena "
          f"{prog.peak_bytes / 2**10:.1f} KiB vs naive {prog.naive_bytes / 2**10:.1f} KiB "
          f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
