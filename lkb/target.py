"""Targets: 𝒯 ≅ Hw × Mod × Quant, and ``KernelTarget``, one object of it.

A performance claim lives on one target; kernel sources are shared across targets. The
projections read one coordinate off a target.

>>> t = KernelTarget("sm_90", "qwen3-0.6b", "bf16")
>>> t.hw, t.model, t.quant
('sm_90', 'qwen3-0.6b', 'bf16')
>>> T = target_category(Poset("Hw", ["cuda", "sm_90"], [("sm_90", "cuda")]),
...                     ["qwen3-0.6b"], ["bf16", "fp8"])
>>> t.as_tuple() in T.objects()
True
>>> T.projection(2)(t.as_tuple())
'bf16'
>>> print(t)
sm_90/qwen3-0.6b/bf16
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from .category import Discrete, Poset, ProductCategory


@attrs.frozen
class KernelTarget:
    """A (hardware class, model, quantization) triple: the key of one registry summand."""

    hw: str
    model: str
    quant: str

    def as_tuple(self) -> tuple[str, str, str]:
        """The target as an object of ``target_category``."""
        return (self.hw, self.model, self.quant)

    @property
    def path(self) -> str:
        """``<hw>/<model>/<quant>``: the leaf directory of this target under ``kernels/``."""
        return f"{self.hw}/{self.model}/{self.quant}"

    def __str__(self) -> str:
        return self.path


def target_category(hw: Poset, models: Iterable[str], quants: Iterable[str]) -> ProductCategory:
    """𝒯 = Hw × Mod × Quant with Mod and Quant discrete."""
    return ProductCategory((hw, Discrete("Mod", tuple(models)), Discrete("Quant", tuple(quants))))
