"""Evaluate an LKB diagram by the reference semantics: the meaning of a plan, on NumPy arrays.

Every box is a family point (its params hold the point and the runtime attributes); inputs
and outputs are arrays in the wires' dtypes. Weights reach the semantics in f32, as the host
realization binds them (an array of a narrower float dtype fed to a weight port is upcast,
exactly, on the way in). In-place families write into their input arrays, so callers pass
copies when they want to keep them.

>>> import numpy as np
>>> from metrale.lkb.presentation import Presentation
>>> P = Presentation.load()
>>> fam = P.family("add")
>>> box = fam.box(fam.point(act="f32"))
>>> a = np.ones((2, 3), np.float32)
>>> evaluate(box.diagram, [a, a], P)[0].tolist()
[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from functools import cache

import numpy as np

from .diagram import Diagram
from .errors import AxiomError
from .presentation import Presentation
from .semantics import SEMANTICS


@cache
def _accepted(name: str) -> frozenset[str]:
    return frozenset(inspect.signature(SEMANTICS[name]).parameters)


def evaluate(d: Diagram, inputs: Sequence[np.ndarray], P: Presentation) -> list[np.ndarray]:
    """The outputs of ``d`` on ``inputs``, box by box in order."""
    if len(inputs) != len(d.dom):
        raise AxiomError("one array per input wire", expected=len(d.dom), found=len(inputs))
    values: dict[tuple[int, int], np.ndarray] = {(-1, k): a for k, a in enumerate(inputs)}
    for j, (box, srcs) in enumerate(zip(d.boxes, d.wiring)):
        fam = P.family(box.name)
        fn = SEMANTICS[fam.semantics]
        accepted = _accepted(fam.semantics)
        kwargs = {k: v for k, v in box.params if k in accepted}
        args = []
        for port, s in zip(fam.inputs, srcs):
            a = values[s]
            if port.name in fam.weights and a.dtype != np.float32:
                a = a.astype(np.float32)
            args.append(a)
        outs = fn(*args, **kwargs)
        for p, out in enumerate(outs):
            values[(j, p)] = out
    return [values[s] for s in d.outputs]
