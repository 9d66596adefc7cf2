"""A tiny random MindVL on mindvl's default tokenizer, saved as `mindvl export` saves one (tokenizer included): the
model folder the generation, chat, evaluation and lmms-eval adapter tests run against."""

from __future__ import annotations

from pathlib import Path

from mindvl.checkpoint import save_pretrained
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, load_tokenizer
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig


def tiny_model_folder(path: Path, seed: int = 3, std: float = 0.1) -> Path:
    tok = load_tokenizer(None)
    sp = tok.special
    text = TextConfig(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      mrope_section=[2, 3, 3])
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=sp.image_pad, video_token_id=sp.video_pad,
                                vision_start_token_id=sp.vision_start, vision_end_token_id=sp.vision_end))
    model.init_weights(seed=seed, std=std)
    return save_pretrained(model, path, side_files_from=DEFAULT_TOKENIZER_PATH.parent)
