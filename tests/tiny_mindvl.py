"""Tiny random MindVLs on mindvl's default tokenizer: in memory (`tiny_model`), or saved as `mindvl export` saves one,
tokenizer included (`tiny_model_folder`: the model folder the generation, chat, evaluation and lmms-eval adapter
tests run against)."""

from __future__ import annotations

from pathlib import Path

from mindvl.checkpoint import save_pretrained
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

# A tiny DeepSeek-V3 decoder (MLA + 16 routed experts, top-2 of 4 groups) for `tiny_model_folder(moe=True)`.
TINY_MOE_TEXT = dict(family="deepseek_v3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=16,
                     num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                     kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                     head_dim=16, mrope_section=[2, 3, 3])


def tiny_model(tok=None, hidden_size: int = 32, head_dim: int = 8, mrope_section=(1, 1, 2), seed: int = 0,
               std: float = 0.02, moe: bool = False) -> MindVL:
    """A 2-layer M-RoPE MindVL with a 2-block vision tower on `tok` (default: mindvl's tokenizer), seeded weights;
    `moe`: the tiny DeepSeek-V3 decoder instead (TINY_MOE_TEXT)."""
    tok = tok or load_tokenizer(None)
    sp = tok.special
    if moe:
        text = TextConfig(vocab_size=tok.vocab_size, **TINY_MOE_TEXT)
    else:
        text = TextConfig(vocab_size=tok.vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 3 // 2,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                          mrope_section=list(mrope_section))
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=sp.image_pad, video_token_id=sp.video_pad,
                                vision_start_token_id=sp.vision_start, vision_end_token_id=sp.vision_end))
    model.init_weights(seed=seed, std=std)
    return model


def tiny_model_folder(path: Path, seed: int = 3, std: float = 0.1, moe: bool = False) -> Path:
    model = tiny_model(hidden_size=64, head_dim=16, mrope_section=(2, 3, 3), seed=seed, std=std, moe=moe)
    return save_pretrained(model, path, side_files_from=DEFAULT_TOKENIZER_PATH.parent)


def tiny_pack(config: MindVLConfig, seed: int = 0) -> dict:
    """A packed row for `tiny_model()`'s config: 3 samples (30, 21, 13 tokens), the first with a 4x6-patch image
    (6 merged tokens), random text ids and labels on the text after each sample's first token."""
    import torch

    from mindvl.conventions import IGNORE_INDEX
    from mindvl.plan.packs import PackShape, fake_pack

    gen = torch.Generator().manual_seed(seed)
    batch = fake_pack(PackShape([30, 21, 13], images=[(1, 4, 6)]), config, lambda s: torch.randn(s, generator=gen))
    text = batch["input_ids"] == 100
    batch["input_ids"][text] = torch.randint(5, 400, (int(text.sum()),), generator=gen)
    batch["labels"] = torch.where(batch["labels"] == IGNORE_INDEX, IGNORE_INDEX, batch["input_ids"])
    return batch
