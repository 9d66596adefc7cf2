"""A tiny random Qwen3.5 (`Qwen3_5ForConditionalGeneration`, transformers 5.23) built offline.

Shapes chosen so that bugs show: linear attention with 2 key heads serving 4 value heads (dk 8 != dv 12), a conv
kernel of 4, layers linear / full / linear / full; full attention with head_dim 16 != hidden/heads, GQA 4:2, partial
rotary 0.5 (8 of 16 channels) with interleaved M-RoPE [2, 1, 1]; the Qwen3-VL-style tower (16-px patches, 4 x 4
learned position table) without DeepStack. Every parameter is re-randomised (hf_tiny.randomise), and A_log is set so
the decay keeps ~10 tokens of memory (transformers' init, A in [0.01, 16], can forget within a token or two, which
would hide a state carried across a sample boundary).
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_tiny import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB, randomise

VISION_KW = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48, patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                 hidden_act="gelu_pytorch_tanh")
TEXT_KW = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
               linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
               linear_num_value_heads=4,
               layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1],
                                "mrope_interleaved": True, "partial_rotary_factor": 0.5})


# MoE: H = 48 != 2I = 40, so a transposed expert tensor cannot pass for an untransposed one; a shared expert of
# another width.
MOE_KW = dict(moe_intermediate_size=20, num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=28)


def _text_kw(moe: bool, **extra) -> dict:
    text = {**TEXT_KW, "bos_token_id": 0, "eos_token_id": 1, **extra}
    if moe:
        del text["intermediate_size"]
        text.update(MOE_KW)
    return text


def _build(model_cls, cfg, seed: int, folder: Path | None):
    """Randomised (A_log so the decay keeps ~10 tokens of memory), eval mode, saved if `folder`."""
    torch.manual_seed(seed)
    model = randomise(model_cls(cfg), seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(-2.0 + 0.5 * torch.randn(p.shape, generator=gen))
    model.eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def qwen35(folder: Path | None = None, seed: int = 0, tie: bool = False, moe: bool = False):
    """A tiny Qwen3_5ForConditionalGeneration, or the MoE one (eager attention, eval mode); saved if `folder`."""
    if moe:
        from transformers import Qwen3_5MoeConfig as Config
        from transformers import Qwen3_5MoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3_5Config as Config
        from transformers import Qwen3_5ForConditionalGeneration as Model

    cfg = Config(vision_config=dict(VISION_KW), text_config=_text_kw(moe), image_token_id=IMAGE_TOKEN,
                 video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                 tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    for sub in (cfg.vision_config, cfg.text_config):
        sub._attn_implementation = "eager"
    return _build(Model, cfg, seed, folder)


def qwen35_text(folder: Path | None = None, seed: int = 0, tie: bool = True, moe: bool = False):
    """The language model alone: a tiny Qwen3_5ForCausalLM (or Qwen3_5MoeForCausalLM); saved if `folder`."""
    if moe:
        from transformers import Qwen3_5MoeForCausalLM as Model
        from transformers import Qwen3_5MoeTextConfig as Config
    else:
        from transformers import Qwen3_5ForCausalLM as Model
        from transformers import Qwen3_5TextConfig as Config

    cfg = Config(**_text_kw(moe, tie_word_embeddings=tie))
    cfg._attn_implementation = "eager"
    return _build(Model, cfg, seed, folder)
