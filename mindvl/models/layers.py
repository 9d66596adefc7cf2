"""Building blocks shared by the vision tower and the language models: RMSNorm, the gated MLP and rotary helpers.

Numerics follow transformers' Qwen2.5-VL / Qwen3 implementations exactly (see shared/reference/model-numerics.md):
RMSNorm normalises in float32 and casts back to the input dtype *before* multiplying by the weight, and the rotary
frequencies are always computed in float32.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def autocast_off(device_type: str):
    """A context with autocast disabled for `device_type` (ops inside run in their inputs' dtypes); nothing to do on
    devices without autocast (meta, where the planner and the device-read tests trace, has none)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts to on `device_type` when it is on there, else None (also on devices without
    autocast)."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def activation(name: str):
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unsupported activation {name!r}; choose one of {sorted(_ACTIVATIONS)}") from None


class RMSNorm(nn.Module):
    """y = w * (x / rms(x)).to(x.dtype); x [..., dim]."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: y = (x / rms(x) * (1 + w)).to(x.dtype), all in float32; w starts at 0.

    Unlike RMSNorm, the weight multiplies before the cast back (transformers' Qwen3_5RMSNorm), and it is stored as
    the offset from 1, as in the checkpoints.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def split_linear(x: torch.Tensor, fused: tuple) -> tuple[torch.Tensor, ...]:
    """Several projections of one input as one matmul: x [..., in] -> one [..., width] per projection.

    `fused` = (weight [sum(widths), in], bias [sum(widths)] or None, widths): views of the projections' own
    parameters, laid out one after another (mindvl.infer.fused_projections attaches them for a generation: one
    kernel instead of two or three in a decode step, the same values)."""
    weight, bias, widths = fused
    return F.linear(x, weight, bias).split(widths, dim=-1)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): the SwiGLU MLP of Qwen's LLMs (no bias) and vision blocks (bias).

    `fused_gate_up` (None unless mindvl.infer.fused_projections attached it, for a generation): gate and up as one
    matmul, see `split_linear`."""

    fused_gate_up: tuple | None = None

    def __init__(self, dim: int, hidden: int, bias: bool, act: str = "silu") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None:
            gate, up = split_linear(x, self.fused_gate_up)
            return self.down_proj(self.act(gate) * up)
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


# ----------------------------------------------------------------------------------------------------------- rotary


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """1 / theta^(2i/dim) for i < dim/2, float32 [dim/2]. Computed on the fly (no buffer) so meta-device init works."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d]; cos/sin [T, d] broadcast over heads. Computed in cos.dtype, returned in x.dtype.

    The vision tower passes float32 tables (transformers rotates vision q/k in fp32); the LLMs pass tables already
    cast to the activation dtype, as transformers does for text.
    """
    xc = x.to(cos.dtype)
    out = xc * cos[:, None, :] + rotate_half(xc) * sin[:, None, :]
    return out.to(x.dtype)


def rope_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, mrope_section: list[int] | None = None,
    interleaved: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables for text tokens: position_ids [T] (1-D RoPE) or [3, T] (M-RoPE) -> cos, sin float32 [T, head_dim].

    M-RoPE: frequency slot j of the first half uses the temporal, height or width index depending on which
    `mrope_section` chunk it falls in; the second half of head_dim repeats the pattern (transformers' layout).
    Interleaved M-RoPE (Qwen3-VL): slot j uses the height index when j % 3 == 1 and j < 3 * sections[1], the width
    index when j % 3 == 2 and j < 3 * sections[2], else the temporal index, so every axis spans low and high
    frequencies.
    """
    inv_freq = inverse_frequencies(head_dim, theta, position_ids.device)  # [hd/2]
    if position_ids.dim() == 1:
        freqs = position_ids.float()[:, None] * inv_freq[None, :]  # [T, hd/2]
    else:
        if mrope_section is None:
            # A 1-D RoPE model given 3-D positions (text rows are equal): use the temporal row.
            freqs = position_ids[0].float()[:, None] * inv_freq[None, :]
        else:
            if sum(mrope_section) != head_dim // 2:
                raise ValueError(f"mrope_section {mrope_section} must sum to head_dim/2 = {head_dim // 2}")
            per_axis = position_ids.float()[:, :, None] * inv_freq[None, None, :]  # [3, T, hd/2]
            if interleaved:
                slot = torch.arange(head_dim // 2, device=position_ids.device)
                # torch.where, not masked assignment: boolean indexing is a device read (nonzero) per call
                axis = torch.where((slot % 3 == 1) & (slot < 3 * mrope_section[1]), 1,
                                   torch.where((slot % 3 == 2) & (slot < 3 * mrope_section[2]), 2, 0))
                freqs = per_axis.gather(0, axis[None, None, :].expand(1, per_axis.shape[1], -1))[0]
                emb = torch.cat((freqs, freqs), dim=-1)
                return emb.cos(), emb.sin()
            chunks = per_axis.split(list(mrope_section), dim=-1)
            freqs = torch.cat([chunk[i % 3] for i, chunk in enumerate(chunks)], dim=-1)  # [T, hd/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
