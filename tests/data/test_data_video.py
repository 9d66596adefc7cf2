"""Videos as Qwen2.5-VL reads them: frame sampling, frame sizes and patch rows against transformers' own video
processor with the real torchvision (golden values made by make_qwen2vl_video_golden.py in a separate venv),
decoding of tiny videos written with PyAV, and bad videos skipped and counted by reason."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
from data_helpers import qa, write_jsonl, write_tar
from make_qwen2vl_video_golden import SAMPLING, SIZES

from mindvl.data import DataConfig, build_loader
from mindvl.data.video import (
    VideoError,
    VideoSettings,
    decode_video,
    expand_video_patches,
    frame_size,
    patchify_video_uint8,
    require_decoder,
    sample_frame_indices,
    settings_from_processor_config,
    write_test_video,
)

GOLDEN = Path(__file__).with_name("golden") / "qwen2vl_video.npz"


@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


def test_defaults_are_transformers(golden):
    s = VideoSettings()
    assert golden["defaults"].tolist() == [s.min_frames, s.max_frames, s.min_pixels, s.max_pixels,
                                           s.max_video_tokens, 2]


def test_frame_sampling_matches_transformers(golden):
    expected = np.split(golden["sampling_indices"], np.cumsum(golden["sampling_lengths"])[:-1])
    for (total, vfps, fps, lo, hi), want in zip(SAMPLING, expected, strict=True):
        kw = {k: v for k, v in (("min_frames", lo), ("max_frames", hi)) if v is not None}
        assert sample_frame_indices(total, vfps, fps, **kw) == want.tolist(), (total, vfps, fps)
    # Hand-checked: 9 frames at 4 fps sampled at 2 fps -> 4.5 frames -> 4 (even) at 0, 2.25, 4.5, 6.75.
    assert expected[0].tolist() == [0, 2, 4, 6]


def test_frame_sizes_match_transformers_with_the_per_video_budget(golden):
    for (n, h, w, cap), want in zip(SIZES, golden["sizes"].tolist(), strict=True):
        assert list(frame_size(h, w, n, VideoSettings(cap_pixels_per_frame=cap))) == want, (n, h, w, cap)
    # 768 frames of 480x640: the budget (0.9 * 128000 tokens of 28x28 over 384 temporal patches) lowers the size.
    assert np.prod(golden["sizes"][2]) < np.prod(golden["sizes"][3])


# A stock-style Qwen2.5-VL video_preprocessor_config.json: no `cap_pixels_per_frame` (nor fps/max_video_tokens).
STOCK_VIDEO_CONFIG = {
    "video_processor_type": "Qwen2VLVideoProcessor", "processor_class": "Qwen2_5_VLProcessor",
    "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
    "min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28,
    "size": {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28},
}


def test_a_stock_folder_without_the_budget_key_sizes_as_transformers(golden, tmp_path):
    """transformers' Qwen2VLVideoProcessor has `cap_pixels_per_frame = None` and tests it for truth: a folder whose
    file lacks the key runs WITHOUT the per-video budget, and so must mindvl read it."""
    from mindvl.infer.chat import video_settings

    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(STOCK_VIDEO_CONFIG))
    s = video_settings(tmp_path)
    assert s.cap_pixels_per_frame is False
    assert (s.min_frames, s.max_frames, s.min_pixels, s.max_pixels, s.max_video_tokens) == tuple(
        golden["defaults"].tolist()[:5])
    # transformers' sizes without the budget (SIZES[3]: 768 frames of 480x640) and not the budgeted ones (SIZES[2]).
    assert SIZES[3][:3] == SIZES[2][:3] == (768, 480, 640) and not SIZES[3][3]
    assert list(frame_size(480, 640, 768, s)) == golden["sizes"][3].tolist() != golden["sizes"][2].tolist()
    # The case: 400 frames of 1080x1920. Without the budget the size does not depend on the frame count, so
    # transformers' 64-frame size (SIZES[4], where the budget does not bind) is its 400-frame size: 560x1008
    # (hand-checked: sqrt(1080*1920 / 602112) = 1.856; floor(1080/1.856/28)*28 = 560, floor(1920/1.856/28)*28 = 1008).
    assert SIZES[4][1:3] == (1080, 1920)
    assert list(frame_size(1080, 1920, 400, s)) == golden["sizes"][4].tolist() == [560, 1008]
    # With the budget on (mindvl's training default), the same clip is smaller: the difference the key makes.
    assert list(frame_size(1080, 1920, 400, VideoSettings())) == [504, 896]
    # An explicit null is also off (truth test); an explicit true turns the budget on.
    assert not settings_from_processor_config({**STOCK_VIDEO_CONFIG, "cap_pixels_per_frame": None}).cap_pixels_per_frame
    assert settings_from_processor_config({**STOCK_VIDEO_CONFIG, "cap_pixels_per_frame": True}).cap_pixels_per_frame


def test_odd_frame_counts_repeat_the_last_frame():
    frames = np.random.default_rng(0).integers(0, 256, (3, 28, 56, 3), dtype=np.uint8)
    padded = np.concatenate([frames, frames[-1:]])
    np.testing.assert_array_equal(patchify_video_uint8(frames), patchify_video_uint8(padded))
    rows = patchify_video_uint8(padded).reshape(2, 1, 2, 2, 2, 3, 2, 14, 14)  # (t, bh, bw, mh, mw, C, T, ph, pw)
    # Row 0 holds frames 0 and 1 of the top-left patch, channel-major: transformers' (C, T, 14, 14) order.
    np.testing.assert_array_equal(rows[0, 0, 0, 0, 0, :, 1], padded[1, :14, :14].transpose(2, 0, 1))


def test_processing_equals_transformers_with_torchvision(golden):
    """Golden rows from transformers' processor with the real torchvision (make_qwen2vl_video_golden.py): frame
    sampling at 2 fps, resize up (40x100 -> 28x112) and down (90x70 -> 56x28), rows: bit-identical."""
    from make_qwen2vl_video_golden import CASES, decoded_video

    from mindvl.data.video import DecodedVideo, process_frames

    for i, (name, (total, fps, height, width, size)) in enumerate(CASES.items()):
        video = decoded_video(total, height, width, seed=i)
        indices = sample_frame_indices(total, fps, 2.0)
        assert indices == golden[f"{name}_indices"].tolist()
        decoded = DecodedVideo(video[indices], indices, total, fps)
        assert decoded.sampled_fps == float(golden[f"{name}_sampled_fps"])
        v = process_frames(decoded, VideoSettings(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"]))
        assert list(v.grid) == golden[f"{name}_grid"][0].tolist()
        assert (v.grid[1] * 14, v.grid[2] * 14) != (height, width)  # the frames were resized
        np.testing.assert_array_equal(expand_video_patches(v.patches), golden[f"{name}_rows"])


def _ramp_video(path: Path, n: int, fps: int = 4, h: int = 56, w: int = 84) -> np.ndarray:
    """Frame k is a flat grey of level (10 + 20k) mod 240 (recognisable after lossy coding)."""
    frames = np.stack([np.full((h, w, 3), (10 + 20 * k) % 240, np.uint8) for k in range(n)])
    write_test_video(path, frames, fps=fps)
    return frames


@pytest.mark.parametrize("container", ["mp4", "mkv"])  # mkv does not store a frame count: packets are counted
def test_decode_picks_the_sampled_frames(tmp_path, container):
    _ramp_video(tmp_path / f"v.{container}", 12, fps=4)
    d = decode_video(tmp_path / f"v.{container}")
    assert (d.total_frames, d.video_fps) == (12, 4.0)
    assert d.indices == sample_frame_indices(12, 4.0) == [0, 2, 4, 6, 8, 10]  # 12 / 4 * 2 = 6 frames
    levels = d.frames.reshape(len(d.indices), -1).mean(1)
    np.testing.assert_allclose(levels, [10 + 20 * k for k in d.indices], atol=4)
    assert d.sampled_fps == 2.0


def test_bad_videos_are_skipped_and_counted(tmp_path, tok):
    _ramp_video(tmp_path / "good.mp4", 8)
    _ramp_video(tmp_path / "one.mp4", 1)  # one frame: not even one temporal patch
    _ramp_video(tmp_path / "long.mp4", 40)
    good = (tmp_path / "good.mp4").read_bytes()
    (tmp_path / "cut.mp4").write_bytes(good[: len(good) // 3])
    (tmp_path / "junk.mp4").write_bytes(b"\x00not a video" * 50)
    names = ["good.mp4", "one.mp4", "long.mp4", "cut.mp4", "junk.mp4", "absent.mp4"]
    records = [{**qa("<video>What happens?", "Grey."), "videos": [n]} for n in names]
    records.append({**qa("<video><video>Compare.", "Same."), "videos": ["good.mp4"]})  # markers != videos
    write_jsonl(tmp_path / "v.jsonl", records)
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "v.jsonl")}], "seq_len": 2048, "pack_buffer": 4,
                                "video": {"min_pixels": 56 * 56, "max_pixels": 56 * 84, "max_decoded_frames": 30}})
    loader = build_loader(cfg, tok, max_epochs=1)
    packs = list(loader)
    assert sum(p.num_samples for p in packs) == 1
    skipped = loader.report()["skipped"]
    assert skipped == {"video_no_frames": 1, "video_too_long": 1, "corrupt_video": 2, "missing_video": 1,
                       "video_count_mismatch": 1}, skipped


def test_a_video_over_the_byte_limit_is_skipped_before_decoding(tmp_path, tok, caplog):
    """`data.video.max_video_bytes` bounds a video file as `data.max_image_bytes` bounds an image: measured on the
    descriptor before the decoder reads a byte, a larger file is a `video_too_large` skip (counted, logged with its
    file:line, the message naming the file and the setting); a file at the limit decodes."""
    _ramp_video(tmp_path / "small.mp4", 8)
    rng = np.random.default_rng(0)
    write_test_video(tmp_path / "big.mp4", rng.integers(0, 255, (8, 56, 56, 3), dtype=np.uint8), fps=4)
    limit = (tmp_path / "small.mp4").stat().st_size
    assert (tmp_path / "big.mp4").stat().st_size > limit
    s = VideoSettings(max_video_bytes=limit)
    assert decode_video(tmp_path / "small.mp4", s).total_frames == 8
    for source in (tmp_path / "big.mp4", (tmp_path / "big.mp4").read_bytes()):
        with pytest.raises(VideoError) as err:
            decode_video(source, s)
        assert err.value.reason == "video_too_large" and "data.video.max_video_bytes" in str(err.value)
    with pytest.raises(VideoError, match=rf"^{tmp_path / 'big.mp4'}: the video has \d+ bytes, over the limit of "
                                         rf"{limit} \(data\.video\.max_video_bytes\); raise the limit"):
        decode_video(tmp_path / "big.mp4", s)
    path = write_jsonl(tmp_path / "v.jsonl", [{**qa("<video>What happens?", "Grey."), "videos": [n]}
                                              for n in ("small.mp4", "big.mp4", "small.mp4")])
    cfg = DataConfig.from_dict({"sources": [{"path": str(path)}], "seq_len": 2048, "pack_buffer": 4,
                                "video": {"min_pixels": 56 * 56, "max_pixels": 56 * 84, "max_video_bytes": limit}})
    with caplog.at_level(logging.WARNING, logger="mindvl.data"):
        loader = build_loader(cfg, tok, max_epochs=1)
        assert sum(p.num_samples for p in loader) == 2
    assert loader.report()["skipped"] == {"video_too_large": 1}
    assert any("video_too_large" in r.getMessage() and f"{path}:2" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="max_video_bytes"):
        DataConfig.from_dict({"sources": [{"path": str(path)}], "video": {"max_video_bytes": 0}})


def test_missing_decoder_names_the_extra(monkeypatch, tmp_path, tok):
    _ramp_video(tmp_path / "v.mp4", 8)
    write_jsonl(tmp_path / "v.jsonl", [qa("text only", "fine"), {**qa("<video>What?", "Grey."), "videos": ["v.mp4"]}])
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` now raises ImportError
    with pytest.raises(ImportError, match=r"mindvl\[video\]"):
        require_decoder()
    with pytest.raises(ImportError, match=r"mindvl\[video\]"):
        decode_video(b"anything")
    # A run stops at its first video (not a skipped sample: every video would be lost), naming the extra.
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "v.jsonl")}], "seq_len": 1024})
    with pytest.raises(ImportError, match=r"mindvl\[video\]"):
        list(build_loader(cfg, tok, max_epochs=1))
    # A source whose first record names a video fails when the loader is built, before any training step; a
    # source without videos does not need the decoder.
    write_jsonl(tmp_path / "w.jsonl", [{**qa("<video>What?", "Grey."), "videos": ["v.mp4"]}])
    write_tar(tmp_path / "w.tar", [("k", {"json": b'{"messages": []}', "mp4": b"x"})])
    for path in ("w.jsonl", "w.tar"):
        cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "t.jsonl")},
                                                {"name": "clips", "path": str(tmp_path / path)}]})
        write_jsonl(tmp_path / "t.jsonl", [qa("text only", "fine")])
        with pytest.raises(ImportError, match=r"source 'clips' has videos: .*mindvl\[video\]"):
            build_loader(cfg, tok)
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "t.jsonl")}], "seq_len": 1024})
    assert sum(p.num_samples for p in build_loader(cfg, tok, max_epochs=1)) == 1


def test_sampling_edge_cases():
    with pytest.raises(VideoError) as exc:
        sample_frame_indices(0, 30.0)
    assert exc.value.reason == "video_no_frames"
    assert sample_frame_indices(3, 30.0) == [0, 1]  # fewer than min_frames: all it has, rounded down to even


def test_video_records_in_tar_shards_and_the_vision_budget(tmp_path, tok):
    _ramp_video(tmp_path / "v.mp4", 8)
    data = (tmp_path / "v.mp4").read_bytes()
    record = json.dumps({**qa("<video>What?", "Grey."), "videos": ["mp4"]}).encode()
    write_tar(tmp_path / "s.tar", [("k0", {"json": record, "mp4": data}), ("k1", {"json": record, "mp4": data})])
    video = {"min_pixels": 56 * 56, "max_pixels": 56 * 84}  # 8 frames -> 4 sampled -> grid (2, 4, 6): 48 rows
    cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "s.tar")}], "seq_len": 4096, "pack_buffer": 4,
                                "max_patches_per_pack": 96, "video": video})
    packs = list(build_loader(cfg, tok, max_epochs=1))
    assert [p.image_grid_thw.tolist() for p in packs] == [[[2, 4, 6], [2, 4, 6]]]
    # A pack budget of 60 rows holds one video at a time; 40 rows cannot hold any: both are skipped as
    # too_many_patches and a source with no usable sample is an error.
    def run(budget):
        cfg = DataConfig.from_dict({"sources": [{"path": str(tmp_path / "s.tar")}], "seq_len": 4096,
                                    "pack_buffer": 4, "max_patches_per_pack": budget, "video": video})
        return [p.image_grid_thw.tolist() for p in build_loader(cfg, tok, max_epochs=1)]

    assert run(60) == [[[2, 4, 6]], [[2, 4, 6]]]
    with pytest.raises(ValueError, match="too_many_patches"):
        run(40)
