"""The data pipeline with Qwen3-VL's processor (`data.processor: qwen3_vl`, or filled in from the model folder by the
trainer): 16-px patch rows with mean/std 0.5 equal to transformers' image processor set up as Qwen3-VL's, token
counts and vision budgets in 16-px patches (hand-computed), and a video laid out as Qwen3-VL's processor does (one
timestamped block per temporal patch) with M-RoPE positions equal to transformers' Qwen3-VL get_rope_index."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from data_helpers import png_bytes, qa, write_jsonl
from PIL import Image

from mindvl.data import DataConfig, build_loader
from mindvl.data.processors import QWEN3_VL, as_processing


def _cfg(path, **kw) -> DataConfig:
    return DataConfig.from_dict({"sources": [{"paths": [str(path)]}], "seq_len": 512, "pack_buffer": 1,
                                 "default_system": None, "image_resize": "pil", "min_pixels": 1024,
                                 "max_pixels": 32 * 32 * 16, **kw})


def _first_pack(cfg, tok):
    return next(iter(build_loader(cfg, tok, max_epochs=1)))


def test_qwen3_image_rows_grid_and_pads(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(70, 100, seed=1))
    write_jsonl(tmp_path / "d.jsonl", [qa("<image>What?", "A.", images=["a.png"])])
    pack = _first_pack(_cfg(tmp_path / "d.jsonl", processor="qwen3_vl"), tok)
    # 70 x 100 -> smart_resize to multiples of 32: round(70/32)=2, round(100/32)=3 -> 64 x 96 = 6144 pixels within
    # [1024, 16384]: grid (1, 4, 6) in 16-px patches, 6 merged tokens.
    assert pack.image_grid_thw.tolist() == [[1, 4, 6]]
    assert int((pack.input_ids == tok.special.image_pad).sum()) == 6
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ref = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3, size={"shortest_edge": 1024, "longest_edge": 32 * 32 * 16})(
        images=[Image.open(io.BytesIO(png_bytes(70, 100, seed=1))).convert("RGB")], return_tensors="np")
    rows = pack.pixel_values.numpy() if isinstance(pack.pixel_values, torch.Tensor) else pack.pixel_values
    assert rows.shape == (24, 1536) and np.array_equal(rows, ref["pixel_values"])
    # The same record through Qwen2-VL's processor (the default): 28-px units, round(70/28)=2 (2.5, banker's),
    # round(100/28)=4 -> 56 x 112: grid (1, 4, 8), 8 tokens of 1176-value rows.
    pack2 = _first_pack(_cfg(tmp_path / "d.jsonl"), tok)
    assert pack2.image_grid_thw.tolist() == [[1, 4, 8]] and pack2.pixel_values.shape == (32, 1176)


def test_vision_budget_counts_16px_patches(tmp_path, tok):
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(png_bytes(70, 100, seed=i))
    write_jsonl(tmp_path / "d.jsonl", [qa("<image>What?", "A.", images=[f"{i}.png"]) for i in range(3)])
    # 24 patch rows per sample: a budget of 50 holds two samples (48), not three (72); in Qwen2-VL's 14-px patches the
    # same images have 32 rows each and one sample per pack would fit.
    cfg = _cfg(tmp_path / "d.jsonl", processor="qwen3_vl", max_patches_per_pack=50, pack_buffer=8)
    packs = list(build_loader(cfg, tok, max_epochs=1))
    assert [len(p.image_grid_thw) for p in packs] == [2, 1]
    cfg = _cfg(tmp_path / "d.jsonl", max_patches_per_pack=50, pack_buffer=8)
    assert [len(p.image_grid_thw) for p in build_loader(cfg, tok, max_epochs=1)] == [1, 1, 1]


def test_processor_spec_is_validated():
    assert as_processing("qwen3_vl") == QWEN3_VL
    assert as_processing({"family": "qwen3_vl", "image_mean": [0.5, 0.5, 0.5]}) == QWEN3_VL
    with pytest.raises(ValueError, match=r"data.processor: unknown processor family 'qwen4'"):
        DataConfig.from_dict({"sources": ["x.jsonl"], "processor": "qwen4"})
    with pytest.raises(ValueError, match=r"data.processor: unknown key\(s\) patch"):
        DataConfig.from_dict({"sources": ["x.jsonl"], "processor": {"family": "qwen3_vl", "patch": 16}})
    with pytest.raises(ValueError, match=r"data.processor.merge_size: only 2 is supported"):
        DataConfig.from_dict({"sources": ["x.jsonl"], "processor": {"merge_size": 3}})


def test_qwen3_video_sample_layout_and_positions(tmp_path, tok):
    pytest.importorskip("av")
    import qwen3vl_tiny as Q

    from mindvl.data.video import write_test_video

    frames = np.random.default_rng(0).integers(0, 256, (9, 64, 96, 3), dtype=np.uint8)
    write_test_video(tmp_path / "v.mp4", frames, fps=4)
    (tmp_path / "a.png").write_bytes(png_bytes(70, 100, seed=1))
    write_jsonl(tmp_path / "d.jsonl", [{**qa("<video>What happens?<image>", "B.", images=["a.png"]),
                                        "videos": ["v.mp4"]}])
    spec = {"family": "qwen3_vl", "video_min_pixels": 4096, "video_max_pixels": 65536}
    pack = _first_pack(_cfg(tmp_path / "d.jsonl", processor=spec), tok)
    # Frames 0, 3, 5, 8 (4 of 9 at 2 fps, min_frames 4), 64 x 96 kept: 2 temporal patches of 4 x 6 patches, each its
    # own (1, 4, 6) item after its timestamp; then the image.
    assert pack.image_grid_thw.tolist() == [[1, 4, 6], [1, 4, 6], [1, 4, 6]]
    text = tok.decode(pack.input_ids.tolist())
    assert "<0.4 seconds><|vision_start|>" in text and "<1.6 seconds><|vision_start|>" in text
    assert int((pack.input_ids == tok.special.video_pad).sum()) == 12
    # Positions: transformers' get_rope_index over the video's (2, 4, 6) grid and the image's (1, 4, 6).
    ids = torch.as_tensor(pack.input_ids)[None]
    kinds = (ids == tok.special.image_pad).long() + 2 * (ids == tok.special.video_pad).long()
    hf = Q.qwen3vl()
    ref, _ = hf.model.get_rope_index(ids, kinds, torch.tensor([[1, 4, 6]]), torch.tensor([[2, 4, 6]]))
    assert torch.equal(torch.as_tensor(pack.position_ids), ref[:, 0])


def test_loader_workers_and_rank_shards_carry_16px_rows(tmp_path, tok):
    """Worker processes allocate the pack's shared-memory rows at the processor's width; two ranks' shards together
    hold every record once, each pack cut as the single-process loader cuts it."""
    for i in range(4):
        (tmp_path / f"{i}.png").write_bytes(png_bytes(70, 100, seed=i))
    write_jsonl(tmp_path / "d.jsonl", [qa(f"<image>Q{i}?", "A.", images=[f"{i}.png"]) for i in range(4)])
    cfg = _cfg(tmp_path / "d.jsonl", processor="qwen3_vl")
    single = {tuple(p.input_ids.tolist()): p.pixel_values for p in build_loader(cfg, tok, max_epochs=1)}
    cfg.num_workers = 1
    seen = []
    for rank in range(2):
        for p in build_loader(cfg, tok, rank=rank, world_size=2, max_epochs=1):
            assert p.pixel_values.shape == (24, 1536)
            assert np.array_equal(np.asarray(p.pixel_values), np.asarray(single[tuple(p.input_ids.tolist())]))
            seen.append(tuple(p.input_ids.tolist()))
    assert sorted(seen) == sorted(single)


def test_qwen3_video_byte_limit_is_the_data_setting(tmp_path, tok):
    """The Qwen3-VL processor path honours data.video.max_video_bytes as the Qwen2.5-VL one does: the loader
    skips the larger file as `video_too_large`, and both the decoder and the header-only layout refuse it."""
    pytest.importorskip("av")
    from mindvl.data.processors import process_video_qwen3, video_layout_qwen3
    from mindvl.data.video import VideoError, write_test_video

    frames = np.random.default_rng(0).integers(0, 256, (9, 64, 96, 3), dtype=np.uint8)
    write_test_video(tmp_path / "v.mp4", frames, fps=4)
    size = (tmp_path / "v.mp4").stat().st_size
    p = as_processing(QWEN3_VL)
    for fn in (process_video_qwen3, video_layout_qwen3):
        with pytest.raises(VideoError) as err:
            fn(tmp_path / "v.mp4", p, max_video_bytes=size - 1)
        assert err.value.reason == "video_too_large"
        fn(tmp_path / "v.mp4", p, max_video_bytes=size)
    write_jsonl(tmp_path / "d.jsonl", [{**qa("<video>What happens?", "B."), "videos": ["v.mp4"]}, qa("Hi", "Yes.")])
    cfg = DataConfig.from_dict({"sources": [str(tmp_path / "d.jsonl")], "seq_len": 1024, "pack_buffer": 2,
                                "processor": {"family": "qwen3_vl", "video_min_pixels": 4096,
                                              "video_max_pixels": 65536}, "video": {"max_video_bytes": size - 1}})
    loader = build_loader(cfg, tok, max_epochs=1)
    assert sum(pk.num_samples for pk in loader) == 1
    assert loader.report()["skipped"] == {"video_too_large": 1}
