"""Two-engine OCR: word precision and recall of each engine alone and of their intersection, against ground truth.

Three parts, each scored the same way: the normalised words of `mindvl.curate.stages.ocr.words` (case-folded,
punctuation removed, a CJK character is a word), as multisets per image: precision = matched / predicted words,
recall = matched / true words. Every table shows the intersection rule before issue 28 (normalised substrings, no
word boundaries; a copy is kept below as `substring_rule`) beside today's word-level rule.

1. **Fragment cases**: the issue's cases and their kin, one image each (true text, engine A, engine B).
2. **Simulated engines** on the rendered corpus's true lines (`text_image`, Latin) and on Chinese lines: each
   engine's reading is the truth with independent errors of the kinds real recognisers make (a word cut short at
   either end, a confusable character, dropped spaces, a spurious space, a line cut into two boxes, mid-word or not),
   at rates chosen so that engine A errs like PP-OCR and engine B like Tesseract on these images (see RESULTS.md).
   Deterministic and fast; no OCR engine needed.
3. **Real engines** on rendered images (`ocr_corpus`): RapidOCR (PP-OCRv4) when `rapidocr-onnxruntime` is installed,
   Tesseract when the binary is on PATH; the intersection of the two real engines when both are there, else of
   RapidOCR with the simulated Tesseract-like engine B.

    python benchmarks/bench_curate_ocr.py --n 40 --sim 400
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mindvl.curate.stages.ocr import intersect_lines, normalise
from mindvl.curate.synth import text_image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "curate"))
from ocr_cases import FRAGMENT_CASES, word_bag  # noqa: E402

# --- the rule before issue 28 (normalised substrings without word boundaries), for comparison -------------------


def _span(raw: str, norm_start: int, norm_len: int) -> str:
    idx = [i for i, c in enumerate(raw) if normalise(c)]
    return raw[idx[norm_start]: idx[norm_start + norm_len - 1] + 1]


def _spaced(x: str, y: str) -> str:
    return y if len(y.split()) > len(x.split()) else x


def _merge(intervals):
    out = []
    for s, e, t in sorted(intervals, key=lambda x: (x[0], x[1])):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e), [*out[-1][2], t])
        else:
            out.append((s, e, [t]))
    return out


def _reading(host_span, pieces):
    return host_span.strip() if len(pieces) > 1 else _spaced(host_span.strip(), pieces[0].strip())


def substring_rule(a: list[str], b: list[str], min_chars: int = 3) -> list[str]:
    nb = [normalise(t) for t in b]
    kept, group = [], []

    def flush():
        if group:
            host, intervals = group
            for s, e, texts in _merge(intervals):
                kept.append(_reading(_span(b[host], s, e - s), texts))
            group.clear()

    for line in a:
        na = normalise(line)
        host = next((j for j, x in enumerate(nb) if len(na) >= min_chars and na in x), None)
        if host is not None:
            if group and group[0] != host:
                flush()
            if not group:
                group.extend([host, []])
            start = nb[host].find(na)
            group[1].append((start, start + len(na), line))
            continue
        flush()
        pieces = [(na.find(x), na.find(x) + len(x), t) for t, x in zip(b, nb, strict=True)
                  if len(x) >= min_chars and x in na]
        for s, e, texts in _merge(pieces):
            kept.append(_reading(_span(line, s, e - s), texts))
    flush()
    return kept


# --- scoring ----------------------------------------------------------------------------------------------------


class Score:
    def __init__(self):
        self.pred = self.hit = self.true = self.exact = self.images = 0

    def add(self, pred: list[str], truth: list[str]) -> None:
        p, t = word_bag(pred), word_bag(truth)
        self.pred += sum(p.values())
        self.true += sum(t.values())
        self.hit += sum((p & t).values())
        self.exact += int(p == t)
        self.images += 1

    def row(self, name: str) -> str:
        return (f"| {name} | {self.pred} | {self.hit / max(1, self.pred):.3f} | {self.hit / max(1, self.true):.3f} "
                f"| {self.exact}/{self.images} |")


HEADER = "| reading | words predicted | precision | recall | images read exactly |\n|---|---|---|---|---|"


def table(title: str, cases: list[tuple[list[str], list[str], list[str]]], names: tuple[str, str]) -> None:
    scores = {k: Score() for k in ("a", "b", "old", "new", "strict")}
    for truth, a, b in cases:
        scores["a"].add(a, truth)
        scores["b"].add(b, truth)
        scores["old"].add(substring_rule(a, b), truth)
        scores["new"].add(intersect_lines(a, b), truth)
        scores["strict"].add(intersect_lines(a, b, glued_words=False), truth)
    print(f"\n{title}: {len(cases)} images, {scores['a'].true} true words\n{HEADER}")
    print(scores["a"].row(names[0]))
    print(scores["b"].row(names[1]))
    print(scores["old"].row("intersection, substring rule (before)"))
    print(scores["new"].row("**intersection, word rule** (default)"))
    print(scores["strict"].row("intersection, word rule, `glued_words: false`"))


# --- part 1: fragment cases -------------------------------------------------------------------------------------

# (truth, engine A, engine B): the tests' fragment cases (tests/curate/ocr_cases.py)
FRAGMENTS = [(truth, a, b) for truth, a, b, _ in FRAGMENT_CASES]


def fragment_cases() -> None:
    print("\nFragment cases (truth | A | B -> before | now):")
    for truth, a, b in FRAGMENTS:
        print(f"  {truth} | {a} | {b} -> {substring_rule(a, b)} | {intersect_lines(a, b)}")
    table("Part 1, fragment cases", FRAGMENTS, ("engine A", "engine B"))


# --- part 2: simulated engines ----------------------------------------------------------------------------------

CONFUSABLE = {"m": "rn", "n": "m", "l": "1", "1": "l", "o": "0", "0": "o", "e": "c", "c": "e", "i": "l", "5": "s",
              "s": "5", "8": "b", "b": "8", "u": "v", "v": "u"}
HANZI = ("的一是在不了有和人这中大为上个国我以要他时来用们生到作地于出就分对成会可主发年动同工也能下过子说产种面"
         "而方后多定行学法所民得经十三之进着等部度家电力里如水化高自二理起小物现实加量都两体制机当使点从业本去把性"
         "好应开它合还因由其些然前外天政四日那社义事平形相全表间样与关各重新线内数正心反你明看原又么利比或但质气第向"
         "道命此变条只没结解问意建月公无系军很情者最立代想已通并提直题党程展五果料象员革位入常文总次品式活设及管特件"
         "长求老头基资边流路级少图山统接知较将组见计别她手角期根论运农指几九区强放决西被干做必战先回则任取据处府")
# Confusable pairs of the kind CJK recognisers mix up (shape neighbours).
HANZI_CONFUSABLE = {"日": "曰", "土": "士", "己": "已", "未": "末", "人": "入", "大": "太", "天": "夭", "王": "玉",
                    "间": "问", "体": "休", "已": "己", "入": "人"}


def _sim_word(w: str, rng: random.Random, p: dict[str, float], cjk: bool) -> str:
    if rng.random() < p["cut_end"] and len(w) > 2:
        w = w[:-rng.randint(1, min(2, len(w) - 2))]
    if rng.random() < p["cut_start"] and len(w) > 2:
        w = w[1:]
    if rng.random() < p["confuse"]:
        if cjk:  # a shape neighbour when the table has one, else another character
            w = HANZI_CONFUSABLE.get(w, rng.choice(HANZI))
        else:
            spots = [i for i, c in enumerate(w) if c.lower() in CONFUSABLE]
            if spots:
                i = rng.choice(spots)
                w = w[:i] + CONFUSABLE[w[i].lower()] + w[i + 1:]
    if not cjk and rng.random() < p["space_in"] and len(w) > 3:
        i = rng.randint(1, len(w) - 1)
        w = w[:i] + " " + w[i:]
    return w


def simulate(lines: list[str], rng: random.Random, p: dict[str, float], cjk: bool) -> list[str]:
    """One engine's reading of `lines`: per-word errors, dropped spaces, lines cut into two boxes."""
    out: list[str] = []
    for line in lines:
        if cjk:  # a CJK line is read character by character: each character a word, no spaces
            chars = [_sim_word(c, rng, p, True) for c in line]
            if rng.random() < p["cut_end"] * 2:  # the recogniser stops a character short
                chars = chars[:-1]
            text = "".join(chars)
        else:
            ws = [_sim_word(w, rng, p, False) for w in line.split()]
            text = ws[0]
            for w in ws[1:]:
                text += ("" if rng.random() < p["drop_space"] else " ") + w
        if rng.random() < p["split"] and len(text) > 4:  # two boxes, at a space or (mid_word) anywhere
            spaces = [i for i, c in enumerate(text) if c == " "]
            i = rng.choice(spaces) if spaces and rng.random() > p["mid_word"] else rng.randint(2, len(text) - 2)
            out += [x for x in (text[:i].strip(), text[i:].strip()) if x]
        elif text.strip():
            out.append(text)
    return out


# Engine A errs like PP-OCR on these images (dropped spaces, confusables, words cut at box edges), B like Tesseract.
RATES_A = {"cut_end": 0.05, "cut_start": 0.03, "confuse": 0.08, "space_in": 0.0, "drop_space": 0.2, "split": 0.2,
           "mid_word": 0.4}
RATES_B = {"cut_end": 0.03, "cut_start": 0.01, "confuse": 0.03, "space_in": 0.01, "drop_space": 0.02, "split": 0.1,
           "mid_word": 0.2}


def chinese_lines(i: int, seed: int) -> list[str]:
    rng = random.Random(f"zh:{seed}:{i}")
    lines = []
    for _ in range(rng.randint(1, 3)):
        line = "".join(rng.choice(HANZI) for _ in range(rng.randint(4, 10)))
        if rng.random() < 0.3:
            line += f" {rng.randint(10, 9999)}"
        lines.append(line)
    return lines


def simulated(n: int, seed: int) -> None:
    for label, truth_of, cjk in (("Latin (the rendered corpus's lines)", lambda i: text_image(i, seed)[1], False),
                                 ("Chinese lines (4-10 characters, 30% with a number)",
                                  lambda i: chinese_lines(i, seed), True)):
        cases = []
        for i in range(n):
            truth = truth_of(i)
            rng = random.Random(f"sim:{seed}:{i}:{cjk}")
            cases.append((truth, simulate(truth, rng, RATES_A, cjk), simulate(truth, rng, RATES_B, cjk)))
        table(f"Part 2, simulated engines, {label}", cases, ("engine A (PP-OCR-like errors)",
                                                              "engine B (Tesseract-like errors)"))


# --- part 3: real engines ---------------------------------------------------------------------------------------


def real(n: int, seed: int) -> None:
    try:
        import rapidocr_onnxruntime  # noqa: F401

        from mindvl.curate.stages.ocr import rapidocr_lines
    except ImportError:
        print("\nPart 3 skipped: rapidocr-onnxruntime is not installed (pip install 'mindvl[curate]')")
        return
    from mindvl.curate.stages.ocr import tesseract_lines

    have_tess = shutil.which("tesseract") is not None
    cases = []
    t0 = time.perf_counter()
    for i in range(n):
        img, truth = text_image(i, seed)
        a = rapidocr_lines(img)
        b = (tesseract_lines(img) if have_tess
             else simulate(truth, random.Random(f"sim:{seed}:{i}:False"), RATES_B, False))
        cases.append((truth, a, b))
    seconds = time.perf_counter() - t0
    second = "Tesseract (eng, psm 6)" if have_tess else "simulated Tesseract-like engine B (no tesseract binary)"
    table(f"Part 3, real engines on rendered images ({seconds:.0f} s)", cases, ("PP-OCRv4 via RapidOCR", second))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40, help="rendered images read by the real engines")
    ap.add_argument("--sim", type=int, default=400, help="images per script for the simulated engines")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--skip-real", action="store_true")
    args = ap.parse_args()
    fragment_cases()
    simulated(args.sim, args.seed)
    if not args.skip_real:
        with tempfile.TemporaryDirectory():
            real(args.n, args.seed)
    print("\nload:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), "| tesseract:",
          shutil.which("tesseract") or "not installed", "| cpus:", os.cpu_count())


if __name__ == "__main__":
    main()
