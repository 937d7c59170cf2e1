"""The names a user types for hardware and weight formats, resolved or answered helpfully.

A GPU's product name (``h100``, ``RTX 4090``) is not a hardware class, but it names one: the
class whose ``HARDWARE.toml`` lists it (its device, or the products on its first line), so
``met`` answers with that class instead of the nearest spelling (``sm_100``).
"""

from __future__ import annotations

import re
from typing import Any


def _products(hw: Any) -> list[str]:
    """The product names a class stands for: its device's, and those its ``HARDWARE.toml``
    names on its first line (``NVIDIA Hopper GPUs (H100, H200)``)."""
    names = [hw.device.name]
    try:
        first = hw.file.read_text(encoding="utf-8").splitlines()[0] if hw.file else ""
    except (OSError, IndexError):
        first = ""
    m = re.search(r"\(([^)]*)\)", first)
    if m:
        names += [n.strip() for n in m.group(1).split(",")]
    for n in list(names):
        names.append(re.sub(r"^(NVIDIA|GeForce)\s+", "", n))
    return names


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


def hardware_class(name: str, kernels: str | None = None, key: str = "--hardware") -> str:
    """``name`` if it is a hardware class; a product name (``h100``, ``RTX 4090``) is answered
    with the class it belongs to, anything else with the list of classes.

    >>> hardware_class("sm_90")
    'sm_90'
    >>> hardware_class("h100")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: --hardware: 'h100' is a GPU, not a hardware class: its class is sm_90 (NVIDIA Hopper GPUs (H100, H200), compute capability 9.0) (expected one of cuda, host, sm_100, sm_120, sm_121, sm_80, sm_89, sm_90, found 'h100'); did you mean 'sm_90'?
    """  # noqa: E501
    from metrale.lkb.errors import ConfigError
    from metrale.realize.hardware import load_hardware

    hw = load_hardware(kernels)
    if name in hw.names:
        return name
    cls = _product_class(name, hw)
    if cls is not None:
        raise ConfigError(f"{name!r} is a GPU, not a hardware class: its class is "
                          f"{cls.name} ({about(cls)})", key=key,
                          expected="one of " + ", ".join(hw.names), found=repr(name),
                          suggestion=cls.name)
    hw.get(name)  # the usual error: the classes, and the nearest by spelling
    return name


def _product_class(name: str, classes: Any) -> Any:
    """The class whose products include ``name`` (``h100`` → sm_90), or ``None``."""
    q = _squash(name).removeprefix("nvidia").removeprefix("geforce")
    for cls in classes:
        for product in _products(cls):
            pattern = _squash(product).replace("xx", "[0-9][0-9]")
            if q and (re.fullmatch(pattern, q) or (len(q) >= 4 and q in _squash(product))):
                return cls
    return None


def about(hw: Any) -> str:
    """What a class is, from the first line of its ``HARDWARE.toml``."""
    try:
        first = hw.file.read_text(encoding="utf-8").splitlines()[0] if hw.file else ""
    except (OSError, IndexError):
        first = ""
    return first.split(":", 1)[1].strip() if ":" in first else hw.device.name


def quant_names() -> str:
    """The weight formats ``met quantize --to`` takes, spelled as its help and its error say.

    >>> quant_names()
    'fp8, mxfp4, nvfp4, or one of fp8_e4m3_block, fp8_e4m3_channel, fp8_e4m3_tensor, fp8_e5m2_block, fp8_e5m2_channel, fp8_e5m2_tensor (fp8 is fp8_e4m3_channel)'
    """  # noqa: E501
    from metrale.lkb.quant import FORMATS, QuantFormat

    fp8 = [f for f in sorted(FORMATS) if f.startswith("fp8_")]
    return (f"fp8, mxfp4, nvfp4, or one of {', '.join(fp8)} "
            f"(fp8 is {QuantFormat.parse('fp8').name})")
