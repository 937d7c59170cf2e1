"""Metrale: a category-theory-first compiler framework for the kernel plans of LLM inference.

The public API, re-exported here (each name imported on first use, so ``import metrale`` stays
light and never imports CuPy or Hypothesis):

>>> import metrale
>>> plan = metrale.plan_for("tiny-qwen3", "bf16", "host")
>>> plan.kernel_count > 0 and isinstance(metrale.Presentation.load(), metrale.Presentation)
True
>>> sorted(metrale.__all__)[:4]
['AllocationError', 'AxiomError', 'Box', 'BuildCache']
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # the category toolkit
    "Box": "metrale.lkb.diagram", "Builder": "metrale.lkb.diagram",
    "Diagram": "metrale.lkb.diagram", "Functor": "metrale.lkb.functor",
    "compose": "metrale.lkb.functor", "Ty": "metrale.lkb.ty", "TensorType": "metrale.lkb.ty",
    "DType": "metrale.lkb.dtype", "KernelTarget": "metrale.lkb.target",
    "ProductCategory": "metrale.lkb.category", "Coproduct": "metrale.lkb.category",
    "Poset": "metrale.lkb.category", "Vendor": "metrale.lkb.vendor",
    # the LKB
    "Presentation": "metrale.lkb.presentation", "Family": "metrale.lkb.family",
    "Point": "metrale.lkb.family", "Relation": "metrale.lkb.relation",
    "QuantFormat": "metrale.lkb.quant", "QuantTensor": "metrale.lkb.quant",
    # realization
    "realization": "metrale.realize.functor", "load_hardware": "metrale.realize.hardware",
    "residual": "metrale.realize.residual", "relations_on": "metrale.realize.relations",
    "build": "metrale.realize.build", "BuildCache": "metrale.realize.cache",
    "Registry": "metrale.realize.registry", "preflight": "metrale.realize.preflight",
    # planning
    "ModelConfig": "metrale.plan.config", "circuit_for": "metrale.plan.circuit",
    "lowering": "metrale.plan.lower", "rewrite": "metrale.plan.fuser",
    "rewriting": "metrale.plan.fuser", "fuser": "metrale.plan.fuser",
    "target": "metrale.realize.target", "Target": "metrale.realize.target",
    "Pipeline": "metrale.lkb.pipeline",
    "plan_for": "metrale.plan.plan", "Plan": "metrale.plan.plan",
    # runtime
    "Engine": "metrale.runtime.engine", "Program": "metrale.runtime.executor",
    "HostBackend": "metrale.runtime.host_backend", "MockBackend": "metrale.runtime.mock_backend",
    "CupyBackend": "metrale.runtime.cupy_backend", "Checkpoint": "metrale.runtime.checkpoint",
    "quantize_checkpoint": "metrale.runtime.quantize",
    # errors
    "MetraleError": "metrale.lkb.errors", "AxiomError": "metrale.lkb.errors",
    "ConfigError": "metrale.lkb.errors", "CheckpointError": "metrale.lkb.errors",
    "CompileError": "metrale.lkb.errors", "PlanError": "metrale.lkb.errors",
    "AllocationError": "metrale.lkb.errors", "LaunchError": "metrale.lkb.errors",
    "DeviceFault": "metrale.lkb.errors", "UnavailableError": "metrale.lkb.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metrale' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
