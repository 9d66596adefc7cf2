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

Videos render as `<|vision_start|><|video_pad|>*n<|vision_end|>` (n = t*h*w/4). Documents (`encode_document`) have
no template at all: text with image blocks, every text token trained, closed by a trained `<|endoftext|>`.

Bounded encoding (`max_tokens`; the training pipeline passes seq_len): tokenizing never sees much more text than a
pack can hold. Once more than `max_tokens + CUT_MARGIN` ids are built nothing more is added, and a long text chunk is
tokenized by growing prefixes (doubling, from 4 characters per missing token) cut just before a space or punctuation
that follows a letter or digit, a pre-tokenizer boundary (Qwen2's split pattern never joins across it), so the
prefix's tokens are the full text's; where no such boundary is in reach (256 characters), the CUT_MARGIN tokens
built past `max_tokens` absorb the pre-token cut in two. So the first `max_tokens` ids and labels equal those of the
unbounded encoding, and the result is longer than `max_tokens` exactly when the unbounded one is: truncation
(`process.safe_cut`) cuts the same sample (tests/data/test_data_bounded_records.py compares them on English, CJK,
digit, punctuation and boundary-free text). A vision block is added whole or not at all.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .schema import IGNORE_INDEX, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Message
from .tokenizer import TextTokenizer

DEFAULT_SYSTEM = "You are a helpful assistant."
MERGE_UNIT = 4  # 2x2 patches -> one LLM token
# Extra tokens a bounded encoding builds past max_tokens: the tokens at a prefix's end are the least certain to
# match the full text's (a pre-token cut in two), so they are kept beyond what the cut uses.
CUT_MARGIN = 64
_BOUNDARY_SEARCH = 256  # characters searched back from a prefix's end for a pre-tokenizer boundary


@dataclass
class Encoded:
    """Token ids, labels (int64 [L]) and where each vision item's pads are: image_spans[i] = (start, end) of the
    pad run of the i-th image or video in order of appearance (input_ids[start:end] are its image or video pads;
    its vision_start is at start-1 and vision_end at end); is_video[i] says which."""

    input_ids: np.ndarray
    labels: np.ndarray
    image_spans: list[tuple[int, int]]
    is_video: list[bool] | None = None
    partial: bool = False  # a bounded encoding stopped early: the full text has more tokens than these


def _boundary(text: str, n: int) -> int:
    """A cut <= n just before a space or punctuation that follows a letter or digit (no pre-token spans it, and
    NFC never composes across it), searched in the last _BOUNDARY_SEARCH characters; n when there is none."""
    for i in range(n, max(n - _BOUNDARY_SEARCH, 1), -1):
        c = text[i]
        if (c.isspace() or unicodedata.category(c)[0] == "P") and text[i - 1].isalnum():
            return i
    return n


def encode_prefix(tok: TextTokenizer, text: str, need: int | None):
    """`tok.encode_text` of `text`, or of a prefix of it that has at least `need` tokens (None: the whole text).

    Prefixes grow by doubling from 4 characters per needed token (running text is ~4), so the text tokenized is
    at most about twice what gives `need` tokens, and the tokenizer never sees a huge text whole."""
    if need is None:
        return tok.encode_text(text)
    n = max(4 * need, 256)
    while n < len(text):
        enc = tok.encode_text(text[:_boundary(text, n)])
        if len(enc.ids) >= need:
            return enc
        n *= 2
    return tok.encode_text(text)


class _Builder:
    """Accumulates ids/labels; text is buffered so one chunk between two special tokens is encoded at once."""

    def __init__(self, tok: TextTokenizer, max_tokens: int | None = None):
        self.tok = tok
        # Bounded: stop once more than this many ids are built (max_tokens + CUT_MARGIN); None: never.
        self.stop_after = None if max_tokens is None else max_tokens + CUT_MARGIN
        self.ids: list[int] = []
        self.labels: list[int] = []
        self.spans: list[tuple[int, int]] = []
        self.is_video: list[bool] = []
        self._text: list[str] = []
        self._label_from: int | None = None  # char offset in the pending chunk from which tokens are trained

    @property
    def full(self) -> bool:
        return self.stop_after is not None and len(self.ids) > self.stop_after

    def text(self, s: str, trained: bool) -> None:
        if self.full:
            return
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
        need = None if self.stop_after is None else self.stop_after + 1 - len(self.ids)
        enc = encode_prefix(self.tok, chunk, need)  # "<|im_end|>" in a message is text, not the end of the turn
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
        if self.full:
            return
        self.ids.extend([token_id] * count)
        self.labels.extend([token_id if trained else IGNORE_INDEX] * count)

    def image(self, n_pads: int, video: bool = False) -> None:
        sp = self.tok.special
        if video and sp.video_pad is None:
            raise ValueError(f"tokenizer {self.tok.name} has no <|video_pad|> token; use a Qwen2-VL/2.5-VL tokenizer")
        self._flush()
        if self.full:
            return  # a vision block is added whole or not at all (safe_cut needs its span)
        stop, self.stop_after = self.stop_after, None
        self.special(sp.vision_start, False)
        start = len(self.ids)
        self.special(sp.video_pad if video else sp.image_pad, False, n_pads)
        self.spans.append((start, len(self.ids)))
        self.is_video.append(video)
        self.special(sp.vision_end, False)
        self.stop_after = stop

    def finish(self) -> Encoded:
        self._flush()
        return Encoded(np.asarray(self.ids, np.int64), np.asarray(self.labels, np.int64), self.spans, self.is_video,
                       partial=self.full)


def encode_conversation(
    tok: TextTokenizer,
    messages: Sequence[Message],
    grids: Sequence[tuple[int, int, int]],
    default_system: str | None = DEFAULT_SYSTEM,
    train_on_prompt: bool = False,
    video_grids: Sequence[tuple[int, int, int]] = (),
    max_tokens: int | None = None,
    video_timestamps: Sequence[Sequence[float]] | None = None,
) -> Encoded:
    """Render `messages` (content with `<image>`/`<video>` placeholders) and tokenize; `grids[i]` is image i's
    (t, h, w), `video_grids[j]` video j's. Each video becomes `<|vision_start|><|video_pad|>*n<|vision_end|>`;
    with `video_timestamps` (Qwen3-VL's processor) video j becomes, per temporal patch k,
    `<{video_timestamps[j][k]:.1f} seconds><|vision_start|><|video_pad|>*(h*w/4)<|vision_end|>`: t vision items
    (spans), each one frame of the video.

    Labels are on assistant content + `<|im_end|>`; with `train_on_prompt`, on every non-vision token except the
    `<|im_start|>role\\n` headers. `max_tokens`: a bounded encoding (see the module docstring).
    """
    if sum(m.content.count(IMAGE_PLACEHOLDER) for m in messages) != len(grids):
        raise ValueError("number of <image> placeholders differs from the number of images")
    if sum(m.content.count(VIDEO_PLACEHOLDER) for m in messages) != len(video_grids):
        raise ValueError("number of <video> placeholders differs from the number of videos")
    sp = tok.special
    b = _Builder(tok, max_tokens)
    turns = list(messages)
    if default_system is not None and (not turns or turns[0].role != "system"):
        turns.insert(0, Message("system", default_system))
    items = _VisionItems(grids, video_grids, video_timestamps)
    for m in turns:
        trained = m.role == "assistant" or (train_on_prompt and m.role != "system")
        b.special(sp.im_start, False)
        b.text(f"{m.role}\n", False)
        _content(b, m.content, items, trained)
        b.special(sp.im_end, trained)
        b.text("\n", False)
    return b.finish()


_PLACEHOLDERS = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})")
_IMAGE_ONLY = re.compile(f"({re.escape(IMAGE_PLACEHOLDER)})")  # documents: a literal "<video>" is just text


class _VisionItems:
    """The next image's or video's pad count, in order of appearance."""

    def __init__(self, grids: Sequence[tuple[int, int, int]], video_grids: Sequence[tuple[int, int, int]],
                 video_timestamps: Sequence[Sequence[float]] | None = None):
        self.grids, self.video_grids, self.image, self.video = grids, video_grids, 0, 0
        self.timestamps = video_timestamps
        if video_timestamps is not None:
            if len(video_timestamps) != len(video_grids):
                raise ValueError(f"{len(video_timestamps)} timestamp lists for {len(video_grids)} videos")
            for (t, _, _), stamps in zip(video_grids, video_timestamps, strict=True):
                if len(stamps) != t:
                    raise ValueError(f"a video of {t} temporal patches has {len(stamps)} timestamps")

    def frames(self) -> list[tuple[float, int]]:
        """Qwen3-VL: the next video's (seconds, pads) per temporal patch."""
        t, h, w = self.video_grids[self.video]
        stamps = self.timestamps[self.video]
        self.video += 1
        return [(stamps[k], h * w // MERGE_UNIT) for k in range(t)]

    def pads(self, video: bool) -> int:
        if video:
            t, h, w = self.video_grids[self.video]
            self.video += 1
        else:
            t, h, w = self.grids[self.image]
            self.image += 1
        return t * h * w // MERGE_UNIT


def _content(b: _Builder, content: str, items: _VisionItems, trained: bool,
             placeholders: re.Pattern = _PLACEHOLDERS) -> None:
    for piece in placeholders.split(content):
        if piece == VIDEO_PLACEHOLDER and items.timestamps is not None:
            for seconds, pads in items.frames():
                b.text(f"<{seconds:.1f} seconds>", trained)
                b.image(pads, video=True)
        elif piece == IMAGE_PLACEHOLDER or piece == VIDEO_PLACEHOLDER:
            b.image(items.pads(piece == VIDEO_PLACEHOLDER), video=piece == VIDEO_PLACEHOLDER)
        elif piece:
            b.text(piece, trained)


def encode_document(tok: TextTokenizer, text: str, grids: Sequence[tuple[int, int, int]],
                    end_of_text: bool = True, max_tokens: int | None = None) -> Encoded:
    """A document (interleaved web page, plain text): no chat template; `text` with `<image>` placeholders.

    Every text token after the first is trained and so is the closing `<|endoftext|>` (the model learns where
    documents end); vision_start, the pads and vision_end are not.
    """
    if text.count(IMAGE_PLACEHOLDER) != len(grids):
        raise ValueError("number of <image> placeholders differs from the number of images")
    b = _Builder(tok, max_tokens)
    _content(b, text, _VisionItems(grids, ()), trained=True, placeholders=_IMAGE_ONLY)
    if end_of_text:
        b.special(tok.special.endoftext, True)
    enc = b.finish()
    if len(enc.labels):
        enc.labels[0] = IGNORE_INDEX  # no token predicts a sample's first one: it is not a target
    return enc


def mrope_positions(length: int, image_spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]],
                    time_intervals: Sequence[float | None] | None = None) -> np.ndarray:
    """int64 [3, length]: Qwen2.5-VL `get_rope_index` positions for one sample, starting at 0.

    Text tokens advance one position on all three rows; a vision item's pads get (time, row, col) merged-grid
    coordinates offset by the current position, and the text after it resumes at current + max(h, w)/2.
    `time_intervals[i]` is None for an image (time index = temporal patch k, always 0) and, for a video,
    `tokens_per_second * second_per_grid_t`: its patch k gets time int(k * interval), computed in float32 as
    transformers does (Qwen2.5-VL's absolute-time alignment).
    """
    pos = np.empty((3, length), np.int64)
    cur = 0
    prev = 0
    intervals = list(time_intervals) if time_intervals is not None else [None] * len(grids)
    for (start, end), (t, h, w), interval in zip(image_spans, grids, intervals, strict=True):
        n_text = start - prev
        pos[:, prev:start] = np.arange(cur, cur + n_text)[None, :]
        cur += n_text
        lh, lw = h // 2, w // 2
        if end - start != t * lh * lw:
            raise ValueError("image span length does not match its grid")
        frames = np.arange(t)
        if interval is not None:
            frames = (frames.astype(np.float32) * np.float32(interval)).astype(np.int64)
        tt = np.repeat(frames, lh * lw)
        hh = np.tile(np.repeat(np.arange(lh), lw), t)
        ww = np.tile(np.arange(lw), t * lh)
        pos[0, start:end] = tt + cur
        pos[1, start:end] = hh + cur
        pos[2, start:end] = ww + cur
        cur = cur + max(lh, lw)  # not past the time axis: transformers resumes at the spatial extent
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
