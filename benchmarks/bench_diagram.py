"""Composing and comparing long chains of boxes: time and growth from 1,000 to 10,000 boxes.

Run: ``python benchmarks/bench_diagram.py``. Goal: 10,000 boxes composed and compared well
under a second each, growing about linearly. Also timed: comparing diagrams whose boxes no
output reads all tie (pairs of a source and its reader, in two construction orders), the case
that takes the canonical form's colour refinement longest.
"""

from __future__ import annotations

import gc
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import median_time, write_result  # noqa: E402

from metrale.lkb import Box, Diagram, TensorType, Ty  # noqa: E402
from metrale.lkb.dtype import BF16  # noqa: E402

X = Ty(TensorType(("rows", "hidden"), BF16))


def measure(n: int) -> dict[str, float]:
    boxes = [Box(f"op{i % 11}", X, X, {"i": i % 5}) for i in range(n)]

    def compose() -> Diagram:
        d = boxes[0].diagram
        for b in boxes[1:]:
            d = d >> b
        len(d)  # flatten: the composite is really built
        return d

    def compare() -> bool:
        a, b = compose(), compose()
        assert a == b
        return True

    a = compose()
    b = compose()
    t_eq = median_time(lambda: (a == b, object.__setattr__(a, "_canon", None),
                                object.__setattr__(b, "_canon", None)))
    gc.disable()  # the same work without the collector's full-heap scans: the algorithm's cost
    try:
        compose_no_gc = median_time(compose)
    finally:
        gc.enable()
    return {"boxes": n, "compose_s": median_time(compose), "compare_s": t_eq,
            "compose_gc_paused_s": compose_no_gc, "compose_and_compare_s": median_time(compare)}


def measure_dead(n: int) -> dict[str, float]:
    """Two diagrams of n / 2 dead pairs ``v = g(); f(v)``, the pairs in two orders: equal."""
    source, reader = Box("g", Ty(), X), Box("f", X, Ty())

    def pairs(order: list[int]) -> Diagram:
        boxes, wiring = [], []
        for _ in order:
            boxes += [source, reader]
            wiring += [(), ((len(boxes) - 2, 0),)]
        return Diagram.flat(Ty(), Ty(), boxes, wiring, [])

    order = list(range(n // 2))
    a, b = pairs(order), pairs(random.Random(0).sample(order, len(order)))
    assert a == b, "isomorphic diagrams compared unequal"
    t_eq = median_time(lambda: (a == b, object.__setattr__(a, "_canon", None),
                                object.__setattr__(b, "_canon", None)))
    return {"boxes": n, "compare_s": t_eq}


def main() -> None:
    rows = [measure(n) for n in (1000, 2000, 5000, 10000)]
    dead = [measure_dead(n) for n in (1000, 2000, 5000, 10000)]
    first, last = rows[0], rows[-1]
    growth = {k: last[k] / first[k] for k in ("compose_s", "compose_gc_paused_s", "compare_s")}
    print(f"{'boxes':>7} {'compose ms':>11} {'(gc paused)':>12} {'compare ms':>11}")
    for r in rows:
        print(f"{r['boxes']:>7} {r['compose_s'] * 1e3:>11.1f} "
              f"{r['compose_gc_paused_s'] * 1e3:>12.1f} {r['compare_s'] * 1e3:>11.1f}")
    print(f"growth 1k→10k (10x boxes): compose {growth['compose_s']:.1f}x "
          f"({growth['compose_gc_paused_s']:.1f}x with the collector paused: its full-heap scans "
          f"are the non-linear part), compare {growth['compare_s']:.1f}x")
    for r in dead:
        print(f"{r['boxes']:>7} boxes in tied dead pairs: compare {r['compare_s'] * 1e3:.1f} ms")
    ok = last["compose_s"] < 1.0 and last["compare_s"] < 1.0
    path = write_result("diagram", {"rows": rows, "dead_pairs": dead, "growth_1k_to_10k": growth,
                                    "goal": "10k boxes < 1 s each, ~linear", "met": ok})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
