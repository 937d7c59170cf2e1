"""The transformers oracle: tiny random Hugging Face checkpoints and their reference outputs.

``make_hf_checkpoint`` builds a random model of one architecture from the tiny built-in config
(:data:`metrale.plan.models.TINY_BY_ARCH`) and saves it as transformers does (safetensors +
config.json); ``hf_reference`` runs that checkpoint in float32 on the CPU: a prefill over the
prompt, then greedy decode steps through the KV cache. Both are deterministic.

Weights are drawn with std ``hidden_size ** -0.5`` (not transformers' 0.02) so projections
keep unit variance: attention scores, router logits and output logits are O(1), and an error
in RoPE, masking or routing shows in the logits instead of vanishing in a uniform softmax.
Norm weights are ``1 + 0.1 * N(0, 1)``, so a kernel that ignores them is caught too; attention
sinks (gpt-oss) are ``N(0, 1)``, logits on the scale of the attention scores.

torch and transformers are imported on first use, so importing this module is cheap.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from metrale.lkb.errors import ConfigError, nearest
from metrale.plan.config import ARCHS
from metrale.plan.models import TINY_BY_ARCH, builtin_config

HF_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig",
                     "gpt_oss": "GptOssConfig"}
"""Architecture → the transformers config class that builds it."""

NORM_JITTER = 0.1
"""Std of the random deviation of norm weights from 1."""


class HfReference(NamedTuple):
    """What transformers computes for a prompt: prefill logits, greedy tokens, decode logits.

    ``greedy_tokens[0]`` is the argmax of ``prefill_logits[-1]``; decode step ``i`` feeds
    ``greedy_tokens[i]`` at position ``T + i`` and yields ``step_logits[i]``, whose argmax is
    ``greedy_tokens[i + 1]``. So there are ``steps + 1`` greedy tokens.
    """

    prefill_logits: np.ndarray  # float32 [T, vocab]
    greedy_tokens: list[int]  # steps + 1 tokens
    step_logits: np.ndarray  # float32 [steps, vocab]

    def margins(self) -> np.ndarray:
        """Top-1 minus top-2 logit of each greedy choice: how decisive the oracle's argmax is."""
        rows = np.concatenate([self.prefill_logits[-1:], self.step_logits])
        top2 = np.sort(rows, axis=-1)[:, -2:]
        return top2[:, 1] - top2[:, 0]


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ConfigError("unknown architecture", key="arch", expected="one of " + ", ".join(ARCHS),
                          found=repr(arch), suggestion=nearest(arch, ARCHS))


def hf_config_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    """The tiny built-in ``config.json`` of ``arch`` with ``overrides`` (config.json keys)."""
    _check_arch(arch)
    data = builtin_config(TINY_BY_ARCH[arch])
    data.update(overrides)
    return data


def make_hf_checkpoint(arch: str, dst_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16",
                       init_std: float | None = None, **overrides: Any) -> Path:
    """Save a random tiny ``arch`` model (``llama``, ``qwen3``, ``qwen3_moe``) to ``dst_dir``.

    ``overrides`` are config.json keys applied over the tiny config (e.g.
    ``num_hidden_layers=3``, ``tie_word_embeddings=True``); ``dtype`` is the stored weight
    dtype (``bfloat16``, ``float16``, ``float32``); weights are initialised in float32 from a
    generator seeded with ``seed`` and rounded once to ``dtype``. Returns the directory.
    """
    import torch
    import transformers

    data = hf_config_dict(arch, **overrides)
    data["torch_dtype"] = dtype
    config = getattr(transformers, HF_CONFIG_CLASSES[arch])(**data)
    std = config.hidden_size ** -0.5 if init_std is None else init_std
    try:
        torch_dtype = getattr(torch, dtype)
    except AttributeError:
        raise ConfigError("unknown torch dtype", key="dtype", found=repr(dtype),
                          expected="bfloat16, float16 or float32") from None
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters lists a tied lm_head/embedding once and in a fixed order, so the
        # same seed gives the same weights.
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + NORM_JITTER * noise)
            elif name.endswith("sinks"):  # logits on the scale of the scores: they matter
                param.copy_(noise)
            else:
                param.copy_(std * noise)
    model = model.to(torch_dtype)
    dst = Path(dst_dir)
    dst.mkdir(parents=True, exist_ok=True)
    # transformers 5 always writes safetensors; 4.x takes the flag (default true there too).
    kwargs = {}
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    model.save_pretrained(dst, **kwargs)
    return dst


def load_hf_model(ckpt_dir: str | Path) -> Any:
    """The checkpoint as a float32 transformers model on the CPU, in eval mode."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(Path(ckpt_dir), dtype=torch.float32)
    return model.eval()


def hf_reference(ckpt_dir: str | Path, token_ids: Sequence[int], steps: int) -> HfReference:
    """Run the checkpoint in float32 on the CPU: prefill ``token_ids``, then ``steps`` greedy steps.

    Decode steps go through transformers' KV cache one token at a time, as an engine runs them.
    """
    import torch

    if not token_ids:
        raise ConfigError("empty prompt", key="token_ids", expected="at least one token", found=0)
    model = load_hf_model(ckpt_dir)
    forward = inspect.signature(model.forward).parameters
    # transformers 5 renamed past_key_values to cache, in the arguments and in the outputs
    cache_kw = "cache" if "cache" in forward else "past_key_values"
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        prefill = out.logits[0].float().numpy().copy()
        cache = getattr(out, cache_kw)
        tokens = [int(prefill[-1].argmax())]
        step_logits = []
        for _ in range(steps):
            out = model(torch.tensor([[tokens[-1]]]), use_cache=True, **{cache_kw: cache})
            cache = getattr(out, cache_kw)
            row = out.logits[0, -1].float().numpy().copy()
            step_logits.append(row)
            tokens.append(int(row.argmax()))
    vocab = prefill.shape[-1]
    steps_arr = np.stack(step_logits) if step_logits else np.zeros((0, vocab), np.float32)
    return HfReference(prefill, tokens, steps_arr.astype(np.float32))
