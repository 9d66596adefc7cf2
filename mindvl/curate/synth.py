"""Generated corpora with known answers, for tests, benchmarks and trying a pipeline without data.

`pairs_corpus(out, n_distinct, ...)` writes image-caption pairs in mindvl's JSONL layout: `n_distinct` distinct
images (random smooth colour fields with random shapes: their perceptual hashes are far apart), and for some of them
duplicates: exact copies, resized, JPEG re-encoded and slightly cropped versions. Returns the ground truth (which
record is a copy of which). `text_images(...)` renders words in several fonts, sizes and backgrounds for OCR.
Everything is a pure function of the seed.
"""

from __future__ import annotations

import io
import json
import os
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from mindvl.data.synth import WORDS

VARIANTS = ("exact", "resized", "reencoded", "cropped")


def distinct_image(i: int, seed: int, size: int = 160) -> Image.Image:
    """A random smooth colour field with a few shapes (smooth fields make perceptual hashes far apart)."""
    rng = np.random.default_rng([seed, i, 7])
    low = rng.integers(0, 256, size=(4, 4, 3), dtype=np.uint8)
    img = Image.fromarray(low).resize((size, size), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(img)
    for _ in range(3):
        x0, y0 = rng.integers(0, size - 40, 2)
        w, h = rng.integers(20, 60, 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)([int(x0), int(y0), int(x0 + w), int(y0 + h)],
                                                                 fill=colour)
    return img


def variant(img: Image.Image, kind: str, rng: random.Random) -> bytes:
    """Encoded bytes of a duplicate of `img`: exact (same PNG bytes), resized, re-encoded JPEG, cropped 2-5%."""
    if kind == "exact":
        return encode(img, "PNG")
    if kind == "resized":
        s = rng.uniform(0.5, 1.6)
        return encode(img.resize((max(16, int(img.width * s)), max(16, int(img.height * s))),
                                 Image.Resampling.BILINEAR), "PNG")
    if kind == "reencoded":
        return encode(img, "JPEG", quality=rng.randint(50, 80))
    if kind == "cropped":
        f = rng.uniform(0.02, 0.05)
        dx, dy = int(img.width * f), int(img.height * f)
        return encode(img.crop((rng.randint(0, dx), rng.randint(0, dy), img.width - rng.randint(0, dx),
                                img.height - rng.randint(0, dy))), "PNG")
    raise ValueError(f"unknown variant {kind!r} (known: {', '.join(VARIANTS)})")


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def caption(rng: random.Random, n_words: int = 6) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words)).capitalize() + "."


@dataclass
class PairsTruth:
    files: list[str]  # JSONL files written
    original_of: dict[str, str]  # image file name of each duplicate -> name of its original
    names: list[str]  # every image name in corpus order


def pairs_corpus(out: str, n_distinct: int, dup_fraction: float = 0.3, n_files: int = 2, seed: int = 0,
                 variants: tuple[str, ...] = VARIANTS, size: int = 160) -> PairsTruth:
    """Write `n_files` JSONL files of caption pairs under `out` (images in out/images). Originals come before their
    duplicates in corpus order (file order, then line order), so a dedup keeping the first keeps the original."""
    rng = random.Random(f"pairs:{seed}")
    os.makedirs(os.path.join(out, "images"), exist_ok=True)

    def save(name: str, data: bytes) -> None:  # images go to disk at once: memory stays flat in n
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)

    entries: list[tuple[str, str]] = []  # (name, original name or "")
    dups: list[tuple[str, str]] = []
    for i in range(n_distinct):
        img = distinct_image(i, seed, size)
        name = f"images/d{i:05d}.png"
        save(name, encode(img, "PNG"))
        entries.append((name, ""))
        if rng.random() < dup_fraction:
            kind = variants[len(dups) % len(variants)]
            ext = "jpg" if kind == "reencoded" else "png"
            dup = f"images/d{i:05d}_{kind}.{ext}"
            save(dup, variant(img, kind, rng))
            dups.append((dup, name))
    entries += dups  # every duplicate after every original
    per_file = -(-len(entries) // n_files)
    files = []
    for f in range(n_files):
        path = os.path.join(out, f"pairs_{f:02d}.jsonl")
        with open(path, "w") as fh:
            for name, _ in entries[f * per_file:(f + 1) * per_file]:
                record = {"messages": [{"role": "user", "content": "<image>Describe the image."},
                                       {"role": "assistant", "content": caption(rng)}], "images": [name],
                          "id": name}
                fh.write(json.dumps(record) + "\n")
        files.append(path)
    return PairsTruth(files, {n: o for n, o in entries if o}, [n for n, _ in entries])


FONT_SIZES = (18, 24, 32)
BACKGROUNDS = ((255, 255, 255), (235, 225, 200), (40, 40, 60), (200, 220, 240))


def text_image(i: int, seed: int) -> tuple[Image.Image, list[str]]:
    """A rendered text image: 1-3 lines of 2-4 words, one of Pillow's fonts (TrueType at several sizes, bold by
    stroke, or the bitmap font) on one of several backgrounds, some with light noise. Returns (image, lines)."""
    rng = random.Random(f"ocr:{seed}:{i}")
    bg = BACKGROUNDS[rng.randrange(len(BACKGROUNDS))]
    fg = (250, 250, 250) if sum(bg) < 300 else (rng.randint(0, 60),) * 3
    lines = [" ".join(rng.choice(WORDS) if rng.random() < 0.8 else str(rng.randint(10, 9999))
                      for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 3))]
    kind = rng.choice(("ttf", "ttf", "bold", "bitmap"))
    size = rng.choice(FONT_SIZES)
    font = ImageFont.load_default_imagefont() if kind == "bitmap" else ImageFont.load_default(size=size)
    stroke = 1 if kind == "bold" else 0
    scale = 3 if kind == "bitmap" else 1  # the bitmap font is 11 px high: render, then upscale
    draw0 = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    boxes = [draw0.textbbox((0, 0), t, font=font, stroke_width=stroke) for t in lines]
    line_h = max(b[3] - b[1] for b in boxes) + 12
    width = max(b[2] - b[0] for b in boxes) + 40
    img = Image.new("RGB", (width, line_h * len(lines) + 30), bg)
    draw = ImageDraw.Draw(img)
    for j, (t, b) in enumerate(zip(lines, boxes, strict=True)):
        draw.text((20 - b[0], 15 + j * line_h - b[1]), t, fill=fg, font=font, stroke_width=stroke, stroke_fill=fg)
    if scale > 1:
        img = img.resize((img.width * scale, img.height * scale), Image.Resampling.BICUBIC)
    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(0.6))
    return img, lines


def ocr_corpus(out: str, n: int, seed: int = 0) -> tuple[str, list[list[str]]]:
    """JSONL of n rendered text images (record answers are placeholders: the OCR stage writes them)."""
    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    path = os.path.join(out, "ocr.jsonl")
    truth = []
    with open(path, "w") as fh:
        for i in range(n):
            img, lines = text_image(i, seed)
            name = f"images/t{i:05d}.png"
            img.save(os.path.join(out, name))
            truth.append(lines)
            fh.write(json.dumps({"messages": [{"role": "user", "content": "<image>Read the text in the image."},
                                              {"role": "assistant", "content": "(to be read)"}],
                                 "images": [name]}) + "\n")
    return path, truth
