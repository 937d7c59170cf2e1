"""The benchmarked plans' kernels that carry no current evidence record on a class: the record
run that a kernel source change calls for, planned before the device is lent.

A record counts only for the source hash it was measured on, so editing a kernel, or a header
it includes, leaves its points unmeasured until a record run measures them again
(``tests/mock/test_evidence.py`` fails until then). This lists those points, each under the
first plan that launches it: model, policy, weight format, then decode at 1 and 8 rows and
prefill of 512 tokens (every row's logits, then the last row's), the plans that test walks;
and gpt-oss-20b's decode in its published format, mxfp4 (PARTLY: no record run has timed its
prefill or its other formats yet).
Which benchmark records which point:
- decode kernels: ``bench_gpu_decode.py MODEL --batches 1 --quants Q --policies P --no-hf
  --kernels --record``;
- prefill GEMM points (``shape=gemm``): ``bench_gpu_prefill.py --models M --rows 2048 --weights
  W --steps "" --record`` (its SHAPES name each family's shapes per model);
- the prefill steps' other kernels: ``bench_gpu_prefill.py --models M --rows "" --steps 512
  --step-quants Q --policies P --no-hf --record``.

    python3 benchmarks/stale_evidence.py [--hardware sm_90] [--models ...] [--quants ...]

Records go to the evidence store; ``met evidence export --hardware sm_90 --out
kernels/sm_90/EVIDENCE.toml`` ships them. Prints; writes nothing.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from typing import Any

MODELS = ("qwen3-0.6b", "llama-3.1-8b", "qwen3-30b-a3b")
QUANTS = ("bf16", "fp8", "mxfp4", "nvfp4")
POLICIES = ("exact", "bounded")
STEPS = (("decode", 1, "all"), ("decode", 8, "all"), ("prefill", 512, "all"),
         ("prefill", 512, "last"))
DECODE = STEPS[:2]
PARTLY = (("gpt-oss-20b", ("mxfp4",), DECODE),)
"""Models benchmarked in part, each with the formats and steps whose records are held current."""


def awaiting_device(hw: str = "sm_90") -> dict[str, str]:
    """``{source: reason}``: the sources ``kernels/<hw>/AWAITING_DEVICE.toml`` lists as changed
    since their records, awaiting the next device run on the class."""
    import tomllib

    from metrale.realize.hardware import default_kernels_dir

    path = default_kernels_dir() / hw / "AWAITING_DEVICE.toml"
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        return {s["path"]: s["reason"] for s in tomllib.load(f).get("source", [])}


def unmeasured_kernels(plan: Any, hw: str = "sm_90") -> list:
    """The kernels of ``plan`` (each point once, in plan order) with no record of their current
    source on ``hw``: the planner priced them by its model alone, so after a source edit it may
    choose other points than it will once they are recorded."""
    seen: set[str] = set()
    out = []
    for k in plan.kernels:
        if k.kernel is None or k.evidence == f"measured on {hw}" or str(k.point) in seen:
            continue
        seen.add(str(k.point))
        out.append(k)
    return out


def stale_kernels(hw: str = "sm_90", models: Iterable[str] = MODELS,
                  quants: Iterable[str] = QUANTS, policies: Iterable[str] = POLICIES,
                  awaiting: Iterable[str] = (), steps: Iterable[tuple[str, int, str]] = STEPS
                  ) -> Iterator[tuple[str, str]]:
    """``(plan, point)``, lazily: each kernel of the plans whose evidence on ``hw`` is not a
    record of its current source, once, under the first plan (``"MODEL POLICY QUANT MODE ROWS
    LOGITS"``) that launches it; kernels whose source is one of ``awaiting`` (sources listed
    as awaiting a device run) left out; ``steps``: the (mode, rows, logits) planned. A caller
    asking only whether there is one stops planning at the first."""
    awaiting = frozenset(awaiting)
    from metrale.plan.plan import plan_for

    steps = tuple(steps)
    seen: set[str] = set()
    for model in models:
        for policy in policies:
            for quant in quants:
                for mode, rows, logits in steps:
                    plan = plan_for(model, quant, hw, mode=mode, rows=rows, policy=policy,
                                    logits=logits)
                    for k in unmeasured_kernels(plan, hw):
                        point = str(k.point)
                        if point in seen or k.kernel.source in awaiting:
                            continue
                        seen.add(point)
                        yield f"{model} {policy} {quant} {mode} {rows} {logits}", point


def unmeasured(hw: str = "sm_90", models: Iterable[str] = MODELS,
               quants: Iterable[str] = QUANTS, policies: Iterable[str] = POLICIES,
               awaiting: Iterable[str] = (), steps: Iterable[tuple[str, int, str]] = STEPS
               ) -> dict[str, list[str]]:
    """``{plan: [point, ...]}``: stale_kernels' pairs grouped by plan; plans with none left
    out."""
    out: dict[str, list[str]] = {}
    for plan, point in stale_kernels(hw, models, quants, policies, awaiting, steps):
        out.setdefault(plan, []).append(point)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="sm_90")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quants", default=",".join(QUANTS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    args = ap.parse_args()
    found = unmeasured(args.hardware, args.models.split(","), args.quants.split(","),
                       args.policies.split(","))
    if args.models == ",".join(MODELS):  # the default run: the partly benchmarked models too
        for model, quants, steps in PARTLY:
            found.update(unmeasured(args.hardware, [model], quants, args.policies.split(","),
                                    steps=steps))
    for plan, points in found.items():
        print(f"{plan}: {len(points)}")
        for p in points:
            print(f"    {p}")
    print(f"{sum(map(len, found.values()))} kernels without a current record on {args.hardware}")


if __name__ == "__main__":
    main()
