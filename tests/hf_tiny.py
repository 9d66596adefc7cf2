"""Tiny random transformers models, built offline from transformers' own config classes.

Every parameter is re-randomised (transformers initialises norms to 1 and biases to 0, which would hide bugs such as
a norm applied to the wrong tensor or a dropped bias). Works with transformers 4.51 ... 5.23 (see
shared/reference/model-numerics.md §6): the vision-tower return type, the M-RoPE `mm_token_type_ids` argument and
the state-dict prefixes are detected, not assumed.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 151, 152, 150, 153
VOCAB = 160

VISION_KW = dict(depth=4, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=48, patch_size=14,
                 spatial_merge_size=2, temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                 in_channels=3)


@torch.no_grad()
def randomise(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1 and "norm" in name or name.endswith("ln_q.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def qwen25vl(folder: Path | None = None, seed: int = 0, tie: bool = False):
    """A tiny Qwen2.5-VL (vision depth 4 with full attention at 1 and 3, M-RoPE [1, 2, 3]); saved if `folder`."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(
        vision_config=VISION_KW, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": [1, 2, 3]},
        max_position_embeddings=512, rms_norm_eps=1e-6, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END, bos_token_id=0, eos_token_id=1,
        tie_word_embeddings=tie, attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = randomise(Qwen2_5_VLForConditionalGeneration(cfg), seed).eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def qwen3(folder: Path | None = None, seed: int = 0, tie: bool = True, vocab: int = VOCAB, hidden: int = 32):
    """A tiny Qwen3 (head_dim 16 != hidden/heads, GQA 4:2); saved if `folder`."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=vocab, tie_word_embeddings=tie, rope_theta=1e6,
                      rms_norm_eps=1e-6, max_position_embeddings=512, attn_implementation="eager")
    torch.manual_seed(seed)
    model = randomise(Qwen3ForCausalLM(cfg), seed).eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def vision_tower(vlm):
    return vlm.model.visual if hasattr(vlm.model, "visual") else vlm.visual


def hf_image_features(vlm, pixel_values, grid_thw) -> torch.Tensor:
    out = vision_tower(vlm)(pixel_values, grid_thw=grid_thw)
    return out.pooler_output if hasattr(out, "pooler_output") else out  # 5.x ModelOutput / 4.x tensor


def mm_kwargs(vlm, input_ids) -> dict:
    """transformers >= 5.3 builds M-RoPE positions from mm_token_type_ids and silently falls back to 1-D without it."""
    if "mm_token_type_ids" in inspect.signature(vlm.forward).parameters:
        return {"mm_token_type_ids": (input_ids == IMAGE_TOKEN).long()}
    return {}


def random_pixels(grids: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen), grid


def multimodal_ids(pieces: list, seed: int = 0) -> torch.Tensor:
    """pieces: ints (that many random text tokens) or grids [t, h, w] (vision_start + t*h*w/4 pads + vision_end)."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids += torch.randint(2, 140, (piece,), generator=gen).tolist()
        else:
            t, h, w = piece
            ids += [VISION_START] + [IMAGE_TOKEN] * (t * h * w // 4) + [VISION_END]
    return torch.tensor(ids, dtype=torch.long)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())
