"""Reference semantics of the ``sample`` family: temperature, top-k, top-p and min-p sampling
with a counter-based random draw; registered into ``semantics.SEMANTICS``.

One row, its logits ``l`` (f32) and its parameters ``(T, k, p, m)`` and key
``(seed_lo, seed_hi, request, position)``:

1. ``T`` not ``> 0`` (0, negative, NaN): greedy, the first index of the largest logit (NaN
   largest, as ``argmax``). Otherwise ``z = l / T`` (f32, correctly rounded); a non-finite
   ``max(z)`` (an inf or NaN logit) falls back to the argmax of ``z``.
2. ``w = exp(z - max(z))`` in f32 (so the largest weight is exactly 1).
3. top-k (``1 <= k < vocab``; ``k`` truncated): keep ``z >= `` the k-th largest ``z``
   (logits tied with it are kept, as transformers' ``TopKLogitsWarper`` keeps them).
4. top-p (``0 < p < 1``): keep ``i`` when the mass of the kept weights strictly larger than
   ``w[i]`` is ``< p * S`` (``S`` the kept mass): the smallest set of the largest weights
   whose mass reaches ``p``, ties kept together.
5. min-p (``m > 0``, clipped to 1): keep ``w >= m`` (``w / S >= m * max(w) / S``).
6. ``u = (x0 >> 8) * 2**-24`` where ``x0`` is the first word of Philox-4x32-10 at key
   ``(seed_lo, seed_hi)`` and counter ``(position, request, 0, 0)``; the id is the first kept
   ``i``, in index order, whose running mass exceeds ``u * S'`` (``S'`` the kept mass).

Masses are summed in f64 (sequentially here; a device sums the same terms in its own fixed
order, so the two agree except where rounding at 1e-16 moves a boundary). A row's id depends
on its own logits, parameters and key alone: the family is row-invariant, and a request keyed
by (seed, request, position) draws the same token alone or in a batch.

>>> [hex(v) for v in philox4x32(np.zeros((1, 4), np.uint32), np.zeros((1, 2), np.uint32))[0]]
['0x6627e8d5', '0xe169c58d', '0xbc57ac4c', '0x9b00dbd8']
>>> logits = np.array([[0.0, 3.0, 1.0, 2.0]], np.float32)
>>> greedy = np.array([[0.0, 0.0, 1.0, 0.0]], np.float32)
>>> keys = np.array([[7, 0, 0, 5]], np.int32)
>>> int(sample(logits, greedy, keys)[0][0])
1
>>> top1 = np.array([[1.0, 1.0, 1.0, 0.0]], np.float32)
>>> int(sample(logits, top1, keys)[0][0])
1
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .semantics import F32, Reduction, _fail, _rand, _shape, semantics

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
PHILOX_ROUNDS = 10
_MASK = np.uint64(0xFFFFFFFF)


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = PHILOX_ROUNDS) -> np.ndarray:
    """Philox-4x32 (Salmon et al., SC'11; Random123's ``philox4x32_R``) of each row's counter
    ``u32[.., 4]`` and key ``u32[.., 2]``: ``u32[.., 4]``. The known answer at zero counter and
    key is in the module docstring."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[..., 0].astype(np.uint64), key[..., 1].astype(np.uint64)
    m0, m1 = np.uint64(PHILOX_M[0]), np.uint64(PHILOX_M[1])
    for r in range(rounds):
        if r:
            k0 = (k0 + np.uint64(PHILOX_W[0])) & _MASK
            k1 = (k1 + np.uint64(PHILOX_W[1])) & _MASK
        p0, p1 = m0 * c[0], m1 * c[2]
        hi0, lo0 = p0 >> np.uint64(32), p0 & _MASK
        hi1, lo1 = p1 >> np.uint64(32), p1 & _MASK
        c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
    return np.stack(c, axis=-1).astype(np.uint32)


def uniform(keys: np.ndarray) -> np.ndarray:
    """Each row's draw in [0, 1) (f32, a multiple of 2**-24) from its key
    ``(seed_lo, seed_hi, request, position)`` (i32 bit patterns)."""
    k = np.ascontiguousarray(keys).view(np.uint32).reshape(-1, 4)
    zeros = np.zeros(len(k), np.uint32)
    x = philox4x32(np.stack([k[:, 3], k[:, 2], zeros, zeros], axis=-1), k[:, :2])
    return ((x[:, 0] >> np.uint32(8)).astype(np.float32) * np.float32(2.0 ** -24))


def _sample_row(l: np.ndarray, t: float, k: float, p: float, m: float, u: np.float32) -> int:
    if not t > 0:
        return int(np.argmax(l))
    z = l / np.float32(t)
    top = z.max()
    if not np.isfinite(top):
        return int(np.argmax(z))
    w = np.exp(z - top)
    n = z.size
    keep = np.ones(n, bool)
    if 1 <= k < n:
        kk = int(k)
        keep &= z >= np.partition(z, n - kk)[n - kk]
    if 0 < p < 1:
        kept = w[keep].astype(np.float64)
        total = float(kept.sum()) if kept.size else 0.0
        desc = np.sort(kept)[::-1]
        before = np.concatenate([[0.0], np.cumsum(desc)])
        greater = before[np.searchsorted(-desc, -w.astype(np.float64), side="left")]
        keep &= greater < p * total
    if m > 0:
        keep &= w >= np.float32(min(m, 1.0))
    mass = np.cumsum(np.where(keep, w, 0).astype(np.float64))
    hit = np.flatnonzero(mass > float(u) * mass[-1])
    return int(hit[0]) if hit.size else int(np.argmax(l))


def _sample_orders(p: Mapping[str, Any]) -> tuple[Reduction, ...]:
    return (Reduction("vocab", "f64", 0, "sequential", within="sequential",
                      of="kept weights exp(z - max)"),)


def _ex_sample(rng: np.random.Generator, rows: int, act: str) -> tuple[tuple, dict]:
    logits = _rand(rng, (rows, 40), F32, 2.0)
    params = np.zeros((rows, 4), np.float32)
    params[:, 0] = rng.uniform(0.5, 1.5, rows)
    params[:, 1] = rng.integers(0, 30, rows)
    params[:, 2] = rng.uniform(0.5, 1.0, rows)
    params[:, 3] = rng.uniform(0.0, 0.2, rows)
    if rows > 1:
        params[0, 0] = 0.0  # one greedy row
    keys = rng.integers(0, 2 ** 31, (rows, 4)).astype(np.int32)
    return (logits, params, keys), {}


@semantics("sample", rows=(0, 1, 2), orders=_sample_orders, example=_ex_sample)
def sample(logits: np.ndarray, params: np.ndarray, keys: np.ndarray) -> tuple[np.ndarray]:
    """Each row's id drawn from its logits by its parameters ``(T, k, p, m)`` and key
    ``(seed_lo, seed_hi, request, position)``, as the module docstring defines it."""
    sizes: dict[str, int] = {}
    _shape("sample", "logits", logits, ("rows", "vocab"), sizes, (F32,))
    _shape("sample", "params", params, ("rows", "four"), sizes, (F32,))
    _shape("sample", "keys", keys, ("rows", "four"), sizes, (np.dtype(np.int32),))
    if sizes["four"] != 4:
        raise _fail("sample", "params", "bad shape", "(rows, 4)", params.shape)
    drawn = params[:, 0] > 0
    u = uniform(keys) if drawn.any() else np.zeros(len(keys), np.float32)  # greedy: no draw
    out = np.empty(logits.shape[0], np.int32)
    for r in range(logits.shape[0]):
        t, k, p, m = (float(v) for v in params[r])
        out[r] = _sample_row(logits[r], t, k, p, m, u[r])
    return (out,)
