"""`mindvl data synth` / `mindvl data stats` and the synthetic generator's determinism and content."""

from __future__ import annotations

import json

import numpy as np
import pytest
from data_helpers import qa, write_jsonl
from PIL import Image

from mindvl.cli import main
from mindvl.data.synth import generate, make_record


def _tree(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_synth_cli_deterministic(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["data", "synth", "--out", str(tmp_path / name), "--n", "16", "--seed", "4"]) == 0
    assert main(["data", "synth", "--out", str(tmp_path / "c"), "--n", "16", "--seed", "5"]) == 0
    a, b, c = (_tree(tmp_path / n) for n in "abc")
    assert a == b and a != c
    records = [json.loads(line) for line in (tmp_path / "a" / "data.jsonl").read_text().splitlines()]
    assert len(records) == 16 and {r["images"][0].split("/")[1].split("_")[0] for r in records} == {
        "ocr", "chart", "grounding", "doc"}
    assert main(["data", "synth", "--out", str(tmp_path / "d"), "--n", "4", "--tasks", "maps"]) == 2
    assert "unknown synth task 'maps'" in capsys.readouterr().err


def test_the_task_lists_name_every_generator(capsys):
    # Three hand-kept lists name the synthetic tasks: the generators, the recipe validation (data/config.py, which
    # does not import the Pillow drawing code) and `mindvl data synth --help` (which does not import data at start-up).
    from mindvl.data.config import SYNTH_KNOWN_TASKS
    from mindvl.data.synth import GENERATORS, TEXT_GENERATORS

    assert set(SYNTH_KNOWN_TASKS) == set(GENERATORS) | set(TEXT_GENERATORS)
    with pytest.raises(SystemExit):
        main(["data", "synth", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert all(name in help_text.replace(",", " ").split() for name in SYNTH_KNOWN_TASKS), help_text


def test_synth_prefix_property_and_tasks(tmp_path):
    generate(tmp_path / "small", 5, seed=2, tasks=["chart", "grounding"])
    generate(tmp_path / "big", 9, seed=2, tasks=["chart", "grounding"])
    small = (tmp_path / "small" / "data.jsonl").read_text().splitlines()
    big = (tmp_path / "big" / "data.jsonl").read_text().splitlines()
    assert big[:5] == small
    assert all("chart" in line or "grounding" in line for line in big)


def test_synth_images_are_native_size_and_grounding_boxes_are_correct():
    for i in range(40):
        record, img, task = make_record(i, 11, ["ocr", "chart", "grounding", "doc"])
        assert img.width % 28 == 0 and img.height % 28 == 0  # no resize by the processor at default pixels
        if task == "grounding":
            answer = record["messages"][1]["content"]
            x1, y1, x2, y2 = (int(v) for v in answer.replace("(", "").replace(")", "").split(", "))
            a = np.asarray(img.convert("RGB")).astype(int)
            bg = a[0, 0] if not (x1 == 0 and y1 == 0) else a[-1, -1]
            inside = a[y1:y2 + 1, x1:x2 + 1]
            assert (np.abs(inside - bg).sum(-1) > 30).any()  # the named shape is drawn in its box
            rows = np.where((np.abs(a - inside[(y2 - y1) // 2, (x2 - x1) // 2]).sum(-1) == 0).any(1))[0]
            assert rows.min() >= y1 - 1 and rows.max() <= y2 + 1  # and nowhere outside it (shapes don't overlap)
        if task == "ocr":
            assert isinstance(img, Image.Image) and record["messages"][1]["content"]


def test_stats_cli_json(tmp_path, synth_dir, capsys):
    bad = write_jsonl(tmp_path / "bad.jsonl", [qa(), "{nope", {"messages": []}])
    assert main(["data", "stats", str(synth_dir / "data.jsonl"), str(bad), "--seq-len", "2048", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["samples"] == 61 and out["skipped"] == {"bad_json": 1, "empty_conversation": 1}
    assert 0.5 < out["packing_efficiency"] <= 1.0
    assert out["tokens"] == sum(row["tokens"] for row in out["sources"].values())
    assert sum(out["token_histogram"].values()) == 61
    trained = {name: row["trained_tokens"] for name, row in out["sources"].items()}
    assert main(["data", "stats", str(synth_dir / "data.jsonl"), str(bad), "--seq-len", "2048"]) == 0
    text = capsys.readouterr().out
    assert "packing efficiency" in text and "tokens per sample" in text
    # The text report carries the trained (labelled) tokens the JSON has: in total and per source.
    assert f"trained tokens     {sum(trained.values())}  (" in text
    for name, n in trained.items():
        assert f"{name}: " in text and f"({n} trained, " in text


def test_stats_cli_missing_file_is_one_line_error(tmp_path, capsys):
    assert main(["data", "stats", str(tmp_path / "none.jsonl"), "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "file not found" in err
