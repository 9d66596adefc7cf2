"""OCR annotation with two independent engines whose results are intersected (paper B.1.2).

Engines: `rapidocr` (PaddleOCR's PP-OCRv4 detection + recognition as ONNX, shipped in the rapidocr-onnxruntime
wheel, run by onnxruntime on CPU) and `tesseract` (the `tesseract` binary, LSTM engine, TSV output grouped into
lines by block/paragraph/line). Both read every image.

Intersection, at word level: a word is kept only where both engines read the same whole word. Texts are
compared normalised (Unicode NFKC, case-folded, every character that is not a letter or digit removed), so case,
punctuation and spacing alone do not count, but word boundaries do: a boundary is a line end, whitespace, or either
side of a character of a script written without spaces (Han, Hiragana, Katakana: there each character is a word, the
unit Chinese OCR is scored in, as no segmenter is needed to agree on it). Each line of engine A is aligned with each
line of engine B (difflib's matching blocks of the normalised texts); inside a matching block the positions that
are boundaries in BOTH readings cut it into candidate words, and a candidate is agreed when neither engine puts a
word break inside it that the other lacks, with one exception: a stretch that one engine read as a single token and
the other as several words is agreed (line recognisers, PP-OCR's above all, drop spaces: "meadowriver" / "meadow
river"; the characters are the same and the spaced reading is kept). So a word one engine cut short never survives
("Room 30" / "Room 305" keeps "Room"; "oom 305" / "Room 305" keeps "305"; "open" / "reopened today" keeps nothing).
The residual risk of the exception: a break inserted by one engine inside a word the other read whole survives
("30 5" / "305"); `glued_words: false` turns the exception off (on simulated engines: word precision 0.974 -> 0.994,
recall 0.679 -> 0.552, benchmarks/RESULTS.md). Agreed runs shorter than `min_chars` normalised characters are
dropped; each character of B confirms at most one run (longest runs first, so a repeated word is not confirmed
twice by one reading). The kept text is A's agreed runs in A's reading order, one line per A line (or fewer: runs
that continue each other without a gap in one A line or in one B line, i.e. a line one engine cut into boxes, are
joined back), each run written with the spacing of the engine whose reading has more word breaks (the characters
are the same by construction).

`write_answer: true` puts the kept text in the record's assistant turn (an OCR training pair); records with no agreed
line are dropped (`ocr_no_agreement`). Coverage: the characters of the kept text are counted (report: distinct
characters, the rarest ones), and with `vocabulary: FILE` (one word per line) the share of the vocabulary's words and
characters that occur, with the missing ones listed for targeted top-up.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import unicodedata
from dataclasses import dataclass
from difflib import SequenceMatcher

from .base import Histogram, MapStage, Options, register, with_first_image

ENGINES = ("rapidocr", "tesseract")
_RAPID: dict[str, object] = {}


def normalise(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKC", text).casefold() if c.isalnum())


# Scripts written without spaces between words: each character is a word (Han incl. extensions and compatibility
# ideographs, Hiragana, Katakana incl. halfwidth). Hangul is written with spaces and is not here.
_UNSPACED = ((0x3040, 0x30FF), (0x31F0, 0x31FF), (0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF),
             (0xFF66, 0xFF9F), (0x20000, 0x3134F))


def unspaced(c: str) -> bool:
    o = ord(c)
    return any(lo <= o <= hi for lo, hi in _UNSPACED)


def words(text: str) -> list[str]:
    """The normalised words of a text (the unit the intersection agrees on and the benchmark scores): whitespace
    separates words, every character of a script written without spaces is a word, and each word is normalised
    (empty ones, pure punctuation, dropped)."""
    out: list[str] = []
    for token in unicodedata.normalize("NFKC", text).split():
        piece = ""
        for c in token:
            if unspaced(c):
                out.extend(x for x in (normalise(piece), c) if x)
                piece = ""
            else:
                piece += c
        if normalise(piece):
            out.append(normalise(piece))
    return out


@dataclass
class _Reading:
    """A line normalised for matching: `norm[k]` came from `text[src[k]]`; `brk[p]` (p = 0..len(norm)): whether a
    word boundary lies before normalised position p."""
    text: str
    norm: str
    src: list[int]
    brk: list[bool]

    def raw(self, start: int, end: int) -> str:
        return self.text[self.src[start]: self.src[end - 1] + 1].strip()


def _reading(line: str) -> _Reading:
    text = unicodedata.normalize("NFKC", line)
    norm: list[str] = []
    src: list[int] = []
    brk = [True]
    gap = True  # whitespace since the last letter/digit (or line start)
    prev_unspaced = False
    for i, c in enumerate(text):
        if c.isspace():
            gap = True
            continue
        n = "".join(x for x in c.casefold() if x.isalnum())
        if not n:  # punctuation: no character, and no boundary by itself ("12.50" is one word)
            continue
        u = unspaced(c)
        if norm:
            brk.append(gap or u or prev_unspaced)
        for k, x in enumerate(n):
            if k:
                brk.append(False)
            norm.append(x)
            src.append(i)
        gap, prev_unspaced = False, u
    brk.append(True)
    if not norm:
        brk = [True]
    return _Reading(text, "".join(norm), src, brk)


def _agreed_runs(ra: _Reading, rb: _Reading, min_chars: int, glued: bool = True) -> list[tuple[int, int, int]]:
    """(start in A, start in B, length) of the runs of whole words both readings agree on (module docstring)."""
    runs = []
    for i, j, n in SequenceMatcher(None, ra.norm, rb.norm, autojunk=False).get_matching_blocks():
        cuts = [k for k in range(n + 1) if ra.brk[i + k] and rb.brk[j + k]]
        run = None  # [start, end) in block offsets of the current agreed run
        for p, q in zip(cuts, cuts[1:], strict=False):
            # p, q are consecutive common boundaries, so a break strictly between them is in one reading only:
            # agreed when neither reading breaks there, or (`glued`) when only one does (the other read the
            # stretch as one token).
            split_a = any(ra.brk[i + k] for k in range(p + 1, q))
            split_b = any(rb.brk[j + k] for k in range(p + 1, q))
            if not (split_a and split_b) if glued else not (split_a or split_b):
                run = (run[0], q) if run else (p, q)
            else:
                if run and run[1] - run[0] >= min_chars:
                    runs.append((i + run[0], j + run[0], run[1] - run[0]))
                run = None
        if run and run[1] - run[0] >= min_chars:
            runs.append((i + run[0], j + run[0], run[1] - run[0]))
    return runs


def _spaced(x: str, y: str) -> str:
    """Of two readings with the same normalised text, the one with more word breaks (dropped spaces are the common
    error of line recognisers on Latin text; ties: the first)."""
    return y if len(y.split()) > len(x.split()) else x


def intersect_lines(a: list[str], b: list[str], min_chars: int = 3, glued_words: bool = True) -> list[str]:
    """The text both engines agree on, word by word (see the module docstring), in A's order. `glued_words`
    False: strict, a stretch one engine read as one token and the other as several words is not agreed."""
    ra, rb = [_reading(t) for t in a], [_reading(t) for t in b]
    cands = [(n, ia, sa, ib, sb) for ia, x in enumerate(ra) for ib, y in enumerate(rb)
             for sa, sb, n in _agreed_runs(x, y, min_chars, glued_words)]
    used_a = [bytearray(len(x.norm)) for x in ra]
    used_b = [bytearray(len(y.norm)) for y in rb]
    chosen: list[tuple[int, int, int, int, int]] = []  # (A line, start in A, length, B line, start in B)
    for n, ia, sa, ib, sb in sorted(cands, key=lambda c: (-c[0], c[1], c[2], c[3], c[4])):
        if any(used_a[ia][sa:sa + n]) or any(used_b[ib][sb:sb + n]):
            continue  # overlapping runs (another alignment of the same characters): the longer one stands
        used_a[ia][sa:sa + n] = b"\x01" * n
        used_b[ib][sb:sb + n] = b"\x01" * n
        chosen.append((ia, sa, n, ib, sb))
    kept: list[str] = []
    last: tuple[int, int, int, int] | None = None  # (A line, end in A, B line, end in B) of the previous run
    for ia, sa, n, ib, sb in sorted(chosen):
        text = _spaced(ra[ia].raw(sa, sa + n), rb[ib].raw(sb, sb + n))
        # A run that continues the previous one without a gap, in A's line (B split the line) or in B's line (A
        # split it, even across A lines): the same line -> joined.
        if last is not None and ((last[0] == ia and last[1] == sa) or (last[2] == ib and last[3] == sb)):
            kept[-1] = f"{kept[-1]} {text}"
        else:
            kept.append(text)
        last = (ia, sa + n, ib, sb + n)
    return kept


def rapidocr_lines(image, text_score: float = 0.5) -> list[str]:
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError as exc:  # pragma: no cover - environment
        raise ImportError("OCR engine rapidocr needs rapidocr-onnxruntime: pip install 'mindvl[curate]'") from exc
    if "engine" not in _RAPID:
        threads = {f"{p}_{k}": 1 for p in ("det", "cls", "rec") for k in ("intra_op_num_threads",
                                                                          "inter_op_num_threads")}
        _RAPID["engine"] = RapidOCR(**threads)
    result, _ = _RAPID["engine"](image.convert("RGB"), text_score=text_score)  # PIL RGB: it converts to BGR
    return [r[1] for r in (result or []) if str(r[1]).strip()]


def tesseract_lines(image, lang: str = "eng", psm: int = 6, timeout: float = 60.0) -> list[str]:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="PNG")
    env = dict(os.environ, OMP_THREAD_LIMIT="1")
    proc = subprocess.run(["tesseract", "stdin", "stdout", "-l", lang, "--psm", str(psm), "tsv"], input=buf.getvalue(),
                          capture_output=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"tesseract failed: {proc.stderr.decode(errors='replace').strip()[:200]}")
    lines: dict[tuple[str, str, str], list[str]] = {}
    for row in proc.stdout.decode(errors="replace").splitlines()[1:]:
        cols = row.split("\t")
        if len(cols) < 12 or cols[0] != "5" or not cols[11].strip():
            continue
        lines.setdefault((cols[2], cols[3], cols[4]), []).append(cols[11].strip())
    return [" ".join(words) for words in lines.values()]


_WORD = re.compile(r"\w+", re.UNICODE)


@register
class Ocr(MapStage):
    name = "ocr"
    histograms = {"agreed_fraction": Histogram(0, 1, 20)}

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"engines": list(ENGINES), "min_chars": 3, "lang": "eng", "psm": 6,
                               "text_score": 0.5, "write_answer": True, "drop_without_agreement": True,
                               "glued_words": True, "vocabulary": None},
                         where, {"text_score": (float,), "vocabulary": (str,)})
        if list(self.o.engines) != list(ENGINES):
            raise ValueError(f"{where}.engines: must be {list(ENGINES)} (engine A, engine B), got {self.o.engines}")
        if shutil.which("tesseract") is None:
            raise ValueError(f"{where}.engines: tesseract is not on PATH; install it (Debian: apt-get install -y "
                             "tesseract-ocr)")
        try:
            import rapidocr_onnxruntime  # noqa: F401
        except ImportError as exc:
            raise ValueError(f"{where}.engines: rapidocr needs rapidocr-onnxruntime: pip install "
                             "'mindvl[curate]'") from exc
        self.vocab: list[str] | None = None
        if self.o.vocabulary is not None:
            if not os.path.isfile(self.o.vocabulary):
                raise FileNotFoundError(f"{where}.vocabulary: file not found: {self.o.vocabulary}")
            with open(self.o.vocabulary, encoding="utf-8") as f:
                self.vocab = sorted({w.strip().casefold() for w in f if w.strip()})

    def process(self, batch):
        pairs, dropped = with_first_image(batch)
        kept = []
        for item, image in pairs:
            a = rapidocr_lines(image, self.o.text_score)
            b = tesseract_lines(image, self.o.lang, self.o.psm)
            agreed = intersect_lines(a, b, self.o.min_chars, self.o.glued_words)
            item.meta["ocr"] = {"rapidocr": a, "tesseract": b, "kept": agreed}
            self._count(a, b, agreed)
            if not agreed and self.o.drop_without_agreement:
                dropped.append((item, "ocr_no_agreement"))
                continue
            if self.o.write_answer and agreed:
                item.set_answer("\n".join(agreed))
            kept.append(item)
        return kept, dropped

    def _count(self, a: list[str], b: list[str], agreed: list[str]) -> None:
        e = self.extra
        e["ocr_images"] = e.get("ocr_images", 0) + 1
        e["lines_a"] = e.get("lines_a", 0) + len(a)
        e["lines_b"] = e.get("lines_b", 0) + len(b)
        e["lines_kept"] = e.get("lines_kept", 0) + len(agreed)
        e["images_with_agreement"] = e.get("images_with_agreement", 0) + bool(agreed)
        n_a = sum(len(normalise(t)) for t in a)
        self.observe("agreed_fraction", sum(len(normalise(t)) for t in agreed) / n_a if n_a else 0.0)
        chars = e.setdefault("char_counts", {})
        text = "\n".join(agreed)
        for c in text:
            if not c.isspace():
                chars[c] = chars.get(c, 0) + 1
        if self.vocab is not None:
            words = e.setdefault("vocab_word_counts", {})
            present = {w.casefold() for w in _WORD.findall(text)}
            for w in self.vocab:
                if w in present:
                    words[w] = words.get(w, 0) + 1
            e["vocabulary"] = self.vocab


def coverage(extra: dict) -> dict:
    """Coverage statistics of the kept OCR text from the merged per-shard counters."""
    chars = extra.get("char_counts", {})
    out: dict = {"distinct_characters": len(chars),
                 "rarest_characters": "".join(sorted(chars, key=lambda c: (chars[c], c))[:20])}
    vocab = extra.get("vocabulary")
    if vocab:
        words = extra.get("vocab_word_counts", {})
        vocab_chars = sorted({c for w in vocab for c in w})
        out["vocabulary_words_covered"] = f"{len(words)}/{len(vocab)} ({len(words) / len(vocab):.1%})"
        covered_chars = [c for c in vocab_chars if c in chars or c.upper() in chars]
        out["vocabulary_characters_covered"] = (f"{len(covered_chars)}/{len(vocab_chars)} "
                                                f"({len(covered_chars) / max(1, len(vocab_chars)):.1%})")
        out["missing_words"] = " ".join(w for w in vocab if w not in words)[:300]
    return out
