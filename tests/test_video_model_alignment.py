"""Video on the model side against transformers' Qwen2.5-VL: `get_rope_index` on mixed image + video + text samples
(the time axis scaled by second_per_grid_ts) and the forward with a video (fp32, rel. error <= 1e-4)."""

from __future__ import annotations

import hf_tiny as H
import numpy as np
import pytest
import torch

from mindvl.data.template import mrope_positions
from mindvl.models import mrope_position_ids

TOL = 1e-4


@pytest.fixture(scope="module")
def vl_pair(tmp_path_factory):
    return H.converted_qwen25vl(tmp_path_factory.mktemp("vlvideo"), seed=11)


def mixed_ids(pieces: list, seed: int) -> torch.Tensor:
    return H.multimodal_ids([p if isinstance(p, int) or p[0] == "video" else list(p[1:]) for p in pieces], seed)


def mm_types(ids: torch.Tensor) -> torch.Tensor:
    return (ids == H.IMAGE_TOKEN).long() + 2 * (ids == H.VIDEO_TOKEN).long()


PIECES = [3, ("video", 4, 4, 6), 5, ("image", 1, 8, 4), 2, ("video", 6, 4, 4), 4]
SECONDS = [2 / 3, 2 / 1.5]  # temporal_patch_size / fps: fps 3 (k * 1.333.. truncates), fps 1.5


def test_mrope_positions_with_videos_match_get_rope_index(vl_pair):
    hf, ours = vl_pair
    tps = ours.config.tokens_per_second  # converted from the HF vision config (4 there; real checkpoints use 2)
    assert tps == hf.config.vision_config.tokens_per_second == 4
    ids = mixed_ids(PIECES, seed=1)
    image_grid = torch.tensor([[1, 8, 4]])
    video_grid = torch.tensor([[4, 4, 6], [6, 4, 4]])
    seconds = torch.tensor(SECONDS)  # float32, as the processor's BatchFeature hands it to the model
    ref, _ = hf.model.get_rope_index(ids[None], mm_token_type_ids=mm_types(ids)[None], image_grid_thw=image_grid,
                                     video_grid_thw=video_grid, second_per_grid_ts=seconds)
    cu = torch.tensor([0, len(ids)])
    got = mrope_position_ids(ids, cu, image_grid, H.IMAGE_TOKEN, 2, H.VIDEO_TOKEN, video_grid, seconds, tps)
    assert torch.equal(got, ref[:, 0])
    # mindvl's packed form: one grid stream in order of appearance gives the same positions.
    stream = torch.tensor([[4, 4, 6], [1, 8, 4], [6, 4, 4]])
    assert torch.equal(mrope_position_ids(ids, cu, stream, H.IMAGE_TOKEN, 2, H.VIDEO_TOKEN, None, seconds, tps), got)
    # The data side's implementation (numpy, from the pad spans) gives the same positions too.
    is_pad = ((ids == H.IMAGE_TOKEN) | (ids == H.VIDEO_TOKEN)).int()
    starts = torch.nonzero(is_pad.diff(prepend=torch.zeros(1, dtype=torch.int)) == 1).flatten().tolist()
    ends = torch.nonzero(is_pad.diff(append=torch.zeros(1, dtype=torch.int)) == -1).flatten().add(1).tolist()
    intervals = [float(np.float32(tps) * np.float32(SECONDS[0])), None, float(np.float32(tps) * np.float32(SECONDS[1]))]
    data_side = mrope_positions(len(ids), list(zip(starts, ends, strict=True)), stream.tolist(), intervals)
    assert np.array_equal(data_side, ref[:, 0].numpy())
    # Hand-checked: the first video starts after 3 text + vision_start (position 4); its 4 temporal patches at fps 3
    # are k * 4 * (2/3) = 0, 2.67, 5.33, 8 -> 0, 2, 5, 8 (truncated), 2x3 merged tokens each.
    assert got[0, 4:28].tolist() == [4] * 6 + [6] * 6 + [9] * 6 + [12] * 6
    assert int(got[0, 28]) == 4 + 3  # vision_end resumes at start + max(h, w)/2, not after the time axis


def test_forward_with_a_video_matches_transformers(vl_pair):
    hf, ours = vl_pair
    ids = mixed_ids(PIECES, seed=2)
    pixels, image_grid = H.random_pixels([[1, 8, 4]], seed=3)
    videos, video_grid = H.random_pixels([[4, 4, 6], [6, 4, 4]], seed=4)
    seconds = torch.tensor(SECONDS)
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=pixels, image_grid_thw=image_grid, pixel_values_videos=videos,
                 video_grid_thw=video_grid, second_per_grid_ts=seconds, mm_token_type_ids=mm_types(ids)[None]).logits
        got = ours(input_ids=ids[None], pixel_values=pixels, image_grid_thw=image_grid, pixel_values_videos=videos,
                   video_grid_thw=video_grid, second_per_grid_ts=seconds).logits
        # The packed form: one pixel stream, videos and images in order of appearance.
        n0 = 4 * 4 * 6
        stream = torch.cat([videos[:n0], pixels, videos[n0:]])
        grids = torch.tensor([[4, 4, 6], [1, 8, 4], [6, 4, 4]])
        packed = ours(input_ids=ids, pixel_values=stream, image_grid_thw=grids, second_per_grid_ts=seconds).logits
    assert got.shape == ref.shape
    assert H.rel_err(got, ref) <= TOL
    assert H.rel_err(packed, ref[0]) <= TOL
