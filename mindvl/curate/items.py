"""The unit that travels through a curation pipeline: one record with its image bytes and its annotations.

An `Item` keeps the record exactly as it was read (the JSON object mindvl trains on, minus its image-name fields)
and the images' encoded bytes, untouched, so a kept record is written out byte-for-byte as it came in. Stages add
JSON-serialisable annotations to `meta` (scores, hashes, cluster ids, OCR lines) and numeric vectors to `arrays`
(embeddings), which are kept beside the shard, not inside the record.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from mindvl.data.image import ImageError, load_image, to_rgb


@dataclass
class Item:
    key: str  # unique within the corpus and stable across runs: "<shard name>/<ordinal>"
    record: dict[str, Any]  # the record (messages or conversations), image-name fields removed
    images: list[bytes]  # encoded image bytes, in placeholder order
    where: str  # file:line or shard:key of the input, for messages
    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    # Model outputs shared by the stages of one pass and never written (e.g. the CLIP image embedding by model
    # folder, computed once for clip_score, embed and the aesthetic/NSFW/watermark heads).
    features: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)
    _decoded: list[Image.Image] | None = field(default=None, repr=False, compare=False)

    def pil_images(self) -> list[Image.Image]:
        """The images decoded once (RGB, EXIF-oriented) and cached on the item. Raises ImageError."""
        if self._decoded is None:
            self._decoded = [to_rgb(load_image(b)) for b in self.images]
        return self._decoded

    def first_image(self) -> Image.Image | None:
        images = self.pil_images()
        return images[0] if images else None

    @property
    def kind(self) -> str:
        return record_kind(self.record)

    def texts(self, role: str = "assistant") -> str:
        """The text of the messages of `role` (assistant: the caption/answer; user: the prompt; all), placeholders
        removed, joined by newlines. A caption record's caption counts as the assistant's; a document's text as
        every role's."""
        kind = self.kind
        if kind == "caption":
            return str(self.record.get("caption", self.record.get("text", ""))).strip() if role != "user" else ""
        if kind == "document":
            parts = self.record.get("texts", [self.record.get("text", "")])
            text = "\n".join(p for p in (parts if isinstance(parts, list) else [parts]) if isinstance(p, str))
            return text.replace("<image>", "").strip()
        out = []
        for m in messages_of(self.record):
            r = message_role(m)
            if role == "all" or r == role:
                out.append(message_text(m).replace("<image>", "").strip())
        return "\n".join(t for t in out if t)

    def set_answer(self, text: str) -> None:
        """Replace the last assistant message's text, or a caption record's caption (re-captioning, OCR answers)."""
        if self.kind == "caption":
            self.record["caption"] = text
            return
        msgs = messages_of(self.record)
        for m in reversed(msgs):
            if message_role(m) == "assistant":
                if "content" in m or "role" in m:
                    m["content"] = text
                else:
                    m["value"] = text
                return
        raise ValueError(f"{self.where}: record has no assistant message to replace")


def record_kind(record: dict) -> str:
    """chat | caption | document, as mindvl.data.records.parse_record decides it (curate writes a tar key's txt
    caption into the record's `caption`)."""
    if "messages" in record or "conversations" in record:
        return "chat"
    if "texts" in record or ("text" in record and "caption" not in record and not isinstance(record.get("image"), str)):
        return "document"
    return "caption"


def messages_of(record: dict) -> list[dict]:
    msgs = record.get("messages", record.get("conversations", []))
    return msgs if isinstance(msgs, list) else []


def message_role(m: dict) -> str:
    from mindvl.data.records import ROLE_ALIASES

    return ROLE_ALIASES.get(str(m.get("role", m.get("from", ""))).lower(), "")


def message_text(m: dict) -> str:
    content = m.get("content", m.get("value", ""))
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else str(p.get("text", "<image>" if p.get("type") == "image" else ""))
                       for p in content)
    return content if isinstance(content, str) else ""


def image_extension(data: bytes) -> str:
    """File extension for encoded image bytes (from the header, without decoding the pixels)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "png").lower()
    except Exception:  # an undecodable image is dropped by the decode filter; its name does not matter
        return "bin"
    return {"jpeg": "jpg", "tiff": "tif"}.get(fmt, fmt)


__all__ = ["ImageError", "Item", "image_extension", "message_role", "message_text", "messages_of"]
