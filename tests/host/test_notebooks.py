"""Every notebook in notebooks/ runs top to bottom in a fresh kernel, and is committed stripped.

Each notebook executes with nbclient in its own folder (as Jupyter runs it), a per-cell time
limit and a whole-notebook budget; any error fails the test with the cell that raised. The
committed files carry no outputs (``python notebooks/strip.py`` strips them).
"""

from __future__ import annotations

import copy
import importlib.util
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
EXPECTED = ["01_the_lkb.ipynb", "02_functors.ipynb", "03_plan_a_model.ipynb",
            "04_residual_and_evidence.ipynb", "05_run.ipynb", "06_the_composite.ipynb",
            "07_gpt_oss.ipynb"]
CELL_TIMEOUT_S = 120
BUDGET_S = {"05_run.ipynb": 180}
"""Whole-notebook wall time allowed (default 90 s); 05 builds a transformers checkpoint."""


def _strip_module():
    spec = importlib.util.spec_from_file_location("notebook_strip", FOLDER / "strip.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_notebooks_are_all_there():
    assert [p.name for p in NOTEBOOKS] == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_is_stripped(path: Path):
    strip = _strip_module()
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code"
    assert all(c.outputs == [] and c.execution_count is None for c in code), \
        f"{path.name} carries outputs: run python notebooks/strip.py"
    assert strip.is_stripped(nb)


def test_strip_removes_outputs_and_keeps_code(tmp_path: Path):
    strip = _strip_module()
    nb = nbformat.read(NOTEBOOKS[0], as_version=4)
    dirty = copy.deepcopy(nb)
    dirty.cells[1].outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    dirty.cells[1].execution_count = 3
    dirty.metadata["language_info"] = {"name": "python", "version": "3.11.7"}
    target = tmp_path / "dirty.ipynb"
    nbformat.write(dirty, target)
    assert strip.main(["--check", str(target)]) == 1
    assert strip.main([str(target)]) == 0
    clean = nbformat.read(target, as_version=4)
    assert strip.is_stripped(clean)
    assert [c.source for c in clean.cells] == [c.source for c in nb.cells]
    assert strip.main(["--check", str(target)]) == 0


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path: Path):
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    # kernel "python3" runs this interpreter (jupyter_client swaps "python" for sys.executable)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(FOLDER)}})
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{e}")
    seconds = time.perf_counter() - start
    assert seconds < BUDGET_S.get(path.name, 90), f"{path.name} took {seconds:.0f} s"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    ran = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in ran), "a cell did not run"
