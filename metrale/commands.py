"""The subcommands of ``met``, each a thin layer over the public API."""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.table import Table

from metrale.cli import command


def _console() -> Console:
    return Console(soft_wrap=True)


def _kernels_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", default=None, help="kernels folder (default: the shipped one)")


def _policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=("exact", "bounded"), default="exact",
                   help="numerics: exact (every fusion bit-identical) or bounded (also the "
                        "relations with a declared error bound, e.g. tensor-core GEMVs)")


def _format_arg(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table")


def _version(p: argparse.ArgumentParser) -> None:
    pass


@command("version", "print the version")(_version)
def version(args: argparse.Namespace) -> int:
    import metrale

    print(metrale.__version__)
    return 0


def _families_args(p: argparse.ArgumentParser) -> None:
    _kernels_arg(p)
    _format_arg(p)


@command("families", "list the LKB generators: kernel families and their points")(_families_args)
def families(args: argparse.Namespace) -> int:
    from metrale.lkb.presentation import Presentation

    P = Presentation.load(args.kernels)
    if args.format == "json":
        print(json.dumps([{"family": f.name, "doc": f.doc,
                           "inputs": [str(p) for p in f.inputs],
                           "outputs": [str(p) for p in f.outputs],
                           "params": {k: list(v) for k, v in f.params},
                           "points": [{"point": str(p), "reductions": list(f.reductions(p))}
                                      for p in f.points],
                           "row_invariant": f.row_invariant} for f in P.generators], indent=2))
        return 0
    t = Table(title=f"LKB generators: {len(P.generators)} families, {len(P.points())} points")
    for col in ("family", "signature", "parameters", "points", "row-inv."):
        t.add_column(col)
    for f in P.generators:
        sig = f"{', '.join(p.name for p in f.inputs)} → {', '.join(p.name for p in f.outputs)}"
        params = "; ".join(f"{k} ∈ {{{', '.join(map(str, v))}}}" for k, v in f.params)
        t.add_row(f.name, sig, params, str(len(f.points)), "yes" if f.row_invariant else "no")
    _console().print(t)
    return 0


def _relations_args(p: argparse.ArgumentParser) -> None:
    _kernels_arg(p)
    p.add_argument("--hardware", default=None,
                   help="show whether each relation holds bit-identically on this class")
    _format_arg(p)


@command("relations", "list the LKB relations: fusion rules and their numerics")(_relations_args)
def relations(args: argparse.Namespace) -> int:
    from metrale.lkb.presentation import Presentation

    if args.hardware:
        table, doc = relations_on_table(args.hardware, args.kernels)
        if args.format == "json":
            print(json.dumps(doc, indent=2))
        else:
            _console().print(table)
        return 0
    P = Presentation.load(args.kernels)
    if args.format == "json":
        print(json.dumps([{"relation": r.name, "lhs": r.lhs.text, "rhs": r.rhs.text,
                           "numerics": r.numerics,
                           "bound": None if r.bound is None else {"rel": r.bound.rel,
                                                                  "abs": r.bound.abs},
                           "priority": r.priority} for r in P.relations], indent=2))
        return 0
    t = Table(title=f"LKB relations: {len(P.relations)}")
    for col in ("relation", "lhs", "rhs", "numerics"):
        t.add_column(col)
    for r in P.relations:
        numerics = r.numerics if r.bound is None else f"bounded: rel {r.bound.rel}, abs {r.bound.abs}"
        t.add_row(r.name, r.lhs.text, r.rhs.text, numerics)
    _console().print(t)
    return 0


def _check_args(p: argparse.ArgumentParser) -> None:
    _kernels_arg(p)
    p.add_argument("--hardware", default="host", help="the class whose realization is checked")
    p.add_argument("--seeds", type=int, default=3, help="random input sets per relation point")
    p.add_argument("--verbose", action="store_true", help="list passing checks too")


@command("check", "run both sides of every relation and every row-invariance claim")(_check_args)
def check(args: argparse.Namespace) -> int:
    from metrale.lkb.check import check_presentation
    from metrale.lkb.errors import ConfigError
    from metrale.lkb.presentation import Presentation

    if args.hardware != "host":
        raise ConfigError("the semantic check runs the host realization; GPU classes are "
                          "checked by tests/cuda on a device", key="--hardware",
                          expected="host", found=args.hardware)
    P = Presentation.load(args.kernels)
    findings = check_presentation(P, seeds=tuple(range(args.seeds)))
    bad = [f for f in findings if not f.ok]
    console = _console()
    for f in findings:
        if not f.ok or args.verbose:
            console.print(str(f), markup=False)
    console.print(f"{len(findings) - len(bad)} passed, {len(bad)} failed "
                  f"({len(P.relations)} relations, {len(P.generators)} families, "
                  f"{args.seeds} seeds, hardware {args.hardware})", markup=False)
    return 1 if bad else 0


def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a bf16 (or f16/f32) safetensors checkpoint directory")
    p.add_argument("dst", help="the folder to write (must not exist unless --overwrite)")
    p.add_argument("--format", required=True,
                   help="fp8 (e4m3, per channel), fp8_e4m3_block, fp8_e4m3_tensor, mxfp4, nvfp4")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--no-progress", action="store_true")


@command("quantize", "write a quantized checkpoint from a bf16 one, with SQNR per tensor")(
    _quantize_args)
def quantize(args: argparse.Namespace) -> int:
    from metrale.runtime.quantize import quantize_checkpoint

    report = quantize_checkpoint(args.src, args.dst, args.format,
                                 progress=not args.no_progress, overwrite=args.overwrite)
    console = _console()
    console.print(report.table())
    console.print(f"wrote {args.dst}: {report.bytes_before:,} → {report.bytes_after:,} bytes, "
                  f"lowest SQNR {report.min_sqnr_db:.2f} dB", markup=False)
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name, a config.json, or a checkpoint directory")
    p.add_argument("--quant", default="bf16", help="bf16, fp8, mxfp4 or nvfp4")
    p.add_argument("--hardware", default="host", help="a hardware class (met plan ... sm_90)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--logits", choices=("all", "last"), default="all",
                   help="prefill: logits for every row, or for the last row only")
    p.add_argument("--context", type=int, default=1024, help="cached positions per row")
    p.add_argument("--act", choices=("bf16", "f32"), default="bf16")
    _policy_arg(p)
    p.add_argument("--layer", type=int, default=None, help="the layer whose kernels to list")
    p.add_argument("--diff", metavar="HW_OR_QUANT", default=None,
                   help="compare with the plan for another class or quant")
    p.add_argument("--why", action="store_true", help="list every declined fusion and why")
    _kernels_arg(p)
    _format_arg(p, ("table", "json", "dot"))


@command("plan", "plan one forward step: F_H ∘ L_H applied to a model's circuit")(_plan_args)
def plan(args: argparse.Namespace) -> int:
    from collections import Counter

    from metrale.plan.plan import plan_for
    from metrale.plan.printers import plan_text

    def make(hardware: str, quant: str):
        return plan_for(args.model, quant, hardware, mode=args.mode, rows=args.rows,
                        policy=args.policy, act=args.act, context=args.context,
                        kernels_dir=args.kernels, logits=args.logits)

    p = make(args.hardware, args.quant)
    if args.diff:
        from metrale.realize.hardware import load_hardware

        other = (make(args.diff, args.quant) if args.diff in load_hardware(args.kernels).names
                 else make(args.hardware, args.diff))
        print(p.diff(other))
        return 0
    if args.format == "json":
        print(json.dumps(p.to_json(), indent=2, sort_keys=True))
    elif args.format == "dot":
        print(p.to_dot())
    else:
        print(plan_text(p, layer=args.layer), end="")
        reasons = Counter((d.relation, d.reason) for d in p.declined)
        if args.why:
            for (rel, why), n in sorted(reasons.items()):
                print(f"declined {rel} ×{n}: {why}")
        elif reasons:
            print(f"declined fusions: {sum(reasons.values())} ({len(reasons)} reasons; --why)")
    return 0


def relations_on_table(hw_name: str, kernels_dir: str | None = None) -> tuple[Table, list]:
    """The relations on one class, as a rich table and a JSON-ready list (for ``met relations
    --hardware H``): each relation's status on H, the reason, and its verdict per point."""
    from metrale.realize.functor import realization
    from metrale.realize.relations import relations_on

    F = realization(hw_name, kernels_dir=kernels_dir)
    found = relations_on(F)
    t = Table(title=f"LKB relations on {F.name}: {len(found)}")
    for col in ("relation", "lhs", "rhs", "on " + F.name, "reason"):
        t.add_column(col)
    for r in found:
        t.add_row(r.relation.name, r.relation.lhs.text, r.relation.rhs.text, r.status, r.reason)
    return t, [r.to_json() for r in found]


def _residual_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", required=True, help="the hardware class (e.g. sm_90)")
    _kernels_arg(p)
    _format_arg(p)


@command("residual", "list Residual(H): shadows, class-only sources and per-point copies, "
                     "with reasons and evidence")(_residual_args)
def residual(args: argparse.Namespace) -> int:
    from metrale.realize.residual import residual as residual_of

    r = residual_of(args.hardware, args.kernels)
    if args.format == "json":
        print(json.dumps(r.to_json(), indent=2))
        return 0
    console = _console()
    if r.count:
        console.print(r.table())
    console.print(f"residual({r.hw}): {r.count}", markup=False)
    return 0


def _build_args(p: argparse.ArgumentParser) -> None:
    from metrale.build_cli import configure

    configure(p)
    _kernels_arg(p)
    _format_arg(p)


@command("build", "compile every point a model's plans use, ahead of time, into the cache "
                  "and the registry")(_build_args)
def build(args: argparse.Namespace) -> int:
    from metrale.build_cli import run as run_build

    return run_build(args)


def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="a built-in name (seeded random weights) or a checkpoint directory "
                        "(default: tiny-qwen3)")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory to load")
    p.add_argument("--hardware", default="host", help="the hardware class to run on")
    p.add_argument("--steps", type=int, default=32, help="greedy decode steps")
    p.add_argument("--prompt", default="1,2,3,4,5,6,7,8", help="comma-separated token ids")
    p.add_argument("--act", choices=("bf16", "f32"), default="bf16")
    p.add_argument("--quant", default=None, help="weight format (default: the checkpoint's)")
    p.add_argument("--context", type=int, default=1024, help="KV cache positions")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    p.add_argument("--blocking", action="store_true",
                   help="synchronize after every launch, so a fault names its kernel")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _policy_arg(p)


@command("run", "run a model: prefill a prompt, then greedy decode steps, with tokens/s and "
                "peak memory")(_run_args)
def run(args: argparse.Namespace) -> int:
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from metrale.lkb.errors import ConfigError
    from metrale.plan.printers import summary_lines
    from metrale.runtime.engine import Engine

    source = args.checkpoint or args.model or "tiny-qwen3"
    try:
        prompt = [int(t) for t in args.prompt.split(",") if t.strip()]
    except ValueError:
        raise ConfigError("prompt must be comma-separated token ids", key="--prompt",
                          found=repr(args.prompt)) from None
    if args.steps < 1:
        raise ConfigError("bad step count", key="--steps", expected="an int >= 1",
                          found=args.steps)
    console = _console()
    t0 = time.perf_counter()
    with Engine.load(source, hardware=args.hardware, quant=args.quant, act=args.act,
                     max_ctx=args.context, seed=args.seed, blocking=args.blocking,
                     policy=args.policy) as eng:
        load_s = time.perf_counter() - t0
        for line in summary_lines(eng.plan("decode", 1)):
            console.print(line, markup=False)
        t1 = time.perf_counter()
        token = int(eng.prefill(prompt)[-1].argmax())
        prefill_s = time.perf_counter() - t1
        tokens = [token]
        bar = Progress(TextColumn("[bold]decode[/]"), BarColumn(), MofNCompleteColumn(),
                       console=console, transient=True,
                       disable=args.no_progress or args.steps < 64)
        t2 = time.perf_counter()
        with bar:
            task = bar.add_task("decode", total=args.steps - 1)
            for _ in range(args.steps - 1):
                token = int(eng.decode([token])[0].argmax())
                tokens.append(token)
                bar.advance(task)
        decode_s = time.perf_counter() - t2
        mem = eng.memory()
        backend = eng.backend.name
    decode_tps = (args.steps - 1) / decode_s if args.steps > 1 else float("nan")
    console.print(f"model {eng.config.name} ({eng.quant}, act {eng.act}) on {backend}; "
                  f"loaded in {load_s:.2f} s", markup=False)
    console.print(f"prefill: {len(prompt)} tokens in {prefill_s * 1e3:.1f} ms "
                  f"({len(prompt) / prefill_s:.1f} tokens/s)", markup=False)
    console.print(f"decode: {args.steps - 1} steps, {decode_tps:.1f} tokens/s", markup=False)
    console.print(f"tokens: {tokens}", markup=False)
    console.print(f"peak memory: {mem['device_live'] / 2**20:.2f} MiB "
                  f"(weights {mem['weights'] / 2**20:.2f}, KV cache {mem['kv_cache'] / 2**20:.2f}, "
                  f"activations {mem['activations_peak'] / 2**20:.3f})", markup=False)
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name or a checkpoint directory")
    p.add_argument("--quant", default=None, help="bf16, fp8, mxfp4 or nvfp4")
    p.add_argument("--hardware", default="host", help="the class to run (e.g. sm_90)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                   help="the step to time (prefill: the whole step only, no per-kernel table)")
    p.add_argument("--rows", type=int, default=1,
                   help="decode: rows (sequences); prefill: the prompt's tokens")
    p.add_argument("--context", type=int, default=1024, help="cached positions per row")
    p.add_argument("--steps", type=int, default=100, help="timed steps (median)")
    p.add_argument("--record", action="store_true",
                   help="append evidence records (kernel bandwidth) for the class")
    _policy_arg(p)
    _kernels_arg(p)
    _format_arg(p)


@command("bench", "time the decode step and each kernel against the memory floor "
                  "(--record writes evidence), or a prefill step (--mode prefill)")(_bench_args)
def bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from metrale.lkb.errors import ConfigError
    from metrale.realize.evidence import EVIDENCE_FILE, append_records
    from metrale.realize.hardware import default_kernels_dir, load_hardware
    from metrale.runtime.bench import evidence, kernel_times, time_decode
    from metrale.runtime.engine import Engine

    if args.mode == "prefill":
        return _bench_prefill(args)
    hw = load_hardware(args.kernels).get(args.hardware)
    with Engine.load(args.model, hardware=args.hardware, quant=args.quant,
                     max_ctx=args.context + 1, slots=args.rows, policy=args.policy) as eng:
        step = time_decode(eng, args.rows, steps=args.steps)
        kernels = kernel_times(eng, args.rows)
        device = eng.backend.limits.name
        records = []
        if args.record:
            toolchain = _toolchain(hw)
            records = evidence(kernels, hw, device, toolchain)
            if not records:
                raise ConfigError("nothing to record: this class runs the reference semantics, "
                                  "which have no source to pin evidence to",
                                  key="--record", expected="a class with compiled kernels",
                                  found=args.hardware)
            path = Path(args.kernels or default_kernels_dir()) / hw.name / EVIDENCE_FILE
            append_records(path, records)
    if args.format == "json":
        print(json.dumps({
            "model": step.model, "quant": step.quant, "hardware": step.hardware,
            "device": device, "rows": step.rows, "context": step.context,
            "policy": args.policy, "step_s": step.step_s, "floor_s": step.floor_s,
            "bytes_moved": step.bytes_moved,
            "launches": step.launches, "graph": step.graph,
            "kernels": [{"kernel": k.label, "point": k.point, "count": k.count,
                         "seconds": k.seconds, "bytes": k.bytes_moved,
                         "bytes_per_s": k.bytes_per_s} for k in kernels],
            "recorded": len(records)}, indent=2))
        return 0
    t = Table(title=f"{step.model} {step.quant} on {step.hardware} ({device}): decode, "
                    f"{step.rows} row(s), context {step.context}, policy {args.policy}")
    for col in ("kernel", "per step", "µs each", "GB/s", "share of step"):
        t.add_column(col)
    total = sum(k.seconds * k.count for k in kernels) or 1.0
    for k in sorted(kernels, key=lambda k: -k.seconds * k.count):
        t.add_row(k.label, f"×{k.count}", f"{k.seconds * 1e6:.1f}",
                  f"{k.bytes_per_s / 1e9:.1f}", f"{k.seconds * k.count / total:.0%}")
    console = _console()
    console.print(t)
    console.print(f"step {step.step_s * 1e3:.3f} ms (median of {args.steps}, "
                  f"{'graph replay' if step.graph else 'launches'}), floor "
                  f"{step.floor_s * 1e3:.3f} ms: {step.fraction_of_floor:.0%} of the floor; "
                  f"{step.launches} launches" + (f"; {len(records)} evidence records written"
                                                 if records else ""), markup=False)
    return 0


def _bench_prefill(args: argparse.Namespace) -> int:
    """``met bench --mode prefill``: one prompt of ``--rows`` tokens into a fresh cache, timed
    whole (the plan's memory floor beside it; a prefill is bound by arithmetic, not bytes)."""
    from metrale.lkb.errors import ConfigError
    from metrale.runtime.bench import time_prefill
    from metrale.runtime.engine import Engine

    if args.record:
        raise ConfigError("evidence comes from the decode step's kernels, timed one by one",
                          key="--record", expected="--mode decode", found="--mode prefill")
    with Engine.load(args.model, hardware=args.hardware, quant=args.quant,
                     max_ctx=max(args.rows, 1), policy=args.policy) as eng:
        step = time_prefill(eng, args.rows, steps=args.steps)
        device = eng.backend.limits.name
    if args.format == "json":
        print(json.dumps({
            "model": step.model, "quant": step.quant, "hardware": step.hardware,
            "device": device, "mode": "prefill", "rows": step.rows, "policy": args.policy,
            "step_s": step.step_s,
            "floor_s": step.floor_s, "bytes_moved": step.bytes_moved,
            "launches": step.launches}, indent=2))
        return 0
    _console().print(f"{step.model} {step.quant} on {step.hardware} ({device}): prefill of "
                     f"{step.rows} tokens {step.step_s * 1e3:.3f} ms (median of {args.steps}), "
                     f"{step.launches} launches; memory floor {step.floor_s * 1e3:.3f} ms",
                     markup=False)
    return 0


def _toolchain(hw) -> str:
    from metrale.lkb.vendor import Vendor

    if hw.vendor == Vendor.NVIDIA:
        from metrale.realize.compute import NvidiaTarget

        return NvidiaTarget("ptx").version()
    import numpy

    return f"numpy {numpy.__version__}"
