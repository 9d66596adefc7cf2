"""Claim 4's text-only synth task and its held-out probe."""

from __future__ import annotations

import json
import re

from tiny_mindvl import tiny_model_folder

from mindvl.ablate.text_eval import evaluate_text, text_items
from mindvl.data.synth import generate


def test_reverse_task_is_text_only_and_right(tmp_path):
    jsonl = generate(tmp_path / "d", 30, seed=4, tasks=["reverse", "digits"])
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    text = [r for r in records if "images" not in r]
    assert 0 < len(text) < len(records)
    for r in text:
        question, answer = (m["content"] for m in r["messages"])
        assert "<image>" not in question
        assert answer == re.search(r"\d+", question).group()[::-1]
    assert len(list((tmp_path / "d" / "images").iterdir())) == len(records) - len(text)


def test_sort_task_and_the_probe_are_sorting():
    # The probe is `sort`, a task the VL recipes' text data (`reverse`) does not train: hand-checked answers.
    items = text_items(40)
    for question, answer in items:
        digits = re.search(r"\d+", question).group()
        assert answer == "".join(sorted(digits)) and 3 <= len(digits) <= 6
    assert any(a != re.search(r"\d+", q).group() for q, a in items)  # not the identity on these items
    assert text_items(3) == text_items(3, task="sort")


def test_text_probe_matches_chat_and_is_reused(tmp_path):
    from mindvl.infer.chat import chat, load_for_chat

    folder = tiny_model_folder(tmp_path / "m")
    out = tmp_path / "text.jsonl"
    scores = evaluate_text(folder, out, n=5, batch_size=2)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == list(range(5)) and [(r["question"], r["answer"]) for r in rows] == text_items(5)
    model, tok = load_for_chat(folder, None, "cpu")
    for row, score in zip(rows, scores, strict=True):
        # Batched probe == one greedy chat turn without a system prompt, item by item.
        assert row["prediction"] == chat(model, tok, row["question"], system=None, max_new_tokens=16).strip()
        assert score == float(row["prediction"] == row["answer"])
    # A finished file is reused: no model is loaded (the folder may even be gone).
    assert evaluate_text(tmp_path / "missing", out, n=5) == scores
