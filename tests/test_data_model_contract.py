"""The contract between mindvl.data and mindvl.models (which never import each other): real packs from the
synthetic generator, through the loader, into a MindVL model built for the shipped default tokenizer."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from tiny_mindvl import tiny_model

from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.data.synth import generate


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    jsonl = generate(tmp_path_factory.mktemp("synth") / "s", n=12, seed=3, tasks=("ocr", "chart", "grounding"))
    cfg = DataConfig.from_dict({"sources": [{"path": str(jsonl)}], "seq_len": 768,
                                "pack_buffer": 6, "max_pixels": 64 * 28 * 28})
    tok = load_tokenizer()
    return tok, [p.to_torch() for p in itertools.islice(build_loader(cfg, tok, max_epochs=1), 3)]


def test_pack_positions_equal_the_models_own(packs):
    tok, batch = packs
    model = tiny_model(tok)
    assert any(len(p["image_grid_thw"]) for p in batch)
    for p in batch:
        ours = model.default_position_ids(p["input_ids"], p["cu_seqlens"], p["image_grid_thw"])
        assert torch.equal(p["position_ids"], ours)  # two independent implementations of get_rope_index


def test_packs_train_the_model_and_match_separate_samples(packs):
    tok, batch = packs
    model = tiny_model(tok)
    p = next(p for p in batch if len(p["image_grid_thw"]))
    loss_sum, count = model(**p)
    assert torch.isfinite(loss_sum) and int(count) > 0
    loss_sum.backward()
    assert model.projector.fc1.weight.grad.abs().sum() > 0  # the images' features reached the loss
    # The same pack as separate samples gives the same summed loss: nothing leaks across packing boundaries.
    total, n_total, image = 0.0, 0, 0
    patches = torch.cat([torch.zeros(1, dtype=torch.long), p["image_grid_thw"].prod(-1).cumsum(0)])
    with torch.no_grad():
        for a, b in itertools.pairwise(p["cu_seqlens"].tolist()):
            ids = p["input_ids"][a:b]
            n_img = int((ids == tok.special.vision_start).sum())
            pv = p["pixel_values"][patches[image]:patches[image + n_img]] if n_img else None
            grid = p["image_grid_thw"][image:image + n_img] if n_img else None
            image += n_img
            logits = model(input_ids=ids[None], pixel_values=pv, image_grid_thw=grid).logits[0]
            total += F.cross_entropy(logits[:-1], p["labels"][a + 1:b], ignore_index=-100, reduction="sum")
            n_total += int((p["labels"][a + 1:b] != -100).sum())
    assert n_total == int(count)
    torch.testing.assert_close(loss_sum.detach(), torch.as_tensor(total), rtol=1e-5, atol=1e-4)
