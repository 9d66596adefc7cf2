"""OCR cases and word scoring shared by the OCR tests and benchmarks/bench_curate_ocr.py (no pytest here: the
benchmark imports it too)."""

from __future__ import annotations

from collections import Counter

from mindvl.curate.stages.ocr import words

# The fragment cases and their kin, one image each: (true text, engine A's reading, engine B's reading, what
# the word-level intersection keeps by default). A word one engine cut short never survives.
FRAGMENT_CASES = [
    (["Room 305"], ["Room 30"], ["Room 305"], ["Room"]),
    (["Room 305"], ["oom 305"], ["Room 305"], ["305"]),
    (["reopened today"], ["open"], ["reopened today"], []),
    (["Room 305 Floor 21"], ["Room 305", "Floor 2"], ["Room 305 Floor 21"], ["Room 305 Floor"]),
    (["international park"], ["national park"], ["international park"], ["park"]),
    (["portal 8080"], ["port 80"], ["portal 8080"], []),
    (["gate 12B"], ["gate 12B"], ["gate 12"], ["gate"]),
    (["Total: $12.50"], ["Total: $12.50"], ["Total $12.5"], ["Total"]),  # "12.50" is one word: 12.5 does not agree
    (["well-known fact"], ["well-known fact"], ["well fact"], ["fact"]),
    (["第305号房间"], ["第305号房间"], ["第30号房间"], ["号房间"]),  # the number 305 is one word: 30 does not agree
    (["营业时间 9:00-18:00"], ["营业时间 9:00-18:00"], ["营业时间 9:00-18:0"], ["营业时间"]),
    # one engine glued two words: the lenient default keeps the spaced reading (`glued_words: false` would not)
    (["meadow river 4006"], ["meadowriver 4006"], ["meadow river 4006"], ["meadow river 4006"]),
]


def word_bag(lines: list[str]) -> Counter:
    """The normalised words of `lines` as a multiset (mindvl.curate.stages.ocr.words: case-folded, punctuation
    removed, a CJK character is a word)."""
    return Counter(w for t in lines for w in words(t))


def precision_recall(pred: list[str], truth: list[str]) -> tuple[float, float]:
    """Word precision (matched / predicted words) and recall (matched / true words) of `pred` against `truth`."""
    p, t = word_bag(pred), word_bag(truth)
    hit = sum((p & t).values())
    return hit / max(1, sum(p.values())), hit / max(1, sum(t.values()))
