"""Typed, validated configuration of the data pipeline (the `data:` section of a recipe).

`DataConfig.from_dict(d)` rejects unknown keys and wrong types with an error that names the key
(`data.sources[1].ratio: must be > 0`), so a typo in a recipe fails at load time, not hours into a run. The
conversion is mindvl.typed's (the one the recipe uses); each class adds its shorthands (`_prepare_mapping`) and
its checks (`_check_built`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from mindvl.typed import build
from mindvl.untrusted import MAX_IMAGE_BYTES, MAX_VIDEO_BYTES

from .image import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, RESIZE_METHODS
from .processors import QWEN2_VL, VisionProcessing, as_processing
from .template import DEFAULT_SYSTEM

RECORD_BYTES_PER_TOKEN = 256  # default record byte limit per token of seq_len (DataConfig.record_byte_limit)
RECORD_BYTES_FLOOR = 1 << 20

SYNTH_TASKS = ("ocr", "chart", "grounding", "doc")  # the default mix
# digits: short digit strings, the quickstart's learnable OCR task; reverse, sort: text only (the ablation's base
# LLM learns both, its vision-language text data is `reverse`, `sort` is the text probe);
# digits_sized, minichart, minidoc: the tiny recipes' testbed tasks (issue 29); minichart_sized, minidoc_sized: those
# pages at the ablation's resolution-grid sizes too
SYNTH_KNOWN_TASKS = (*SYNTH_TASKS, "digits", "reverse", "sort", "digits_sized", "minichart", "minidoc",
                     "minichart_sized", "minidoc_sized")


def _positive(value: int | None, where: str) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{where}: must be > 0, got {value}")


@dataclass
class SynthConfig:
    """A synthetic source generated once into a cache folder (see mindvl.data.synth)."""

    tasks: list[str] = field(default_factory=lambda: list(SYNTH_TASKS))
    n: int = 1000
    seed: int = 0

    @classmethod
    def _prepare_mapping(cls, d: Any, where: str) -> Any:
        if isinstance(d, dict) and isinstance(d.get("tasks"), str):  # `tasks: ocr,chart`
            d = {**d, "tasks": [t.strip() for t in d["tasks"].split(",") if t.strip()]}
        return d

    def _check_built(self, where: str) -> None:
        if not self.tasks:
            raise ValueError(f"{where}.tasks: must be a non-empty list of {list(SYNTH_KNOWN_TASKS)}")
        for t in self.tasks:
            if t not in SYNTH_KNOWN_TASKS:
                raise ValueError(f"{where}.tasks: unknown task {t!r} (known: {', '.join(SYNTH_KNOWN_TASKS)})")
        _positive(self.n, f"{where}.n")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> SynthConfig:
        return build(cls, d, where)


@dataclass
class VideoConfig:
    """How videos are sampled and sized (transformers' Qwen2-VL video processor defaults; see mindvl.data.video)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 768 * 28 * 28
    cap_pixels_per_frame: bool = True  # the per-video total-pixel budget (qwen-vl-utils' rule)
    max_video_tokens: int = 128_000
    max_decoded_frames: int = 100_000  # longer videos are skipped (video_too_long) before decoding
    max_video_bytes: int = MAX_VIDEO_BYTES  # larger video files are skipped (video_too_large) before decoding
    # M-RoPE time scale; None: the model's own (the trainer fills it in). Set, it must equal the model's.
    tokens_per_second: int | None = None

    def _check_built(self, where: str) -> None:
        if not self.fps > 0:
            raise ValueError(f"{where}.fps: must be > 0, got {self.fps}")
        for key in ("min_frames", "max_frames", "min_pixels", "max_pixels", "max_video_tokens", "max_decoded_frames",
                    "max_video_bytes", "tokens_per_second"):
            _positive(getattr(self, key), f"{where}.{key}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"{where}: min_pixels {self.min_pixels} is larger than max_pixels {self.max_pixels}")
        if self.min_frames > self.max_frames:
            raise ValueError(f"{where}: min_frames {self.min_frames} is larger than max_frames {self.max_frames}")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> VideoConfig:
        return build(cls, d, where)


@dataclass
class SourceConfig:
    """One data source: files/globs (JSONL or WebDataset tar shards) or a synthetic set, with a sampling ratio.

    `category` groups sources in `mindvl data plan` (e.g. the paper's Caption/OCR/Grounding); `caption_prompts`
    turns caption records into samples: `default` (mindvl.data.captions' instruction set, one chosen per record
    from the seed), a list of instructions, or `none` (the caption is trained as a document after its image).
    """

    name: str = ""
    paths: list[str] = field(default_factory=list)
    synth: SynthConfig | None = None
    format: str = "auto"  # auto (by extension) | jsonl | tar
    ratio: float = 1.0
    min_pixels: int | None = None  # override DataConfig.min_pixels for this source
    max_pixels: int | None = None
    category: str = ""
    caption_prompts: list[str] | str = "default"
    # Records may name images and videos by absolute path (a corpus you wrote yourself, media kept elsewhere). Off
    # by default: then only paths inside the records' folder are read (symlinks resolved: one pointing out of it is
    # an `image_outside` skip), and an absolute one is an `image_absolute` skip. On, symlinks may point anywhere.
    absolute_paths: bool = False

    @classmethod
    def _prepare_mapping(cls, d: Any, where: str) -> Any:
        if isinstance(d, str):  # a bare path or glob
            d = {"paths": [d]}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: must be a mapping or a path, got {type(d).__name__}")
        d = dict(d)
        if "path" in d:  # a convenient alias for a single file or glob
            if "paths" in d:
                raise ValueError(f"{where}: give either `path` or `paths`, not both")
            d["paths"] = d.pop("path")
        if isinstance(d.get("paths"), str):
            d["paths"] = [d["paths"]]
        return d

    def _check_built(self, where: str) -> None:
        if bool(self.paths) == (self.synth is not None):
            raise ValueError(f"{where}: give exactly one of `paths` (files/globs) or `synth`")
        if self.format not in ("auto", "jsonl", "tar"):
            raise ValueError(f"{where}.format: must be auto, jsonl or tar, got {self.format!r}")
        if not self.ratio > 0:
            raise ValueError(f"{where}.ratio: must be > 0, got {self.ratio}")
        prompts = self.caption_prompts
        if isinstance(prompts, str):
            if prompts not in ("default", "none"):
                raise ValueError(f"{where}.caption_prompts: must be default, none or a list of instructions")
        elif not prompts or not all(prompts):
            raise ValueError(f"{where}.caption_prompts: must be default, none or a non-empty list of instructions")
        elif any("<image>" in p or "<video>" in p for p in prompts):
            raise ValueError(f"{where}.caption_prompts: an instruction must not contain <image>/<video> (the image "
                             "is placed before it)")
        _positive(self.min_pixels, f"{where}.min_pixels")
        _positive(self.max_pixels, f"{where}.max_pixels")

    @classmethod
    def from_dict(cls, d: Any, where: str) -> SourceConfig:
        return build(cls, d, where)


@dataclass
class DataConfig:
    """The data pipeline of one training phase."""

    sources: list[SourceConfig] = field(default_factory=list)
    seq_len: int = 8192  # token slots per pack
    max_patches_per_pack: int | None = None  # cap on vision patch rows per pack (None: only the token budget)
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # decoded-size limit: larger files are refused as bombs
    # Resize kernel (mindvl.data.image.resize_rgb): torch's antialiased uint8 bicubic, the one transformers'
    # torchvision processor runs (2-3x faster than Pillow, within 2 levels of it); "pil" is bit-identical to
    # transformers' PIL processor.
    image_resize: str = "torch"
    truncation: str = "truncate"  # truncate (at a safe point) | drop, for samples longer than seq_len
    # Bytes of one record (a JSONL line; a tar key's non-media members) above which it is skipped unparsed
    # (`record_too_large`); None: record_byte_limit()'s default, derived from seq_len.
    max_record_bytes: int | None = None
    # Bytes of one image or video file (a tar member, or a file a record names) above which it is skipped unread
    # (`image_too_large`): its size is measured before anything is read.
    max_image_bytes: int = MAX_IMAGE_BYTES
    pack_buffer: int = 256  # samples held for packing (bounded look-ahead)
    pad_to_seq_len: bool = False  # pad each pack to seq_len with a final -100 segment (static shapes)
    seed: int = 0
    strict: bool = False  # fail on the first bad sample instead of skipping it
    num_workers: int = 0  # loader worker processes per rank
    tokenizer: str | None = None  # HF tokenizer folder; None: the model folder's (train.preflight), else mindvl's
    default_system: str | None = DEFAULT_SYSTEM  # system turn added when a conversation has none (None: none)
    train_on_prompt: bool = False
    synth_cache: str | None = None  # where synthetic sources are generated (default ~/.cache/mindvl/synth)
    video: VideoConfig = field(default_factory=VideoConfig)
    box_format: str = "qwen2.5-vl"  # boxes of records that declare `coords` become this (mindvl.data.grounding)
    # Held-out data for validation during training: separate sources, or a fraction of the records of `sources`
    # (chosen by a hash of each record's file and byte offset: stable across runs, resumes and slot layouts).
    eval_sources: list[SourceConfig] = field(default_factory=list)
    eval_fraction: float = 0.0
    split: str = "train"  # train | eval: which side of eval_fraction this pipeline reads (set by the trainer)
    # The vision processor (mindvl.data.processors.VisionProcessing: patch size, merge size, mean/std, video
    # sampling): `qwen2_vl`, `qwen3_vl` or a mapping of its fields; None: the model's, which the trainer and the
    # planner read from the model folder's processor configs (or the vision tower's family). Pixel limits stay
    # min_pixels/max_pixels above (the processor's own apply to its videos).
    processor: Any = None

    @classmethod
    def _prepare_mapping(cls, d: Any, where: str) -> Any:
        if isinstance(d, dict):
            raw_sources = d.get("sources")
            if not isinstance(raw_sources, list) or not raw_sources:
                raise ValueError(f"{where}.sources: must be a non-empty list of sources")
        return d

    def _check_built(self, where: str) -> None:
        explicit = {s.name for s in self.sources if s.name}
        for i, s in enumerate(self.sources):
            if not s.name:
                name = f"synth{i}" if s.synth is not None else _default_name(s.paths[0], i)
                s.name = name if name not in explicit else f"{name}_{i}"
                explicit.add(s.name)
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"{where}.sources: source names must be unique, got {names}")
        for key in ("seq_len", "max_patches_per_pack", "min_pixels", "max_pixels", "max_image_pixels",
                    "max_record_bytes", "max_image_bytes", "pack_buffer"):
            _positive(getattr(self, key), f"{where}.{key}")
        for i, s in enumerate(self.eval_sources):
            s.name = s.name or f"eval{i}"
        self.processor = as_processing(self.processor, f"{where}.processor")
        self.validate(where)

    @classmethod
    def from_dict(cls, d: Any, where: str = "data") -> DataConfig:
        """The validated config of a recipe's `data:` mapping (a DataConfig, e.g. a recipe's, comes back as a copy
        the caller may fill in)."""
        return copy.deepcopy(d) if isinstance(d, cls) else build(cls, d, where)

    def validate(self, where: str = "data") -> None:
        """Cross-field checks (also run on configs built in code)."""
        if not self.sources:
            raise ValueError(f"{where}.sources: must be a non-empty list of sources")
        as_processing(self.processor, f"{where}.processor")
        if self.box_format not in ("qwen2.5-vl", "rel1000"):
            raise ValueError(f"{where}.box_format: must be qwen2.5-vl or rel1000, got {self.box_format!r}")
        if self.truncation not in ("truncate", "drop"):
            raise ValueError(f"{where}.truncation: must be truncate or drop, got {self.truncation!r}")
        if self.image_resize not in RESIZE_METHODS:
            raise ValueError(f"{where}.image_resize: must be one of {', '.join(RESIZE_METHODS)}, got "
                             f"{self.image_resize!r}")
        if self.max_record_bytes is not None and self.max_record_bytes < self.seq_len:
            # Every token covers at least one byte of text, so a record under seq_len bytes always fits a pack: a
            # lower limit would skip records that could be trained whole.
            raise ValueError(f"{where}.max_record_bytes: {self.max_record_bytes} is below seq_len {self.seq_len}; "
                             "it would skip records that fit a pack (leave it unset for the default)")
        if self.num_workers < 0:
            raise ValueError(f"{where}.num_workers: must be >= 0, got {self.num_workers}")
        if not 0 <= self.eval_fraction < 1:
            raise ValueError(f"{where}.eval_fraction: must lie in [0, 1), got {self.eval_fraction}")
        if self.eval_fraction and self.eval_sources:
            raise ValueError(f"{where}: give eval_sources or eval_fraction, not both")
        if self.split not in ("train", "eval"):
            raise ValueError(f"{where}.split: must be train or eval, got {self.split!r}")
        for i, s in enumerate([None, *self.sources]):
            lo = (s.min_pixels if s and s.min_pixels else None) or self.min_pixels
            hi = (s.max_pixels if s and s.max_pixels else None) or self.max_pixels
            if lo > hi:
                key = f"{where}.sources[{i - 1}]" if s else where
                raise ValueError(f"{key}: min_pixels {lo} is larger than max_pixels {hi}")
        if self.max_patches_per_pack is not None and self.max_patches_per_pack < 4:
            raise ValueError(f"{where}.max_patches_per_pack: must be >= 4 (one merged token), got "
                             f"{self.max_patches_per_pack}")

    def vision_processing(self) -> VisionProcessing:
        """The processor every stage of this pipeline uses (Qwen2-VL's when none was given or filled in)."""
        return as_processing(self.processor) or QWEN2_VL

    def record_byte_limit(self) -> int:
        """The byte size above which a record is skipped before parsing (`max_record_bytes`, or its default).

        The default, 256 bytes per token of seq_len and at least 1 MiB, is safe for real data: text takes 3-5
        bytes per token (every token at least one byte) and JSON's escapes at most 6 bytes per character
        (`\\u00XX`), so a record whose usable part is seq_len tokens is rarely more than ~30 bytes per token;
        256 leaves room for long tokens (runs of spaces or dashes) and for the record's other fields. Records
        between seq_len tokens and this limit are parsed, and their text is cut before tokenizing to what one
        pack can hold (mindvl.data.template), so the cost of a record is bounded either way. Images do not count
        (a JSONL record names them; a tar key's image members are measured by `max_image_pixels`)."""
        if self.max_record_bytes is not None:
            return self.max_record_bytes
        return max(RECORD_BYTES_FLOOR, RECORD_BYTES_PER_TOKEN * self.seq_len)

    def eval_config(self) -> DataConfig | None:
        """The pipeline of the held-out data (None when there is none): the eval sources, or the same sources
        reading only the held-out fraction."""
        if self.eval_sources:
            return dataclasses.replace(self, sources=list(self.eval_sources), eval_sources=[], split="eval")
        if self.eval_fraction:
            return dataclasses.replace(self, split="eval")
        return None

    def pixels_for(self, source: int) -> tuple[int, int]:
        s = self.sources[source]
        return (s.min_pixels or self.min_pixels, s.max_pixels or self.max_pixels)


def _default_name(path: str, index: int) -> str:
    import os

    base = os.path.basename(path.rstrip("/")) or f"source{index}"
    for ext in (".jsonl", ".json", ".tar"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base.replace("*", "_") or f"source{index}"
