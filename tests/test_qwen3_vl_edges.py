"""Qwen3-VL inputs at the edges, against transformers: DeepStack indexes out of order (block `b`'s states go
through merger `indexes.index(b)`, and reach the LLM in block order) and images with a temporal grid t > 1 (their
positions use t as given: one vision item, time offsets 0..t-1, where a video's frames are items of their own)."""

from __future__ import annotations

import hf_tiny as H
import pytest
import qwen3vl_tiny as Q
import torch
from vl_alignment import TOL, rel

from mindvl.checkpoint import convert_from_hf, load_model


def _pair(root, deepstack: list[int], depth: int):
    """A tiny Qwen3-VL (transformers) with these DeepStack indexes and tower depth, and mindvl's conversion of it."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = {**Q.VISION_KW, "depth": depth, "deepstack_visual_indexes": deepstack}
    text = {**Q.TEXT_KW, "bos_token_id": 0, "eos_token_id": 1}
    cfg = Qwen3VLConfig(vision_config=vision, text_config=text, image_token_id=H.IMAGE_TOKEN,
                        video_token_id=H.VIDEO_TOKEN, vision_start_token_id=H.VISION_START,
                        vision_end_token_id=H.VISION_END)
    for c in (cfg, cfg.vision_config, cfg.text_config):
        c._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = H.randomise(Qwen3VLForConditionalGeneration(cfg), 0).eval()
    hf.save_pretrained(root / "hf")
    convert_from_hf(root / "hf", root / "mv")
    ours = load_model(root / "mv")
    ours.set_attention_backend("sdpa")
    return hf, ours


@pytest.fixture(scope="module")
def out_of_order(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("qwen3vl_ds"), [3, 0, 1], depth=4)


@torch.no_grad()
def test_out_of_order_deepstack_indexes_match_transformers(out_of_order):
    """Indexes [3, 0, 1]: block 0's states go through merger 1, block 1's through merger 2, block 3's through merger
    0, and the LLM's layers 0, 1, 2 receive them in block order (0.52 off transformers' logits before)."""
    hf, ours = out_of_order
    grid = torch.tensor([[1, 6, 10], [1, 4, 4]])
    px = Q.patch_rows(grid, 3)
    ref = hf.model.visual(px, grid_thw=grid)
    features, stack = ours.vision_features(px, grid)
    assert rel(features, ref.pooler_output) <= TOL
    assert len(stack) == len(ref.deepstack_features) == 3
    for got, want in zip(stack, ref.deepstack_features, strict=True):
        assert rel(got, want) <= TOL
    ids, kinds = Q.prompt([("image", [1, 6, 10]), ("image", [1, 4, 4])])
    want = hf(input_ids=ids, mm_token_type_ids=kinds, pixel_values=px, image_grid_thw=grid).logits
    assert rel(ours(input_ids=ids, pixel_values=px, image_grid_thw=grid).logits, want) <= TOL


def test_repeated_deepstack_indexes_are_refused_in_one_line():
    from mindvl.models import VisionConfig

    with pytest.raises(ValueError, match=r"deepstack_visual_indexes \[0, 2, 0\].*more than once"):
        VisionConfig(family="qwen3_vl", depth=3, num_position_embeddings=16, deepstack_visual_indexes=[0, 2, 0])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("qwen3vl_t2"), [0, 2], depth=3)


@torch.no_grad()
def test_an_image_with_two_temporal_patches_matches_transformers(pair):
    """An image grid row [2, 4, 6] (two temporal patches): transformers places it as one vision item with time
    offsets 0 and 1 and resumes the text at max(h, w) / 2 (before: 6e-2 off, its two frames were placed apart as a
    video's are). A video beside it still has its frames placed apart; mindvl's one-stream form agrees too."""
    hf, ours = pair
    images, videos = torch.tensor([[2, 4, 6], [1, 4, 4]]), torch.tensor([[2, 4, 6]])
    ids, kinds = Q.prompt([("image", [2, 4, 6]), ("video", [2, 4, 6]), ("image", [1, 4, 4])])
    # Q.prompt gives an image h*w/4 pads; an image of t temporal patches has t*h*w/4 in one run.
    run = (kinds[0] == 1).nonzero()[:, 0]
    first = run[: 6]  # the first image's pads: 4 * 6 / 4
    extra = torch.full((6,), H.IMAGE_TOKEN)
    at = int(first[-1]) + 1
    ids = torch.cat([ids[:, :at], extra[None], ids[:, at:]], 1)
    kinds = torch.cat([kinds[:, :at], torch.ones(1, 6, dtype=kinds.dtype), kinds[:, at:]], 1)
    px, pv = Q.patch_rows(images, 1), Q.patch_rows(videos, 2)
    pos, _ = hf.model.get_rope_index(ids, kinds, images, videos)
    cu = torch.tensor([0, ids.shape[1]], dtype=torch.int32)
    assert torch.equal(ours.default_position_ids(ids[0], cu, images, videos), pos[:, 0])
    n1 = int(images[0].prod())
    stream = torch.cat([images[:1], videos, images[1:]])
    assert torch.equal(ours.default_position_ids(ids[0], cu, stream), pos[:, 0])
    ref = hf(input_ids=ids, mm_token_type_ids=kinds, pixel_values=px, image_grid_thw=images,
             pixel_values_videos=pv, video_grid_thw=videos).logits
    got = ours(input_ids=ids, pixel_values=px, image_grid_thw=images, pixel_values_videos=pv, video_grid_thw=videos)
    assert rel(got.logits, ref) <= TOL
    packed = ours(input_ids=ids[0], pixel_values=torch.cat([px[:n1], pv, px[n1:]]), image_grid_thw=stream)
    assert rel(packed.logits, ref[0]) <= TOL
