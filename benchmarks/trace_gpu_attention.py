"""Where the time of one decode-attention launch goes: phase marks inside the kernel.

Builds ``cuda/common/attention_decode.cu`` with ``PHASE_TRACE`` (``phase.cuh``: thread 0 of
every block writes the SM clock and the global timer at each ``phase_mark``), launches the rope
entry at the decode shapes of Qwen3-0.6B, Llama-3.1-8B and gpt-oss-20b (whose sink attention's
decode launch is this entry; only its merge differs), and prints, per phase, the median
over blocks of the time since the block started (global timer, ns) and the median of the SM
cycles spent in the phase. The marks cover the decode launch up to its chunk records; the merge
launched after it (``metrale_attention_decode_merge``) is not traced, but it is in the
per-launch figure: both launches, unmarked and timed in a CUDA graph as ``bench_gpu_variants.py``
times them. ``block_start_spread_ns`` says whether the launch's blocks all started at once
(one wave) or some waited for a multiprocessor (more blocks than fit).

Run on the lent GPU: ``python benchmarks/trace_gpu_attention.py [--defines "VAR=1 ..."]``.
Writes ``benchmarks/results/gpu_attention_trace.json``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from _common import write_result  # noqa: E402
from bench_gpu_variants import (  # noqa: E402
    CONTEXT,
    attention_launcher,
    chunk_shape,
    decode_attention,
    decode_inputs,
    then_launch,
    time_graph,
)

from metrale.lkb.semantics_attention import rope_tables  # noqa: E402

MARKS = 16  # phase.cuh PHASE_MARKS
MAX_BLOCKS = 4096
PHASES = ["entry", "before wait", "after wait", "q staged", "scores", "softmax", "p·v",
          "records stored"]
# (model, hq, hkv, head_dim)
SHAPES = [("qwen3-0.6b", 16, 8, 128), ("llama-3.1-8b", 32, 8, 128), ("gpt-oss-20b", 64, 8, 64)]


def summarize(marks: np.ndarray, names: list[str] = PHASES) -> dict:
    """The phases of one marked launch from its trace ``marks`` [blocks, MARKS, (cycles, ns)]
    (zeros: a mark not reached; a block with no entry mark ran none): per phase the blocks that
    reached it, the median since each block's entry (ns), the median SM cycles since the mark
    before, and the median since the first block's entry; the spread of the blocks' entries
    and the first entry to the last block's last mark.

    >>> m = np.zeros((2, MARKS, 2), np.int64)
    >>> m[0, :3] = [[10, 100], [30, 150], [40, 170]]
    >>> m[1, :2] = [[5, 300], [9, 360]]
    >>> r = summarize(m, ["entry", "before wait", "after wait"])
    >>> r["blocks"], r["block_start_spread_ns"], [p["blocks"] for p in r["phases"]]
    (2, 200.0, [2, 2, 1])
    >>> r["phases"][1]["ns_since_block_start"], r["phases"][1]["cycles_in_phase"]
    (55.0, 12.0)
    """
    t = marks[marks[:, 0, 1] > 0]
    g0 = t[:, 0, 1].min()
    phases = []
    for i, name in enumerate(names):
        have = t[:, i, 1] > 0
        if not have.any():
            continue
        cycles = t[have, i, 0] - t[have, i - 1, 0] if i > 0 else np.zeros(have.sum())
        phases.append({"phase": name, "blocks": int(have.sum()),
                       "ns_since_block_start": float(np.median(t[have, i, 1] - t[have, 0, 1])),
                       "cycles_in_phase": float(np.median(cycles)),
                       "ns_since_first_block": float(np.median(t[have, i, 1] - g0))})
    last = t[:, :, 1].max(axis=1)
    return {"blocks": len(t), "block_start_spread_ns": float(t[:, 0, 1].max() - g0),
            "first_start_to_last_end_ns": float(last.max() - g0), "phases": phases}


def trace_shape(cp: Any, traced: tuple, plain: tuple, trace: Any, defines: str, model: str,
                hq: int, hkv: int, d: int, position: int) -> dict:
    """One row at ``position`` of a (hq, hkv, d) model: the unmarked and marked kernels timed in
    a graph, then one marked launch read back, phase by phase."""
    x = decode_inputs(cp, hq, hkv, d, 1, position)
    cos, sin = (cp.asarray(t) for t in rope_tables(x.max_ctx, d))
    (mod_t, fn_t, kernel), (mod_p, fn_p, _) = traced, plain
    grid, block, shared = chunk_shape(kernel.launch_for(x.sizes), defines, x.max_ctx)
    nblocks = grid[0] * grid[1] * grid[2]
    scalars = (np.int32(1), np.int32(hq), np.int32(hkv), np.int32(d), np.int32(x.max_ctx),
               np.int32(x.max_ctx), np.float32(d ** -0.5), np.int32(0))

    def launcher(module, fn):
        merge = then_launch(module, kernel, x.sizes,
                            {"positions": x.positions, "o": x.o, "work": x.work}, defines)
        return attention_launcher(fn, (grid, block, shared), x.caches, (x.q, x.k, x.v),
                                  (x.positions, x.slots, cos, sin, x.o, x.work), scalars, merge)

    per_launch = time_graph(cp, launcher(mod_p, fn_p), x.copies)
    marked = time_graph(cp, launcher(mod_t, fn_t), x.copies)
    trace[...] = 0
    launcher(mod_t, fn_t)(0)
    cp.cuda.Device().synchronize()
    marks = trace.get().reshape(MAX_BLOCKS, MARKS, 2)[:nblocks].astype(np.int64)
    out = {"model": model, "position": position, "launch_seconds_graph": per_launch,
           "launch_seconds_graph_marked": marked, **summarize(marks)}
    print(f"{model} position={position}: {per_launch * 1e6:.2f} us per launch in a graph "
          f"({marked * 1e6:.2f} marked); blocks start over {out['block_start_spread_ns']:.0f} ns, "
          f"first start to last end {out['first_start_to_last_end_ns']:.0f} ns", flush=True)
    for ph in out["phases"]:
        print(f"   {ph['phase']:16} {ph['ns_since_block_start']:7.0f} ns  "
              f"{ph['cycles_in_phase']:7.0f} cycles  ({ph['blocks']} blocks)", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--defines", default="", help="extra defines for both builds")
    args = ap.parse_args()
    import cupy as cp

    cp.random.seed(0)
    with tempfile.TemporaryDirectory() as tmp:  # each module is loaded where it is built
        traced = decode_attention(cp, "rope_kv_append_attention", f"{args.defines} "
                                  f"PHASE_TRACE={MAX_BLOCKS}", Path(tmp) / "traced.cubin",
                                  style="neox")
        plain = decode_attention(cp, "rope_kv_append_attention", args.defines,
                                 Path(tmp) / "plain.cubin", style="neox")
    ptr = traced[0].get_global("metrale_phase_trace")
    trace = cp.ndarray((MAX_BLOCKS * MARKS * 2,), cp.uint64, ptr)
    results = [trace_shape(cp, traced, plain, trace, args.defines, m, hq, hkv, d, pos)
               for m, hq, hkv, d in SHAPES for pos in (CONTEXT, 200)]
    path = write_result("gpu_attention_trace", {"defines": args.defines, "rows": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
