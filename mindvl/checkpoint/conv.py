"""Conv3d <-> Matmul weight conversion for the patch embedding (the paper's Conv->Matmul replacement).

A Conv3d whose kernel equals its stride, applied to a row that holds exactly one (C, T, p, p) patch, is a dot
product with the flattened kernel; flattening the kernel in (C, T, p, p) order matches the patch-row layout of
transformers' Qwen2-VL image processor, so the conversion is a reshape in both directions.
"""

from __future__ import annotations

import torch


def conv3d_to_matmul(weight: torch.Tensor) -> torch.Tensor:
    """[D, C, T, p, p] (Conv3d, no bias) -> [D, C*T*p*p] (Linear weight)."""
    if weight.dim() != 5:
        raise ValueError(f"expected a Conv3d weight [D, C, T, p, p], got shape {tuple(weight.shape)}")
    return weight.reshape(weight.shape[0], -1).contiguous()


def matmul_to_conv3d(weight: torch.Tensor, in_channels: int, temporal_patch: int, patch: int) -> torch.Tensor:
    """[D, C*T*p*p] -> [D, C, T, p, p], the layout transformers' Qwen2.5-VL checkpoints store."""
    expected = in_channels * temporal_patch * patch * patch
    if weight.dim() != 2 or weight.shape[1] != expected:
        raise ValueError(f"expected a matmul weight [D, {expected}], got shape {tuple(weight.shape)}")
    return weight.reshape(weight.shape[0], in_channels, temporal_patch, patch, patch).contiguous()
