"""Hardware vendors: the five families of compute targets a hardware class can belong to.

A vendor picks the compiler (``realize.compute.target_for``). Spellings are forgiving (the
names of each vendor's toolchains are accepted too) and case-insensitive; anything else is a
``ConfigError`` that lists the valid spellings and suggests the nearest one.

>>> Vendor.parse("CUDA") is Vendor.NVIDIA
True
>>> Vendor.parse(" rocm ") is Vendor.AMD, Vendor.parse("metal"), str(Vendor.INTEL)
(True, <Vendor.APPLE: 'apple'>, 'intel')
>>> try:
...     Vendor.parse("nvidai", file="kernels/sm_90/HARDWARE.toml", key="vendor")
... except ConfigError as e:
...     print(e.where, "|", e.message, "|", e.suggestion)
...     print(e.expected)
kernels/sm_90/HARDWARE.toml: vendor | unknown vendor | nvidia
one of host, cpu, numpy, nvidia, cuda, amd, rocm, hip, apple, metal, intel, oneapi, sycl

Laws: every spelling parses to its vendor, and a vendor's value parses to itself.

>>> all(Vendor.parse(s) is v for v in Vendor for s in v.spellings)
True
>>> all(Vendor.parse(v.value) is v and Vendor.parse(v) is v for v in Vendor)
True
"""

from __future__ import annotations

import enum

from .errors import ConfigError, nearest


class Vendor(enum.Enum):
    """Who makes the hardware, hence which compiler builds its kernels.

    >>> Vendor.NVIDIA.spellings
    ('nvidia', 'cuda')
    """

    HOST = "host"
    NVIDIA = "nvidia"
    AMD = "amd"
    APPLE = "apple"
    INTEL = "intel"

    @property
    def spellings(self) -> tuple[str, ...]:
        """The accepted spellings, canonical name first."""
        return _SPELLINGS[self]

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, text: object, file: object = None, key: str | None = None) -> Vendor:
        """The vendor spelled ``text`` (case and surrounding blanks ignored).

        ``file`` and ``key`` say where the spelling came from, for the error message.

        >>> Vendor.parse("HIP")
        <Vendor.AMD: 'amd'>
        """
        if isinstance(text, Vendor):
            return text
        valid = [s for v in cls for s in v.spellings]
        if not isinstance(text, str):
            raise ConfigError("vendor must be a string", file=file, key=key,
                              expected="one of " + ", ".join(valid),
                              found=f"{type(text).__name__} {text!r}")
        found = _BY_SPELLING.get(text.strip().lower())
        if found is None:
            raise ConfigError("unknown vendor", file=file, key=key,
                              expected="one of " + ", ".join(valid), found=repr(text),
                              suggestion=nearest(text.strip().lower(), valid))
        return found


_SPELLINGS: dict[Vendor, tuple[str, ...]] = {
    Vendor.HOST: ("host", "cpu", "numpy"),
    Vendor.NVIDIA: ("nvidia", "cuda"),
    Vendor.AMD: ("amd", "rocm", "hip"),
    Vendor.APPLE: ("apple", "metal"),
    Vendor.INTEL: ("intel", "oneapi", "sycl"),
}
_BY_SPELLING = {s: v for v, ss in _SPELLINGS.items() for s in ss}
