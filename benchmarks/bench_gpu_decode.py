"""Decode step on the GPU: Metrale's plan vs Hugging Face eager vs HF + torch.compile, and floors.

One process, one GPU, random weights, batch 1 and 8, a 1024-token KV cache. Metrale runs the
sm_90 plan through CupyBackend with the step captured once as a CUDA graph and replayed; HF runs
the same shapes in bf16 with a static cache, eagerly and under
``torch.compile(mode="reduce-overhead")``. Every figure is the median of many timed steps after
warm-up; the floors are the plan's bytes over the device's nominal bandwidth and over the copy
rate measured in the same run. Writes ``benchmarks/results/gpu_decode.json``.

Beside it, the plain-torch model of ``torch_peer.py`` (the same math without transformers' cache
objects, checked against transformers in ``tests/host/test_torch_peer.py``) is compiled the same
way: a compiled peer that stands where transformers' own compiled decode fails (as it did on
the lent H200's torch 2.11 / transformers 5.17).

Run on the lent GPU: ``python benchmarks/bench_gpu_decode.py qwen3-0.6b llama-3.1-8b``
(``--no-hf`` skips the peers; ``--quants bf16,fp8,mxfp4``; ``--record`` writes evidence).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import device_copy_rate, write_result  # noqa: E402

from metrale.runtime.bench import median_wall  # noqa: E402

CONTEXT = 1024


def fast_weights(model: str, quant: str, rng: np.random.Generator) -> dict:
    """Random weights in their storage format, tiled from a pool (generating 8B normal values
    and quantizing them would take minutes; the bytes moved are what the step time is about).
    Values: bf16 N(0, 1/hidden); fp8 e4m3 codes (no NaN) with a per-row scale; mxfp4 random
    nibbles with e8m0 scales near 2^-5."""
    import ml_dtypes

    from metrale.lkb.quant import QuantFormat, QuantTensor
    from metrale.plan.config import ModelConfig
    from metrale.runtime.engine import _weight_shapes

    config = ModelConfig.load(model)
    std = config.hidden_size ** -0.5
    pool = (rng.standard_normal(1 << 22) * std).astype(ml_dtypes.bfloat16)
    norm_pool = (1 + 0.1 * rng.standard_normal(1 << 16)).astype(ml_dtypes.bfloat16)
    byte_pool = rng.integers(0, 256, 1 << 22, dtype=np.uint8)
    fp8_pool = np.where((byte_pool & 0x7F) == 0x7F, byte_pool ^ 1, byte_pool).astype(np.uint8)
    out = {}
    for name, (shape, fmt) in _weight_shapes(config, quant).items():
        if not fmt:
            out[name] = np.resize(norm_pool if name.endswith("norm.weight") else pool, shape)
            continue
        f = QuantFormat.parse(fmt)
        specs = f.array_specs(shape)
        dshape, _ = specs["data"]
        if fmt == "fp8":
            data = np.resize(fp8_pool, dshape).view(ml_dtypes.float8_e4m3fn)
            scale = np.full(specs["scale"][0], std / 110, np.float32)  # dequantized std ~ std
            out[name] = QuantTensor(f, shape, data, scale)
        else:
            data = np.resize(byte_pool, dshape)
            sshape, sdt = specs["scale"]
            scale = np.resize(rng.integers(120, 125, 4096, dtype=np.uint8), sshape)
            scale = scale.view(sdt.numpy) if sdt.numpy.itemsize == 1 else scale
            glob = (np.float32(1.0) if "global_scale" in specs else None)
            out[name] = QuantTensor(f, shape, data, scale, glob)
    return out


def metrale_step(model: str, quant: str, batch: int, rng: np.random.Generator,
                 records: list | None = None) -> dict:
    """The decode step timed on the sm_90 plan; with ``records``, each distinct kernel is also
    timed alone and its evidence record (bandwidth against the class's floor) appended."""
    import ml_dtypes

    from metrale.plan.config import ModelConfig
    from metrale.runtime.bench import time_decode
    from metrale.runtime.engine import Engine

    eng = Engine(ModelConfig.load(model), quant, fast_weights(model, quant, rng),
                 hardware="sm_90", backend=None, loader=None, act="bf16",
                 max_ctx=CONTEXT + 1, slots=batch, blocking=False, debug=False, graphs=True,
                 fuse=True, policy="exact")
    # a full cache of random values (never time on zeros); every row at position CONTEXT
    for name, ptr in eng.externals.items():
        if name.startswith("kv."):
            vals = rng.standard_normal(ptr.nbytes // 2).astype(np.float32) * 0.5
            eng.backend.copy_h2d(ptr, vals.astype(ml_dtypes.bfloat16).view(np.uint8))
    t = time_decode(eng, batch, steps=200)
    logits = eng.program("decode", batch).read("logits")
    if records is not None:
        from metrale.realize.compute import NvidiaTarget
        from metrale.realize.hardware import load_hardware
        from metrale.runtime.bench import evidence, kernel_times

        records += evidence(kernel_times(eng, batch), load_hardware().get("sm_90"),
                            eng.backend.limits.name, NvidiaTarget("ptx").version())
    out = {"step_s": t.step_s, "floor_s": t.floor_s, "bytes": t.bytes_moved,
           "launches": t.launches, "finite": bool(np.isfinite(logits).all()), "graph": t.graph}
    eng.close()
    return out


COMPILE_MODES = ("reduce-overhead", "reduce-overhead+eager-attn",
                 "reduce-overhead+no-position-ids", "reduce-overhead+static", "default+graph")
"""How the torch.compile peer is tried, in order, each in a fresh process (a device-side
assert ends the process that hit it): torch.compile(mode="reduce-overhead") as is; with HF's
eager attention instead of SDPA; without explicit position ids; with dynamic=False; and the
default mode with the CUDA graph captured by this script."""


def hf_steps(model: str, batch: int, compile_mode: str, out: dict) -> dict:
    """HF eager and (``compile_mode``) compiled decode steps, filled into ``out`` as they are
    measured, so that a later failure keeps the earlier figures."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

    from metrale.plan.config import ModelConfig

    cfg_dict = ModelConfig.load(model).to_hf_dict()
    cfg = AutoConfig.for_model(**cfg_dict)
    torch.manual_seed(0)
    extra = {"attn_implementation": "eager"} if compile_mode.endswith("+eager-attn") else {}
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **extra).eval()
    cache = StaticCache(config=cfg, max_cache_len=CONTEXT + 64)
    ids = torch.randint(0, cfg.vocab_size, (batch, CONTEXT), device="cuda")
    with torch.no_grad():
        m(ids, past_key_values=cache, use_cache=True,
          cache_position=torch.arange(CONTEXT, device="cuda"))
    tok = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
    pos = torch.tensor([CONTEXT], device="cuda")
    position_ids = pos.view(1, 1).expand(batch, 1).contiguous()

    kwargs = dict(past_key_values=cache, use_cache=True, cache_position=pos)
    if not compile_mode.endswith("+no-position-ids"):
        kwargs["position_ids"] = position_ids

    def step(fn):
        def run():
            with torch.no_grad():
                fn(tok, **kwargs)
            torch.cuda.synchronize()
        return run

    out["eager_s"] = median_wall(step(m), 50, 5)
    out["compile_mode"] = compile_mode
    if compile_mode.startswith("reduce-overhead"):
        t0 = time.perf_counter()
        dynamic = False if compile_mode.endswith("+static") else None
        run = step(torch.compile(m, mode="reduce-overhead", fullgraph=False, dynamic=dynamic))
        for _ in range(3):
            run()
        out["compile_warmup_s"] = time.perf_counter() - t0
        out["compiled_s"] = median_wall(run, 100, 5)
    elif compile_mode == "default+graph":
        # what reduce-overhead does (torch.compile's kernels replayed from a CUDA graph), with
        # the graph captured here instead of by torch's graph trees
        t0 = time.perf_counter()
        compiled = torch.compile(m, fullgraph=False)
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    compiled(tok, **kwargs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                compiled(tok, **kwargs)

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        replay()
        out["compile_warmup_s"] = time.perf_counter() - t0
        out["compiled_s"] = median_wall(replay, 100, 5)
    m = cache = None  # free the weights before the next model
    torch.cuda.empty_cache()
    return out


def torch_peer_steps(model: str, batch: int, out: dict) -> dict:
    """The plain-torch decode step (``torch_peer.py``, the same model without transformers'
    cache objects) in bf16, eagerly and under ``torch.compile(mode="reduce-overhead")``."""
    import torch
    from torch_peer import TorchDecode, random_state

    from metrale.plan.config import ModelConfig

    c = ModelConfig.load(model)
    m = TorchDecode(c, random_state(c, torch.bfloat16, device="cuda"), batch=batch,
                    max_ctx=CONTEXT + 64)
    m.k_cache.normal_(0, 0.5)  # a full cache of random values, as Metrale's
    m.v_cache.normal_(0, 0.5)
    tok = torch.randint(0, c.vocab_size, (batch,), device="cuda")
    pos = torch.tensor(CONTEXT, device="cuda")

    def step(fn):
        def run():
            with torch.no_grad():
                fn(tok, pos)
            torch.cuda.synchronize()
        return run

    out["peer_eager_s"] = median_wall(step(m), 20, 3)
    t0 = time.perf_counter()
    run = step(torch.compile(m, mode="reduce-overhead", fullgraph=True))
    for _ in range(3):
        run()
    out["peer_compile_warmup_s"] = time.perf_counter() - t0
    out["peer_compiled_s"] = median_wall(run, 100, 5)
    return out


def hf_child(model: str, batch: int, compile_too: bool, timeout: float) -> dict:
    """HF figures from a child process (a failure there is reported, not fatal here). Where
    ``torch.compile(mode="reduce-overhead")`` fails (a device-side assert ends its process),
    a second child compiles in the default mode and replays a CUDA graph it captures."""
    peer = {}
    if compile_too:  # the plain-torch model compiled, whatever transformers' compile does
        peer = _child(model, batch, "torch-peer", timeout)
        if "hf_error" in peer:
            peer = {"peer_error": peer["hf_error"]}
    modes = COMPILE_MODES if compile_too else ("none",)
    errors: dict[str, str] = {}
    eager = {}
    for mode in modes:
        out = _child(model, batch, mode, timeout)
        if "eager_s" in out:
            eager = {"eager_s": out["eager_s"]}
        if "hf_error" not in out:
            return {**out, **peer, **({"compile_errors": errors} if errors else {})}
        errors[mode] = out["hf_error"]
        print(f"  HF {model} b={batch} torch.compile[{mode}] failed: {out['hf_error'][:240]}",
              flush=True)
    return {**eager, **peer, "hf_error": " / ".join(f"{m}: {e}" for m, e in errors.items())}


def _child(model: str, batch: int, mode: str, timeout: float) -> dict:
    import json as _json
    import subprocess

    cmd = [sys.executable, __file__, "--hf-child", model, str(batch), mode]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"hf_error": f"timed out after {timeout:.0f} s"}
    asserts = [ln.strip() for ln in done.stderr.splitlines() if "Assertion" in ln][:1]
    for line in reversed(done.stdout.splitlines()):
        if line.startswith("{"):
            out = _json.loads(line)
            if "hf_error" in out and asserts:  # the device's own words for the assert
                out["hf_error"] += f" ({asserts[0][-200:]})"
            if "hf_error" not in out or done.returncode == 0:
                return out
    tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
    return {"hf_error": " | ".join(tail)[:300]}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--hf-child":
        import json as _json

        out: dict = {}
        try:
            if sys.argv[4] == "torch-peer":
                torch_peer_steps(sys.argv[2], int(sys.argv[3]), out)
            else:
                hf_steps(sys.argv[2], int(sys.argv[3]), sys.argv[4], out)
        except Exception as e:  # reported to the parent as data
            out["hf_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        print(_json.dumps(out), flush=True)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["qwen3-0.6b", "llama-3.1-8b"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--quants", default="bf16")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--quant-batches", default="1", help="batches timed for non-bf16 quants")
    ap.add_argument("--compile-batches", default="1,8", help="batches torch.compile is timed at")
    ap.add_argument("--hf-timeout", type=float, default=150)
    ap.add_argument("--record", action="store_true",
                    help="append evidence records (each kernel at batch 1) to the sm_90 class")
    ap.add_argument("--deadline", type=float, default=300,
                    help="seconds after which torch.compile peers are skipped (device time)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rate = device_copy_rate()
    print(f"device-to-device copy: {rate / 1e12:.2f} TB/s (read + write)", flush=True)
    rows: list[dict] = []
    records: list = []
    start = time.perf_counter()
    for model in args.models:
        for batch in map(int, args.batches.split(",")):
            late = time.perf_counter() - start > args.deadline
            compile_here = not (args.no_compile or late) and str(batch) in \
                args.compile_batches.split(",")
            ours = {}
            for quant in args.quants.split(","):
                if quant != "bf16" and batch not in map(int, args.quant_batches.split(",")):
                    continue
                ours[quant] = metrale_step(model, quant, batch, rng,
                                           records if args.record and batch == 1 else None)
            hf = {} if args.no_hf else hf_child(model, batch, compile_here, args.hf_timeout)
            for quant, m in ours.items():
                r = {"model": model, "quant": quant, "batch": batch, **m, **hf,
                     "copy_floor_s": m["bytes"] / rate}
                rows.append(r)
                line = (f"{model:<14} {quant:<6} b={batch}: metrale {m['step_s'] * 1e3:7.3f} ms "
                        f"({m['launches']} launches) | floor {m['floor_s'] * 1e3:.3f} ms "
                        f"(copy-rate floor {r['copy_floor_s'] * 1e3:.3f}) -> "
                        f"{m['floor_s'] / m['step_s']:.0%} of floor")
                if "hf_error" in hf:
                    line += f" | HF: {hf['hf_error'][:120]}"
                if "eager_s" in hf:
                    line += f" | HF eager {hf['eager_s'] * 1e3:.2f} ms"
                    if "compiled_s" in hf:
                        line += (f" | HF+compile[{hf['compile_mode']}] "
                                 f"{hf['compiled_s'] * 1e3:.2f} ms "
                                 f"({hf['compiled_s'] / m['step_s']:.2f}x ours)")
                if "peer_compiled_s" in hf:
                    line += (f" | torch peer+compile {hf['peer_compiled_s'] * 1e3:.2f} ms "
                             f"({hf['peer_compiled_s'] / m['step_s']:.2f}x ours)")
                print(line, flush=True)
    path = write_result("gpu_decode", {"copy_rate_bytes_per_s": rate, "context": CONTEXT,
                                       "rows": rows})
    print(f"wrote {path}")
    if records:
        from metrale.realize.evidence import EVIDENCE_FILE, append_records
        from metrale.realize.hardware import default_kernels_dir

        where = default_kernels_dir() / "sm_90" / EVIDENCE_FILE
        append_records(where, records)
        print(f"appended {len(records)} evidence records to {where}")


if __name__ == "__main__":
    main()
