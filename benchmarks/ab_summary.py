"""The verdict of an A/B call: every tree's decode steps side by side, from the result files
``ab_gpu_step.sh run`` leaves (``gpu_decode_N_TAG.json``, N the run's place in the call).

For each step (model, quant, policy, batch): each tree's step times in run order, their median,
and the median's ratio to the baseline tree's (``--base``, default ``work``), so a change is
judged within one call, where the run-to-run spread between calls is as large as most gains. It
also says whether the trees' logits hashed the same (``logits_sha256``: fixed seeds, so trees
whose kernels agree bit for bit give equal hashes) and names any step where they did not.

Run where the files are: ``python3 benchmarks/ab_summary.py $OUT`` (``ab_gpu_step.sh run``
does, at its end). Prints the table and writes ``ab_summary.json`` beside the files.

>>> rows = [{"model": "m", "quant": "bf16", "policy": "exact", "batch": 1, "step_s": s,
...          "logits_sha256": "x"} for s in (2e-3, 1e-3)]
>>> summary({"work": [rows[0]], "new": [rows[1]]}, base="work")["steps"][0]["trees"]["new"]
{'runs_ms': [1.0], 'median_ms': 1.0, 'ratio': 0.5}
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import atomic_write  # noqa: E402

RUN_FILE = re.compile(r"gpu_decode_(\d+)_(.+)\.json")
KEY = ("model", "quant", "policy", "batch")


def read_runs(folder: Path) -> dict[str, list[dict]]:
    """Tree tag -> its step rows, in the order the call ran them (the file's N)."""
    found = []
    for p in folder.iterdir():
        m = RUN_FILE.fullmatch(p.name)
        if m:
            found.append((int(m.group(1)), m.group(2), p))
    if not found:
        raise SystemExit(f"{folder}: no gpu_decode_N_TAG.json files (ab_gpu_step.sh run's)")
    runs: dict[str, list[dict]] = {}
    for _, tag, p in sorted(found):
        try:
            rows = json.loads(p.read_text())["rows"]
        except (ValueError, KeyError) as e:
            raise SystemExit(f"{p}: not a bench_gpu_decode.py result ({e})") from None
        runs.setdefault(tag, []).extend(r for r in rows if "step_s" in r and "model" in r)
    return runs


def summary(runs: dict[str, list[dict]], base: str = "work") -> dict[str, Any]:
    """Per step, each tree's runs (ms), median and ratio to ``base``'s median; hash agreement."""
    if base not in runs:
        raise SystemExit(f"no runs of the baseline tree {base!r} (trees: {', '.join(runs)})")
    keys = sorted({tuple(r[k] for k in KEY) for rows in runs.values() for r in rows},
                  key=lambda k: tuple(str(x) for x in k))
    steps = []
    for key in keys:
        trees: dict[str, Any] = {}
        hashes: dict[str, set] = {}
        for tag, rows in runs.items():
            mine = [r for r in rows if tuple(r[k] for k in KEY) == key]
            if not mine:
                continue
            ms = [round(r["step_s"] * 1e3, 4) for r in mine]
            trees[tag] = {"runs_ms": ms, "median_ms": round(statistics.median(ms), 4)}
            hashes[tag] = {r.get("logits_sha256") for r in mine}
        ref = trees.get(base, {}).get("median_ms")
        for t in trees.values():
            t["ratio"] = round(t["median_ms"] / ref, 4) if ref else None
        distinct = set().union(*hashes.values())
        steps.append({**dict(zip(KEY, key)), "trees": trees,
                      "same_logits": len(distinct) == 1 and None not in distinct})
    return {"base": base, "trees": list(runs), "steps": steps}


def table(s: dict[str, Any]) -> str:
    """The summary as text: a line per step, each tree's median (ms) and ratio to the base."""
    tags = s["trees"]
    out = ["step".ljust(34) + "".join(t[:18].rjust(20) for t in tags) + "  logits"]
    for st in s["steps"]:
        name = f"{st['model']} {st['quant']} {st['policy']} b{st['batch']}"
        cells = []
        for t in tags:
            v = st["trees"].get(t)
            cells.append((f"{v['median_ms']:.3f} ({v['ratio']:.3f})" if v and v["ratio"]
                          else (f"{v['median_ms']:.3f}" if v else "-")).rjust(20))
        out.append(name.ljust(34) + "".join(cells)
                   + ("  same" if st["same_logits"] else "  DIFFER"))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path, help="where ab_gpu_step.sh run left its result files")
    ap.add_argument("--base", default="work", help="the tree the others are compared with")
    args = ap.parse_args(argv)
    s = summary(read_runs(args.folder), args.base)
    print(table(s))
    atomic_write(args.folder / "ab_summary.json", json.dumps(s, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
