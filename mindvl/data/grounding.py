"""Grounding conventions: boxes and points between a dataset's coordinates and the model's.

Conventions (`BoxFormat`):
- `abs`: absolute pixels of the image as stored on disk (what most datasets ship);
- `rel1000`: integers 0..1000 relative to the image (Qwen2-VL's convention, `<|box_start|>(x1,y1),(x2,y2)<|box_end|>`);
- `rel1`: floats 0..1 relative to the image (COCO-style normalised);
- `qwen2.5-vl`: absolute pixels of the *resized* image the model sees (Qwen2.5-VL's convention, `"bbox_2d"`).

A record declares the convention of the coordinates in its text with `"coords": "abs" | "rel1000" | "rel1"`; the
pipeline then rewrites every box and point in its messages into the data config's `box_format` (`qwen2.5-vl`, the
default, or `rel1000` for Qwen2-VL-style models), using the image's size on disk and after smart_resize, so
resizing never silently misplaces a box. Records without `coords` are left as they are. Recognised in text:
`(x1, y1), (x2, y2)` (Qwen2-VL, mindvl's synthetic set), `"bbox_2d": [x1, y1, x2, y2]` and `"point_2d": [x, y]`
(Qwen2.5-VL's JSON). A box or point outside the image (beyond half a pixel), or a box with x2 < x1 or y2 < y1, makes
the record a bad sample (`box_outside_image`, `bad_box`). Coordinates refer to the record's only image (a record
that declares `coords` with several images is refused: `bad_record`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

RECORD_COORDS = ("abs", "rel1000", "rel1")
MODEL_BOX_FORMATS = ("qwen2.5-vl", "rel1000")
_NUM = r"-?\d+(?:\.\d+)?"
_PAIR_BOX = re.compile(rf"\(\s*({_NUM})\s*,\s*({_NUM})\s*\)\s*,\s*\(\s*({_NUM})\s*,\s*({_NUM})\s*\)")
_JSON_BOX = re.compile(rf'("bbox_2d"\s*:\s*\[)\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*,\s*({_NUM})\s*(\])')
_JSON_POINT = re.compile(rf'("point_2d"\s*:\s*\[)\s*({_NUM})\s*,\s*({_NUM})\s*(\])')
TOLERANCE = 0.5  # pixels: a box edge on the image border, rounded, is inside


class BoxError(ValueError):
    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def to_pixels(values: Sequence[float], coords: str, size: tuple[int, int]) -> list[float]:
    """x, y, x, y, ... in `coords` -> absolute pixels of the image on disk; size = (width, height)."""
    w, h = size
    if coords == "abs":
        scale = (1.0, 1.0)
    elif coords == "rel1000":
        scale = (w / 1000, h / 1000)
    elif coords == "rel1":
        scale = (w, h)
    else:
        raise ValueError(f"unknown coordinate convention {coords!r} (known: {', '.join(RECORD_COORDS)})")
    return [v * scale[i % 2] for i, v in enumerate(values)]


def from_pixels(values: Sequence[float], target: str, size: tuple[int, int], resized: tuple[int, int]) -> list[int]:
    """Absolute pixels of the image on disk -> the model's convention (integers): `qwen2.5-vl` scales to the resized
    image, `rel1000` to 0..1000."""
    w, h = size
    if target == "qwen2.5-vl":
        scale = (resized[0] / w, resized[1] / h)
    elif target == "rel1000":
        scale = (1000 / w, 1000 / h)
    else:
        raise ValueError(f"unknown box format {target!r} (known: {', '.join(MODEL_BOX_FORMATS)})")
    return [round(v * scale[i % 2]) for i, v in enumerate(values)]


def check_inside(pixels: Sequence[float], size: tuple[int, int], is_box: bool) -> None:
    w, h = size
    for i, v in enumerate(pixels):
        limit = w if i % 2 == 0 else h
        if v < -TOLERANCE or v > limit + TOLERANCE:
            kind = "box" if is_box else "point"
            raise BoxError("box_outside_image", f"{kind} {[round(p, 1) for p in pixels]} (pixels) lies outside the "
                           f"{w}x{h} image; fix the annotation or the record's `coords`")
    if is_box and (pixels[2] < pixels[0] or pixels[3] < pixels[1]):
        raise BoxError("bad_box", f"box {[round(p, 1) for p in pixels]} has x2 < x1 or y2 < y1; write it as "
                       "(left, top), (right, bottom)")


def convert_text(text: str, coords: str, target: str, size: tuple[int, int], resized: tuple[int, int]) -> str:
    """Rewrite every box and point in `text` from `coords` to `target` (see the module docstring)."""

    def convert(values: list[str], is_box: bool) -> list[int]:
        pixels = to_pixels([float(v) for v in values], coords, size)
        check_inside(pixels, size, is_box)
        return from_pixels(pixels, target, size, resized)

    def pair_box(m: re.Match) -> str:
        x1, y1, x2, y2 = convert(list(m.groups()), True)
        return f"({x1}, {y1}), ({x2}, {y2})"

    def json_box(m: re.Match) -> str:
        x1, y1, x2, y2 = convert(list(m.groups()[1:5]), True)
        return f"{m.group(1)}{x1}, {y1}, {x2}, {y2}{m.group(6)}"

    def json_point(m: re.Match) -> str:
        x, y = convert(list(m.groups()[1:3]), False)
        return f"{m.group(1)}{x}, {y}{m.group(4)}"

    text = _PAIR_BOX.sub(pair_box, text)
    text = _JSON_BOX.sub(json_box, text)
    return _JSON_POINT.sub(json_point, text)
