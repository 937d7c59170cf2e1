"""Kernel sources and registries (package data): KERNEL_FAMILIES.toml, FUSIONS.toml, <hw>/.

Installed, this folder is ``metrale.kernels``. Where the repository root is on ``sys.path`` (pytest
runs from it; the notebooks add it for ``tests.oracle``), the folder is also found as a top-level
``kernels``: the name of Hugging Face's kernels distribution, which transformers imports. Imported
under that name, this module hands the name over to that distribution where it is installed.
"""
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

if __name__ == "kernels":
    _here = Path(__file__).resolve().parent.parent
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if Path(p or ".").resolve() != _here])
    if _spec is not None and _spec.loader is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
