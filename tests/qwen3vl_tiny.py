"""Tiny random Qwen3-VL / Qwen3-VL-MoE models built offline from transformers 5.23's config classes.

Every parameter is re-randomised (hf_tiny.randomise; LayerNorm biases included). Shapes are chosen so that bugs
show: vision head_dim 16 with a 4 x 4 learned position table resampled to grids of other sizes, DeepStack after
blocks 0 and 2 of 3 (injected after LLM layers 0 and 1 of 3), text head_dim 12 != hidden/heads with interleaved
M-RoPE [2, 2, 2], MoE with H != 2I so a transposed expert tensor cannot pass for an untransposed one.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hf_tiny import IMAGE_TOKEN, VIDEO_TOKEN, VISION_END, VISION_START, VOCAB, randomise

VISION_KW = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=48, patch_size=16,
                 spatial_merge_size=2, temporal_patch_size=2, in_channels=3, num_position_embeddings=16,
                 deepstack_visual_indexes=[0, 2], hidden_act="gelu_pytorch_tanh")
TEXT_KW = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=12, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2, 2],
                                "mrope_interleaved": True})
MOE_KW = dict(moe_intermediate_size=20, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1)


def qwen3vl(folder: Path | None = None, seed: int = 0, moe: bool = False, tie: bool = False):
    """A tiny Qwen3VLForConditionalGeneration (or the MoE one); saved if `folder`."""
    if moe:
        from transformers import Qwen3VLMoeConfig as Config
        from transformers import Qwen3VLMoeForConditionalGeneration as Model
    else:
        from transformers import Qwen3VLConfig as Config
        from transformers import Qwen3VLForConditionalGeneration as Model
    text = {**TEXT_KW, **(MOE_KW if moe else {}), "bos_token_id": 0, "eos_token_id": 1}
    cfg = Config(vision_config=dict(VISION_KW), text_config=text, image_token_id=IMAGE_TOKEN,
                 video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
                 tie_word_embeddings=tie)
    cfg._attn_implementation = "eager"
    for sub in (cfg.vision_config, cfg.text_config):
        sub._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = randomise(Model(cfg), seed).eval()
    if folder is not None:
        model.save_pretrained(folder)
    return model


def patch_rows(grid_thw: torch.Tensor, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = int(grid_thw.prod(-1).sum())
    return torch.randn(n, 3 * 2 * 16 * 16, generator=gen)


def prompt(items: list[tuple[str, list[int]]], text: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [1, T] and mm_token_type_ids [1, T] in the Qwen3-VL processor's form: text, then per image
    `<vision_start> pads <vision_end>`, per video frame `<timestamp text> <vision_start> pads <vision_end>`."""
    gen = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(2, 140, (n,), generator=gen).tolist()

    ids, kinds = words(text), [0] * text
    for kind, (t, h, w) in items:
        pads = h * w // 4
        for _ in range(t if kind == "video" else 1):
            if kind == "video":
                ids += words(2)
                kinds += [0, 0]
            ids += [VISION_START] + [VIDEO_TOKEN if kind == "video" else IMAGE_TOKEN] * pads + [VISION_END]
            kinds += [0] + [2 if kind == "video" else 1] * pads + [0]
        ids += words(text)
        kinds += [0] * text
    return torch.tensor([ids]), torch.tensor([kinds])
