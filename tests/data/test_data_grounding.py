"""Grounding conventions: boxes and points follow the image through smart_resize (Qwen2.5-VL: pixels of the resized
image; Qwen2-VL: 0..1000), checked by hand; boxes outside the image are skipped and counted."""

from __future__ import annotations

import json
import logging

import pytest
from data_helpers import png_bytes, qa, write_jsonl

from mindvl.data import DataConfig, build_loader
from mindvl.data.grounding import BoxError, convert_text
from mindvl.data.schema import IGNORE_INDEX
from mindvl.data.synth import generate


def test_conversions_by_hand():
    size, resized = (640, 480), (448, 336)  # a 0.7 scale
    assert convert_text("at (64, 48), (320, 240).", "abs", "qwen2.5-vl", size, resized) == "at (45, 34), (224, 168)."
    assert convert_text("(64, 48), (320, 240)", "abs", "rel1000", size, resized) == "(100, 100), (500, 500)"
    assert convert_text("(100,100),(500,500)", "rel1000", "qwen2.5-vl", size, resized) == "(45, 34), (224, 168)"
    assert convert_text("(0.1, 0.1), (0.5, 0.5)", "rel1", "qwen2.5-vl", size, resized) == "(45, 34), (224, 168)"
    text = '[{"bbox_2d": [64, 48, 320, 240], "label": "cat"}, {"point_2d": [640, 480]}]'
    assert convert_text(text, "abs", "qwen2.5-vl", size, resized) == (
        '[{"bbox_2d": [45, 34, 224, 168], "label": "cat"}, {"point_2d": [448, 336]}]')
    with pytest.raises(BoxError) as exc:
        convert_text("(10, 10), (700, 20)", "abs", "qwen2.5-vl", size, resized)
    assert exc.value.reason == "box_outside_image"
    with pytest.raises(BoxError) as exc:
        convert_text("(300, 10), (200, 20)", "abs", "qwen2.5-vl", size, resized)
    assert exc.value.reason == "bad_box"


def test_synthetic_grounding_boxes_follow_the_resize(tmp_path, tok):
    jsonl = generate(tmp_path / "s", 12, seed=2, tasks=["grounding"])
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert all(r["coords"] == "abs" for r in records)
    max_pixels = 90 * 28 * 28  # below the smallest synthetic image (280x280): every image is downscaled
    cfg = DataConfig.from_dict({"sources": [{"path": str(jsonl)}], "seq_len": 4096, "pack_buffer": 16,
                                "max_pixels": max_pixels, "default_system": None})
    from PIL import Image

    from mindvl.data.image import smart_resize

    answers = {}
    for pack in build_loader(cfg, tok, max_epochs=1):
        cu = pack.cu_seqlens.tolist()
        for k, (a, b) in enumerate(zip(cu, cu[1:], strict=False)):
            labels = pack.labels[a:b]
            text = tok.decode(labels[labels != IGNORE_INDEX].tolist()).removesuffix("<|im_end|>")
            answers[tuple(pack.image_grid_thw[k].tolist())] = answers.get(tuple(pack.image_grid_thw[k].tolist()),
                                                                          []) + [text]
    checked = 0
    for r in records:
        w, h = Image.open(jsonl.parent / r["images"][0]).size
        rh, rw = smart_resize(h, w, 28, 56 * 56, max_pixels)
        x1, y1, x2, y2 = (int(v) for v in r["messages"][1]["content"].replace("(", "").replace(")", "").split(","))
        scaled = f"({round(x1 * rw / w)}, {round(y1 * rh / h)}), ({round(x2 * rw / w)}, {round(y2 * rh / h)})"
        assert scaled in answers[(1, rh // 14, rw // 14)]
        checked += (rw, rh) != (w, h)
    assert checked == len(records)


def test_bad_boxes_are_skipped_with_their_line(tmp_path, tok, caplog):
    (tmp_path / "a.png").write_bytes(png_bytes(100, 200))  # 200 wide, 100 high
    good = {**qa("<image>Where?", "(10, 10), (190, 90)", images=["a.png"]), "coords": "abs"}
    records = [good,
               {**qa("<image>Where?", "(10, 10), (250, 90)", images=["a.png"]), "coords": "abs"},  # line 2
               {**qa("<image>Where?", "(500, 10), (900, 1200)", images=["a.png"]), "coords": "rel1000"},  # line 3
               {**qa("<image>Where?", "(10, 10), (20, 20)", images=["a.png"]), "coords": "pixels"},  # line 4
               {**qa("<image>Where?", "(30, 10), (20, 20)", images=["a.png"]), "coords": "abs"}]  # line 5
    path = write_jsonl(tmp_path / "g.jsonl", records)
    cfg = DataConfig.from_dict({"sources": [{"path": str(path)}], "seq_len": 1024, "pack_buffer": 8})
    with caplog.at_level(logging.WARNING, logger="mindvl.data"):
        loader = build_loader(cfg, tok, max_epochs=1)
        assert sum(p.num_samples for p in loader) == 1
    assert loader.report()["skipped"] == {"box_outside_image": 2, "bad_record": 1, "bad_box": 1}
    for line, reason in ((2, "box_outside_image"), (3, "box_outside_image"), (4, "bad_record"), (5, "bad_box")):
        assert any(f"{path}:{line}" in r.message and reason in r.message for r in caplog.records), line
