"""A real pack with a document, a video chat, an image chat and a text chat trains a tiny M-RoPE MindVL, and its
summed loss equals the samples run one by one with positions computed on the model side (the data side's M-RoPE
and the model's agree on videos, with the time axis scaled by second_per_grid_t)."""

from __future__ import annotations

import itertools
import json

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.data.video import write_test_video
from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig


def qa(question: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def test_pack_with_every_kind_trains_and_matches_samples_one_by_one(tmp_path):
    tok = load_tokenizer()
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (56, 84, 3), np.uint8)).save(tmp_path / "a.png")
    # 8 frames at 8 fps: 4 sampled (min_frames) at 4 fps -> 0.5 s per temporal patch (not the default 1 s).
    write_test_video(tmp_path / "v.mp4", np.random.default_rng(1).integers(0, 256, (8, 56, 84, 3), np.uint8), fps=8)
    records = [{"text": "A page <image> about noise.", "images": ["a.png"]},
               {**qa("<video>What moves?", "Nothing."), "videos": ["v.mp4"]},
               {**qa("<image>Describe.", "Noise."), "images": ["a.png"]}, qa("Hi", "Hello.")]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "d.jsonl")}], "seq_len": 2048, "pack_buffer": 8,
                                "min_pixels": 56 * 84, "max_pixels": 56 * 84,
                                "video": {"min_pixels": 56 * 84, "max_pixels": 56 * 84}})
    [pack] = list(build_loader(cfg, tok, max_epochs=1))
    p = pack.to_torch()
    assert p["image_grid_thw"].tolist() == [[1, 4, 6], [2, 4, 6], [1, 4, 6]]
    sp = tok.special
    text = TextConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, mrope_section=[1, 1, 2])
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=sp.image_pad, video_token_id=sp.video_pad,
                                vision_start_token_id=sp.vision_start, vision_end_token_id=sp.vision_end))
    model.init_weights(seed=0, std=0.1)
    loss_sum, count = model(**p)
    loss_sum.backward()
    assert model.visual.patch_embed.weight.grad.abs().sum() > 0

    total, n_total, item = 0.0, 0, 0
    rows = torch.cat([torch.zeros(1, dtype=torch.long), p["image_grid_thw"].prod(-1).cumsum(0)])
    with torch.no_grad():
        for a, b in itertools.pairwise(p["cu_seqlens"].tolist()):
            ids = p["input_ids"][a:b]
            n = int((ids == sp.vision_start).sum())
            seconds = [0.5] * int((ids == sp.video_pad).any())
            pixels = p["pixel_values"][rows[item]:rows[item + n]] if n else None
            logits = model(input_ids=ids[None], pixel_values=pixels,
                           image_grid_thw=p["image_grid_thw"][item:item + n] if n else None,
                           second_per_grid_ts=torch.tensor(seconds)).logits[0]
            item += n
            total += F.cross_entropy(logits[:-1], p["labels"][a + 1:b], ignore_index=-100, reduction="sum")
            n_total += int((p["labels"][a + 1:b] != -100).sum())
    assert n_total == int(count)
    torch.testing.assert_close(loss_sum.detach(), torch.as_tensor(total), rtol=1e-5, atol=1e-4)
