"""Planning time: Llama-3.1-70B decode, and its growth with layer count (8 → 80 layers).

Run: ``python benchmarks/bench_plan.py``. Goal: 70B decode planned in under 0.5 s on a
2-core machine, time linear in layers. For scale, torch.compile took 27 s to warm up an 8B
model on an H200 (measured here earlier).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_time, write_result  # noqa: E402

from metrale.lkb.presentation import Presentation  # noqa: E402
from metrale.plan.config import ModelConfig  # noqa: E402
from metrale.plan.plan import plan_for  # noqa: E402


def main() -> None:
    P = Presentation.load()
    base = ModelConfig.load("llama-3.1-70b")
    plan_for(base.with_layers(2), "bf16", "sm_90", presentation=P)  # warm imports and caches
    rows = []
    for layers in (8, 16, 32, 64, 80):
        cfg = base.with_layers(layers)
        t = median_time(lambda cfg=cfg: plan_for(cfg, "bf16", "sm_90", presentation=P), 5)
        rows.append({"layers": layers, "plan_s": t})
    cold = median_time(lambda: plan_for("llama-3.1-70b", "bf16", "sm_90"), 3)
    per_layer = [r["plan_s"] / r["layers"] for r in rows]
    print(f"{'layers':>7} {'plan ms':>9} {'ms/layer':>9}")
    for r, pl in zip(rows, per_layer):
        print(f"{r['layers']:>7} {r['plan_s'] * 1e3:>9.1f} {pl * 1e3:>9.2f}")
    print(f"llama-3.1-70b decode, presentation loaded too: {cold * 1e3:.0f} ms (goal < 500 ms)")
    growth = rows[-1]["plan_s"] / rows[0]["plan_s"]
    print(f"growth 8 → 80 layers (10x): {growth:.1f}x")
    path = write_result("plan", {"rows": rows, "llama_70b_decode_s": cold,
                                 "growth_8_to_80": growth, "goal_s": 0.5, "met": cold < 0.5})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
