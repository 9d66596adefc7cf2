"""OCR annotation with two independent engines whose results are intersected (paper B.1.2).

Engines: `rapidocr` (PaddleOCR's PP-OCRv4 detection + recognition as ONNX, shipped in the rapidocr-onnxruntime
wheel, run by onnxruntime on CPU) and `tesseract` (the `tesseract` binary, LSTM engine, TSV output grouped into
lines by block/paragraph/line). Both read every image.

Intersection, at line level: texts are normalised (Unicode NFKC, case-folded, every character that is not a letter or
digit removed, so spacing and punctuation differences do not count). A line of engine A is *agreed* when its
normalised text occurs inside one line of engine B; when it does not, the lines of B that occur inside it are agreed
instead (one engine split a line the other read whole). Agreed pieces that overlap or touch inside the same line of
the other engine are merged into that line's span (so a word cut in two boxes by one engine comes back whole; every
character of the span was read by both). Agreed strings shorter than `min_chars` normalised characters are
ignored. The kept text is the agreed lines in A's reading order, one per line; a single agreed piece is written with
the spacing of the engine whose reading has more word breaks (the characters are the same by construction). Only
character sequences both engines read identically survive, which is why the intersection's precision is higher than
either engine's.

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

from .base import Histogram, MapStage, Options, register, with_first_image

ENGINES = ("rapidocr", "tesseract")
_RAPID: dict[str, object] = {}


def normalise(text: str) -> str:
    return "".join(c for c in unicodedata.normalize("NFKC", text).casefold() if c.isalnum())


def _span(raw: str, norm_start: int, norm_len: int) -> str:
    """The part of `raw` whose normalised text is normalise(raw)[norm_start : norm_start + norm_len]."""
    idx = [i for i, c in enumerate(raw) if normalise(c)]
    return raw[idx[norm_start]: idx[norm_start + norm_len - 1] + 1]


def _spaced(x: str, y: str) -> str:
    """Of two readings with the same normalised text, the one with more word breaks (dropped spaces are the common
    error of line recognisers on Latin text; ties: the first)."""
    return y if len(y.split()) > len(x.split()) else x


def _merge(intervals: list[tuple[int, int, str]]) -> list[tuple[int, int, list[str]]]:
    """Merge (start, end, text) intervals that overlap or touch, in start order."""
    out: list[tuple[int, int, list[str]]] = []
    for s, e, t in sorted(intervals, key=lambda x: (x[0], x[1])):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e), [*out[-1][2], t])
        else:
            out.append((s, e, [t]))
    return out


def _reading(host_span: str, pieces: list[str]) -> str:
    """The text of an agreed span: the host line's reading when several pieces were merged into it (their cuts are
    not word breaks), else the better-spaced of the two readings."""
    return host_span.strip() if len(pieces) > 1 else _spaced(host_span.strip(), pieces[0].strip())


def intersect_lines(a: list[str], b: list[str], min_chars: int = 3) -> list[str]:
    """The agreed lines (see the module docstring), in A's order."""
    nb = [normalise(t) for t in b]
    kept: list[str] = []
    group: list = []  # consecutive A lines agreeing inside the same B line: [host, [(start, end, text)]]

    def flush() -> None:
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
                               "vocabulary": None},
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
            agreed = intersect_lines(a, b, self.o.min_chars)
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
