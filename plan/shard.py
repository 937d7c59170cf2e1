"""S_n: tensor-parallel sharding of a model into ``n`` ranks joined by collectives.

``Sharding(n)`` is a value. On a config it gives one rank's shape: attention heads and KV heads
split by rank, the MLP's intermediate width (each expert's, in a MoE) split by rank, and the
lm_head's rows split by vocabulary (``ModelConfig.ranks``). On a circuit it gives the rank's
circuit, the same step in those sizes with the ranks joined where a split meets: after the
attention's output projection and after the MLP (or MoE) an ``all_reduce`` adds the ranks'
partial sums, and the logits of each rank's part of the vocabulary are gathered into the
whole. The embedding is split by vocabulary too: a rank gives the rows of the ids its part
holds and ``-0.0`` for the others (the identity of addition), and an ``all_reduce`` adds them,
which gives each id's row bit for bit. Every rank runs that one circuit (SPMD); they differ
only in their weights, which :meth:`Sharding.weights` cuts from the checkpoint's (and the
first id of the rank's part of the vocabulary). Norms and routers are replicated; a bias
added after a split's partial sums (o_proj's) is added once, after the ``all_reduce``; the
experts' down-projection bias, added inside the MoE, is rank 0's alone.

The plan of a rank is then the composite as ever, ``(L_H ≫ F_H)(S_n(circuit))``: lowering
sends ``all_reduce`` to ``all_gather ≫ rank_sum`` (the transport moves bytes; the sum, in rank
order in f32, is a kernel with a declared order), so the host and every GPU class give one
rank's step the same bytes. Splitting a reduction changes its order, so a sharded step agrees
with the unsharded one within the bound of a reordered f32 sum, not byte for byte; the logits'
gather moves bytes only.

Laws (checked here and with Hypothesis in ``tests/mock/test_shard.py``):

>>> from metrale.plan.circuit import circuit_for
>>> c = circuit_for("tiny-llama", rows=2)
>>> Sharding(1)(c) == c
True
>>> s = Sharding(2)(c)
>>> s.op_counts()["all_reduce"], s.sizes(16)["heads"], s.sizes(16)["vocab_part"]
(5, 2, 128)
>>> import numpy as np
>>> from metrale.runtime.engine import random_weights
>>> w = random_weights("tiny-llama")
>>> parts = [Sharding(2).weights(w, "tiny-llama", r) for r in range(2)]
>>> name = "model.layers.0.self_attn.o_proj.weight"
>>> bool((np.concatenate([p[name] for p in parts], axis=-1) == w[name]).all())
True
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np

from metrale.lkb.errors import ConfigError

from .circuit import VOCAB_FIRST, Circuit, circuit_for
from .config import ModelConfig

_ROWS, _COLS = -2, -1
"""A weight ``[..., n, k]`` splits by its output rows (``n``) or by its input columns (``k``)."""

SPLITS: tuple[tuple[str, int], ...] = (
    ("model.embed_tokens.weight", _ROWS), ("lm_head.weight", _ROWS),
    ("self_attn.q_proj.weight", _ROWS), ("self_attn.k_proj.weight", _ROWS),
    ("self_attn.v_proj.weight", _ROWS), ("self_attn.q_proj.bias", _COLS),
    ("self_attn.k_proj.bias", _COLS), ("self_attn.v_proj.bias", _COLS),
    ("self_attn.sinks", _COLS), ("self_attn.o_proj.weight", _COLS),
    ("mlp.gate_proj.weight", _ROWS), ("mlp.up_proj.weight", _ROWS),
    ("mlp.down_proj.weight", _COLS),
    ("mlp.experts.gate_proj.weight", _ROWS), ("mlp.experts.up_proj.weight", _ROWS),
    ("mlp.experts.down_proj.weight", _COLS),
    ("mlp.experts.gate_up_proj", _ROWS), ("mlp.experts.gate_up_proj_bias", _COLS),
    ("mlp.experts.down_proj", _COLS),
)
"""Checkpoint weights (by name suffix) that each rank holds a slice of, and the axis cut.
gpt-oss's ``gate_up_proj`` interleaves gate and up rows in pairs; a rank's slice of an even
number of rows keeps its pairs whole."""

RANK_ZERO: tuple[str, ...] = ("mlp.experts.down_proj_bias",)
"""Biases added inside a split's partial sums: rank 0 holds them, the other ranks zeros, so
the all-reduce adds each once."""


@attrs.frozen
class Sharding:
    """S_n for ``ranks`` = n: configs, circuits and weights of one rank of n.

    >>> Sharding(2).config("tiny-llama").num_attention_heads
    2
    >>> Sharding(3).config("tiny-llama")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: tiny-llama: num_attention_heads: does not split into 3 ranks (expected a multiple of 3, found 4)
    """

    ranks: int = attrs.field()

    @ranks.validator
    def _check(self, _: Any, value: int) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError("tensor-parallel ranks", key="--tp", expected="an int >= 1",
                              found=repr(value))

    def config(self, model: str | ModelConfig) -> ModelConfig:
        """One rank's config of ``model`` (the model itself for one rank)."""
        c = ModelConfig.load(model)
        n = self.ranks
        if n == 1:
            return c
        if c.ranks != 1:
            raise ConfigError("already one rank of a sharding", file=c.name, key="ranks",
                              expected="an unsharded config", found=c.ranks)
        fields = {"num_attention_heads": c.num_attention_heads,
                  "num_key_value_heads": c.num_key_value_heads,
                  "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
        if c.is_moe:
            fields["moe_intermediate_size"] = c.moe_intermediate_size
        for key, value in fields.items():
            if value % n:
                raise ConfigError(f"does not split into {n} ranks", file=c.name, key=key,
                                  expected=f"a multiple of {n}", found=value)
        cut = {k: v // n for k, v in fields.items() if k != "vocab_size"}
        return attrs.evolve(c, **cut, ranks=n)

    def __call__(self, circuit: Circuit) -> Circuit:
        """S_n on circuits: the circuit of one rank of the same step."""
        if self.ranks == 1:
            return circuit
        return circuit_for(self.config(circuit.config), circuit.quant, circuit.mode,
                           circuit.rows, act=circuit.act, logits=circuit.logits,
                           sample=circuit.sample)

    def weights(self, weights: Mapping[str, Any], model: str | ModelConfig, rank: int
                ) -> dict[str, Any]:
        """Rank ``rank``'s weights, cut from the whole model's (arrays in the circuit's layout,
        or :class:`~metrale.lkb.quant.QuantTensor`), and ``tp.vocab_first``, the first id of
        its rows of the vocabulary (of the embedding, and of the head)."""
        n = self.ranks
        if not isinstance(rank, int) or not 0 <= rank < n:
            raise ConfigError("no such rank", key="rank", expected=f"0 <= rank < {n}",
                              found=repr(rank))
        if n == 1:
            return dict(weights)
        c = ModelConfig.load(model)
        out: dict[str, Any] = {}
        for name, w in weights.items():
            axis = next((ax for suffix, ax in SPLITS if name.endswith(suffix)), None)
            if axis is not None:
                out[name] = _slice(w, axis, rank, n, name)
            elif name.endswith(RANK_ZERO) and rank:
                out[name] = np.zeros_like(w)
            else:
                out[name] = w
        out[VOCAB_FIRST] = np.array([rank * (c.vocab_size // n)], np.int32)
        return out


def _slice(w: Any, axis: int, rank: int, n: int, name: str) -> Any:
    """Rank ``rank``'s ``1/n`` of ``w`` along logical ``axis``; a quantized weight's packed
    arrays are cut where their extent follows that axis (its blocks must not straddle ranks)."""
    from metrale.lkb.quant import QuantTensor

    if not isinstance(w, QuantTensor):
        return _cut(np.asarray(w), axis % np.ndim(w), rank, n, name)
    shape = list(w.shape)
    ax = axis % len(shape)
    if shape[ax] % n:
        raise ConfigError(f"does not split into {n} ranks", key=name,
                          expected=f"a multiple of {n} along axis {ax}", found=shape[ax])
    part = [*shape[:ax], shape[ax] // n, *shape[ax + 1:]]
    whole, cut = w.fmt.array_specs(tuple(shape)), w.fmt.array_specs(tuple(part))
    arrays = {}
    for field in ("data", "scale", "global_scale"):
        arr = getattr(w, field)
        if arr is None:
            arrays[field] = None
            continue
        moved = [i for i, (a, b) in enumerate(zip(whole[field][0], cut[field][0])) if a != b]
        arrays[field] = _cut(arr, moved[0], rank, n, f"{name}.{field}") if moved else arr
    return QuantTensor(w.fmt, tuple(part), arrays["data"], arrays["scale"],
                       arrays["global_scale"])


def _cut(a: np.ndarray, axis: int, rank: int, n: int, name: str) -> np.ndarray:
    size = a.shape[axis]
    if size % n:
        raise ConfigError(f"does not split into {n} ranks", key=name,
                          expected=f"a multiple of {n} along axis {axis}", found=size)
    step = size // n
    index = [slice(None)] * a.ndim
    index[axis] = slice(rank * step, (rank + 1) * step)
    return np.ascontiguousarray(a[tuple(index)])
