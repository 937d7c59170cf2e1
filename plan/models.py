"""Built-in model configs: published shapes as ``config.json`` dicts, plus three tiny test models.

Each entry is exactly what the model's Hugging Face ``config.json`` holds (fields that matter
for planning; token ids and initializer range are kept where published, for fidelity), so a
built-in name and a downloaded checkpoint load through the same reader.

>>> "llama-3.1-8b" in builtin_names() and "tiny-qwen3-moe" in builtin_names()
True
>>> builtin_config("qwen3-0.6b")["hidden_size"]
1024
>>> try:
...     builtin_config("qwen3-0.6")
... except ConfigError as e:
...     print(e.message, "/", e.suggestion)
unknown built-in model / qwen3-0.6b
"""

from __future__ import annotations

import copy
from typing import Any

from metrale.lkb.errors import ConfigError, nearest

_LLAMA3_ROPE_8 = {
    "factor": 8.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
    "rope_type": "llama3",
}

_LLAMA_COMMON: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 128256,
}

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_0_6B: dict[str, Any] = {
    **_QWEN3_COMMON,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}

QWEN3_8B: dict[str, Any] = {
    **_QWEN3_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 36,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}

LLAMA_3_2_1B: dict[str, Any] = {
    **_LLAMA_COMMON,
    "head_dim": 64,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "rope_scaling": {**_LLAMA3_ROPE_8, "factor": 32.0},
    "tie_word_embeddings": True,
}

# Llama 3.1's published configs carry no head_dim: it is hidden_size / num_attention_heads.
LLAMA_3_1_8B: dict[str, Any] = {
    **_LLAMA_COMMON,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rope_scaling": dict(_LLAMA3_ROPE_8),
    "tie_word_embeddings": False,
}

LLAMA_3_1_70B: dict[str, Any] = {
    **_LLAMA_COMMON,
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_hidden_layers": 80,
    "num_key_value_heads": 8,
    "rope_scaling": dict(_LLAMA3_ROPE_8),
    "tie_word_embeddings": False,
}

QWEN3_30B_A3B: dict[str, Any] = {
    **_QWEN3_COMMON,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
}

# gpt-oss: every layer MoE (router with a bias, softmax over the chosen experts' logits, a
# clamped SwiGLU with biases), attention with per-head sinks and biased projections,
# layer_types alternating a 128-position sliding window with full attention, YaRN RoPE.
_GPT_OSS_COMMON: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "max_position_embeddings": 131072,
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_key_value_heads": 8,
    "pad_token_id": 199999,
    # as published: the experts in mxfp4, attention, routers, embedding and head kept bf16
    "quantization_config": {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": 201088,
}


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


GPT_OSS_20B: dict[str, Any] = {
    **_GPT_OSS_COMMON,
    "layer_types": _alternating(24),
    "num_hidden_layers": 24,
    "num_local_experts": 32,
}

GPT_OSS_120B: dict[str, Any] = {
    **_GPT_OSS_COMMON,
    "layer_types": _alternating(36),
    "num_hidden_layers": 36,
    "num_local_experts": 128,
}

# The tiny models are what the oracle tests build random checkpoints of: every structural
# feature of the big ones (GQA, explicit head_dim, qk-norm for qwen, llama3 rope scaling,
# top-k routing) at sizes that run in milliseconds on a CPU.
_TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **_TINY_SHAPE,
    "attention_bias": False,
    "hidden_act": "silu",
    "mlp_bias": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    # original_max_position_embeddings is set small so all three llama3 bands (kept,
    # interpolated, divided) occur among a head_dim of 16's eight frequencies.
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
}

TINY_QWEN3: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    **_TINY_SHAPE,
    "attention_bias": False,
    "hidden_act": "silu",
    "max_window_layers": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
}

TINY_QWEN3_MOE: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    **_TINY_SHAPE,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "hidden_act": "silu",
    "max_window_layers": 2,
    "mlp_only_layers": [],
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "use_sliding_window": False,
}

# Layer 0 slides over 8 positions, layer 1 attends to all: a prompt of a few dozen tokens
# exercises both, the sinks, the biases, yarn's three bands (original 32 positions) and a clamp
# that binds (the tests draw weights large enough for |gate| > 7 to occur).
TINY_GPT_OSS: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    **_TINY_SHAPE,
    "intermediate_size": 32,
    "max_position_embeddings": 1024,  # = factor x original, as transformers expects of yarn
    "attention_bias": True,
    "hidden_act": "silu",
    "layer_types": ["sliding_attention", "full_attention"],
    "num_experts_per_tok": 2,
    "num_local_experts": 6,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 32,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000.0,
    "sliding_window": 8,
    "swiglu_limit": 7.0,
}

BUILTIN: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": QWEN3_0_6B,
    "qwen3-8b": QWEN3_8B,
    "llama-3.2-1b": LLAMA_3_2_1B,
    "llama-3.1-8b": LLAMA_3_1_8B,
    "llama-3.1-70b": LLAMA_3_1_70B,
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "gpt-oss-20b": GPT_OSS_20B,
    "gpt-oss-120b": GPT_OSS_120B,
    "tiny-llama": TINY_LLAMA,
    "tiny-qwen3": TINY_QWEN3,
    "tiny-qwen3-moe": TINY_QWEN3_MOE,
    "tiny-gpt-oss": TINY_GPT_OSS,
}
"""Built-in name → its ``config.json`` dict. Read through :func:`builtin_config` (a copy)."""

TINY_BY_ARCH: dict[str, str] = {
    "llama": "tiny-llama",
    "qwen3": "tiny-qwen3",
    "qwen3_moe": "tiny-qwen3-moe",
    "gpt_oss": "tiny-gpt-oss",
}
"""The tiny built-in of each architecture (what the oracle checkpoints are built from)."""


def builtin_names() -> tuple[str, ...]:
    """The built-in model names, sorted.

    >>> builtin_names()[:3]
    ('gpt-oss-120b', 'gpt-oss-20b', 'llama-3.1-70b')
    """
    return tuple(sorted(BUILTIN))


def builtin_config(name: str) -> dict[str, Any]:
    """A fresh deep copy of the ``config.json`` dict of built-in ``name``.

    >>> builtin_config("tiny-llama")["num_hidden_layers"]
    2
    """
    try:
        return copy.deepcopy(BUILTIN[name])
    except KeyError:
        raise ConfigError(
            "unknown built-in model",
            file=name,
            expected="one of " + ", ".join(builtin_names()),
            found=repr(name),
            suggestion=nearest(name, BUILTIN),
        ) from None
