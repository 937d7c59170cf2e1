"""Time the reference semantics on a Qwen3-0.6B-shaped decode step (rows=1), as the host class
runs it: one decoder layer alone, the 28-layer step with lm_head and argmax, and lm_head alone.

Weights are random f32 (the host upcasts at load), distinct per layer so nothing is timed hot
from cache; activations bf16; the KV cache holds ``--context`` positions. Writes JSON to
``benchmarks/results/host_semantics.json`` (or ``--out``) and prints it.

    python benchmarks/bench_host_semantics.py [--layers 28] [--context 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from metrale.lkb.files import atomic_write
from metrale.lkb.semantics import (
    BF16,
    F32,
    argmax,
    embedding,
    gate_up_swiglu,
    linear,
    linear_add,
    qkv,
    rmsnorm,
)
from metrale.lkb.semantics_attention import kv_append_attention, qk_norm_rope, rope_tables

QWEN3_0_6B = dict(hidden=1024, heads=16, kv_heads=8, head_dim=128, inter=3072, vocab=151936,
                  layers=28, eps=1e-6, theta=1e6)
POINT = dict(k_block=256, h_block=256, head_block=128, kv_block=256)


def make_layer(rng, s, context):
    h, d, inter = s["hidden"], s["head_dim"], s["inter"]

    def w(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * shape[-1] ** -0.5).astype(F32)

    def cache():
        return rng.standard_normal((1, context, s["kv_heads"], d), np.float32).astype(BF16)

    return dict(
        ln1=1 + 0.1 * w(h), ln2=1 + 0.1 * w(h), wq=w(s["heads"] * d, h),
        wk=w(s["kv_heads"] * d, h), wv=w(s["kv_heads"] * d, h), qn=1 + 0.1 * w(d),
        kn=1 + 0.1 * w(d), wo=w(h, s["heads"] * d), wg=w(inter, h), wu=w(inter, h),
        wd=w(h, inter), kc=cache(), vc=cache(),
    )


def decoder_layer(x, L, s, pos, cos, sin):
    """One Qwen3 decoder layer in family calls, as the host plan runs it (rows = x.shape[0])."""
    p, rows, d = POINT, x.shape[0], s["head_dim"]
    slots = np.zeros(rows, np.int32)
    (y,) = rmsnorm(x, L["ln1"], eps=s["eps"], h_block=p["h_block"], act="bf16")
    q, k, v = qkv(y, L["wq"], L["wk"], L["wv"], k_block=p["k_block"], act="bf16")
    q, k = qk_norm_rope(q.reshape(rows, s["heads"], d), k.reshape(rows, s["kv_heads"], d),
                        L["qn"], L["kn"], pos, cos, sin, eps=s["eps"], h_block=p["head_block"],
                        act="bf16")
    o, _, _ = kv_append_attention(k, v.reshape(rows, s["kv_heads"], d), q, L["kc"], L["vc"], pos,
                                  slots, scale=d**-0.5, kv_block=p["kv_block"], act="bf16")
    (x,) = linear_add(o.reshape(rows, -1), L["wo"], x, k_block=p["k_block"], act="bf16")
    (y,) = rmsnorm(x, L["ln2"], eps=s["eps"], h_block=p["h_block"], act="bf16")
    (hh,) = gate_up_swiglu(y, L["wg"], L["wu"], k_block=p["k_block"], act="bf16")
    (x,) = linear_add(hh, L["wd"], x, k_block=p["k_block"], act="bf16")
    return x


def timed(fn, repeat):
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=QWEN3_0_6B["layers"])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "host_semantics.json"))
    args = ap.parse_args()
    s = QWEN3_0_6B
    rng = np.random.default_rng(0)
    layers = [make_layer(rng, s, args.context) for _ in range(args.layers)]
    table = rng.standard_normal((s["vocab"], s["hidden"]), np.float32).astype(BF16)
    lm_head = (rng.standard_normal((s["vocab"], s["hidden"]), np.float32) * 0.03).astype(F32)
    final_ln = np.ones(s["hidden"], F32)
    cos, sin = rope_tables(args.context, s["head_dim"], s["theta"])
    pos = np.array([args.context - 1], np.int32)  # decode at the last cache position
    ids = np.array([42], np.int32)

    def step():
        (x,) = embedding(ids, table, act="bf16")
        for L in layers:
            x = decoder_layer(x, L, s, pos, cos, sin)
        (y,) = rmsnorm(x, final_ln, eps=s["eps"], h_block=POINT["h_block"], act="bf16")
        (logits,) = linear(y, lm_head, k_block=POINT["k_block"], out="f32", act="bf16")
        return argmax(logits)

    x0 = embedding(ids, table, act="bf16")[0]
    step()  # warm up (page in the weights)
    # one layer, cycling through the layers so its weights are not cache-hot
    it = iter(range(10**9))
    layer_med, layer_min = timed(
        lambda: decoder_layer(x0, layers[next(it) % len(layers)], s, pos, cos, sin),
        max(args.repeat * 4, len(layers)))
    y0 = rmsnorm(x0, final_ln, eps=s["eps"], h_block=256, act="bf16")[0]
    head_med, head_min = timed(
        lambda: linear(y0, lm_head, k_block=POINT["k_block"], out="f32", act="bf16"), args.repeat)
    step_med, step_min = timed(step, args.repeat)
    result = {
        "benchmark": "host_semantics_decode",
        "model_shape": "qwen3-0.6b",
        "shape": s | {"layers": args.layers},
        "point": POINT,
        "act": "bf16",
        "weights": "f32",
        "rows": 1,
        "context": args.context,
        "repeat": args.repeat,
        "layer_ms_median": round(layer_med, 3),
        "layer_ms_min": round(layer_min, 3),
        "lm_head_ms_median": round(head_med, 3),
        "step_ms_median": round(step_med, 3),
        "step_ms_min": round(step_min, 3),
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    text = json.dumps(result, indent=2) + "\n"
    atomic_write(args.out, text)
    print(text, end="")


if __name__ == "__main__":
    main()
