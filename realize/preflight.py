"""Arch preflight: will binaries built for a class's arch run on the device that is present?

The rules are NVIDIA's compatibility rules. A cubin for ``sm_XY`` runs on compute capability
X.Z with Z >= Y (same major). PTX for ``sm_XY`` also runs on any newer major, compiled by
the driver's JIT. Arch-specific targets (``sm_90a``, ``sm_100a``: wgmma, tcgen05) run only
on exactly their capability, in either form; family targets (``sm_100f``) run on their major
with a minor at least theirs.

>>> preflight_arch("sm_80", (9, 0), "ptx").ok, preflight_arch("sm_80", (9, 0), "cubin").ok
(True, False)
>>> preflight_arch("sm_90a", (9, 0)).ok, preflight_arch("sm_90a", (10, 0)).ok
(True, False)
>>> print(preflight_arch("sm_90a", (12, 0), device_name="NVIDIA GeForce RTX 5090").reason)
built sm_90a (ptx); device NVIDIA GeForce RTX 5090 is cc 12.0: sm_90a is arch-specific and runs only on cc 9.0

Law: compatibility is monotone within a major for cubins, and over all newer capabilities
for plain PTX.

>>> all(preflight_arch("sm_80", (8, m), "cubin").ok for m in range(10))
True
"""  # noqa: E501

from __future__ import annotations

from collections.abc import Sequence

import attrs

from metrale.lkb.errors import ConfigError
from metrale.lkb.vendor import Vendor
from metrale.realize.hardware import HardwareClass, HardwareRegistry, parse_arch

BINARY_FORMATS = ("ptx", "cubin")


@attrs.frozen
class Verdict:
    """Whether the binaries run, and the reason: which arch was built, which device is here.

    >>> bool(Verdict(False, "no"))
    False
    """

    ok: bool
    reason: str

    def __bool__(self) -> bool:
        return self.ok


def _capability(cc: Sequence[int]) -> tuple[int, int]:
    if (not isinstance(cc, Sequence) or isinstance(cc, str) or len(cc) != 2
            or not all(type(x) is int and x >= 0 for x in cc)):
        raise ConfigError("compute capability must be (major, minor)", key="compute_capability",
                          expected="two non-negative integers such as (9, 0)", found=repr(cc))
    return int(cc[0]), int(cc[1])


def preflight_arch(arch: str, compute_capability: Sequence[int], binary_format: str = "ptx",
                   device_name: str | None = None) -> Verdict:
    """Whether ``binary_format`` code built for ``arch`` runs on a device of this capability."""
    have = _capability(compute_capability)
    if binary_format not in BINARY_FORMATS:
        raise ConfigError("unknown binary format", key="binary_format",
                          expected="ptx or cubin", found=repr(binary_format))
    major, minor, suffix = parse_arch(arch)
    built = (major, minor)
    head = (f"built {arch} ({binary_format}); device {device_name + ' ' if device_name else ''}"
            f"is cc {have[0]}.{have[1]}: ")
    if suffix == "a":
        ok = have == built
        why = (f"{arch} is arch-specific and runs only on cc {major}.{minor}"
               if not ok else "arch-specific code on its exact capability")
    elif suffix == "f":
        ok = have[0] == major and have[1] >= minor
        why = (f"{arch} is family-specific and runs only on cc {major}.x >= {major}.{minor}"
               if not ok else f"family-specific code within family {major}.x")
    elif binary_format == "cubin":
        ok = have[0] == major and have[1] >= minor
        why = (f"a cubin for {arch} runs only on cc {major}.x >= {major}.{minor}"
               if not ok else f"cubin within major {major}")
    else:
        ok = have >= built
        if not ok:
            why = f"PTX for {arch} needs cc >= {major}.{minor}"
        elif have[0] == major:
            why = f"PTX within major {major}"
        else:
            why = f"PTX for {arch} is JIT-compiled by the driver for cc {have[0]}.{have[1]}"
    return Verdict(ok, head + why)


def preflight(hw_class: HardwareClass, compute_capability: Sequence[int], *,
              binary_format: str = "ptx", device_name: str | None = None) -> Verdict:
    """Whether binaries built for ``hw_class``'s arch run on a device of this capability.

    >>> from metrale.realize.hardware import load_hardware
    >>> hw = load_hardware()
    >>> preflight(hw.get("sm_89"), (8, 9)).ok, preflight(hw.get("sm_89"), (8, 6)).ok
    (True, False)
    >>> print(preflight(hw.get("cuda"), (9, 0)).reason)
    class cuda has no arch of its own (its sources compile for the class that inherits it); preflight a descendant class
    """  # noqa: E501
    have = _capability(compute_capability)
    if hw_class.vendor is Vendor.HOST:
        return Verdict(True, f"class {hw_class.name} runs on the CPU; device code is not used "
                             f"(cc {have[0]}.{have[1]} ignored)")
    if hw_class.vendor is not Vendor.NVIDIA:
        return Verdict(False, f"class {hw_class.name} is {hw_class.vendor}; preflight knows "
                              "only NVIDIA compute capabilities")
    if hw_class.arch is None:
        return Verdict(False, f"class {hw_class.name} has no arch of its own (its sources "
                              "compile for the class that inherits it); preflight a "
                              "descendant class")
    v = preflight_arch(hw_class.arch, have, binary_format, device_name)
    return Verdict(v.ok, f"class {hw_class.name}: {v.reason}")


def best_class(registry: HardwareRegistry, compute_capability: Sequence[int], *,
               binary_format: str = "ptx") -> HardwareClass | None:
    """The most specific NVIDIA class whose binaries run on this capability, or ``None``.

    Newest arch first; among equals, the one with the longer chain.

    >>> from metrale.realize.hardware import load_hardware
    >>> hw = load_hardware()
    >>> [best_class(hw, cc).name for cc in [(8, 6), (9, 0), (10, 3), (12, 1)]]
    ['sm_80', 'sm_90', 'sm_89', 'sm_121']
    >>> best_class(hw, (7, 5)) is None
    True
    """
    have = _capability(compute_capability)
    fits = [c for c in registry if c.vendor is Vendor.NVIDIA and c.arch is not None
            and preflight(c, have, binary_format=binary_format).ok]
    return max(fits, key=lambda c: (parse_arch(c.arch)[:2], len(registry.chain(c))),
               default=None)
