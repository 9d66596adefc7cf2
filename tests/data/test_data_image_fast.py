"""The fast image paths: float32 arithmetic expansion bit-identical to transformers' rescale + normalise for every
uint8 level, and torch's antialiased resize within its stated tolerance (2 levels) of Pillow's (the bit-exact
reference)."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from mindvl.data import DataConfig, _compiled
from mindvl.data.image import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    expand_patches,
    preprocess,
    preprocess_uint8,
    resize_rgb,
)


def transformers_normalise(levels: np.ndarray) -> np.ndarray:
    """transformers' order of operations: float64 rescale, float32 cast, float32 (x - mean) / std per channel."""
    rescaled = (levels.astype(np.float64) * (1 / 255)).astype(np.float32)
    mean = np.asarray(OPENAI_CLIP_MEAN, np.float32)[:, None]
    std = np.asarray(OPENAI_CLIP_STD, np.float32)[:, None]
    return (rescaled - mean) / std


@pytest.mark.parametrize("path", ["numpy", "compiled"])
def test_expansion_is_bit_identical_for_every_level_and_channel(path, monkeypatch):
    if path == "compiled":
        pytest.importorskip("numba")
    monkeypatch.setenv("MINDVL_DATA_NUMPY", "1" if path == "numpy" else "0")
    assert _compiled.available() == (path == "compiled")
    patches = np.resize(np.arange(256, dtype=np.uint8), (4, 588))  # every level in every channel
    out = expand_patches(patches).reshape(4, 3, 2, 196)  # (row, C, T, pixel)
    for c in range(3):
        levels = patches[:, c * 196:(c + 1) * 196]
        assert set(np.unique(levels).tolist()) == set(range(256))
        expected = transformers_normalise(levels[None].repeat(3, 0).reshape(3, -1))[c].reshape(4, 196)
        assert np.array_equal(out[:, c, 0], expected) and np.array_equal(out[:, c, 1], expected), c
    buffer = np.full((4, 1176), np.nan, np.float32)
    assert expand_patches(patches, out=buffer) is buffer and np.array_equal(buffer, out.reshape(4, 1176))
    pack = np.full((7, 1176), np.nan, np.float32)  # rows of a pack's buffer, as the packer writes them
    expand_patches(patches, out=pack[2:6])
    assert np.array_equal(pack[2:6], out.reshape(4, 1176)) and np.isnan(pack[[0, 1, 6]]).all()


def photo(h: int, w: int, seed: int) -> Image.Image:
    """Smooth content with noise, like a photo (pure noise would exaggerate interpolation differences)."""
    rng = np.random.default_rng(seed)
    small = Image.fromarray(rng.integers(0, 256, (max(2, h // 16), max(2, w // 16), 3), dtype=np.uint8))
    base = np.asarray(small.resize((w, h), Image.BICUBIC)).astype(np.int16)
    return Image.fromarray(np.clip(base + rng.integers(-10, 11, base.shape), 0, 255).astype(np.uint8))


@pytest.mark.parametrize("h,w,min_pixels,max_pixels", [
    (1080, 1920, 3136, 1280 * 28 * 28),  # downscale
    (333, 500, 3136, 1280 * 28 * 28),  # near size, odd sides
    (40, 90, 64 * 28 * 28, 256 * 28 * 28),  # upscale to min_pixels
    (2000, 60, 3136, 256 * 28 * 28),  # extreme aspect ratio
])
def test_torch_resize_within_two_levels_of_pillow(h, w, min_pixels, max_pixels):
    img = photo(h, w, h + w)
    ours, grid = preprocess_uint8(img, min_pixels, max_pixels, resize="torch")
    ref, ref_grid = preprocess_uint8(img, min_pixels, max_pixels, resize="pil")
    assert grid == ref_grid and ours.shape == ref.shape and ours.dtype == np.uint8
    diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    assert diff.max() <= 2, diff.max()
    assert diff.mean() < 0.25, diff.mean()  # 0.23 for the strongest one-sided downscale here, ~0.04 typical
    assert not np.array_equal(ours, ref) or (h, w) == (grid[1] * 14, grid[2] * 14)  # a different kernel indeed


def test_same_size_is_not_resampled_and_bad_method_is_refused():
    img = photo(56, 84, 0)
    assert np.array_equal(resize_rgb(img, 56, 84, "torch"), np.asarray(img))
    with pytest.raises(ValueError, match="resize method"):
        preprocess(img, resize="lanczos")


def test_data_config_names_the_resize_key():
    src = [{"synth": {"tasks": ["ocr"], "n": 2}}]
    assert DataConfig.from_dict({"sources": src}).image_resize == "torch"
    assert DataConfig.from_dict({"sources": src, "image_resize": "pil"}).image_resize == "pil"
    with pytest.raises(ValueError, match="data.image_resize"):
        DataConfig.from_dict({"sources": src, "image_resize": "bilinear"})


def test_loader_default_resize_through_a_worker_process(tmp_path, tok):
    """The loader's default (torch) path in a DataLoader worker (one torch thread there) gives the same rows as the
    in-process `preprocess_uint8(resize="torch")` + `expand_patches`: deterministic across processes and threads."""
    from data_helpers import png_bytes, qa, write_jsonl

    from mindvl.data import build_loader

    sizes = [(100, 60), (333, 290), (700, 500)]
    for i, (h, w) in enumerate(sizes):
        (tmp_path / f"{i}.png").write_bytes(png_bytes(h, w, seed=i))
    recs = [qa("<image>a", "x", images=["0.png"]), qa("two <image> and <image>", "y", images=["1.png", "2.png"])]
    cfg = DataConfig.from_dict({"sources": [str(write_jsonl(tmp_path / "d.jsonl", recs))], "seq_len": 4096,
                                "pack_buffer": 2, "num_workers": 1})
    assert cfg.image_resize == "torch"
    (pack,) = list(build_loader(cfg, tok, max_epochs=1))
    rows = [preprocess_uint8(Image.open(tmp_path / f"{i}.png"), cfg.min_pixels, cfg.max_pixels, resize="torch")
            for i in range(3)]
    expected = expand_patches(np.concatenate([r[0] for r in rows]))
    assert np.array_equal(np.asarray(pack.pixel_values), expected)
    assert np.asarray(pack.image_grid_thw).tolist() == [list(r[1]) for r in rows]
