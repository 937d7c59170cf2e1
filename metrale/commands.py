"""The subcommands of ``met``, each a thin layer over the public API.

Tables are rich tables at the terminal's width (``COLUMNS`` where there is no terminal), their
columns folding long names rather than cutting them; every command that prints a table also
prints JSON with ``--format json``. Steps that can take seconds show a progress display on a
terminal's stderr, never in a pipe, and never with ``--no-progress``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from metrale import names
from metrale.cli import command
from metrale.terminal import add as _add
from metrale.terminal import console as _console
from metrale.terminal import int_at_least, token_ids
from metrale.terminal import no_progress_arg as _no_progress_arg
from metrale.terminal import print_table as _print_table
from metrale.terminal import progress as _progress
from metrale.terminal import table as _table


def _kernels_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", default=None, help="kernels folder (default: the shipped one)")


def _policy_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", choices=("exact", "bounded"), default="exact",
                   help="numerics: exact (every fusion bit-identical) or bounded (also the "
                        "relations with a declared error bound, e.g. tensor-core GEMVs)")


def default_context(model: str) -> int:
    """The cached positions a timed decode step reads by default: 1024, or one less than the
    model's ``max_position_embeddings`` where that is smaller (the step's own position is one
    more)."""
    from metrale.plan.config import ModelConfig

    return max(1, min(1024, ModelConfig.load(model).max_position_embeddings - 1))


def random_arg(p: argparse.ArgumentParser) -> None:
    """``--random``: how a model without a checkpoint draws its weights, for the commands that
    time it (``runtime.engine.RANDOM_WEIGHTS``)."""
    p.add_argument("--random", choices=("pooled", "normal"), default="pooled",
                   help="a model without a checkpoint: pooled random weights (tiled from small "
                        "pools, seconds for an 8B model; the default for timing) or normal "
                        "(every value drawn)")


def _format_arg(p: argparse.ArgumentParser, choices: tuple[str, ...] = ("table", "json")) -> None:
    p.add_argument("--format", choices=choices, default="table", help="output format")


def _version(p: argparse.ArgumentParser) -> None:
    pass


@command("version", "print the version")(_version)
def version(args: argparse.Namespace) -> int:
    import metrale

    print(metrale.__version__)
    return 0


def _models_args(p: argparse.ArgumentParser) -> None:
    _format_arg(p)


@command("models", "list the built-in model configs (a name plans with random weights; a "
                   "checkpoint directory works wherever a name does)")(_models_args)
def models(args: argparse.Namespace) -> int:
    from metrale.plan.config import ModelConfig
    from metrale.plan.models import builtin_names

    configs = [ModelConfig.load(n) for n in builtin_names()]
    if args.format == "json":
        print(json.dumps([{"model": c.name, "arch": c.arch, "layers": c.num_hidden_layers,
                           "hidden": c.hidden_size, "heads": c.num_attention_heads,
                           "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                           "vocab": c.vocab_size, "experts": c.num_experts,
                           "max_positions": c.max_position_embeddings,
                           "test_model": c.name.startswith("tiny-")} for c in configs], indent=2))
        return 0
    t = _table(f"built-in models: {len(configs)} (published shapes; tiny-*: test models)",
               ("model", "arch", "layers", "hidden", "heads", "experts", "vocab"),
               right=("layers", "hidden", "experts", "vocab"))
    for c in configs:
        _add(t, c.name, c.arch, str(c.num_hidden_layers), str(c.hidden_size),
             f"{c.num_attention_heads}/{c.num_key_value_heads} x {c.head_dim}",
             f"{c.num_experts_per_tok} of {c.num_experts}" if c.num_experts else "",
             str(c.vocab_size))
    _print_table(t)
    return 0


def _hardware_args(p: argparse.ArgumentParser) -> None:
    _kernels_arg(p)
    _format_arg(p)


@command("hardware", "list the hardware classes (--hardware takes a class, e.g. sm_90 for "
                     "H100/H200), with what each is and what it inherits")(_hardware_args)
def hardware(args: argparse.Namespace) -> int:
    from metrale.realize.hardware import load_hardware

    classes = list(load_hardware(args.kernels))
    if args.format == "json":
        print(json.dumps([{"class": h.name, "vendor": str(h.vendor.value), "arch": h.arch,
                           "inherits": list(h.inherits), "device": h.device.name,
                           "about": names.about(h)} for h in classes], indent=2))
        return 0
    t = _table(f"hardware classes: {len(classes)}",
               ("class", "vendor", "arch", "inherits", "costed as", "what"))
    for h in classes:
        _add(t, h.name, str(h.vendor.value), h.arch or "", ", ".join(h.inherits),
             h.device.name, names.about(h))
    _print_table(t)
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
    t = _table(f"LKB generators: {len(P.generators)} families, {len(P.points())} points",
               ("family", "signature", "parameters", "points", "row-inv."), right=("points",))
    for f in P.generators:
        sig = f"{', '.join(p.name for p in f.inputs)} → {', '.join(p.name for p in f.outputs)}"
        params = "; ".join(f"{k} ∈ {{{', '.join(map(str, v))}}}" for k, v in f.params)
        _add(t, f.name, sig, params, str(len(f.points)), "yes" if f.row_invariant else "no")
    _print_table(t)
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
        table, doc = relations_on_table(names.hardware_class(args.hardware, args.kernels),
                                        args.kernels)
        if args.format == "json":
            print(json.dumps(doc, indent=2))
        else:
            _print_table(table)
        return 0
    P = Presentation.load(args.kernels)
    if args.format == "json":
        print(json.dumps([{"relation": r.name, "lhs": r.lhs.text, "rhs": r.rhs.text,
                           "numerics": r.numerics,
                           "bound": None if r.bound is None else {"rel": r.bound.rel,
                                                                  "abs": r.bound.abs},
                           "priority": r.priority} for r in P.relations], indent=2))
        return 0
    t = _table(f"LKB relations: {len(P.relations)}", ("relation", "lhs", "rhs", "numerics"))
    for r in P.relations:
        numerics = r.numerics if r.bound is None else f"bounded: rel {r.bound.rel}, abs {r.bound.abs}"
        _add(t, r.name, r.lhs.text, r.rhs.text, numerics)
    _print_table(t)
    return 0


def _check_args(p: argparse.ArgumentParser) -> None:
    _kernels_arg(p)
    p.add_argument("--hardware", default="host",
                   help="the class whose realization is checked (only host runs here)")
    p.add_argument("--seeds", type=int_at_least(1, 1000), default=3,
                   help="random input sets per relation point")
    p.add_argument("--only", type=_names, metavar="NAMES",
                   help="the relations and families to check, comma-separated (default: all)")
    p.add_argument("--verbose", action="store_true", help="list passing checks too")
    _no_progress_arg(p)


def _names(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("--only names relations or families, found none")
    return names


@command("check", "run both sides of every relation and every row-invariance claim")(_check_args)
def check(args: argparse.Namespace) -> int:
    from metrale.lkb.check import check_presentation
    from metrale.lkb.errors import ConfigError, nearest
    from metrale.lkb.presentation import Presentation

    if args.hardware != "host":
        # a GPU's product name or a misspelt class is answered as such; a folder holding only
        # the presentation (no */HARDWARE.toml) is still checked on the host
        names.hardware_class(args.hardware, args.kernels)
        raise ConfigError("the semantic check runs the host realization; GPU classes are "
                          "checked by tests/cuda on a device", key="--hardware",
                          expected="host", found=args.hardware)
    P = Presentation.load(args.kernels)
    known = [r.name for r in P.relations] + [f.name for f in P.generators]
    for name in args.only or ():
        if name not in known:
            raise ConfigError("no relation or family of this name", key="--only",
                              found=repr(name), suggestion=nearest(name, known))
    rels = [r for r in P.relations if not args.only or r.name in args.only]
    fams = [f for f in P.generators if not args.only or f.name in args.only]
    with _progress(args, f"checking {len(rels)} relations and {len(fams)} families, "
                         f"{args.seeds} seeds"):
        findings = check_presentation(P, seeds=tuple(range(args.seeds)), only=args.only)
    bad = [f for f in findings if not f.ok]
    console = _console()
    for f in findings:
        if not f.ok or args.verbose:
            console.print(str(f), markup=False)
    console.print(f"{len(findings) - len(bad)} passed, {len(bad)} failed "
                  f"({len(rels)} relations, {len(fams)} families, "
                  f"{args.seeds} seeds, hardware {args.hardware})", markup=False)
    return 1 if bad else 0


def _output_format(text: str) -> str:
    if text in ("table", "json"):
        return text
    raise argparse.ArgumentTypeError(
        f"--format is the output format (table or json), found {text!r}; the weight format is "
        f"--to (met quantize SRC DST --to {text})")


def _quantize_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a bf16 (or f16/f32) safetensors checkpoint directory")
    p.add_argument("dst", help="the folder to write (must not exist, unless --overwrite and it "
                               "is a previous output of met quantize)")
    p.add_argument("--to", required=True, metavar="QUANT",
                   help="the weight format to write: " + names.quant_names())
    p.add_argument("--overwrite", action="store_true",
                   help="replace DST if it is a previous output of met quantize (never "
                        "anything else, never SRC or a folder holding it)")
    _no_progress_arg(p)
    p.add_argument("--format", type=_output_format, default="table",
                   help="output format: table or json")


@command("quantize", "write a quantized checkpoint from a bf16 one, with SQNR per tensor")(
    _quantize_args)
def quantize(args: argparse.Namespace) -> int:
    from metrale.lkb.errors import ConfigError, nearest
    from metrale.lkb.quant import FORMATS, QuantFormat
    from metrale.runtime.quantize import quantize_checkpoint

    try:
        fmt = QuantFormat.parse(args.to)
    except ConfigError:
        fmt = None
    if fmt is None or fmt.name == "bf16":
        raise ConfigError("unknown weight format", key="--to", expected=names.quant_names(),
                          found=repr(args.to),
                          suggestion=nearest(args.to.lower(), ["fp8", "mxfp4", "nvfp4", *(
                              f for f in FORMATS if f != "bf16")]))
    report = quantize_checkpoint(args.src, args.dst, args.to, progress=not args.no_progress,
                                 overwrite=args.overwrite, flag="--overwrite")
    if args.format == "json":
        print(json.dumps({"src": report.src, "dst": report.dst, "format": report.fmt,
                          "bytes_before": report.bytes_before, "bytes_after": report.bytes_after,
                          "min_sqnr_db": report.min_sqnr_db,
                          "tensors": [{"tensor": t.name, "shape": list(t.shape),
                                       "dtype": t.dtype, "format": t.fmt,
                                       "bytes_before": t.bytes_before,
                                       "bytes_after": t.bytes_after, "sqnr_db": t.sqnr_db}
                                      for t in report.tensors]}, indent=2))
        return 0
    t = _table(f"quantize {report.src} -> {report.dst} ({report.fmt})",
               ("tensor", "shape", "format", "bytes before", "bytes after", "SQNR dB"),
               right=("bytes before", "bytes after", "SQNR dB"))
    for r in report.tensors:
        _add(t, r.name, "x".join(map(str, r.shape)), r.fmt, f"{r.bytes_before:,}",
             f"{r.bytes_after:,}", "" if r.sqnr_db is None else f"{r.sqnr_db:.2f}")
    _print_table(t)
    worst = report.min_sqnr_db
    _console().print(f"wrote {args.dst}: {report.bytes_before:,} → {report.bytes_after:,} bytes, "
                     + ("nothing quantized" if worst is None else f"lowest SQNR {worst:.2f} dB"),
                     markup=False)
    return 0


def _plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name (met models), a config.json, or a checkpoint "
                                 "directory")
    p.add_argument("--quant", default="bf16", help="weight format: bf16, fp8, mxfp4 or nvfp4")
    p.add_argument("--hardware", default="host",
                   help="a hardware class (met hardware), e.g. sm_90 for H100/H200")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                   help="the step planned")
    p.add_argument("--rows", type=int_at_least(1), default=1,
                   help="decode: rows (sequences); prefill: the prompt's tokens")
    p.add_argument("--logits", choices=("all", "last"), default="all",
                   help="prefill: logits for every row, or for the last row only")
    p.add_argument("--context", type=int_at_least(1), default=1024,
                   help="cached positions per row")
    p.add_argument("--act", choices=("bf16", "f32"), default="bf16", help="activation dtype")
    _policy_arg(p)
    p.add_argument("--layer", type=int_at_least(0), default=None,
                   help="the layer whose kernels to list (default: layer 0, as every layer "
                        "launches the same kernels)")
    p.add_argument("--diff", metavar="HW_OR_QUANT", default=None,
                   help="compare with the plan for another class (sm_80) or quant (fp8)")
    p.add_argument("--why", action="store_true", help="list every declined fusion and why")
    tp_arg(p)
    _kernels_arg(p)
    _format_arg(p, ("table", "json", "dot"))


def tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int_at_least(1), default=1, metavar="N",
                   help="tensor-parallel ranks: the plan of one rank of N (heads, MLP and "
                        "vocabulary split; all-reduce after attention and MLP); run on the "
                        "host, N ranks are simulated in this process")


def _sharded(model: Any, tp: int) -> Any:
    """``model`` (a name, config file or checkpoint) as one rank of ``tp`` (itself for one)."""
    from metrale.plan.config import ModelConfig
    from metrale.plan.shard import Sharding

    return Sharding(tp).config(ModelConfig.load(model)) if tp > 1 else model




def _diff_target(text: str, kernels: str | None) -> tuple[str, str]:
    """``("hardware", class)`` or ``("quant", name)`` for ``--diff``'s argument, else a
    ``ConfigError`` naming both kinds of target."""
    from metrale.lkb.errors import ConfigError
    from metrale.lkb.quant import QuantFormat
    from metrale.realize.hardware import load_hardware

    classes = load_hardware(kernels).names
    if text in classes:
        return "hardware", text
    try:
        QuantFormat.parse(text)
    except ConfigError:
        pass
    else:
        return "quant", text
    if names._product_class(text, load_hardware(kernels)) is not None:
        names.hardware_class(text, kernels, key="--diff")  # a product name is answered with its class
    from metrale.lkb.errors import nearest

    raise ConfigError("bad diff target", key="--diff",
                      expected="a hardware class (" + ", ".join(classes) + ") or a quant "
                               "(bf16, fp8, mxfp4, nvfp4)", found=repr(text),
                      suggestion=nearest(text, [*classes, "bf16", "fp8", "mxfp4", "nvfp4"]))


@command("plan", "plan one forward step: F_H ∘ L_H applied to a model's circuit")(_plan_args)
def plan(args: argparse.Namespace) -> int:
    from collections import Counter

    import attrs

    from metrale.lkb.errors import ConfigError
    from metrale.plan.plan import plan_for
    from metrale.plan.printers import plan_text

    def make(hardware: str, quant: str):
        return plan_for(_sharded(args.model, args.tp), quant, hardware, mode=args.mode,
                        rows=args.rows,
                        policy=args.policy, act=args.act, context=args.context,
                        kernels_dir=args.kernels, logits=args.logits)

    hw = names.hardware_class(args.hardware, args.kernels)
    diff = _diff_target(args.diff, args.kernels) if args.diff else None
    p = make(hw, args.quant)
    from metrale.plan.config import ModelConfig

    layers = ModelConfig.load(args.model).num_hidden_layers
    if args.layer is not None and args.layer >= layers:
        raise ConfigError("no such layer", key="--layer",
                          expected=f"0 <= layer < {layers} ({p.target.model} has {layers})",
                          found=args.layer)
    if diff:
        other = make(diff[1], args.quant) if diff[0] == "hardware" else make(hw, diff[1])
        d = p.diff(other)
        # only the reasons that differ between the two sides say why their kernels differ
        mine, theirs = _declined(p), _declined(other)
        d = attrs.evolve(d, reasons=tuple(
            [f"{r} (only {p.target})" for r in sorted(mine - theirs)]
            + [f"{r} (only {other.target})" for r in sorted(theirs - mine)]))
        print(d)
        return 0
    if args.format == "json":
        print(json.dumps(p.to_json(), indent=2, sort_keys=True))
    elif args.format == "dot":
        print(p.to_dot())
    else:
        print(plan_text(p, layer=args.layer, width=_console().width), end="")
        reasons = Counter((d.relation, d.reason) for d in p.declined)
        if args.why:
            for (rel, why), n in sorted(reasons.items()):
                print(f"declined {rel} ×{n}: {why}")
        elif reasons:
            print(f"declined fusions: {sum(reasons.values())} ({len(reasons)} reasons; --why)")
    return 0


def _declined(p: Any) -> set[str]:
    """A plan's declined fusions as ``relation: why`` lines (overlaps left out, as in diffs)."""
    return {f"{d.relation}: {d.reason}" for d in p.declined if not d.reason.startswith("overlaps")}


def relations_on_table(hw_name: str, kernels_dir: str | None = None) -> tuple[Table, list]:
    """The relations on one class, as a rich table and a JSON-ready list (for ``met relations
    --hardware H``): each relation's status on H, the reason, and its verdict per point."""
    from metrale.realize.functor import realization
    from metrale.realize.relations import relations_on

    F = realization(hw_name, kernels_dir=kernels_dir)
    found = relations_on(F)
    t = _table(f"LKB relations on {F.name}: {len(found)}",
               ("relation", "lhs", "rhs", "on " + F.name, "reason"))
    for r in found:
        _add(t, r.relation.name, r.relation.lhs.text, r.relation.rhs.text, r.status, r.reason)
    return t, [r.to_json() for r in found]


def _residual_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", required=True, help="the hardware class (e.g. sm_90)")
    _kernels_arg(p)
    _format_arg(p)


@command("residual", "list Residual(H): shadows, class-only sources and per-point copies, "
                     "grouped by reason, with evidence")(_residual_args)
def residual(args: argparse.Namespace) -> int:
    from metrale.realize.residual import residual as residual_of

    r = residual_of(names.hardware_class(args.hardware, args.kernels), args.kernels)
    if args.format == "json":
        print(json.dumps(r.to_json(), indent=2))
        return 0
    groups: dict[tuple[str, str, str, str], list[str]] = {}
    for e in r.entries:
        groups.setdefault((e.kind, e.file, e.reason, e.evidence), []).append(e.name)
    if groups:
        kinds = ", ".join(f"{k}: {n}" for k, n in r.by_kind().items())
        t = _table(f"Residual({r.hw}): {r.count} ({kinds}); {len(groups)} reason(s)",
                   ("kind", "count", "file", "reason", "evidence", "points"), right=("count",))
        for (kind, file, reason, ev), points in groups.items():
            _add(t, kind, str(len(points)), file, reason, ev, "\n".join(points))
        _print_table(t)
    _console().print(f"residual({r.hw}): {r.count}", markup=False)
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
    p.add_argument("model", nargs="?", default="tiny-qwen3",
                   help="a built-in name (met models; seeded random weights) or a checkpoint "
                        "directory (default: tiny-qwen3)")
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint directory to load (a path to its config.json or "
                        ".safetensors file loads that directory); it must hold weights")
    p.add_argument("--hardware", default="host",
                   help="the hardware class to run on: host is the CPU; a GPU class (sm_90 …) "
                        "is never picked on its own")
    p.add_argument("--steps", type=int_at_least(1), default=32,
                   help="tokens to generate greedily (the first by the prefill)")
    p.add_argument("--prompt", default="1,2,3,4,5,6,7,8",
                   help="text (a checkpoint with tokenizer.json), else comma-separated token ids")
    p.add_argument("--act", choices=("bf16", "f32"), default="bf16", help="activation dtype")
    p.add_argument("--quant", default=None, help="weight format (default: the checkpoint's, "
                                                 "else bf16)")
    p.add_argument("--context", type=int_at_least(1), default=None,
                   help="KV cache positions (default: 1024, or the model's "
                        "max_position_embeddings if smaller)")
    p.add_argument("--seed", type=int_at_least(0, 2**63 - 1), default=0,
                   help="seed of the random weights; with a text prompt, of the draws")
    p.add_argument("--blocking", action="store_true",
                   help="synchronize after every launch, so a fault names its kernel")
    _no_progress_arg(p)
    _policy_arg(p)
    tp_arg(p)
    from metrale.generate_cli import sampling_args

    sampling_args(p)


def _run_source(args: argparse.Namespace) -> tuple[Any, str]:
    """What ``met run`` loads and how it says where the weights come from."""
    import os
    from pathlib import Path

    from metrale.lkb.errors import CheckpointError
    from metrale.runtime.checkpoint import INDEX, SINGLE
    from metrale.runtime.engine import checkpoint_dir

    if args.checkpoint is not None:
        folder = checkpoint_dir(args.checkpoint)
        if folder is None or not any(os.path.lexists(folder / n) for n in (SINGLE, INDEX)):
            found = ("nothing" if not Path(args.checkpoint).exists() else
                     "a folder without weights" if Path(args.checkpoint).is_dir()
                     else "a file with no weights beside it")
            raise CheckpointError("--checkpoint needs weights", file=args.checkpoint,
                                  key="--checkpoint",
                                  expected=f"a checkpoint directory holding {SINGLE} or {INDEX}",
                                  found=found)
        return folder, f"weights from {folder}"
    source = args.model
    folder = checkpoint_dir(source)
    if folder is not None:
        return folder, f"weights from {folder}"
    return source, f"random weights (seed {args.seed})"


@command("run", "run a model: prefill a prompt, then greedy decode steps, with tokens/s and "
                "peak memory")(_run_args)
def run(args: argparse.Namespace) -> int:
    import time

    import numpy as np
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from metrale.generate_cli import run_text, wants_text
    from metrale.lkb.errors import ConfigError
    from metrale.plan.config import ModelConfig
    from metrale.plan.printers import summary_lines
    from metrale.runtime.parallel import load_engine

    if wants_text(args):
        return run_text(args)
    source, weights = _run_source(args)
    flag = "--prompt-ids" if args.prompt_ids else "--prompt"
    try:  # without a tokenizer the prompt is token ids: a bad one is a usage error (exit 2)
        prompt = token_ids(args.prompt_ids or args.prompt)
    except argparse.ArgumentTypeError as e:
        argparse.ArgumentParser(prog="met run").error(f"argument {flag}: {e}")
    hardware = names.hardware_class(args.hardware)
    config = ModelConfig.load(source)
    context = (args.context if args.context is not None
               else min(1024, config.max_position_embeddings))
    need = len(prompt) + args.steps - 1
    if need > context:  # refused before loading, not after the last step
        raise ConfigError("prompt and steps do not fit the context", key="--steps",
                          expected=f"prompt + steps - 1 <= --context {context} (at most "
                                   f"{max(context - len(prompt) + 1, 0)} steps)",
                          found=f"{len(prompt)} + {args.steps} - 1 = {need}")
    console = _console()
    t0 = time.perf_counter()
    with _progress(args, f"loading {config.name} ({weights})"):
        eng = load_engine(source, args.tp, hardware=hardware, quant=args.quant, act=args.act,
                          max_ctx=context, seed=args.seed, blocking=args.blocking,
                          policy=args.policy, progress=not args.no_progress)
    with eng:
        load_s = time.perf_counter() - t0
        for line in summary_lines(eng.plan("decode", 1)):
            console.print(line, markup=False)
        greedy = np.zeros((1, 4), np.float32)  # temperature 0: the plan's sample op is argmax
        t1 = time.perf_counter()
        token = eng.prefill_ids(prompt, params=greedy, keys=np.zeros((1, 4), np.int32))
        prefill_s = time.perf_counter() - t1
        tokens = [token]
        bar = Progress(TextColumn("[bold]decode[/]"), BarColumn(), MofNCompleteColumn(),
                       console=Console(stderr=True), transient=True,
                       disable=args.no_progress or not sys.stderr.isatty())
        t2 = time.perf_counter()
        with bar:
            task = bar.add_task("decode", total=args.steps - 1)
            for _ in range(args.steps - 1):
                token = int(eng.decode_ids([token], greedy, np.zeros((1, 4), np.int32))[0])
                tokens.append(token)
                bar.advance(task)
        decode_s = time.perf_counter() - t2
        mem = eng.memory()
        backend = eng.backend.name
    steps = args.steps - 1
    ranks = f" x {args.tp} ranks (tensor parallel)" if args.tp > 1 else ""
    console.print(f"model {eng.config.name} ({eng.quant}, act {eng.act}) on {backend}{ranks}, "
                  f"{weights}; loaded in {load_s:.2f} s", markup=False)
    console.print(f"prefill: {len(prompt)} tokens in {prefill_s * 1e3:.1f} ms "
                  f"({len(prompt) / prefill_s:.1f} tokens/s)", markup=False)
    console.print(f"generated {args.steps} token(s): 1 by the prefill, then {steps} decode "
                  f"step(s)" + (f" at {steps / decode_s:.1f} tokens/s" if steps else ""),
                  markup=False)
    console.print(f"tokens: {tokens}", markup=False)
    held = ("; the host holds weights as f32, whatever the format" if backend == "host"
            else "")
    console.print(f"peak memory: {mem['device_live'] / 2**20:.2f} MiB "
                  f"(weights {mem['weights'] / 2**20:.2f}, KV cache {mem['kv_cache'] / 2**20:.2f}, "
                  f"activations {mem['activations_peak'] / 2**20:.3f}{held})", markup=False)
    return 0


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a built-in name (met models) or a checkpoint directory")
    p.add_argument("--quant", default=None,
                   help="bf16, fp8, mxfp4 or nvfp4 (default: the checkpoint's, else bf16)")
    p.add_argument("--hardware", default="host", help="the class to run (e.g. sm_90)")
    p.add_argument("--mode", choices=("decode", "prefill"), default="decode",
                   help="the step to time (prefill: the whole step only, no per-kernel table)")
    p.add_argument("--rows", type=int_at_least(1), default=1,
                   help="decode: rows (sequences, each its own KV cache); prefill: the "
                        "prompt's tokens")
    p.add_argument("--context", type=int_at_least(1), default=None,
                   help="cached positions per row (default: 1024, or one less than the "
                        "model's max_position_embeddings if smaller)")
    p.add_argument("--steps", type=int_at_least(1), default=100, help="timed steps (median)")
    _no_progress_arg(p)
    p.add_argument("--record", action="store_true",
                   help="record evidence (kernel bandwidth) for the class in the evidence store "
                        "(`met evidence`)")
    _policy_arg(p)
    tp_arg(p)
    _kernels_arg(p)
    random_arg(p)
    _format_arg(p)


@command("bench", "time the decode step and each kernel against the memory floor "
                  "(--record writes evidence), or a prefill step (--mode prefill)")(_bench_args)
def bench(args: argparse.Namespace) -> int:
    import attrs

    from metrale.lkb.errors import ConfigError
    from metrale.realize.evidence import record_evidence
    from metrale.realize.hardware import load_hardware
    from metrale.runtime.bench import evidence, kernel_times, time_decode
    from metrale.runtime.parallel import load_engine

    if args.mode == "prefill":
        return _bench_prefill(args)
    hw = load_hardware(args.kernels).get(names.hardware_class(args.hardware, args.kernels))
    if args.context is None:
        args.context = default_context(args.model)
    if args.tp > 1 and args.record:
        raise ConfigError("evidence is each kernel timed alone, on one device", key="--record",
                          expected="--tp 1", found=f"--tp {args.tp}")
    with _progress(args, f"loading {args.model}"):
        eng = load_engine(args.model, args.tp, hardware=hw.name, quant=args.quant,
                          max_ctx=args.context + 1, slots=args.rows, policy=args.policy,
                          random=args.random)
    with eng:
        with _progress(args, f"timing {args.steps} decode steps, then each kernel"):
            # with ranks, the step is timed whole (its collectives wait for every rank)
            step = (time_decode(eng, args.rows, steps=args.steps) if args.tp == 1
                    else eng.time_step("decode", args.rows, args.steps))
            kernels = kernel_times(eng, args.rows) if args.tp == 1 else ()
        device = eng.backend.limits.name
        records = []
        if args.record:
            toolchain = _toolchain(hw)
            shape = f"rows={args.rows},context={args.context}"  # what the records measured
            records = [attrs.evolve(r, shape=shape)
                       for r in evidence(kernels, hw, device, toolchain)]
            if not records:
                raise ConfigError("nothing to record: this class runs the reference semantics, "
                                  "which have no source to pin evidence to",
                                  key="--record", expected="a class with compiled kernels",
                                  found=args.hardware)
            record_evidence(records)
    if args.format == "json":
        print(json.dumps({
            "model": step.model, "quant": step.quant, "hardware": step.hardware,
            "device": device, "rows": step.rows, "context": step.context, "tp": args.tp,
            "policy": args.policy, "step_s": step.step_s, "floor_s": step.floor_s,
            "bytes_moved": step.bytes_moved,
            "launches": step.launches, "graph": step.graph,
            "kernels": [{"kernel": k.label, "point": k.point, "count": k.count,
                         "seconds": k.seconds, "bytes": k.bytes_moved,
                         "bytes_per_s": k.bytes_per_s} for k in kernels],
            "recorded": len(records)}, indent=2))
        return 0
    ranks = f", {args.tp} ranks" if args.tp > 1 else ""
    t = _table(f"{step.model} {step.quant} on {step.hardware} ({device}{ranks}): decode, "
               f"{step.rows} row(s), context {step.context}, policy {args.policy}",
               ("kernel", "per step", "µs each", "GB/s", "share of step"),
               right=("per step", "µs each", "GB/s", "share of step"))
    total = sum(k.seconds * k.count for k in kernels) or 1.0
    for k in sorted(kernels, key=lambda k: -k.seconds * k.count):
        _add(t, k.label, f"×{k.count}", f"{k.seconds * 1e6:.1f}",
             f"{k.bytes_per_s / 1e9:.1f}", _share(k.seconds * k.count / total))
    if kernels:
        _print_table(t)
    from metrale.lkb.vendor import Vendor

    if hw.vendor == Vendor.HOST:  # NumPy's reference semantics are no kernels to hold to a floor
        floor = "no memory floor on the host (it runs the reference semantics)"
    else:
        floor = (f"floor {step.floor_s * 1e3:.3f} ms: {_share(step.fraction_of_floor)} of "
                 f"the floor")
    if not kernels:
        _console().print(f"{step.model} {step.quant} on {step.hardware} ({device}{ranks}): "
                         f"decode, {step.rows} row(s), context {step.context}", markup=False)
    _console().print(f"step {step.step_s * 1e3:.3f} ms (median of {args.steps}, "
                     f"{'graph replay' if step.graph else 'launches'}), {floor}; "
                     f"{step.launches} launches" + (f"; {len(records)} evidence records in the store"
                                                    if records else ""), markup=False)
    return 0


def _share(fraction: float) -> str:
    """A fraction as a percentage that never rounds a non-zero value to ``0%``.

    >>> _share(0.0004), _share(0.5)
    ('0.04%', '50%')
    """
    if 0 < fraction < 0.01:
        return f"{fraction:.2%}" if fraction >= 0.0001 else "< 0.01%"
    return f"{fraction:.0%}"


def _bench_prefill(args: argparse.Namespace) -> int:
    """``met bench --mode prefill``: one prompt of ``--rows`` tokens into a fresh cache, timed
    whole (the plan's memory floor beside it; a prefill is bound by arithmetic, not bytes)."""
    from metrale.lkb.errors import ConfigError
    from metrale.runtime.bench import time_prefill
    from metrale.runtime.parallel import load_engine

    if args.record:
        raise ConfigError("evidence comes from the decode step's kernels, timed one by one",
                          key="--record", expected="--mode decode", found="--mode prefill")
    with _progress(args, f"loading {args.model}"):
        eng = load_engine(args.model, args.tp,
                          hardware=names.hardware_class(args.hardware, args.kernels),
                          quant=args.quant, max_ctx=args.rows, policy=args.policy,
                          random=args.random)
    with eng, _progress(args, f"timing {args.steps} prefill steps"):
        step = (time_prefill(eng, args.rows, steps=args.steps) if args.tp == 1
                else eng.time_step("prefill", args.rows, args.steps))
        device = eng.backend.limits.name
    if args.format == "json":
        print(json.dumps({
            "model": step.model, "quant": step.quant, "hardware": step.hardware,
            "device": device, "mode": "prefill", "rows": step.rows, "policy": args.policy,
            "tp": args.tp,
            "step_s": step.step_s,
            "floor_s": step.floor_s, "bytes_moved": step.bytes_moved,
            "launches": step.launches}, indent=2))
        return 0
    ranks = f", {args.tp} ranks" if args.tp > 1 else ""
    _console().print(f"{step.model} {step.quant} on {step.hardware} ({device}{ranks}): prefill of "
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
