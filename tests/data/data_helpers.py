"""Helpers for the data pipeline tests (a uniquely named module, imported by the test files)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
from PIL import Image


def png_bytes(h: int, w: int, seed: int = 0, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def write_jsonl(path: Path, records: list) -> Path:
    """Records may be dicts (dumped as JSON) or raw strings (written as-is, for malformed lines)."""
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return path


def write_tar(path: Path, keys: list[tuple[str, dict[str, bytes]]]) -> Path:
    """A WebDataset shard: per key, members named key.suffix."""
    with tarfile.open(path, "w") as tf:
        for key, members in keys:
            for suffix, data in members.items():
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return path


def qa(question: str = "What is this?", answer: str = "A test.", images: list[str] | None = None) -> dict:
    rec = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}
    if images is not None:
        rec["images"] = images
    return rec
