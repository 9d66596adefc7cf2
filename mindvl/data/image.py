"""Image decoding and the Qwen2-VL patch layout.

`preprocess(image, min_pixels, max_pixels) -> (pixel_values [P, 1176] float32, (t, h, w))` is bit-identical to
transformers' PIL Qwen2-VL image processor (`Qwen2VLImageProcessorPil` in 5.x, `Qwen2VLImageProcessor` in 4.x):
RGB conversion (transparency composited onto white), `smart_resize` to multiples of 28, PIL bicubic resize, rescale
by 1/255 computed in float64 then cast to float32, float32 normalisation with the OpenAI CLIP mean/std, then the
patch layout where the 2x2 patches that the merger fuses are consecutive rows and each row is flattened
(C=3, T=2, 14, 14) with the single frame repeated along T.

Speed and memory: the per-pixel arithmetic (rescale, normalise) is float32 `(x / 255 - mean) / std`, the same bits
as transformers' float64 rescale + float32 normalisation for every uint8 level (`_CLIP_TABLE` holds them; a test
checks all 768). The pipeline keeps patches as uint8 (`preprocess_uint8`, 588 bytes a row) while samples wait in
the packing buffer and expands them to float32 rows (`expand_patches`) only when a pack is built, straight into the
pack's buffer, in one compiled pass when numba (the `fast` extra) is installed, else in a few numpy passes.

Decoding (`load_image`) applies the EXIF orientation and refuses decompression bombs *before* the pixels are
decoded. transformers' processor does not apply EXIF orientation itself, so equality tests pass the same already
oriented PIL image to both.
"""

from __future__ import annotations

import io
import math
import os
import warnings
from collections.abc import Sequence

import numpy as np
from PIL import Image, ImageOps

from mindvl.untrusted import MAX_IMAGE_BYTES, TooLargeError, UntrustedInputError, open_regular

from . import _compiled

PATCH_SIZE = 14
TEMPORAL_PATCH_SIZE = 2
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: resized sides are multiples of this
CHANNELS = 3
PATCH_DIM = CHANNELS * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1176 values per patch row

# transformers' class defaults (Qwen2VLImageProcessor): 56*56 and 28*28*1280.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# Pillow's own warning threshold; an image with more source pixels than this is refused as a decompression bomb.
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200


class ImageError(ValueError):
    """An image that cannot be used; `reason` is a short machine-readable key for the skip counters."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def smart_resize(
    height: int,
    width: int,
    factor: int = FACTOR,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect ratio kept.

    Same arithmetic as transformers' `smart_resize` (Python's `round` is banker's rounding, on purpose).
    """
    if min(height, width) <= 0:
        raise ImageError("bad_image_size", f"image has an empty side ({height}x{width})")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            "bad_aspect_ratio",
            f"aspect ratio {max(height, width) / min(height, width):.1f} of a {height}x{width} image exceeds "
            f"{MAX_ASPECT_RATIO}; crop or pad the image",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_for_size(height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) in patches that `preprocess` will produce for an image of this size, without decoding it."""
    rh, rw = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
    return 1, rh // PATCH_SIZE, rw // PATCH_SIZE


def _value_table(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """[3, 256] float32: the normalised value of every uint8 level per channel.

    The operations and dtypes are exactly those of transformers' `rescale` (float64 multiply by 1/255, cast to
    float32) and `normalize` (float32 subtract, float32 divide), applied to the 256 possible inputs.
    """
    levels = np.arange(256, dtype=np.uint8)
    rescaled = (levels.astype(np.float64) * (1 / 255)).astype(np.float32)  # [256]
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return ((rescaled[None, :] - mean32) / std32).astype(np.float32)  # [3, 256]


_CLIP_TABLE = _value_table(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white (what transformers' `convert_to_rgb` does)."""
    if image.mode == "RGB" and image.info.get("transparency") is None:
        return image  # convert() would copy the whole image for nothing
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def load_image(source: str | os.PathLike | bytes, max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
               max_image_bytes: int = MAX_IMAGE_BYTES) -> Image.Image:
    """Decode an image file or bytes: size checks first (a file: a regular file of at most `max_image_bytes`;
    decompression bombs), full decode, EXIF orientation.

    Raises `ImageError` with reason `missing_image`, `image_too_large`, `decompression_bomb` or `corrupt_image`.
    """
    name = "<bytes>" if isinstance(source, bytes) else os.fspath(source)
    try:
        fp = io.BytesIO(source) if isinstance(source, bytes) else open_regular(source, max_image_bytes, "image",
                                                                              "data.max_image_bytes")
    except TooLargeError as exc:
        raise ImageError("image_too_large", f"{exc}; it is not read") from exc
    except UntrustedInputError as exc:
        raise ImageError("missing_image", f"image file unusable: {exc}") from exc
    except FileNotFoundError as exc:
        raise ImageError("missing_image", f"image file not found: {name}") from exc
    except OSError as exc:
        raise ImageError("missing_image", f"image file unreadable: {name} ({exc})") from exc
    with fp:
        try:
            with warnings.catch_warnings():
                # Our own limit below is the policy; Pillow's warning would only duplicate it.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(fp)
                width, height = image.size  # header only: nothing decoded yet
                if width * height > max_image_pixels:
                    raise ImageError(
                        "decompression_bomb",
                        f"image {name} declares {width}x{height} = {width * height} pixels, over the "
                        f"max_image_pixels limit {max_image_pixels}; refusing to decode it",
                    )
                image.load()
        except ImageError:
            raise
        except Image.DecompressionBombError as exc:
            raise ImageError("decompression_bomb", f"image {name} refused as a decompression bomb: {exc}") from exc
        except (OSError, SyntaxError, ValueError, Image.UnidentifiedImageError) as exc:
            raise ImageError("corrupt_image", f"image {name} is corrupt or truncated: {exc}") from exc
        try:
            # In place: without an orientation tag the default returns a full copy of the image for nothing.
            ImageOps.exif_transpose(image, in_place=True)
        except Exception as exc:  # a malformed EXIF block must not take the corpus down
            raise ImageError("corrupt_image", f"image {name} has an unreadable EXIF block: {exc}") from exc
    return image


PATCH_PIXELS = CHANNELS * PATCH_SIZE * PATCH_SIZE  # 588 uint8 values per patch before normalisation


def patchify_uint8(levels: np.ndarray, patch: int = PATCH_SIZE, merge: int = MERGE_SIZE) -> np.ndarray:
    """[H, W, 3] uint8 (H, W multiples of patch*merge) -> [H/p * W/p, 3*p*p] uint8 in the merger's row order.

    Rows run over (h-block, w-block, h-in-block, w-in-block); each row is (C, p, p). Kept as uint8 so a buffered
    sample costs 588 bytes per 14-px patch (768 per 16-px one) instead of the 4704 (6144) of its float32 row.
    """
    height, width, c = levels.shape
    gh, gw = height // patch, width // patch
    x = levels.reshape(gh // merge, merge, patch, gw // merge, merge, patch, c)
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)  # (bh, bw, mh, mw, C, ph, pw)
    return np.ascontiguousarray(x).reshape(gh * gw, c * patch * patch)


def expand_patches(patches: np.ndarray, out: np.ndarray | None = None, mean: Sequence[float] = OPENAI_CLIP_MEAN,
                   std: Sequence[float] = OPENAI_CLIP_STD) -> np.ndarray:
    """[P, 3*p*p] uint8 -> [P, 3*2*p*p] float32 rows (C, T=2, p, p): normalised values, frame repeated on T.

    Writes into `out` when given (e.g. a pack's shared-memory buffer), so the float rows are materialised once.
    float32 `(x / 255 - mean) / std` gives the same bits as transformers' float64 rescale, float32 cast and float32
    normalisation for every uint8 level and channel (`_CLIP_TABLE` holds those; a test checks all 768, and the
    rescaled level does not depend on the mean/std, so Qwen3-VL's 0.5/0.5 agree too). With numba
    it is one compiled pass (`mindvl.data._compiled`), else a few SIMD numpy passes.
    """
    n = patches.shape[0]
    pixels = patches.shape[1] // CHANNELS  # 196 values of one channel's 14x14 patch (256 for 16x16)
    if out is None:
        out = np.empty((n, CHANNELS * TEMPORAL_PATCH_SIZE * pixels), np.float32)
    mean32 = np.asarray(mean, np.float32).reshape(1, CHANNELS, 1)
    std32 = np.asarray(std, np.float32).reshape(1, CHANNELS, 1)
    if _compiled.available() and n:
        _compiled.expand_rows(patches.reshape(n, CHANNELS * pixels), mean32.reshape(CHANNELS),
                              std32.reshape(CHANNELS), out)
        return out
    view = out.reshape(n, CHANNELS, TEMPORAL_PATCH_SIZE, pixels)
    frame = patches.reshape(n, CHANNELS, pixels).astype(np.float32)
    np.divide(frame, np.float32(255), out=frame)
    frame -= mean32
    frame /= std32
    np.copyto(view, frame[:, :, None, :])  # the single frame on every temporal slot
    return out


RESIZE_METHODS = ("pil", "torch")


def resize_rgb(rgb: Image.Image, height: int, width: int, method: str = "pil") -> np.ndarray:
    """An RGB image resized to [height, width, 3] uint8 with antialiased bicubic interpolation.

    - `pil`: Pillow's BICUBIC resize, bit-identical to transformers' PIL Qwen2-VL processor (the reference).
    - `torch`: torch's uint8 antialiased bicubic kernel (`F.interpolate(..., antialias=True)`, AVX2 on x86) on the
      channels-last image, the resize transformers' torchvision processor runs (its default when torchvision is
      installed). Against `pil`: at most 2 levels apart, mean |difference| about 0.04 levels, 2-3x faster
      (benchmarks/RESULTS.md, "Image preprocessing"). It uses torch's intra-op threads: torch's DataLoader sets one
      per worker process.
    """
    if method not in RESIZE_METHODS:
        raise ValueError(f"image resize method must be one of {RESIZE_METHODS}, got {method!r}")
    if rgb.size == (width, height):
        return np.asarray(rgb)
    if method == "pil":
        return np.asarray(rgb.resize((width, height), Image.BICUBIC))
    import torch  # only this path needs it; mindvl.data stays importable without torch for the PIL path

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only numpy view; interpolate never writes its input
        src = torch.from_numpy(np.asarray(rgb)).permute(2, 0, 1).unsqueeze(0)  # [1, 3, H, W], channels-last memory
    out = torch.nn.functional.interpolate(src, size=(height, width), mode="bicubic", antialias=True,
                                          align_corners=False)
    return out[0].permute(1, 2, 0).contiguous().numpy()  # [height, width, 3]; already HWC-contiguous


def preprocess_uint8(
    image: Image.Image | str | os.PathLike | bytes,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    resize: str = "pil",
    patch: int = PATCH_SIZE,
    merge: int = MERGE_SIZE,
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Everything up to normalisation: (uint8 patches [t*h*w, 3*p*p], grid_thw). `expand_patches` finishes it.
    `resize` is a method of `resize_rgb` (`pil`: bit-identical to transformers' PIL processor); `patch` and `merge`
    are the processor's (14 and 2 for Qwen2-VL; 16 and 2 for Qwen3-VL, see mindvl.data.processors)."""
    if not isinstance(image, Image.Image):
        image = load_image(image, max_image_pixels)
    rgb = to_rgb(image)
    width, height = rgb.size
    rh, rw = smart_resize(height, width, patch * merge, min_pixels, max_pixels)
    return patchify_uint8(resize_rgb(rgb, rh, rw, resize), patch, merge), (1, rh // patch, rw // patch)


def preprocess(
    image: Image.Image | str | os.PathLike | bytes,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    resize: str = "pil",
) -> tuple[np.ndarray, tuple[int, int, int]]:
    """One image -> (pixel_values [t*h*w, 1176] float32, grid_thw (t, h, w) in patches).

    A path or bytes is decoded with `load_image` (EXIF orientation, bomb check); a PIL image is used as given.
    The merged image tokens for the LLM number t*h*w/4. `resize` as in `preprocess_uint8`.
    """
    patches, grid = preprocess_uint8(image, min_pixels, max_pixels, max_image_pixels, resize)
    return expand_patches(patches), grid
