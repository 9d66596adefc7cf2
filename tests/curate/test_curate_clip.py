"""CLIP-score filtering and CLIP embeddings with a tiny random CLIP built from transformers' config classes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from curate_helpers import TOKENIZER, assert_kept_exactly, dropped, run

from mindvl.curate.synth import pairs_corpus

transformers = pytest.importorskip("transformers")
pytest.importorskip("faiss")

def test_clip_threshold_keeps_exactly_the_pairs_above_it(tmp_path, clip_dir):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    truth = pairs_corpus(str(tmp_path / "in"), 24, dup_fraction=0.0, n_files=2, seed=4)
    records = [json.loads(line) for f in truth.files for line in open(f)]
    # the direct computation: transformers' own forward, one pair at a time, cosine = logits / logit_scale
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc, tok = AutoImageProcessor.from_pretrained(clip_dir), AutoTokenizer.from_pretrained(clip_dir)
    direct = {}
    with torch.no_grad():
        for r in records:
            image = Image.open(tmp_path / "in" / r["images"][0]).convert("RGB")
            out = model(input_ids=tok([r["messages"][1]["content"]], return_tensors="pt")["input_ids"],
                        pixel_values=proc(images=[image], return_tensors="pt")["pixel_values"])
            direct[r["id"]] = float(out.logits_per_image[0, 0] / model.logit_scale.exp())
    threshold = float(np.median(list(direct.values())))
    report, items = run(truth.files, str(tmp_path / "out"),
                        [{"clip_score": {"model": clip_dir, "threshold": threshold, "batch_size": 5}}])
    above = {k for k, v in direct.items() if v >= threshold}
    assert_kept_exactly(report, items, direct, above, len(records), "clip_score", "clip_score", abs=1e-5)


def test_clip_embeddings_feed_the_clustering(tmp_path, clip_dir):
    truth = pairs_corpus(str(tmp_path / "in"), 30, dup_fraction=0.0, n_files=1, seed=5)
    report, items = run(truth.files, str(tmp_path / "out"),
                        [{"embed": {"model": clip_dir}}, {"cluster": {"k": 3, "target": 12, "floor": 2}}])
    assert len(items) == 12 and all(it.meta["cluster"] in {"0", "1", "2"} for it in items)
    assert sum(c["quota"] for c in report["plans"]["1:cluster"]["clusters"]) == 12


def test_low_clip_pairs_are_recaptioned_in_batches_as_single_chat_calls_would(tmp_path, clip_dir):
    from tiny_mindvl import tiny_model_folder

    from mindvl.infer.chat import chat, load_for_chat, pixel_limits

    folder = tiny_model_folder(tmp_path / "vlm")
    truth = pairs_corpus(str(tmp_path / "in"), 5, dup_fraction=0.0, n_files=1, seed=6)
    report, items = run(truth.files, str(tmp_path / "out"), [
        {"clip_score": {"model": clip_dir, "mark_below": 0.0}},
        {"recaption": {"model": str(folder), "max_new_tokens": 6, "batch_size": 3, "prompt": "Caption it."}}])
    low = [it for it in items if it.meta["clip_score"] < 0.0]
    assert all(bool(it.meta.get("recaptioned")) == (it.meta["clip_score"] < 0.0) for it in items)
    assert low, "the tiny random CLIP gave no pair a negative score; pick another seed"
    model, tok = load_for_chat(folder, device="cpu")
    lo, hi = pixel_limits(folder)
    for it in low:
        image = open(tmp_path / "in" / it.record["id"], "rb").read()
        expected = chat(model, tok, "Caption it.", [image], max_new_tokens=6, min_pixels=lo, max_pixels=hi)
        assert it.texts() == expected.strip()
        assert it.meta["original_caption"] != it.texts()


def test_top_fraction_per_source_keeps_the_best_scored_half_of_each_file(tmp_path, clip_dir):
    truth = pairs_corpus(str(tmp_path / "in"), 21, dup_fraction=0.0, n_files=2, seed=9)
    _, scored = run(truth.files, str(tmp_path / "all"), [{"clip_score": {"model": clip_dir}}])
    report, items = run(truth.files, str(tmp_path / "top"), [{"clip_score": {"model": clip_dir}},
                                                            {"top_fraction": {"fraction": 0.5, "per": "source"}}])
    expected = set()
    for f in truth.files:
        mine = sorted((it for it in scored if it.meta["source"] == f), key=lambda it: -it.meta["clip_score"])
        expected |= {it.record["id"] for it in mine[: -(-len(mine) // 2)]}  # ceil(half) of each file
    assert {it.record["id"] for it in items} == expected
    assert dropped(report, "1:top_fraction") == {"below_top_fraction": len(scored) - len(expected)}


def test_siglip_folder_scores_match_its_own_logits(tmp_path):
    from PIL import Image
    from transformers import PreTrainedTokenizerFast, SiglipConfig, SiglipImageProcessor, SiglipModel

    from mindvl.curate.stages.embed import ClipModel

    tok = PreTrainedTokenizerFast(tokenizer_file=TOKENIZER)
    tok.pad_token = tok.convert_ids_to_tokens(0)
    cfg = SiglipConfig(
        text_config={"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8})
    torch.manual_seed(0)
    model = SiglipModel(cfg).eval()
    model.save_pretrained(tmp_path)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    images = [Image.new("RGB", (40, 30), (i * 40, 100, 200 - i * 30)) for i in range(3)]
    texts = ["a red thing", "blue sky over water", "x"]
    clip = ClipModel(str(tmp_path))
    scores = (clip.image_embeddings(images) * clip.text_embeddings(texts)).sum(1)
    with torch.no_grad():  # SigLIP's logits are scale * cosine + bias, with max-length padding
        out = model(input_ids=tok(texts, padding="max_length", max_length=16, return_tensors="pt")["input_ids"],
                    pixel_values=SiglipImageProcessor.from_pretrained(tmp_path)(images=images,
                                                                               return_tensors="pt")["pixel_values"])
        direct = torch.diagonal(out.logits_per_image - model.logit_bias) / model.logit_scale.exp()
    np.testing.assert_allclose(scores, direct.numpy(), atol=1e-5)
