"""Multi-head Latent Attention (DeepSeek-V2/V3), one of the attentions the decoder (text.py) is built from.

Numerics follow transformers' DeepseekV3ForCausalLM (5.23; shared/reference/model-numerics.md §4): q = q_b(rms(q_a(x)))
(or a plain q_proj when q_lora_rank is None); one latent kv_a(x) = [c_kv | k_rot] per token, k/v = kv_b(rms(c_kv))
per head, and ONE rotary key k_rot shared by all heads. The rotary part uses the interleaved pair layout of the
checkpoints when `rope_interleave` (transformers' even/odd formula). The softmax scale is (nope + rope)^-0.5, times
mscale(factor, mscale_all_dim)^2 under yarn rope scaling; the yarn rotary frequencies and their cos/sin attention
factor are transformers' `_compute_yarn_parameters`. The two latent norms use eps 1e-6 whatever `rms_norm_eps` says
(transformers' default).

Generation: with a `LayerKV` of an MLACache (mla_cache.py) the layer caches latents and rope keys, not per-head K/V.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .attention import attend
from .config import TextConfig
from .kv_cache import LayerKV
from .layers import RMSNorm, inverse_frequencies, rotate_half
from .mla_cache import MLACache

# transformers' DeepseekV3RMSNorm default, used for q_a_layernorm / kv_a_layernorm regardless of rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


# ------------------------------------------------------------------------------------------------------- rotary


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inverse_frequencies(cfg: TextConfig, device: torch.device | None = None) -> tuple[torch.Tensor, float]:
    """transformers' `_compute_yarn_parameters` over the rotary width: (inv_freq float32 [rope/2], cos/sin factor)."""
    rs, dim, base = cfg.rope_scaling, cfg.qk_rope_head_dim, cfg.rope_theta
    factor = rs.get("factor") or cfg.max_position_embeddings / rs["original_max_position_embeddings"]
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
    orig = rs["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def mla_rope_cos_sin(position_ids: torch.Tensor, cfg: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids [T] or [3, T] -> cos, sin float32 [T, qk_rope_head_dim] (cat(freqs, freqs), times yarn's factor).

    With `mrope_section`, frequency slot j takes the temporal/height/width position of its section (Qwen2.5-VL's
    M-RoPE, as in layers.rope_cos_sin); without it, [3, T] positions use the temporal row.
    """
    dim = cfg.qk_rope_head_dim
    if cfg.rope_scaling is None:
        inv_freq, factor = inverse_frequencies(dim, cfg.rope_theta, position_ids.device), 1.0
    else:
        inv_freq, factor = yarn_inverse_frequencies(cfg, position_ids.device)
    if position_ids.dim() == 2 and cfg.mrope_section is not None:
        per_axis = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, rope/2]
        chunks = per_axis.split(list(cfg.mrope_section), dim=-1)
        freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)
    else:
        pos = position_ids[0] if position_ids.dim() == 2 else position_ids
        freqs = pos.float()[:, None] * inv_freq[None, :]  # [T, rope/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * factor, emb.sin() * factor


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] with rotary pairs stored interleaved (x0,x1),(x2,x3)...; cos/sin [T, d] = cat(f, f).

    Output is in the de-interleaved [evens | odds] order, exactly as transformers' apply_rotary_pos_emb_interleave
    (both q and k are permuted the same way, so q.k is unchanged).
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_rotary_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d] already in x's dtype (transformers rotates text in the activation dtype)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


# ------------------------------------------------------------------------------------------------------- MLA


class MLAttention(nn.Module):
    """Multi-head Latent Attention on a packed row: x [T, H] -> [T, H] (or [B, H] for the given `rows`).

    The decoder's attention interface (text.py): `rotary(position_ids, cfg)` builds the rotary tables once per
    forward, `cache_class` the cache this attention writes to, and `forward` takes the tables, the packed layout, an
    optional `LayerKV` and optional `rows`.
    """

    @staticmethod
    def rotary(position_ids: torch.Tensor, cfg: TextConfig) -> tuple[torch.Tensor, torch.Tensor]:
        return mla_rope_cos_sin(position_ids, cfg)

    cache_class = MLACache  # latents + rope keys, not per-head K/V
    attend = staticmethod(attend)  # the varlen core; replaceable per instance from outside (see text.GQAttention)

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        h, nh, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        self.num_heads = nh
        self.nope, self.rope, self.v_dim, self.kv_rank = (
            cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank)
        qk = self.nope + self.rope
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, nh * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(nh * self.v_dim, h, bias=bias)
        self.interleaved = bool(cfg.rope_interleave)
        self.scale = qk**-0.5
        rs = cfg.rope_scaling
        if rs is not None and rs.get("mscale_all_dim"):  # yarn's softmax temperature (~1.874 for V3)
            self.scale *= _yarn_mscale(rs["factor"], rs["mscale_all_dim"]) ** 2
        self.backend = "auto"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens: torch.Tensor | None,
                max_seqlen: int, kv: LayerKV | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows` [B] (a prefill's last tokens): every token is still attended (MLA's prefill expands the cached
        latents through the training path's varlen attention; a last-query-only path would be the absorbed decode
        attention, whose numerics differ), and only the output projection and what follows run on B rows."""
        n = x.shape[0]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(n, self.num_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(kv_latent)  # [T, r]: what an MLA cache stores
        rotate = apply_rotary_interleaved if self.interleaved else apply_rotary_half
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[:, None, :], cos, sin)  # k_rot: one head, shared
        if kv is not None:
            out = kv.attend_latent(self.kv_b_proj.weight, q_pass, q_rot, latent, k_rot[:, 0], self.v_dim,
                                   self.scale, cu_seqlens, max_seqlen, self.backend)
        else:
            kv_full = self.kv_b_proj(latent).view(n, self.num_heads, self.nope + self.v_dim)
            k_pass, v = kv_full.split([self.nope, self.v_dim], dim=-1)
            q = torch.cat([q_pass, q_rot], dim=-1)  # [T, nh, nope + rope]
            k = torch.cat([k_pass, k_rot.expand(n, self.num_heads, self.rope)], dim=-1)
            out = self.attend(q, k, v, cu_seqlens, max_seqlen, causal=True, scale=self.scale, backend=self.backend)
        if rows is not None:
            out = out[rows]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_dim))  # out [T or B, nh, v_dim]

