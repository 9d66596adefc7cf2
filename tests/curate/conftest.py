"""Shared fixtures of the curation tests: a tiny random CLIP folder."""

from __future__ import annotations

import pytest
import torch
from curate_helpers import TOKENIZER


@pytest.fixture(scope="session")
def clip_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tok.pad_token = tok.convert_ids_to_tokens(0)  # lowest id: CLIP's legacy pooling takes the highest id's position
    cfg = CLIPConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 64, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        projection_dim=16)
    torch.manual_seed(0)
    model = CLIPModel(cfg).eval()
    d = tmp_path_factory.mktemp("clip")
    model.save_pretrained(d)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)
