"""Decode step on the GPU: Metrale's plan vs Hugging Face eager vs HF + torch.compile, and floors.

One process, one GPU, random weights, batch 1 and 8, a 1024-token KV cache. Metrale runs the
sm_90 plan through CupyBackend with the step captured once as a CUDA graph and replayed; HF runs
the same shapes in bf16 with a static cache, eagerly and under
``torch.compile(mode="reduce-overhead")``. Every figure is the median of many timed steps after
warm-up; the floors are the plan's bytes over the device's nominal bandwidth and over the copy
rate measured in the same run. Every Metrale step of the run is timed before the first peer (whose
processes, and torch.compile's minutes, come last), and ``benchmarks/results/gpu_decode.json`` is
written again after each step and each peer, so a run cut short keeps what it timed.

Beside it, the plain-torch model of ``torch_peer.py`` (the same math without transformers' cache
objects, checked against transformers in ``tests/host/test_torch_peer.py``) is compiled the same
way: a compiled peer that stands where transformers' own compiled decode fails (as it did on
the lent H200's torch 2.11 / transformers 5.17).

Run on the lent GPU: ``python benchmarks/bench_gpu_decode.py qwen3-0.6b llama-3.1-8b``
(``--no-hf`` skips the peers; ``--quants bf16,fp8,mxfp4``; ``--policies exact,bounded`` plans
under each policy, the bounded plans running the GEMV-shaped matmuls on tensor cores;
``--kernels`` times each kernel alone and prints the profile; ``--record`` writes those timings
as evidence, at batch 1 (each kernel's bandwidth against the floor: what ``met plan`` shows as
measured; the time records that price plans come from ``met tune``); ``--kernels-dirs A,B``
also times the plans realized from variant kernel folders, an A/B of compile-time choices in
one run; ``--priority-too`` the plans made
without the shipped time records, the analytic model's and the priorities' choices, an A/B of
what ``met tune``'s records chose); ``--without R1,R2`` (repeatable) the plans made without
those relations, each line saying whether its logits are the shipped plan's bytes, and with
``--rounds N`` the shipped step and those variants timed N times in turn, medians kept (engines
of one run differ by about 2 %); ``--name NAME`` writes ``benchmarks/results/NAME.json`` (a
run beside the committed one). After the steps it prints each quantized step against the bf16
step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    array_sha256,
    cache_keyword,
    device_copy_rate,
    result_name,
    write_result,
)

from metrale.runtime.bench import median_wall  # noqa: E402

CONTEXT = 1024


def decode_engine(model: str, quant: str, batch: int, *, seed: int = 0,
                  dependent: bool = True, graphs: bool = True,
                  policy: str = "exact", presentation: Any = None,
                  kernels_dir: str | None = None) -> tuple[Any, Any]:
    """An sm_90 engine for ``batch`` decode rows at position ``CONTEXT`` with random weights and
    a full cache of random values drawn from ``seed`` (never time on zeros; every engine of a run
    gets the same, so plans that agree bit for bit give the same logits), planned under
    ``policy``; with it, the
    backend the caller owns (None: the engine's own, with dependent launches where the class
    has them). ``presentation``: the LKB to plan over (None: the shipped one); ``kernels_dir``:
    the kernels folder to realize it with (None: the shipped one)."""
    import ml_dtypes

    from metrale.plan.config import ModelConfig
    from metrale.runtime.engine import Engine, pooled_weights

    backend = loader = None
    if not dependent:
        from metrale.realize.hardware import load_hardware
        from metrale.runtime.cuda_loader import CudaPlanLoader
        from metrale.runtime.cupy_backend import CupyBackend

        arch = load_hardware().get("sm_90").arch
        backend, loader = CupyBackend(), CudaPlanLoader(arch, kernels_dir=kernels_dir,
                                                         dependent_launch=False)
    eng = Engine(ModelConfig.load(model), quant, pooled_weights(model, quant),
                 hardware="sm_90", backend=backend, loader=loader, act="bf16",
                 max_ctx=CONTEXT + 1, slots=batch, blocking=False, debug=False, graphs=graphs,
                 fuse=True, policy=policy, presentation=presentation, kernels_dir=kernels_dir)
    rng = np.random.default_rng(seed)
    for name, ptr in eng.externals.items():
        if name.startswith("kv."):
            vals = rng.standard_normal(ptr.nbytes // 2).astype(np.float32) * 0.5
            eng.backend.copy_h2d(ptr, vals.astype(ml_dtypes.bfloat16).view(np.uint8))
    return eng, backend


def metrale_step(model: str, quant: str, batch: int, kernels: bool = False,
                 records: list | None = None,
                 dependent: bool = True, policy: str = "exact",
                 presentation: Any = None, kernels_dir: str | None = None,
                 resident: bool = False) -> dict:
    """The decode step timed on the sm_90 plan. With ``kernels``, each distinct kernel is also
    timed alone (``runtime.bench.kernel_times``: inputs rotated past L2, graph replay) and
    listed under ``"kernels"``; with ``resident`` too, timed again with its inputs resident in
    L2 (``"resident_s"``); with ``records``, its evidence record (bandwidth against the class's
    floor) is added there."""
    from metrale.runtime.bench import kernel_times, time_decode

    eng, backend = decode_engine(model, quant, batch, dependent=dependent, policy=policy,
                                 presentation=presentation, kernels_dir=kernels_dir)
    t = time_decode(eng, batch, steps=200)
    program = eng.program("decode", batch)
    logits = program.read("logits")
    out = {"step_s": t.step_s, "floor_s": t.floor_s, "bytes": t.bytes_moved,
           # the planner's prediction of this step, costed for the device it ran on
           "predicted_s": program.plan.predicted_us / 1e6,
           "launches": t.launches, "finite": bool(np.isfinite(logits).all()), "graph": t.graph,
           # the same weights and inputs (fixed seeds) give the same hash exactly when the plans'
           # kernels agree bit for bit: how an A/B of trees checks a bit-identical change
           "logits_sha256": array_sha256(logits)}
    if kernels or records is not None:
        timings = kernel_times(eng, batch)
        out["kernels"] = [{"kernel": k.label, "point": k.point, "count": k.count,
                           "seconds": k.seconds, "bytes": k.bytes_moved,
                           "bytes_per_s": k.bytes_per_s} for k in timings]
        if resident:
            warm = {k.label: k.seconds for k in kernel_times(eng, batch, resident=True)}
            for row in out["kernels"]:
                row["resident_s"] = warm[row["kernel"]]
        if records is not None:
            from metrale.realize.compute import NvidiaTarget
            from metrale.realize.hardware import load_hardware
            from metrale.runtime.bench import evidence

            records += evidence(timings, load_hardware().get("sm_90"),
                                eng.backend.limits.name, NvidiaTarget("ptx").version())
    eng.close()
    if backend is not None:
        backend.close()
    return out


def without_relations(names: str) -> Any:
    """The shipped LKB less the named relations (None when no name is given); an unknown name
    is a ConfigError that names it."""
    if not names:
        return None
    from metrale.lkb.presentation import Presentation

    P = Presentation.load()
    drop = set(names.split(","))
    for name in drop:
        P.relation(name)  # raises, naming the relation, where there is none
    return Presentation(P.generators, tuple(r for r in P.relations if r.name not in drop))


def interleaved_rounds(m: dict, rounds: int, cell: tuple[str, str, int, str],
                       presentations: list) -> None:
    """Time the shipped step of ``cell`` (model, quant, batch, policy) and each variant
    (planned over one of ``presentations``) again in turn until each has ``rounds`` figures,
    then keep each one's median as its ``step_s`` and every figure under ``step_s_rounds``: an
    A/B whose difference is near the spread between engines (about 2 % on an H100) reads the
    medians of interleaved rounds, not one engine each."""
    model, quant, batch, policy = cell
    m["step_s_rounds"] = [m["step_s"]]
    for w in m["without"]:
        w["step_s_rounds"] = [w["step_s"]]
    for _ in range(rounds - 1):
        for d, presentation in zip((m, *m["without"]), (None, *presentations)):
            d["step_s_rounds"].append(metrale_step(model, quant, batch, policy=policy,
                                                   presentation=presentation)["step_s"])
    for d in (m, *m["without"]):
        d["step_s"] = float(np.median(d["step_s_rounds"]))


def _logits_word(variant: dict, shipped: dict) -> str:
    """``same`` where a variant's logits are the shipped plan's bytes (as a bit-identical
    relation left out must leave them), else ``other``."""
    return "same" if variant["logits_sha256"] == shipped["logits_sha256"] else "other"


def _spread(d: dict) -> str:
    """`` (median of N: lo-hi ms)`` where ``d`` was timed in rounds, else nothing."""
    t = d.get("step_s_rounds")
    return (f" (median of {len(t)}: {min(t) * 1e3:.3f}-{max(t) * 1e3:.3f} ms)"
            if t and len(t) > 1 else "")


def metrale_line(r: dict) -> str:
    """One cell's Metrale figures as the run prints them."""
    line = (f"{r['model']:<14} {r['quant']:<6} {r['policy']:<7} b={r['batch']}: metrale "
            f"{r['step_s'] * 1e3:7.3f} ms{_spread(r)} ({r['launches']} launches) | floor "
            f"{r['floor_s'] * 1e3:.3f} ms (copy-rate floor {r['copy_floor_s'] * 1e3:.3f}) -> "
            f"{r['floor_s'] / r['step_s']:.0%} of floor | predicted "
            f"{r['predicted_s'] * 1e3:.3f} ms ({r['predicted_s'] / r['step_s'] - 1:+.1%})")
    for w in r.get("without", []):
        line += (f" | without {w['relations']} {w['step_s'] * 1e3:.3f} ms{_spread(w)} "
                 f"({w['launches']} launches, {_logits_word(w, r)} logits)")
    if "plain_step_s" in r:
        line += f" | plain launches {r['plain_step_s'] * 1e3:.3f} ms"
    return line


def peer_line(r: dict) -> str:
    """One cell's peer figures (transformers eager and compiled, the compiled plain-torch
    peer) beside its Metrale step, as the run prints them."""
    line = (f"{r['model']:<14} {r['quant']:<6} {r['policy']:<7} b={r['batch']}: peers of "
            f"metrale {r['step_s'] * 1e3:7.3f} ms")
    if "hf_error" in r:
        line += f" | HF: {r['hf_error'][:120]}"
    if "eager_s" in r:
        line += f" | HF eager {r['eager_s'] * 1e3:.2f} ms"
        if "compiled_s" in r:
            line += (f" | HF+compile {r['compiled_s'] * 1e3:.2f} ms "
                     f"({r['compiled_s'] / r['step_s']:.2f}x ours)")
    if "peer_error" in r:
        line += f" | torch peer: {r['peer_error'][:120]}"
    if "peer_compiled_s" in r:
        line += (f" | torch peer+compile {r['peer_compiled_s'] * 1e3:.2f} ms "
                 f"({r['peer_compiled_s'] / r['step_s']:.2f}x ours)")
    return line


def print_kernels(kernels: list[dict], step_s: float) -> None:
    """Each family's share of the summed kernel medians, then the eight costliest launches (and,
    where timed, each one's time with its inputs resident in L2)."""
    total = sum(k["seconds"] * k["count"] for k in kernels)
    print(f"  sum of kernel medians {total * 1e3:.3f} ms (step {step_s * 1e3:.3f} ms)")
    if all("resident_s" in k for k in kernels):
        warm = sum(k["resident_s"] * k["count"] for k in kernels)
        print(f"  sum with each kernel's inputs resident in L2 {warm * 1e3:.3f} ms")
    share: dict[str, float] = {}
    for k in kernels:
        family = k["point"].split("[")[0]
        share[family] = share.get(family, 0.0) + k["seconds"] * k["count"]
    for family, sec in sorted(share.items(), key=lambda kv: -kv[1]):
        print(f"    {family:<22} {sec * 1e3:8.3f} ms")
    for k in sorted(kernels, key=lambda k: -k["seconds"] * k["count"])[:8]:
        resident = (f" (L2-resident {k['resident_s'] * 1e6:.1f} us)" if "resident_s" in k
                    else "")
        print(f"    {k['point'][:70]:<70} x{k['count']:<3} {k['seconds'] * 1e6:8.1f} us "
              f"{k['bytes_per_s'] / 1e9:7.0f} GB/s{resident}")


def print_quant_ratios(rows: list[dict]) -> None:
    """Each quantized step against the bf16 step of its model, batch and policy (the issue's
    goals: fp8 at most 0.6x, mxfp4 at most 0.35x), with the bytes' own ratio beside it."""
    bf16 = {(r["model"], r["batch"], r["policy"]): r for r in rows if r["quant"] == "bf16"}
    for r in rows:
        base = bf16.get((r["model"], r["batch"], r["policy"]))
        if r["quant"] == "bf16" or base is None:
            continue
        print(f"{r['model']:<14} {r['quant']:<6} {r['policy']:<7} b={r['batch']}: "
              f"{r['step_s'] / base['step_s']:.2f}x the bf16 step "
              f"(bytes {r['bytes'] / base['bytes']:.2f}x)", flush=True)


COMPILE = {"mode": "reduce-overhead"}
"""How the compiled peers are compiled (``torch.compile``'s keywords); the CPU test of the
timing loop compiles with ``backend="eager"``: the same steps through the same graph capture,
without Inductor's half minute of C++ on the CPU."""


def _time_eager_and_compiled(module: Any, call: Any, out: dict, prefix: str,
                             compile_too: bool, fullgraph: bool, device: str) -> None:
    """``out[prefix + "eager_s"]`` then, with ``compile_too``, ``out[prefix + "compiled_s"]``
    under ``torch.compile(mode="reduce-overhead")`` (3 warm-up steps, their time recorded too);
    filled as measured, so that a failure in the compiled run keeps the eager figure."""
    import torch

    def step(fn: Any) -> Any:
        def run() -> None:
            with torch.no_grad():
                call(fn)
            if device == "cuda":
                torch.cuda.synchronize()
        return run

    out[prefix + "eager_s"] = median_wall(step(module), 50, 5)
    if not compile_too:
        return
    t0 = time.perf_counter()
    run = step(torch.compile(module, fullgraph=fullgraph, **COMPILE))
    for _ in range(3):
        run()
    out[prefix + "compile_warmup_s"] = time.perf_counter() - t0
    out[prefix + "compiled_s"] = median_wall(run, 100, 5)


HF_HEADROOM = 192
"""Cache positions past CONTEXT for transformers' timed steps: 55 eager, 3 + 5 + 100 compiled."""


def hf_steps(model: str, batch: int, compile_too: bool, out: dict,
             device: str = "cuda") -> None:
    """transformers' decode step (bf16, static cache filled by a prefill), eagerly and compiled.

    transformers' static cache writes each step at its own running length, whatever
    ``cache_position`` says, so every timed step advances it by one: the cache has room for
    all of them (HF_HEADROOM), and the rows sit at positions 1024 to 1024 + 163 while timed.
    (With 64 positions of room, the compiled run's 65th step indexed past the cache and hit a
    device-side assert.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    from metrale.plan.config import ModelConfig

    cfg = AutoConfig.for_model(**ModelConfig.load(model).to_hf_dict())
    torch.manual_seed(0)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    cache = {cache_keyword(m.forward): StaticCache(config=cfg,
                                                   max_cache_len=CONTEXT + HF_HEADROOM)}
    ids = torch.randint(0, cfg.vocab_size, (batch, CONTEXT), device=device)
    with torch.no_grad():
        m(ids, **cache, use_cache=True, cache_position=torch.arange(CONTEXT, device=device))
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), device=device)
    pos = torch.tensor([CONTEXT], device=device)
    position_ids = pos.view(1, 1).expand(batch, 1).contiguous()
    _time_eager_and_compiled(
        m, lambda fn: fn(tok, **cache, use_cache=True, cache_position=pos,
                         position_ids=position_ids),
        out, "", compile_too, fullgraph=False, device=device)


def torch_peer_steps(model: str, batch: int, out: dict, device: str = "cuda") -> None:
    """The plain-torch decode step (``torch_peer.py``, the same model without transformers'
    cache objects) in bf16, eagerly and compiled."""
    import torch
    from torch_peer import TorchDecode, random_state

    from metrale.plan.config import ModelConfig

    c = ModelConfig.load(model)
    m = TorchDecode(c, random_state(c, torch.bfloat16, device=device), batch=batch,
                    max_ctx=CONTEXT + 64)
    m.k_cache.normal_(0, 0.5)  # a full cache of random values, as Metrale's
    m.v_cache.normal_(0, 0.5)
    tok = torch.randint(0, c.vocab_size, (batch,), device=device)
    pos = torch.tensor(CONTEXT, device=device)
    _time_eager_and_compiled(m, lambda fn: fn(tok, pos), out, "peer_", True, fullgraph=True,
                             device=device)


def hf_child(model: str, batch: int, compile_too: bool, timeout: float) -> dict:
    """The peers' figures, each from a child process (a failure there, such as a device-side
    assert that ends the process, is reported as ``hf_error`` / ``peer_error``, not fatal
    here): transformers eager (and compiled with ``compile_too``), and with ``compile_too`` the
    plain-torch peer."""
    out = _child(model, batch, "hf-compile" if compile_too else "hf", timeout, "hf_error")
    if compile_too:
        out.update(_child(model, batch, "torch-peer", timeout, "peer_error"))
    return out


def _child(model: str, batch: int, mode: str, timeout: float, error_key: str) -> dict:
    """What the child printed (its figures so far, and ``error_key`` where it failed, with the
    device's assert line when there is one)."""
    import json as _json
    import subprocess

    cmd = [sys.executable, __file__, "--hf-child", model, str(batch), mode]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {error_key: f"timed out after {timeout:.0f} s"}
    asserts = [ln.strip()[-200:] for ln in done.stderr.splitlines() if "Assertion" in ln][:1]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            out = _json.loads(line)
            if "error" in out:
                out[error_key] = out.pop("error") + "".join(f" ({a})" for a in asserts)
            return out
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {error_key: " | ".join(tail)[:300]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-child":
        import json as _json

        out: dict = {}
        try:
            if sys.argv[4] == "torch-peer":
                torch_peer_steps(sys.argv[2], int(sys.argv[3]), out)
            else:
                hf_steps(sys.argv[2], int(sys.argv[3]), sys.argv[4] == "hf-compile", out)
        except Exception as e:  # reported to the parent as data
            out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(_json.dumps(out), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quants", default="bf16")
    ap.add_argument("--policies", default="exact",
                    help="numerics policies the plans are made under (exact, bounded)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--peer-models", default="",
                    help="models (comma-separated) whose transformers peers are timed; default "
                         "all (an MoE's eager forward loops over its experts in Python)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quant-batches", default="1", help="batches timed for non-bf16 quants")
    ap.add_argument("--compile-batches", default="1,8", help="batches torch.compile is timed at")
    ap.add_argument("--hf-timeout", type=float, default=150)
    ap.add_argument("--kernels", action="store_true",
                    help="also time each distinct kernel alone and print the profile")
    ap.add_argument("--l2-resident", action="store_true",
                    help="with --kernels: also time each kernel with its inputs resident in L2 "
                         "(one copy every run): what prefetching its bytes into L2 could reach")
    ap.add_argument("--record", action="store_true",
                    help="record evidence (each kernel's bandwidth at batch 1) for sm_90 in the "
                         "evidence store; the time records that price plans come from met tune")
    ap.add_argument("--plain-too", action="store_true",
                    help="also time each bf16 step with plain (not dependent) launches")
    ap.add_argument("--without", action="append", default=[], metavar="RELATIONS",
                    help="comma-separated relations: each step is also timed planned without "
                         "them, in the same run (repeatable: one variant each)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --without: time the shipped step and each variant this many "
                         "times in turn (A B A B ..., a new engine each), keeping each one's "
                         "median: engines of one run differ by about 2 %%")
    ap.add_argument("--kernels-dirs", default="",
                    help="kernels folders (comma-separated; variants of the shipped one) whose "
                         "plans are also timed, each step and its kernels, in the same run")
    ap.add_argument("--priority-too", action="store_true",
                    help="also time each step planned without the shipped time records (the "
                         "analytic model and the priorities), in the same run; the evidence "
                         "store's records still count, so run it where the store holds none")
    ap.add_argument("--name", default="gpu_decode", type=result_name,
                    help="the results file's stem (benchmarks/results/NAME.json): a run of "
                         "other models or another card beside the committed one")
    ap.add_argument("--deadline", type=float, default=300,
                    help="seconds into the peers (which run after every Metrale step) after "
                         "which torch.compile peers are skipped (device time)")
    args = ap.parse_args()
    if args.l2_resident and not args.kernels:
        ap.error("--l2-resident times each kernel a second time: give --kernels too")
    withouts = [(names, without_relations(names)) for names in args.without]
    variants = {folder: folder for folder in filter(None, args.kernels_dirs.split(","))}
    if args.priority_too:
        import tempfile

        from metrale.realize.evidence import without_time_records
        from metrale.realize.hardware import default_kernels_dir

        folder = without_time_records(default_kernels_dir(),
                                      Path(tempfile.mkdtemp()) / "kernels")
        variants["without time records"] = str(folder)
    rate = device_copy_rate()
    print(f"device-to-device copy: {rate / 1e12:.2f} TB/s (read + write)", flush=True)
    rows: list[dict] = []
    records: list = []

    def save() -> Path:  # after each cell and each peer: a run cut short keeps what it timed
        return write_result(args.name, {"copy_rate_bytes_per_s": rate, "context": CONTEXT,
                                        "rows": rows})

    # Metrale's steps first, every model and batch, then the peers: the peers' processes (and
    # torch.compile's minutes) come last, so that a device call that runs out of time still
    # brings back every Metrale figure
    cells: list[tuple[str, int, list[dict]]] = []
    for model in args.models:
        for batch in map(int, args.batches.split(",")):
            ours = []
            for quant in args.quants.split(","):
                if quant != "bf16" and batch not in map(int, args.quant_batches.split(",")):
                    continue
                for policy in args.policies.split(","):
                    m = metrale_step(model, quant, batch, args.kernels,
                                     records if args.record and batch == 1 else None,
                                     policy=policy, resident=args.l2_resident)
                    if args.plain_too and quant == "bf16":
                        m["plain_step_s"] = metrale_step(model, quant, batch,
                                                         dependent=False,
                                                         policy=policy)["step_s"]
                    for name, folder in variants.items():
                        v = metrale_step(model, quant, batch, args.kernels, policy=policy,
                                         kernels_dir=folder, resident=args.l2_resident)
                        m.setdefault("variants", {})[name] = v
                        print(f"{model:<14} {quant:<6} {policy:<7} b={batch}: {name}: "
                              f"{v['step_s'] * 1e3:7.3f} ms ({v['launches']} launches; "
                              f"predicted {v['predicted_s'] * 1e3:.3f}; "
                              f"{_logits_word(v, m)} logits)",
                              flush=True)
                        if "kernels" in v:
                            print_kernels(v["kernels"], v["step_s"])
                    for names, presentation in withouts:
                        w = metrale_step(model, quant, batch, policy=policy,
                                         presentation=presentation)
                        m.setdefault("without", []).append(
                            {"relations": names, "step_s": w["step_s"],
                             "launches": w["launches"], "logits_sha256": w["logits_sha256"]})
                    if withouts and args.rounds > 1:
                        interleaved_rounds(m, args.rounds, (model, quant, batch, policy),
                                           [presentation for _, presentation in withouts])
                    r = {"model": model, "quant": quant, "policy": policy, "batch": batch, **m,
                         "copy_floor_s": m["bytes"] / rate}
                    rows.append(r)
                    ours.append(r)
                    print(metrale_line(r), flush=True)
                    if "kernels" in m:
                        print_kernels(m["kernels"], m["step_s"])
                    save()
            cells.append((model, batch, ours))
    if records:  # before the peers: a run cut short in them keeps its records
        from metrale.realize.evidence import record_evidence
        from metrale.realize.evidence_store import default_store_path

        added = record_evidence(records)
        print(f"recorded {added} new evidence records in {default_store_path()} "
              "(`met evidence export --hardware sm_90 --out kernels/sm_90/EVIDENCE.toml` "
              "ships them)", flush=True)
    start = time.perf_counter()
    for model, batch, ours in cells:
        if args.no_hf or (args.peer_models and model not in args.peer_models.split(",")):
            continue
        late = time.perf_counter() - start > args.deadline
        compile_here = not (args.no_compile or late) and str(batch) in \
            args.compile_batches.split(",")
        hf = hf_child(model, batch, compile_here, args.hf_timeout)
        for r in ours:
            r.update(hf)
            print(peer_line(r), flush=True)
        save()
    path = save()
    print_quant_ratios(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
