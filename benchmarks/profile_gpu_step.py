"""One layer of the decode step under Nsight Compute: where each kernel's warps wait.

The step timings (``bench_gpu_decode.py``) say how long each kernel takes; this says why. For
each model and quant it builds the same sm_90 engine (random weights, full cache, every row at
position 1024), runs the step once to load its modules, then launches the step again with the
profiler on for the launches of its second layer only, under
``ncu --set full --clock-control none``. From the report it keeps, per kernel (with the plan's
label and point of its launch): the duration, DRAM throughput, achieved occupancy, issued
instructions per cycle, registers, and the warp stall reasons (cycles a warp spends stalled per
issued instruction, by reason), which name the limit: ``long_scoreboard`` (waiting on global
memory), ``no_instruction`` (the instruction cache), ``barrier``, ``membar``,
``math_pipe_throttle`` and so on.

Run on the lent GPU (ncu must be on the PATH; the clocks are left alone):
``python3 benchmarks/profile_gpu_step.py qwen3-0.6b:bf16 llama-3.1-8b:bf16 --out DIR``
(``--policy bounded`` profiles the bounded plans: the tensor-core GEMVs; ``--prefill ROWS`` the
prefill of a ROWS-token prompt, one sequence from position 0, in place of the decode step). Writes
``benchmarks/results/gpu_profile.json`` (the summary; ``gpu_profile_bounded.json`` under
``--policy bounded``, ``gpu_profile_prefill.json`` under ``--prefill``), and per target
``DIR/<model>_<quant>.csv`` (``..._prefill<ROWS>.csv`` under ``--prefill``)
(ncu's details page), ``DIR/<model>_<quant>.raw.csv`` (its raw page: every metric collected)
and ``DIR/<model>_<quant>_<source>.sass.csv`` (per-instruction stall samples of the kernels
``--source`` names). The summary also keeps L2's and the SM's throughput and the tensor pipe's
busy share, which say whether a tensor-core kernel is fed or computing.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result  # noqa: E402

KEEP = {
    "gpu__time_duration.sum": "seconds",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes_read.sum": "dram_read_bytes",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy_pct",
    "smsp__inst_executed.sum": "instructions",
    "sm__inst_executed.avg.per_cycle_active": "ipc",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_active_pct",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__occupancy_limit_registers": "blocks_limit_registers",
    "launch__occupancy_limit_shared_mem": "blocks_limit_shared",
    "sm__maximum_warps_per_active_cycle_pct": "occupancy_limit_pct",
    "lts__t_sector_hit_rate.pct": "l2_hit_pct",
    "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum": "global_load_requests",
    "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum": "global_load_sectors",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "lts__t_bytes.sum": "l2_bytes",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1_pct",
}
UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "nsecond": 1e-9, "usecond": 1e-6,
         "msecond": 1e-3, "second": 1.0, "byte": 1.0, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9}
"""ncu's units (the raw page's second row) to seconds and bytes; its raw page spells times
``us`` (2025.3), its metric docs ``usecond``."""
STALL = "smsp__average_warps_issue_stalled_"
STALL_END = "_per_issue_active.ratio"


def child(model: str, quant: str, batch: int, launches: Path, policy: str = "exact",
          prefill: int = 0) -> None:
    """Run inside ncu: the step (planned under ``policy``; with ``prefill``, the prefill of a
    prompt of that many tokens instead of the decode step) once, then its second layer with the
    profiler on; the plan's label and point of each profiled launch, in order, go to
    ``launches`` (JSON)."""
    import cupy
    from bench_gpu_decode import decode_engine
    from bench_gpu_prefill import prefill_engine

    from metrale.runtime.bench import decode_program, prefill_program

    if prefill:
        eng = prefill_engine(model, quant, prefill, policy, graphs=False)
        prog = prefill_program(eng, prefill)
    else:
        eng, _ = decode_engine(model, quant, batch, graphs=False, policy=policy)
        prog = decode_program(eng, batch)
    prog.run()
    families = [ln.kernel.family for ln in prog.launches]
    lo, hi = second_layer([ln.kernel.layer for ln in prog.launches])
    be = eng.backend
    stream = be.stream()
    for i, (ln, args) in enumerate(zip(prog.launches, prog.arguments)):
        if i == lo:
            be.synchronize(stream)
            cupy.cuda.runtime.profilerStart()
        be.launch(ln.handle, ln.grid, ln.block, ln.shared_mem, args, stream,
                  dependent=ln.dependent)
        if i == hi - 1:
            be.synchronize(stream)
            cupy.cuda.runtime.profilerStop()
    be.synchronize(stream)
    print("profiled launches", lo, "to", hi - 1, ":", " ".join(families[lo:hi]))
    launches.write_text(json.dumps([{"kernel": f"#{ln.kernel.index} {ln.kernel.family}",
                                     "point": str(ln.kernel.point)}
                                    for ln in prog.launches[lo:hi]]))
    eng.close()


def second_layer(layers: list[int | None]) -> tuple[int, int]:
    """The launches ``[lo, hi)`` of a step's second layer, from its input norm on, given each
    launch's layer in the plan (``None`` for the embedding and the head). The plan's layers,
    not the families' order: a prefill plan's first launches repeat inside a layer (fp8's
    dequant before each GEMM under the exact policy).

    >>> second_layer([None, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 2, 2, None])
    (8, 15)
    >>> second_layer([None, 0, 0, None])
    Traceback (most recent call last):
    ...
    ValueError: one layer only: no launch of layer 1
    """
    at = [i for i, layer in enumerate(layers) if layer == 1]
    if not at:
        raise ValueError("one layer only: no launch of layer 1")
    lo, hi = at[0], at[-1] + 1
    if len(at) != hi - lo:
        raise ValueError(f"layer 1's launches are not contiguous: {at}")
    return lo, hi


def target(text: str) -> tuple[str, str]:
    """``MODEL:QUANT`` as a pair; anything else is a usage error naming the argument."""
    model, sep, quant = text.partition(":")
    if not (model and sep and quant) or ":" in quant:
        raise argparse.ArgumentTypeError(f"expected MODEL:QUANT (e.g. llama-3.1-8b:mxfp4), "
                                         f"got {text!r}")
    return model, quant


def ncu_csv(report: Path, *args: str) -> str:
    return subprocess.run(["ncu", "--import", str(report), "--csv", *args], check=True,
                          capture_output=True, text=True).stdout


def summarize(raw_csv: str) -> list[dict]:
    r"""Per kernel of ncu's raw page (``--page raw --csv``: a header row, a units row, then one
    row per kernel), in launch order: the KEEP metrics (times in seconds, bytes in bytes) and
    the stall reasons as ``[reason, cycles per issued instruction]``, largest first.

    >>> text = ('"ID","Kernel Name","gpu__time_duration.sum","{s}barrier{e}","{s}wait{e}"\n'
    ...         '"","","usecond","",""\n"0","k","14.5","1.1","2.25"\n'
    ...        ).format(s=STALL, e=STALL_END)
    >>> k = summarize(text)[0]
    >>> k["name"], round(k["seconds"] * 1e6, 3), k["stalls"]
    ('k', 14.5, [['wait', 2.25], ['barrier', 1.1]])
    """
    rows = list(csv.DictReader(io.StringIO(raw_csv)))
    units = rows[0] if rows and not rows[0].get("ID", "").strip().isdigit() else {}
    kernels = []
    for row in rows[1:] if units else rows:
        k: dict = {"name": row.get("Kernel Name", "")}
        for metric, key in KEEP.items():
            value = _number(row.get(metric))
            scale = UNITS.get((units.get(metric) or "").strip(), 1.0)
            k[key] = None if value is None else value * scale
        stalls = [[m[len(STALL):-len(STALL_END)], _number(v)] for m, v in row.items()
                  if m and m.startswith(STALL) and m.endswith(STALL_END)]
        k["stalls"] = sorted((s for s in stalls if s[1]), key=lambda s: -s[1])
        kernels.append(k)
    return kernels


def labelled(kernels: list[dict], launches: list[dict]) -> list[dict]:
    """Each profiled kernel with the plan's label and point of its launch (they come in the same
    order); unchanged when the counts differ, which would mean ncu profiled other launches.

    >>> labelled([{"name": "metrale_linear"}], [{"kernel": "#8 linear", "point": "linear[..]"}])
    [{'name': 'metrale_linear', 'kernel': '#8 linear', 'point': 'linear[..]'}]
    >>> labelled([{"name": "metrale_linear"}], [])
    [{'name': 'metrale_linear'}]
    """
    if len(kernels) != len(launches):
        return kernels
    return [{**k, **ln} for k, ln in zip(kernels, launches)]


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", nargs="*", type=target,
                    default=[("qwen3-0.6b", "bf16"), ("llama-3.1-8b", "bf16")],
                    help="MODEL:QUANT pairs")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prefill", type=int, default=0, metavar="ROWS",
                    help="profile the prefill of a ROWS-token prompt, not the decode step")
    ap.add_argument("--policy", default="exact", help="the numerics policy of the plans")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--source", default="attention",
                    help="regex of kernel names whose per-instruction samples are exported")
    ap.add_argument("--child", type=target, help=argparse.SUPPRESS)
    ap.add_argument("--launches", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child, a.batch, a.launches, a.policy, a.prefill)
        return
    if shutil.which("ncu") is None:
        sys.exit("profile_gpu_step: ncu is not on the PATH (Nsight Compute's folder)")
    a.out.mkdir(parents=True, exist_ok=True)
    results = []
    for model, quant in a.targets:
        stem = f"{model}_{quant}".replace(".", "_").replace("-", "_") + (
            "" if a.policy == "exact" else f"_{a.policy}") + (
            f"_prefill{a.prefill}" if a.prefill else "")
        report = a.out / f"{stem}.ncu-rep"
        launches = a.out / f"{stem}.launches.json"
        cmd = ["ncu", "--set", "full", "--clock-control", "none", "--profile-from-start", "off",
               "--import-source", "no", "-f", "-o", str(report.with_suffix("")),
               sys.executable, __file__, "--child", f"{model}:{quant}", "--batch", str(a.batch),
               "--policy", a.policy, "--prefill", str(a.prefill), "--launches", str(launches)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        print(run.stdout[-3000:], run.stderr[-3000:], sep="\n")
        if run.returncode or not report.exists():
            results.append({"model": model, "quant": quant, "error": run.stderr[-2000:]})
            continue
        (a.out / f"{stem}.csv").write_text(ncu_csv(report, "--page", "details"))
        try:
            sass = ncu_csv(report, "--page", "source", "--print-source", "sass",
                           "--kernel-name", f"regex:{a.source}")
            tag = re.sub(r"[^A-Za-z0-9]+", "_", a.source).strip("_")
            (a.out / f"{stem}_{tag}.sass.csv").write_text(sass)
            if not sass.strip():  # said, not silent: the regex is on kernel names
                print(f"source page: no kernel name matches {a.source!r} (e.g. "
                      f"'rows8' for the multi-row GEMVs, 'attention' for attention)")
        except subprocess.CalledProcessError as e:
            print("source page:", e.stderr[-1000:])
        raw = ncu_csv(report, "--page", "raw")
        (a.out / f"{stem}.raw.csv").write_text(raw)
        kernels = summarize(raw)
        if launches.exists():
            plan = json.loads(launches.read_text())
            if len(plan) != len(kernels):  # said, not silent: the rows keep ncu's names only
                print(f"{model} {quant}: ncu profiled {len(kernels)} kernels and the plan "
                      f"launched {len(plan)}; the rows are left without the plan's labels")
            kernels = labelled(kernels, plan)
            launches.unlink()
        results.append({"model": model, "quant": quant, "batch": a.batch, "policy": a.policy,
                        "prefill_rows": a.prefill, "kernels": kernels})
        for k in kernels:
            top = ", ".join(f"{r} {v:.2f}" for r, v in k["stalls"][:5])
            print(f"{model} {quant} {k.get('kernel', k['name'])[:44]:<44} "
                  f"{(k['seconds'] or 0) * 1e6:7.2f} us "
                  f"dram {k['dram_pct'] or 0:5.1f}% occ {k['occupancy_pct'] or 0:5.1f}% "
                  f"ipc {k['ipc'] or 0:4.2f} l2hit {k['l2_hit_pct'] or 0:4.1f}% "
                  f"sect/req {(k['global_load_sectors'] or 0) / (k['global_load_requests'] or 1):4.1f}"
                  f" l2 {k['l2_pct'] or 0:4.1f}% tensor {k['tensor_pct'] or 0:4.1f}% | {top}")
        report.unlink()
    name = "gpu_profile" + ("" if a.policy == "exact" else f"_{a.policy}") + (
        "_prefill" if a.prefill else "")
    print("wrote", write_result(name, {"targets": results}))


if __name__ == "__main__":
    main()
