"""Parse and validate one record (a dict from a JSONL line or a tar shard's .json) into a `Conversation`.

Accepted layouts (what LLaMA-Factory, ms-swift and InternVL users have on disk):
- `messages`: [{role, content}] with roles system/user/assistant (`human`/`gpt` accepted); content is a string
  with `<image>` placeholders, or a list of parts [{type: text, text} | {type: image}].
- ShareGPT `conversations`: [{from, value}] with from human/user, gpt/assistant, system.
- optional top-level `system`; images in `images` (list) or `image` (one name or a list; InternVL/LLaVA).
Text-only records are fine. Every problem raises `BadSample(reason, where, message)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .schema import IMAGE_PLACEHOLDER, BadSample, Conversation, ImageRef, Message

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
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                out.append(part["text"])
            else:
                raise BadSample("bad_message", where, f"message {index}: content part {part!r:.60} is not text/image")
        return "".join(out)
    raise BadSample("bad_message", where, f"message {index}: content must be a string or a list of parts")


def parse_record(
    record: Any,
    where: str,
    resolve_image: Callable[[str], ImageRef],
    image_names: list[str] | None = None,
) -> Conversation:
    """Validate `record` and return its Conversation.

    `resolve_image(name)` turns an image name from the record into an ImageRef (a path beside the JSONL file, or a
    tar member's bytes); it raises BadSample itself when the image does not exist. `image_names` are the images to
    use when the record lists none (a tar key's image members).
    """
    if not isinstance(record, dict):
        raise BadSample("bad_record", where, "record is not a JSON object")
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

    names = record.get("images", record.get("image"))
    if names is None:
        names = list(image_names or [])
    elif isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadSample("bad_record", where, "`images` must be a list of file names")
    n_placeholders = sum(m.content.count(IMAGE_PLACEHOLDER) for m in messages)
    if n_placeholders != len(names):
        raise BadSample(
            "image_count_mismatch",
            where,
            f"{n_placeholders} <image> placeholder(s) but {len(names)} image(s); make them match",
        )
    return Conversation(messages, [resolve_image(n) for n in names], where)
