"""mindvl.eval.scorers against eval-scoring.md §9's golden vectors (computed with the toolkits' own functions) and
the §12 edge cases, under both toolkits where they differ."""

from __future__ import annotations

import pytest

from mindvl.eval import scorers
from mindvl.eval.scorers import (
    MCQPass,
    anls,
    circular_hit,
    mmbench_circular,
    mmbench_extract,
    mme_correct,
    mme_score,
    mme_yes_no,
    ocrbench_hit,
    prepare_prediction,
    relaxed_accuracy,
    relaxed_correctness,
)

LMMS, VLM = "lmms-eval", "vlmevalkit"
HME = "Handwritten Mathematical Expression Recognition"

# ---------------------------------------------------------------------------------------------------------------
# OCRBench (§9 table: answers, prediction, source, category, lmms-eval, VLMEvalKit)
# ---------------------------------------------------------------------------------------------------------------

OCRBENCH_GOLDEN = [
    (["CENTRE"], "The text is centre.", "IIIT5K", "Regular Text Recognition", 1, 1),
    (["CENTRE"], "CENT RE", "IIIT5K", "Regular Text Recognition", 0, 0),
    (["art"], "smart", "WordArt", "Artistic Text Recognition", 1, 1),
    (["ANTONIOS", "ANTONIO'S"], "Antonio's", "ctw", "Irregular Text Recognition", 1, 1),
    (["both sides"], "both\nsides", "STVQA", "Scene Text-centric VQA", 1, 1),
    (["abc"], "a\tbc", "STVQA", "Scene Text-centric VQA", 0, 0),
    (["2590"], "２５９０", "ORAND", "Digit String Recognition", 1, 0),
    (["both sides"], "ｂｏｔｈ　ｓｉｄｅｓ", "STVQA", "Scene Text-centric VQA", 1, 0),
    (["Droits réservés Olivier CABARET"], "droits réservés olivier cabaret", "ESTVQA", "Scene Text-centric VQA", 1, 1),
    (["y _ { 2 } = - 1\n", "y_2 = - 1\n"], "$y_{2}=-1$", "HME100k", HME, 1, 1),
    (["x"], "X", "HME100k", HME, 0, 0),
    (["\\frac { a } { b }"], "\\frac{a}{b}", "HME100k", HME, 1, 1),
    (["abc"], "", "IIIT5K", "Regular Text Recognition", 0, 0),
]


@pytest.mark.parametrize("answers,pred,source,category,lmms,vlm", OCRBENCH_GOLDEN)
def test_ocrbench_golden(answers, pred, source, category, lmms, vlm):
    # each toolkit keys HME on its own column: lmms-eval the source dataset, VLMEvalKit the category (§2.2)
    assert ocrbench_hit(pred, answers, source, LMMS) == lmms
    assert ocrbench_hit(pred, answers, category, VLM) == vlm


def test_ocrbench_edge_cases():
    assert ocrbench_hit("anything", [""]) == 1  # '' is a substring of everything (§2.4-5)
    assert ocrbench_hit("   ", ["abc"]) == 0
    assert ocrbench_hit("  centre \n", "CENTRE") == 1  # a plain-string answer is one answer
    assert ocrbench_hit("nan", ["an"], toolkit=VLM) == 1  # an empty VLMEvalKit prediction reads back as "nan"
    assert ocrbench_hit("No answer", []) == 0
    # folding is full-width ASCII only, never NFKC (①, ², Ⅳ stay), and HME stays width-sensitive under lmms-eval
    assert ocrbench_hit("①", ["1"]) == 0 and ocrbench_hit("x²", ["x2"]) == 0 and ocrbench_hit("Ⅳ", ["IV"]) == 0
    assert ocrbench_hit("２", ["2"], "HME100k") == 0
    assert ocrbench_hit("Ａｂ", ["ab"], "IIIT5K") == 1 and ocrbench_hit("Ａｂ", ["ab"], "IIIT5K", VLM) == 0
    # HME removes spaces but keeps case; either the source or the category name selects it
    assert ocrbench_hit("A B", ["ab"], "HME100k") == 0 and ocrbench_hit("A B", ["AB"], HME, VLM) == 1
    assert ocrbench_hit("a b", ["ab"], "IIIT5K") == 0  # non-HME keeps inner spaces


# ---------------------------------------------------------------------------------------------------------------
# ANLS (§9)
# ---------------------------------------------------------------------------------------------------------------

ANLS_GOLDEN = [
    (["Yes"], "yes", 1.0, 1.0),
    (["1/2/1997"], "1/2/97", 0.75, 0.75),
    (["abc"], "abd", 2 / 3, 2 / 3),
    (["abcd"], "ab", 0.5, 0.5),
    (["abcde"], "ab", 0.0, 0.0),
    (["New  York"], " new york ", 1.0, 1.0),
    (["ab"], "a b   ", 2 / 3, 5 / 6),
    (["cat", "dog"], "dog", 1.0, 1.0),
    (["abc"], "  abd\n", 2 / 3, 5 / 6),
    (["ß"], "s", 0.5, 0.5),
    ([""], "", 1.0, 1.0),
    (["0.5"], "0.50", 0.75, 0.75),
    (["$1,000"], "1000", 2 / 3, 2 / 3),
    (["ITC Limited"], "The answer is ITC Limited", 0.0, 0.0),
]


@pytest.mark.parametrize("answers,pred,lmms,vlm", ANLS_GOLDEN)
def test_anls_golden(answers, pred, lmms, vlm):
    assert anls(pred, answers, LMMS) == pytest.approx(lmms, abs=1e-9)
    assert anls(pred, answers, VLM) == pytest.approx(vlm, abs=1e-9)


def test_anls_edge_cases():
    assert anls("dog", ["cat", "dog", "bird"]) == 1.0  # best ground truth
    assert anls("cot", ["cat", "xyz"]) == pytest.approx(2 / 3)
    assert anls("", ["abc"]) == 0.0 and anls("   ", ["abc"], toolkit=VLM) == 0.0
    assert anls("   ", [""]) == 1.0  # lmms-eval strips to "" first
    # VLMEvalKit keeps the raw whitespace in the length: distance 1 ("a" vs "ab") over 5 raw chars
    assert anls(" a   ", ["ab"], toolkit=VLM) == pytest.approx(0.8)
    assert anls(" a   ", ["ab"]) == pytest.approx(0.5)  # lmms-eval: "a" vs "ab", 1/2 -> exactly 0.5, kept
    assert anls("abc", "abc") == 1.0  # a plain-string answer
    with pytest.raises(ValueError, match="ground-truth"):
        anls("x", [])


# ---------------------------------------------------------------------------------------------------------------
# ChartQA relaxed accuracy (§9: target, prediction, now, VLMEvalKit before 2025-09-01)
# ---------------------------------------------------------------------------------------------------------------

CHARTQA_GOLDEN = [
    ("12.5", "12", 1, 1),
    ("100", "105", 1, 1),
    ("100", "105.0001", 0, 1),
    ("100", "95.1", 1, 0),
    ("0", "0", 1, 1),
    ("0", "0.0", 0, 0),
    ("45%", "45", 0, 0),
    ("45%", "0.45", 1, 1),
    ("45", "45%", 0, 0),
    ("Yes", "yes", 1, 1),
    ("Yes", "Yes.", 0, 0),
    ("1,000", "1000", 0, 0),
    ("1000", "1_000", 1, 1),
    ("-10", "-10.4", 1, 1),
    ("5", "nan", 0, 0),
    ("17", " 17 ", 1, 1),
    ("2019", "2019.0", 1, 1),
    ("0.57", "57%", 1, 1),
]


@pytest.mark.parametrize("target,pred,now,before", CHARTQA_GOLDEN)
def test_chartqa_golden(target, pred, now, before):
    assert relaxed_accuracy(pred, target, LMMS) == now
    assert relaxed_accuracy(pred, target, VLM) == now
    # the pre-677e30a5 VLMEvalKit called relaxed_correctness(pred, gt): the tolerance relative to the prediction
    assert int(relaxed_correctness(pred.strip(), target)) == before


def test_chartqa_edge_cases():
    assert relaxed_accuracy("", "0") == 0.0 and relaxed_accuracy("   ", "") == 1.0  # "" == "" after the strip
    assert relaxed_accuracy("１２", "12") == 1.0  # Python float() reads full-width digits
    assert relaxed_accuracy("7", ["3", "7.2"]) == 1.0 and relaxed_accuracy("5", ["3", "7"]) == 0.0
    assert relaxed_accuracy("inf", "5") == 0.0
    assert relaxed_accuracy("0", "0%") == 0.0  # 0% parses to 0.0: falsy, string compare "0" vs "0%"


# ---------------------------------------------------------------------------------------------------------------
# MME
# ---------------------------------------------------------------------------------------------------------------

MME_GOLDEN = [
    ("Yes", "yes", "Yes"), ("yes.", "yes", "Yes"), ("No.", "no", "No"), ("Yes, there is a dog.", "yes", "Yes"),
    ("There is no dog.", "other", "No"), ("Not sure", "no", "Unknown"), ("y", "yes", "Unknown"),
    ("n", "no", "Unknown"), ("Yes and no", "yes", "Unknown"), ("I think yes", "other", "Yes"),
    ("nope", "no", "Unknown"), ("None", "no", "Unknown"), ("The answer is No", "other", "No"),
    ("YES!", "yes", "Yes"), ("No, it is not.", "no", "No"), ("Sure", "other", "Unknown"), ("", "other", "Unknown"),
]


@pytest.mark.parametrize("pred,lmms,vlm", MME_GOLDEN)
def test_mme_yes_no_golden(pred, lmms, vlm):
    assert mme_yes_no(pred, LMMS) == lmms
    assert mme_yes_no(pred, VLM) == vlm


def test_mme_correct_case_rules():
    assert mme_correct("yes", "Yes") and mme_correct("YES.", "yes.")  # lmms-eval lower-cases the answer too
    assert mme_correct("yes", "Yes", VLM) and not mme_correct("yes", "yes", VLM)  # VLMEvalKit: case-sensitive
    assert not mme_correct("maybe", "No") and not mme_correct("Sure", "No", VLM)  # other / Unknown are wrong
    assert mme_yes_no("   no  ") == "no" and mme_yes_no("Yes/no", VLM) == "Unknown"  # '/' becomes a space


# correct answers per image (out of 2), 3 images per category; gives §9's per-category scores
MME_PATTERN = {
    "existence": (2, 2, 0), "count": (1, 1, 1), "position": (1, 1, 1), "color": (2, 2, 2), "posters": (2, 2, 0),
    "celebrity": (2, 2, 1), "scene": (2, 1, 1), "landmark": (2, 2, 1), "artwork": (1, 1, 1), "OCR": (2, 2, 1),
    "commonsense_reasoning": (2, 2, 2), "numerical_calculation": (2, 1, 1), "text_translation": (2, 1, 1),
    "code_reasoning": (1, 1, 1),
}
MME_CATEGORY_SCORES = {
    "existence": 133.33, "count": 50, "position": 50, "color": 200, "posters": 133.33, "celebrity": 150, "scene": 100,
    "landmark": 150, "artwork": 50, "OCR": 150, "commonsense_reasoning": 200, "numerical_calculation": 100,
    "text_translation": 100, "code_reasoning": 50,
}


def _mme_rows() -> list[dict]:
    rows = []
    for cat, pattern in MME_PATTERN.items():
        for i, n_right in enumerate(pattern):
            for q in range(2):
                rows.append({"category": cat, "pair_id": f"{cat}/{i}.png", "correct": q < n_right})
    return rows


@pytest.mark.parametrize("toolkit", [LMMS, VLM])
def test_mme_score_golden_aggregate(toolkit):
    rows = _mme_rows()
    assert len(rows) == 84
    res = mme_score(rows, toolkit)
    assert res["perception"] == pytest.approx(1166.6667, abs=1e-3)
    assert res["cognition"] == pytest.approx(450.0)
    assert res["total"] / 28 == pytest.approx(57.738, abs=1e-3)
    for cat, score in MME_CATEGORY_SCORES.items():
        assert res["categories"][cat]["score"] == pytest.approx(score, abs=0.01)
    assert res["categories"]["existence"]["acc"] == pytest.approx(200 / 3)
    assert res["categories"]["existence"]["acc_plus"] == pytest.approx(200 / 3)


def test_mme_score_pairing_rules_differ():
    base = [r for r in _mme_rows() if r["category"] != "count"]
    def q(pair, correct):
        return {"category": "count", "pair_id": pair, "correct": correct}

    # images a (T, F, T) and c (T, T, F) have 3 questions, b (T, F) has 2
    extra = [q("a", True), q("a", False), q("a", True), q("b", True), q("b", False),
             q("c", True), q("c", True), q("c", False)]
    with pytest.raises(ValueError, match="exactly 2"):
        mme_score(base + extra, LMMS)
    vlm = mme_score(base + extra, VLM)  # acc over all 8 questions (5 right), acc+ over each image's first two
    assert vlm["categories"]["count"] == pytest.approx({"acc": 62.5, "acc_plus": 100 / 3, "score": 62.5 + 100 / 3})
    lenient = mme_score(base + extra, LMMS, strict=False)  # a and c left out: only b counts -> 50 + 0
    assert lenient["categories"]["count"]["score"] == 50.0 and lenient["unpaired_images"] == 2

    single = base + [{"category": "count", "pair_id": "c", "correct": True}]
    with pytest.raises(ValueError, match="at least 2"):
        mme_score(single, VLM)
    assert mme_score(single, VLM, strict=False)["missing_categories"] == ["count"]


def test_mme_score_missing_and_unknown_categories():
    rows = [r for r in _mme_rows() if r["category"] in ("color", "code_reasoning")]
    lmms = mme_score(rows, LMMS)  # lmms-eval sums whatever categories ran
    assert (lmms["perception"], lmms["cognition"]) == (200.0, 50.0)
    with pytest.raises(ValueError, match="all 14 categories"):
        mme_score(rows, VLM)
    assert len(mme_score(rows, VLM, strict=False)["missing_categories"]) == 12
    with pytest.raises(ValueError, match="unknown MME category"):
        mme_score([{"category": "Color", "pair_id": "x", "correct": True}])


# ---------------------------------------------------------------------------------------------------------------
# MMBench
# ---------------------------------------------------------------------------------------------------------------

CHOICES = {"A": "teddy bear", "B": "rabbit", "C": "cat", "D": "dog"}
# §9: prediction, lmms-eval can_infer, lmms-eval extract_mcq_answer, VLMEvalKit can_infer (None = False / "")
MMBENCH_GOLDEN = [
    ("A", "A", "A", "A"),
    ("B.", "B", "B", "B"),
    ("(C)", "C", "C", "C"),
    ("The answer is D.", "D", "D", "D"),
    ("A cat is sitting on the mat.", "C", "A", "C"),
    ("C. cat", "C", "C", "C"),
    ("cat", "C", None, "C"),
    ("It is a rabbit or a cat", None, None, None),
    ("Answer: B", "B", "B", "B"),
    ("B is wrong; the correct answer is **C**.", "B", "B", "C"),
    ("I choose D because A, B and C are wrong", "A", "C", None),
    ("Option B", "B", "B", "B"),
    ("b", None, None, None),
    ("", None, None, None),
]


@pytest.mark.parametrize("pred,lmms_infer,lmms_static,vlm", MMBENCH_GOLDEN)
def test_mmbench_extract_golden(pred, lmms_infer, lmms_static, vlm):
    infer = scorers._lmms_can_infer_option(pred) or scorers._lmms_can_infer_text(pred, CHOICES)
    assert infer == lmms_infer
    assert scorers._lmms_static_extract(pred, list(CHOICES)) == lmms_static
    # the lmms-eval static route: can_infer first, the static extractor for what it leaves unresolved
    assert mmbench_extract(pred, CHOICES, LMMS) == (lmms_infer or lmms_static)
    assert mmbench_extract(pred, CHOICES, VLM) == vlm


def test_mmbench_extract_toolkit_specific_rules():
    late = "C is the answer I would pick here for sure"
    assert mmbench_extract(late, CHOICES, LMMS) == "C"
    assert mmbench_extract(late, CHOICES, VLM) is None  # VLMEvalKit: the letter must be among the last 5 tokens
    assert mmbench_extract("Cannot determine the answer", CHOICES, VLM) == "Z"  # refusal
    assert mmbench_extract("my final answer is b", CHOICES, VLM) == "B"  # the (?i) "answer is X" regex
    long = "cat " + "and more words " * 4  # over twice the options' total length: no text match in VLMEvalKit
    assert mmbench_extract(long, CHOICES, VLM) is None and mmbench_extract(long, CHOICES, LMMS) == "C"
    with_e = {**CHOICES, "E": "horse"}
    assert mmbench_extract("horse", with_e, VLM) == "E"
    assert mmbench_extract("horse", with_e, LMMS) is None  # lmms-eval's text match looks at A-D only (§6.5-5)
    assert mmbench_extract("  (B)  ", CHOICES, LMMS) == "B"


def _rotations() -> list[dict[str, str]]:
    """The four passes of a question whose answer is "cat": options rotate, the answer letter is C, B, A, D."""
    return [
        {"A": "teddy bear", "B": "rabbit", "C": "cat", "D": "dog"},
        {"A": "rabbit", "B": "cat", "C": "dog", "D": "teddy bear"},
        {"A": "cat", "B": "dog", "C": "teddy bear", "D": "rabbit"},
        {"A": "dog", "B": "teddy bear", "C": "rabbit", "D": "cat"},
    ]


CIRCULAR_GOLDEN = {  # §9: predictions per pass, expected hit (both toolkits agree on these four)
    "all_correct": (["C", "B", "A", "D"], 1),
    "one_wrong": (["C", "B", "B", "D"], 0),
    "free_text_all_ok": (["cat", "The answer is B.", "A", "D. cat"], 1),
    "one_unparseable": (["C", "B", "I am not sure", "D"], 0),
}


@pytest.mark.parametrize("toolkit", [LMMS, VLM])
def test_mmbench_circular_golden(toolkit):
    groups = {
        name: [MCQPass(p, ch, gt) for p, ch, gt in zip(preds, _rotations(), "CBAD", strict=True)]
        for name, (preds, _) in CIRCULAR_GOLDEN.items()
    }
    res = mmbench_circular(groups, toolkit)
    assert res["hits"] == {name: hit for name, (_, hit) in CIRCULAR_GOLDEN.items()}
    assert res["accuracy"] == 0.5


def test_circular_hit_rules():
    assert circular_hit(["A", "B"], ["A", "B"]) == 1
    assert circular_hit(["A", None], ["A", "B"]) == 0  # unresolved without a judge is wrong
    assert circular_hit([], []) == 0
    assert scorers.mmbench_group("3000017") == 17 and scorers.mmbench_group(17) == 17
    with pytest.raises(ValueError):
        circular_hit(["A"], ["A", "B"])


# ---------------------------------------------------------------------------------------------------------------
# Pipeline and toolkit names
# ---------------------------------------------------------------------------------------------------------------


def test_prepare_prediction():
    assert prepare_prediction("  Yes \n") == "Yes"
    assert prepare_prediction(None) == "" and prepare_prediction("   ") == ""
    assert prepare_prediction("  Yes \n", VLM) == "  Yes \n"  # VLMEvalKit does not strip
    assert prepare_prediction("", VLM) == "nan" and prepare_prediction(None, "VLMEvalKit") == "nan"
    assert prepare_prediction("   ", VLM) == "   "  # whitespace is not NaN to pandas
    assert prepare_prediction("None", VLM) == "nan" and prepare_prediction("None") == "None"  # pandas na_values


@pytest.mark.parametrize(
    "call",
    [
        lambda t: anls("a", ["a"], t),
        lambda t: relaxed_accuracy("1", "1", t),
        lambda t: ocrbench_hit("a", ["a"], None, t),
        lambda t: mme_yes_no("yes", t),
        lambda t: mme_score([], t),
        lambda t: mmbench_extract("A", CHOICES, t),
        lambda t: mmbench_circular({}, t),
        lambda t: prepare_prediction("a", t),
    ],
)
def test_unknown_toolkit_raises(call):
    with pytest.raises(ValueError, match="unknown toolkit 'opencompass'.*lmms-eval, vlmevalkit"):
        call("opencompass")
