"""``met tune`` and ``met plan --costs``: measure the alternatives, record, re-plan.

``tune(...)`` runs, for each rows value: the plan the planner chooses now (its predicted step
time, and the step timed where it runs); then every alternative the search enumerated
(``plan.search.alternatives``: each matmul point, each site's alternatives), each kernel of
them timed alone at the plan's sizes (``runtime.bench.kernel_times``), once: at the first
alternative that launches it (by point, source and shape); the times are recorded
as evidence of the class in the evidence store (``plan.cost.time_records``, ``record_times``:
``time@<shape>`` in microseconds, with the source hash of what ran; never into the installed
kernels); then the plan is made again, now priced by
what was measured, and its step timed. Timing is real wherever it runs: on the host, the
reference semantics through NumPy.

>>> import contextlib, io
>>> from metrale.cli import main
>>> out = io.StringIO()
>>> with contextlib.redirect_stdout(out):
...     status = main(["plan", "tiny-llama", "--costs", "--hardware", "host"])
>>> status, "predicted step:" in out.getvalue()
(0, True)
"""

from __future__ import annotations

import argparse
import datetime
import json
from collections.abc import Sequence
from typing import Any

import attrs

from metrale.cli import command, extend_command
from metrale.commands import default_context, random_arg  # and met plan, which --costs extends
from metrale.terminal import int_at_least

SLOWER_MARGIN = 0.02
"""A tuned plan measured more than this much slower than the plan before is reported."""
PRUNE = 3.0
"""An alternative predicted at more than this many times the plan's step is not timed: it
cannot win by any error of the model seen (a prefill's GEMV-shaped alternative at 2,048 rows,
its weights read once a tile of 8 rows, is predicted at tens of times the GEMM plan), and its
records would only stand at shapes no plan chooses them for."""


@attrs.frozen
class TuneRow:
    """One rows value tuned: predicted and measured step seconds before and after, the
    kernels timed and the records written."""

    rows: int
    bucket: int
    predicted_before_us: float
    measured_before_us: float
    predicted_after_us: float
    measured_after_us: float
    alternatives: int
    kernels_timed: int
    recorded: int
    changed: bool
    """Whether the plan after differs from the plan before (other kernels)."""
    pruned: int = 0
    """Alternatives not timed: predicted at more than ``PRUNE`` times the plan before."""
    kernels_out: tuple[str, ...] = ()
    """The kernels (``family (entry)``) the plan before launched and the tuned plan does not."""
    kernels_in: tuple[str, ...] = ()
    """The kernels the tuned plan launches and the plan before did not."""

    @property
    def slower(self) -> bool:
        """Whether the tuned plan, other than the plan before, measured more than
        ``SLOWER_MARGIN`` slower than it: its kernels' times alone mislead in the step."""
        return self.changed and self.measured_after_us > self.measured_before_us * (
            1 + SLOWER_MARGIN)

    @property
    def error_after(self) -> float:
        """The tuned plan's predicted step against its measured one: (predicted - measured) /
        measured."""
        return (self.predicted_after_us - self.measured_after_us) / self.measured_after_us


def tune(model: str, hardware: str, *, quant: str = "bf16", rows: Sequence[int] = (1,),
         mode: str = "decode", context: int = 1024, policy: str = "exact",
         kernels: str | None = None, steps: int = 20, repeats: int = 20,
         record: bool = True, random: str = "pooled") -> list[TuneRow]:
    """Time every alternative's kernels at the plan's shapes for each ``rows``, record them
    (``record=False``: time only), re-plan and time the step before and after. ``random``: how
    a built-in model's weights are drawn (``runtime.engine.RANDOM_WEIGHTS``)."""
    from metrale.plan.config import ModelConfig
    from metrale.plan.cost import record_times, shape_of, time_records
    from metrale.plan.plan import plan_for
    from metrale.plan.search import alternatives
    from metrale.realize.target import target
    from metrale.runtime.bench import kernel_times, time_decode, time_prefill
    from metrale.runtime.engine import Engine

    config = ModelConfig.load(model)
    out = []
    for r in rows:
        T = target(hardware, kernels_dir=kernels, policy=policy)
        ctx = context if mode == "decode" else max(context, r)

        with Engine.load(config, hardware=hardware, quant=quant, policy=policy,
                         max_ctx=ctx + (1 if mode == "decode" else 0),
                         slots=r if mode == "decode" else 1, random=random) as eng:
            device = eng.backend.limits.name

            def make(choice: Any = None, r: int = r, ctx: int = ctx, device: str = device
                     ) -> Any:
                # costed for the device the steps run on: its records count first
                return plan_for(config, quant, hardware, mode=mode, rows=r, policy=policy,
                                context=ctx + (1 if mode == "decode" else 0),
                                kernels_dir=kernels, choice=choice, device=device)

            before = make()
            eng.use_plan(before)
            step_before = _step(eng, mode, r, steps, time_decode, time_prefill)
            timed: dict[tuple, tuple[Any, dict, float]] = {}
            alts = alternatives(before.choice)
            pruned = 0
            for choice in alts:
                p = make(choice)
                if p.predicted_us > PRUNE * before.predicted_us:
                    pruned += 1
                    continue
                # the kernels no earlier alternative timed (each is timed once: by point,
                # source and shape), by index
                fresh: dict[int, tuple[tuple, dict, Any]] = {}
                for k in p.launches:
                    if k.kernel is None:
                        continue
                    shape = shape_of(p.hw_target.presentation.family(k.family), k.box,
                                     dict(p.sizes))
                    key = (str(k.point), k.kernel.source_hash, tuple(sorted(shape.items())))
                    if key not in timed:
                        fresh[k.index] = (key, shape, k.kernel)
                if not fresh:
                    continue  # nothing new to time: no program to build
                eng.use_plan(p)
                for t in kernel_times(eng, r, mode=mode, repeats=repeats,
                                      skip=lambda k, fresh=fresh: k.index not in fresh):
                    key, shape, kernel = fresh[int(t.label[1:].split()[0])]
                    timed.setdefault(key, (kernel, shape, t.seconds * 1e6))
            records = time_records(timed.values(), T.hw, device, _toolchain(T.hw),
                                   datetime.date.today().isoformat())
            if record and records:
                record_times(records)
            after = make()
            eng.use_plan(after)
            step_after = _step(eng, mode, r, steps, time_decode, time_prefill)
        gone, came = kernel_changes(before, after)
        out.append(TuneRow(r, before.bucket, before.predicted_us, step_before * 1e6,
                           after.predicted_us, step_after * 1e6, len(alts), len(timed),
                           len(records) if record else 0, after != before, pruned, gone, came))
    return out


def kernel_changes(before: Any, after: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What tuning changed in a plan: the kernels (``family (entry)``, each once however many
    layers launch it) that ``before`` launches and ``after`` does not, and the reverse.

    >>> from metrale.plan.plan import plan_for
    >>> exact, bounded = (plan_for("llama-3.1-8b", "bf16", "sm_90", policy=p)
    ...                   for p in ("exact", "bounded"))
    >>> kernel_changes(exact, bounded)
    (('qkv (metrale_qkv)',), ('qkv (metrale_qkv_gemv_mma)',))
    """
    def kernels(p: Any) -> set[str]:
        return {f"{k.family} ({k.kernel.entry})" if k.kernel is not None and k.kernel.entry
                else k.family for k in p.launches}

    b, a = kernels(before), kernels(after)
    return tuple(sorted(b - a)), tuple(sorted(a - b))


def _step(eng: Any, mode: str, rows: int, steps: int, time_decode: Any, time_prefill: Any
          ) -> float:
    if mode == "decode":
        return time_decode(eng, rows, steps=steps, warmup=2).step_s
    return time_prefill(eng, rows, steps=max(1, steps // 10), warmup=1).step_s


def _toolchain(hw: Any) -> str:
    from metrale.commands import _toolchain as toolchain

    return toolchain(hw)


def _tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name or a config.json")
    p.add_argument("--hardware", default="host", help="the class to tune (e.g. sm_90)")
    p.add_argument("--quant", default="bf16", help="bf16, fp8, mxfp4 or nvfp4")
    p.add_argument("--rows", type=int, nargs="+", default=[1],
                   help="decode: rows (sequences) per step; prefill: the prompt's tokens")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    p.add_argument("--context", type=int_at_least(1), default=None,
                   help="cached positions per row (default: 1024, or one less than the model's "
                        "max_position_embeddings if smaller)")
    p.add_argument("--policy", choices=("exact", "bounded"), default="exact")
    p.add_argument("--steps", type=int, default=20, help="timed steps (median)")
    p.add_argument("--repeats", type=int, default=20,
                   help="timed launches of each kernel (graphs of this many and twice as many)")
    p.add_argument("--no-record", action="store_true", help="time only, record nothing")
    p.add_argument("--kernels", default=None, help="kernels folder (default: the shipped one)")
    random_arg(p)
    p.add_argument("--format", choices=("table", "json"), default="table")


@command("tune", "time every alternative's kernels at the plan's shapes, record them as "
                 "evidence, re-plan, and compare predicted and measured steps")(_tune_args)
def tune_command(args: argparse.Namespace) -> int:
    from metrale.lkb.errors import ConfigError

    if any(r < 1 for r in args.rows):
        raise ConfigError("rows must be positive", key="--rows", expected="integers >= 1",
                          found=repr(args.rows))
    if args.context is None:
        args.context = default_context(args.model)
    rows = tune(args.model, args.hardware, quant=args.quant, rows=args.rows, mode=args.mode,
                context=args.context, policy=args.policy, kernels=args.kernels,
                steps=args.steps, repeats=args.repeats, record=not args.no_record,
                random=args.random)
    if args.format == "json":
        print(json.dumps([attrs.asdict(r) | {"error_after": r.error_after, "slower": r.slower}
                          for r in rows], indent=2))
        return 0
    from metrale.terminal import add, console, print_table, table

    t = table(f"met tune {args.model} {args.quant} on {args.hardware}, {args.mode}, policy "
              f"{args.policy}: steps before→after tuning",
              ("rows", "bucket", "predicted µs", "measured µs", "error", "timed", "plan"),
              right=("rows", "bucket", "predicted µs", "measured µs", "error", "timed"))
    for col, width in zip(t.columns[2:6], (15, 15, 6, 5), strict=True):
        col.min_width = width  # the header stays put whatever the times' digits
    for r in rows:
        add(t, str(r.rows), str(r.bucket),
            f"{r.predicted_before_us:.1f}→{r.predicted_after_us:.1f}",
            f"{r.measured_before_us:.1f}→{r.measured_after_us:.1f}",
            f"{r.error_after:+.1%}", f"{r.kernels_timed}/{r.alternatives}",
            "new" if r.changed else "same")
    print_table(t)
    recorded, pruned = sum(r.recorded for r in rows), sum(r.pruned for r in rows)
    console().print(f"error: the tuned plan's predicted step against its measured one; timed: "
                    f"kernels timed / alternatives; {recorded} evidence records written"
                    + (" to the store" if recorded else " (--no-record)" if args.no_record
                       else "")
                    + (f"; {pruned} alternatives predicted past {PRUNE:g}x the plan's step "
                       "left untimed" if pruned else ""), markup=False)
    plan = (f"met plan {args.model} --quant {args.quant} --hardware {args.hardware} --mode "
            f"{args.mode} --policy {args.policy}")
    for line in slower_notes(rows, plan):
        console().print(line, markup=False)
    return 0


def slower_notes(rows: Sequence[TuneRow], plan: str) -> list[str]:
    """A line for each rows value whose tuned plan measured slower than the plan before it:
    the records chose it by its kernels timed alone, which the step does not bear out; ``plan``
    is the ``met plan`` command that shows the plan's records, less its rows.

    >>> r = TuneRow(1, 1, 900.0, 884.2, 814.0, 935.8, 48, 49, 49, True,
    ...             kernels_out=("qkv (metrale_qkv)",), kernels_in=("qkv (metrale_qkv_gemv_mma)",))
    >>> print(slower_notes([r], "met plan qwen3-0.6b --quant mxfp4")[0])
    rows 1: the tuned plan measured 5.8% slower than the plan before it (884.2 → 935.8 µs), though its kernels timed alone chose it: it runs qkv (metrale_qkv_gemv_mma) where the plan before ran qkv (metrale_qkv); `met plan qwen3-0.6b --quant mxfp4 --rows 1 --costs` shows each kernel's record
    >>> slower_notes([attrs.evolve(r, measured_after_us=890.0)], "met plan m")
    []
    """
    def swap(r: TuneRow) -> str:
        if not (r.kernels_in or r.kernels_out):
            return ""
        return (f": it runs {', '.join(r.kernels_in) or 'no other kernel'} where the plan "
                f"before ran {', '.join(r.kernels_out) or 'no other kernel'}")

    return [f"rows {r.rows}: the tuned plan measured "
            f"{r.measured_after_us / r.measured_before_us - 1:.1%} slower than the plan before "
            f"it ({r.measured_before_us:.1f} → {r.measured_after_us:.1f} µs), though its kernels "
            f"timed alone chose it{swap(r)}; `{plan} --rows {r.rows} --costs` shows each "
            "kernel's record" for r in rows if r.slower]


def _costs_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--costs", action="store_true",
                   help="print each kernel's predicted µs, where the number came from, the "
                        "step total and what the search chose")


def _plan_costs(args: argparse.Namespace, run: Any) -> int:
    if not getattr(args, "costs", False):
        return run(args)
    from metrale.commands import _sharded
    from metrale.plan.plan import plan_for
    from metrale.plan.printers import plan_costs_text

    p = plan_for(_sharded(args.model, args.tp), args.quant, args.hardware, mode=args.mode,
                 rows=args.rows, policy=args.policy, act=args.act, context=args.context,
                 kernels_dir=args.kernels, logits=args.logits)
    if args.format == "json":
        doc = p.to_json()
        keys = ("target", "mode", "rows", "predicted_us", "cost_device", "cost_sources", "search")
        print(json.dumps({k: doc[k] for k in keys}
                         | {"kernels": [{"index": k["index"], "family": k["family"],
                                         "cost": k["cost"]} for k in doc["kernels"]]},
                         indent=2, sort_keys=True))
    else:
        print(plan_costs_text(p, layer=args.layer), end="")
    return 0


extend_command("plan", _costs_arg, _plan_costs)
