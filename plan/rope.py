"""Rotary position embedding tables: inverse frequencies and the cos/sin of every position.

The arithmetic mirrors transformers' ``modeling_rope_utils`` step by step in float32 (its
default, ``linear`` and ``llama3`` types), so the host reference and the oracle agree closely:
the one inexact step is ``base ** x``, which transformers computes with a float32 ``pow``
accurate to 1 ulp and we round from float64 (correctly rounded); they differ in rare elements
by one ulp. Rotation is neox-style: frequency ``j`` turns the pair ``(j, j + head_dim/2)``.

Laws: ``inv_freq[0] == 1`` for every unscaled table; ``cos**2 + sin**2 == 1`` up to rounding;
row 0 of the table is ``cos = 1, sin = 0``; ``linear`` scaling divides every frequency by
``factor``; ``llama3`` keeps wavelengths below ``original / high_freq_factor`` and divides
those above ``original / low_freq_factor`` by ``factor``; ``yarn`` blends ``inv_freq`` and
``inv_freq / factor`` along a linear ramp between its correction dims and scales the tables by
:func:`rope_attention_factor`.

>>> from metrale.plan.config import ModelConfig
>>> c = ModelConfig.load("tiny-qwen3")
>>> f = rope_inv_freq(c)
>>> f.dtype, f.shape, float(f[0])
(dtype('float32'), (8,), 1.0)
>>> cos, sin = rope_table(c, 4)
>>> cos.shape, bool((cos[0] == 1).all() and (sin[0] == 0).all())
((4, 8), True)
>>> bool(np.allclose(cos**2 + sin**2, 1, atol=1e-6))
True
"""

from __future__ import annotations

import math

import numpy as np

from metrale.lkb.errors import ConfigError

from .config import ModelConfig

_F32 = np.float32


def _default_inv_freq(theta: float, dim: int) -> np.ndarray:
    # transformers: 1.0 / (base ** (arange(0, dim, 2).float() / dim)), all in float32.
    exponent = np.arange(0, dim, 2, dtype=_F32) / _F32(dim)
    power = np.power(np.float64(_F32(theta)), exponent.astype(np.float64)).astype(_F32)
    return _F32(1) / power


def _llama3(inv_freq: np.ndarray, factor: float, low: float, high: float, original: int
            ) -> np.ndarray:
    # Each line is one line of transformers' _compute_llama3_parameters; torch evaluates
    # ``scalar / tensor`` as ``tensor.reciprocal() * scalar``, and so do we.
    low_wavelen = _F32(original / low)
    high_wavelen = _F32(original / high)
    wavelen = (_F32(1) / inv_freq) * _F32(2 * math.pi)
    scaled = np.where(wavelen > low_wavelen, inv_freq / _F32(factor), inv_freq)
    smooth = ((_F32(1) / wavelen) * _F32(original) - _F32(low)) / _F32(high - low)
    smoothed = (_F32(1) - smooth) * scaled / _F32(factor) + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(_F32)


def _yarn(theta: float, dim: int, scaling) -> np.ndarray:
    # transformers' _compute_yarn_parameters, line by line: the correction range in float64
    # Python, the ramp and the blend in float32.
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings
                               / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    exponent = np.arange(0, dim, 2).astype(_F32) / _F32(dim)
    pos_freqs = np.power(np.float64(_F32(theta)), exponent.astype(np.float64)).astype(_F32)
    extrapolation = _F32(1) / pos_freqs
    interpolation = _F32(1) / (_F32(scaling.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=_F32) - _F32(low)) / _F32(high - low), 0, 1)
    keep = (_F32(1) - ramp).astype(_F32)
    return (interpolation * (_F32(1) - keep) + extrapolation * keep).astype(_F32)


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor the cos/sin tables are scaled by: yarn's ``attention_factor`` (by default
    ``0.1 ln(factor) + 1``), 1 for the other types.

    >>> from metrale.plan.config import ModelConfig
    >>> round(rope_attention_factor(ModelConfig.load("gpt-oss-20b")), 6)
    1.346574
    >>> rope_attention_factor(ModelConfig.load("tiny-llama"))
    1.0
    """
    scaling = config.rope_scaling
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return float(scaling.attention_factor)
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """The ``head_dim // 2`` inverse frequencies (float32) of ``config``'s RoPE.

    >>> from metrale.plan.config import ModelConfig
    >>> f = rope_inv_freq(ModelConfig.load("llama-3.1-8b"))
    >>> f.shape, bool(f[-1] < f[0])
    ((64,), True)
    """
    inv_freq = _default_inv_freq(config.rope_theta, config.head_dim)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return (inv_freq / _F32(scaling.factor)).astype(_F32)
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling.factor, scaling.low_freq_factor,
                       scaling.high_freq_factor, scaling.original_max_position_embeddings)
    if scaling.rope_type == "yarn":
        return _yarn(config.rope_theta, config.head_dim, scaling)
    raise ConfigError("unknown rope scaling type", file=config.name, key="rope_scaling.rope_type",
                      expected="one of default, linear, llama3", found=repr(scaling.rope_type))


def rope_table(config: ModelConfig, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each float32 ``[max_positions, head_dim // 2]``, for positions ``0..n-1``.

    The angle is ``float32(position) * inv_freq`` in float32, as transformers forms it; its
    cosine and sine are taken in float64 and rounded, so each entry is correctly rounded for
    that angle (transformers' float32 ``cos`` is within an ulp of it).

    >>> from metrale.plan.config import ModelConfig
    >>> cos, sin = rope_table(ModelConfig.load("tiny-llama"), 3)
    >>> bool(np.isclose(sin[1, 0], np.sin(1.0)))
    True
    """
    if not isinstance(max_positions, int) or isinstance(max_positions, bool) or max_positions < 1:
        raise ConfigError("rope table length must be a positive integer", file=config.name,
                          key="max_positions", expected="an integer > 0", found=repr(max_positions))
    positions = np.arange(max_positions, dtype=_F32)
    angles = (positions[:, None] * rope_inv_freq(config)[None, :]).astype(np.float64)
    cos, sin = np.cos(angles).astype(_F32), np.sin(angles).astype(_F32)
    factor = rope_attention_factor(config)
    if factor != 1.0:  # yarn: transformers scales the f32 tables, cos() * attention_scaling
        cos, sin = (cos * _F32(factor)).astype(_F32), (sin * _F32(factor)).astype(_F32)
    return cos, sin
