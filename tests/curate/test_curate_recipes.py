"""The shipped curation recipes: valid, and the model-free demo runs through the CLI."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import yaml

from mindvl.curate import PipelineConfig
from mindvl.curate.synth import pairs_corpus

RECIPES = os.path.join(os.path.dirname(__file__), "..", "..", "recipes", "curation")


def test_caption_recipe_is_valid_with_local_models(tmp_path, clip_dir, classifier_dir):
    import torch
    from tiny_mindvl import tiny_model_folder

    vlm = str(tiny_model_folder(tmp_path / "vlm"))
    head = str(tmp_path / "head.pth")
    torch.save(torch.nn.Linear(16, 1).state_dict(), head)  # a 1-layer head over the tiny CLIP's 16-d embedding
    d = yaml.safe_load(open(os.path.join(RECIPES, "captions.yaml")))
    for entry in d["stages"]:
        (name, opts), = entry.items()
        if name in ("clip_score", "embed", "aesthetic_score", "nsfw_score"):
            opts["model"] = clip_dir
        if "head" in opts:
            opts["head"] = head
        if "classifier" in opts:
            opts["classifier"] = classifier_dir
        if name == "recaption":
            opts["model"] = vlm
    cfg = PipelineConfig.from_dict(d, "captions.yaml")
    assert [n for n, _ in cfg.stages] == ["image_filter", "text_filter", "phash_dedup", "aesthetic_score",
                                          "nsfw_score", "watermark_score", "clip_score", "recaption", "embed",
                                          "cluster"]


@pytest.mark.skipif(shutil.which("tesseract") is None, reason="tesseract is not installed (not in CI)")
def test_ocr_recipe_is_valid():
    pytest.importorskip("rapidocr_onnxruntime")
    cfg = PipelineConfig.load(os.path.join(RECIPES, "ocr.yaml"))
    assert [n for n, _ in cfg.stages] == ["image_filter", "phash_dedup", "ocr", "text_filter"]


def test_demo_recipe_runs_through_the_cli(tmp_path, capsys):
    pytest.importorskip("faiss")
    pytest.importorskip("imagehash")
    from mindvl.cli import main

    truth = pairs_corpus(str(tmp_path / "pairs"), 120, n_files=2, seed=7)
    out = tmp_path / "cur"
    assert main(["curate", os.path.join(RECIPES, "demo.yaml"), "--inputs", *truth.files, "--output", str(out)]) == 0
    assert "records in 4 shards" in capsys.readouterr().out
    report = json.load(open(out / "report.json"))
    assert report["written"] == sum(c["quota"] for c in report["plans"]["4:cluster"]["clusters"])
    assert sorted(os.listdir(out / "shards")) == [f"s0000{i}.tar" for i in range(4)]
    assert main(["curate", os.path.join(RECIPES, "demo.yaml"), "--inputs", *truth.files, "--output", str(out)]) == 0
    assert "nothing left to do" in capsys.readouterr().out
