"""Parse and validate one record (a dict from a JSONL line or a tar shard's .json) into a `Conversation`.

Accepted layouts (what LLaMA-Factory, ms-swift and InternVL users have on disk):
- `messages`: [{role, content}] with roles system/user/assistant (`human`/`gpt` accepted); content is a string
  with `<image>` placeholders, or a list of parts [{type: text, text} | {type: image}].
- ShareGPT `conversations`: [{from, value}] with from human/user, gpt/assistant, system.
- optional top-level `system`; images in `images` (list) or `image` (one name or a list; InternVL/LLaVA);
  videos in `videos` / `video` for `<video>` placeholders (or {type: video} parts).
Text-only records are fine.

Documents (no chat template, loss on text; OBELICS/MMC4-style interleaved pages and plain text):
- `{"text": "... <image> ...", "images": [...]}`, or OBELICS's parallel lists
  `{"texts": ["a", null, "b"], "images": [null, "x.jpg", null]}` (each position is text or an image).
Captions (turned into samples by the source's caption prompts): `{"image": "x.jpg", "caption": "..."}` (or
`text` beside one image name, LAION-style), and a tar key's `txt` member (or `.json` with a `caption` field)
beside exactly one image (WebDataset caption shards).

Grounding: `"coords": "abs" | "rel1000" | "rel1"` declares the convention of the boxes and points in a chat's text
(mindvl.data.grounding rewrites them into the model's).

Every problem raises `BadSample(reason, where, message)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .grounding import RECORD_COORDS
from .schema import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, BadSample, Conversation, ImageRef, Message

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
}


def _content_text(content: Any, where: str, index: int) -> str:
    """A message content as text with `<image>` placeholders (list-of-parts content is flattened)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict) and (part.get("type") == "image" or "image" in part or "image_url" in part):
                out.append(IMAGE_PLACEHOLDER)
            elif isinstance(part, dict) and (part.get("type") == "video" or "video" in part):
                out.append(VIDEO_PLACEHOLDER)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                raise BadSample("bad_message", where, f"message {index}: content part {part!r:.60} is not text/image")
        return "".join(out)
    raise BadSample("bad_message", where, f"message {index}: content must be a string or a list of parts")


def _names(record: dict, plural: str, singular: str, where: str, default: list[str] | None = None) -> list[str]:
    names = record.get(plural, record.get(singular))
    if names is None:
        names = list(default or [])
    elif isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadSample("bad_record", where, f"`{plural}` must be a list of file names")
    return names


def _check_count(text: str, marker: str, names: list[str], where: str) -> None:
    n = text.count(marker)
    if n != len(names):
        kind = "image" if marker == IMAGE_PLACEHOLDER else "video"
        raise BadSample(f"{kind}_count_mismatch", where,
                        f"{n} {marker} placeholder(s) but {len(names)} {kind}(s); make them match")


def parse_record(
    record: Any,
    where: str,
    resolve_image: Callable[[str], ImageRef],
    image_names: list[str] | None = None,
    caption: str | None = None,
) -> Conversation:
    """Validate `record` and return its Conversation (kind chat, document or caption).

    `resolve_image(name)` turns an image or video name from the record into an ImageRef (a path beside the JSONL
    file, or a tar member's bytes); it raises BadSample itself when the file does not exist. `image_names` are the
    images to use when the record lists none (a tar key's image members); `caption` a caption found beside them
    (a tar key's `txt` member) when the record has none.
    """
    if not isinstance(record, dict):
        raise BadSample("bad_record", where, "record is not a JSON object")
    if "messages" in record or "conversations" in record:
        return _parse_chat(record, where, resolve_image, image_names)
    if caption is None and ("texts" in record or ("text" in record and "caption" not in record
                                                  and not isinstance(record.get("image"), str))):
        return _parse_document(record, where, resolve_image, image_names)
    if "caption" in record or "text" in record or caption is not None:  # a txt member wins over .json metadata
        return _parse_caption(record, where, resolve_image, image_names, caption)
    raise BadSample("bad_record", where, "record has none of `messages`, `conversations` (chat), `text`/`texts` "
                    "(document) or `caption` (image-caption pair)")


def _parse_document(record: dict, where: str, resolve: Callable[[str], ImageRef],
                    image_names: list[str] | None) -> Conversation:
    if "texts" in record:  # OBELICS: parallel lists, each position text or an image
        texts, images = record["texts"], record.get("images", [None] * len(record["texts"]))
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            raise BadSample("bad_record", where, "`texts` and `images` must be lists of the same length")
        parts, names = [], []
        for i, (t, im) in enumerate(zip(texts, images, strict=True)):
            if (t is None) == (im is None) or not isinstance(t if t is not None else im, str):
                raise BadSample("bad_record", where, f"position {i}: give exactly one of a text or an image name")
            if im is not None:
                parts.append(IMAGE_PLACEHOLDER)
                names.append(im)
            else:
                parts.append(t)
        text = "".join(p if p == IMAGE_PLACEHOLDER else p.strip("\n") + "\n\n" for p in parts).rstrip("\n")
    else:
        text = record["text"]
        if not isinstance(text, str):
            raise BadSample("bad_record", where, "`text` must be a string")
        names = _names(record, "images", "image", where, image_names)
    if not text.replace(IMAGE_PLACEHOLDER, "").strip():
        raise BadSample("empty_document", where, "document has no text to train on; remove the record")
    _check_count(text, IMAGE_PLACEHOLDER, names, where)
    return Conversation([], [resolve(n) for n in names], where, kind="document", text=text)


def _parse_caption(record: dict, where: str, resolve: Callable[[str], ImageRef], image_names: list[str] | None,
                   caption: str | None) -> Conversation:
    text = record.get("caption", caption if caption is not None else record.get("text"))
    if not isinstance(text, str) or not text.strip():
        raise BadSample("empty_caption", where, "caption is missing or empty; remove the record")
    names = _names(record, "images", "image", where, image_names)
    if len(names) != 1:
        raise BadSample("image_count_mismatch", where, f"a caption record needs exactly one image, got {len(names)}")
    if IMAGE_PLACEHOLDER in text or VIDEO_PLACEHOLDER in text:
        raise BadSample("image_count_mismatch", where, f"the caption contains a {IMAGE_PLACEHOLDER} or "
                        f"{VIDEO_PLACEHOLDER} placeholder; remove it")
    return Conversation([], [resolve(names[0])], where, kind="caption", text=text.strip())


def _parse_chat(record: dict, where: str, resolve_image: Callable[[str], ImageRef],
                image_names: list[str] | None) -> Conversation:
    if "messages" in record:
        raw, role_key, text_key = record["messages"], "role", "content"
    elif "conversations" in record:
        raw, role_key, text_key = record["conversations"], "from", "value"
    else:
        raise BadSample("bad_record", where, "record has neither `messages` nor `conversations`")
    if not isinstance(raw, list) or not raw:
        raise BadSample("empty_conversation", where, "conversation is empty; remove the record")

    messages: list[Message] = []
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise BadSample("bad_record", where, "`system` must be a string")
        messages.append(Message("system", system))
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise BadSample("bad_message", where, f"message {i} is not an object")
        # Both spellings are accepted inside either layout (mixed exports are common).
        role_raw = m.get(role_key, m.get("role", m.get("from")))
        role = ROLE_ALIASES.get(str(role_raw).lower()) if role_raw is not None else None
        if role is None:
            raise BadSample(
                "unknown_role", where, f"message {i} has unknown role {role_raw!r}; use system/user/assistant"
            )
        if role == "system" and messages:
            raise BadSample("bad_message", where, f"message {i}: a system message may only come first")
        content = m.get(text_key, m.get("content", m.get("value")))
        messages.append(Message(role, _content_text(content, where, i)))
    if not any(m.role == "assistant" and m.content.strip() for m in messages):
        raise BadSample("no_assistant_turn", where, "conversation has no non-empty assistant message to train on")

    names = _names(record, "images", "image", where, image_names)
    videos = _names(record, "videos", "video", where)
    text = "".join(m.content for m in messages)
    _check_count(text, IMAGE_PLACEHOLDER, names, where)
    _check_count(text, VIDEO_PLACEHOLDER, videos, where)
    coords = record.get("coords")
    if coords is not None and (coords not in RECORD_COORDS or len(names) != 1):
        raise BadSample("bad_record", where, f"`coords` must be one of {', '.join(RECORD_COORDS)} on a record with "
                        f"exactly one image (got {coords!r} with {len(names)} image(s))")
    return Conversation(messages, [resolve_image(n) for n in names], where,
                        videos=[resolve_image(n) for n in videos], coords=coords)
