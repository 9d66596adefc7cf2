"""Image-based and text-based filters (the paper's B.1.1 "image-based criteria, text-based criteria, URL filtering").

`image_filter`: every image decodes (Pillow, EXIF-oriented, decompression bombs refused before decoding), sides,
aspect ratio and pixel count within bounds.

`text_filter` on the caption (the assistant turns by default):
- length in characters and words;
- *language by script*: the share of letters that belong to the allowed Unicode scripts (the first word of each
  letter's Unicode name: LATIN, CJK, CYRILLIC, ARABIC, HANGUL, ...). It is a script test, not a language model: it
  tells Chinese from English, not English from French;
- repetition: the share of word 3-grams that repeat an earlier 3-gram in the same text (Gopher's duplicate n-gram
  fraction);
- character-class noise: the share of characters that are neither letters, digits, whitespace nor common punctuation;
- URL/domain blocklist: the record's `url` field (and, optionally, URLs in the caption) whose host is a blocked
  domain or one of its subdomains.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache
from urllib.parse import urlsplit

from mindvl.data.image import ImageError

from ..items import Item
from .base import Dropped, Histogram, Options, RecordFilter, register


@register
class ImageFilter(RecordFilter):
    name = "image_filter"
    histograms = {"min_side": Histogram(0, 2048, 32), "aspect_ratio": Histogram(1, 8, 28)}

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"require_image": True, "min_side": 1, "max_side": None, "max_aspect_ratio": None,
                               "min_pixels": None, "max_pixels": None},
                         where, {"max_side": (int,), "max_aspect_ratio": (float,), "min_pixels": (int,),
                                 "max_pixels": (int,)})
        self.o.positive("min_side", "max_side", "max_aspect_ratio", "min_pixels", "max_pixels")

    def reason(self, item: Item) -> str | None:
        if not item.images:
            return "no_image" if self.o.require_image else None
        try:
            images = item.pil_images()
        except ImageError as exc:
            return "undecodable" if exc.reason == "corrupt_image" else exc.reason
        for im in images:
            w, h = im.size
            self.observe("min_side", min(w, h))
            self.observe("aspect_ratio", max(w, h) / max(1, min(w, h)))
            if min(w, h) < self.o.min_side:
                return "too_small"
            if self.o.max_side is not None and max(w, h) > self.o.max_side:
                return "too_large"
            if self.o.max_aspect_ratio is not None and max(w, h) / min(w, h) > self.o.max_aspect_ratio:
                return "aspect_ratio"
            if self.o.min_pixels is not None and w * h < self.o.min_pixels:
                return "too_few_pixels"
            if self.o.max_pixels is not None and w * h > self.o.max_pixels:
                return "too_many_pixels"
        return None


_URL = re.compile(r"(?:https?://|www\.)[^\s<>\"']+", re.IGNORECASE)
_WORD = re.compile(r"\w+", re.UNICODE)
_PUNCT = set(".,;:!?'\"()[]{}-–—/&%$#@*+=<>|_~`^…“”‘’«»、。，；：！？（）《》·")


@lru_cache(maxsize=65536)
def char_script(c: str) -> str:
    """The Unicode script family of a letter, from its name ('LATIN SMALL LETTER A' -> 'latin'; CJK ideographs ->
    'han')."""
    name = unicodedata.name(c, "")
    first = name.split(" ", 1)[0].lower()
    return {"cjk": "han"}.get(first, first)


def script_share(text: str, scripts: set[str]) -> float:
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return 0.0
    return sum(char_script(c) in scripts for c in letters) / len(letters)


def repetition(text: str, n: int = 3) -> float:
    """Share of word n-grams that repeat an earlier n-gram (0: no repetition)."""
    words = _WORD.findall(text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return 1.0 - len(set(grams)) / len(grams)


def noise(text: str) -> float:
    """Share of characters that are not letters, digits, whitespace or common punctuation."""
    if not text:
        return 0.0
    bad = sum(not (c.isalnum() or c.isspace() or c in _PUNCT) for c in text)
    return bad / len(text)


def host_blocked(url: str, domains: tuple[str, ...]) -> bool:
    if not url.lower().startswith(("http://", "https://")):
        url = "http://" + url
    try:
        host = (urlsplit(url).hostname or "").lower().rstrip(".")
    except ValueError:
        return False
    return any(host == d or host.endswith("." + d) for d in domains)


@register
class TextFilter(RecordFilter):
    name = "text_filter"
    histograms = {"chars": Histogram(0, 2000, 40), "repetition": Histogram(0, 1, 20), "noise": Histogram(0, 1, 20)}

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"field": "assistant", "min_chars": 1, "max_chars": None, "min_words": None,
                               "scripts": None, "min_script_share": 0.8, "max_repetition": None, "max_noise": None,
                               "blocked_domains": None, "url_field": "url", "drop_urls_in_text": False},
                         where, {"max_chars": (int,), "min_words": (int,), "scripts": (list,),
                                 "max_repetition": (float,), "max_noise": (float,), "blocked_domains": (list,)})
        if self.o.field not in ("assistant", "user", "all"):
            raise ValueError(f"{where}.field: must be assistant, user or all, got {self.o.field!r}")
        self.scripts = {str(s).lower() for s in self.o.scripts} if self.o.scripts else None
        self.domains = tuple(str(d).lower().lstrip(".") for d in (self.o.blocked_domains or ()))

    def reason(self, item: Item) -> str | None:
        text = item.texts(self.o.field)
        if not text.strip():
            return "empty_text"
        self.observe("chars", len(text))
        if len(text) < self.o.min_chars:
            return "too_short"
        if self.o.max_chars is not None and len(text) > self.o.max_chars:
            return "too_long"
        if self.o.min_words is not None and len(_WORD.findall(text)) < self.o.min_words:
            return "too_few_words"
        if self.scripts is not None and script_share(text, self.scripts) < self.o.min_script_share:
            return "script"
        if self.o.max_repetition is not None:
            rep = repetition(text)
            self.observe("repetition", rep)
            if rep > self.o.max_repetition:
                return "repetition"
        if self.o.max_noise is not None:
            nz = noise(text)
            self.observe("noise", nz)
            if nz > self.o.max_noise:
                return "noise"
        urls = _URL.findall(text)
        if self.o.drop_urls_in_text and urls:
            return "url_in_text"
        if self.domains:
            url = item.record.get(self.o.url_field)
            for u in ([url] if isinstance(url, str) else []) + urls:
                if host_blocked(u, self.domains):
                    return "blocked_domain"
        return None


__all__ = ["Dropped", "ImageFilter", "TextFilter", "char_script", "noise", "repetition", "script_share"]
