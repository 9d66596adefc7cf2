"""The MLP projector: fuses each 2x2 block of vision patches and maps it to the LLM width.

Layout of Qwen2.5-VL's merger (so a converted Qwen2.5-VL keeps its own): RMSNorm over the vision width, then the
4 rows of a merge block are concatenated, then Linear(4D, 4D) -> GELU (exact erf) -> Linear(4D, out).
For a MindVL composition this module is freshly initialised from a seed, as the paper does.

Input: [P, D] vision hidden states (4 consecutive rows = one merge block). Output: [P/4, out].
"""

from __future__ import annotations

import torch
from torch import nn

from .layers import RMSNorm


class Projector(nn.Module):
    def __init__(self, vision_hidden: int, out_hidden: int, merge_unit: int = 4, eps: float = 1e-6) -> None:
        super().__init__()
        self.merge_unit = merge_unit
        inner = vision_hidden * merge_unit
        self.norm = RMSNorm(vision_hidden, eps)
        self.fc1 = nn.Linear(inner, inner)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inner, out_hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x).view(x.shape[0] // self.merge_unit, self.fc1.in_features)
        return self.fc2(self.act(self.fc1(x)))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Seeded random init (normal weights, zero biases, unit norm), independent of the global RNG."""
        self.norm.weight.fill_(1.0)
        for linear in (self.fc1, self.fc2):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
            linear.bias.zero_()
