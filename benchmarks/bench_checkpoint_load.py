"""Loading every tensor of a Qwen3-0.6B-shaped bf16 checkpoint: wall time and peak RSS.

Run: ``python benchmarks/bench_checkpoint_load.py [--dir D] [--runs 5]``. It writes a random
bf16 checkpoint with Qwen3-0.6B's shapes (hidden 1024, intermediate 3072, 28 layers, 16 q and
8 kv heads of 128, vocab 151936, tied embeddings: about 1.19 GB) unless ``--dir`` already holds
one, then loads it in fresh processes: ``Checkpoint.open``, ``weight()`` for every logical
weight, and a read of every byte (an xor-reduction: what binding host weights costs when the
pages must come in). Warm runs find the file in the page cache; one cold run first evicts the
file's pages with ``posix_fadvise(DONTNEED)`` (this file only). Goals: warm < 3 s, peak RSS
< 1.5x the bytes touched.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import write_result  # noqa: E402

HIDDEN, INTER, LAYERS, QH, KVH, HD, VOCAB = 1024, 3072, 28, 16, 8, 128, 151936


def shapes() -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, HIDDEN),
                                       "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (QH * HD, HIDDEN),
            p + "self_attn.k_proj.weight": (KVH * HD, HIDDEN),
            p + "self_attn.v_proj.weight": (KVH * HD, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, QH * HD),
            p + "self_attn.q_norm.weight": (HD,),
            p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN),
            p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER),
        })
    return out


def make_checkpoint(folder: Path) -> None:
    import ml_dtypes
    import numpy as np

    from metrale.lkb.quant import FORMATS
    from metrale.runtime.checkpoint import write_checkpoint

    rng = np.random.default_rng(0)

    def tensors():
        for name, shape in shapes().items():
            yield name, (rng.standard_normal(shape, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
              "num_attention_heads": QH, "num_key_value_heads": KVH, "head_dim": HD,
              "vocab_size": VOCAB, "tie_word_embeddings": True}
    write_checkpoint(folder, tensors(), config, FORMATS["bf16"])


CHILD = r"""
import json, os, sys, time
import numpy as np
from metrale.runtime.checkpoint import Checkpoint

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

folder, cold = sys.argv[1], sys.argv[2] == "cold"
if cold:
    for p in os.listdir(folder):
        fd = os.open(os.path.join(folder, p), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
base = status("VmRSS")
t0 = time.perf_counter()
touched = 0
check = 0
with Checkpoint.open(folder) as ck:
    t_open = time.perf_counter() - t0
    for name in ck.weight_names():
        w = ck.weight(name)
        arrays = [w] if isinstance(w, np.ndarray) else [a for a in (w.data, w.scale, w.global_scale) if a is not None]
        for a in arrays:
            b = a.reshape(-1).view(np.uint8)
            words = b[: b.size // 8 * 8].view(np.uint64)
            check ^= int(np.bitwise_xor.reduce(words)) if words.size else 0
            check ^= int(np.bitwise_xor.reduce(b[words.size * 8:])) if b.size % 8 else 0
            touched += a.nbytes
    seconds = time.perf_counter() - t0
    # VmHWM, not ru_maxrss: Linux carries the parent's high-water mark across fork and exec
    peak = status("VmHWM")
print(json.dumps({"seconds": seconds, "open_s": t_open, "touched": touched, "peak_rss": peak,
                  "baseline_rss": base, "checksum": check}))
"""


def run_child(folder: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), mode], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="checkpoint folder to use (made if missing)")
    ap.add_argument("--runs", type=int, default=5, help="warm runs (median reported)")
    args = ap.parse_args()

    scratch = None
    folder = args.dir
    if folder is None:
        scratch = Path(tempfile.mkdtemp(prefix="metrale-bench-ckpt-"))
        folder = scratch / "qwen3-0.6b-bf16"
    try:
        t_make = None
        if not (folder / "model.safetensors").exists():
            t0 = time.perf_counter()
            make_checkpoint(folder)
            t_make = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
        cold = run_child(folder, "cold")
        run_child(folder, "warm")  # bring every page back before timing warm runs
        warm = [run_child(folder, "warm") for _ in range(args.runs)]
        assert len({r["checksum"] for r in warm + [cold]}) == 1, "runs read different bytes"
        med = statistics.median(r["seconds"] for r in warm)
        peak = max(r["peak_rss"] for r in warm)
        touched = warm[0]["touched"]
        result = {
            "file_bytes": size,
            "bytes_touched": touched,
            "make_s": t_make,
            "warm_runs_s": [r["seconds"] for r in warm],
            "warm_median_s": med,
            "warm_GBps": touched / med / 1e9,
            "open_median_s": statistics.median(r["open_s"] for r in warm),
            "cold_s": cold["seconds"],
            "peak_rss_bytes": peak,
            "baseline_rss_bytes": warm[0]["baseline_rss"],
            "peak_rss_over_touched": peak / touched,
            "goal_warm_s": 3.0,
            "goal_peak_rss_over_touched": 1.5,
            "cpus": os.cpu_count(),
        }
        path = write_result("checkpoint_load", result)
        print(f"checkpoint {folder} ({size / 1e9:.3f} GB, {touched / 1e9:.3f} GB touched)")
        print(f"{'measure':<28}{'value':>14}{'goal':>10}")
        print(f"{'warm load, median s':<28}{med:>14.3f}{'< 3':>10}")
        print(f"{'warm load, GB/s':<28}{touched / med / 1e9:>14.2f}{'':>10}")
        print(f"{'  of which open s':<28}{result['open_median_s']:>14.4f}{'':>10}")
        print(f"{'cold load (fadvise), s':<28}{cold['seconds']:>14.3f}{'':>10}")
        print(f"{'peak RSS, GB':<28}{peak / 1e9:>14.3f}{'':>10}")
        print(f"{'peak RSS / bytes touched':<28}{peak / touched:>14.3f}{'< 1.5':>10}")
        print(f"{'baseline RSS (imports), MB':<28}{warm[0]['baseline_rss'] / 1e6:>14.1f}{'':>10}")
        print(f"wrote {path}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
