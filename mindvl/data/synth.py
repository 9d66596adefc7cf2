"""Synthetic multimodal data: OCR, charts, grounding and documents, rendered with Pillow, deterministic from a seed.

`generate(out_dir, n, seed, tasks)` writes `out_dir/data.jsonl` (the `messages` layout with `<image>` placeholders
and `images` relative to the file) and `out_dir/images/*.png`. Sample i depends only on (seed, i), so a larger n
extends a smaller one. Only Pillow's bundled fonts are used (its TrueType "Aileron" at several sizes, with and
without a stroke, and its bitmap font), so the output is the same on every machine with the same Pillow.

Image sides are multiples of 28 and within the default pixel range, so the processor does not resize them at the
defaults; grounding records declare `"coords": "abs"` (pixels of the image on disk), so a lower max_pixels rescales
their boxes with the image (mindvl.data.grounding) instead of misplacing them.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

from .image import FACTOR, smart_resize

# The default mix; GENERATORS also has "digits" and the testbed's tasks, TEXT_GENERATORS "reverse" and "sort".
TASKS = ("ocr", "chart", "grounding", "doc")
SYNTH_VERSION = 5  # bump when the generator's output changes, so cached sets are regenerated

WORDS = (
    "apple river mountain signal quantum harbor velvet copper garden silent orbit lantern meadow crystal thunder "
    "falcon marble canyon ember willow summit cobalt prism voyage beacon saffron glacier timber atlas nectar"
).split()
CATEGORIES = ("North", "South", "East", "West", "Alpha", "Beta", "Gamma", "Delta", "Q1", "Q2", "Q3", "Q4")
COLOURS = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 200, 30),
    "purple": (140, 60, 180), "orange": (245, 140, 30), "black": (20, 20, 20), "gray": (128, 128, 128),
}
SHAPES = ("rectangle", "circle", "triangle")


# Pillow's bundled fonts, loaded once per size: loading parses the embedded font file again on every call (~0.2 ms,
# about a tenth of a small image's drawing); a loaded font draws the same glyphs however often it is used.
@functools.cache
def _truetype(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


@functools.cache
def _bitmap() -> ImageFont.ImageFont:
    return ImageFont.load_default_imagefont()


def _font(rng: random.Random, lo: int = 14, hi: int = 40) -> tuple[ImageFont.ImageFont | ImageFont.FreeTypeFont, int]:
    """(font, stroke width): Pillow's bundled TrueType at a random size, sometimes bold (stroke), or its bitmap font."""
    if rng.random() < 0.15:
        return _bitmap(), 0
    return _truetype(rng.randint(lo, hi)), rng.choice((0, 0, 0, 1))


def _size(rng: random.Random, lo: int, hi: int) -> int:
    return 28 * rng.randint(lo // 28, hi // 28)


def _bg_fg(rng: random.Random) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    light = rng.random() < 0.7
    bg = tuple(rng.randint(200, 255) if light else rng.randint(0, 60) for _ in range(3))
    dark = sum(bg) < 300
    fg = tuple(rng.randint(190, 255) for _ in range(3)) if dark else tuple(rng.randint(0, 90) for _ in range(3))
    return bg, fg  # type: ignore[return-value]


def _ocr(rng: random.Random) -> tuple[Image.Image, str, str]:
    w, h = _size(rng, 224, 644), _size(rng, 84, 308)
    bg, fg = _bg_fg(rng)
    img = Image.new("RGB", (w, h), bg)
    draw = ImageDraw.Draw(img)
    parts = [rng.choice(WORDS) if rng.random() < 0.7 else str(rng.randint(0, 99999)) for _ in range(rng.randint(1, 4))]
    text = " ".join(parts)
    font, stroke = _font(rng)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font, stroke_width=stroke)
    x = rng.randint(0, max(0, w - (right - left) - 1)) - left
    y = rng.randint(0, max(0, h - (bottom - top) - 1)) - top
    draw.text((x, y), text, fill=fg, font=font, stroke_width=stroke, stroke_fill=fg)
    q = rng.choice(("What text is written in the image?", "Read the text in the image.", "OCR this image."))
    return img, q, text


def _digits(rng: random.Random) -> tuple[Image.Image, str, str]:
    """3-5 dark digits, left-aligned and vertically centred on a light 28 x 112 strip: OCR a tiny model learns from
    scratch in a few minutes on 2 cores (about 1,000 steps of 1K-token packs; the `ocr` task's free placement,
    dark backgrounds and mixed words stay near 0% exact match over the same budget). The quickstart's task."""
    w, h = 112, 28
    bg = tuple(rng.randint(200, 255) for _ in range(3))
    fg = tuple(rng.randint(0, 90) for _ in range(3))
    img = Image.new("RGB", (w, h), bg)  # type: ignore[arg-type]
    draw = ImageDraw.Draw(img)
    text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 5)))
    font = _truetype(rng.randint(19, 21))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    draw.text((rng.randint(1, 4) - left, (h - (bottom - top)) // 2 - top), text, fill=fg, font=font)  # type: ignore[arg-type]
    q = rng.choice(("What text is written in the image?", "Read the text in the image.", "OCR this image."))
    return img, q, text


def _chart(rng: random.Random) -> tuple[Image.Image, str, str]:
    w, h = _size(rng, 336, 560), _size(rng, 252, 420)
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    n = rng.randint(3, 6)
    cats = rng.sample(CATEGORIES, n)
    vals = [rng.randint(1, 100) for _ in range(n)]
    font = _truetype(12)
    x0, y0, x1, y1 = 40, 20, w - 10, h - 30  # plot area
    draw.line([(x0, y0), (x0, y1), (x1, y1)], fill=(0, 0, 0), width=1)
    for tick in (0, 25, 50, 75, 100):
        ty = y1 - (y1 - y0) * tick / 100
        draw.text((4, ty - 6), str(tick), fill=(0, 0, 0), font=font)
        draw.line([(x0 - 3, ty), (x0, ty)], fill=(0, 0, 0))
    step = (x1 - x0) / n
    kind = rng.choice(("bar", "line"))
    colour = rng.choice(list(COLOURS.values())[:6])
    points = []
    for i, (c, v) in enumerate(zip(cats, vals, strict=True)):
        cx = x0 + step * (i + 0.5)
        top = y1 - (y1 - y0) * v / 100
        if kind == "bar":
            draw.rectangle([cx - step * 0.3, top, cx + step * 0.3, y1], fill=colour)
        points.append((cx, top))
        draw.text((cx - 10, y1 + 6), c, fill=(0, 0, 0), font=font)
        draw.text((cx - 8, top - 14), str(v), fill=(0, 0, 0), font=font)
    if kind == "line":
        draw.line(points, fill=colour, width=2)
        for px, py in points:
            draw.ellipse([px - 3, py - 3, px + 3, py + 3], fill=colour)
    if rng.random() < 0.6:
        i = rng.randrange(n)
        return img, f"In this {kind} chart, what is the value of {cats[i]}?", str(vals[i])
    best = max(range(n), key=lambda i: (vals[i], -i))
    return img, f"Which category has the highest value in this {kind} chart?", cats[best]


def _grounding(rng: random.Random) -> tuple[Image.Image, str, str]:
    w, h = _size(rng, 280, 644), _size(rng, 280, 644)
    img = Image.new("RGB", (w, h), tuple(rng.randint(225, 255) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    names = rng.sample(list(COLOURS), rng.randint(1, 4))
    boxes = []
    for colour in names:
        for _ in range(30):  # shapes must not overlap, or the visible extent would differ from the answer box
            bw, bh = rng.randint(24, w // 3), rng.randint(24, h // 3)
            x1, y1 = rng.randint(0, w - bw - 1), rng.randint(0, h - bh - 1)
            box = (x1, y1, x1 + bw, y1 + bh)
            if not any(box[0] <= b[2] and b[0] <= box[2] and box[1] <= b[3] and b[1] <= box[3] for _, _, b in boxes):
                break
        else:
            continue
        shape = rng.choice(SHAPES)
        fill = COLOURS[colour]
        if shape == "rectangle":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon([(box[0], box[3]), ((box[0] + box[2]) // 2, box[1]), (box[2], box[3])], fill=fill)
        boxes.append((colour, shape, box))
    colour, shape, box = rng.choice(boxes)
    q = f"Locate the {colour} {shape} and give its bounding box as (x1, y1), (x2, y2)."
    return img, q, f"({box[0]}, {box[1]}), ({box[2]}, {box[3]})"


def _doc(rng: random.Random) -> tuple[Image.Image, str, str]:
    w, h = _size(rng, 392, 616), _size(rng, 504, 812)
    img = Image.new("RGB", (w, h), (252, 252, 248))
    draw = ImageDraw.Draw(img)
    title_font = _truetype(rng.randint(22, 30))
    body_font = _truetype(rng.randint(13, 17))
    kind = rng.choice(("Invoice", "Receipt", "Report", "Order"))
    title = f"{kind} {rng.randint(1000, 9999)}"
    draw.text((24, 20), title, fill=(10, 10, 10), font=title_font, stroke_width=1, stroke_fill=(10, 10, 10))
    fields = {
        "Date": f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
        "Customer": f"{rng.choice(WORDS).title()} {rng.choice(WORDS).title()}",
        "Total": f"${rng.randint(10, 9999)}.{rng.randint(0, 99):02d}",
        "Items": str(rng.randint(1, 40)),
        "City": rng.choice(("Paris", "Lima", "Oslo", "Cairo", "Seoul", "Quito", "Perth")),
    }
    y = 70
    for k, v in fields.items():
        draw.text((24, y), f"{k}: {v}", fill=(30, 30, 30), font=body_font)
        y += 26
    y += 10
    for _ in range(rng.randint(3, 8)):  # filler body text
        if y > h - 30:
            break
        draw.text((24, y), " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 8))), fill=(60, 60, 60),
                  font=body_font)
        y += 22
    if rng.random() < 0.3:
        return img, "What is the title of this document?", title
    key = rng.choice(list(fields))
    return img, f"According to the document, what is the {key.lower()}?", fields[key]


# The testbed's tasks (issue 29): small images a ~1.2M-parameter model learns to read in the tiny recipes' budget, so
# the ablation's chart and document benchmarks sit between floor and ceiling. Glyphs are 16-20 px, the size the
# digit strips show is readable by the tiny vision tower (one merged token is 28 x 28 pixels).
SIZED_SHAPES = ((28, 112), (56, 140), (56, 168), (56, 196), (56, 224))  # (h, w): the canonical strip and enlargements
MINI_LABELS = ("A", "B", "C", "D", "E", "F", "G", "H")
MINI_FIELDS = ("Total", "Code")  # the form's two fields, in this order


# The sizes the ablation's resolution grid (mindvl.ablate.plan SCALES) makes of a 224 x 112 chart or form, as
# (min, max) pixel limits in 28 x 28 units: downscaled by max_pixels 16 / 24 / 28, upscaled by min_pixels 36 / 48.
PAGE_GRID_SETTINGS = ((4, 16), (4, 24), (4, 28), (36, 64), (48, 64))
PAGE_SIZED_SHAPES = tuple(smart_resize(112, 224, min_pixels=lo * FACTOR**2, max_pixels=hi * FACTOR**2)
                          for lo, hi in PAGE_GRID_SETTINGS)  # (h, w): 56x140, 84x168, 84x196, 140x252, 140x280


def _resized(img: Image.Image, rng: random.Random, shapes: Sequence[tuple[int, int]]) -> Image.Image:
    """Half the time, `img` resized (bicubic, as the processor resizes) to one of `shapes` (h, w): real training
    images come at many sizes, so a model trained on these has seen the sizes test-time min/max_pixels make."""
    if rng.random() < 0.5:
        h, w = rng.choice(list(shapes))
        img = img.resize((w, h), Image.BICUBIC)
    return img


def _digits_sized(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A `digits` strip, half the time enlarged (bicubic, as the processor upscales) to one of SIZED_SHAPES: real
    training images come at many sizes, so a model trained on these reads a strip that test-time min_pixels enlarges
    (the resolution grid's upscaled settings) instead of failing on every one of them."""
    img, q, text = _digits(rng)
    return _resized(img, rng, SIZED_SHAPES[1:]), q, text


def _minichart_sized(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A `minichart`, half the time resized to one of PAGE_SIZED_SHAPES (the resolution grid's sizes). Not in the
    tiny recipes: with these at 10% of the multitask and SFT samples, the tiny model read no chart at any size
    (RESULTS, Testbed, session 9); kept for larger budgets."""
    img, q, answer = _minichart(rng)
    return _resized(img, rng, PAGE_SIZED_SHAPES), q, answer


def _minidoc_sized(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A `minidoc`, half the time resized to one of PAGE_SIZED_SHAPES (the resolution grid's sizes); see
    `_minichart_sized`."""
    img, q, answer = _minidoc(rng)
    return _resized(img, rng, PAGE_SIZED_SHAPES), q, answer


def _minichart(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A 224 x 112 bar chart (32 merged tokens): three bars lettered A, B, C from the left, each bar's value (10-99)
    printed in a row along the top above its bar. Asks for one bar's value (read the number above the named bar) or
    for the highest bar's letter (compare heights or values). A fixed layout keeps the task within what the tiny
    model learns in the tiny budget (values printed on top of 3-4 bars lettered from A-H stayed at 0-7% exact match;
    RESULTS, Testbed). Below 32 tokens of max_pixels the image is downscaled: what separates the SFT variants trained
    at 16/48/64 tokens."""
    w, h = 224, 112
    img = Image.new("RGB", (w, h), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    n = 3
    labels = list(MINI_LABELS[:n])
    vals = rng.sample(range(10, 100), n)  # distinct: the highest bar is unambiguous
    font = _truetype(rng.randint(18, 20))
    colour = rng.choice(list(COLOURS.values())[:6])
    base, top_room = h - 22, 28  # bars stand on y=base; the values' row takes the top 28 px (one token row)
    step = (w - 8) / n
    draw.line([(4, base), (w - 4, base)], fill=(0, 0, 0), width=1)
    for i, (lab, v) in enumerate(zip(labels, vals, strict=True)):
        cx = 4 + step * (i + 0.5)
        top = base - (base - top_room) * v / 100
        draw.rectangle([cx - step * 0.2, top, cx + step * 0.2, base], fill=colour)
        draw.text((cx, top_room // 2), str(v), fill=(0, 0, 0), font=font, anchor="mm")
        draw.text((cx, base + 2), lab, fill=(0, 0, 0), font=font, anchor="mt")
    if rng.random() < 0.6:
        i = rng.randrange(n)
        return img, f"What is the value of bar {labels[i]}?", str(vals[i])
    return img, "Which bar is the highest?", labels[max(range(n), key=vals.__getitem__)]


def _minidoc(rng: random.Random) -> tuple[Image.Image, str, str]:
    """A 224 x 112 form (32 merged tokens): a title line ("Invoice 48"), then "Total: 37" and "Code: 52" on the next
    two lines, one 28-px token row each, two-digit numbers. Asks for one field's value (the key names the line, then
    read its number) or for the title. A fixed layout keeps the task within the tiny budget (three of six keys in
    random order, with up to three digits, stayed at 0%; two keys in random order too)."""
    w, h = 224, 112
    img = Image.new("RGB", (w, h), (252, 252, 248))
    draw = ImageDraw.Draw(img)
    font = _truetype(rng.randint(18, 20))
    title = f"{rng.choice(('Invoice', 'Receipt', 'Order', 'Report'))} {rng.randint(10, 99)}"
    fields = {k: str(rng.randint(10, 99)) for k in MINI_FIELDS}
    lines = [title, *(f"{k}: {v}" for k, v in fields.items())]
    for row, line in enumerate(lines):
        draw.text((6, 14 + 28 * row), line, fill=(10, 10, 10), font=font, anchor="lm")
    if rng.random() < 0.25:
        return img, "What is the title of this form?", title
    key = rng.choice(MINI_FIELDS)
    return img, f"What is the {key.lower()} on this form?", fields[key]


def _reverse(rng: random.Random) -> tuple[str, str]:
    """Text only: write a 3-6 digit number backwards. A skill a tiny language model learns in a few hundred steps: the
    base LLM's first task and the text instruction data of the tiny multitask and SFT recipes (`sort` is the probe)."""
    text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 6)))
    q = rng.choice(("Write {} backwards.", "Reverse the digits {}.", "What is {} reversed?")).format(text)
    return q, text[::-1]


def _sort(rng: random.Random) -> tuple[str, str]:
    """Text only: write a 3-6 digit number's digits in ascending order. The base LLM (text.yaml) learns it beside
    `reverse`; the vision-language phases' text data carries only `reverse`, so this is the skill they can erode and
    the LM merge can restore (claim 4's probe), as a real model's text benchmarks differ from its instruction data."""
    text = "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(3, 6)))
    q = rng.choice(("Sort the digits of {}.", "Write the digits of {} in ascending order.")).format(text)
    return q, "".join(sorted(text))


GENERATORS: dict[str, Callable[[random.Random], tuple[Image.Image, str, str]]] = {
    "ocr": _ocr, "chart": _chart, "grounding": _grounding, "doc": _doc, "digits": _digits,
    "digits_sized": _digits_sized, "minichart": _minichart, "minidoc": _minidoc,
    "minichart_sized": _minichart_sized, "minidoc_sized": _minidoc_sized,
}
# Text-only tasks: (question, answer) with no image.
TEXT_GENERATORS: dict[str, Callable[[random.Random], tuple[str, str]]] = {"reverse": _reverse, "sort": _sort}
# The short-answer instructions that VQA instruction data carries (LLaVA-style) and that the community toolkits'
# ChartQA / DocVQA prompts end with (lmms-eval ChartQA: "with a single word"; DocVQA, and VLMEvalKit's ChartQA: "using
# a single word or phrase"). Training questions of the testbed's chart and form tasks carry one, so a model trained
# on them is asked at evaluation what it was taught: without it the tiny model answered the suffixed benchmark
# questions at its answer prior (ChartQA 5%, DocVQA 1%) while reading 52% / 29% of the same items asked bare
# (benchmarks/RESULTS.md, Testbed). The benchmark items themselves stay bare: the evaluation appends the toolkit's.
SHORT_ANSWER_INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "minichart": ("\nAnswer the question with a single word.", "\nAnswer the question using a single word or phrase."),
    "minidoc": ("\nAnswer the question using a single word or phrase.",),
}
SHORT_ANSWER_INSTRUCTIONS.update({"minichart_sized": SHORT_ANSWER_INSTRUCTIONS["minichart"],
                                  "minidoc_sized": SHORT_ANSWER_INSTRUCTIONS["minidoc"]})


def make_record(i: int, seed: int, tasks: Sequence[str]) -> tuple[dict, Image.Image | None, str]:
    """Sample i: (record without its image path, image or None for a text task, task). A pure function of
    (seed, i, tasks)."""
    rng = random.Random(f"mindvl-synth:{seed}:{i}")
    task = tasks[rng.randrange(len(tasks))]
    if task in TEXT_GENERATORS:
        question, answer = TEXT_GENERATORS[task](rng)
        turns = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        return {"messages": turns}, None, task
    img, question, answer = GENERATORS[task](rng)
    if task in SHORT_ANSWER_INSTRUCTIONS:
        question += rng.choice(SHORT_ANSWER_INSTRUCTIONS[task])
    prompt = f"<image>{question}" if rng.random() < 0.8 else f"{question}\n<image>"
    record = {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}
    if task == "grounding":
        record["coords"] = "abs"  # pixels of the image on disk: the pipeline rescales them when it resizes
    return record, img, task


def generate(out_dir: str | os.PathLike, n: int, seed: int = 0, tasks: Sequence[str] = TASKS,
             progress: Callable[[int], None] | None = None) -> Path:
    """Write n samples to out_dir/data.jsonl and out_dir/images/; returns the JSONL path. `progress(i)` is called
    after each sample when given."""
    for t in tasks:
        if t not in GENERATORS and t not in TEXT_GENERATORS:
            raise ValueError(f"unknown synth task {t!r} (known: {', '.join([*GENERATORS, *TEXT_GENERATORS])})")
    if n <= 0:
        raise ValueError(f"--n must be > 0, got {n}")
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    jsonl = out / "data.jsonl"
    with open(jsonl, "w") as f:
        for i in range(n):
            record, img, task = make_record(i, seed, list(tasks))
            if img is not None:
                name = f"images/{task}_{i:07d}.png"
                # zlib level 3 instead of Pillow's 6: the same pixels (PNG is lossless) in ~5-10% more bytes, written in
                # about half the time (the images are ~2/3 of a set's generation time at level 6)
                img.save(out / name, format="PNG", compress_level=3)
                record["images"] = [name]
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
            if progress is not None:
                progress(i + 1)
    return jsonl


def synth_path(cache: str | os.PathLike, tasks: Sequence[str], n: int, seed: int) -> Path:
    """Where `ensure_synth` keeps a synthetic set's JSONL (it exists once generated)."""
    return Path(cache) / f"{'-'.join(tasks)}_n{n}_s{seed}_v{SYNTH_VERSION}" / "data.jsonl"


def ensure_synth(cache: str | os.PathLike, tasks: Sequence[str], n: int, seed: int,
                 progress: Callable[[int], None] | None = None) -> Path:
    """The JSONL of a cached synthetic set, generated on first use (atomically: safe with several ranks)."""
    cache = Path(cache)
    final = synth_path(cache, tasks, n, seed).parent
    if (final / "data.jsonl").is_file():
        return final / "data.jsonl"
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".synth-", dir=cache))
    try:
        generate(tmp, n, seed, tasks, progress)
        try:
            os.rename(tmp, final)  # atomic; if another process won the race its copy is identical
        except OSError:
            if not (final / "data.jsonl").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "data.jsonl"
