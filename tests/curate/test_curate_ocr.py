"""OCR: the word-level intersection rule (fragment cases, punctuation, case, CJK), and the two-engine stage on rendered
text images."""

from __future__ import annotations

import shutil

import pytest
from curate_helpers import dropped, run
from ocr_cases import FRAGMENT_CASES, precision_recall

from mindvl.curate.stages.ocr import intersect_lines, normalise, words
from mindvl.curate.synth import ocr_corpus


def test_intersection_rule_hand_checked():
    assert normalise(" Total: $12.50 ") == "total1250"
    a = ["velvet falcon", "Lamterm willow prism", "cobalt 4006", "ab"]
    b = ["velvet falcon!", "lantern willow prism", "cobalt", "4006", "ab"]
    # line 1 agrees whole; line 2 agrees on its last two words only (m/n in the first); line 3 was split by B: its
    # two agreed words continue each other in A's line and come back as one line; "ab" is below min_chars
    assert intersect_lines(a, b, min_chars=3) == ["velvet falcon", "willow prism", "cobalt 4006"]
    # the same characters read with and without a space: the spaced reading is kept
    assert intersect_lines(["velvet3624"], ["velvet 3624 x"]) == ["velvet 3624"]
    assert intersect_lines(["silent marble"], ["silentmarble"]) == ["silent marble"]
    # A's pieces of one B line that continue each other come back as one line
    assert intersect_lines(["cobalt", "4006 signal"], ["cobalt 4006 signal"]) == ["cobalt 4006 signal"]
    assert intersect_lines(["apple 7", "7306"], ["apple 7306"]) == ["apple 7306"]
    # a box cut inside a word ("emberg"): that word was never read whole by A, so only "glacier" agrees
    assert intersect_lines(["emberg", "glacier", "x"], ["ember glacier"]) == ["glacier"]
    # pieces that do not touch stay apart
    assert intersect_lines(["apple", "7306"], ["apple river 7306"]) == ["apple", "7306"]
    assert intersect_lines(["x y z"], []) == []


@pytest.mark.parametrize("a, b, kept", [
    # The fragment cases and their kin (shared with benchmarks/bench_curate_ocr.py)
    *[(a, b, kept) for _, a, b, kept in FRAGMENT_CASES],
    # ... either way round
    (["Room 305"], ["Room 30"], ["Room"]),
    (["reopened today"], ["open"], []),
    (["Room 305 Floor 21"], ["Room 305", "Floor 2"], ["Room 305 Floor"]),
    # kin: a prefix, a suffix and an inner piece of a longer word; a longer number
    (["inter national"], ["international"], ["inter national"]),  # spacing only: the spaced reading
    (["call 555 1234"], ["call 5551 234"], ["call"]),  # both break inside "5551234", at different places
    # punctuation and case do not count; punctuation inside a token is not a word boundary ("12.50" is one word)
    (["TOTAL: $12.50"], ["total 12.50!"], ["TOTAL: $12.50"]),
    (["e-mail sent"], ["email sent"], ["e-mail sent"]),
    # CJK: every character is a word (no spaces to cut at); a prefix of a line is text both read
    (["欢迎光临本店"], ["欢迎光临"], ["欢迎光临"]),
    (["今天天气很好"], ["今天天气很女子"], ["今天天气很"]),
    (["出口 EXIT 3"], ["出口EXIT3"], ["出口 EXIT 3"]),
])
def test_agreement_is_on_whole_words(a, b, kept):
    assert intersect_lines(a, b) == kept
    # Every kept word is a whole word of a reading, never a piece of one; it is a word of both readings except
    # where one engine read the stretch as one token (dropped spaces: "international" / "inter national").
    wa, wb = words(" ".join(a)), words(" ".join(b))
    for w in words(" ".join(kept)):
        assert w in wa or w in wb, w


def test_words_and_min_chars():
    assert words("Hello, 世界 Room-305  12.50!") == ["hello", "世", "界", "room305", "1250"]
    assert words("ＲＯＯＭ　３０５") == ["room", "305"]  # NFKC: full-width letters and space
    assert words("カタカナ ひらがな 한국어 단어") == [*"カタカナ", *"ひらがな", "한국어", "단어"]
    # min_chars counts the normalised characters of an agreed run (not of each word)
    assert intersect_lines(["ab"], ["ab"]) == [] and intersect_lines(["ab cd"], ["ab cd"]) == ["ab cd"]
    assert intersect_lines(["ab cd"], ["ab cd"], min_chars=5) == []
    # each character of B confirms one run: A's repeated word is confirmed once
    assert intersect_lines(["stop", "stop"], ["stop"]) == ["stop"]


def test_strict_mode_refuses_words_only_one_engine_separated():
    assert intersect_lines(["Room 30 5"], ["Room 305"]) == ["Room 30 5"]  # the lenient default's residual risk
    assert intersect_lines(["Room 30 5"], ["Room 305"], glued_words=False) == ["Room"]
    assert intersect_lines(["meadowriver 4006"], ["meadow river 4006"], glued_words=False) == ["4006"]
    assert intersect_lines(["meadowriver 4006"], ["meadow river 4006"]) == ["meadow river 4006"]
    assert intersect_lines(["Room 305", "Floor 2"], ["Room 305 Floor 21"], glued_words=False) == ["Room 305 Floor"]




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
        wa, wb = words(" ".join(o["rapidocr"])), words(" ".join(o["tesseract"]))
        for w in words(" ".join(o["kept"])):  # every kept word is a whole word of a reading, its characters in both
            assert (w in wa or w in wb) and w in normalise(" ".join(o["rapidocr"])) and w in normalise(
                " ".join(o["tesseract"]))
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


def test_the_stage_keeps_agreed_words_only(tmp_path, monkeypatch):
    """The stage with stand-in engines (no binaries needed): the kept text is the word-level intersection, written
    as the answer; an image with no agreed word is dropped as ocr_no_agreement; `glued_words` reaches the rule."""
    pytest.importorskip("rapidocr_onnxruntime")
    import mindvl.curate.stages.ocr as ocr

    path, _truth = ocr_corpus(str(tmp_path / "in"), 3, seed=3)
    readings = [(["Room 30", "Floor 2"], ["Room 305 Floor 21"]), (["open"], ["reopened today"]),
                (["meadowriver 4006"], ["meadow river 4006"])]
    calls = iter(readings * 2)
    current = {}

    def engine_a(image, text_score=0.5):
        current["pair"] = next(calls)
        return current["pair"][0]

    monkeypatch.setattr(ocr.shutil, "which", lambda name: "/usr/bin/" + name)
    monkeypatch.setattr(ocr, "rapidocr_lines", engine_a)
    monkeypatch.setattr(ocr, "tesseract_lines", lambda image, lang="eng", psm=6: current["pair"][1])
    for glued, third in ((True, "meadow river 4006"), (False, "4006")):
        report, items = run([path], str(tmp_path / f"out{glued}"), [{"ocr": {"glued_words": glued}}],
                            engine="inprocess")
        answers = sorted(it.texts() for it in items)
        assert answers == sorted(["Room\nFloor", third]), answers
        assert dropped(report, "0:ocr") == {"ocr_no_agreement": 1}
