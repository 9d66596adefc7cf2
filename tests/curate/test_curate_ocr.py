"""OCR: the line-level intersection rule, and the two-engine stage on rendered text images."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from curate_helpers import run

from mindvl.curate.stages.ocr import intersect_lines, normalise
from mindvl.curate.synth import ocr_corpus


def test_intersection_rule_hand_checked():
    assert normalise(" Total: $12.50 ") == "total1250"
    a = ["velvet falcon", "Lamterm willow prism", "cobalt 4006", "ab"]
    b = ["velvet falcon!", "lantern willow prism", "cobalt", "4006", "ab"]
    # line 1 agrees whole; line 2 disagrees (m/n); line 3 was split by B: B's touching pieces inside it agree and
    # merge back into one line; "ab" is below min_chars
    assert intersect_lines(a, b, min_chars=3) == ["velvet falcon", "cobalt 4006"]
    # the same characters read with and without a space: the spaced reading is kept
    assert intersect_lines(["velvet3624"], ["velvet 3624 x"]) == ["velvet 3624"]
    assert intersect_lines(["silent marble"], ["silentmarble"]) == ["silent marble"]
    # A's pieces of one B line (even cut mid-word, overlapping) come back as B's span
    assert intersect_lines(["cobalt", "4006 signal"], ["cobalt 4006 signal"]) == ["cobalt 4006 signal"]
    assert intersect_lines(["emberg", "glacier", "x"], ["ember glacier"]) == ["ember glacier"]
    assert intersect_lines(["apple 7", "7306"], ["apple 7306"]) == ["apple 7306"]
    # pieces that do not touch stay apart
    assert intersect_lines(["apple", "7306"], ["apple river 7306"]) == ["apple", "7306"]
    assert intersect_lines(["x y z"], []) == []


def _words(lines: list[str]) -> Counter:
    return Counter(w for t in lines for w in t.casefold().split())


def precision_recall(pred: list[str], truth: list[str]) -> tuple[float, float]:
    p, t = _words(pred), _words(truth)
    hit = sum((p & t).values())
    return hit / max(1, sum(p.values())), hit / max(1, sum(t.values()))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tesseract") is None, reason="tesseract is not installed (apt-get install -y "
                    "tesseract-ocr); CI does not install it, RESULTS.md has the measured run")
def test_two_engine_ocr_on_rendered_text(tmp_path):
    pytest.importorskip("rapidocr_onnxruntime")
    path, truth = ocr_corpus(str(tmp_path / "in"), 8, seed=3)
    report, items = run([path], str(tmp_path / "out"), [{"ocr": {"drop_without_agreement": False}}])
    assert len(items) == 8
    by_line = {int(it.where.rsplit(":", 1)[1]) - 1: it for it in items}
    pred = {"rapidocr": [], "tesseract": [], "kept": []}
    gt = []
    for i, it in by_line.items():
        o = it.meta["ocr"]
        for line in o["kept"]:  # every kept line is read by both engines
            n = normalise(line)
            assert any(n in normalise(x) for x in o["rapidocr"]) or any(normalise(x) in n for x in o["rapidocr"])
            assert any(n in normalise(x) for x in o["tesseract"]) or any(normalise(x) in n for x in o["tesseract"])
        assert it.texts() == ("\n".join(o["kept"]) if o["kept"] else "(to be read)")
        for k in pred:
            pred[k] += o[k]
        gt += truth[i]
    prec = {k: precision_recall(v, gt)[0] for k, v in pred.items()}
    assert prec["kept"] >= max(prec["rapidocr"], prec["tesseract"])
    ex = report["extra"]["0:ocr"]
    assert ex["ocr_images"] == 8 and ex["lines_kept"] == len(pred["kept"])


def test_coverage_of_the_kept_text_against_a_vocabulary():
    from mindvl.curate.stages.ocr import coverage

    extra = {"char_counts": {"a": 3, "b": 1, "c": 2}, "vocabulary": ["ab", "cd", "zz"], "vocab_word_counts": {"ab": 2}}
    cov = coverage(extra)
    assert cov["distinct_characters"] == 3 and cov["rarest_characters"] == "bca"
    assert cov["vocabulary_words_covered"] == "1/3 (33.3%)"
    assert cov["vocabulary_characters_covered"] == "3/5 (60.0%)"  # a b c of a b c d z
    assert cov["missing_words"] == "cd zz"
