"""Native-resolution vision tower, compatible with Qwen2.5-VL's.

All images of a micro-batch run as ONE concatenated sequence of patch rows; which patches may attend to each other
is expressed only through cu_seqlens (per frame in full-attention blocks, per 112-px window elsewhere), never
through padding or a dense mask.

Inputs:  pixel_values [P, C*2*14*14] (rows as transformers' Qwen2-VL image processor lays them out: every 4
         consecutive rows form one 2x2 merge block), grid_thw [N, 3] = (t, h, w) in patches per image, as host
         ints (the trainer's: the layout is built on the host, nothing is read back) or a tensor.
Output:  hidden states [P, D] in the input (raster-of-merge-blocks) order. The projector fuses each 4 rows.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attend
from .config import VisionConfig
from .host import Segments, host_grids, to_device
from .layers import GatedMLP, RMSNorm, apply_rotary, inverse_frequencies


class PatchEmbed(nn.Module):
    """The Conv3d(kernel = stride = (2, 14, 14)) of Qwen2.5-VL computed as one matmul (the paper's Conv->Matmul).

    A stride-equals-kernel convolution over a row that already holds exactly one (C, T, p, p) patch is a dot product
    with the flattened kernel, so weight [D, C*T*p*p] = conv_weight.reshape(D, -1); see mindvl.checkpoint.conv.
    """

    def __init__(self, patch_dim: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, patch_dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return F.linear(pixel_values.to(self.weight.dtype), self.weight)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.backend = "auto"

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):  # x [P, D]
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, x.shape[-1] // self.num_heads).unbind(1)  # [P, H, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(q, k, v, cu_seqlens, max_seqlen, causal=False, backend=self.backend)
        return self.proj(out.reshape(n, x.shape[-1]))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, full_attention: bool) -> None:
        super().__init__()
        self.full_attention = full_attention
        self.norm1 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm2 = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = VisionAttention(cfg.hidden_size, cfg.num_heads)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=True, act=cfg.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, max_seqlen)
        return x + self.mlp(self.norm2(x))


class VisionLayout:
    """Everything about the patch sequence that depends only on the grids, computed on the host from host ints
    (once per forward) and copied to the device without a read back:

    - `window_order` [P/4]: merge blocks reordered so every window is contiguous (frames and images never mix);
    - `window_cu` / `frame_cu`: host offsets over patches for windowed and full-attention blocks, as `Segments`
      (what the compiled blocks pass to `attend` untouched; they know their longest segment);
    - `hw` [P, 2]: each patch's (row, col) inside its frame, in input order, for the 2-D rotary embedding.
    """

    def __init__(self, grid_thw: torch.Tensor | Sequence[Sequence[int]], cfg: VisionConfig,
                 device: torch.device) -> None:
        merge, unit = cfg.spatial_merge_size, cfg.merge_unit
        win = cfg.window_size // cfg.spatial_merge_size // cfg.patch_size  # window side in merged tokens
        order, window_lens, frame_lens, hw = [], [], [], []
        base = 0
        for t, h, w in host_grids(grid_thw):
            lh, lw = h // merge, w // merge
            blocks = torch.arange(t * lh * lw).view(t, lh, lw)
            nh, nw = -(-lh // win), -(-lw // win)
            padded = F.pad(blocks, (0, nw * win - lw, 0, nh * win - lh), value=-1)
            tiles = padded.view(t, nh, win, nw, win).permute(0, 1, 3, 2, 4).reshape(t * nh * nw, win * win)
            keep = tiles >= 0
            order.append(tiles[keep] + base)
            window_lens += [n * unit for n in keep.sum(1).tolist() if n]  # host tensors: no device involved
            frame_lens += [h * w] * t
            rows = torch.arange(h).view(lh, merge, 1, 1).expand(lh, merge, lw, merge)
            cols = torch.arange(w).view(1, 1, lw, merge).expand(lh, merge, lw, merge)
            # merge-block order: (block row, block col, row in block, col in block)
            pair = torch.stack([rows.permute(0, 2, 1, 3).flatten(), cols.permute(0, 2, 1, 3).flatten()], -1)
            hw.append(pair.repeat(t, 1))
            base += t * lh * lw
        if order:
            window_order, hw_all = torch.cat(order), torch.cat(hw)
        else:  # a text-only micro-batch: zero patches, every block still runs
            window_order, hw_all = torch.zeros(0, dtype=torch.long), torch.zeros(0, 2, dtype=torch.long)
        self.window_order = to_device(window_order, device)
        self.restore_order = to_device(torch.argsort(window_order), device)
        self.window_cu, self.frame_cu = _offsets(window_lens), _offsets(frame_lens)
        self.hw = to_device(hw_all, device)


def _offsets(lengths: list[int]) -> Segments:
    """Offsets of the segments, wrapped for the compiled blocks (host.Segments: no recompile per layout)."""
    return Segments((0, *itertools.accumulate(lengths)))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg.patch_dim, cfg.hidden_size)
        full = set(cfg.fullatt_block_indexes)
        self.blocks = nn.ModuleList(VisionBlock(cfg, i in full) for i in range(cfg.depth))

    def rotary(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2-D RoPE: half the rotary frequencies follow the row, half the column. hw [P, 2] -> cos/sin fp32 [P, hd]."""
        inv_freq = inverse_frequencies(self.cfg.head_dim // 2, self.cfg.rope_theta, hw.device)  # [hd/4]
        angles = (hw.float()[:, :, None] * inv_freq[None, None, :]).flatten(1)  # [P, hd/2] = [rows | cols]
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor:
        """grid_thw: [N, 3] as host ints (nothing is read from the device) or a tensor (read once)."""
        cfg, unit = self.cfg, self.cfg.merge_unit
        layout = VisionLayout(grid_thw, cfg, pixel_values.device)
        n = pixel_values.shape[0]
        if n != layout.hw.shape[0]:
            raise ValueError(f"pixel_values has {n} patch rows but grid_thw describes {layout.hw.shape[0]}")
        x = self.patch_embed(pixel_values)  # [P, D]
        d = x.shape[-1]
        # Window order, in whole merge blocks, so that windows are contiguous runs for varlen attention.
        x = x.view(n // unit, unit, d)[layout.window_order].view(n, d)
        hw = layout.hw.view(n // unit, unit, 2)[layout.window_order].view(n, 2)
        cos, sin = self.rotary(hw)
        for block in self.blocks:
            # max_seqlen None: attend takes it from the Segments (an int here would be one more guard)
            x = block(x, cos, sin, layout.frame_cu if block.full_attention else layout.window_cu, None)
        return x.view(n // unit, unit, d)[layout.restore_order].view(n, d)
