"""Qwen3-VL's image and video processing against transformers 5.23's processors (bit-exact), and the choice of
processor from a model folder's config files.

The image side runs transformers' PIL `Qwen2VLImageProcessorPil` set up as Qwen3-VL's hub config sets it (patch
16, mean/std 0.5). The video side runs the parts of `Qwen3VLVideoProcessor` that need no torchvision (not installed
here): frame sampling, its smart_resize (with and without the per-frame cap), patchify; the normalisation is its
formula (the fused mean/std x 255), and the timestamps come from `Qwen3VLProcessor._calculate_timestamps`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mindvl.data.processors import (
    QWEN2_VL,
    QWEN3_VL,
    VisionProcessing,
    frame_timestamps,
    image_grid,
    preprocess_image,
    processing_from_folder,
    sample_frame_indices,
    video_frame_size,
    video_prompt,
    video_rows,
)

SIZES = [(123, 271), (17, 40), (600, 420), (32, 32), (600, 5), (2048, 3000), (257, 255)]


def _image(h: int, w: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _hf_image_processor(p: VisionProcessing):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=p.patch_size, temporal_patch_size=p.temporal_patch_size,
                                    merge_size=p.merge_size, image_mean=list(p.image_mean),
                                    image_std=list(p.image_std),
                                    size={"shortest_edge": p.min_pixels, "longest_edge": p.max_pixels})


@pytest.mark.parametrize("hw", SIZES)
def test_image_rows_and_grid_equal_transformers(hw):
    p = VisionProcessing(**{**QWEN3_VL.__dict__, "min_pixels": 32 * 32 * 4, "max_pixels": 32 * 32 * 300})
    image = _image(*hw, seed=hw[0])
    ref = _hf_image_processor(p)(images=[image], return_tensors="np")
    rows, grid = preprocess_image(image, p)
    assert grid == tuple(ref["image_grid_thw"][0].tolist()) == image_grid(*hw, p)
    assert rows.shape[1] == 3 * 2 * 16 * 16
    assert rows.dtype == np.float32 and np.array_equal(rows, ref["pixel_values"])


def test_hub_defaults_size_a_large_image_like_transformers():
    image = _image(900, 1400, seed=1)
    ref = _hf_image_processor(QWEN3_VL)(images=[image], return_tensors="np")
    rows, grid = preprocess_image(image, QWEN3_VL)
    assert grid == tuple(ref["image_grid_thw"][0].tolist()) and np.array_equal(rows, ref["pixel_values"])


@pytest.mark.parametrize("total,fps", [(100, 30.0), (7, 24.0), (3000, 29.97), (5, 1.0), (40, 2.0)])
def test_frame_sampling_equals_transformers(total, fps):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    ref = Qwen3VLVideoProcessor().sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
    assert sample_frame_indices(total, fps, QWEN3_VL) == ref.tolist()


@pytest.mark.parametrize("cap", [False, True])
def test_frame_sizes_equal_transformers(cap, monkeypatch):
    from transformers.image_utils import SizeDict
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    proc = Qwen3VLVideoProcessor()
    p = VisionProcessing(**{**QWEN3_VL.__dict__, "cap_pixels_per_frame": cap})
    seen = []
    # The base class's resize needs torchvision: record the size Qwen3VLVideoProcessor.resize asks it for.
    monkeypatch.setattr(Qwen3VLVideoProcessor.__bases__[0], "resize",
                        lambda self, image, size, resample: seen.append((size.height, size.width)))
    size = SizeDict(shortest_edge=p.video_min_pixels, longest_edge=p.video_max_pixels)
    for n, h, w in [(8, 480, 640), (64, 1080, 1920), (400, 1080, 1920), (4, 20, 900), (16, 33, 47), (2, 2000, 64)]:
        proc.resize(torch.zeros(1, n, 3, h, w, dtype=torch.uint8), size, None, factor=32, temporal_factor=2,
                    cap_pixels_per_frame=cap)
        assert video_frame_size(n, h, w, p) == seen[-1], (n, h, w)


def test_video_rows_equal_transformers_patchify_and_normalisation():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (5, 64, 96, 3), dtype=np.uint8)  # odd: the last frame fills the last patch
    rows, grid = video_rows(frames, QWEN3_VL)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)[None].float()  # [1, n, C, H, W]
    mean = torch.tensor(QWEN3_VL.image_mean) * (1.0 / (1 / 255))  # transformers' fused rescale + normalise
    std = torch.tensor(QWEN3_VL.image_std) * (1.0 / (1 / 255))
    x = (x - mean[None, None, :, None, None]) / std[None, None, :, None, None]
    ref, gt, gh, gw = Qwen3VLVideoProcessor().patchify(x, patch_size=16, merge_size=2, temporal_patch_size=2)
    assert grid == (gt, gh, gw) == (3, 4, 6)
    assert np.array_equal(rows, ref[0].numpy())


def test_timestamps_and_prompt_equal_transformers():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    indices = [0, 20, 40, 59, 79]
    ref = Qwen3VLProcessor._calculate_timestamps(None, list(indices), 30.0, 2)
    assert frame_timestamps(indices, 30.0) == ref
    text = video_prompt(ref, 2)
    assert text.startswith("<0.3 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|><1.6 seconds>")


def test_processing_is_chosen_from_the_model_folder(tmp_path):
    assert processing_from_folder(tmp_path) == QWEN2_VL  # no config files: Qwen2-VL's class defaults
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor", "patch_size": 16,
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "size": {"longest_edge": 16777216, "shortest_edge": 65536}}))
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({
        "video_processor_type": "Qwen3VLVideoProcessor", "size": {"longest_edge": 25165824, "shortest_edge": 4096},
        "fps": 2, "patch_size": 16}))
    p = processing_from_folder(tmp_path)
    assert p.family == "qwen3_vl" and p.patch_size == 16 and p.factor == 32 and p.patch_dim == 1536
    assert (p.min_pixels, p.max_pixels, p.video_min_pixels, p.video_max_pixels) == (65536, 16777216, 4096, 25165824)
    (tmp_path / "preprocessor_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="preprocessor_config.json: must hold a JSON object"):
        processing_from_folder(tmp_path)


def test_a_qwen3_vl_folder_without_processor_files_gets_qwen3_vl_ones(tmp_path):
    """save_pretrained of a Qwen3-VL-shaped model with no source folder writes Qwen3-VL's processor settings, which
    `processing_from_folder` (and transformers' AutoProcessor) read back."""
    from mindvl.checkpoint import save_pretrained
    from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

    cfg = MindVLConfig(
        text=TextConfig(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, mrope_section=[4, 2, 2],
                        mrope_interleaved=True),
        vision=VisionConfig(family="qwen3_vl", depth=1, hidden_size=32, intermediate_size=48, num_heads=2,
                            patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0]),
        image_token_id=151, video_token_id=152, vision_start_token_id=150, vision_end_token_id=153)
    save_pretrained(MindVL(cfg), tmp_path / "m")
    p = processing_from_folder(tmp_path / "m")
    assert p == QWEN3_VL
