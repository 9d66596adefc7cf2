"""Shared fixtures of the curation tests: a tiny random CLIP folder and a tiny random image classifier."""

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


@pytest.fixture(scope="session")
def classifier_dir(tmp_path_factory):
    """A tiny random ConvNeXt watermark classifier (class 0 = watermark, as LAION's detector) with its processor."""
    pytest.importorskip("transformers")
    from transformers import ConvNextConfig, ConvNextForImageClassification, ConvNextImageProcessor

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=2,
                         id2label={0: "watermark", 1: "clear"}, label2id={"watermark": 0, "clear": 1})
    torch.manual_seed(0)
    model = ConvNextForImageClassification(cfg).eval()
    with torch.no_grad():
        model.classifier.weight.mul_(20)  # spread the probabilities
    d = tmp_path_factory.mktemp("watermark")
    model.save_pretrained(d)
    ConvNextImageProcessor(size={"shortest_edge": 32}).save_pretrained(d)
    return str(d)
