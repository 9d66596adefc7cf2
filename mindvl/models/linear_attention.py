"""Qwen3.5's linear-attention layer (Gated DeltaNet), on packed rows, with the numerics of transformers 5.23's
Qwen3_5GatedDeltaNet.

    x [T, H] -> in_proj_qkv -> causal conv1d (kernel K, depthwise, SiLU; reset per sample) -> q, k [Hk, dk], v [Hv, dv]
             -> in_proj_a -> g = -exp(A_log) * softplus(a + dt_bias)       (per value head, log decay <= 0)
             -> in_proj_b -> beta = sigmoid(b)
             -> gated delta rule (delta_rule.py; q, k L2-normalised; the state restarts at every sample)
             -> gated RMSNorm per value head: w * norm(o) * silu(z), z = in_proj_z(x)  -> out_proj -> [T, H]

Module and parameter names are transformers' (`linear_attn.in_proj_qkv`, `conv1d.weight` [C, 1, K], `A_log`,
`dt_bias`, `norm.weight`, `out_proj`), so checkpoints convert by renaming alone.

With a cache (HybridCache via LayerKV): a prefill runs the packed prompts like training and stores each prompt's
conv window and final state; a decode step (one token per sequence) advances them by one token, in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextConfig
from .delta_rule import causal_conv1d, causal_conv1d_step, conv_states, gated_delta_rule, gated_delta_step
from .host import offsets_tensor
from .kv_cache import LayerKV


class GatedRMSNorm(nn.Module):
    """y = (w * (x / rms(x)).to(x.dtype) * silu(z in float32)).to(x.dtype) over the last dim; w starts at 1."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


class ShortConv(nn.Module):
    """Holds the depthwise conv weight in transformers' Conv1d shape [C, 1, K] (the key `conv1d.weight`)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        nn.init.normal_(self.weight, std=0.02)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        self.conv1d = ShortConv(self.conv_dim, cfg.linear_conv_kernel_dim)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))  # A = exp(A_log) = 1; checkpoints set it
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, cfg.hidden_size, bias=False)
        if cfg.hidden_act != "silu":
            raise ValueError(f"Gated DeltaNet's conv uses SiLU; hidden_act {cfg.hidden_act!r} is not supported")
        self.chunk_size = 64

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, kv: LayerKV | None = None,
                rows: torch.Tensor | None = None):
        """x [T, H] -> [T, H], or [B, H] for `rows` (computed for all tokens, then taken: the state needs them all).
        cos/sin and max_seqlen are unused (no positions in linear attention); same signature as the attention.
        `cu_seqlens` may be host ints (the training forward's): the delta rule plans its chunks from them on the
        host (no device read); the convolution takes them as a tensor."""
        offsets = cu_seqlens  # host ints, Segments or a tensor, as given: the delta rule's chunk plan
        if cu_seqlens is not None:  # a compile boundary: host offsets never enter a compiled graph
            cu_seqlens = offsets_tensor(cu_seqlens, x.device)
        weight = self.conv1d.weight[:, 0]  # [C, K]
        mixed = self.in_proj_qkv(x)
        cache = kv.cache if kv is not None else None
        decode = cache is not None and not cache.is_prefill
        if decode:  # the states are updated in place (a captured step reads them at fixed addresses)
            conv_state, recurrent_state = kv.states()
            mixed, window = causal_conv1d_step(mixed, weight, conv_state)
            conv_state.copy_(window)
        else:
            if cache is not None:
                cache.update_states(kv.layer, conv_states(mixed, cu_seqlens, weight.shape[1] - 1))
            mixed = causal_conv1d(mixed, weight, cu_seqlens)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.unflatten(-1, (-1, self.head_k_dim)), k.unflatten(-1, (-1, self.head_k_dim))
        v = v.unflatten(-1, (-1, self.head_v_dim))
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if decode:
            o, state = gated_delta_step(q, k, v, g, beta, recurrent_state)
            recurrent_state.copy_(state)
        else:
            o, state = gated_delta_rule(q, k, v, g, beta, offsets, chunk_size=self.chunk_size)
            if cache is not None:
                cache.update_states(kv.layer, None, state)
        z = self.in_proj_z(x).unflatten(-1, (-1, self.head_v_dim))
        out = self.out_proj(self.norm(o, z).flatten(1))
        return out if rows is None else out[rows]
