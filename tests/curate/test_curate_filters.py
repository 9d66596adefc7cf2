"""Image and text filters, and bad input: counted skips or one-line errors naming the key or file."""

from __future__ import annotations

import io
import json
import os

import pytest
from curate_helpers import dropped, run
from PIL import Image

from mindvl.curate import PipelineConfig
from mindvl.curate.stages.filters import host_blocked, noise, repetition, script_share


def _png(w: int, h: int, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def _record(text: str, image: str | None = "a.png", **extra) -> dict:
    user = "<image>Describe." if image else "Describe."
    r = {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}], **extra}
    if image:
        r["images"] = [image]
    return r


def test_text_measures_hand_computed():
    assert repetition("a b c a b c") == pytest.approx(1 - 3 / 4)  # 3-grams abc bca cab abc: one repeat of four
    assert repetition("one two") == 0.0
    assert noise("ab§§") == 0.5
    assert script_share("hello 世界", {"latin"}) == pytest.approx(5 / 7)
    assert script_share("hello 世界", {"han"}) == pytest.approx(2 / 7)
    assert host_blocked("https://img.bad.example/x.jpg", ("bad.example",))
    assert not host_blocked("https://notbad.example/x.jpg", ("bad.example",))


def test_filters_and_bad_input_are_counted_by_stage_and_reason(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    images = {"ok.png": _png(64, 48), "small.png": _png(8, 8), "wide.png": _png(300, 20),
              "broken.png": b"\x89PNG\r\n\x1a\n not really a png"}
    for name, data in images.items():
        (d / name).write_bytes(data)
    lines = [
        json.dumps(_record("A red square on a plain background.", "ok.png")),  # kept
        json.dumps(_record("A tiny red square here.", "small.png")),  # too_small
        json.dumps(_record("A wide red banner image.", "wide.png")),  # aspect_ratio
        json.dumps(_record("An image that does not decode.", "broken.png")),  # undecodable
        json.dumps(_record("An image that is missing.", "missing.png")),  # read: missing_image
        json.dumps(_record("   ", "ok.png")),  # read: the trainer's own validation (no assistant turn)
        "{not json",  # read: bad_json
        json.dumps(_record("buy buy buy buy buy buy buy buy", "ok.png")),  # repetition
        json.dumps(_record("这是 一个 红色的 正方形", "ok.png")),  # script
        json.dumps(_record("A red square from a blocked site.", "ok.png", url="http://cdn.spam.example/a")),
        json.dumps(_record("A text-only record without image.", None)),  # no_image
    ]
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    report, items = run([str(d / "data.jsonl")], str(tmp_path / "out"), [
        {"image_filter": {"min_side": 16, "max_aspect_ratio": 4.0}},
        {"text_filter": {"min_words": 2, "scripts": ["latin"], "max_repetition": 0.5, "max_noise": 0.2,
                         "blocked_domains": ["spam.example"]}},
    ])
    assert [it.texts() for it in items] == ["A red square on a plain background."]
    assert dropped(report, "read") == {"missing_image": 1, "no_assistant_turn": 1, "bad_json": 1}
    assert dropped(report, "0:image_filter") == {"too_small": 1, "aspect_ratio": 1, "undecodable": 1, "no_image": 1}
    assert dropped(report, "1:text_filter") == {"repetition": 1, "script": 1, "blocked_domain": 1}
    assert report["written"] == 1
    md = open(tmp_path / "out" / "report.md").read()
    assert "too_small: 1" in md and os.path.exists(tmp_path / "out" / "report_funnel.png")


def test_config_errors_name_the_key(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps(_record("x y", None)) + "\n")
    base = {"inputs": [str(tmp_path / "a.jsonl")], "output": str(tmp_path / "o")}
    with pytest.raises(ValueError, match=r"stages\[1\]: unknown stage 'dedupe' \(known: .*phash_dedup"):
        PipelineConfig.from_dict({**base, "stages": [{"text_filter": {}}, {"dedupe": {}}]})
    with pytest.raises(ValueError, match=r"stages\[0\]\.text_filter\.min_chars: expected int"):
        PipelineConfig.from_dict({**base, "stages": [{"text_filter": {"min_chars": "3"}}]})
    with pytest.raises(ValueError, match=r"stages\[0\]\.cluster\.kk: unknown option"):
        PipelineConfig.from_dict({**base, "stages": [{"cluster": {"kk": 3}}]})
    with pytest.raises(FileNotFoundError, match=r"stages\[0\]\.clip_score\.model: model folder not found: /nope"):
        PipelineConfig.from_dict({**base, "stages": [{"clip_score": {"model": "/nope"}}]})
    with pytest.raises(ValueError, match=r"engine\.name: unknown engine 'spark'"):
        PipelineConfig.from_dict({**base, "engine": {"name": "spark"}, "stages": ["text_filter"]})


def test_cli_one_line_errors(tmp_path, capsys):
    from mindvl.cli import main

    (tmp_path / "a.jsonl").write_text(json.dumps(_record("x y", None)) + "\n")
    pipe = tmp_path / "p.yaml"
    pipe.write_text(f"inputs: [{tmp_path / 'missing*.jsonl'}]\noutput: {tmp_path / 'o'}\nstages: [text_filter]\n")
    assert main(["curate", str(pipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no file matches" in err
    pipe.write_text(f"inputs: [{tmp_path / 'a.jsonl'}]\noutput: {tmp_path / 'o'}\nstages: [{{ocrr: {{}}}}]\n")
    assert main(["curate", str(pipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stages[0]: unknown stage 'ocrr'" in err
