"""The performance tables of README.md and docs/performance.md, and docs/decode.svg, generated
from the committed benchmark results (``benchmarks/results/*.json``); no figure is typed by hand.

Each generated block sits between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``; the
text around the blocks is the docs' own. A result file that is missing, or a run that did not
measure a cell (no peers, no batch 8, a format left out), shows as "—" and the block says what
the committed run holds, so a new run of a benchmark needs nothing but this script:

    python benchmarks/report.py           # rewrite the blocks and the chart
    python benchmarks/report.py --check   # exit 1, naming the files, if any is out of date

``tests/mock/test_report.py`` runs the check: the docs cannot disagree with the JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README, PERFORMANCE, CHART = ROOT / "README.md", ROOT / "docs" / "performance.md", \
    ROOT / "docs" / "decode.svg"
QUANT_ORDER = ("bf16", "fp8", "mxfp4", "nvfp4")
POLICIES = ("exact", "bounded")
DASH = "—"
_BLOCK = re.compile(r"(<!-- report:([a-z0-9-]+) -->\n)(.*?)(<!-- /report:\2 -->)", re.S)



def load(name: str, results: Path = RESULTS) -> dict[str, Any] | None:
    """``results/<name>.json``, or ``None`` when it is not committed."""
    path = results / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _ms(seconds: float | None, digits: int = 2) -> str:
    return DASH if seconds is None else f"{seconds * 1e3:.{digits}f}"


def _median(values: Iterable[float]) -> float | None:
    values = [v for v in values if isinstance(v, int | float)]
    return statistics.median(values) if values else None


def _order(values: Iterable[str], first: tuple[str, ...] = ()) -> list[str]:
    seen = list(dict.fromkeys(values))
    return [v for v in first if v in seen] + [v for v in seen if v not in first]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _source(name: str, command: str, gpu: str | None = None) -> str:
    """Where a block's figures come from (and, where the file names it, the GPU that made them)
    and the command that makes them again."""
    on = f" ({gpu})" if gpu else ""
    return f"From `benchmarks/results/{name}.json`{on}; reproduce with `{command}`."


# --- decode ----------------------------------------------------------------------------------

class Decode:
    """The decode rows of a ``gpu_decode.json``, indexed by (model, batch, quant, policy); a key
    measured more than once takes the median. Rows without a policy are the exact plans."""

    def __init__(self, doc: dict[str, Any] | None, file: str | None = None) -> None:
        self.doc = doc or {}
        self.file = file  # the results file's stem, where it is not the run's own name
        self.rows: dict[tuple, list[dict]] = {}
        for r in self.doc.get("rows", []):
            if isinstance(r, dict) and {"model", "batch", "quant"} <= r.keys():
                key = (r["model"], int(r["batch"]), r["quant"], r.get("policy") or "exact")
                self.rows.setdefault(key, []).append(r)
        self.models = _order(k[0] for k in self.rows)
        self.batches = sorted({k[1] for k in self.rows})
        self.quants = _order((k[2] for k in self.rows), QUANT_ORDER)

    @property
    def command(self) -> str:
        """The command that measures the cells this run holds (with ``--name`` where the run
        has a results file of its own)."""
        policies = _order((k[3] for k in self.rows), POLICIES)
        peered = _order(k[0] for k, rs in self.rows.items() for r in rs
                        if any(r.get(f) is not None for f in ("eager_s", "compiled_s")))
        peers = bool(peered)
        quant_batches = sorted({k[1] for k in self.rows if k[2] != "bf16"})
        return " ".join(["python benchmarks/bench_gpu_decode.py", *self.models,
                         "--batches", ",".join(map(str, self.batches)),
                         "--quants", ",".join(self.quants), "--policies", ",".join(policies),
                         *(["--quant-batches", ",".join(map(str, quant_batches))]
                           if quant_batches and quant_batches != [1] else []),
                         *([] if peers else ["--no-hf"]),
                         *(["--peer-models", ",".join(peered)]
                           if peers and peered != self.models else []),
                         *([f"--name {self.name}"] if self.name != "gpu_decode" else [])])

    @property
    def name(self) -> str:
        """The run's results file stem (``bench_gpu_decode.py --name``)."""
        return self.file or self.doc.get("benchmark") or "gpu_decode"

    def get(self, model: str, batch: int, quant: str, policy: str, field: str) -> float | None:
        rows = [r for r in self.rows.get((model, batch, quant, policy), ())
                if r.get("finite", True)]
        return _median(r.get(field) for r in rows)

    def any(self, model: str, batch: int, field: str) -> float | None:
        """``field`` of the model's bf16 rows at ``batch`` under any policy (peers, floors)."""
        return _median(r.get(field) for p in POLICIES
                       for r in self.rows.get((model, batch, "bf16", p), ()))

    def cell(self, model: str, batch: int, quant: str) -> str:
        exact, bounded = (self.get(model, batch, quant, p, "step_s") for p in POLICIES)
        if exact is None and bounded is None:
            broken = any(not r.get("finite", True) for p in POLICIES
                         for r in self.rows.get((model, batch, quant, p), ()))
            return "not finite" if broken else DASH
        return f"{_ms(exact)} / {_ms(bounded)}"


def _copy_rate(d: Decode) -> str:
    """The sentence on the run's device-to-device copy rate (nothing where it has none)."""
    copy = d.doc.get("copy_rate_bytes_per_s")
    return f" The device-to-device copy in the same run moved {copy / 1e12:.2f} TB/s." if copy \
        else ""


def decode_summary(doc: dict[str, Any] | None) -> str:
    """README's table: per model and batch, each format's step (exact / bounded), the bf16
    floor and the peers."""
    d = Decode(doc)
    if not d.rows:
        return "No decode result is committed (`benchmarks/results/gpu_decode.json`)."
    header = ["model", "batch", *d.quants, "HBM floor (bf16)", "HF eager", "HF + torch.compile"]
    rows = []
    for model in d.models:
        for batch in d.batches:
            if not any(k[:2] == (model, batch) for k in d.rows):
                continue
            rows.append([model, str(batch), *(d.cell(model, batch, q) for q in d.quants),
                         _ms(d.any(model, batch, "floor_s")), _ms(d.any(model, batch, "eager_s")),
                         _ms(d.any(model, batch, "compiled_s"))])
    device = f" on one {d.doc['device']}" if d.doc.get("device") else ""
    context = d.doc.get("context")
    return (f"Decode step of the sm_90 plans{device}, ms, Metrale's exact / bounded policy; "
            + (f"{context} cached positions, " if context else "") + "random weights, CUDA "
            "graph replay. " + _source("gpu_decode", d.command, d.doc.get("gpu")) + "\n\n"
            + _table(header, rows))


def decode_detail(doc: dict[str, Any] | None) -> str:
    """docs/performance.md's table: every measured step with its floor and launches."""
    d = Decode(doc)
    if not d.rows:
        return "No decode result is committed (`benchmarks/results/gpu_decode.json`)."
    header = ["model", "batch", "weights", "exact ms", "bounded ms", "HBM floor ms",
              "best / floor", "launches"]
    rows = []
    for model in d.models:
        for batch in d.batches:
            for quant in d.quants:
                steps = [d.get(model, batch, quant, p, "step_s") for p in POLICIES]
                floor = _median(d.get(model, batch, quant, p, "floor_s") for p in POLICIES)
                if all(s is None for s in steps) and floor is None:
                    continue
                best = min((s for s in steps if s is not None), default=None)
                launches = _median(d.get(model, batch, quant, p, "launches") for p in POLICIES)
                rows.append([model, str(batch), quant, *(_ms(s, 3) for s in steps),
                             _ms(floor, 3),
                             DASH if best is None or not floor else f"{best / floor:.2f}×",
                             DASH if launches is None else f"{launches:.0f}"])
    return (_source("gpu_decode", d.command, d.doc.get("gpu")) + _copy_rate(d) + "\n\n"
            + _table(header, rows))


def decode_peers(doc: dict[str, Any] | None) -> str:
    """The peers of the same run, against Metrale's exact bf16 step."""
    d = Decode(doc)
    fields = (("eager_s", "HF eager"), ("compiled_s", "HF + torch.compile"),
              ("peer_compiled_s", "plain torch + torch.compile"))
    rows = []
    for model in d.models:
        for batch in d.batches:
            exact = d.get(model, batch, "bf16", "exact", "step_s")
            cells = [d.any(model, batch, f) for f, _ in fields]
            if exact is None or all(c is None for c in cells):
                continue
            rows.append([model, str(batch), _ms(exact, 3),
                         *(DASH if c is None else f"{_ms(c, 3)} ({c / exact:.2f}×)"
                           for c in cells)])
    if not rows:
        return ("The committed decode run measured no peer (it ran with `--no-hf`); "
                f"`{d.command.replace(' --no-hf', '')}` measures them in the same process.")
    return (_source("gpu_decode", d.command, d.doc.get("gpu"))
            + " In brackets: the peer's time over Metrale's.\n\n"
            + _table(["model", "batch", "Metrale exact bf16 ms", *(n for _, n in fields)], rows))


def decode_run(doc: dict[str, Any] | None, name: str, *, batched: bool = False) -> str:
    """A decode run of a results file of its own (a model measured beside the committed run):
    each step with its floor, its share of the floor and the peers of the same run; ``batched``:
    its steps of more than one row only."""
    d = Decode(doc, name)
    keys = [k for k in d.rows if not batched or k[1] > 1]
    if not keys:
        return f"No result is committed (`benchmarks/results/{name}.json`)."
    fields = [(f, n) for f, n in (("eager_s", "HF eager"), ("compiled_s", "HF + torch.compile"))
              if any(d.get(*k, f) is not None for k in keys)]  # the peers the run measured
    rows = []
    for model, batch, quant, policy in keys:
        step, floor = (d.get(model, batch, quant, policy, f) for f in ("step_s", "floor_s"))
        peers = [d.get(model, batch, quant, policy, f) for f, _ in fields]
        rows.append([model, str(batch), quant, policy, _ms(step, 3), _ms(floor, 3),
                     DASH if step is None or not floor else f"{floor / step:.0%}",
                     *(DASH if c is None or step is None else f"{_ms(c, 2)} ({c / step:.1f}×)"
                       for c in peers),
                     DASH if (n := d.get(model, batch, quant, policy, "launches")) is None
                     else f"{n:.0f}"])
    return (_source(name, d.command, d.doc.get("gpu")) + _copy_rate(d)
            + (" Its steps of more than one row"
               + (" (the file holds its one-row steps too)." if len(keys) < len(d.rows) else ".")
               if batched else "")
            + " Steps in ms"
            + ("; the peers run transformers' model in bf16 (in brackets: the peer's time over "
               "Metrale's)." if fields else ", no peer in this run.")
            + "\n\n"
            + _table(["model", "batch", "weights", "policy", "step ms", "HBM floor ms",
                      "of the floor", *(n for _, n in fields), "launches"], rows))


def decode_chart(doc: dict[str, Any] | None) -> str:
    """docs/decode.svg: batch-1 steps against their floor and peers, one panel per model."""
    d = Decode(doc)
    bars = (("exact", "#2563eb"), ("bounded", "#f59e0b"), ("HBM floor", "#9ca3af"),
            ("HF + torch.compile", "#16a34a"))
    panels = []
    for model in d.models:
        if not any(k[:2] == (model, 1) for k in d.rows):
            continue
        groups = []
        for quant in d.quants:
            vals = [d.get(model, 1, quant, "exact", "step_s"),
                    d.get(model, 1, quant, "bounded", "step_s"),
                    _median(d.get(model, 1, quant, p, "floor_s") for p in POLICIES),
                    d.any(model, 1, "compiled_s") if quant == "bf16" else None]
            if any(v is not None for v in vals[:2]):
                groups.append((quant, vals))
        if groups:
            panels.append((model, groups))
    width, bar_h, left, right = 720, 12, 70, 90
    height = 40 + sum(28 + len(g) * (len(bars) * bar_h + 10) for _, g in panels) + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           '<text x="10" y="18" font-size="13" font-weight="bold">Decode step, batch 1 (ms): '
           'Metrale against its HBM floor and the compiled peer</text>']
    x = 10
    for name, color in bars:
        out.append(f'<rect x="{x}" y="26" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="35">{name}</text>')
        x += 24 + 7 * len(name)
    y = 50
    for model, groups in panels:
        top = max(v for _, vals in groups for v in vals if v is not None)
        scale = (width - left - right) / top
        out.append(f'<text x="10" y="{y + 12}" font-weight="bold">{model}</text>')
        y += 20
        for quant, vals in groups:
            out.append(f'<text x="10" y="{y + len(bars) * bar_h / 2 + 4:.0f}">{quant}</text>')
            for (_, color), v in zip(bars, vals):
                if v is not None:
                    out.append(f'<rect x="{left}" y="{y}" width="{v * scale:.1f}" '
                               f'height="{bar_h - 2}" fill="{color}"/>'
                               f'<text x="{left + v * scale + 4:.1f}" y="{y + bar_h - 3}">'
                               f'{v * 1e3:.3f}</text>')
                y += bar_h
            y += 10
        y += 8
    out.append("</svg>")
    return "\n".join(out) + "\n"


# --- prefill ---------------------------------------------------------------------------------

def prefill_command(doc: dict[str, Any] | None) -> str:
    """The command that measures what a ``gpu_prefill.json`` holds."""
    doc = doc or {}
    cases = [c for c in doc.get("cases", []) if isinstance(c, dict)]
    steps = [s for s in doc.get("steps", []) if isinstance(s, dict)]
    models = _order(str(x.get("model")) for x in (*cases, *steps))
    words = ["python benchmarks/bench_gpu_prefill.py", "--models", ",".join(models)]
    if cases:
        words += ["--weights", ",".join(_order((str(c.get("weight")) for c in cases),
                                               QUANT_ORDER)),
                  "--rows", ",".join(str(n) for n in sorted({int(c["rows"]) for c in cases
                                                             if "rows" in c}))]
        k_blocks = sorted({int(c.get("k_block", 256)) for c in cases}, reverse=True)
        if k_blocks != [256]:
            words += ["--k-blocks", ",".join(map(str, k_blocks))]
    else:
        words += ["--rows", '""']
    if steps:
        words += ["--steps", ",".join(str(n) for n in sorted({int(s["rows"]) for s in steps
                                                              if "rows" in s})),
                  "--step-quants", ",".join(_order((str(s.get("quant", "bf16")) for s in steps),
                                                   QUANT_ORDER)),
                  "--policies", ",".join(_order((s.get("policy") or "exact" for s in steps),
                                                POLICIES))]
        if not any(s.get("hf_eager_s") is not None for s in steps):
            words.append("--no-hf")
    else:
        words += ["--steps", '""']
    return " ".join(words)


def prefill_steps(doc: dict[str, Any] | None) -> str:
    # a variant kernel folder's steps (--kernels-dirs) are an experiment's, not the shipped plans'
    steps = [s for s in (doc or {}).get("steps", [])
             if isinstance(s, dict) and not s.get("kernels_dir")]
    rows: dict[tuple, list] = {}
    for s in steps:
        key = (s.get("model"), s.get("quant", "bf16"), s.get("policy") or "exact")
        rows.setdefault(key, []).append(s)
    lengths = sorted({int(s["rows"]) for s in steps if "rows" in s})
    if not rows or not lengths:
        return ("The committed prefill run timed no whole step (it ran with `--steps \"\"`); "
                "`python benchmarks/bench_gpu_prefill.py --rows \"\" --steps 512,2048 "
                "--step-quants bf16 --policies exact,bounded` times them beside transformers' "
                "eager forward.")
    # generation's prefill computes the last row's logits alone (`met run`); transformers'
    # forward, the peer, all of them, as the whole step does
    last = any(s.get("last_logits_step_s") for s in steps)
    table = []
    for (model, quant, policy), ss in rows.items():
        cells = []
        for n in lengths:
            at = [s for s in ss if int(s.get("rows", -1)) == n]
            t = _median(s.get("step_s") for s in at)
            peer = _median(s.get("hf_eager_s") for s in at)
            cells.append(DASH if t is None else _ms(t) + ("" if peer is None
                                                          else f" (HF {_ms(peer)})"))
            if last:
                t_last = _median(s.get("last_logits_step_s") for s in at)
                cells.append(DASH if t_last is None else _ms(t_last))
        table.append([str(model), quant, policy, *cells])
    header = [h for n in lengths for h in (f"{n} tokens", f"{n}, last row's logits only")
              if last or not h.endswith("only")]
    return (_source("gpu_prefill", prefill_command(doc), doc.get("gpu")) + " Whole steps in ms, "
            "transformers' eager forward (every row's logits) in brackets; the step that "
            "generation runs computes the last row's logits only.\n\n"
            + _table(["model", "weights", "policy", *header], table))


def prefill_gemm(doc: dict[str, Any] | None) -> str:
    cases = [c for c in (doc or {}).get("cases", []) if isinstance(c, dict) and c.get("finite")]
    groups: dict[tuple, dict[int, list]] = {}
    for c in cases:
        # the bounded chain_* relations' points (k one chain of 16-wide steps) a row of their own
        weight = c.get("weight") if c.get("k_block", 256) == 256 else f"{c.get('weight')}, k chain"
        groups.setdefault((c.get("model"), weight), {}).setdefault(c.get("rows"), []).append(c)
    if not groups:
        return "The committed prefill run timed no GEMM (`benchmarks/results/gpu_prefill.json`)."
    peak = (doc or {}).get("tensor_peak")
    row_counts = sorted({n for by_rows in groups.values() for n in by_rows})
    formats = QUANT_ORDER + ("f32",)
    rows = []
    for (model, weight), by_rows in sorted(groups.items(), key=lambda kv: (
            str(kv[0][0]), formats.index(kv[0][1]) if kv[0][1] in formats else len(formats),
            str(kv[0][1]))):
        cells = [str(model), str(weight)]
        best = 0.0
        for n in row_counts:
            cs = by_rows.get(n, [])
            tflops = [c["tflops"] for c in cs if "tflops" in c]
            vs = _median(c.get("vs_peer") for c in cs)
            best = max([best, *tflops])
            cells += [f"{min(tflops):.0f}–{max(tflops):.0f}" if tflops else DASH,
                      DASH if vs is None else f"{vs:.2f}×"]
        cells.append(DASH if not peak or not best else f"{best * 1e12 / peak:.0%}")
        rows.append(cells)
    head = ["model", "weights"]
    for n in row_counts:
        head += [f"{n} rows: TFLOP/s", "vs cuBLAS (median)"]
    return (_source("gpu_prefill", prefill_command(doc), doc.get("gpu")) + " Each model's "
            "GEMM-shaped matmuls alone (one launch of each layer's, the head's and the last "
            "layer's down projection with its residual add); the peer is cuBLAS (torch.matmul in "
            "bf16) on the same shapes" + ("; a \"k chain\" row times the points of the bounded "
            "`chain_*` relations (k one chain of 16-wide steps, `gemm_chain.cu`)"
            if any(c.get("k_block", 256) != 256 for c in cases) else "") + ".\n\n"
            + _table([*head, "best of the tensor peak"], rows))


def prefill_attention(doc: dict[str, Any] | None) -> str:
    cases = [c for c in (doc or {}).get("cases", []) if isinstance(c, dict)]
    rows = []
    for c in cases:
        peer = (c.get("peer") or {}).get("seconds")
        cells = []
        for kind in ("tree", "online"):
            s = (c.get(kind) or {}).get("seconds") if (c.get(kind) or {}).get("finite") else None
            cells.append(DASH if s is None else f"{s * 1e6:.0f}"
                         + ("" if not peer else f" ({peer / s:.2f}×)"))
        rows.append([str(c.get("model")), str(c.get("rows")), *cells,
                     DASH if peer is None else f"{peer * 1e6:.0f}"])
    if not rows:
        return "No prefill attention result is committed."
    command = " ".join([
        "python benchmarks/bench_gpu_prefill_attention.py",
        "--models", ",".join(_order(str(c.get("model")) for c in cases)),
        "--rows", ",".join(str(n) for n in sorted({int(c["rows"]) for c in cases if "rows" in c})),
        *(["--online"] if any("online" in c for c in cases) else [])])
    return (_source("gpu_prefill_attention", command) + " One layer's attention alone, µs; in "
            "brackets its speed relative to torch's fused attention.\n\n"
            + _table(["model", "tokens", "two-pass (exact) µs", "online (bounded) µs",
                      "torch sdpa µs"], rows))


# --- machine code ----------------------------------------------------------------------------

def sass_mix(doc: dict[str, Any] | None) -> str:
    """What the multi-row GEMVs' loops issue a KiB of weights (``bench_sass_mix.py``), with x in
    bf16 (as shipped) and in f32, against the FMA floor; one row per entry and weight format."""
    rows_in = [r for r in (doc or {}).get("rows", []) if isinstance(r, dict)]
    by: dict[tuple, dict[str, dict]] = {}
    for r in rows_in:
        if not r.get("variant"):
            by.setdefault((r.get("entry"), r.get("weight")), {})[str(r.get("act"))] = r
    if not by:
        return "No machine-code reading is committed (`benchmarks/results/sass_mix.json`)."
    table = []
    for (entry, weight), acts in sorted(by.items(), key=lambda kv: (
            next(iter(kv[1].values())).get("rows", 0), str(kv[0][1]), str(kv[0][0]))):
        first = next(iter(acts.values()))
        cells = []
        for act in ("bf16", "f32"):
            r = acts.get(act)
            cells.append(DASH if r is None else
                         f"{r['issued_per_kib']:.0f} ({r['of_floor']:.0%} FFMA)")
        table.append([f"`{entry}`", str(weight), str(first.get("rows")), *cells,
                      f"{first['floor_per_kib']:.0f}"])
    weights = ",".join(_order(str(k[1]) for k in by))
    acts = ",".join(_order(str(a) for v in by.values() for a in v))
    command = f"python benchmarks/bench_sass_mix.py --weights {weights} --acts {acts}"
    return (_source("sass_mix", command) + " Warp instructions the entry's hot loop issues for "
            "each KiB of weights, read from its sm_90a machine code (no GPU); the floor is its "
            "FFMAs alone. x in f32 is what the same loop issues were the activations widened "
            "before it.\n\n"
            + _table(["entry", "weights", "rows", "x bf16 (shipped)", "x f32", "FMA floor"],
                     table))


# --- host, planning, build -------------------------------------------------------------------

def _dig(doc: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(doc, list):
            doc = doc[int(part)] if part.lstrip("-").isdigit() and doc else None
        elif isinstance(doc, dict):
            doc = doc.get(part)
        else:
            return None
    return doc


HOST: tuple[tuple[str, str, str, Callable[[Any], str], str, str], ...] = (
    ("host_decode", "Qwen3-0.6B decode step on the host backend (f32, 2 threads)",
     "engine_step_s", lambda v: f"{v * 1e3:.0f} ms", "", "python benchmarks/bench_host_decode.py"),
    ("host_decode", "the same step in transformers (CPU torch, f32)", "transformers_step_s",
     lambda v: f"{v * 1e3:.0f} ms", "", "python benchmarks/bench_host_decode.py"),
    ("host_decode", "the host step's time over transformers'", "ratio", lambda v: f"{v:.2f}×",
     "goal_ratio", "python benchmarks/bench_host_decode.py"),
    ("host_semantics", "Qwen3-0.6B decode step in the reference semantics (bf16)",
     "step_ms_median", lambda v: f"{v:.0f} ms", "", "python benchmarks/bench_host_semantics.py"),
    ("executor_memory", "executor memory over weights + KV cache + live activations", "ratio",
     lambda v: f"{v:.3f}×", "goal_ratio", "python benchmarks/bench_executor_memory.py"),
    ("checkpoint_load", "load a Qwen3-0.6B bf16 checkpoint, warm", "warm_median_s",
     lambda v: f"{v:.3f} s", "goal_warm_s", "python benchmarks/bench_checkpoint_load.py"),
    ("checkpoint_load", "its peak RSS over the bytes it touched", "peak_rss_over_touched",
     lambda v: f"{v:.2f}×", "goal_peak_rss_over_touched",
     "python benchmarks/bench_checkpoint_load.py"),
    ("plan", "`met plan llama-3.1-70b --hardware sm_90`, cold process", "cold_met_plan_70b_s",
     lambda v: f"{v:.2f} s", "goal_cold_s", "python benchmarks/bench_plan.py"),
    ("plan", "warm 70B plan over a warm 0.6B plan", "warm_extra_s", lambda v: f"+{v:.2f} s",
     "goal_warm_extra_s", "python benchmarks/bench_plan.py"),
    ("build", "build llama-3.1-8b bf16 for sm_90, cold", "cold.wall_s", lambda v: f"{v:.1f} s",
     "targets.cold_s", "python benchmarks/bench_build.py"),
    ("build", "the same build, warm", "warm.wall_s", lambda v: f"{v:.2f} s", "targets.warm_s",
     "python benchmarks/bench_build.py"),
    ("diagram", "compose {boxes} boxes", "rows.-1.compose_s", lambda v: f"{v * 1e3:.0f} ms", "",
     "python benchmarks/bench_diagram.py"),
    ("diagram", "compare two diagrams of {boxes} boxes", "rows.-1.compare_s",
     lambda v: f"{v * 1e3:.0f} ms", "", "python benchmarks/bench_diagram.py"),
)


def host(results: Path = RESULTS) -> str:
    rows = []
    for name, what, field, fmt, goal, command in HOST:
        doc = load(name, results)
        value = _dig(doc, field)
        g = _dig(doc, goal) if goal else None
        boxes = _dig(doc, "rows.-1.boxes")
        rows.append([what.format(boxes=f"{boxes:,}" if isinstance(boxes, int) else "the most"),
                     fmt(value) if isinstance(value, int | float) else DASH,
                     DASH if not isinstance(g, int | float) else f"≤ {fmt(g)}",
                     f"`{command}`", f"`{name}.json`"])
    return ("Measured on the 2-core CPU machine CI runs on (the build with `nvcc`).\n\n"
            + _table(["figure", "measured", "goal", "reproduce", "JSON"], rows))


# --- cold start ------------------------------------------------------------------------------

def cold_start(doc: dict[str, Any] | None) -> str:
    """Time to the first token of ``met run MODEL --hardware H`` in a fresh process on a fresh
    machine (every cache empty), then warm (``bench_cold_start.py``), against the goal.

    >>> print(cold_start({"hardware": "sm_90", "gpu": "GPU", "cores": 16, "goal_s": 5.0,
    ...     "goal_model": "m", "rows": [{"model": "m", "cold": {"wall_s": 4.2, "load_s": 2.0,
    ...     "prefill_ms": 90.0}, "warm": {"wall_s": 1.6}, "driver_cold": {"wall_s": 1.7}}]}))
    ... # doctest: +ELLIPSIS
    From `benchmarks/results/cold_start.json` (GPU, 16 cores); reproduce with ...
    <BLANKLINE>
    | model | fresh machine | of it: load | of it: prefill | warm | driver's cache empty | goal |
    |---|---|---|---|---|---|---|
    | m | 4.2 s | 2.0 s | 90 ms | 1.6 s | 1.7 s | ≤ 5.0 s |
    """
    rows_in = [r for r in (doc or {}).get("rows", []) if isinstance(r, dict)]
    if not rows_in:
        return "No cold-start run is committed (`benchmarks/results/cold_start.json`)."

    def secs(r: dict, part: str, field: str = "wall_s") -> str:
        v = _dig(r, f"{part}.{field}")
        return f"{v:.1f} s" if isinstance(v, int | float) else DASH

    table = []
    for r in rows_in:
        prefill = _dig(r, "cold.prefill_ms")
        goal = f"≤ {doc['goal_s']:.1f} s" if r.get("model") == doc.get("goal_model") else DASH
        table.append([str(r.get("model")), secs(r, "cold"), secs(r, "cold", "load_s"),
                      f"{prefill:.0f} ms" if isinstance(prefill, int | float) else DASH,
                      secs(r, "warm"), secs(r, "driver_cold"), goal])
    models = ",".join(str(r.get("model")) for r in rows_in)
    command = f"python benchmarks/bench_cold_start.py --models {models}"
    return (f"From `benchmarks/results/cold_start.json` ({doc.get('gpu')}, "
            f"{doc.get('cores')} cores); reproduce with `{command}` on the lent GPU. Each "
            f"figure is the wall time of `met run MODEL "
            f"--hardware {doc.get('hardware')} --steps 1` in a fresh process, which ends with "
            "the first token: on a fresh machine (Metrale's cache and the CUDA driver's "
            "empty), then with both warm, then with only the driver's empty.\n\n"
            + _table(["model", "fresh machine", "of it: load", "of it: prefill", "warm",
                      "driver's cache empty", "goal"], table))


# --- the files -------------------------------------------------------------------------------

def blocks(results: Path = RESULTS) -> dict[str, str]:
    """Every generated block by name."""
    decode, prefill = load("gpu_decode", results), load("gpu_prefill", results)
    return {"decode-summary": decode_summary(decode), "decode-detail": decode_detail(decode),
            "decode-peers": decode_peers(decode), "prefill-steps": prefill_steps(prefill),
            "prefill-gemm": prefill_gemm(prefill),
            "prefill-attention": prefill_attention(load("gpu_prefill_attention", results)),
            "sass-mix": sass_mix(load("sass_mix", results)),
            "cold-start": cold_start(load("cold_start", results)),
            "decode-gpt-oss": decode_run(load("gpu_decode_gpt_oss", results),
                                         "gpu_decode_gpt_oss"),
            "decode-batched": decode_run(load("gpu_decode_batched", results),
                                         "gpu_decode_batched", batched=True),
            "host": host(results)}


def render(text: str, generated: dict[str, str], file: object = "text") -> str:
    """``text`` with each marked block replaced; a marker naming no block is an error."""
    def one(m: re.Match) -> str:
        if m.group(2) not in generated:
            raise KeyError(f"{file}: no generated block named {m.group(2)!r}")
        return f"{m.group(1)}{generated[m.group(2)].rstrip()}\n{m.group(4)}"

    return _BLOCK.sub(one, text)


def outputs(results: Path = RESULTS, root: Path = ROOT) -> dict[Path, str]:
    """What each generated file should hold."""
    generated = blocks(results)
    out = {p: render(p.read_text(encoding="utf-8"), generated, p)
           for p in (root / "README.md", root / "docs" / "performance.md",
                     root / "docs" / "models.md") if p.is_file()}
    out[root / "docs" / "decode.svg"] = decode_chart(load("gpu_decode", results))
    return out


def stale(results: Path = RESULTS, root: Path = ROOT) -> list[Path]:
    """The generated files whose text is not what the results make."""
    return [p for p, text in outputs(results, root).items()
            if not p.is_file() or p.read_text(encoding="utf-8") != text]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if out of date")
    args = ap.parse_args(argv)
    if args.check:
        behind = stale()
        for p in behind:
            print(f"{p.relative_to(ROOT)} is out of date: run python benchmarks/report.py",
                  file=sys.stderr)
        return 1 if behind else 0
    sys.path.insert(0, str(ROOT))
    from metrale.lkb.files import atomic_write

    for p, text in outputs().items():
        if not p.is_file() or p.read_text(encoding="utf-8") != text:
            atomic_write(p, text)
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
