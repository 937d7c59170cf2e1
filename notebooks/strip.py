"""Strip the outputs of notebooks, so that committed notebooks diff as code.

``python notebooks/strip.py`` strips every notebook in this folder in place (atomically);
``--check`` changes nothing and exits 1 naming the notebooks that carry outputs (CI runs the
same check as ``tests/host/test_notebooks.py``). Paths may be given instead of the folder.

A stripped notebook has no outputs, no execution counts, no per-cell execution metadata and
no record of the Python version that last ran it; its cells, their ids and the notebook's
kernelspec are kept.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import nbformat

from metrale.lkb.files import atomic_write

CELL_METADATA_DROPPED = ("execution", "collapsed", "scrolled", "ExecuteTime")
NOTEBOOK_METADATA_DROPPED = ("widgets",)


def strip(nb: Any) -> Any:
    """A copy of ``nb`` with every output and execution count removed."""
    out = copy.deepcopy(nb)
    for key in NOTEBOOK_METADATA_DROPPED:
        out.metadata.pop(key, None)
    if "language_info" in out.metadata:  # executing records the Python version: noise in diffs
        out.metadata["language_info"] = {"name": out.metadata["language_info"].get("name",
                                                                                  "python")}
    for cell in out.cells:
        for key in CELL_METADATA_DROPPED:
            cell.metadata.pop(key, None)
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    return out


def is_stripped(nb: Any) -> bool:
    """Whether ``nb`` is already stripped."""
    return strip(nb) == nb


def notebooks(paths: list[str]) -> list[Path]:
    """The notebooks named, or every ``*.ipynb`` of this folder."""
    if paths:
        return [Path(p) for p in paths]
    return sorted(Path(__file__).resolve().parent.glob("*.ipynb"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="notebooks (default: notebooks/*.ipynb)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a "
                        "notebook carries outputs")
    args = parser.parse_args(argv)
    dirty = []
    for path in notebooks(args.paths):
        nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
        if is_stripped(nb):
            continue
        dirty.append(path)
        if not args.check:
            atomic_write(path, nbformat.writes(strip(nb)) + "\n")
    for path in dirty:
        print(f"{path}: {'has outputs' if args.check else 'stripped'}")
    return 1 if args.check and dirty else 0


if __name__ == "__main__":
    sys.exit(main())
