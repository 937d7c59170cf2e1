"""Model circuits: one forward step of a model as a Circ string diagram over tensor types.

``circuit_for(config, quant, mode, rows)`` wires the ops ``embed``, ``rmsnorm``, ``linear``,
``view``, ``bias``, ``qk_norm``, ``rope``, ``attention``, ``add``, ``swiglu``, ``moe``,
``last_row`` and ``lm_head``. What a model adds is data on these boxes, read from its config:
projections with biases (``attention_bias``) get a ``bias`` box, attention with learned sinks
an extra ``sinks`` input, a biased MoE with a clamped SwiGLU (gpt-oss) its router and expert
biases and the ``router``/``limit``/``alpha`` params.

Conventions, fixed once:

- Dims are symbolic (``rows``, ``hidden``, ``q_dim``, ``heads`` …); :meth:`Circuit.sizes`
  binds them. The q/k/v projections give ``[rows, q_dim]``/``[rows, kv_dim]``; ``qk_norm``,
  ``rope`` and ``attention`` work on heads, ``[rows, heads, head_dim]``, and an explicit
  ``view`` box (a zero-cost reinterpretation; params ``src``/``dst`` shapes) converts between.
- Box params hold everything lowering needs that is not already in the types, and never the
  layer index: the same op of two layers is the *same* box (a functor then maps it once).
- ``mode`` changes sizes, not wiring: decode is ``rows`` sequences with one token each
  (``slots = rows``), prefill is ``rows`` tokens of one sequence (``slots = 1``), unless the
  circuit is given ``cache_slots``: the cache then holds that many (an engine's prefill reads
  the slot from its ``slots`` input, so one plan and one graph serve every slot). Attention
  first writes each row's k, v into the cache at ``(slot, position)``, then attends causally
  up to the row's position, so both modes share one diagram.
- Weights are inputs named as in the Hugging Face checkpoint; MoE experts come stacked per
  layer (the loader stacks ``mlp.experts.{e}.gate_proj.weight`` into
  ``mlp.experts.gate_proj.weight`` of shape ``[experts, moe_inter, hidden]``). A tied
  ``lm_head`` reads the embedding input; embedding, norm, router and lm_head weights are bf16,
  linear and expert weights are typed by ``quant`` (quantized checkpoints keep those bf16).

Laws: building is deterministic (``circuit_for(c) == circuit_for(c)``); the diagram is
well-typed (``Diagram.flat`` re-checks it); layers share boxes.

>>> c = circuit_for("tiny-qwen3", rows=2)
>>> print(c)
tiny-qwen3 decode rows=2 quant=bf16 act=bf16: 2 layers, 41 boxes, 34 inputs, 5 outputs
>>> c == circuit_for("tiny-qwen3", rows=2)
True
>>> str(c.input_type("model.layers.1.self_attn.q_norm.weight"))
'bf16[head_dim]'
>>> [b.name for b in c.diagram.boxes[:8]]
['embed', 'rmsnorm', 'linear', 'linear', 'linear', 'view', 'view', 'view']
>>> c.sizes(max_ctx=64)["slots"], circuit_for("tiny-qwen3", mode="prefill", rows=5).sizes(64)["slots"]
(2, 1)
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from collections.abc import Mapping
from typing import Any

import attrs

from metrale.lkb.diagram import Box, Builder, Diagram, Wire
from metrale.lkb.dtype import BF16, F32, I32, DType
from metrale.lkb.errors import ConfigError, PlanError, nearest
from metrale.lkb.family import WEIGHT_FORMATS
from metrale.lkb.ty import Dim, TensorType, Ty

from .config import ModelConfig

MODES = ("decode", "prefill")
"""Forward-step modes: ``rows`` sequences of one token, or ``rows`` tokens of one sequence."""

ACTS = {"bf16": BF16, "f32": F32}
"""Activation dtypes a circuit may carry."""

OPS = ("embed", "rmsnorm", "linear", "bias", "view", "qk_norm", "rope", "attention", "add",
       "swiglu", "moe", "last_row", "lm_head", "sample", "all_reduce", "all_gather")
"""The Circ generators, by name."""

LOGITS = ("all", "last")
"""Which rows a step gives logits for: every row, or (prefill) the last one only."""

ROPE_STYLE = "neox"
"""Llama and Qwen3 rotate halves (pair ``(j, j + head_dim/2)``)."""


@attrs.frozen
class Circuit:
    """One forward step of a model: a diagram plus the names of its inputs and outputs.

    ``input_names[k]`` names wire ``k`` of ``diagram.dom`` (``tokens``, ``positions``,
    ``slots``, ``rope.cos``, ``rope.sin``, ``kv.{i}.k``, ``kv.{i}.v``, then the checkpoint
    weights); ``output_names[k]`` names wire ``k`` of ``diagram.cod`` (``logits``, then the
    updated caches ``kv.{i}.k``, ``kv.{i}.v``).

    >>> c = circuit_for("tiny-llama")
    >>> c.input_names[:5], c.output_names[:3]
    (('tokens', 'positions', 'slots', 'rope.cos', 'rope.sin'), ('logits', 'kv.0.k', 'kv.0.v'))
    >>> str(c.output_type("logits"))
    'f32[rows,vocab]'
    >>> c
    circuit_for('tiny-llama', 'bf16', 'decode', 1, act='bf16')
    """

    diagram: Diagram
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    config: ModelConfig
    quant: str
    mode: str
    rows: int
    act: str = "bf16"
    logits: str = "all"
    sample: bool = False
    transposed: frozenset[str] = frozenset()
    """Weights whose plain (bf16/f32) checkpoint tensor is stored with its last two axes
    swapped, ``[..., k, n]`` (transformers' gpt-oss experts compute ``x @ W``); quantized
    layouts of them are stored ``[..., n, k]`` as the circuit types them."""
    cache_slots: int | None = None
    """Slots of the KV cache the step reads and writes (``None``: ``rows`` for decode, 1 for
    prefill)."""
    _inputs: Mapping[str, int] = attrs.field(init=False, eq=False, hash=False, repr=False)
    _outputs: Mapping[str, int] = attrs.field(init=False, eq=False, hash=False, repr=False)

    def __attrs_post_init__(self) -> None:
        for names, dom, what in ((self.input_names, self.diagram.dom, "input"),
                                 (self.output_names, self.diagram.cod, "output")):
            if len(names) != len(dom) or len(set(names)) != len(names):
                raise PlanError(f"one distinct name per diagram {what}", key=f"{what}_names",
                                expected=len(dom), found=len(set(names)))
        object.__setattr__(self, "_inputs", {n: k for k, n in enumerate(self.input_names)})
        object.__setattr__(self, "_outputs", {n: k for k, n in enumerate(self.output_names)})

    @property
    def layers(self) -> int:
        """Decoder layers in the circuit."""
        return self.config.num_hidden_layers

    @property
    def weight_names(self) -> tuple[str, ...]:
        """The inputs bound from the checkpoint, in input order."""
        return self.input_names[self._inputs["model.embed_tokens.weight"]:]

    def input_type(self, name: str) -> TensorType:
        """The type of input ``name``; an unknown name is a :class:`PlanError`."""
        return self.diagram.dom.types[self._lookup(self._inputs, name, "input")]

    def output_type(self, name: str) -> TensorType:
        """The type of output ``name``; an unknown name is a :class:`PlanError`."""
        return self.diagram.cod.types[self._lookup(self._outputs, name, "output")]

    def _lookup(self, index: Mapping[str, int], name: str, what: str) -> int:
        try:
            return index[name]
        except KeyError:
            raise PlanError(f"no such circuit {what}", file=self.config.name, key=name,
                            expected=f"one of the {len(index)} {what} names",
                            found=repr(name), suggestion=nearest(name, index)) from None

    def sizes(self, max_ctx: int) -> dict[str, int]:
        """Concrete sizes of every dim: the config's, plus ``rows``, ``slots``, ``max_ctx``,
        ``max_pos`` (the RoPE table covers the cache: ``max_ctx`` positions) and ``half``.

        >>> s = circuit_for("llama-3.1-8b", rows=4).sizes(1024)
        >>> s["rows"], s["slots"], s["max_pos"], s["half"], s["q_dim"]
        (4, 4, 1024, 64, 4096)
        """
        if not isinstance(max_ctx, int) or isinstance(max_ctx, bool) or max_ctx <= 0:
            raise PlanError("context length must be a positive integer", file=self.config.name,
                            key="max_ctx", expected="an integer > 0", found=repr(max_ctx))
        out = self.config.sizes()
        slots = self.cache_slots or (self.rows if self.mode == "decode" else 1)
        out.update(rows=self.rows, slots=slots,
                   max_ctx=max_ctx, max_pos=max_ctx, half=self.config.head_dim // 2, last=1,
                   four=4)
        return out

    def __str__(self) -> str:
        last = (" logits=last" if self.logits == "last" else "") + (" sample" if self.sample
                                                                     else "")
        return (f"{self.config.name} {self.mode} rows={self.rows}{last} quant={self.quant}"
                f" act={self.act}: {self.layers} layers, {len(self.diagram)} boxes,"
                f" {len(self.input_names)} inputs, {len(self.output_names)} outputs")

    def __repr__(self) -> str:
        last = (", logits='last'" if self.logits == "last" else "") + (", sample=True" if
                                                                        self.sample else "")
        cache = f", cache_slots={self.cache_slots}" if self.cache_slots else ""
        return (f"circuit_for({self.config.name!r}, {self.quant!r}, {self.mode!r}, {self.rows},"
                f" act={self.act!r}{last}{cache})")

    def _repr_svg_(self) -> str:
        return self.diagram._repr_svg_()

    def op_counts(self) -> dict[str, int]:
        """How many boxes of each op, in :data:`OPS` order.

        >>> circuit_for("tiny-llama").op_counts()["linear"]
        14
        """
        counts = Counter(b.name for b in self.diagram.boxes)
        return {op: counts[op] for op in OPS if counts[op]}


# -- types and boxes ------------------------------------------------------------------------

def _t(shape: tuple[Dim, ...], dtype: DType, fmt: str = "") -> TensorType:
    return TensorType(shape, dtype, fmt)


@attrs.frozen
class _Ops:
    """The boxes of one model at one (quant, act): built once, shared by every layer."""

    config: ModelConfig
    quant: str
    act: str

    @property
    def a(self) -> DType:
        return ACTS[self.act]

    def x(self, *dims: Dim, lead: str = "rows") -> TensorType:
        return _t((lead, *dims), self.a)

    def weight(self, *dims: Dim) -> TensorType:
        dtype, fmt = WEIGHT_FORMATS[self.quant]
        return _t(dims, dtype, fmt)

    def cache(self) -> TensorType:
        return _t(("slots", "max_ctx", "kv_heads", "head_dim"), self.a)

    def at(self, module: str) -> _Ops:
        """The ops of checkpoint module ``module``: bf16 weights where the checkpoint's
        ``quantization_config.modules_to_not_convert`` keeps it unquantized (gpt-oss's
        published mxfp4 checkpoints keep attention and routers bf16), else these."""
        if self.quant == "bf16" or not _kept(self.config, module):
            return self
        return attrs.evolve(self, quant="bf16")

    def box(self, name: str, dom: tuple[TensorType, ...], cod: tuple[TensorType, ...],
            **params: Any) -> Box:
        return Box(name, Ty(*dom), Ty(*cod), {"act": self.act, **params})

    def embed(self) -> Box:
        if self.config.ranks > 1:  # this rank's rows of the table, and where they start
            return self.box("embed", (_t(("rows",), I32), _t(("vocab_part", "hidden"), BF16),
                                      _t((1,), I32)), (self.x("hidden"),))
        return self.box("embed", (_t(("rows",), I32), _t(("vocab", "hidden"), BF16)),
                        (self.x("hidden"),))

    def rmsnorm(self, lead: str = "rows") -> Box:
        return self.box("rmsnorm", (self.x("hidden", lead=lead), _t(("hidden",), BF16)),
                        (self.x("hidden", lead=lead),), eps=self.config.rms_norm_eps)

    def last_row(self) -> Box:
        return self.box("last_row", (self.x("hidden"),), (self.x("hidden", lead="last"),))

    def linear(self, role: str, n_in: str, n_out: str) -> Box:
        return self.box("linear", (self.x(n_in), self.weight(n_out, n_in)), (self.x(n_out),),
                        role=role, weight=self.quant)

    def view(self, src: tuple[Dim, ...], dst: tuple[Dim, ...]) -> Box:
        return self.box("view", (self.x(*src),), (self.x(*dst),),
                        src=("rows", *src), dst=("rows", *dst))

    def heads(self, kind: str) -> TensorType:
        return self.x(kind, "head_dim")

    def qk_norm(self) -> Box:
        q, k = self.heads("heads"), self.heads("kv_heads")
        w = _t(("head_dim",), BF16)
        return self.box("qk_norm", (q, k, w, w), (q, k), eps=self.config.rms_norm_eps)

    def rope(self) -> Box:
        q, k = self.heads("heads"), self.heads("kv_heads")
        table = _t(("max_pos", "half"), F32)
        return self.box("rope", (q, k, _t(("rows",), I32), table, table), (q, k),
                        style=ROPE_STYLE)

    def attention(self, window: int) -> Box:
        c = self.config
        q, kv, cache = self.heads("heads"), self.heads("kv_heads"), self.cache()
        idx = _t(("rows",), I32)
        return self.box("attention", (q, kv, kv, cache, cache, idx, idx), (q, cache, cache),
                        heads=c.num_attention_heads, kv_heads=c.num_key_value_heads,
                        head_dim=c.head_dim, scale=c.head_dim ** -0.5, window=window)

    def add(self) -> Box:
        return self.box("add", (self.x("hidden"), self.x("hidden")), (self.x("hidden"),))

    def bias(self, n: str) -> Box:
        return self.box("bias", (self.x(n), _t((n,), BF16)), (self.x(n),))

    def attention_sink(self, window: int) -> Box:
        box = self.attention(window)
        dom = (*box.dom.types, _t(("heads",), BF16))
        return Box("attention", Ty(*dom), box.cod, {**dict(box.params), "sinks": True})

    def swiglu(self) -> Box:
        return self.box("swiglu", (self.x("inter"), self.x("inter")), (self.x("inter"),))

    def moe(self) -> Box:
        c = self.config
        if c.expert_bias:
            return self.box(
                "moe",
                (self.x("hidden"), _t(("experts", "hidden"), BF16), _t(("experts",), BF16),
                 self.weight("experts", "moe_gate_up", "hidden"),
                 _t(("experts", "moe_gate_up"), BF16),
                 self.weight("experts", "hidden", "moe_inter"), _t(("experts", "hidden"), BF16)),
                (self.x("hidden"),),
                experts=c.num_experts, top_k=c.num_experts_per_tok, router=c.router,
                moe_inter=c.moe_intermediate_size, weight=self.quant, limit=c.swiglu_limit,
                alpha=c.swiglu_alpha)
        return self.box(
            "moe",
            (self.x("hidden"), _t(("experts", "hidden"), BF16),
             self.weight("experts", "moe_inter", "hidden"),
             self.weight("experts", "moe_inter", "hidden"),
             self.weight("experts", "hidden", "moe_inter")),
            (self.x("hidden"),),
            experts=c.num_experts, top_k=c.num_experts_per_tok,
            renormalize=c.norm_topk_prob, moe_inter=c.moe_intermediate_size, weight=self.quant)

    def sample(self, lead: str = "rows") -> Box:
        return self.box("sample", (_t((lead, "vocab"), F32), _t((lead, "four"), F32),
                                   _t((lead, "four"), I32)), (_t((lead,), I32),))

    def lm_head(self, lead: str = "rows", vocab: str = "vocab") -> Box:
        return self.box("lm_head", (self.x("hidden", lead=lead), _t((vocab, "hidden"), BF16)),
                        (_t((lead, vocab), F32),), weight="bf16")

    def all_reduce(self) -> Box:
        """The sum over the ranks of each one's partial [rows, hidden] (tensor parallelism)."""
        return self.box("all_reduce", (self.x("hidden"),), (self.x("hidden"),),
                        ranks=self.config.ranks)

    def gather_logits(self, lead: str) -> tuple[Box, Box]:
        """Every rank's logits of its part of the vocabulary, side by side, then read as one
        row of the whole vocabulary (a view: the parts are in rank order)."""
        part = _t((lead, "vocab_part"), F32)
        gathered = _t((lead, "ranks", "vocab_part"), F32)
        gather = Box("all_gather", Ty(part), Ty(gathered), {"act": "f32",
                                                            "ranks": self.config.ranks})
        view = Box("view", Ty(gathered), Ty(_t((lead, "vocab"), F32)),
                   {"act": "f32", "src": (lead, "ranks", "vocab_part"), "dst": (lead, "vocab")})
        return gather, view


# -- inputs ---------------------------------------------------------------------------------

def _kept(config: ModelConfig, module: str) -> bool:
    """Whether ``module`` or a module containing it matches a ``modules_to_not_convert``
    pattern (fnmatch, ``*`` for the layer index) of the config's quantization_config."""
    patterns = (config.quantization_config or {}).get("modules_to_not_convert") or ()
    parts = module.split(".")
    prefixes = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    return any(isinstance(pat, str) and fnmatch.fnmatchcase(m, pat)
               for pat in patterns for m in prefixes)


def _layer_weights(ops: _Ops, i: int) -> list[tuple[str, TensorType]]:
    """Layer ``i``'s checkpoint weights, in the order the circuit reads them."""
    c, p = ops.config, f"model.layers.{i}."
    norm = _t(("hidden",), BF16)
    out = [(p + "input_layernorm.weight", norm)]
    for proj, n in (("q_proj", "q_dim"), ("k_proj", "kv_dim"), ("v_proj", "kv_dim")):
        out.append((p + f"self_attn.{proj}.weight",
                    ops.at(p + f"self_attn.{proj}").weight(n, "hidden")))
        if c.attention_bias:
            out.append((p + f"self_attn.{proj}.bias", _t((n,), BF16)))
    if c.arch in ("qwen3", "qwen3_moe"):
        head = _t(("head_dim",), BF16)
        out += [(p + "self_attn.q_norm.weight", head), (p + "self_attn.k_norm.weight", head)]
    if c.attention_sinks:
        out.append((p + "self_attn.sinks", _t(("heads",), BF16)))
    out.append((p + "self_attn.o_proj.weight",
                ops.at(p + "self_attn.o_proj").weight("hidden", "q_dim")))
    if c.attention_bias:
        out.append((p + "self_attn.o_proj.bias", _t(("hidden",), BF16)))
    out.append((p + "post_attention_layernorm.weight", norm))
    if c.is_moe_layer(i) and c.expert_bias:
        names = ("mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj",
                 "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
                 "mlp.experts.down_proj_bias")
        out += [(p + n, t) for n, t in zip(names, ops.at(p + "mlp.experts").moe().dom.types[1:])]
    elif c.is_moe_layer(i):
        moe = ops.at(p + "mlp.experts").moe().dom.types
        out += [(p + "mlp.gate.weight", moe[1]),
                (p + "mlp.experts.gate_proj.weight", moe[2]),
                (p + "mlp.experts.up_proj.weight", moe[3]),
                (p + "mlp.experts.down_proj.weight", moe[4])]
    else:
        out += [(p + "mlp.gate_proj.weight", ops.at(p + "mlp.gate_proj").weight("inter", "hidden")),
                (p + "mlp.up_proj.weight", ops.at(p + "mlp.up_proj").weight("inter", "hidden")),
                (p + "mlp.down_proj.weight", ops.at(p + "mlp.down_proj").weight("hidden", "inter"))]
    return out


def _inputs(ops: _Ops, sample: str = "") -> list[tuple[str, TensorType]]:
    c = ops.config
    idx, table = _t(("rows",), I32), _t(("max_pos", "half"), F32)
    out = [("tokens", idx), ("positions", idx), ("slots", idx),
           ("rope.cos", table), ("rope.sin", table)]
    for i in range(c.num_hidden_layers):
        out += [(f"kv.{i}.k", ops.cache()), (f"kv.{i}.v", ops.cache())]
    if sample:  # per row: (temperature, top_k, top_p, min_p) and (seed lo, hi, request, position)
        out += [("sample.params", _t((sample, "four"), F32)),
                ("sample.keys", _t((sample, "four"), I32))]
    vocab = "vocab_part" if c.ranks > 1 else "vocab"  # a rank holds its rows of the vocabulary
    out.append(("model.embed_tokens.weight", _t((vocab, "hidden"), BF16)))
    if c.ranks > 1:
        out.append((VOCAB_FIRST, _t((1,), I32)))
    for i in range(c.num_hidden_layers):
        out += _layer_weights(ops, i)
    out.append(("model.norm.weight", _t(("hidden",), BF16)))
    if not c.tie_word_embeddings:
        out.append(("lm_head.weight", _t((vocab, "hidden"), BF16)))
    return out


VOCAB_FIRST = "tp.vocab_first"
"""The input holding the first token id of a rank's part of the vocabulary (tensor
parallelism: bound with the rank's weights)."""


# -- the circuit ----------------------------------------------------------------------------

def _check(config: ModelConfig, quant: str, mode: str, rows: int, act: str, logits: str) -> None:
    where = f"{config.name} (circuit)"
    for key, value, valid in (("quant", quant, tuple(WEIGHT_FORMATS)), ("mode", mode, MODES),
                              ("act", act, tuple(ACTS)), ("logits", logits, LOGITS)):
        if value not in valid:
            raise ConfigError(f"unknown {key}", file=where, key=key,
                              expected="one of " + ", ".join(valid), found=repr(value),
                              suggestion=nearest(str(value), valid))
    if not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
        raise ConfigError("rows must be a positive integer", file=where, key="rows",
                          expected="an integer > 0", found=repr(rows))
    if logits == "last" and mode == "decode":
        raise ConfigError("decode rows are sequences, each needs its logits", file=where,
                          key="logits", expected="'all' in decode", found="'last'")


def circuit_for(config: ModelConfig | str, quant: str = "bf16", mode: str = "decode",
                rows: int = 1, *, act: str = "bf16", logits: str = "all",
                sample: bool = False, cache_slots: int | None = None) -> Circuit:
    """The circuit of one forward step of ``config`` (a :class:`ModelConfig` or built-in name).

    ``quant`` types the linear and expert weights (``bf16``, ``fp8``, ``mxfp4``, ``nvfp4``),
    ``act`` the activations and KV cache (``bf16`` or ``f32``); logits are f32, for every row
    or (``logits="last"``, prefill) for the last row only: the final norm and lm_head then run
    on that row, ``[last, hidden]`` with ``last`` = 1. ``sample`` ends the step with the
    ``sample`` op on those logits: inputs ``sample.params`` and ``sample.keys``, output ``ids``.

    >>> c = circuit_for("tiny-qwen3-moe", "nvfp4", "prefill", 16)
    >>> c.op_counts()["moe"], str(c.input_type("model.layers.0.mlp.experts.down_proj.weight"))
    (2, 'nvfp4[experts,hidden,moe_inter]')
    >>> str(circuit_for("tiny-llama", mode="prefill", rows=8, logits="last").output_type("logits"))
    'f32[last,vocab]'
    >>> circuit_for("tiny-llama", quant="nvfp")
    Traceback (most recent call last):
    ...
    metrale.lkb.errors.ConfigError: tiny-llama (circuit): quant: unknown quant (expected one of bf16, fp8, mxfp4, nvfp4, found 'nvfp'); did you mean 'nvfp4'?
    """
    config = ModelConfig.load(config)
    _check(config, quant, mode, rows, act, logits)
    if cache_slots is not None and (not isinstance(cache_slots, int) or isinstance(
            cache_slots, bool) or cache_slots < (rows if mode == "decode" else 1)):
        raise ConfigError("bad cache slot count", file=f"{config.name} (circuit)",
                          key="cache_slots", expected="an int, at least the step's sequences",
                          found=repr(cache_slots))
    ops = _Ops(config, quant, act)
    inputs = _inputs(ops, ("last" if logits == "last" else "rows") if sample else "")
    names = tuple(n for n, _ in inputs)
    b = Builder(Ty(*(t for _, t in inputs)))
    w: dict[str, Wire] = dict(zip(names, b.inputs))

    embed, rmsnorm, add = ops.embed(), ops.rmsnorm(), ops.add()
    shapes = {"q_proj": ("hidden", "q_dim"), "k_proj": ("hidden", "kv_dim"),
              "v_proj": ("hidden", "kv_dim"), "o_proj": ("q_dim", "hidden"),
              "gate_proj": ("hidden", "inter"), "up_proj": ("hidden", "inter"),
              "down_proj": ("inter", "hidden")}

    def linear(module: str) -> Box:
        role = module.rsplit(".", 1)[1]
        return ops.at(module).linear(role, *shapes[role])

    swiglu = ops.swiglu()
    q_view, kv_view = ops.view(("q_dim",), ("heads", "head_dim")), ops.view(
        ("kv_dim",), ("kv_heads", "head_dim"))
    o_view = ops.view(("heads", "head_dim"), ("q_dim",))
    qk_norm = ops.qk_norm() if config.arch in ("qwen3", "qwen3_moe") else None
    rope = ops.rope()
    make_attention = ops.attention_sink if config.attention_sinks else ops.attention
    attention = {win: make_attention(win) for win in
                 {config.layer_window(i) or 0 for i in range(config.num_hidden_layers)}}
    bias = {n: ops.bias(n) for n in ("q_dim", "kv_dim", "hidden")} if config.attention_bias \
        else {}

    sharded = config.ranks > 1
    all_reduce = ops.all_reduce() if sharded else None

    def reduce(x: Wire) -> Wire:
        """The ranks' partial sums added (tensor parallelism); ``x`` itself on one rank."""
        return b.add(all_reduce, x)[0] if all_reduce is not None else x

    def project(box: Box, x: Wire, name: str) -> Wire:
        (y,) = b.add(box, x, w[name + ".weight"])
        if box.param("role") == "o_proj":
            y = reduce(y)  # o_proj's columns are split by rank: the partial sums meet here
        if bias:
            (y,) = b.add(bias[box.cod.types[0].shape[1]], y, w[name + ".bias"])
        return y


    if sharded:  # each rank's rows of the vocabulary, -0.0 elsewhere: the sum is exact
        (h,) = b.add(embed, w["tokens"], w["model.embed_tokens.weight"], w[VOCAB_FIRST])
        h = reduce(h)
    else:
        (h,) = b.add(embed, w["tokens"], w["model.embed_tokens.weight"])
    caches: list[Wire] = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        (n,) = b.add(rmsnorm, h, w[p + "input_layernorm.weight"])
        q = project(linear(p + "self_attn.q_proj"), n, p + "self_attn.q_proj")
        k = project(linear(p + "self_attn.k_proj"), n, p + "self_attn.k_proj")
        v = project(linear(p + "self_attn.v_proj"), n, p + "self_attn.v_proj")
        (q,), (k,), (v,) = b.add(q_view, q), b.add(kv_view, k), b.add(kv_view, v)
        if qk_norm is not None:
            q, k = b.add(qk_norm, q, k, w[p + "self_attn.q_norm.weight"],
                         w[p + "self_attn.k_norm.weight"])
        q, k = b.add(rope, q, k, w["positions"], w["rope.cos"], w["rope.sin"])
        sinks = (w[p + "self_attn.sinks"],) if config.attention_sinks else ()
        o, kc, vc = b.add(attention[config.layer_window(i) or 0], q, k, v, w[f"kv.{i}.k"],
                          w[f"kv.{i}.v"], w["positions"], w["slots"], *sinks)
        caches += [kc, vc]
        (o,) = b.add(o_view, o)
        a = project(linear(p + "self_attn.o_proj"), o, p + "self_attn.o_proj")
        (h,) = b.add(add, h, a)
        (n,) = b.add(rmsnorm, h, w[p + "post_attention_layernorm.weight"])
        moe = ops.at(p + "mlp.experts").moe() if config.is_moe_layer(i) else None
        if moe is not None and config.expert_bias:
            (d,) = b.add(moe, n, *(w[p + "mlp." + x] for x in (
                "router.weight", "router.bias", "experts.gate_up_proj",
                "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")))
        elif moe is not None:
            (d,) = b.add(moe, n, w[p + "mlp.gate.weight"], w[p + "mlp.experts.gate_proj.weight"],
                         w[p + "mlp.experts.up_proj.weight"],
                         w[p + "mlp.experts.down_proj.weight"])
        else:
            (g,) = b.add(linear(p + "mlp.gate_proj"), n, w[p + "mlp.gate_proj.weight"])
            (u,) = b.add(linear(p + "mlp.up_proj"), n, w[p + "mlp.up_proj.weight"])
            (s,) = b.add(swiglu, g, u)
            (d,) = b.add(linear(p + "mlp.down_proj"), s, w[p + "mlp.down_proj.weight"])
        # down_proj's rows (each expert's, in a MoE) are split by rank: partial sums meet here
        (h,) = b.add(add, h, reduce(d))
    lead = "rows"
    if logits == "last":
        (h,) = b.add(ops.last_row(), h)
        lead = "last"
    (n,) = b.add(ops.rmsnorm(lead), h, w["model.norm.weight"])
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    if sharded:  # each rank's logits of its rows of the vocabulary, gathered
        (part,) = b.add(ops.lm_head(lead, "vocab_part"), n, w[head])
        gather, view = ops.gather_logits(lead)
        (out,) = b.add(view, *b.add(gather, part))
    else:
        (out,) = b.add(ops.lm_head(lead), n, w[head])

    outputs = ("logits", *(f"kv.{i}.{kv}" for i in range(config.num_hidden_layers)
                           for kv in ("k", "v")))
    ends = (out, *caches)
    if sample:
        (ids,) = b.add(ops.sample(lead), out, w["sample.params"], w["sample.keys"])
        outputs, ends = (*outputs, "ids"), (*ends, ids)
    # transformers' gpt-oss experts store their plain matrices as x @ W takes them
    transposed = frozenset(n for n in names if config.expert_bias and
                           n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")))
    return Circuit(b.build(*ends), names, outputs, config, quant, mode, rows, act, logits,
                   sample, transposed, cache_slots)
