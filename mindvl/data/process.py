"""Conversation -> Sample: decode and patchify images and videos, render and tokenize, truncate safely, positions.

Deterministic: the same record always gives the same Sample, which is what lets the packing buffer be restored on
resume by reading its records again instead of storing their pixels in the checkpoint.

Record kinds: a chat goes through the chat template; a document (interleaved images and text, or plain text) is
tokenized as it stands with every text token trained; a caption becomes one or the other (mindvl.data.captions).
Text is tokenized only as far as seq_len needs (mindvl.data.template's bounded encoding): a long record costs
what one pack can hold, not its length. Truncation (`truncation: truncate`) of anything longer than seq_len cuts at
the last token before seq_len that is not inside an image's or video's `<|vision_start|> ... <|vision_end|>` block
and drops the vision items after the cut: a long document keeps its first seq_len tokens up to an image boundary,
never half an image.
Boxes and points of a record that declares `coords` are rewritten into `box_format` once its image's size on disk and
after smart_resize are known (mindvl.data.grounding).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from mindvl.untrusted import MAX_IMAGE_BYTES

from .captions import caption_sample, prompt_set
from .grounding import BoxError, convert_text
from .image import ImageError, load_image
from .processors import QWEN2_VL, VisionProcessing, image_uint8, process_video_qwen3
from .schema import IGNORE_INDEX, BadSample, Conversation, Message, Sample, SampleRef
from .template import DEFAULT_SYSTEM, encode_conversation, encode_document, mrope_positions, safe_cut
from .tokenizer import TextTokenizer
from .video import VideoSettings, preprocess_video


@dataclass(kw_only=True)  # by name only: eight positional ints and strings were one swap away from a silent bug
class ProcessConfig:
    seq_len: int
    min_pixels: int
    max_pixels: int
    max_image_pixels: int
    max_image_bytes: int = MAX_IMAGE_BYTES  # a named image file over it is skipped unread (image_too_large)
    truncation: str = "truncate"  # truncate | drop
    max_patches: int | None = None  # a sample with more patch rows can never fit a pack
    default_system: str | None = DEFAULT_SYSTEM
    train_on_prompt: bool = False
    caption_prompts: list[str] | str = "default"
    seed: int = 0
    video: VideoSettings = field(default_factory=VideoSettings)
    tokens_per_second: int = 2
    box_format: str = "qwen2.5-vl"
    image_resize: str = "pil"  # mindvl.data.image.resize_rgb method
    # The model family's processor: patch size, merge size, mean/std (applied when a pack is built), video rules.
    processing: VisionProcessing = QWEN2_VL


def _images(conv: Conversation, cfg: ProcessConfig) -> tuple[list[np.ndarray], list[tuple[int, int, int]],
                                                              Conversation]:
    pixels, grids = [], []
    for img in conv.images:
        try:
            image = load_image(img.data if img.data is not None else img.name, cfg.max_image_pixels,
                               cfg.max_image_bytes)
            pv, grid = image_uint8(image, cfg.processing, cfg.min_pixels, cfg.max_pixels, cfg.max_image_pixels,
                                   cfg.image_resize)
        except ImageError as exc:
            raise BadSample(exc.reason, conv.where, f"{exc}") from exc
        if conv.coords is not None:  # boxes in the text follow the image through smart_resize
            patch = cfg.processing.patch_size
            resized = (grid[2] * patch, grid[1] * patch)
            try:
                conv = _with_boxes(conv, image.size, resized, cfg.box_format)
            except BoxError as exc:
                raise BadSample(exc.reason, conv.where, f"{exc}") from exc
        pixels.append(pv)
        grids.append(grid)
    return pixels, grids, conv


def _with_boxes(conv: Conversation, size: tuple[int, int], resized: tuple[int, int], target: str) -> Conversation:
    messages = [Message(m.role, convert_text(m.content, conv.coords, target, size, resized)) for m in conv.messages]
    return dataclasses.replace(conv, messages=messages, coords=None)


def _videos(conv: Conversation, cfg: ProcessConfig) -> tuple[list[tuple[np.ndarray, tuple[int, int, int],
                                                                         float | None]],
                                                              list[tuple[int, int, int]], list[list[float]] | None]:
    """(the videos' vision items in order: (uint8 rows, grid, M-RoPE time interval), the videos' grids, their
    timestamps). Qwen2-VL's processor: one item per video, its time axis scaled by the interval. Qwen3-VL's: one
    item per temporal patch (grid (1, h, w), no time offset: the prompt's `<t seconds>` text carries time), and the
    timestamps the template writes before each."""
    items, grids, stamps = [], [], []
    qwen3 = cfg.processing.family == "qwen3_vl"
    for vid in conv.videos:
        source = vid.data if vid.data is not None else vid.name
        try:
            if qwen3:
                q = process_video_qwen3(source, cfg.processing, cfg.video.fps, cfg.video.max_decoded_frames,
                                        cfg.video.max_video_bytes)
            else:
                v = preprocess_video(source, cfg.video)
        except ImageError as exc:  # VideoError is one
            raise BadSample(exc.reason, conv.where, f"{exc}") from exc
        if qwen3:
            items += [(rows, grid, None) for rows, grid in q.frames()]
            grids.append(q.grid)
            stamps.append(q.timestamps)
            continue
        grids.append(v.grid)
        # float32 like transformers: tokens_per_second * second_per_grid_t (a float32 tensor there)
        items.append((v.patches, v.grid, float(np.float32(cfg.tokens_per_second) * np.float32(v.second_per_grid_t))))
    return items, grids, (stamps if qwen3 else None)


def process_conversation(conv: Conversation, tok: TextTokenizer, cfg: ProcessConfig, source: int = 0,
                         ref: SampleRef | None = None) -> tuple[Sample, bool]:
    """Returns (sample, truncated). Raises BadSample (reasons: image/video problems, too_long, too_many_patches)."""
    if conv.kind == "caption":
        conv = caption_sample(conv, prompt_set(cfg.caption_prompts), cfg.seed)
    pixels, grids, conv = _images(conv, cfg)
    video_items, vgrids, stamps = _videos(conv, cfg)

    # Bounded: the tokenizer sees about as much text as seq_len tokens need, however long the record (the ids
    # up to seq_len, and whether there are more, are those of the whole text).
    if conv.kind == "document":
        enc = encode_document(tok, conv.text, grids, max_tokens=cfg.seq_len)
    else:
        enc = encode_conversation(tok, conv.messages, grids, cfg.default_system, cfg.train_on_prompt, vgrids,
                                  max_tokens=cfg.seq_len, video_timestamps=stamps)
    ids, labels, spans = enc.input_ids, enc.labels, enc.image_spans
    is_video = list(enc.is_video or [False] * len(spans))
    # Every vision item in order of appearance: (is_video, rows, grid, time interval or None).
    img_iter, vid_iter = iter(zip(pixels, grids, strict=True)), iter(video_items)
    items = []
    for v in is_video:
        if v:
            rows, grid, interval = next(vid_iter)
            items.append((True, rows, grid, interval))
        else:
            rows, grid = next(img_iter)
            items.append((False, rows, grid, None))
    truncated = False
    n_tokens = f"{'over ' if enc.partial else ''}{len(ids)}"
    if len(ids) > cfg.seq_len:
        if cfg.truncation == "drop":
            raise BadSample("too_long", conv.where, f"{n_tokens} tokens > seq_len {cfg.seq_len} (truncation: drop)")
        cut = safe_cut(len(ids), cfg.seq_len, spans)
        keep = sum(1 for _, end in spans if end < cut)  # items whose whole block is before the cut
        ids, labels = ids[:cut], labels[:cut]
        spans, items = spans[:keep], items[:keep]
        truncated = True
        if not (labels != IGNORE_INDEX).any():
            raise BadSample("too_long", conv.where, f"{n_tokens} tokens > seq_len {cfg.seq_len} and "
                            "nothing trainable before a safe cut")
    n_patches = sum(rows.shape[0] for _, rows, _, _ in items)
    if cfg.max_patches is not None and n_patches > cfg.max_patches:
        raise BadSample("too_many_patches", conv.where,
                        f"{n_patches} patch rows > max_patches_per_pack {cfg.max_patches}; lower max_pixels "
                        "(or the video's max_pixels / fps)")
    check_vision_tokens(ids, spans, [v for v, _, _, _ in items], tok, conv.where)
    positions = mrope_positions(len(ids), spans, [g for _, _, g, _ in items], [t for _, _, _, t in items])
    image_rows = [rows for v, rows, _, _ in items if not v]
    video_rows = [rows for v, rows, _, _ in items if v]
    if len(image_rows) == 1:
        patches = image_rows[0]  # the common case: no copy
    else:
        patches = np.concatenate(image_rows, 0) if image_rows else \
            np.zeros((0, 3 * cfg.processing.patch_size ** 2), np.uint8)
    grid_thw = np.asarray([g for _, _, g, _ in items], np.int64).reshape(-1, 3)
    sample = Sample(ids, labels, positions, patches, grid_thw, source, ref, conv.where)
    if video_rows:
        sample.video_patches = np.concatenate(video_rows, 0) if len(video_rows) > 1 else video_rows[0]
        sample.is_video = np.asarray([v for v, _, _, _ in items], bool)
        assert sample.video_patches.shape[1] == cfg.processing.patch_dim
    return sample, truncated


def check_vision_tokens(ids: np.ndarray, spans: list[tuple[int, int]], is_video: list[bool], tok: TextTokenizer,
                        where: str) -> None:
    """The model replaces each `<|image_pad|>` (`<|video_pad|>`) by one merged image (video) feature and raises when
    the counts differ; a sample with pads outside the template's vision blocks is skipped here (reason
    `image_token_mismatch`), before any model sees it, so no rank fails alone inside a step. With the template's
    text-is-text encoding this catches only a tokenizer that cannot encode a special-token string as text."""
    for pad_id, video, kind in ((tok.special.image_pad, False, "image"), (tok.special.video_pad, True, "video")):
        if pad_id is None:
            continue
        pads = int((ids == pad_id).sum())
        expected = sum(end - start for (start, end), v in zip(spans, is_video, strict=True) if v == video)
        if pads != expected:
            raise BadSample("image_token_mismatch", where, f"{pads} {kind} pad tokens for {expected} {kind} "
                            f"features; the text holds {kind} pad tokens")
