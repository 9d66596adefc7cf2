"""Scoring rules of lmms-eval and VLMEvalKit as pure functions (eval-scoring.md, cited as §N).

Every function that depends on the toolkit takes `toolkit: str = "lmms-eval"`; `"vlmevalkit"` selects VLMEvalKit's
rule, any other value raises ValueError. Versions followed are the ones pinned in the report's header (lmms-eval
0.7.2 @ 75571cfe, VLMEvalKit 0.2rc1 @ e8e78f05): full-width folding in OCRBench (lmms-eval >= 2026-07-30),
target-relative ChartQA tolerance in both, VLMEvalKit's "last 5 tokens" and "answer is X" MMBench rules.

What a toolkit's *pipeline* does to a prediction before its scorer sees it (§1) is split off into
`prepare_prediction`: lmms-eval strips every generation, VLMEvalKit round-trips predictions through an xlsx/tsv file
so an empty generation comes back as the string "nan". The scorers below apply lmms-eval's strip themselves (it is
idempotent, and §9's golden vectors include it) but never the "nan" substitution, which belongs to the file round trip;
`mindvl.eval.benchmarks` applies `prepare_prediction` before scoring.

Not reproduced, on purpose: LLM judges (VLMEvalKit's gpt-4o-mini fallback, lmms-eval's GPT route for `mmbench_en_dev`);
without them VLMEvalKit behaves as with `--judge exact_matching` (unresolved = wrong) and lmms-eval as
`mmbench_en_dev_static`. lmms-eval's `<think>` stripping on CLI runs (§1) is left to the caller. lmms-eval's
module-global OCRBench accumulator (§2.4-6) is not reproduced: every call scores as a fresh process would.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

LMMS_EVAL = "lmms-eval"
VLMEVALKIT = "vlmevalkit"
TOOLKITS = (LMMS_EVAL, VLMEVALKIT)


def check_toolkit(toolkit: str) -> str:
    """The canonical toolkit name (case-insensitive match), or ValueError naming the known ones."""
    name = str(toolkit).lower()
    if name not in TOOLKITS:
        raise ValueError(f"unknown toolkit {toolkit!r} (known: {', '.join(TOOLKITS)})")
    return name


# pandas' default `na_values`: whole cells that `read_csv` / `read_excel` read as NaN.
PANDAS_NA = frozenset({
    "", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND", "1.#QNAN", "<NA>", "N/A",
    "NA", "NULL", "NaN", "None", "n/a", "nan", "null",
})


def prepare_prediction(prediction: str | None, toolkit: str = LMMS_EVAL) -> str:
    """What the toolkit's pipeline hands to its scorers (§1, §12-1).

    lmms-eval: `res.strip()` on every `generate_until` output (None is treated as an empty generation).
    VLMEvalKit: the prediction unchanged, except that it is written to an xlsx/tsv file and read back with pandas
    before scoring, so an empty generation comes back as NaN and is scored as `str(NaN)` = "nan" (§1). The same
    happens to the other whole-cell strings in pandas' default `na_values` ("None", "NA", "null", ...): §1 names only
    the empty case; the rest is how pandas reads any cell.
    """
    toolkit = check_toolkit(toolkit)
    text = "" if prediction is None else str(prediction)
    if toolkit == LMMS_EVAL:
        return text.strip()
    return "nan" if text in PANDAS_NA else text


def _as_list(answers: str | Sequence[str]) -> list[str]:
    return [answers] if isinstance(answers, str) else [str(a) for a in answers]


# ---------------------------------------------------------------------------------------------------------------
# DocVQA / InfoVQA: ANLS (§3)
# ---------------------------------------------------------------------------------------------------------------


def levenshtein(a: str, b: str) -> int:
    """Unit-cost character Levenshtein distance (insert, delete, substitute), as both toolkits compute it (§3.1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def _normalised_distance(gt: str, pred: str) -> float:
    """§3.1 `nl`: distance between lower-cased, whitespace-collapsed strings over the longer *raw* length.

    The denominator uses the raw strings' `.upper()` lengths (§3.3-1, -3): extra whitespace raises the score and
    "ß" counts as 2 characters.
    """
    g = " ".join(gt.strip().lower().split())
    p = " ".join(pred.strip().lower().split())
    length = max(len(gt.upper()), len(pred.upper()))
    return 0.0 if length == 0 else levenshtein(g, p) / length


def anls(prediction: str, answers: str | Sequence[str], toolkit: str = LMMS_EVAL, threshold: float = 0.5) -> float:
    """Per-question ANLS (§3.1): 1 - the smallest normalised distance to any answer, 0 if that is below `threshold`.

    A similarity of exactly `threshold` is kept (strict `<`, §3.3-4); both strings empty give 1.0 (§3.3-5).
    lmms-eval scores the stripped prediction; VLMEvalKit the raw one, so surrounding whitespace enters the
    length denominator there (§3.3-1, -2). The benchmark score is the mean over questions (lmms-eval reports it in
    [0, 1], VLMEvalKit ×100).
    """
    toolkit = check_toolkit(toolkit)
    gts = _as_list(answers)
    if not gts:
        raise ValueError("anls needs at least one ground-truth answer")
    pred = prediction.strip() if toolkit == LMMS_EVAL else prediction
    similarity = 1.0 - min(_normalised_distance(g, pred) for g in gts)
    return 0.0 if similarity < threshold else similarity


# ---------------------------------------------------------------------------------------------------------------
# ChartQA: relaxed accuracy (§4)
# ---------------------------------------------------------------------------------------------------------------


def to_float(text: str) -> float | None:
    """§4.1 `to_float`: Python `float()` semantics ('1_000', ' 17 ', 'nan', 'inf' parse), a trailing '%' means /100."""
    try:
        if text.endswith("%"):
            return float(text.rstrip("%")) / 100.0
        return float(text)
    except ValueError:
        return None


def relaxed_correctness(target: str, prediction: str, tolerance: float = 0.05) -> bool:
    """§4.1 `relaxed`: numbers within `tolerance` of the *target* (inclusive); otherwise case-insensitive equality.

    A target of 0 is falsy and falls through to the string comparison ("0" vs "0.0" is wrong, §4.3-1); "nan" parses
    but every comparison with it is False (§4.3-4).
    """
    p, t = to_float(prediction), to_float(target)
    if p is not None and t:
        return abs(p - t) / abs(t) <= tolerance
    return prediction.lower() == target.lower()


def relaxed_accuracy(prediction: str, target: str | Sequence[str], toolkit: str = LMMS_EVAL) -> float:
    """ChartQA per-question score, 1.0 or 0.0 (§4.1).

    Both toolkits strip the prediction (lmms-eval in its pipeline, VLMEvalKit in `process_line`) and measure the
    tolerance against the target (VLMEvalKit since 677e30a5, 2025-09-01; §4.3-7). Several targets (a VLMEvalKit
    answer that is a list literal) count if any matches (`hit_calculate` takes the max).
    """
    check_toolkit(toolkit)
    pred = prediction.strip()
    return 1.0 if any(relaxed_correctness(t, pred) for t in _as_list(target)) else 0.0


# ---------------------------------------------------------------------------------------------------------------
# OCRBench (§2)
# ---------------------------------------------------------------------------------------------------------------

OCRBENCH_TEXT_RECOGNITION = (
    "Regular Text Recognition",
    "Irregular Text Recognition",
    "Artistic Text Recognition",
    "Handwriting Recognition",
    "Digit String Recognition",
    "Non-Semantic Text Recognition",
)
HME_CATEGORY = "Handwritten Mathematical Expression Recognition"
HME_SOURCE = "HME100k"
# §2.1: the ten categories; VLMEvalKit reports the first six summed as "Text Recognition".
OCRBENCH_CATEGORIES = (
    *OCRBENCH_TEXT_RECOGNITION,
    "Scene Text-centric VQA",
    "Doc-oriented VQA",
    "Key Information Extraction",
    HME_CATEGORY,
)
OCRBENCH_TOTAL = 1000  # lmms-eval divides by this whatever the number of items (§2.4-7)

# lmms-eval `_fold_fullwidth_ascii` (§2.2): U+FF01..U+FF5E -> ASCII, U+3000 -> space; nothing else (not NFKC).
_FULLWIDTH = {code: code - 0xFEE0 for code in range(0xFF01, 0xFF5F)}
_FULLWIDTH[0x3000] = ord(" ")


def fold_fullwidth(text: str) -> str:
    """lmms-eval's full-width ASCII folding (§2.2, §2.4-1); ①, ², Ⅳ, ㎏ are left alone."""
    return text.translate(_FULLWIDTH)


def is_hme(dataset: str | None) -> bool:
    """Whether an OCRBench item takes the HME100k rule (§2.2).

    lmms-eval keys on the source dataset name ("HME100k", HF column `dataset`), VLMEvalKit on the category
    ("Handwritten Mathematical Expression Recognition", TSV column `category`). In the official data the two
    coincide (§2.1: the HME category *is* the 100 HME100k items), so either name is accepted under both toolkits.
    """
    return dataset in (HME_SOURCE, HME_CATEGORY)


def ocrbench_hit(
    prediction: str, answers: str | Sequence[str], dataset: str | None = None, toolkit: str = LMMS_EVAL
) -> int:
    """OCRBench per-item hit, 1 or 0 (§2.2): some answer is a substring of the prediction.

    `dataset` is the item's source ("HME100k") or category; only HME changes the rule: case-sensitive, all spaces
    removed (`\\n` first mapped to a space). Other items: lower-cased, stripped, `\\n` -> ' ', nothing else
    normalised (§2.4-4); lmms-eval also folds full-width ASCII first, VLMEvalKit does not (§2.4-1).
    An empty answer is contained in anything (§2.4-5).
    """
    toolkit = check_toolkit(toolkit)
    hme = is_hme(dataset)
    pred = prediction.strip() if toolkit == LMMS_EVAL else prediction
    fold = fold_fullwidth if toolkit == LMMS_EVAL and not hme else (lambda s: s)  # HME stays width-sensitive
    for answer in _as_list(answers):
        if hme:
            a = answer.strip().replace("\n", " ").replace(" ", "")
            p = pred.strip().replace("\n", " ").replace(" ", "")
        else:
            a = fold(answer).lower().strip().replace("\n", " ")
            p = fold(pred).lower().strip().replace("\n", " ")
        if a in p:
            return 1
    return 0


# ---------------------------------------------------------------------------------------------------------------
# MME (§5)
# ---------------------------------------------------------------------------------------------------------------

MME_PERCEPTION = (
    "existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork", "OCR",
)
MME_COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")
MME_CATEGORIES = MME_PERCEPTION + MME_COGNITION

# VQAv2's punctuation routine, which VLMEvalKit's `process_punctuation` is (§5.3).
_VQA_PUNCT = (";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!")
_DIGIT_COMMA_DIGIT = re.compile(r"\d,\d")
_PERIOD_NOT_BEFORE_DIGIT = re.compile(r"\.(?!\d)")


def process_punctuation(text: str) -> str:
    """VLMEvalKit `process_punctuation` (§5.3), the VQAv2 routine.

    Each mark in `_VQA_PUNCT` is deleted if it touches a space somewhere in the text (or the text has a
    digit,digit comma anywhere), else replaced by a space. Then '.' is deleted unless a digit follows it, at most 32
    times: the original passes `re.UNICODE` (= 32) where `re.sub` expects its `count`.
    """
    delete = _DIGIT_COMMA_DIGIT.search(text) is not None
    out = text
    for mark in _VQA_PUNCT:
        if delete or f"{mark} " in text or f" {mark}" in text:
            out = out.replace(mark, "")
        else:
            out = out.replace(mark, " ")
    return _PERIOD_NOT_BEFORE_DIGIT.sub("", out, count=32)


def mme_yes_no(prediction: str, toolkit: str = LMMS_EVAL) -> str:
    """The yes/no read from an MME prediction, in the toolkit's own labels (§5.3).

    lmms-eval `parse_pred_ans` -> "yes" | "no" | "other": exact "yes"/"no" after lower/strip/'.' removal, "y"/"n",
    else whichever of "yes"/"no" occurs in the first four characters ("Not sure", "None", "nope" -> "no").
    VLMEvalKit `YOrN_Extraction` -> "Yes" | "No" | "Unknown": the whole word "yes" xor "no" after lower-casing and
    `process_punctuation`. ("Unknown" would go to an LLM judge; without one it scores as wrong.)
    """
    toolkit = check_toolkit(toolkit)
    if toolkit == LMMS_EVAL:
        p = prediction.lower().strip().replace(".", "")
        if p in ("yes", "no"):
            return p
        if len(p) == 1:
            return {"y": "yes", "n": "no"}.get(p, "other")
        head = p[:4]
        return "yes" if "yes" in head else "no" if "no" in head else "other"
    words = process_punctuation(prediction.lower()).split()
    if "yes" in words and "no" not in words:
        return "Yes"
    if "no" in words and "yes" not in words:
        return "No"
    return "Unknown"


def mme_correct(prediction: str, answer: str, toolkit: str = LMMS_EVAL) -> bool:
    """Whether an MME prediction matches its "Yes"/"No" answer (§5.3, §5.6-4).

    lmms-eval compares with the answer lower-cased and '.'-free; VLMEvalKit compares case-sensitively with the
    answer as stored ("Yes"/"No" in its TSV).
    """
    toolkit = check_toolkit(toolkit)
    parsed = mme_yes_no(prediction, toolkit)
    if toolkit == LMMS_EVAL:
        return parsed == answer.lower().replace(".", "")
    return parsed == answer


def mme_score(rows: Iterable[Mapping[str, Any]], toolkit: str = LMMS_EVAL, strict: bool = True) -> dict[str, Any]:
    """MME totals (§5.2) from per-question rows `{"category", "pair_id", "correct"}`.

    `pair_id` is the image both questions share (lmms-eval `question_id`, VLMEvalKit `image_path`). Per category:
    acc = % of questions right, acc+ = % of images with both right, score = acc + acc+ (max 200). Perception sums
    the 10 perception categories (max 2000), cognition the 4 others (max 800; VLMEvalKit calls it "reasoning").

    Where the toolkits differ (§5.2, §5.6-1): lmms-eval asserts exactly 2 questions per image; VLMEvalKit takes acc
    over all questions, acc+ over each image's first two, fails on an image with 1 question and raises if any of the
    14 categories is absent. With `strict=True` those failures raise ValueError; with `strict=False` offending images
    are left out (counted in "unpaired_images") and absent categories are listed in "missing_categories" instead.

    Returns {"perception", "cognition", "total", "categories": {name: {"acc", "acc_plus", "score"}},
    "unpaired_images", "missing_categories"}. A category outside §5.1's 14 raises ValueError (the toolkits know only
    those).
    """
    toolkit = check_toolkit(toolkit)
    by_cat: dict[str, dict[Hashable, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        cat = row["category"]
        if cat not in MME_CATEGORIES:
            raise ValueError(f"unknown MME category {cat!r} (known: {', '.join(MME_CATEGORIES)})")
        by_cat[cat][row["pair_id"]].append(bool(row["correct"]))

    categories: dict[str, dict[str, float]] = {}
    unpaired = 0
    for cat, images in by_cat.items():
        kept: list[list[bool]] = []
        for pair_id, answers in images.items():
            bad = len(answers) != 2 if toolkit == LMMS_EVAL else len(answers) < 2
            if bad:
                if strict:
                    raise ValueError(
                        f"MME image {pair_id!r} ({cat}) has {len(answers)} question(s); {toolkit} needs "
                        f"{'exactly 2' if toolkit == LMMS_EVAL else 'at least 2'} (§5.6-1)"
                    )
                unpaired += 1
                continue
            kept.append(answers)
        if not kept:
            continue
        if toolkit == LMMS_EVAL:  # mean over images of (#right/#asked)*100
            acc = sum(100.0 * sum(a) / len(a) for a in kept) / len(kept)
            acc_plus = sum(100.0 * (sum(a) == 2) for a in kept) / len(kept)
        else:  # mean over all questions; acc+ over each image's first two
            flat = [x for a in kept for x in a]
            acc = 100.0 * sum(flat) / len(flat)
            acc_plus = sum(100.0 * (a[0] and a[1]) for a in kept) / len(kept)
        categories[cat] = {"acc": acc, "acc_plus": acc_plus, "score": acc + acc_plus}

    missing = [c for c in MME_CATEGORIES if c not in categories]
    if toolkit == VLMEVALKIT and missing and strict:
        raise ValueError(f"VLMEvalKit's MME_rating needs all 14 categories; missing: {', '.join(missing)} (§5.2)")
    perception = sum(categories[c]["score"] for c in MME_PERCEPTION if c in categories)
    cognition = sum(categories[c]["score"] for c in MME_COGNITION if c in categories)
    return {
        "perception": perception,
        "cognition": cognition,
        "total": perception + cognition,
        "categories": categories,
        "unpaired_images": unpaired,
        "missing_categories": missing,
    }


# ---------------------------------------------------------------------------------------------------------------
# MMBench (§6)
# ---------------------------------------------------------------------------------------------------------------

MMBENCH_GROUP = 1_000_000  # circular copy k of question q has index q + k * 1e6 (§6.1)

_API_FAILURE = "Failed to obtain answer via API"
# VLMEvalKit `can_infer_option`: refusals that map to the "no answer" letter Z (§6.3).
_VLM_REFUSALS = (
    "Sorry, I can't help with images of people yet.",
    "I can't process this file.",
    "I'm sorry, but without the image provided",
    "Cannot determine the answer",
)
_VLM_SEPARATORS = str.maketrans({c: " " for c in ".()[],:;!*#{}"})
_VLM_ANSWER_IS = re.compile(r"(?:correct\s+)?answer\s+is\s+\**([ABCD])\**", re.IGNORECASE)
# lmms-eval `can_infer_option`: letters A-E and the affixed forms tried when no single bare letter decides (§6.3).
_LMMS_LETTERS = "ABCDE"
_LMMS_AFFIXES = (
    ("", "."), ("", ","), ("", ":"), ("", ")"), ("", ")."), ("(", ")"), ("(", ")."),
    (":", ""), (":", ","), (":", "."), (":", ")"), (":", ")."),
)
# lmms-eval `extract_mcq_answer` (static route, §6.3): format priorities; the later position wins a tie.
_STATIC_FORMATS = ((("(", ")"), 6), (("", "."), 5), (("", ":"), 4), (("", ")"), 3), (("", " "), 2))
_STATIC_PHRASE, _STATIC_START, _STATIC_END = 7, 10, 9
_STATIC_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
    "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
    "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select", "i pick",
    "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは",
)


def _vlm_can_infer_option(answer: str, choices: Mapping[str, str]) -> str | None:
    """VLMEvalKit `can_infer_option` (§6.3), with env VERBOSE unset (its quantifier guard is off then)."""
    if _API_FAILURE in answer:
        return None
    if any(r in answer for r in _VLM_REFUSALS):
        return "Z"
    tokens = answer.translate(_VLM_SEPARATORS).split()
    present = [c for c in choices if c in tokens]
    if len(present) == 1:
        if tokens.index(present[0]) >= len(tokens) - 5:  # the letter must be among the last 5 tokens
            return present[0]
    elif not present and "Z" in tokens:
        return "Z"
    m = _VLM_ANSWER_IS.search(answer)
    # (?i) lets a lower-case letter match; it is upper-cased here (§6.3 does not say whether the original does).
    return m.group(1).upper() if m else None


def _vlm_can_infer_text(answer: str, choices: Mapping[str, str]) -> str | None:
    """VLMEvalKit `can_infer_text` (§6.3): no match when the answer is over twice the options' total length."""
    answer = answer.lower()
    if len(answer) > 2 * sum(len(str(v)) for v in choices.values()):
        return None
    found = [k for k, v in choices.items() if str(v).lower() in answer]
    return found[0] if len(found) == 1 else None


def _lmms_can_infer_option(answer: str) -> str | None:
    """lmms-eval `MMBench_Evaluator.can_infer_option` (§6.3): whitespace tokens only, no punctuation stripping.

    One bare letter among A-E decides, unless "A" is a token of a >3-token answer (a quantifier); otherwise the
    first affixed form ("X.", "(X)", ":X", ...) that exactly one letter takes decides.
    """
    if _API_FAILURE in answer:
        return None
    tokens = answer.split()
    bare = [c for c in _LMMS_LETTERS if c in tokens]
    if len(bare) == 1 and not ("A" in tokens and len(tokens) > 3):
        return bare[0]
    for prefix, suffix in _LMMS_AFFIXES:
        hits = [c for c in _LMMS_LETTERS if f"{prefix}{c}{suffix}" in tokens]
        if len(hits) == 1:
            return hits[0]
    return None


def _lmms_can_infer_text(answer: str, choices: Mapping[str, str]) -> str | None:
    """lmms-eval `can_infer_text` (§6.3): no length guard; only options A-D are looked at (§6.5-5)."""
    answer = answer.lower()
    found = [k for k, v in choices.items() if k in "ABCD" and str(v).lower() in answer]
    return found[0] if len(found) == 1 else None


def _lmms_static_extract(response: str, letters: Sequence[str]) -> str | None:
    """lmms-eval `extract_mcq_answer` (§6.3), the priority-ranked version of the pinned commit.

    Candidates: response starts with a standalone letter (10), ends with one (9), a letter after an answer phrase
    (7), "(X)" (6), "X." (5), "X:" (4), "X)" (3), "X " (2), and only if none of those, any occurrence (0). The best
    priority wins, then the later position. Only upper-case letters count. Which letters the static MMBench
    aggregator passes is not stated in §6; the item's own option letters are used here.
    """
    if not response.strip():
        return None
    text = response.strip()
    for mark in ",.!?;:'\"":  # one pass per mark, in this order, as the original does
        text = text.strip(mark)
    text = f" {text} "
    found: list[tuple[int, int, str]] = []
    for (prefix, suffix), priority in _STATIC_FORMATS:
        for ch in letters:
            pos = text.rfind(f"{prefix}{ch}{suffix}")
            if pos != -1:
                found.append((priority, pos, ch))
    lowered = text.lower()
    for phrase in _STATIC_PHRASES:
        start = lowered.find(phrase)
        if start != -1:
            for ch in letters:
                pos = text.find(ch, start + len(phrase))
                if pos != -1:
                    found.append((_STATIC_PHRASE, pos, ch))
    core = text.strip()
    for ch in letters:
        if core.startswith(ch) and (len(core) == 1 or not core[1].isalpha()):
            found.append((_STATIC_START, 0, ch))
        if core.endswith(ch) and (len(core) == 1 or not core[-2].isalpha()):
            found.append((_STATIC_END, len(text) - 1, ch))
    if not found:
        found = [(0, text.rfind(ch), ch) for ch in letters if ch in text]
    if not found:
        return None
    # stable sort, best first: the first-found candidate wins an exact (priority, position) tie
    return sorted(found, key=lambda c: (c[0], c[1]), reverse=True)[0][2]


def mmbench_extract(prediction: str, choices: Mapping[str, str], toolkit: str = LMMS_EVAL) -> str | None:
    """The option letter read from an MMBench prediction without an LLM judge, or None if unresolved (§6.3).

    `choices` maps the item's option letters to their texts (e.g. {"A": "teddy bear", "B": "rabbit", ...}).
    lmms-eval (`mmbench_en_dev_static`): `can_infer` (option letter, then option text), and for what that leaves
    unresolved, the static `extract_mcq_answer`. VLMEvalKit (`--judge exact_matching`): `can_infer` (option letter
    with punctuation stripped and the last-5-token and "answer is X" rules, then option text with the length guard).
    A refusal gives VLMEvalKit's "Z", which never equals an answer. Lower-case letters are never read (§6.5-4).
    """
    toolkit = check_toolkit(toolkit)
    if toolkit == LMMS_EVAL:
        pred = prediction.strip()
        return (
            _lmms_can_infer_option(pred)
            or _lmms_can_infer_text(pred, choices)
            or _lmms_static_extract(pred, list(choices))
        )
    pred = str(prediction)
    return _vlm_can_infer_option(pred, choices) or _vlm_can_infer_text(pred, choices)


class MCQPass(NamedTuple):
    """One circular pass of an MMBench question: the prediction, that pass's options and its answer letter."""

    prediction: str
    choices: Mapping[str, str]
    answer: str


def mmbench_group(index: int | str) -> int:
    """The circular group of an MMBench row: `index % 1e6` (§6.1); string indices are accepted (§6.5-6)."""
    return int(index) % MMBENCH_GROUP


def circular_hit(extracted: Sequence[str | None], answers: Sequence[str]) -> int:
    """1 iff every pass of a question was read and equals its answer (§6.2); one wrong or unresolved pass gives 0.

    Without an LLM judge the toolkits' short-circuit (stop at the first resolved wrong pass) gives the same hit.
    """
    if len(extracted) != len(answers):
        raise ValueError(f"{len(extracted)} extracted letters for {len(answers)} answers")
    return int(bool(answers) and all(e is not None and e == a for e, a in zip(extracted, answers, strict=True)))


def mmbench_circular(groups: Mapping[Hashable, Sequence[MCQPass]], toolkit: str = LMMS_EVAL) -> dict[str, Any]:
    """CircularEval (§6.2): `groups` maps a group id (`mmbench_group(index)`) to its passes.

    Returns {"accuracy": mean hit in [0, 1], "hits": {group: 0|1}}. lmms-eval reports accuracy ×100,
    VLMEvalKit's `report_acc` in [0, 1].
    """
    toolkit = check_toolkit(toolkit)
    hits = {
        g: circular_hit([mmbench_extract(p.prediction, p.choices, toolkit) for p in passes], [p.answer for p in passes])
        for g, passes in groups.items()
    }
    accuracy = sum(hits.values()) / len(hits) if hits else math.nan
    return {"accuracy": accuracy, "hits": hits}
