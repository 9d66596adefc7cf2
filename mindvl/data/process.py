"""Conversation -> Sample: decode and patchify images, render and tokenize, truncate safely, M-RoPE positions.

Deterministic: the same record always gives the same Sample, which is what lets the packing buffer be restored on
resume by reading its records again instead of storing their pixels in the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .image import PATCH_PIXELS, ImageError, load_image, preprocess_uint8
from .schema import IGNORE_INDEX, BadSample, Conversation, Sample, SampleRef
from .template import DEFAULT_SYSTEM, encode_conversation, mrope_positions, safe_cut
from .tokenizer import TextTokenizer


@dataclass
class ProcessConfig:
    seq_len: int
    min_pixels: int
    max_pixels: int
    max_image_pixels: int
    truncation: str = "truncate"  # truncate | drop
    max_patches: int | None = None  # a sample with more patch rows can never fit a pack
    default_system: str | None = DEFAULT_SYSTEM
    train_on_prompt: bool = False
    image_resize: str = "pil"  # mindvl.data.image.resize_rgb method


def process_conversation(conv: Conversation, tok: TextTokenizer, cfg: ProcessConfig, source: int = 0,
                         ref: SampleRef | None = None) -> tuple[Sample, bool]:
    """Returns (sample, truncated). Raises BadSample (reasons: image problems, too_long, too_many_patches)."""
    pixels: list[np.ndarray] = []
    grids: list[tuple[int, int, int]] = []
    for img in conv.images:
        try:
            image = load_image(img.data if img.data is not None else img.name, cfg.max_image_pixels)
            pv, grid = preprocess_uint8(image, cfg.min_pixels, cfg.max_pixels, resize=cfg.image_resize)
        except ImageError as exc:
            raise BadSample(exc.reason, conv.where, f"{exc}") from exc
        pixels.append(pv)
        grids.append(grid)

    enc = encode_conversation(tok, conv.messages, grids, cfg.default_system, cfg.train_on_prompt)
    ids, labels, spans = enc.input_ids, enc.labels, enc.image_spans
    truncated = False
    if len(ids) > cfg.seq_len:
        if cfg.truncation == "drop":
            raise BadSample("too_long", conv.where, f"{len(ids)} tokens > seq_len {cfg.seq_len} (truncation: drop)")
        cut = safe_cut(len(ids), cfg.seq_len, spans)
        keep = sum(1 for _, end in spans if end < cut)  # images whose whole block is before the cut
        ids, labels = ids[:cut], labels[:cut]
        spans, grids, pixels = spans[:keep], grids[:keep], pixels[:keep]
        truncated = True
        if not (labels != IGNORE_INDEX).any():
            raise BadSample("too_long", conv.where, f"{len(enc.input_ids)} tokens > seq_len {cfg.seq_len} and "
                            "nothing trainable before a safe cut")
    n_patches = sum(p.shape[0] for p in pixels)
    if cfg.max_patches is not None and n_patches > cfg.max_patches:
        raise BadSample("too_many_patches", conv.where,
                        f"{n_patches} patch rows > max_patches_per_pack {cfg.max_patches}; lower max_pixels")
    positions = mrope_positions(len(ids), spans, grids)
    if len(pixels) == 1:
        patches = pixels[0]  # the common case: no copy
    else:
        patches = np.concatenate(pixels, 0) if pixels else np.zeros((0, PATCH_PIXELS), np.uint8)
    grid_thw = np.asarray(grids, np.int64).reshape(-1, 3)
    sample = Sample(ids, labels, positions, patches, grid_thw, source, ref, conv.where)
    return sample, truncated
