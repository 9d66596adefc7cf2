"""The data types that travel through the pipeline: record -> Conversation -> Sample -> Pack.

Everything is NumPy; `Pack.to_torch()` is the one place that hands tensors to the model side (torch is imported
lazily there, so loader workers that never call it do not need it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mindvl.conventions import IGNORE_INDEX

ROLES = ("system", "user", "assistant")
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
RECORD_KINDS = ("chat", "document", "caption")


class BadSample(ValueError):
    """A record that cannot become a training sample.

    `reason` is a short key for the skip counters (e.g. `bad_json`, `missing_image`); `where` is `file:line` or
    `shard:key`. The message says what is wrong and what to do.
    """

    def __init__(self, reason: str, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.reason = reason
        self.where = where


@dataclass(frozen=True)
class SampleRef:
    """Where a record lives, enough to read it again on resume: source index, file index within the source's file
    list, byte offset of the JSONL line (or of the tar header of the key's first member), and 1-based line number
    (or key ordinal in the shard)."""

    source: int
    file: int
    offset: int
    line: int

    def to_list(self) -> list[int]:
        return [self.source, self.file, self.offset, self.line]

    @classmethod
    def from_list(cls, v: list[int]) -> SampleRef:
        return cls(int(v[0]), int(v[1]), int(v[2]), int(v[3]))


@dataclass
class ImageRef:
    """An image named by a record: a path on disk, or bytes read from a tar member (with the member's name)."""

    name: str
    data: bytes | None = None


@dataclass
class Message:
    role: str  # one of ROLES
    content: str  # text with IMAGE_PLACEHOLDER where each image goes


@dataclass
class Conversation:
    """A validated record: messages in order, the images and videos for the placeholders in order of appearance.

    `kind` says how it becomes tokens: `chat` (the chat template, loss on assistant turns), `document` (`text`
    with `<image>` placeholders, no template, loss on every text token: interleaved web documents and plain text)
    or `caption` (one image and its caption in `text`, turned into a chat or a document by the source's caption
    prompts).
    """

    messages: list[Message]
    images: list[ImageRef]
    where: str  # file:line or shard:key, for messages
    videos: list[ImageRef] = field(default_factory=list)  # a video file or tar member, like an image
    kind: str = "chat"
    text: str = ""  # document text / caption
    coords: str | None = None  # the convention of boxes/points in the text, when declared (mindvl.data.grounding)


@dataclass
class Sample:
    """One tokenized conversation with its image patches.

    input_ids, labels: int64 [L]; position_ids: int64 [3, L] (M-RoPE, starting at 0);
    patches: uint8 [P, 3*p*p] the images' rows ((C, p, p) in the merger's order, p the processor's patch: 14 or
    16; not yet normalised: 8x smaller than the float32 rows while the sample waits in the packing buffer;
    `image.expand_patches` makes the Pack's rows); video_patches: uint8 [Pv, 3*2*p*p] the videos' rows
    ((C, T=2, p, p); `video.expand_video_patches`);
    image_grid_thw: int64 [N, 3], every vision item (images and videos) in order of appearance, with
    P + Pv = sum(t*h*w); is_video: bool [N] which of them are videos.
    """

    input_ids: np.ndarray
    labels: np.ndarray
    position_ids: np.ndarray
    patches: np.ndarray
    image_grid_thw: np.ndarray
    source: int = 0
    ref: SampleRef | None = None
    where: str = ""
    video_patches: np.ndarray | None = None
    is_video: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_patches(self) -> int:
        """Vision patch rows, images and videos: what the packer's vision budget counts."""
        videos = 0 if self.video_patches is None else int(self.video_patches.shape[0])
        return int(self.patches.shape[0]) + videos

    @property
    def num_videos(self) -> int:
        return 0 if self.is_video is None else int(self.is_video.sum())

    @property
    def num_trained(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


PACK_KEYS = ("input_ids", "labels", "position_ids", "cu_seqlens", "pixel_values", "image_grid_thw")


@dataclass
class Pack:
    """One packed micro-batch row (ARCHITECTURE.md §3).

    input_ids int64 [T]; labels int64 [T], -100 where not trained, *unshifted* (HF convention: the model predicts
    labels[i+1] from position i; every sample's first label is -100 (a chat's `<|im_start|>`, a document's first
    token: nothing predicts it), so a shift never trains one sample's last token on the next sample's first);
    position_ids int64 [3, T] (M-RoPE rows t, h, w; restarting at 0 per sample; a 1-D RoPE model numbers each
    sample's tokens 0, 1, 2, ... itself from cu_seqlens, as generation does);
    cu_seqlens int32 [n_samples+1] from 0 to T; pixel_values float32 [P, patch_dim] (1176 values at 14 px, 1536 at
    16 px; images and videos in order of appearance: one stream); image_grid_thw int64 [N, 3] (their grids, in the
    same order; videos have t >= 1 temporal patches of 2 frames, or with Qwen3-VL's processor one (1, h, w) item per
    temporal patch, and fill `<|video_pad|>` slots, images fill `<|image_pad|>` slots).
    If padding was requested it is the last segment of cu_seqlens, labels -100,
    and counted in `num_pad`.
    """

    input_ids: Any
    labels: Any
    position_ids: Any
    cu_seqlens: Any
    pixel_values: Any
    image_grid_thw: Any
    sample_sources: list[int] = field(default_factory=list)  # source index per real sample
    sample_refs: list[list[int] | None] = field(default_factory=list)  # SampleRef.to_list() per real sample
    num_pad: int = 0

    @property
    def num_tokens(self) -> int:
        """Token slots, padding included."""
        return int(self.input_ids.shape[0])

    @property
    def num_real_tokens(self) -> int:
        return self.num_tokens - self.num_pad

    @property
    def num_samples(self) -> int:
        return len(self.sample_sources)

    @property
    def num_patches(self) -> int:
        return int(self.pixel_values.shape[0])

    def to_torch(self) -> dict[str, Any]:
        """The model's input dict: exactly the keys in PACK_KEYS, as torch tensors (zero-copy from NumPy)."""
        import torch

        out = {}
        for key in PACK_KEYS:
            value = getattr(self, key)
            out[key] = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """The six arrays as NumPy (for tests and inspection)."""
        return {k: np.asarray(getattr(self, k)) for k in PACK_KEYS}
