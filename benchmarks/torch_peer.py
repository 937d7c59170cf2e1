"""A plain PyTorch decode step for the dense built-in models (Llama, Qwen3), for torch.compile.

The peer that ``torch.compile(mode="reduce-overhead")`` compiles where transformers' own
compiled decode cannot run (with torch 2.11 / transformers 5.17 on an H200 every variant hit
a device-side assert inside an inductor kernel). Same math as the
transformers modeling code — RMSNorm in f32 then cast back, RoPE on the two halves with the
model's (scaled) inverse frequencies, grouped-query attention over a static cache, SwiGLU —
without transformers' cache and mask objects, and with static shapes so that one CUDA graph
holds the whole step: attention reads the whole cache under a mask of the positions <= pos, so
it moves ``max_ctx / (pos + 1)`` times the cache bytes a causal kernel would (1.06x at the
benchmark's 1088 / 1025).

Weights are taken, by transformers' names, from a state dict (a transformers model's own):

>>> import torch
>>> c = ModelConfig.load("tiny-llama")
>>> state = random_state(c, torch.float32, seed=0)
>>> m = TorchDecode(c, state, batch=2, max_ctx=16)
>>> m(torch.tensor([1, 2]), torch.tensor(0)).shape == (2, c.vocab_size)
True
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from metrale.plan.config import ModelConfig
from metrale.plan.rope import rope_inv_freq


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: in f32, then cast back, then times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchDecode(torch.nn.Module):
    """One decode step of ``batch`` rows, every row at the same position ``pos``.

    ``forward(tokens [batch], pos 0-d)`` appends each row's k, v at ``pos`` in the static cache
    (``[layers, batch, max_ctx, kv_heads, head_dim]``) and returns f32 logits ``[batch, vocab]``.
    """

    def __init__(self, config: ModelConfig, state: dict[str, torch.Tensor], *, batch: int,
                 max_ctx: int) -> None:
        super().__init__()
        if config.arch not in ("llama", "qwen3"):
            raise ValueError(f"{config.name}: the torch peer covers dense llama and qwen3 "
                             f"models, not {config.arch}")
        self.c = config
        w = state["model.embed_tokens.weight"]
        self.dtype, device = w.dtype, w.device
        # buffers, not plain attributes: torch.compile then treats them as static (a CUDA
        # graph reads them in place instead of copying them in at every replay)
        self._names = {name: name.replace(".", "__") for name in state}
        for name, t in state.items():
            self.register_buffer(self._names[name], t, persistent=False)
        if "lm_head.weight" not in state:  # tied to the embedding
            self._names["lm_head.weight"] = self._names["model.embed_tokens.weight"]
        self.qk_norm = config.arch == "qwen3"
        shape = (config.num_hidden_layers, batch, max_ctx, config.num_key_value_heads,
                 config.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=self.dtype, device=device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=self.dtype, device=device))
        self.register_buffer("inv_freq", torch.tensor(rope_inv_freq(config), device=device))
        self.register_buffer("positions", torch.arange(max_ctx, device=device))

    def weight(self, name: str) -> torch.Tensor:
        """The weight transformers calls ``name``."""
        return getattr(self, self._names[name])

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        c, s = self.c, self.weight
        b, hq, hkv, d = tokens.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        x = s("model.embed_tokens.weight")[tokens]
        freqs = pos.float() * self.inv_freq
        emb = torch.cat((freqs, freqs))
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        visible = self.positions <= pos  # [max_ctx]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = _rms(x, s(p + "input_layernorm.weight"), c.rms_norm_eps)
            q = F.linear(h, s(p + "self_attn.q_proj.weight")).view(b, hq, d)
            k = F.linear(h, s(p + "self_attn.k_proj.weight")).view(b, hkv, d)
            v = F.linear(h, s(p + "self_attn.v_proj.weight")).view(b, hkv, d)
            if self.qk_norm:
                q = _rms(q, s(p + "self_attn.q_norm.weight"), c.rms_norm_eps)
                k = _rms(k, s(p + "self_attn.k_norm.weight"), c.rms_norm_eps)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.k_cache[i].index_copy_(1, pos.view(1), k.unsqueeze(1))
            self.v_cache[i].index_copy_(1, pos.view(1), v.unsqueeze(1))
            qg = q.view(b, hkv, hq // hkv, d)
            scores = torch.einsum("bhgd,bthd->bhgt", qg, self.k_cache[i]) * d ** -0.5
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(self.dtype)
            o = torch.einsum("bhgt,bthd->bhgd", probs, self.v_cache[i]).reshape(b, hq * d)
            x = x + F.linear(o, s(p + "self_attn.o_proj.weight"))
            h = _rms(x, s(p + "post_attention_layernorm.weight"), c.rms_norm_eps)
            gate = F.linear(h, s(p + "mlp.gate_proj.weight"))
            up = F.linear(h, s(p + "mlp.up_proj.weight"))
            x = x + F.linear(F.silu(gate) * up, s(p + "mlp.down_proj.weight"))
        x = _rms(x, s("model.norm.weight"), c.rms_norm_eps)
        return F.linear(x, s("lm_head.weight")).float()


def random_state(config: ModelConfig, dtype: Any, *, seed: int = 0,
                 device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights by transformers' names: projections N(0, 1/hidden), norms 1 + 0.1 N."""
    g = torch.Generator(device=device).manual_seed(seed)
    c = config
    hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim

    def mat(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=g, device=device) * c.hidden_size ** -0.5).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return (1 + 0.1 * torch.randn(n, generator=g, device=device)).to(dtype)

    out = {"model.embed_tokens.weight": mat(c.vocab_size, c.hidden_size),
           "model.norm.weight": norm(c.hidden_size)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = mat(c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": norm(c.hidden_size),
            p + "post_attention_layernorm.weight": norm(c.hidden_size),
            p + "self_attn.q_proj.weight": mat(hq * d, c.hidden_size),
            p + "self_attn.k_proj.weight": mat(hkv * d, c.hidden_size),
            p + "self_attn.v_proj.weight": mat(hkv * d, c.hidden_size),
            p + "self_attn.o_proj.weight": mat(c.hidden_size, hq * d),
            p + "mlp.gate_proj.weight": mat(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": mat(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": mat(c.hidden_size, c.intermediate_size),
        })
        if c.arch == "qwen3":
            out[p + "self_attn.q_norm.weight"] = norm(d)
            out[p + "self_attn.k_norm.weight"] = norm(d)
    return out
