"""Caption corpora as the warm-up uses them: an image and its caption become a sample through a prompt set.

A caption record (JSONL `{"image": ..., "caption": ...}`, a WebDataset key with an image and a `txt`, or a
`.json` with a `caption` field) becomes, by the source's `caption_prompts`:

- `default` or a list of instructions: a chat, user = `<image>` + one instruction, assistant = the caption. The
  instruction is a pure function of (data seed, record location), so the same record always gets the same one
  (which is what lets the packing buffer be rebuilt on resume) and the choice spreads evenly over the set;
- `none`: a document, `<image>` followed by the caption, every caption token trained.
"""

from __future__ import annotations

import dataclasses

from .mixture import uniform
from .schema import IMAGE_PLACEHOLDER, Conversation, Message

DEFAULT_CAPTION_PROMPTS = (
    "Describe this image.",
    "Describe the image briefly.",
    "What is in this picture?",
    "Write a caption for this image.",
    "Give a short description of the image.",
    "Summarize the content of this image.",
    "What does this image show?",
    "Provide a one-sentence caption for the photo.",
)


def prompt_set(caption_prompts: list[str] | str) -> tuple[str, ...] | None:
    """The instructions of a source's `caption_prompts` setting; None means captions are trained as documents."""
    if caption_prompts == "none":
        return None
    if caption_prompts == "default":
        return DEFAULT_CAPTION_PROMPTS
    return tuple(caption_prompts)


def choose_prompt(prompts: tuple[str, ...], seed: int, where: str) -> str:
    """The instruction for the record at `where` (seeded, stable across runs and resumes)."""
    return prompts[int(uniform("caption", seed, where) * len(prompts))]


def caption_sample(conv: Conversation, prompts: tuple[str, ...] | None, seed: int) -> Conversation:
    """A caption Conversation -> a chat (with a chosen instruction) or a document (`prompts` None)."""
    if prompts is None:
        return dataclasses.replace(conv, kind="document", text=f"{IMAGE_PLACEHOLDER}{conv.text}")
    messages = [Message("user", f"{IMAGE_PLACEHOLDER}{choose_prompt(prompts, seed, conv.where)}"),
                Message("assistant", conv.text)]
    return dataclasses.replace(conv, messages=messages, kind="chat", text="")
