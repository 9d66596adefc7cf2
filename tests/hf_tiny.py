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
    """transformers >= 5.3 builds M-RoPE positions from mm_token_type_ids (text 0, image 1, video 2) and silently
    falls back to 1-D without it."""
    if "mm_token_type_ids" in inspect.signature(vlm.forward).parameters:
        return {"mm_token_type_ids": (input_ids == IMAGE_TOKEN).long() + 2 * (input_ids == VIDEO_TOKEN).long()}
    return {}


def random_pixels(grids: list[list[int]], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    grid = torch.tensor(grids, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 14 * 14, generator=gen), grid


def multimodal_ids(pieces: list, seed: int = 0) -> torch.Tensor:
    """pieces: ints (that many random text tokens), image grids [t, h, w] or video grids ("video", t, h, w)
    (vision_start + t*h*w/4 image or video pads + vision_end)."""
    gen = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, int):
            ids += torch.randint(2, 140, (piece,), generator=gen).tolist()
        else:
            pad = VIDEO_TOKEN if piece[0] == "video" else IMAGE_TOKEN
            t, h, w = piece[-3:]
            ids += [VISION_START] + [pad] * (t * h * w // 4) + [VISION_END]
    return torch.tensor(ids, dtype=torch.long)


def converted_qwen25vl(root: Path, seed: int):
    """(transformers' tiny Qwen2.5-VL, the same weights converted to a mindvl model) under `root`."""
    from mindvl.checkpoint import convert_from_hf, load_model

    hf = qwen25vl(root / "hf", seed=seed)
    convert_from_hf(root / "hf", root / "mindvl")
    return hf, load_model(root / "mindvl")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ---------------------------------------------------------------------------------------------------- MoE models

DEEPSEEK_KW = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                   num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                   n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
                   kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12,
                   routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-5, max_position_embeddings=256,
                   rope_theta=10000.0, rope_interleave=True, tie_word_embeddings=False)


@torch.no_grad()
def randomise_router_bias(model: torch.nn.Module, seed: int, std: float = 0.05) -> torch.nn.Module:
    """DeepSeek's e_score_correction_bias is a buffer (zero at init); small values keep -inf vs 0.0 masking moot."""
    gen = torch.Generator().manual_seed(seed + 1000)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(std * torch.randn(b.shape, generator=gen))
    return model


def deepseek_v3(folder: Path | None = None, seed: int = 0, **overrides):
    """A tiny DeepSeek-V3 (MLA, 1 dense + 2 MoE layers, 8 experts in 4 groups, top-2 of 2 groups, 1 shared expert);
    `overrides` change DEEPSEEK_KW (e.g. q_lora_rank=None, rope_scaling={...yarn...}). Saved if `folder`."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**DEEPSEEK_KW, **overrides}, attn_implementation="eager")
    torch.manual_seed(seed)
    model = randomise_router_bias(randomise(DeepseekV3ForCausalLM(cfg), seed), seed).eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


# Tiny configs of transformers' other MoE families (router: softmax top-k); the keys each config class takes.
MOE_FAMILIES = {
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                       shared_expert_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=8, num_experts_per_tok=3, moe_intermediate_size=16, norm_topk_prob=True,
                       head_dim=8)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=8, num_experts_per_tok=2)),
}


def moe_lm(family: str, folder: Path | None = None, seed: int = 0):
    """A tiny random `family` MoE causal LM (3 layers, hidden 32); saved if `folder`. DeepSeek-V3 via deepseek_v3."""
    import transformers

    if family == "deepseek_v3":
        return deepseek_v3(folder, seed)
    cfg_name, model_name, moe = MOE_FAMILIES[family]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, pad_token_id=None,
        attn_implementation="eager", **moe)
    torch.manual_seed(seed)
    model = randomise(getattr(transformers, model_name)(cfg), seed).eval()
    with torch.no_grad():  # routers at 0.05 std give near-uniform softmax; sharpen so top-k is decisive
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.mul_(20)
    if folder is not None:
        model.save_pretrained(folder)
    return model
