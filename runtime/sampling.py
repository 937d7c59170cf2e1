"""Sampling parameters of a request, and their rows for the plan's ``sample`` op.

A :class:`Sampling` is what a user asks for (temperature, top-k, top-p, min-p, seed); its
:meth:`~Sampling.row` is the ``sample.params`` row ``(T, k, p, m)`` and :func:`key_row` the
``sample.keys`` row ``(seed_lo, seed_hi, request, position)`` that the family
(``metrale.lkb.semantics_sample``) reads. Temperature 0 is greedy (the default).

Law: the token a row draws depends only on its logits, its parameters and its key, so a
seeded request draws the same tokens alone or batched.

>>> s = Sampling(temperature=0.7, top_p=0.9, seed=3)
>>> s.row().tolist(), key_row(3, request=0, position=12).tolist()
([0.699999988079071, 0.0, 0.8999999761581421, 0.0], [3, 0, 0, 12])
>>> Sampling(top_p=1.5)
Traceback (most recent call last):
...
metrale.lkb.errors.ConfigError: top_p: bad sampling parameter (expected a number in (0, 1], found 1.5)
"""

from __future__ import annotations

import os
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import ConfigError

__all__ = ["GREEDY", "Sampling", "key_row", "random_seed"]

SEED_MAX = 2 ** 64 - 1


def _number(name: str, lo: float, hi: float, text: str, integer: bool = False) -> Any:
    def check(inst: Any, attribute: Any, value: Any) -> None:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and integer:
            ok = isinstance(value, int) or float(value).is_integer()
        if not ok or not (lo <= value <= hi) or (name == "top_p" and value <= 0):
            raise ConfigError("bad sampling parameter", key=name, expected=text,
                              found=repr(value))
    return check


@attrs.frozen
class Sampling:
    """How a request draws its tokens; every field is checked (a ``ConfigError`` names it).

    ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 are off; ``seed`` ``None`` draws a fresh seed
    per request (not reproducible).
    """

    temperature: float = attrs.field(
        default=0.0, validator=_number("temperature", 0.0, 100.0, "a number in [0, 100]"))
    top_k: int = attrs.field(
        default=0, validator=_number("top_k", 0, 2 ** 24, "an integer in [0, 2**24]", True))
    top_p: float = attrs.field(
        default=1.0, validator=_number("top_p", 0.0, 1.0, "a number in (0, 1]"))
    min_p: float = attrs.field(
        default=0.0, validator=_number("min_p", 0.0, 1.0, "a number in [0, 1]"))
    seed: int | None = attrs.field(default=None)

    @seed.validator
    def _seed(self, attribute: Any, value: Any) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or not 0 <= value <= SEED_MAX):
            raise ConfigError("bad sampling parameter", key="seed",
                              expected="an integer in [0, 2**64)", found=repr(value))

    @property
    def greedy(self) -> bool:
        """Temperature 0: the first largest logit, no draw."""
        return self.temperature == 0

    def row(self) -> np.ndarray:
        """The ``sample.params`` row: f32 ``(T, k, p, m)``."""
        return np.array([self.temperature, self.top_k, self.top_p, self.min_p], np.float32)

    @classmethod
    def from_defaults(cls, defaults: Any, **override: Any) -> Sampling:
        """The checkpoint's ``generation_config.json`` defaults (greedy unless ``do_sample``),
        then ``override``'s fields that are not ``None``."""
        base: dict[str, Any] = {}
        if defaults is not None and defaults.do_sample:
            for name in ("temperature", "top_k", "top_p", "min_p"):
                v = getattr(defaults, name)
                if v is not None:
                    base[name] = v
            base.setdefault("temperature", 1.0)
        base.update({k: v for k, v in override.items() if v is not None})
        return cls(**base)


GREEDY = Sampling()
"""Temperature 0: argmax decoding."""


def random_seed() -> int:
    """A fresh 64-bit seed from the operating system."""
    return int.from_bytes(os.urandom(8), "little")


def key_row(seed: int, *, request: int, position: int) -> np.ndarray:
    """The ``sample.keys`` row: i32 bit patterns of ``(seed_lo, seed_hi, request, position)``."""
    words = np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, request & 0xFFFFFFFF,
                      position & 0xFFFFFFFF], np.uint32)
    return words.view(np.int32)
