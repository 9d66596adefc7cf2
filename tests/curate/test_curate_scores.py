"""Aesthetic, NSFW and watermark scores: heads with known random weights over a tiny random CLIP's image embeddings
(transformers' own `image_embeds` as the reference, heads recomputed in numpy float64), a tiny transformers
image classifier for watermarks, layer sizes inferred from state dicts, and the one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from curate_helpers import assert_kept_exactly, dropped, run

from mindvl.curate import PipelineConfig
from mindvl.curate.synth import pairs_corpus

transformers = pytest.importorskip("transformers")
D = 16  # the tiny CLIP's projection_dim (conftest.clip_dir)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("scores_in")
    truth = pairs_corpus(str(d), 20, dup_fraction=0.0, n_files=2, seed=11, size=48)
    records = [json.loads(line) for f in truth.files for line in open(f)]
    return truth.files, records, d


@pytest.fixture(scope="module")
def direct_embeddings(corpus, clip_dir):
    """id -> the normalised image embedding from transformers' CLIPModel forward (`image_embeds`), one image at a
    time: the independent reference for the stages' batched embeddings."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    _, records, d = corpus
    model = CLIPModel.from_pretrained(clip_dir).eval()
    proc, tok = AutoImageProcessor.from_pretrained(clip_dir), AutoTokenizer.from_pretrained(clip_dir)
    ids = tok(["a"], return_tensors="pt")["input_ids"]
    out = {}
    with torch.no_grad():
        for r in records:
            image = Image.open(d / r["images"][0]).convert("RGB")
            e = model(input_ids=ids, pixel_values=proc(images=[image], return_tensors="pt")["pixel_values"])
            out[r["id"]] = e.image_embeds[0].double().numpy()
    return out


def laion_aesthetic_head(path, seed=0, d=D):
    """LAION's improved-aesthetic-predictor layout: nn.Sequential of Linear d-1024-128-64-16-1 with dropouts between
    (keys layers.0, .2, .4, .6, .7), random weights; returns [(weight, bias)] as float64 numpy."""
    torch.manual_seed(seed)
    head = torch.nn.Sequential(torch.nn.Linear(d, 1024), torch.nn.Dropout(0.2), torch.nn.Linear(1024, 128),
                               torch.nn.Dropout(0.2), torch.nn.Linear(128, 64), torch.nn.Dropout(0.1),
                               torch.nn.Linear(64, 16), torch.nn.Linear(16, 1))
    with torch.no_grad():
        head[0].weight.mul_(8)  # spread the random scores
    torch.save({f"layers.{k}": v for k, v in head.state_dict().items()}, path)  # LAION: self.layers = Sequential
    return [(m.weight.double().detach().numpy(), m.bias.double().detach().numpy())
            for m in head if isinstance(m, torch.nn.Linear)]


def nsfw_head(path, seed=1, d=D, outputs=1):
    """The PyTorch port of LAION's CLIP NSFW detector: norm.mean/variance, linear_1..4 (ReLU between), saved as
    safetensors; returns (mean, variance, [(weight, bias)]) as float64 numpy."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    sizes = [d, 8, 12, 6, outputs]
    sd = {"norm.mean": torch.randn(d, generator=g) * 0.05, "norm.variance": torch.rand(d, generator=g) * 0.02 + 0.01}
    for i in range(4):
        sd[f"linear_{i + 1}.weight"] = torch.randn(sizes[i + 1], sizes[i], generator=g) * 1.5 / sizes[i] ** 0.5
        sd[f"linear_{i + 1}.bias"] = torch.randn(sizes[i + 1], generator=g) * 0.1
    save_file(sd, str(path))
    layers = [(sd[f"linear_{i}.weight"].double().numpy(), sd[f"linear_{i}.bias"].double().numpy())
              for i in range(1, 5)]
    return sd["norm.mean"].double().numpy(), sd["norm.variance"].double().numpy(), layers


def mlp(x, layers, relu):
    for i, (w, b) in enumerate(layers):
        x = x @ w.T + b
        if relu and i < len(layers) - 1:
            x = np.maximum(x, 0)
    return x


def split_threshold(scores):
    """A threshold halfway between the two middle scores: no score sits on it, so float32 vs float64 cannot flip
    a decision (the scores must be spread, not saturated, for that)."""
    s = sorted(scores)
    assert s[len(s) // 2] - s[len(s) // 2 - 1] > 1e-4, "the random head's scores are too close: pick other weights"
    return float((s[len(s) // 2 - 1] + s[len(s) // 2]) / 2)


def test_aesthetic_keeps_exactly_the_records_the_head_scores_above_the_threshold(tmp_path, corpus, clip_dir,
                                                                                direct_embeddings):
    files, records, _ = corpus
    layers = laion_aesthetic_head(tmp_path / "aesthetic.pth")
    direct = {k: float(mlp(e, layers, relu=False)[0]) for k, e in direct_embeddings.items()}
    threshold = split_threshold(direct.values())
    report, items = run(files, str(tmp_path / "out"), [{"aesthetic_score": {
        "model": clip_dir, "head": str(tmp_path / "aesthetic.pth"), "min_score": threshold, "batch_size": 7}}])
    above = {k for k, v in direct.items() if v >= threshold}
    assert_kept_exactly(report, items, direct, above, len(records), "aesthetic_score", "aesthetic", rel=1e-4, abs=1e-4)
    md = open(tmp_path / "out" / "report.md").read()
    assert f"| 0:aesthetic_score | {len(records)} | {len(above)} | aesthetic: {len(records) - len(above)} |" in md


def test_aesthetic_top_fraction_per_source(tmp_path, corpus, clip_dir, direct_embeddings):
    files, records, _ = corpus
    layers = laion_aesthetic_head(tmp_path / "aesthetic.pth", seed=3)
    direct = {k: float(mlp(e, layers, relu=False)[0]) for k, e in direct_embeddings.items()}
    report, items = run(files, str(tmp_path / "out"), [
        {"aesthetic_score": {"model": clip_dir, "head": str(tmp_path / "aesthetic.pth")}},
        {"top_fraction": {"field": "aesthetic_score", "fraction": 0.25, "per": "source"}}])
    expected = set()
    for f in files:
        mine = sorted((json.loads(line)["id"] for line in open(f)), key=lambda k: -direct[k])
        expected |= set(mine[: -(-len(mine) // 4)])
    assert {it.record["id"] for it in items} == expected
    assert dropped(report, "0:aesthetic_score") == {}
    assert dropped(report, "1:top_fraction") == {"below_top_fraction": len(records) - len(expected)}


def test_nsfw_probe_with_input_normalisation_drops_above_max_score(tmp_path, corpus, clip_dir, direct_embeddings):
    files, records, _ = corpus
    mean, var, layers = nsfw_head(tmp_path / "nsfw.safetensors")
    direct = {k: float(1 / (1 + np.exp(-mlp((e - mean) / np.sqrt(var), layers, relu=True)[0])))
              for k, e in direct_embeddings.items()}
    threshold = split_threshold(direct.values())
    report, items = run(files, str(tmp_path / "out"), [{"nsfw_score": {
        "model": clip_dir, "head": str(tmp_path / "nsfw.safetensors"), "max_score": threshold}}])
    safe = {k for k, v in direct.items() if v <= threshold}
    assert_kept_exactly(report, items, direct, safe, len(records), "nsfw_score", "nsfw", abs=1e-5)


def test_head_layer_sizes_and_order_come_from_the_state_dict(tmp_path):
    from mindvl.curate.stages.scores import Head

    laion_aesthetic_head(tmp_path / "a.pth")
    head = Head(str(tmp_path / "a.pth"), "s.head", "none", "auto", None, "raw")
    assert head.sizes == [D, 1024, 128, 64, 16, 1]
    assert [k for k, _, _ in head.layers] == ["layers.0.weight", "layers.2.weight", "layers.4.weight",
                                             "layers.6.weight", "layers.7.weight"]
    nsfw_head(tmp_path / "n.safetensors", outputs=2)
    head = Head(str(tmp_path / "n.safetensors"), "s.head", ["relu", "relu", "none"], "auto", 1, "auto")
    assert head.sizes == [D, 8, 12, 6, 2] and head.output == "softmax" and head.norm is not None
    # natural order: layer 10 after layer 2; DataParallel's module. prefix stripped; a bias-less Linear
    sd = {"module.net.10.weight": torch.ones(1, 3), "module.net.2.weight": torch.ones(3, 5),
          "module.net.2.bias": torch.zeros(3)}
    torch.save({"state_dict": sd}, tmp_path / "c.pt")
    head = Head(str(tmp_path / "c.pt"), "s.head", "relu", "raw", None, "raw")
    assert head.sizes == [5, 3, 1]
    np.testing.assert_allclose(head.scores(np.ones((2, 5))), [15.0, 15.0])


def test_watermark_probe_scores_the_named_class_of_a_two_class_head(tmp_path, corpus, clip_dir, direct_embeddings):
    files, records, _ = corpus
    mean, var, layers = nsfw_head(tmp_path / "wm.safetensors", seed=5, outputs=2)

    def p0(e):
        z = mlp((e - mean) / np.sqrt(var), layers, relu=True)
        return float(np.exp(z[0]) / np.exp(z).sum())

    direct = {k: p0(e) for k, e in direct_embeddings.items()}
    threshold = split_threshold(direct.values())
    report, items = run(files, str(tmp_path / "out"), [{"watermark_score": {
        "model": clip_dir, "head": str(tmp_path / "wm.safetensors"), "label": 0, "max_score": threshold}}])
    assert {it.record["id"] for it in items} == {k for k, v in direct.items() if v <= threshold}
    assert dropped(report, "0:watermark_score") == {"watermark": sum(v > threshold for v in direct.values())}


def test_watermark_classifier_folder_keeps_exactly_the_images_below_max_score(tmp_path, corpus, classifier_dir):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    files, records, d = corpus
    model = AutoModelForImageClassification.from_pretrained(classifier_dir).eval()
    proc = AutoImageProcessor.from_pretrained(classifier_dir)
    direct = {}
    with torch.no_grad():
        for r in records:
            image = Image.open(d / r["images"][0]).convert("RGB")
            logits = model(**proc(images=[image], return_tensors="pt")).logits
            direct[r["id"]] = float(logits.softmax(-1)[0, 0])
    threshold = split_threshold(direct.values())
    report, items = run(files, str(tmp_path / "out"), [{"watermark_score": {
        "classifier": classifier_dir, "label": "watermark", "max_score": threshold, "batch_size": 6}}])
    clear = {k for k, v in direct.items() if v <= threshold}
    assert_kept_exactly(report, items, direct, clear, len(records), "watermark_score", "watermark", abs=1e-5)


def test_one_clip_embedding_per_image_serves_every_stage_of_the_pass(tmp_path, corpus, clip_dir, monkeypatch):
    from mindvl.curate.stages import embed

    files, records, _ = corpus
    laion_aesthetic_head(tmp_path / "a.pth")
    nsfw_head(tmp_path / "n.safetensors")
    nsfw_head(tmp_path / "w.safetensors", seed=2)
    _, alone = run(files, str(tmp_path / "alone"), [{"aesthetic_score": {"model": clip_dir,
                                                                        "head": str(tmp_path / "a.pth")}}])
    embedded = []
    original = embed.ClipModel.image_embeddings
    monkeypatch.setattr(embed.ClipModel, "image_embeddings",
                        lambda self, images: embedded.extend(images) or original(self, images))
    report, items = run(files, str(tmp_path / "all"), [
        {"aesthetic_score": {"model": clip_dir, "head": str(tmp_path / "a.pth")}},
        {"nsfw_score": {"model": clip_dir, "head": str(tmp_path / "n.safetensors")}},
        {"watermark_score": {"model": clip_dir, "head": str(tmp_path / "w.safetensors")}},
        {"clip_score": {"model": clip_dir}},
        {"embed": {"model": clip_dir}}])
    assert len(items) == len(records)
    assert len(embedded) == len(records)  # five stages, one embedding per image
    by_id = {it.record["id"]: it for it in alone}
    for it in items:
        assert it.meta["aesthetic_score"] == by_id[it.record["id"]].meta["aesthetic_score"]
        assert {"nsfw_score", "watermark_score", "clip_score"} <= set(it.meta)
    assert set(report["histograms"]) == {"0:aesthetic_score", "1:nsfw_score", "2:watermark_score", "3:clip_score"}


def _load(stage: dict):
    return PipelineConfig.from_dict({"inputs": ["x.jsonl"], "output": "o", "stages": [stage]}, "p.yaml")


def test_bad_heads_and_options_are_one_line_errors_naming_the_key_and_file(tmp_path, clip_dir, classifier_dir):
    a = str(tmp_path / "a.pth")
    laion_aesthetic_head(a, d=768)  # a ViT-L/14 head on the tiny 16-d CLIP
    with pytest.raises(ValueError, match=r"p\.yaml: stages\[0\]\.aesthetic_score\.head: .*a\.pth: layers\.0\.weight "
                                         r"takes 768-d input but .* gives 16-d image embeddings"):
        _load({"aesthetic_score": {"model": clip_dir, "head": a}})
    with pytest.raises(FileNotFoundError, match=r"stages\[0\]\.nsfw_score\.head: weight file not found: .*nope\.pth"):
        _load({"nsfw_score": {"model": clip_dir, "head": str(tmp_path / "nope.pth")}})
    with pytest.raises(FileNotFoundError, match=r"stages\[0\]\.nsfw_score\.model: model folder not found"):
        _load({"nsfw_score": {"model": str(tmp_path / "no-clip"), "head": a}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.aesthetic_score\.head: required"):
        _load({"aesthetic_score": {"model": clip_dir}})
    broken = str(tmp_path / "broken.pth")
    torch.save({"0.weight": torch.ones(8, D), "1.weight": torch.ones(1, 9)}, broken)
    with pytest.raises(ValueError, match=r"broken\.pth: 1\.weight takes 9 inputs but 0\.weight gives 8"):
        _load({"nsfw_score": {"model": clip_dir, "head": broken}})
    odd = str(tmp_path / "odd.pth")
    torch.save({"0.weight": torch.ones(1, D), "bn.running_mean": torch.zeros(D)}, odd)
    with pytest.raises(ValueError, match=r"odd\.pth: unexpected key bn\.running_mean; a head is Linear layers"):
        _load({"nsfw_score": {"model": clip_dir, "head": odd}})
    two = str(tmp_path / "two.safetensors")
    nsfw_head(two, outputs=2)
    with pytest.raises(ValueError, match=r"stages\[0\]\.nsfw_score\.label: .*two\.safetensors has 2 outputs"):
        _load({"nsfw_score": {"model": clip_dir, "head": two}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.nsfw_score\.label: 2 is not an output index"):
        _load({"nsfw_score": {"model": clip_dir, "head": two, "label": 2}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.nsfw_score\.activation: .*a list of 3"):
        _load({"nsfw_score": {"model": clip_dir, "head": two, "label": 1, "activation": ["relu"]}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.nsfw_score\.min_score: unknown option"):
        _load({"nsfw_score": {"model": clip_dir, "head": two, "min_score": 0.5}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.watermark_score: give either head .* or classifier"):
        _load({"watermark_score": {"model": clip_dir, "head": two, "classifier": classifier_dir}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.watermark_score\.label: 'logo' is not a class of .*"
                                         r"\(id2label: 0: watermark, 1: clear\)"):
        _load({"watermark_score": {"classifier": classifier_dir, "label": "logo"}})
    with pytest.raises(ValueError, match=r"stages\[0\]\.watermark_score\.label: .* has 2 classes"):
        _load({"watermark_score": {"classifier": classifier_dir}})
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"stages\[0\]\.nsfw_score\.head: .*garbage\.safetensors: not a readable"):
        _load({"nsfw_score": {"model": clip_dir, "head": str(garbage)}})


def test_a_score_that_is_not_finite_is_a_counted_drop(tmp_path, corpus, clip_dir):
    files, records, _ = corpus
    torch.save({"0.weight": torch.ones(1, D), "0.bias": torch.tensor([float("nan")])}, tmp_path / "nan.pth")
    report, items = run(files, str(tmp_path / "out"), [{"nsfw_score": {"model": clip_dir,
                                                                       "head": str(tmp_path / "nan.pth")}}])
    assert items == []
    assert dropped(report, "0:nsfw_score") == {"nsfw_not_finite": len(records)}


def test_embedding_size_is_read_from_clip_and_siglip_configs(tmp_path, clip_dir):
    from transformers import SiglipConfig, SiglipModel

    from mindvl.curate.stages.embed import ClipModel
    from mindvl.curate.stages.scores import clip_embedding_dim

    assert clip_embedding_dim(clip_dir) == D == ClipModel(clip_dir).image_embeddings([_image()]).shape[1]
    cfg = SiglipConfig(text_config={"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
                                    "num_hidden_layers": 1, "num_attention_heads": 2},
                       vision_config={"hidden_size": 24, "intermediate_size": 32, "num_hidden_layers": 1,
                                      "num_attention_heads": 2, "image_size": 16, "patch_size": 8})
    SiglipModel(cfg).save_pretrained(tmp_path)
    with torch.no_grad():  # what get_image_features gives is the width the heads must take
        out = SiglipModel.from_pretrained(tmp_path).get_image_features(pixel_values=torch.zeros(1, 3, 16, 16))
    width = (out.pooler_output if hasattr(out, "pooler_output") else out).shape[-1]
    assert clip_embedding_dim(str(tmp_path)) == width == 24


def _image():
    from PIL import Image

    return Image.new("RGB", (40, 30), (200, 80, 20))
