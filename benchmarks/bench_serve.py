"""``met serve`` under load on the host: time to first token, inter-token latency (p50, p99)
and tokens/s at 1, 8 and 32 concurrent streaming requests, beside transformers' batched
``generate`` on the same prompts in the same run.

The server is ``met serve`` in its own process (127.0.0.1, a free port) over the engine on the
host backend (act f32, exact policy, one KV slot per concurrent request, its decode programs
built at start); each request streams greedy tokens with ``ignore_eos`` (so every request makes
``--tokens`` tokens) through an ``httpx`` client. Each concurrency level first runs its prompts
once for 2 tokens (building the prefill programs of their lengths: ``cold_ttft_p50_s``), then
the timed round. The model is the tiny text checkpoint of ``tests/text_checkpoint.py``
(a qwen3 of 2 layers, vocabulary 384) unless ``--checkpoint`` names another directory with a
``tokenizer.json``. Transformers runs the same prompts (token ids, left-padded) as one batch in
float32 on CPU torch: its tokens/s is the whole batch's new tokens over the ``generate`` time,
its time to first token that of ``max_new_tokens=1``.

On a GPU class (``--hardware sm_90 --model qwen3-0.6b``) the server runs bf16 activations, and
``--model`` names a built-in config: the script saves it with seeded random bf16 weights
(transformers' initialisation) and the fixture's tokenizer, whose vocabulary is smaller than
the model's (ids past it decode to nothing; the benchmark counts token ids, not text).
Transformers then runs the same prompts in bf16 on the same GPU.

    python benchmarks/bench_serve.py [--tokens 32] [--concurrency 1 8 32] [--checkpoint DIR]
    python benchmarks/bench_serve.py --hardware sm_90 --model qwen3-0.6b --name serve_sm_90

Writes ``benchmarks/results/serve_host.json`` (``--name`` another stem).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))
from _common import write_result  # noqa: E402

WORDS = ["Hello", "The quick brown fox", "Metrale compiles", "A category has objects",
         "Über naïve café", "What is two plus two?", "Tokens in, tokens out", "kernel plans"]


def prompts(n: int) -> list[str]:
    return [f"{WORDS[i % len(WORDS)]} #{i}" for i in range(n)]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, np.float64), q)) if values else float("nan")


class Served:
    """``met serve`` in its own process on 127.0.0.1 (so the load generator's Python does not
    share the server's interpreter lock), stopped with SIGINT."""

    def __init__(self, ckpt: Path, hardware: str, slots: int, context: int, act: str) -> None:
        import socket
        import subprocess

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metrale", "serve", str(ckpt), "--hardware", hardware,
             "--port", str(port), "--slots", str(slots), "--context", str(context),
             "--act", act, "--name", "bench", "--log-level", "warning"])
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("met serve did not start")
            time.sleep(0.1)

    def stop(self) -> None:
        import signal

        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        except Exception:
            self.proc.kill()
            raise


async def one(client, url: str, model: str, prompt: str, tokens: int) -> dict:
    t0 = time.perf_counter()
    stamps: list[float] = []
    n = 0
    async with client.stream("POST", url + "/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            got = len(json.loads(line[6:])["choices"][0].get("token_ids") or [])
            if got:
                stamps.append(time.perf_counter())
                n += got
    return {"ttft": stamps[0] - t0, "itl": list(np.diff(stamps)), "tokens": n,
            "end": stamps[-1]}


async def load(url: str, model: str, ps: list[str], tokens: int) -> dict:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(client, url, model, p, tokens) for p in ps))
        wall = max(r["end"] for r in res) - t0
    ttft = [r["ttft"] for r in res]
    itl = [x for r in res for x in r["itl"]]
    total = sum(r["tokens"] for r in res)
    return {"requests": len(ps), "tokens_each": tokens, "tokens": total, "wall_s": wall,
            "tokens_per_s": total / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


def transformers_batch(ckpt: Path, ps: list[str], tokens: int, device: str) -> dict:
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    tok.padding_side = "left"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=dtype).to(device)
    model.eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    batch = tok(ps, return_tensors="pt", padding=True).to(device)
    kw = dict(do_sample=False, pad_token_id=tok.pad_token_id, eos_token_id=None)
    with torch.inference_mode():
        model.generate(**batch, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        sync()
        t0 = time.perf_counter()
        model.generate(**batch, max_new_tokens=1, min_new_tokens=1, **kw)
        sync()
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, **kw)
        sync()
        wall = time.perf_counter() - t0
    new = int(out.shape[1] - batch["input_ids"].shape[1]) * len(ps)
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return {"requests": len(ps), "tokens": new, "wall_s": wall, "tokens_per_s": new / wall,
            "first_token_s": first, "dtype": str(dtype).removeprefix("torch."),
            "device": device, "threads": torch.get_num_threads()}


def random_checkpoint(model: str, dst: Path) -> Path:
    """The built-in config ``model`` saved by transformers with seeded random bf16 weights (made
    on the GPU), and the fixture's tokenizer files beside it."""
    import torch
    import transformers

    from metrale.plan.config import ModelConfig
    from tests.text_checkpoint import write_text_files

    cfg = transformers.AutoConfig.for_model(**ModelConfig.load(model).to_hf_dict())
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    m.save_pretrained(dst)
    del m
    torch.cuda.empty_cache()
    return write_text_files(dst)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default=None, help="a checkpoint with tokenizer.json")
    ap.add_argument("--model", default=None,
                    help="a built-in config, saved with random weights (GPU classes only)")
    ap.add_argument("--hardware", default="host")
    ap.add_argument("--tokens", type=int, default=32, help="tokens each request makes")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--name", default="serve_host", help="the results file's stem")
    args = ap.parse_args(argv)

    import torch
    import transformers

    host = args.hardware == "host"
    if args.model and host:
        ap.error("--model saves a GPU checkpoint: use it with a GPU class (--hardware sm_90)")
    tmp = None
    if args.checkpoint is None:
        from tests.text_checkpoint import make_text_checkpoint

        tmp = tempfile.TemporaryDirectory()
        ckpt = (make_text_checkpoint(Path(tmp.name) / "tiny-text") if args.model is None
                else random_checkpoint(args.model, Path(tmp.name) / args.model))
    else:
        ckpt = Path(args.checkpoint)
    slots = max(args.concurrency)
    act = "f32" if host else "bf16"
    served = Served(ckpt, args.hardware, slots, args.context, act)
    rows = []
    try:
        for c in args.concurrency:
            ps = prompts(c)
            cold = asyncio.run(load(served.url, "bench", ps, 2))  # builds the prompts' prefills
            ours = asyncio.run(load(served.url, "bench", ps, args.tokens))
            ours["cold_ttft_p50_s"] = cold["ttft_p50_s"]
            theirs = transformers_batch(ckpt, ps, args.tokens, "cpu" if host else "cuda")
            rows.append({"concurrency": c, "metrale_serve": ours, "transformers_generate": theirs})
            print(f"c={c:3d}: met serve {ours['tokens_per_s']:8.1f} tok/s, TTFT p50 "
                  f"{ours['ttft_p50_s'] * 1e3:7.1f} ms p99 {ours['ttft_p99_s'] * 1e3:7.1f} ms, "
                  f"ITL p50 {ours['itl_p50_s'] * 1e3:6.1f} ms p99 {ours['itl_p99_s'] * 1e3:6.1f}"
                  f" ms | transformers batched generate {theirs['tokens_per_s']:8.1f} tok/s, "
                  f"first token {theirs['first_token_s'] * 1e3:7.1f} ms")
    finally:
        served.stop()
        if tmp is not None:
            tmp.cleanup()
    checkpoint = (str(args.checkpoint) if args.checkpoint else
                  f"{args.model}, random bf16 weights, the fixture's tokenizer" if args.model
                  else "tests/text_checkpoint.py (qwen3, 2 layers, vocab 384)")
    payload = {"hardware": args.hardware, "checkpoint": checkpoint,
               "act": act, "policy": "exact", "tokens_each": args.tokens,
               "context": args.context, "slots": slots, "rows": rows,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "median_speedup_vs_transformers": statistics.median(
                   r["metrale_serve"]["tokens_per_s"] / r["transformers_generate"]["tokens_per_s"]
                   for r in rows)}
    path = write_result(args.name, payload)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
