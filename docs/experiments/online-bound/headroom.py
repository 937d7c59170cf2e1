"""How much of online_prefill_attention's bound the host semantics use: the online softmax
(kv_append_attention_online, blocks of 64) against the declared order (kv_append_attention,
blocks of 256) on a 300-row prompt of random bf16 q, k, v (q scaled 1 and 4), six seeds. Prints,
per case, the abs coefficient c (in eps_act, times the rms of the output) that
|lhs - rhs| <= 2 eps_act |lhs| + c eps_act rms(lhs) needs. The relation declares c = 8.

Run: ``python3 docs/experiments/online-bound/headroom.py`` (host only, seconds).
"""

import numpy as np

from metrale.lkb.semantics import BF16, SEMANTICS

EPS = 2.0 ** -8


def rand(rng: np.random.Generator, *shape: int, s: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * s).astype(np.float32).astype(BF16)


two_pass, online = SEMANTICS["kv_append_attention"], SEMANTICS["kv_append_attention_online"]
worst = 0.0
for seed in range(6):
    rng = np.random.default_rng(seed)
    rows, hq, hkv, d, ctx = 300, 8, 2, 64, 700
    for q_scale in (1.0, 4.0):
        q = rand(rng, rows, hq, d, s=q_scale)
        k, v = rand(rng, rows, hkv, d), rand(rng, rows, hkv, d)
        kc, vc = rand(rng, 1, ctx, hkv, d), rand(rng, 1, ctx, hkv, d)
        pos = np.arange(rows, dtype=np.int32) + 50 * seed
        slots = np.zeros(rows, np.int32)
        common = {"scale": d ** -0.5, "window": 0, "act": "bf16"}
        a = two_pass(k, v, q, kc.copy(), vc.copy(), pos, slots, kv_block=256, **common)[0]
        b = online(k, v, q, kc.copy(), vc.copy(), pos, slots, kv_block=64, **common)[0]
        a, b = a.astype(np.float32), b.astype(np.float32)
        rms = float(np.sqrt(np.mean(a * a)))
        c = float(np.max((np.abs(a - b) - 2 * EPS * np.abs(a)) / (EPS * rms)))
        worst = max(worst, c)
        print(f"seed {seed} q x{q_scale:g}: abs coefficient needed {c:.2f}, "
              f"outputs moved {np.mean(a != b):.1%}")
print(f"worst {worst:.2f} (declared 8)")
