"""Which vision processor a model folder asks for, and Qwen3-VL's image and video processing reproduced exactly.

A model folder's `preprocessor_config.json` (and `video_preprocessor_config.json`) name the patch layout:
Qwen2-VL / Qwen2.5-VL use 14-px patches with the OpenAI-CLIP mean/std (image.py, video.py); Qwen3-VL uses 16-px
patches (resized sides are multiples of 32) with mean = std = 0.5. `processing_from_folder` reads those files into
one `VisionProcessing`; the functions below take it, so the sizing (and with it token counts, vision budgets and the
planner's packs) follow the family.

Reproduced (tests/test_qwen3_vl_processor.py compares with transformers 5.23):
- images: transformers' PIL `Qwen2VLImageProcessorPil` (which Qwen3-VL's hub config selects, with patch_size 16):
  RGB, smart_resize to multiples of patch*merge within [min_pixels, max_pixels], PIL bicubic, rescale by 1/255 in
  float64 then float32, normalise in float32, then the merge-block row order, each row (C, T=2, p, p) with the
  frame repeated along T;
- videos: `Qwen3VLVideoProcessor`: frames sampled at `fps` as `linspace(0, total-1, n).round()` with n clamped to
  [min_frames, max_frames] and the frame count; the frame size from its `smart_resize` over (frames, height,
  width) (optionally the per-frame pixel cap); fused rescale+normalise; rows (C, T, p, p), an odd frame count
  padded with the last frame; and the per-temporal-patch timestamps the prompt shows (`<1.2 seconds>`).
The frames' resize itself is torchvision's antialiased bicubic, as video.resize_frames does for Qwen2-VL.

One source of truth downstream: a recipe's `data.processor` (`as_processing`: a family name, a mapping of these
fields, or the object the trainer fills in from the model folder) reaches the training pipeline (`image_uint8` /
`expand_image_rows` / `expand_video_rows`: the uint8 buffer and its float rows at pack time; `process_video_qwen3`:
a video as frames of one vision item each, with timestamps for the template), `mindvl data plan`
(`video_layout_qwen3` from headers), and, through `mindvl.infer.chat.folder_processing`, eval, the lmms-eval adapter,
the resolution search and chat. mindvl.data never reads a model: only its folder's processor files.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image

from mindvl.untrusted import loads_json, read_regular

from .image import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, ImageError, load_image, smart_resize, to_rgb

QWEN3_VL_MEAN = (0.5, 0.5, 0.5)
QWEN3_VL_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VisionProcessing:
    """The processor settings that shape pixel rows and token counts (defaults: transformers' class defaults of the
    family's processors; a folder's config files override them)."""

    family: str = "qwen2_vl"  # or "qwen3_vl"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2


QWEN2_VL = VisionProcessing()
# transformers' Qwen3VLVideoProcessor class defaults; the image side as Qwen3-VL's hub preprocessor_config.json
# sets Qwen2VLImageProcessor up (patch 16, mean/std 0.5, 256 ... 16384 tokens of 32 x 32 pixels).
QWEN3_VL = VisionProcessing(
    family="qwen3_vl", patch_size=16, image_mean=QWEN3_VL_MEAN, image_std=QWEN3_VL_STD, min_pixels=65536,
    max_pixels=16777216, video_min_pixels=128 * 32 * 32, video_max_pixels=768 * 32 * 32,
)

PREPROCESSOR_CONFIG = "preprocessor_config.json"
VIDEO_PREPROCESSOR_CONFIG = "video_preprocessor_config.json"


def _read(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:  # a regular file of bounded size and nesting (a model folder mindvl may not have written)
        data = loads_json(read_regular(path, 64 << 20, "processor config"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); fix or remove the file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    return data


def processing_from_folder(folder: str | os.PathLike) -> VisionProcessing:
    """The VisionProcessing a model folder's processor configs describe (family defaults for what they leave out).

    Qwen3-VL is recognised by its processor class (`Qwen3VLProcessor`), its video processor (`Qwen3VLVideoProcessor`)
    or a 16-px patch; anything else is Qwen2-VL's layout. Pixel limits come from `size.shortest_edge/longest_edge`,
    or `min_pixels`/`max_pixels` when present (they override `size`, as transformers' processors do).
    """
    folder = Path(folder)
    image = _read(folder / PREPROCESSOR_CONFIG)
    video = _read(folder / VIDEO_PREPROCESSOR_CONFIG)
    names = " ".join(str(c.get(k, "")) for c in (image, video)
                     for k in ("processor_class", "video_processor_type", "image_processor_type"))
    qwen3 = "Qwen3VL" in names or image.get("patch_size") == 16
    base = QWEN3_VL if qwen3 else QWEN2_VL

    def pixels(cfg: dict, lo: int, hi: int) -> tuple[int, int]:
        size = cfg.get("size") or {}
        return (int(cfg.get("min_pixels") or size.get("shortest_edge") or lo),
                int(cfg.get("max_pixels") or size.get("longest_edge") or hi))

    def value(key: str, default):
        got = image.get(key, video.get(key))
        return default if got is None else got

    min_px, max_px = pixels(image, base.min_pixels, base.max_pixels)
    vmin, vmax = pixels(video, base.video_min_pixels, base.video_max_pixels)
    try:
        out = VisionProcessing(
            family=base.family, patch_size=int(value("patch_size", base.patch_size)),
            temporal_patch_size=int(value("temporal_patch_size", base.temporal_patch_size)),
            merge_size=int(value("merge_size", base.merge_size)),
            image_mean=tuple(float(x) for x in value("image_mean", base.image_mean)),
            image_std=tuple(float(x) for x in value("image_std", base.image_std)),
            min_pixels=min_px, max_pixels=max_px, video_min_pixels=vmin, video_max_pixels=vmax,
            fps=float(video.get("fps") or base.fps), min_frames=int(video.get("min_frames") or base.min_frames),
            max_frames=int(video.get("max_frames") or base.max_frames),
            cap_pixels_per_frame=bool(video.get("cap_pixels_per_frame")),
            max_video_tokens=int(video.get("max_video_tokens") or base.max_video_tokens),
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{folder / PREPROCESSOR_CONFIG}: a processor setting has the wrong type ({exc})") from None
    if len(out.image_mean) != 3 or len(out.image_std) != 3:
        raise ValueError(f"{folder / PREPROCESSOR_CONFIG}: image_mean and image_std need 3 values each")
    return out


# ---------------------------------------------------------------------------------------------------- images


def image_grid(height: int, width: int, p: VisionProcessing) -> tuple[int, int, int]:
    """(t, h, w) in patches that `preprocess_image` gives an image of this size, without decoding it."""
    rh, rw = smart_resize(height, width, p.factor, p.min_pixels, p.max_pixels)
    return 1, rh // p.patch_size, rw // p.patch_size


def _normalise(levels: np.ndarray, mean, std) -> np.ndarray:
    """[..., 3] uint8 -> float32 (x * (1/255) in float64 -> float32, then (x - mean) / std in float32)."""
    x = (levels.astype(np.float64) * (1 / 255)).astype(np.float32)
    return ((x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)).astype(np.float32)


def preprocess_image(image: Image.Image | str | os.PathLike | bytes, p: VisionProcessing
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (pixel rows [h*w, 3*2*p*p] float32, grid (1, h, w)): transformers' PIL Qwen2-VL processor
    with this family's patch size and mean/std."""
    if not isinstance(image, Image.Image):
        image = load_image(image)
    rgb = to_rgb(image)
    width, height = rgb.size
    rh, rw = smart_resize(height, width, p.factor, p.min_pixels, p.max_pixels)
    if (rw, rh) != rgb.size:
        rgb = rgb.resize((rw, rh), Image.BICUBIC)
    values = _normalise(np.asarray(rgb), p.image_mean, p.image_std)  # [H, W, 3]
    frames = np.repeat(values.transpose(2, 0, 1)[None], p.temporal_patch_size, axis=0)  # [T, C, H, W]
    return _patch_rows(frames, p), (1, rh // p.patch_size, rw // p.patch_size)


def _patch_rows(frames: np.ndarray, p: VisionProcessing) -> np.ndarray:
    """[n, C, H, W] (n a multiple of the temporal patch) -> [t*h*w, C*T*p*p] rows in merge-block order."""
    n, c, height, width = frames.shape
    tp, ps, m = p.temporal_patch_size, p.patch_size, p.merge_size
    gt, gh, gw = n // tp, height // ps, width // ps
    x = frames.reshape(gt, tp, c, gh // m, m, ps, gw // m, m, ps)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, bh, bw, mh, mw, C, T, ph, pw)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, c * tp * ps * ps)


# ---------------------------------------------------------------------------------------------------- videos


def sample_frame_indices(total_frames: int, video_fps: float, p: VisionProcessing,
                         fps: float | None = None) -> list[int]:
    """The frames Qwen3VLVideoProcessor.sample_frames picks: n = int(seconds * fps) clamped to
    [min_frames, max_frames] and the frame count, spread as linspace(0, total - 1, n) rounded."""
    if total_frames <= 0 or video_fps <= 0:
        raise ImageError("video_no_frames", f"the video has {total_frames} frames at {video_fps} fps")
    n = int(total_frames / video_fps * (fps if fps is not None else p.fps))
    n = min(max(n, p.min_frames), p.max_frames, total_frames)
    return np.linspace(0, total_frames - 1, n).round().astype(int).tolist()


def video_frame_size(n_frames: int, height: int, width: int, p: VisionProcessing) -> tuple[int, int]:
    """(height, width) Qwen3VLVideoProcessor resizes `n_frames` sampled frames to (its smart_resize over frames)."""
    factor, tf = p.factor, p.temporal_patch_size
    if n_frames < tf:
        raise ImageError("video_no_frames", f"{n_frames} frame(s): at least {tf} are needed for one temporal patch")
    max_pixels = p.video_max_pixels
    if p.cap_pixels_per_frame:
        per_frame = max(min(p.max_video_tokens * factor * factor, p.video_max_pixels // n_frames),
                        int(p.video_min_pixels * 1.05))
        max_pixels = per_frame * n_frames
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError("bad_aspect_ratio", f"aspect ratio of a {height}x{width} video exceeds 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(n_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((n_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < p.video_min_pixels:
        beta = math.sqrt(p.video_min_pixels / (n_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_rows(frames: np.ndarray, p: VisionProcessing) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Resized frames [n, H, W, 3] uint8 -> (rows [t*h*w, 3*T*p*p] float32, grid): fused rescale+normalise
    ((x - 255*mean) / (255*std) in float32, as transformers' torch backend), the last frame repeated to fill the
    last temporal patch."""
    if len(frames) % p.temporal_patch_size:
        pad = -len(frames) % p.temporal_patch_size
        frames = np.concatenate([frames, np.repeat(frames[-1:], pad, 0)])
    mean255 = np.asarray(p.image_mean, np.float32) * np.float32(255.0)
    std255 = np.asarray(p.image_std, np.float32) * np.float32(255.0)
    values = ((frames.astype(np.float32) - mean255) / std255).astype(np.float32).transpose(0, 3, 1, 2)
    n, _, height, width = values.shape
    return _patch_rows(values, p), (n // p.temporal_patch_size, height // p.patch_size, width // p.patch_size)


def frame_timestamps(indices: list[int], video_fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds shown before each temporal patch in Qwen3-VL's prompt (`<1.2 seconds>`): the mean time of the
    patch's first and last frame (the index list padded with its last index, as the frames are)."""
    indices = list(indices)
    if len(indices) % temporal_patch_size:
        indices += [indices[-1]] * (temporal_patch_size - len(indices) % temporal_patch_size)
    times = [i / video_fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def video_prompt(timestamps: list[float], frame_tokens: int, vision_start: str = "<|vision_start|>",
                 video_pad: str = "<|video_pad|>", vision_end: str = "<|vision_end|>") -> str:
    """Qwen3-VL's text for one video: per temporal patch `<t.t seconds><|vision_start|>pads<|vision_end|>`."""
    return "".join(f"<{t:.1f} seconds>{vision_start}{video_pad * frame_tokens}{vision_end}" for t in timestamps)


# ------------------------------------------------------------------------------------- one spec, every consumer

FAMILIES = {"qwen2_vl": QWEN2_VL, "qwen3_vl": QWEN3_VL}


def as_processing(spec, where: str = "data.processor") -> VisionProcessing | None:
    """A recipe's processor spec -> VisionProcessing (None stays None: the model's, filled in by the trainer).

    `qwen2_vl` / `qwen3_vl` (the family's defaults), a mapping of VisionProcessing fields (`family` picks the
    defaults the other keys override; lists for mean/std), or a VisionProcessing (a copy of one already resolved,
    e.g. read back from a run's recipe.json)."""
    if spec is None or isinstance(spec, VisionProcessing):
        return spec
    if isinstance(spec, str):
        if spec not in FAMILIES:
            raise ValueError(f"{where}: unknown processor family {spec!r} (known: {', '.join(FAMILIES)})")
        return FAMILIES[spec]
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must be a family name ({', '.join(FAMILIES)}) or a mapping of processor settings")
    family = spec.get("family", "qwen2_vl")
    if family not in FAMILIES:
        raise ValueError(f"{where}.family: unknown processor family {family!r} (known: {', '.join(FAMILIES)})")
    base = FAMILIES[family]
    known = set(base.__dataclass_fields__)
    unknown = sorted(set(spec) - known)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    values = {}
    for key, value in spec.items():
        default = getattr(base, key)
        try:
            if isinstance(default, tuple):
                value = tuple(float(x) for x in value)
                if len(value) != 3:
                    raise ValueError("needs 3 values")
            elif isinstance(default, bool):
                if not isinstance(value, bool):
                    raise ValueError("expected true/false")
            elif isinstance(default, (int, float)) and not isinstance(value, bool):
                value = type(default)(value)
                if value <= 0:
                    raise ValueError("must be > 0")
            values[key] = value
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}.{key}: {exc} (got {value!r})") from None
    out = VisionProcessing(**{**base.__dict__, **values})
    for key in ("temporal_patch_size", "merge_size"):  # the template and M-RoPE count 2x2 merged frames pairs
        if getattr(out, key) != 2:
            raise ValueError(f"{where}.{key}: only 2 is supported (Qwen2-VL's and Qwen3-VL's), got "
                             f"{getattr(out, key)}")
    return out


def image_uint8(image, p: VisionProcessing, min_pixels: int, max_pixels: int, max_image_pixels: int,
                resize: str = "pil") -> tuple[np.ndarray, tuple[int, int, int]]:
    """The training pipeline's image path for any family: (uint8 patches [h*w, 3*p*p], grid), finished by
    `expand_image_rows` when a pack is built (bit-identical to `preprocess_image` with resize `pil`)."""
    from .image import preprocess_uint8

    return preprocess_uint8(image, min_pixels, max_pixels, max_image_pixels, resize, p.patch_size, p.merge_size)


def expand_image_rows(patches: np.ndarray, p: VisionProcessing, out: np.ndarray | None = None) -> np.ndarray:
    from .image import expand_patches

    return expand_patches(patches, out, p.image_mean, p.image_std)


def expand_video_rows(patches: np.ndarray, p: VisionProcessing, out: np.ndarray | None = None) -> np.ndarray:
    from .video import expand_video_patches

    return expand_video_patches(patches, out, p.image_mean, p.image_std)


def grid_for_image(height: int, width: int, p: VisionProcessing, min_pixels: int, max_pixels: int
                   ) -> tuple[int, int, int]:
    """(t, h, w) of an image of this size under these pixel limits, without decoding it."""
    return image_grid(height, width, replace(p, min_pixels=min_pixels, max_pixels=max_pixels))


@dataclass
class Qwen3Video:
    """A video as Qwen3-VL's processor reads it: uint8 rows (C, T, p, p), grid (t, h, w), and the seconds shown
    before each temporal patch in the prompt."""

    patches: np.ndarray
    grid: tuple[int, int, int]
    timestamps: list[float]

    def frames(self) -> list[tuple[np.ndarray, tuple[int, int, int]]]:
        """One (rows, (1, h, w)) per temporal patch: Qwen3-VL's prompt makes each its own vision item."""
        t, h, w = self.grid
        return [(self.patches[k * h * w:(k + 1) * h * w], (1, h, w)) for k in range(t)]


def _video_settings(p: VisionProcessing, fps: float | None, max_decoded_frames: int | None,
                    max_video_bytes: int | None = None):
    from .video import VideoSettings

    s = VideoSettings(fps=fps if fps is not None else p.fps, min_frames=p.min_frames, max_frames=p.max_frames,
                      min_pixels=p.video_min_pixels, max_pixels=p.video_max_pixels)
    if max_decoded_frames is not None:
        s = replace(s, max_decoded_frames=max_decoded_frames)
    if max_video_bytes is not None:
        s = replace(s, max_video_bytes=max_video_bytes)
    return s


def process_video_qwen3(source, p: VisionProcessing, fps: float | None = None,
                        max_decoded_frames: int | None = None, max_video_bytes: int | None = None) -> Qwen3Video:
    """Decode a video file (or bytes) and lay it out as Qwen3VLVideoProcessor + Qwen3VLProcessor do: frames by
    `sample_frame_indices` at `fps` (default the processor's), resized to `video_frame_size` with torchvision's
    antialiased bicubic on uint8 (mindvl.data.video.resize_frames), rows kept uint8, timestamps from the sampled
    indices and the container's fps."""
    from .video import decode_video, patchify_video_uint8, resize_frames

    s = _video_settings(p, fps, max_decoded_frames, max_video_bytes)
    decoded = decode_video(source, s, pick=lambda total, vfps: sample_frame_indices(total, vfps, p, s.fps))
    n, height, width, _ = decoded.frames.shape
    rh, rw = video_frame_size(n, height, width, p)
    patches = patchify_video_uint8(resize_frames(decoded.frames, rh, rw), p.patch_size, p.merge_size)
    grid = (-(-n // p.temporal_patch_size), rh // p.patch_size, rw // p.patch_size)
    return Qwen3Video(patches, grid, frame_timestamps(decoded.indices, decoded.video_fps, p.temporal_patch_size))


def video_layout_qwen3(source, p: VisionProcessing, fps: float | None = None, max_decoded_frames: int | None = None,
                       max_video_bytes: int | None = None) -> tuple[tuple[int, int, int], list[float]]:
    """The grid and timestamps `process_video_qwen3` gives, from the headers only (no frame decoded)."""
    from .video import video_header

    s = _video_settings(p, fps, max_decoded_frames, max_video_bytes)
    total, video_fps, height, width = video_header(source, s)
    indices = sample_frame_indices(total, video_fps, p, s.fps)
    rh, rw = video_frame_size(len(indices), height, width, p)
    grid = (-(-len(indices) // p.temporal_patch_size), rh // p.patch_size, rw // p.patch_size)
    return grid, frame_timestamps(indices, video_fps, p.temporal_patch_size)


def folder_spec(folder) -> VisionProcessing | None:
    """`processing_from_folder` when the folder has a processor config, else None (no opinion)."""
    return processing_from_folder(folder) if folder and (Path(folder) / PREPROCESSOR_CONFIG).is_file() else None
