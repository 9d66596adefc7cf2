"""Video as Qwen2.5-VL reads it: decode, sample frames by fps, resize under a per-video pixel budget, patch rows.

    preprocess_video(source, VideoSettings()) -> VideoPatches(patches uint8 [t*h*w, 1176], grid (t, h, w),
                                                              second_per_grid_t, sampled_fps)

The rules are those of transformers' Qwen2-VL/Qwen2.5-VL video processor (`Qwen2VLVideoProcessor`, 5.x):

- frames: `n = total / video_fps * fps`, clamped to [min_frames, floor(min(max_frames, total) / 2) * 2] and to
  `total`, then floored to a multiple of the temporal patch (2); the indices are `int(k * total / n)`
  (`arange(0, total, total / n)`); fewer than 2 decodable frames is a bad sample (`video_no_frames`);
- size: `smart_resize` of the frame with min_pixels = 128*28*28 and max_pixels = 768*28*28 (the class defaults),
  and with the per-video budget (`cap_pixels_per_frame`, qwen-vl-utils' rule) the max is first lowered to
  `max(min(max_pixels, total_pixels * 2 // n), int(1.05 * min_pixels))` with total_pixels = 0.9 * 128000 tokens'
  worth of pixels;
- rows: frames are resized with torch's antialiased bicubic `interpolate` on uint8 (what torchvision's resize runs
  on CPU inside transformers' processor; PIL's bicubic, used for still images, differs by up to ~8 levels), padded
  to an even count by repeating the last one, and laid out as (t, h-block, w-block, h-in-block, w-in-block) rows
  of (C, T=2, 14, 14) values;
  normalisation is transformers' fused rescale+normalise, `(x - 255*mean) / (255*std)` in float32, gathered from a
  per-level table (the same bits);
- time: `second_per_grid_t = temporal_patch / sampled_fps` with sampled_fps = n / total * video_fps, which
  M-RoPE scales by `tokens_per_second` (see `template.mrope_positions`).

Decoding uses PyAV (`pip install 'mindvl[video]'`); `require_decoder()` fails at start with the extra's name.
Rows stay uint8 (1176 bytes each) while samples wait in the packing buffer; `expand_video_patches` makes the
float32 rows when a pack is built.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from mindvl.untrusted import MAX_VIDEO_BYTES, TooLargeError, UntrustedInputError, open_regular

from .image import (
    CHANNELS,
    FACTOR,
    MERGE_SIZE,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
    ImageError,
    smart_resize,
)

# transformers' Qwen2VLVideoProcessor class defaults.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
VIDEO_FPS = 2.0
VIDEO_MIN_FRAMES = 4
VIDEO_MAX_FRAMES = 768
MAX_VIDEO_TOKENS = 128_000  # context length assumed by the per-video pixel budget (90% of it)
VIDEO_EXTENSIONS = ("mp4", "avi", "mkv", "mov", "webm", "m4v")
VIDEO_EXTRA = "video"


class VideoError(ImageError):
    """A video that cannot be used; `reason` is the skip counter's key."""


def require_decoder() -> None:
    """Fail at start, naming the extra, when the video decoder (PyAV) is not installed."""
    try:
        import av  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"video records need the PyAV decoder: pip install 'mindvl[{VIDEO_EXTRA}]' (or pip install av)"
        ) from exc


def has_videos(path: str, kind: str) -> bool:
    """Whether the first record of a JSONL file or tar shard names a video (sources are homogeneous in practice:
    a video dataset's first record has one), read without decoding anything."""
    import json
    import tarfile

    if kind == "tar":
        with tarfile.open(path) as tf:
            first = None
            for m in tf:
                if not m.isfile():
                    continue
                key = m.name.partition(".")[0]
                if first is not None and key != first:
                    return False
                first = key
                suffix = m.name.rsplit(".", 1)[-1].lower()
                if suffix in VIDEO_EXTENSIONS:
                    return True
                if suffix == "json":
                    data = tf.extractfile(m).read()
                    if b"<video>" in data or b'"video' in data:
                        return True
        return False
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                try:
                    record = json.loads(line)
                except ValueError:
                    return False
                return isinstance(record, dict) and ("videos" in record or "video" in record
                                                     or b"<video>" in line or b'"type": "video"' in line)
    return False


def require_decoder_for(sources: list[tuple[str, list[tuple[str, str]]]]) -> None:
    """At start: when a source's first record names a video, the decoder must be installed (a run must not fail
    hours in, at the first video of a small video source). `sources`: (name, [(path, kind)]) per source."""
    try:
        require_decoder()
        return
    except ImportError as exc:
        missing = exc
    for name, files in sources:
        if files and has_videos(*files[0]):
            raise ImportError(f"source {name!r} has videos: {missing}") from missing


@dataclass(frozen=True)
class VideoSettings:
    fps: float = VIDEO_FPS
    min_frames: int = VIDEO_MIN_FRAMES
    max_frames: int = VIDEO_MAX_FRAMES
    min_pixels: int = VIDEO_MIN_PIXELS
    max_pixels: int = VIDEO_MAX_PIXELS
    cap_pixels_per_frame: bool = True  # the per-video total-pixel budget
    max_video_tokens: int = MAX_VIDEO_TOKENS
    max_decoded_frames: int = 100_000  # a longer video is refused before decoding (`video_too_long`)
    max_video_bytes: int = MAX_VIDEO_BYTES  # a larger file is refused before the decoder reads it (`video_too_large`)


def video_settings(cfg) -> VideoSettings:
    """VideoSettings from a DataConfig's `video` section (mindvl.data.config.VideoConfig)."""
    return VideoSettings(cfg.fps, cfg.min_frames, cfg.max_frames, cfg.min_pixels, cfg.max_pixels,
                         cfg.cap_pixels_per_frame, cfg.max_video_tokens, cfg.max_decoded_frames, cfg.max_video_bytes)


VIDEO_PROCESSOR_CONFIG = "video_preprocessor_config.json"


def video_processor_config(s: VideoSettings = VideoSettings(), existing: dict | None = None) -> dict:
    """transformers' Qwen2-VL video processor settings (`video_preprocessor_config.json`) for these settings: what a
    model folder needs so that `AutoProcessor` samples and sizes videos as mindvl trained on them (and what
    `mindvl.infer.chat.video_settings` reads back)."""
    cfg = dict(existing or {
        "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "merge_size": MERGE_SIZE,
    })
    cfg.update({"do_sample_frames": True, "fps": s.fps, "min_frames": s.min_frames, "max_frames": s.max_frames,
                "cap_pixels_per_frame": s.cap_pixels_per_frame, "max_video_tokens": s.max_video_tokens,
                "size": {**(cfg.get("size") or {}), "shortest_edge": s.min_pixels, "longest_edge": s.max_pixels}})
    cfg.pop("min_pixels", None)
    cfg.pop("max_pixels", None)
    return cfg


def settings_from_processor_config(cfg: dict, fps: float | None = None) -> VideoSettings:
    """VideoSettings from a `video_preprocessor_config.json` dict (`size.shortest_edge/longest_edge` or
    `min_pixels/max_pixels`, `fps`, `min_frames`, `max_frames`, `cap_pixels_per_frame`, `max_video_tokens`); an
    explicit `fps` wins. The inverse of `video_processor_config`.

    A missing key means what it means to transformers' `Qwen2VLVideoProcessor` (5.23), which is not always
    mindvl's training default: `cap_pixels_per_frame` is a class attribute of None there and `resize` tests it for
    truth, so an absent (or null) key turns the per-video pixel budget OFF (a stock Qwen2.5-VL folder sizes 400
    frames of 1080x1920 to 560x1008, not the budgeted 504x896). The other defaults agree with VideoSettings':
    min/max_frames 4/768, size 128*28*28..768*28*28 (`min_pixels`/`max_pixels` override `size`, as its
    `__init__` does), max_video_tokens 128000. One deliberate difference: transformers has no `fps` default and
    samples no frames unless asked (`do_sample_frames` False), feeding every decoded frame; mindvl always samples,
    at 2 fps when the file names none (qwen-vl-utils' and the model card's rate)."""
    s = VideoSettings()
    size = cfg.get("size") or {}
    return VideoSettings(
        fps=float(fps if fps is not None else cfg.get("fps") or s.fps),
        min_frames=int(cfg.get("min_frames") or s.min_frames),
        max_frames=int(cfg.get("max_frames") or s.max_frames),
        min_pixels=int(cfg.get("min_pixels") or size.get("shortest_edge") or s.min_pixels),
        max_pixels=int(cfg.get("max_pixels") or size.get("longest_edge") or s.max_pixels),
        cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame")),  # absent/null: off, as in transformers
        max_video_tokens=int(cfg.get("max_video_tokens") or s.max_video_tokens),
    )


@dataclass
class DecodedVideo:
    frames: np.ndarray  # uint8 [n, H, W, 3], the sampled frames
    indices: list[int]  # their indices among the video's frames
    total_frames: int
    video_fps: float

    @property
    def sampled_fps(self) -> float:
        """Frames per second of the sampled frames, n / total * video_fps (transformers' `metadata.sampled_fps`,
        in its order of operations)."""
        return len(self.indices) / self.total_frames * self.video_fps


@dataclass
class VideoPatches:
    patches: np.ndarray  # uint8 [t*h*w, 1176]: (C, T, 14, 14) per row
    grid: tuple[int, int, int]  # (t, h, w) in patches
    second_per_grid_t: float  # temporal_patch / sampled_fps
    sampled_fps: float


def sample_frame_indices(total_frames: int, video_fps: float, fps: float = VIDEO_FPS,
                         min_frames: int = VIDEO_MIN_FRAMES, max_frames: int = VIDEO_MAX_FRAMES,
                         temporal_patch: int = TEMPORAL_PATCH_SIZE) -> list[int]:
    """The frames transformers' Qwen2-VL video processor samples at `fps` (see the module docstring)."""
    if total_frames <= 0 or video_fps <= 0:
        raise VideoError("video_no_frames", f"the video has {total_frames} frames at {video_fps} fps")
    cap = math.floor(min(max_frames, total_frames) / temporal_patch) * temporal_patch
    n = total_frames / video_fps * fps
    n = min(max(n, min_frames), cap, total_frames)
    n = math.floor(n / temporal_patch) * temporal_patch
    if n <= 0:
        raise VideoError("video_no_frames", f"the video has {total_frames} frame(s); at least {temporal_patch} "
                         "are needed for one temporal patch")
    step = np.float32(total_frames / n)  # arange(0, total, total / n) in float32, as torch builds it
    return (np.arange(n, dtype=np.float32) * step).astype(np.int64).tolist()


def frame_size(height: int, width: int, n_frames: int, s: VideoSettings) -> tuple[int, int]:
    """(height, width) the sampled frames are resized to: smart_resize under the per-frame and per-video budgets."""
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:
        total_pixels = int(s.max_video_tokens * FACTOR * FACTOR * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * TEMPORAL_PATCH_SIZE // n_frames), int(s.min_pixels * 1.05))
    return smart_resize(height, width, FACTOR, s.min_pixels, max_pixels)


LIMIT_KEY = "data.video.max_video_bytes"


@contextlib.contextmanager
def _video_file(source: str | os.PathLike | bytes, s: VideoSettings) -> Iterator[tuple[str, BinaryIO]]:
    """(the source's name for messages, a file object the decoder reads): a named file must be a regular file of at
    most `s.max_video_bytes`, measured with fstat on the descriptor the decoder then reads (no window between the
    check and the read, a FIFO or device refused without blocking), as images are; bytes (a tar member) likewise.
    A missing file is a `missing_video` bad sample, a larger one `video_too_large`."""
    if isinstance(source, bytes):
        if len(source) > s.max_video_bytes:
            raise VideoError("video_too_large", f"a video member of {len(source)} bytes is over the limit of "
                             f"{s.max_video_bytes} ({LIMIT_KEY}); raise the limit if the file is genuine, or cut it "
                             "into shorter clips")
        yield "<bytes>", io.BytesIO(source)
        return
    name = os.fspath(source)
    if not os.path.isfile(name):
        raise VideoError("missing_video", f"video file not found: {name}")
    try:
        f = open_regular(name, s.max_video_bytes, "video", LIMIT_KEY)
    except TooLargeError as exc:
        raise VideoError("video_too_large", f"{exc}; raise the limit if the file is genuine, or cut it into shorter "
                         "clips") from exc
    except (UntrustedInputError, OSError) as exc:  # replaced by something else since the check, or unreadable
        raise VideoError("missing_video", f"video {name} cannot be read: {exc}") from exc
    with f:
        yield name, f


def _stream_info(container, name: str, s: VideoSettings) -> tuple[object, int, float]:
    """(stream, total frames, fps) from the container's headers (packets counted when it does not say)."""
    if not container.streams.video:
        raise VideoError("video_no_frames", f"video {name} has no video stream")
    stream = container.streams.video[0]
    rate = stream.average_rate or stream.guessed_rate
    video_fps = float(rate) if rate else 0.0
    total = stream.frames
    if total <= 0:  # the container does not say: count the packets (no decoding)
        total = sum(1 for p in container.demux(stream) if p.size)
        container.seek(0)
    if total > s.max_decoded_frames:
        raise VideoError("video_too_long", f"video {name} has {total} frames, over max_decoded_frames "
                         f"{s.max_decoded_frames}; cut it into clips")
    return stream, total, video_fps


def video_header(source: str | os.PathLike | bytes, s: VideoSettings = VideoSettings()
                 ) -> tuple[int, float, int, int]:
    """(total frames, fps, height, width) from the container's headers (no frame is decoded)."""
    require_decoder()
    import av

    with _video_file(source, s) as (name, f):
        try:
            with av.open(f) as container:
                stream, total, video_fps = _stream_info(container, name, s)
                return total, video_fps, stream.codec_context.height, stream.codec_context.width
        except VideoError:
            raise
        except (av.error.FFmpegError, OSError, ValueError) as exc:
            raise VideoError("corrupt_video", f"video {name} is corrupt or truncated: {exc}") from exc


def video_grid(source: str | os.PathLike | bytes, s: VideoSettings = VideoSettings()) -> tuple[int, int, int]:
    """The (t, h, w) grid `preprocess_video` will produce, from the headers only (no frame is decoded)."""
    total, video_fps, height, width = video_header(source, s)
    n = len(sample_frame_indices(total, video_fps, s.fps, s.min_frames, s.max_frames))
    rh, rw = frame_size(height, width, n, s)
    return -(-n // TEMPORAL_PATCH_SIZE), rh // PATCH_SIZE, rw // PATCH_SIZE


def decode_video(source: str | os.PathLike | bytes, s: VideoSettings = VideoSettings(),
                 pick: Callable[[int, float], list[int]] | None = None) -> DecodedVideo:
    """Decode the frames `sample_frame_indices` picks (RGB, uint8), or those `pick(total_frames, video_fps)` names
    (another family's sampling rule, e.g. Qwen3-VL's in mindvl.data.processors). Raises VideoError:
    `missing_video`, `video_too_large`, `corrupt_video`, `video_no_frames`, `video_too_long`."""
    require_decoder()
    import av

    with _video_file(source, s) as (name, f):
        try:
            with av.open(f) as container:
                stream, total, video_fps = _stream_info(container, name, s)
                indices = pick(total, video_fps) if pick is not None else \
                    sample_frame_indices(total, video_fps, s.fps, s.min_frames, s.max_frames)
                wanted, frames, k = set(indices), {}, 0
                for frame in container.decode(stream):
                    if k in wanted:
                        frames[k] = frame.to_ndarray(format="rgb24")
                    k += 1
                    if k > indices[-1]:
                        break
        except VideoError:
            raise
        except (av.error.FFmpegError, OSError, ValueError) as exc:
            raise VideoError("corrupt_video", f"video {name} is corrupt or truncated: {exc}") from exc
    if len(frames) != len(indices):
        raise VideoError("corrupt_video", f"video {name} declares {total} frames but only {k} decode; re-encode it")
    return DecodedVideo(np.stack([frames[i] for i in indices]), indices, total, video_fps)


def patchify_video_uint8(frames: np.ndarray, patch: int = PATCH_SIZE, merge: int = MERGE_SIZE) -> np.ndarray:
    """[n, H, W, 3] uint8 (H, W multiples of patch*merge) -> [t*h*w, 3*2*p*p] uint8 rows (C, T, p, p),
    t = ceil(n / 2) (p = 14: 1176 values; Qwen3-VL's p = 16: 1536).

    An odd frame count is padded by repeating the last frame (as transformers does)."""
    if len(frames) % TEMPORAL_PATCH_SIZE:
        frames = np.concatenate([frames, np.repeat(frames[-1:], -len(frames) % TEMPORAL_PATCH_SIZE, 0)])
    n, height, width, c = frames.shape
    gt, gh, gw = n // TEMPORAL_PATCH_SIZE, height // patch, width // patch
    x = frames.reshape(gt, TEMPORAL_PATCH_SIZE, gh // merge, merge, patch, gw // merge, merge, patch, c)
    x = x.transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)  # (t, bh, bw, mh, mw, C, T, ph, pw)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * TEMPORAL_PATCH_SIZE * patch * patch)


@functools.cache
def _fused_table(mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """[3, 256] float32: transformers' fused rescale+normalise, (level - mean*255) / (std*255) in float32."""
    levels = np.arange(256, dtype=np.float32)
    mean255 = np.asarray(mean, np.float32) * np.float32(255.0)
    std255 = np.asarray(std, np.float32) * np.float32(255.0)
    return ((levels[None, :] - mean255[:, None]) / std255[:, None]).astype(np.float32)


def expand_video_patches(patches: np.ndarray, out: np.ndarray | None = None,
                         mean: tuple[float, ...] = OPENAI_CLIP_MEAN,
                         std: tuple[float, ...] = OPENAI_CLIP_STD) -> np.ndarray:
    """[P, D] uint8 video rows -> [P, D] float32 normalised rows (into `out` when given); `mean`/`std` the
    processor's (Qwen3-VL: 0.5)."""
    n, dim = patches.shape
    if out is None:
        out = np.empty((n, dim), np.float32)
    table = _fused_table(tuple(mean), tuple(std))
    view = out.reshape(n, CHANNELS, dim // CHANNELS)
    src = patches.reshape(n, CHANNELS, dim // CHANNELS)
    for c in range(CHANNELS):
        np.take(table[c], src[:, c], out=view[:, c], mode="clip")
    return out


def resize_frames(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """[n, H, W, 3] uint8 -> [n, height, width, 3] uint8: antialiased bicubic on uint8, as torchvision resizes the
    frames in transformers' video processor (bit-identical; torch is imported here only, not by mindvl.data)."""
    if frames.shape[1:3] == (height, width):
        return frames
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)  # [n, 3, H, W] uint8
    y = F.interpolate(x, size=[height, width], mode="bicubic", align_corners=False, antialias=True)
    return y.permute(0, 2, 3, 1).contiguous().numpy()


def process_frames(decoded: DecodedVideo, s: VideoSettings = VideoSettings()) -> VideoPatches:
    """Sampled frames -> uint8 patch rows, grid and the time per temporal patch."""
    n, height, width, _ = decoded.frames.shape
    rh, rw = frame_size(height, width, n, s)
    patches = patchify_video_uint8(resize_frames(decoded.frames, rh, rw))
    grid = (-(-n // TEMPORAL_PATCH_SIZE), rh // PATCH_SIZE, rw // PATCH_SIZE)
    fps = decoded.sampled_fps
    return VideoPatches(patches, grid, TEMPORAL_PATCH_SIZE / fps, fps)


def preprocess_video(source: str | os.PathLike | bytes, s: VideoSettings = VideoSettings()) -> VideoPatches:
    return process_frames(decode_video(source, s), s)


def write_test_video(path: str | os.PathLike, frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> None:
    """Write uint8 [n, H, W, 3] frames as a small video (tests and examples; even H and W)."""
    require_decoder()
    import av

    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.height, stream.width = frames.shape[1], frames.shape[2]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
