"""Dense decoder LLMs: Qwen3 (q/k RMSNorm, no bias, explicit head_dim) and Qwen2 (qkv bias; Qwen2.5-VL's LLM).

Works on ONE packed row: inputs_embeds [T, H] holding several samples separated by cu_seqlens; attention is causal
within a sample and never crosses samples. Positions come from the caller (restarting per sample): [T] for 1-D RoPE
or [3, T] for M-RoPE.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import attend
from .config import TextConfig
from .layers import GatedMLP, RMSNorm, apply_rotary, rope_cos_sin


class TextAttention(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.backend = "auto"

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):  # x [T, H]
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3 normalises per head, before the rotation
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=self.backend)
        return self.o_proj(out.reshape(n, self.num_heads * self.head_dim))


class TextDecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = TextAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.post_attention_layernorm(x))


class TextModel(nn.Module):
    """Embedding, decoder layers, final norm and the output projection (absent when tied to the embedding)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(TextDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def output_weight(self) -> torch.Tensor:
        """[V, H]: the lm_head weight, or the embedding matrix when the two are tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
    ) -> torch.Tensor:
        """inputs_embeds [T, H], position_ids [T] or [3, T] -> final hidden states [T, H] (after the last norm)."""
        cos, sin = rope_cos_sin(position_ids, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.mrope_section)
        cos, sin = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)  # transformers rotates text in x.dtype
        x = inputs_embeds
        for layer in self.layers:
            x = layer(x, cos, sin, cu_seqlens, max_seqlen)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden @ self.output_weight.T
