"""Qwen3-VL's native-resolution vision tower and its mergers (the numerics of transformers 5.23's Qwen3VLVisionModel).

What differs from Qwen2.5-VL's tower (vision.py):
- 16-px patches; the patch embedding has a bias (a Conv3d with bias, computed here as one matmul);
- a learned square table of position embeddings (`num_position_embeddings` = side^2) is resampled to each image's
  (h, w) patch grid by bilinear interpolation with aligned corners and added to the patch embeddings, on top of the
  same 2-D RoPE inside attention;
- LayerNorm blocks (eps 1e-6, with bias) and a plain two-layer MLP (`linear_fc1 -> gelu_tanh -> linear_fc2`);
- no window attention: every block attends within each frame;
- DeepStack: the states after the blocks listed in `deepstack_visual_indexes` are returned too; each goes through
  its own merger (LayerNorm over the fused 2x2 block, then the MLP) and is added to the LLM's hidden states at the
  visual positions after the first decoder layers (mllm.py / text.py).

Inputs: pixel_values [P, C*2*16*16] in the merge-block row order of the Qwen2-VL/Qwen3-VL processors (4 consecutive
rows = one 2x2 block), grid_thw [N, 3]. Output: (hidden [P, D] before any merger, [hidden after each DeepStack block]).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig
from .host import host_grids
from .layers import activation
from .vision import VisionAttention, VisionLayout, VisionTransformer


class BiasedPatchEmbed(nn.Module):
    """Conv3d(kernel = stride = (2, 16, 16), bias=True) as a matmul: weight [D, C*T*p*p], bias [D]."""

    def __init__(self, patch_dim: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, patch_dim))
        self.bias = nn.Parameter(torch.zeros(hidden))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight, self.bias)


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden, bias=True)
        self.linear_fc2 = nn.Linear(hidden, dim, bias=True)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = Qwen3VisionMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


def interpolated_positions(table: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]],
                           merge: int) -> torch.Tensor:
    """The learned [side*side, D] table resampled to every image's grid: [P, D] in the patch rows' order.

    Bilinear with aligned corners (the table's first and last rows/columns land on the grid's first and last
    patches), separable: rows first, then columns. Each frame of a video gets the same embeddings. The source
    coordinate is computed as transformers does (index * (side - 1) / (size - 1) in float32), so the taps and
    weights are the same numbers.
    """
    side = int(round(table.shape[0] ** 0.5))
    grid = table.view(side, side, -1)
    out = []
    for t, h, w in host_grids(grid_thw):
        rows = _lerp(grid, h, side, dim=0)  # [h, side, D]
        full = _lerp(rows, w, side, dim=1)  # [h, w, D]
        lh, lw = h // merge, w // merge
        blocks = full.view(lh, merge, lw, merge, -1).permute(0, 2, 1, 3, 4).reshape(h * w, -1)  # merge-block order
        out.append(blocks.repeat(t, 1))
    if not out:
        return table.new_zeros(0, table.shape[1])
    return torch.cat(out)


def _lerp(values: torch.Tensor, size: int, side: int, dim: int) -> torch.Tensor:
    """Resample `values` along `dim` (length side) to `size` points, corners aligned."""
    index = torch.arange(size, dtype=torch.float32, device=values.device)
    src = index * (side - 1) / max(size - 1, 1)
    low = src.floor()
    frac = (src - low).to(values.dtype)
    lo = low.long().clamp(0, side - 1)
    hi = (lo + 1).clamp(max=side - 1)
    shape = [1] * values.dim()
    shape[dim] = size
    frac = frac.view(shape)
    return values.index_select(dim, lo) * (1 - frac) + values.index_select(dim, hi) * frac


class Qwen3VisionTransformer(nn.Module):
    """Qwen3-VL's ViT without its mergers (they live beside the projector in mllm.py): see the module docstring."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        if cfg.family != "qwen3_vl":
            raise ValueError(f"Qwen3VisionTransformer needs a vision config of family 'qwen3_vl', not {cfg.family!r}")
        self.cfg = cfg
        self.patch_embed = BiasedPatchEmbed(cfg.patch_dim, cfg.hidden_size)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(cfg) for _ in range(cfg.depth))
        self.deepstack_visual_indexes = list(cfg.deepstack_visual_indexes or [])

    rotary = VisionTransformer.rotary  # the same 2-D RoPE as Qwen2.5-VL's: [row angles | column angles], doubled

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cfg = self.cfg
        grid_thw = host_grids(grid_thw)  # read once (a tensor), used twice
        # Only the per-frame segments and (row, col) pairs are used; the window fields stay unused here.
        layout = VisionLayout(grid_thw, _no_windows(cfg), pixel_values.device)
        n = pixel_values.shape[0]
        if n != layout.hw.shape[0]:
            raise ValueError(f"pixel_values has {n} patch rows but grid_thw describes {layout.hw.shape[0]}")
        x = self.patch_embed(pixel_values)
        x = x + interpolated_positions(self.pos_embed.weight, grid_thw, cfg.spatial_merge_size).to(x.dtype)
        cos, sin = self.rotary(layout.hw)
        stack = []
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, layout.frame_cu, None)  # Segments: attend takes the longest from them
            if i in self.deepstack_visual_indexes:
                stack.append(x)
        return x, stack


def _no_windows(cfg: VisionConfig) -> VisionConfig:
    """VisionLayout reads the window size too; give it one window per 2x2 block (its result is not used)."""
    import copy

    layout_cfg = copy.copy(cfg)
    layout_cfg.window_size = cfg.spatial_merge_size * cfg.patch_size
    return layout_cfg


class LayerNormMerger(nn.Module):
    """Qwen3-VL's patch merger: fuses each 2x2 block of vision states and maps it to the LLM width.

    `post_merge_norm` False (the final merger): LayerNorm over the vision width, then the 4 rows are concatenated;
    True (a DeepStack merger): the 4 rows are concatenated, then LayerNorm over 4D. Then Linear(4D, 4D) -> GELU
    (exact erf) -> Linear(4D, out). [P, D] -> [P/4, out]. Module names (norm, fc1, fc2) match `Projector`'s.

    `deepstack` > 0 (the final merger of a model with DeepStack): it also holds that many DeepStack mergers as
    `deepstack.{j}`, so that the projector's phase settings (frozen, trained) and its FSDP group cover them; the
    model applies them (forward runs the final merger only).
    """

    def __init__(self, vision_hidden: int, out_hidden: int, merge_unit: int = 4, post_merge_norm: bool = False,
                 deepstack: int = 0) -> None:
        super().__init__()
        self.merge_unit, self.post_merge_norm = merge_unit, post_merge_norm
        inner = vision_hidden * merge_unit
        self.norm = nn.LayerNorm(inner if post_merge_norm else vision_hidden, eps=1e-6)
        self.fc1 = nn.Linear(inner, inner)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(inner, out_hidden)
        self.deepstack = nn.ModuleList(LayerNormMerger(vision_hidden, out_hidden, merge_unit, post_merge_norm=True)
                                       for _ in range(deepstack)) if deepstack else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = self.fc1.in_features
        x = self.norm(x.reshape(-1, inner)) if self.post_merge_norm else self.norm(x).reshape(-1, inner)
        return self.fc2(self.act(self.fc1(x)))

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator, std: float = 0.02) -> None:
        """Seeded random init (normal weights, zero biases, unit norm), independent of the global RNG; the DeepStack
        mergers after the final one, in order, from the same generator."""
        self.norm.weight.fill_(1.0)
        self.norm.bias.zero_()
        for linear in (self.fc1, self.fc2):
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * std)
            linear.bias.zero_()
        for merger in self.deepstack or []:
            merger.reset_parameters(generator, std)
