"""mindvl.data.image against transformers' PIL Qwen2-VL image processor (bit-exact), hand values, bad images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from mindvl.data.image import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PATCH_DIM,
    ImageError,
    grid_for_size,
    load_image,
    preprocess,
    smart_resize,
)

hf_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")

HUB_MAX = 12845056  # Qwen2.5-VL preprocessor_config.json


def hf_process(images, min_pixels, max_pixels):
    proc = hf_module.Qwen2VLImageProcessorPil(min_pixels=min_pixels, max_pixels=max_pixels)
    out = proc(images=images, return_tensors="np")
    return out["pixel_values"], out["image_grid_thw"]


def noise(h: int, w: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# (height, width): tiny, thin, exact multiples of 28, odd sizes, extreme aspect ratios (<= 200), large.
SIZES = [
    (1, 1), (3, 7), (20, 20), (27, 29), (28, 28), (56, 56), (1, 150), (2, 400), (400, 2), (13, 2600),
    (123, 271), (271, 123), (224, 224), (333, 500), (480, 640), (719, 1281), (1080, 1920), (1920, 1080),
    (2048, 31), (3000, 4000),
]


@pytest.mark.parametrize("min_pixels,max_pixels", [(DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS), (3136, HUB_MAX),
                                                   (64 * 28 * 28, 256 * 28 * 28)])
def test_bit_identical_to_transformers(min_pixels, max_pixels):
    for i, (h, w) in enumerate(SIZES):
        img = noise(h, w, i)
        ours, grid = preprocess(img, min_pixels, max_pixels)
        ref, ref_grid = hf_process([img], min_pixels, max_pixels)
        assert ref_grid.tolist() == [list(grid)], (h, w)
        assert ours.dtype == np.float32 and ours.shape == ref.shape == (np.prod(grid), PATCH_DIM)
        assert np.array_equal(ours, ref), f"{h}x{w}: max diff {np.abs(ours - ref).max()}"


def test_huge_image_bit_identical():
    img = noise(4000, 6000, 99)  # downscaled to the hub max_pixels
    ours, grid = preprocess(img, 3136, HUB_MAX)
    ref, ref_grid = hf_process([img], 3136, HUB_MAX)
    assert ref_grid.tolist() == [list(grid)]
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("mode", ["L", "LA", "RGBA", "P", "CMYK", "1", "I;16"])
def test_modes_match_transformers(mode):
    rng = np.random.default_rng(3)
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65535, (90, 130), dtype=np.uint16))
    elif mode in ("LA", "RGBA"):
        img = Image.fromarray(rng.integers(0, 256, (90, 130, 4), dtype=np.uint8), "RGBA").convert(mode)
    else:
        img = noise(90, 130, 4).convert(mode)
    if mode == "P":
        img.info["transparency"] = 7  # palette transparency is composited onto white, like RGBA
    ours, grid = preprocess(img, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    ref, ref_grid = hf_process([img], DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert ref_grid.tolist() == [list(grid)]
    assert np.array_equal(ours, ref)


def test_several_images_concatenate_in_order():
    imgs = [noise(100, 60, 1), noise(30, 300, 2), noise(500, 500, 3)]
    parts = [preprocess(im, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS) for im in imgs]
    ref, ref_grid = hf_process(imgs, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    assert np.array_equal(np.concatenate([p for p, _ in parts]), ref)
    assert ref_grid.tolist() == [list(g) for _, g in parts]


def test_smart_resize_hand_values():
    # From the reference notes (§2.2), computed by hand from the formula.
    assert smart_resize(123, 271, 28, 3136, HUB_MAX) == (112, 280)
    assert smart_resize(480, 640, 28, 3136, HUB_MAX) == (476, 644)
    assert smart_resize(1080, 1920, 28, 3136, HUB_MAX) == (1092, 1932)
    assert smart_resize(4000, 3000, 28, 3136, HUB_MAX) == (4004, 2996)
    assert smart_resize(20, 20, 28, 3136, HUB_MAX) == (56, 56)
    assert smart_resize(1080, 1920, 28, 3136, 1003520) == (728, 1316)
    # banker's rounding: 42/28 = 1.5 -> 2, 70/28 = 2.5 -> 2
    assert smart_resize(42, 70, 28, 1, 10**9) == (56, 56)
    assert grid_for_size(480, 640, 3136, HUB_MAX) == (1, 34, 46)


def test_patch_layout_by_hand():
    """Row k of the output is the 14x14 patch at merge block (bh, bw), position (mh, mw) inside the block, in that
    loop order, flattened as (C, T, 14, 14) with the single frame repeated on T."""
    h = w = 56
    a = np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)
    pv, grid = preprocess(Image.fromarray(a), h * w, h * w)  # exact size: no resize
    assert grid == (1, 4, 4)
    mean = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
    std = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)
    norm = (((a.astype(np.float64) / 255).astype(np.float32) - mean) / std).transpose(2, 0, 1)  # [3, 56, 56]
    k = 0
    for bh in range(2):
        for bw in range(2):
            for mh in range(2):
                for mw in range(2):
                    r0, c0 = (2 * bh + mh) * 14, (2 * bw + mw) * 14
                    patch = norm[:, r0:r0 + 14, c0:c0 + 14]
                    expected = np.stack([patch, patch], axis=1).reshape(-1)  # (C, T, 14, 14)
                    np.testing.assert_allclose(pv[k], expected, rtol=0, atol=1e-6)
                    k += 1


def test_aspect_ratio_over_200_is_refused():
    with pytest.raises(ImageError) as e:
        preprocess(noise(1, 201, 0))
    assert e.value.reason == "bad_aspect_ratio"


def _encode(img: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def test_decompression_bomb_refused_before_decoding(tmp_path):
    data = _encode(Image.new("L", (300, 300)))
    with pytest.raises(ImageError) as e:
        load_image(data, max_image_pixels=300 * 300 - 1)
    assert e.value.reason == "decompression_bomb"
    assert load_image(data, max_image_pixels=300 * 300).size == (300, 300)
    # A real bomb: 30000x30000 declared, a few KB on disk; refused under the default limit.
    bomb = tmp_path / "bomb.png"
    Image.new("1", (30000, 30000)).save(bomb)
    assert bomb.stat().st_size < 1_000_000
    with pytest.raises(ImageError) as e:
        load_image(bomb)
    assert e.value.reason == "decompression_bomb" and "bomb.png" in str(e.value)


def test_corrupt_truncated_and_missing(tmp_path):
    data = _encode(noise(64, 64, 0))
    with pytest.raises(ImageError) as e:
        load_image(data[: len(data) // 2])
    assert e.value.reason == "corrupt_image"
    with pytest.raises(ImageError) as e:
        load_image(b"not an image at all")
    assert e.value.reason == "corrupt_image"
    with pytest.raises(ImageError) as e:
        load_image(tmp_path / "nope.png")
    assert e.value.reason == "missing_image"


def test_exif_orientation_applied():
    img = noise(40, 100, 5)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise on display
    loaded = load_image(_encode(img, "JPEG", exif=exif.tobytes(), quality=95))
    assert loaded.size == (40, 100)  # width and height swapped
    plain = load_image(_encode(img, "JPEG", quality=95))
    assert plain.size == (100, 40)
