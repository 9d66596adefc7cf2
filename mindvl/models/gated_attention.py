"""Qwen3.5's full-attention layer: GQA with an output gate, zero-centred q/k norms and partial rotary.

What differs from Qwen3's GQAttention (text.py), following transformers 5.23's Qwen3_5Attention:
- `q_proj` is twice as wide: per head, [query | gate] (head_dim each); the attention output is multiplied by
  sigmoid(gate) before `o_proj`;
- q_norm / k_norm are OffsetRMSNorm (weight stored as the offset from 1, multiplied in float32);
- RoPE (interleaved M-RoPE for the multimodal model) rotates only the first `rotary_dim` = head_dim *
  partial_rotary_factor channels of each head; the rest pass through.

Same interface as GQAttention (x [T, H] packed row, varlen causal attention per sample, optional KV cache and
`rows`); its cache class is the hybrid one, since the model's other layers are linear attention.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import attend
from .config import TextConfig
from .hybrid_cache import HybridCache
from .kv_cache import LayerKV, store
from .layers import OffsetRMSNorm, apply_rotary, rope_cos_sin, split_linear


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [T, heads, d]; keep the rest."""
    rd = cos.shape[-1]
    if rd == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)


class GatedAttention(nn.Module):
    @staticmethod
    def rotary(position_ids: torch.Tensor, cfg: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(position_ids, cfg.rotary_dim, cfg.rope_theta, cfg.mrope_section, cfg.mrope_interleaved)

    cache_class = HybridCache
    attend = staticmethod(attend)
    fused_qkv: tuple | None = None  # as GQAttention's (layers.split_linear)

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, heads * self.head_dim * 2, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.backend = "auto"

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H]; with `rows` [B] (prefill) -> [B, H] (see GQAttention)."""
        # A decode step's K/V slots, asked for first (a compile boundary: a compiled layer's graph resumes after it,
        # so the writes below fuse with the rotation; kv_cache.LayerKV).
        target = kv.decode_target() if kv is not None and rows is None else None
        xq, cos_q, sin_q = (x, cos, sin) if rows is None else (x[rows], cos[rows], sin[rows])
        if self.fused_qkv is not None and kv is not None and rows is None:
            qg, k, v = split_linear(x, self.fused_qkv)
        else:
            qg, k, v = self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        q, gate = qg.unflatten(-1, (-1, 2 * self.head_dim)).chunk(2, dim=-1)
        k, v = k.unflatten(-1, (-1, self.head_dim)), v.unflatten(-1, (-1, self.head_dim))
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rotary(q, cos_q, sin_q), apply_partial_rotary(k, cos, sin)
        if kv is None:
            out = self.attend(q, k, v, cu_seqlens, max_seqlen, causal=True, backend=self.backend)
        else:
            if target is not None:
                store(target, k, v)
            out = kv.attend(q, k, v, cu_seqlens, max_seqlen, self.backend, last_only=rows is not None,
                            stored=target is not None)
        return self.o_proj((out * torch.sigmoid(gate)).flatten(1))
