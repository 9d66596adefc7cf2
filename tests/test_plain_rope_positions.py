"""A 1-D RoPE language model trains on the positions it is served with.

The data pipeline emits M-RoPE rows [3, T]; a plain-RoPE model used to take row 0 (every pad of an image on one
position, the text after it compressed) while generation numbers every token, so the same sample had different
logits in training and at inference. These tests fail on that behaviour."""

from __future__ import annotations

import itertools

import pytest
import torch

from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.data.synth import generate
from mindvl.infer.generate import Prompt, pack_prompts
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig


@pytest.fixture(scope="module")
def pack_and_model(tmp_path_factory):
    jsonl = generate(tmp_path_factory.mktemp("synth") / "s", n=6, seed=5, tasks=("ocr", "grounding"))
    cfg = DataConfig.from_dict({"sources": [{"path": str(jsonl)}], "seq_len": 512, "pack_buffer": 4,
                                "max_pixels": 48 * 28 * 28})
    tok = load_tokenizer()
    pack = next(p for p in itertools.islice(build_loader(cfg, tok, max_epochs=1), 4) if len(p.image_grid_thw))
    sp = tok.special
    text = TextConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, mrope_section=None)
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[0])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=sp.image_pad, video_token_id=sp.video_pad,
                                vision_start_token_id=sp.vision_start, vision_end_token_id=sp.vision_end))
    model.init_weights(seed=0, std=0.2)
    return pack.to_torch(), model.eval()


def test_training_logits_equal_inference_logits_with_plain_rope(pack_and_model):
    p, model = pack_and_model
    assert not model.config.uses_mrope and p["position_ids"].shape[0] == 3
    assert not torch.equal(p["position_ids"][0], model.default_position_ids(p["input_ids"], p["cu_seqlens"], None))
    with torch.no_grad():
        trained = model(input_ids=p["input_ids"], pixel_values=p["pixel_values"], image_grid_thw=p["image_grid_thw"],
                        position_ids=p["position_ids"], cu_seqlens=p["cu_seqlens"]).logits  # [T, V]
        # Inference: each sample's prompt prefilled on its own (positions 0, 1, 2, ... as generation feeds them).
        patches = torch.cat([torch.zeros(1, dtype=torch.long), p["image_grid_thw"].prod(-1).cumsum(0)])
        image = 0
        for a, b in itertools.pairwise(p["cu_seqlens"].tolist()):
            ids = p["input_ids"][a:b]
            n_img = int((ids == model.config.vision_start_token_id).sum())
            prompt = Prompt(ids, p["pixel_values"][patches[image]:patches[image + n_img]],
                            p["image_grid_thw"][image:image + n_img])
            image += n_img
            packed = pack_prompts([prompt], torch.device("cpu"))
            logits, next_pos = model.prefill(packed["input_ids"], packed["cu_seqlens"], model.new_kv_cache(1, b - a),
                                             packed["pixel_values"], packed["image_grid_thw"])
            assert int(next_pos) == b - a  # generation continues at the prompt length
            torch.testing.assert_close(trained[b - 1], logits[0], rtol=1e-5, atol=1e-5)


def test_pack_positions_and_none_give_the_same_loss(pack_and_model):
    p, model = pack_and_model
    with torch.no_grad():
        given = model(**p)
        derived = model(**{**p, "position_ids": None})
    torch.testing.assert_close(given.loss_sum, derived.loss_sum)
