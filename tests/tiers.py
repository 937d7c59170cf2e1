"""The test tiers: the default one, which CI runs, and the full one (``--full``, or
``METRALE_FULL_TESTS=1``: tests/conftest.py), which adds the tests marked ``full``.

A parametrized test samples its matrix in the default tier with :func:`sampled`: the cases that
cover each path stay, the rest (larger shapes, more orders of the same path) join the full tier.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pytest


def sampled(cases: Sequence[Any], keep: Iterable[int]) -> list[Any]:
    """``cases`` of a ``parametrize``, the ones at the indices ``keep`` in the default tier and
    the others marked ``full``."""
    keep = set(keep)
    assert keep <= set(range(len(cases))), (sorted(keep), len(cases))
    out = []
    for i, case in enumerate(cases):
        if i in keep:
            out.append(case)
        elif isinstance(case, type(pytest.param(None))):
            out.append(pytest.param(*case.values, marks=(*case.marks, pytest.mark.full),
                                    id=case.id))
        else:
            out.append(pytest.param(*(case if isinstance(case, tuple) else (case,)),
                                    marks=pytest.mark.full))
    return out
