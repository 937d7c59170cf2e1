"""Model configs: the frozen ``ModelConfig`` read from a Hugging Face ``config.json``.

A config comes from a checkpoint directory, a ``config.json`` path or a built-in name
(:mod:`metrale.plan.models`); both spellings transformers has used are read (``rope_scaling`` +
``rope_theta`` of 4.x and ``rope_parameters`` of 5.x; ``torch_dtype`` and ``dtype``;
``num_experts`` and ``num_local_experts``). Defaults follow transformers' config classes.

Laws: ``from_hf_dict(c.to_hf_dict()) == c``; ``c.with_layers(c.num_hidden_layers) == c``;
a layer is MoE iff it is not in ``mlp_only_layers``, ``num_experts > 0`` and
``(i + 1) % decoder_sparse_step == 0`` (transformers' Qwen3-MoE rule).

>>> c = ModelConfig.load("qwen3-0.6b")
>>> print(c)
qwen3-0.6b: qwen3, 28 layers, hidden 1024, heads 16/8 x 128, inter 3072, vocab 151936, tied
>>> ModelConfig.from_hf_dict(c.to_hf_dict(), name=c.name) == c
True
>>> c.with_layers(c.num_hidden_layers) == c
True
>>> m = ModelConfig.load("qwen3-30b-a3b")
>>> m.sizes()["moe_inter"], all(m.is_moe_layer(i) for i in range(m.num_hidden_layers))
(768, True)
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Any

import attrs

from metrale.lkb.dtype import DType
from metrale.lkb.errors import ConfigError, MetraleError, nearest
from metrale.lkb.files import Fields, raise_all, read_json

from .models import BUILTIN, builtin_config, builtin_names

ARCHS = ("llama", "qwen3", "qwen3_moe", "gpt_oss")
"""Architectures Metrale plans, by their ``model_type``."""

ARCH_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}
"""``model_type`` → the transformers class named in ``architectures``."""

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE scaling types Metrale computes (:mod:`metrale.plan.rope`)."""

LAYER_TYPES = ("full_attention", "sliding_attention")

# transformers' defaults for keys a config.json may leave out, per config class.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "qwen3": 32768, "qwen3_moe": 32768,
                          "gpt_oss": 131072}
_DEFAULT_QWEN3_HEAD_DIM = 128  # Qwen3Config.head_dim; Llama and Qwen3-MoE use hidden / heads
_DEFAULT_ROPE_THETA = 10000.0
_DEFAULT_EPS = 1e-6
_DEFAULT_SLIDING_WINDOW = 4096
_DEFAULT_MAX_WINDOW_LAYERS = 28
# GptOssConfig's defaults: the sliding window, the clamped SwiGLU's limit and sigmoid gain
_DEFAULT_GPT_OSS_WINDOW = 128
_DEFAULT_SWIGLU_LIMIT = 7.0
_DEFAULT_SWIGLU_ALPHA = 1.702


def _positive(value: Any) -> bool:
    return value is not None and value > 0


@attrs.frozen
class RopeScaling:
    """A RoPE frequency rescaling: ``linear`` (divide by ``factor``), Llama 3.1's ``llama3`` or
    ``yarn`` (gpt-oss: ``beta_fast``/``beta_slow`` bound the ramp between interpolated and
    extrapolated frequencies, ``truncate`` rounds the bounds, the tables are scaled by
    ``attention_factor``, by default ``0.1 ln(factor) + 1``).

    The ``default`` type is no rescaling and is spelled ``rope_scaling=None`` on the config.

    >>> r = RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    >>> r.to_hf_dict()["rope_type"], r.to_hf_dict()["original_max_position_embeddings"]
    ('llama3', 8192)
    """

    rope_type: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True
    attention_factor: float | None = None

    def to_hf_dict(self) -> dict[str, Any]:
        """The ``rope_scaling`` dict of a transformers 4.x ``config.json``.

        >>> RopeScaling("yarn", 32.0, None, None, 4096, 32.0, 1.0, False).to_hf_dict()["truncate"]
        False
        """
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        if self.rope_type == "llama3":
            out["low_freq_factor"] = self.low_freq_factor
            out["high_freq_factor"] = self.high_freq_factor
            out["original_max_position_embeddings"] = self.original_max_position_embeddings
        if self.rope_type == "yarn":
            out.update(beta_fast=self.beta_fast, beta_slow=self.beta_slow,
                       original_max_position_embeddings=self.original_max_position_embeddings,
                       truncate=self.truncate)
            if self.attention_factor is not None:
                out["attention_factor"] = self.attention_factor
        return out


@attrs.frozen
class ModelConfig:
    """The shape and numerics of one decoder-only model, as its ``config.json`` states them.

    ``layer_types`` says per layer whether attention is full or sliding (only Qwen3 models
    slide, and only with ``use_sliding_window``); ``sliding_window`` is the effective window
    (``None`` when sliding is off). MoE fields are zero/empty for dense models.
    ``quantization_config`` is the raw dict of the checkpoint (the checkpoint loader reads it).
    gpt-oss adds learned per-head ``attention_sinks``, the ``router`` ``topk_softmax`` (softmax
    over the chosen experts' biased logits; Qwen3-MoE's is ``softmax_topk``), ``expert_bias``
    and the clamped SwiGLU (``swiglu_limit``, ``swiglu_alpha``; ``None``: the plain SwiGLU).

    >>> c = ModelConfig.load("llama-3.1-8b")
    >>> c.head_dim, c.rope_scaling.factor, c.dtype
    (128, 8.0, BF16)
    >>> c.with_layers(2).num_hidden_layers
    2
    """

    name: str
    arch: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    rope_theta: float
    rope_scaling: RopeScaling | None
    rms_norm_eps: float
    max_position_embeddings: int
    layer_types: tuple[str, ...]
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int | None = None
    dtype: DType | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    attention_sinks: bool = False
    router: str = "softmax_topk"
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float | None = None
    ranks: int = 1
    """Tensor-parallel ranks this config is one of (``plan.shard.Sharding``): its head and
    intermediate counts are one rank's, and its circuit joins the ranks by collectives."""
    # A raw dict is unhashable: it takes part in == but not in hash (equal values still hash
    # equal, the one law hash must keep).
    quantization_config: dict[str, Any] | None = attrs.field(default=None, hash=False)

    # -- reading -------------------------------------------------------------------------

    @classmethod
    def load(cls, source: str | os.PathLike | ModelConfig) -> ModelConfig:
        """The config of a checkpoint directory, a ``config.json`` file or a built-in name.

        A path that exists wins over a built-in of the same name.

        >>> ModelConfig.load("tiny-qwen3-moe").sizes()["experts"]
        8
        >>> try:
        ...     ModelConfig.load("lama-3.1-8b")
        ... except ConfigError as e:
        ...     print(e.message, "/", e.suggestion)
        no such model config / llama-3.1-8b
        """
        if isinstance(source, ModelConfig):
            return source
        path = Path(source)
        if path.is_dir():
            file = path / "config.json"
            if not file.is_file():
                raise ConfigError("checkpoint directory has no config.json", file=file)
            return cls.from_hf_dict(read_json(file), file=file, name=path.resolve().name)
        if path.is_file():
            name = path.resolve().parent.name if path.name == "config.json" else path.stem
            return cls.from_hf_dict(read_json(path), file=path, name=name)
        text = os.fspath(source)
        if text in BUILTIN:
            return cls.from_hf_dict(builtin_config(text), file=f"{text} (built-in)", name=text)
        raise ConfigError(
            "no such model config",
            file=text,
            expected="a checkpoint directory, a config.json file or a built-in name",
            found=repr(text),
            suggestion=nearest(text, builtin_names()),
        )

    @classmethod
    def from_hf_dict(cls, data: Any, *, file: object = "config.json", name: str = "model"
                     ) -> ModelConfig:
        """Read a parsed ``config.json``; every violation is reported, naming file and field.

        >>> d = builtin_config("tiny-llama")
        >>> d["num_key_value_heads"] = 3
        >>> try:
        ...     ModelConfig.from_hf_dict(d, file="t/config.json")
        ... except ConfigError as e:
        ...     print(e.where, "/", e.expected, "/", e.found)
        t/config.json: num_key_value_heads / a divisor of 4 / 3
        """
        return _Reader(data, file, name).read()

    # -- derived -------------------------------------------------------------------------

    @property
    def is_moe(self) -> bool:
        """Whether the architecture routes tokens to experts."""
        return self.arch in ("qwen3_moe", "gpt_oss")

    @property
    def q_dim(self) -> int:
        """Width of the query projection: ``heads * head_dim``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections: ``kv_heads * head_dim``."""
        return self.num_key_value_heads * self.head_dim

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_hidden_layers:
            raise ConfigError("layer index out of range", file=self.name, key="num_hidden_layers",
                              expected=f"0 <= i < {self.num_hidden_layers}", found=i)

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer ``i``'s MLP is the sparse MoE block (transformers' Qwen3-MoE rule).

        >>> import attrs
        >>> c = attrs.evolve(ModelConfig.load("tiny-qwen3-moe"), decoder_sparse_step=2)
        >>> [c.is_moe_layer(i) for i in range(2)]
        [False, True]
        """
        self._check_layer(i)
        return (
            self.is_moe
            and i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer ``i``'s attention, ``None`` for full causal attention.

        >>> ModelConfig.load("qwen3-8b").layer_window(0) is None
        True
        """
        self._check_layer(i)
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    def sizes(self) -> dict[str, int]:
        """The named dimensions circuits bind (MoE ones only for MoE models).

        >>> s = ModelConfig.load("llama-3.2-1b").sizes()
        >>> s["q_dim"], s["kv_dim"], "experts" in s
        (2048, 512, False)
        """
        out = {
            "hidden": self.hidden_size,
            "inter": self.intermediate_size,
            "heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "q_dim": self.q_dim,
            "kv_dim": self.kv_dim,
            "vocab": self.vocab_size,
        }
        if self.is_moe:
            out.update(experts=self.num_experts, top_k=self.num_experts_per_tok,
                       moe_inter=self.moe_intermediate_size)
        if self.expert_bias:  # gate and up in one interleaved matrix (gpt-oss)
            out["moe_gate_up"] = 2 * self.moe_intermediate_size
        if self.ranks > 1:  # one rank's rows of the lm_head, gathered into the vocabulary
            out.update(ranks=self.ranks, vocab_part=self.vocab_size // self.ranks)
        return out

    def with_layers(self, n: int) -> ModelConfig:
        """The same model cut or grown to ``n`` layers (benchmarks scale depth this way).

        Per-layer data follows: ``mlp_only_layers`` keeps the indices below ``n``, and
        ``layer_types`` is re-derived by transformers' rule when it was derived, else cut.

        >>> ModelConfig.load("llama-3.1-70b").with_layers(3).layer_types
        ('full_attention', 'full_attention', 'full_attention')
        """
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ConfigError("layer count must be a positive integer", file=self.name,
                              key="num_hidden_layers", expected="an integer > 0", found=repr(n))
        derived = _derive_layer_types(self.arch, self.num_hidden_layers, self.sliding_window,
                                      self.max_window_layers)
        if self.layer_types == derived:
            layer_types = _derive_layer_types(self.arch, n, self.sliding_window,
                                              self.max_window_layers)
        elif n <= len(self.layer_types):
            layer_types = self.layer_types[:n]
        else:
            raise ConfigError("cannot extend explicit layer_types", file=self.name,
                              key="layer_types", expected=f"at most {len(self.layer_types)} layers",
                              found=n)
        return attrs.evolve(
            self,
            num_hidden_layers=n,
            layer_types=layer_types,
            mlp_only_layers=tuple(i for i in self.mlp_only_layers if i < n),
        )

    # -- writing -------------------------------------------------------------------------

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers 4.x and 5.x load and that reads back equal.

        >>> d = ModelConfig.load("tiny-llama").to_hf_dict()
        >>> d["architectures"], d["rope_scaling"]["rope_type"]
        (['LlamaForCausalLM'], 'llama3')
        """
        out: dict[str, Any] = {
            "architectures": [ARCH_CLASSES[self.arch]],
            "model_type": self.arch,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else self.rope_scaling.to_hf_dict(),
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
        }
        if self.arch == "llama":
            out["mlp_bias"] = False
        elif self.arch == "gpt_oss":
            out["sliding_window"] = self.sliding_window
            out["swiglu_limit"] = self.swiglu_limit
            out["layer_types"] = list(self.layer_types)
        else:
            out["use_sliding_window"] = self.use_sliding_window
            out["sliding_window"] = self.sliding_window
            if self.max_window_layers is not None:
                out["max_window_layers"] = self.max_window_layers
        if self.arch == "qwen3":
            out["layer_types"] = list(self.layer_types)
        if self.arch == "gpt_oss":
            out.update(num_local_experts=self.num_experts,
                       num_experts_per_tok=self.num_experts_per_tok)
        elif self.is_moe:
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        if self.dtype is not None:
            # torch_dtype, not dtype: transformers 5 reads it silently and 4.x only reads it.
            out["torch_dtype"] = self.dtype.numpy_name
        if self.quantization_config is not None:
            out["quantization_config"] = copy.deepcopy(self.quantization_config)
        return out

    def __str__(self) -> str:
        text = (
            f"{self.name}: {self.arch}, {self.num_hidden_layers} layers, hidden {self.hidden_size},"
            f" heads {self.num_attention_heads}/{self.num_key_value_heads} x {self.head_dim},"
            f" inter {self.intermediate_size}, vocab {self.vocab_size}"
        )
        if self.is_moe:
            text += (f", experts {self.num_experts} top {self.num_experts_per_tok}"
                     f" x {self.moe_intermediate_size}")
        if self.tie_word_embeddings:
            text += ", tied"
        return text


_MAX_SIZE = 2**31 - 1
"""No size of a config (layers, hidden, heads, vocab …) is larger: kernels index with int32."""


def _derive_layer_types(arch: str, n: int, sliding_window: int | None,
                        max_window_layers: int | None) -> tuple[str, ...]:
    """transformers' per-layer attention kinds when ``layer_types`` is not given."""
    if sliding_window is None or arch == "llama":
        return ("full_attention",) * n
    if arch == "qwen3_moe":  # Qwen3-MoE slides every layer when sliding is on
        return ("sliding_attention",) * n
    if arch == "gpt_oss":  # GptOssConfig: even layers slide, odd ones attend to all
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    first = _DEFAULT_MAX_WINDOW_LAYERS if max_window_layers is None else max_window_layers
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _as_float(value: Any) -> float:
    return float(value)


class _Reader:
    """One pass over a ``config.json`` dict, collecting every violation before raising."""

    def __init__(self, data: Any, file: object, name: str) -> None:
        self.file = file
        self.name = name
        self.errors: list[MetraleError] = []
        # No close(): config.json files carry many keys planning ignores (token ids, …).
        self.f = Fields(data, file, "", self.errors)
        self.data = self.f.data

    def fail(self, key: str, message: str, expected: Any = None, found: Any = None,
             suggestion: str | None = None) -> None:
        self.errors.append(ConfigError(message, file=self.file, key=key, expected=expected,
                                       found=found, suggestion=suggestion))

    def positive(self, key: str, default: int | None = None, *, required: bool = True
                 ) -> int | None:
        """The positive integer at ``key``; absent optional keys give ``default``."""
        if required:
            value = self.f.take(key, int)
        else:
            value = self.f.take(key, (int, type(None)), default=None)
            if value is None:
                return default
        if value is not None and value <= 0:
            self.fail(key, "size must be positive", "an integer > 0", value)
            return None
        if value is not None and value > _MAX_SIZE:
            self.fail(key, "size too large", f"at most {_MAX_SIZE}", value)
            return None
        return value

    def read(self) -> ModelConfig:
        if not self.f.ok:
            raise_all(self.errors)
        self.finite(self.data, "")
        if self.errors:
            raise_all(self.errors)
        f = self.f
        arch = self.arch()
        hidden = self.positive("hidden_size")
        inter = self.positive("intermediate_size")
        layers = self.positive("num_hidden_layers")
        heads = self.positive("num_attention_heads")
        vocab = self.positive("vocab_size")
        kv_heads = self.positive("num_key_value_heads", heads, required=False)
        head_dim = self.head_dim(arch, hidden, heads)
        if _positive(heads) and _positive(kv_heads) and heads % kv_heads:
            self.fail("num_key_value_heads", "key/value heads must divide the attention heads",
                      f"a divisor of {heads}", kv_heads)
        max_pos = self.positive("max_position_embeddings",
                                _DEFAULT_MAX_POSITIONS.get(arch or "llama"), required=False)
        eps = f.take("rms_norm_eps", (int, float), default=_DEFAULT_EPS, convert=_as_float)
        if eps is not None and not eps > 0:
            self.fail("rms_norm_eps", "epsilon must be positive", "a number > 0", eps)
        tied = f.take("tie_word_embeddings", bool, default=False)
        bias = f.take("attention_bias", bool, default=arch == "gpt_oss")
        self.unsupported()
        rope_theta, rope_scaling = self.rope(max_pos)
        use_sliding, window, max_window, layer_types = self.sliding(arch, layers)
        dtype = self.dtype()
        moe = self.moe(arch, layers)
        moe.update(self.gpt_oss(arch))
        quant = f.take("quantization_config", (dict, type(None)), default=None)
        raise_all(self.errors)
        return ModelConfig(
            name=self.name,
            arch=arch,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=vocab,
            tie_word_embeddings=tied,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=eps,
            max_position_embeddings=max_pos,
            layer_types=layer_types,
            attention_bias=bias,
            use_sliding_window=use_sliding,
            sliding_window=window,
            max_window_layers=max_window,
            dtype=dtype,
            quantization_config=None if quant is None else copy.deepcopy(quant),
            **moe,
        )

    def finite(self, value: Any, key: str) -> None:
        """Every number of the config is finite: JSON has no NaN or Infinity, but Python's
        reader accepts them, and one in ``rms_norm_eps`` or ``rope_theta`` would poison every
        activation; each is reported by its dotted key."""
        if isinstance(value, float) and not math.isfinite(value):
            self.fail(key, "number is not finite", "a finite number", value)
        elif isinstance(value, dict):
            for k, v in value.items():
                self.finite(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.finite(v, f"{key}[{i}]")

    def gpt_oss(self, arch: str | None) -> dict[str, Any]:
        """gpt-oss's fixed structure (sinks, biased experts, its router) and its SwiGLU clamp."""
        if arch != "gpt_oss":
            return {}
        limit = self.f.take("swiglu_limit", (int, float), default=_DEFAULT_SWIGLU_LIMIT,
                            convert=_as_float)
        alpha = self.f.take("swiglu_alpha", (int, float), default=_DEFAULT_SWIGLU_ALPHA,
                            convert=_as_float)
        for key, value in (("swiglu_limit", limit), ("swiglu_alpha", alpha)):
            if value is not None and not value > 0:
                self.fail(key, "must be positive", "a number > 0", value)
        return {"attention_sinks": True, "router": "topk_softmax", "expert_bias": True,
                "swiglu_limit": limit, "swiglu_alpha": alpha}

    def arch(self) -> str | None:
        model_type = self.f.take("model_type", (str, type(None)), default=None)
        classes = self.f.take("architectures", (list, type(None)), default=None) or [None]
        by_class = {v: k for k, v in ARCH_CLASSES.items()}
        from_class = by_class.get(classes[0]) if isinstance(classes[0], str) else None
        if model_type is None:
            if from_class is None:
                if classes[0] is None:
                    self.fail("model_type", "missing key", "one of " + ", ".join(ARCHS))
                else:
                    self.fail("architectures", "unknown architecture",
                              "one of " + ", ".join(by_class), repr(classes[0]),
                              nearest(str(classes[0]), by_class))
            return from_class
        if model_type not in ARCHS:
            self.fail("model_type", "unknown architecture", "one of " + ", ".join(ARCHS),
                      repr(model_type), nearest(model_type, ARCHS))
            return None
        if from_class is not None and from_class != model_type:
            self.fail("architectures", "architecture disagrees with model_type",
                      ARCH_CLASSES[model_type], repr(classes[0]))
        return model_type

    def head_dim(self, arch: str | None, hidden: int | None, heads: int | None) -> int | None:
        head_dim = self.f.take("head_dim", (int, type(None)), default=None)
        if head_dim is None:
            if arch == "qwen3":
                return _DEFAULT_QWEN3_HEAD_DIM
            if not (_positive(hidden) and _positive(heads)):
                return None
            if hidden % heads:
                self.fail("head_dim", "head_dim is absent and the heads do not divide hidden_size",
                          f"num_attention_heads dividing {hidden}", heads)
                return None
            head_dim = hidden // heads
        elif head_dim <= 0:
            self.fail("head_dim", "size must be positive", "an integer > 0", head_dim)
            return None
        if head_dim % 2:
            self.fail("head_dim", "RoPE rotates pairs: head_dim must be even", "an even size",
                      head_dim)
            return None
        return head_dim

    def unsupported(self) -> None:
        """Keys that would change the maths if ignored: only their neutral values pass."""
        act = self.f.take("hidden_act", str, default="silu")
        if act is not None and act != "silu":
            self.fail("hidden_act", "activation not supported", "'silu'", repr(act))
        if self.f.take("mlp_bias", bool, default=False):
            self.fail("mlp_bias", "MLP projections with bias are not supported", "false", "true")
        prf = self.f.take("partial_rotary_factor", (int, float), default=1.0)
        if prf is not None and prf != 1.0:
            self.fail("partial_rotary_factor", "partial rotary embedding is not supported",
                      1.0, prf)

    def rope(self, max_pos: int | None) -> tuple[float, RopeScaling | None]:
        top_theta = self.f.take("rope_theta", (int, float, type(None)), default=None)
        new = self.f.take("rope_parameters", (dict, type(None)), default=None)
        old = self.f.take("rope_scaling", (dict, type(None)), default=None)
        if new is not None and old is not None:
            strip = {"rope_theta"}
            if ({k: v for k, v in new.items() if k not in strip}
                    != {k: v for k, v in old.items() if k not in strip}):
                self.fail("rope_scaling", "conflicts with rope_parameters",
                          repr(new), repr(old))
        prefix = "rope_parameters" if new is not None else "rope_scaling"
        params = new if new is not None else (old or {})
        errors: list[MetraleError] = []
        rf = Fields(params, self.file, prefix, errors)
        theta = rf.take("rope_theta", (int, float), default=None)
        if theta is not None and top_theta is not None and float(theta) != float(top_theta):
            self.fail(f"{prefix}.rope_theta", "disagrees with rope_theta", top_theta, theta)
        theta = float(theta if theta is not None else
                      top_theta if top_theta is not None else _DEFAULT_ROPE_THETA)
        if not theta > 0:
            self.fail("rope_theta", "RoPE base must be positive", "a number > 0", theta)
        prf = rf.take("partial_rotary_factor", (int, float), default=1.0)
        if prf is not None and prf != 1.0:
            rf.fail("partial_rotary_factor", "partial rotary embedding is not supported",
                    1.0, prf)
        rope_type = rf.take("rope_type", str, default=None)
        legacy = rf.take("type", str, default=None)
        rope_type = rope_type or legacy or "default"
        scaling = None
        if rope_type not in ROPE_TYPES:
            errors.append(ConfigError(
                "unknown rope scaling type", file=self.file, key=f"{prefix}.rope_type",
                expected="one of " + ", ".join(ROPE_TYPES), found=repr(rope_type),
                suggestion=nearest(rope_type, ROPE_TYPES)))
        else:
            if rope_type != "default":
                scaling = self.rope_scaling(rf, rope_type, max_pos)
            rf.close()  # only a known type says which keys belong
        self.errors.extend(errors)
        return theta, scaling

    def rope_scaling(self, rf: Fields, rope_type: str, max_pos: int | None) -> RopeScaling | None:
        def factor(key: str) -> float | None:
            value = rf.take(key, (int, float), convert=_as_float)
            if value is not None and not value > 0:
                rf.fail(key, "scaling factor must be positive", "a number > 0", value)
                return None
            return value

        scale = factor("factor")
        if rope_type == "linear":
            return None if scale is None else RopeScaling("linear", scale)
        if rope_type == "yarn":
            return self.yarn(rf, scale, max_pos)
        low, high = factor("low_freq_factor"), factor("high_freq_factor")
        original = rf.take("original_max_position_embeddings", int, default=max_pos)
        if original is not None and original <= 0:
            rf.fail("original_max_position_embeddings", "size must be positive",
                    "an integer > 0", original)
            original = None
        if low is not None and high is not None and not high > low:
            rf.fail("high_freq_factor", "must exceed low_freq_factor", f"> {low}", high)
            return None
        if None in (scale, low, high, original):
            return None
        return RopeScaling("llama3", scale, low, high, original)

    def yarn(self, rf: Fields, scale: float | None, max_pos: int | None) -> RopeScaling | None:
        """transformers' ``_compute_yarn_parameters`` keys; ``mscale`` variants are refused."""
        def number(key: str, default: float | None) -> float | None:
            value = rf.take(key, (int, float, type(None)), default=default)
            if value is None:
                return default
            if not value > 0:
                rf.fail(key, "must be positive", "a number > 0", value)
                return None
            return float(value)

        fast, slow = number("beta_fast", 32.0), number("beta_slow", 1.0)
        attention = number("attention_factor", None)
        truncate = rf.take("truncate", bool, default=True)
        for key in ("mscale", "mscale_all_dim"):
            if rf.take(key, (int, float, type(None)), default=None) is not None:
                rf.fail(key, "yarn's mscale variants are not supported", "absent", "present")
        original = rf.take("original_max_position_embeddings", int, default=max_pos)
        if original is not None and original <= 0:
            rf.fail("original_max_position_embeddings", "size must be positive",
                    "an integer > 0", original)
            return None
        if None in (scale, fast, slow, original, truncate):
            return None
        return RopeScaling("yarn", scale, None, None, original, fast, slow, truncate, attention)

    def sliding(self, arch: str | None, layers: int | None
                ) -> tuple[bool, int | None, int | None, tuple[str, ...]]:
        if arch in (None, "llama"):
            return False, None, None, ("full_attention",) * (layers or 0)
        # gpt-oss has no use_sliding_window switch: its layer_types decide
        use = self.f.take("use_sliding_window", bool, default=arch == "gpt_oss")
        window = self.f.take("sliding_window", (int, type(None)),
                             default=_DEFAULT_GPT_OSS_WINDOW if arch == "gpt_oss"
                             else _DEFAULT_SLIDING_WINDOW)
        max_window = self.f.take("max_window_layers", (int, type(None)), default=None)
        if arch == "qwen3" and max_window is None:
            max_window = _DEFAULT_MAX_WINDOW_LAYERS
        if max_window is not None and max_window < 0:
            self.fail("max_window_layers", "must not be negative", "an integer >= 0", max_window)
        if not use:
            window = None  # transformers ignores the window unless use_sliding_window is true
        elif window is None or window <= 0:
            self.fail("sliding_window", "use_sliding_window is true but the window is not a"
                      " positive size", "an integer > 0", repr(window))
            window = None
        explicit = self.f.take("layer_types", (list, type(None)), default=None)
        if layers is None:
            return bool(use), window, max_window, ()
        if arch in ("qwen3", "gpt_oss") and explicit is not None:
            bad = [t for t in explicit if t not in LAYER_TYPES]
            if bad:
                self.fail("layer_types", "unknown layer type", "one of " + ", ".join(LAYER_TYPES),
                          repr(bad[0]), nearest(str(bad[0]), LAYER_TYPES))
            elif len(explicit) != layers:
                self.fail("layer_types", "one entry per layer", f"{layers} entries",
                          len(explicit))
            else:
                return bool(use), window, max_window, tuple(explicit)
        return bool(use), window, max_window, _derive_layer_types(arch, layers, window,
                                                                   max_window)

    def dtype(self) -> DType | None:
        new = self.f.take("dtype", (str, type(None)), default=None)
        old = self.f.take("torch_dtype", (str, type(None)), default=None)
        key, text = ("dtype", new) if new is not None else ("torch_dtype", old)
        if text is None:
            return None
        try:
            return DType.parse(text.removeprefix("torch."), file=self.file, key=key)
        except ConfigError as e:
            self.errors.append(e)
            return None

    def moe(self, arch: str | None, layers: int | None) -> dict[str, Any]:
        if arch == "gpt_oss":  # every layer MoE; the experts' width is intermediate_size
            experts = self.positive("num_local_experts")
            top_k = self.positive("num_experts_per_tok")
            if _positive(experts) and _positive(top_k) and top_k > experts:
                self.fail("num_experts_per_tok", "more experts per token than experts",
                          f"at most num_local_experts = {experts}", top_k)
            return {"num_experts": experts, "num_experts_per_tok": top_k,
                    "moe_intermediate_size": self.data.get("intermediate_size")}
        if arch != "qwen3_moe":
            return {}
        f = self.f
        # transformers 5 writes num_local_experts; published configs say num_experts.
        key = "num_local_experts" if "num_experts" not in self.data and (
            "num_local_experts" in self.data) else "num_experts"
        experts = self.positive(key)
        top_k = self.positive("num_experts_per_tok")
        moe_inter = self.positive("moe_intermediate_size")
        step = self.positive("decoder_sparse_step", 1, required=False)
        norm = f.take("norm_topk_prob", bool, default=False)
        only = f.take("mlp_only_layers", (list, type(None)), default=None) or []
        if _positive(experts) and _positive(top_k) and top_k > experts:
            self.fail("num_experts_per_tok", "more experts per token than experts",
                      f"at most {key} = {experts}", top_k)
        bad = [i for i in only if not isinstance(i, int) or isinstance(i, bool)
               or (layers is not None and not 0 <= i < layers)]
        if bad:
            self.fail("mlp_only_layers", "layer index out of range",
                      f"integers in [0, {layers})", repr(bad[0]))
        return {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": moe_inter,
            "norm_topk_prob": norm,
            "decoder_sparse_step": step,
            "mlp_only_layers": tuple(sorted({i for i in only if i not in bad})),
        }
