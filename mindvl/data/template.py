"""ChatML rendering as Qwen2-VL expects, token ids, labels, image-pad expansion and M-RoPE positions.

The rendering is Qwen2-VL's chat template (a default system turn when the first message is not a system message):

    <|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<|vision_start|><|image_pad|>*n
    <|vision_end|>Describe this image.<|im_end|>\n<|im_start|>assistant\nA cat.<|im_end|>\n

with each image's single `<|image_pad|>` expanded to n = t*h*w/4 pads, as Qwen2.5-VL's processor does.

Text is text: the only special tokens are the ones this template inserts (by id). Special-token strings inside a
message (a user typing `<|im_end|>` or `<|image_pad|>`) are encoded as ordinary characters, as transformers does with
`split_special_tokens=True`; otherwise they would end turns early or add image pads that no image feature matches.
For text without such strings the ids equal what HF gets by tokenizing the whole rendered string: text is encoded
in chunks that end exactly at special tokens, and special tokens are hard split points for a HF tokenizer too.
Labels (unshifted, -100 elsewhere) cover each assistant message's content and its `<|im_end|>` (as LLaMA-Factory
and ms-swift train Qwen), not the `<|im_start|>assistant\n` header nor the newline after `<|im_end|>`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schema import IGNORE_INDEX, IMAGE_PLACEHOLDER, Message
from .tokenizer import TextTokenizer

DEFAULT_SYSTEM = "You are a helpful assistant."
MERGE_UNIT = 4  # 2x2 patches -> one LLM token


@dataclass
class Encoded:
    """Token ids, labels (int64 [L]) and where each image's pads are: image_spans[i] = (start, end) of the pad run,
    i.e. input_ids[start:end] == image_pad; its vision_start is at start-1 and vision_end at end."""

    input_ids: np.ndarray
    labels: np.ndarray
    image_spans: list[tuple[int, int]]


class _Builder:
    """Accumulates ids/labels; text is buffered so one chunk between two special tokens is encoded at once."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self._text: list[str] = []
        self._label_from: int | None = None  # char offset in the pending chunk from which tokens are trained

    def text(self, s: str, trained: bool) -> None:
        if trained and self._label_from is None:
            self._label_from = sum(len(t) for t in self._text)
        elif not trained and self._label_from is not None:
            # A trained stretch followed by an untrained one in the same chunk never happens in ChatML.
            raise AssertionError("untrained text after trained text in one chunk")
        self._text.append(s)

    def _flush(self) -> None:
        if not self._text:
            return
        chunk = "".join(self._text)
        enc = self.tok.encode_text(chunk)  # "<|im_end|>" in a message is text, not the end of the turn
        self.ids.extend(enc.ids)
        if self._label_from is None:
            self.labels.extend([IGNORE_INDEX] * len(enc.ids))
        else:
            start = self._label_from
            # A token is trained if any of its characters is trained text (a token that straddles the boundary,
            # e.g. "\n\n" when the answer starts with a newline, carries answer text).
            pairs = zip(enc.ids, enc.offsets, strict=True)
            self.labels.extend(i if end > start else IGNORE_INDEX for i, (_, end) in pairs)
        self._text, self._label_from = [], None

    def special(self, token_id: int, trained: bool, count: int = 1) -> None:
        self._flush()
        self.ids.extend([token_id] * count)
        self.labels.extend([token_id if trained else IGNORE_INDEX] * count)

    def image(self, n_pads: int) -> None:
        sp = self.tok.special
        self.special(sp.vision_start, False)
        start = len(self.ids)
        self.special(sp.image_pad, False, n_pads)
        self.spans.append((start, len(self.ids)))
        self.special(sp.vision_end, False)

    def finish(self) -> Encoded:
        self._flush()
        return Encoded(np.asarray(self.ids, np.int64), np.asarray(self.labels, np.int64), self.spans)


def encode_conversation(
    tok: TextTokenizer,
    messages: Sequence[Message],
    grids: Sequence[tuple[int, int, int]],
    default_system: str | None = DEFAULT_SYSTEM,
    train_on_prompt: bool = False,
) -> Encoded:
    """Render `messages` (content with `<image>` placeholders) and tokenize; `grids[i]` is image i's (t, h, w).

    Labels are on assistant content + `<|im_end|>`; with `train_on_prompt`, on every non-vision token except the
    `<|im_start|>role\\n` headers.
    """
    if sum(m.content.count(IMAGE_PLACEHOLDER) for m in messages) != len(grids):
        raise ValueError("number of <image> placeholders differs from the number of images")
    sp = tok.special
    b = _Builder(tok)
    turns = list(messages)
    if default_system is not None and (not turns or turns[0].role != "system"):
        turns.insert(0, Message("system", default_system))
    image_index = 0
    for m in turns:
        trained = m.role == "assistant" or (train_on_prompt and m.role != "system")
        b.special(sp.im_start, False)
        b.text(f"{m.role}\n", False)
        pieces = m.content.split(IMAGE_PLACEHOLDER)
        for k, piece in enumerate(pieces):
            if k > 0:
                t, h, w = grids[image_index]
                b.image(t * h * w // MERGE_UNIT)
                image_index += 1
            if piece:
                b.text(piece, trained)
        b.special(sp.im_end, trained)
        b.text("\n", False)
    return b.finish()


def mrope_positions(length: int, image_spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]]) -> (
    np.ndarray
):
    """int64 [3, length]: Qwen2.5-VL `get_rope_index` positions for one sample, starting at 0.

    Text tokens advance one position on all three rows; an image's pads get (t, h, w) merged-grid coordinates
    offset by the current position, and the text after it resumes at max + 1 (= current + max(h, w)/2 for t=1).
    """
    pos = np.empty((3, length), np.int64)
    cur = 0
    prev = 0
    for (start, end), (t, h, w) in zip(image_spans, grids, strict=True):
        n_text = start - prev
        pos[:, prev:start] = np.arange(cur, cur + n_text)[None, :]
        cur += n_text
        lh, lw = h // 2, w // 2
        if end - start != t * lh * lw:
            raise ValueError("image span length does not match its grid")
        tt = np.repeat(np.arange(t), lh * lw)
        hh = np.tile(np.repeat(np.arange(lh), lw), t)
        ww = np.tile(np.arange(lw), t * lh)
        pos[0, start:end] = tt + cur
        pos[1, start:end] = hh + cur
        pos[2, start:end] = ww + cur
        cur = cur + max(t, lh, lw)  # = pos[:, start:end].max() + 1
        prev = end
    pos[:, prev:] = np.arange(cur, cur + length - prev)[None, :]
    return pos


def safe_cut(length: int, limit: int, image_spans: Sequence[tuple[int, int]]) -> int:
    """The largest cut <= limit that does not fall inside an image's <|vision_start|> ... <|vision_end|> block."""
    if length <= limit:
        return length
    cut = limit
    for start, end in image_spans:
        block_start, block_end = start - 1, end + 1  # vision_start .. vision_end inclusive -> [block_start, block_end)
        if block_start < cut < block_end:
            cut = block_start
    return cut
