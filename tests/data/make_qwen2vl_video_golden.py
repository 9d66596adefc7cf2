"""Writes golden/qwen2vl_video.npz: transformers' Qwen2-VL video processor, with the real torchvision: its class
defaults, its frame sampling (`sample_frames`) on SAMPLING, its frame sizes with and without the per-video pixel
budget on SIZES (the size decision of `resize`; the resize itself is skipped there), and the whole processing of
two small synthetic decoded videos (CASES: sampling at 2 fps, resize up and down, patch rows).

torchvision cannot live beside the project's torch, so this is run by hand in a separate environment:

    python3 -m venv /work/venv-video
    /work/venv-video/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.23.0 numpy
    /work/venv-video/bin/python tests/data/make_qwen2vl_video_golden.py

test_data_video.py rebuilds the same decoded videos with `decoded_video` and compares mindvl's processing with the
stored rows (the videos themselves are not stored).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SAMPLING = [  # (total frames, video fps, sampling fps, min_frames, max_frames); None: the processor's default
    (9, 4.0, 2.0, None, None), (10, 30.0, 2.0, None, None), (300, 30.0, 2.0, None, None),
    (301, 29.97, 2.0, None, None), (7, 3.0, 2.0, None, None), (100, 24.0, 1.0, 4, 10), (5000, 25.0, 2.0, None, None),
    (33, 7.0, 3.0, 2, 768), (2, 1.0, 2.0, None, None), (11, 2.5, 1.5, None, None), (1000, 60.0, 0.5, None, None),
]
SIZES = [  # (frames, height, width, per-video budget)
    (4, 56, 84, True), (16, 480, 640, True), (768, 480, 640, True), (768, 480, 640, False), (64, 1080, 1920, True),
    (2, 20, 3000, True), (400, 360, 202, True),
]
# (total frames, fps of the file, height, width, processor size overrides)
CASES = {
    "up": (9, 4.0, 40, 100, {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 12}),
    "down": (12, 6.0, 90, 70, {"shortest_edge": 28 * 28, "longest_edge": 56 * 56}),
}


def decoded_video(total: int, height: int, width: int, seed: int) -> np.ndarray:
    """uint8 [total, H, W, 3]: smooth gradients plus noise, so resampling filters matter."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = []
    for k in range(total):
        base = np.stack([xx * 255 / width, yy * 255 / height, (xx + yy + 20 * k) % 255], -1)
        frames.append(np.clip(base + rng.normal(0, 30, base.shape), 0, 255).astype(np.uint8))
    return np.stack(frames)


def main() -> None:
    import torch
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    out = {}
    proc = Qwen2VLVideoProcessor()
    out["defaults"] = np.asarray([proc.min_frames, proc.max_frames, proc.size["shortest_edge"],
                                  proc.size["longest_edge"], proc.max_video_tokens, proc.temporal_patch_size])
    indices = [proc.sample_frames(VideoMetadata(total_num_frames=t, fps=vf), fps=f, min_frames=lo, max_frames=hi)
               for t, vf, f, lo, hi in SAMPLING]
    out["sampling_indices"] = np.concatenate([i.numpy() for i in indices])
    out["sampling_lengths"] = np.asarray([len(i) for i in indices])
    real_resize = type(proc).__mro__[1].resize
    type(proc).__mro__[1].resize = lambda self, image, size, resample=None, **kw: (size.height, size.width)
    out["sizes"] = np.asarray([
        proc.resize(torch.zeros(1, 1, 3, h, w, dtype=torch.uint8).expand(1, n, 3, h, w), proc.size, None, factor=28,
                    temporal_factor=2, cap_pixels_per_frame=cap)
        for n, h, w, cap in SIZES])
    type(proc).__mro__[1].resize = real_resize
    for i, (name, (total, fps, height, width, size)) in enumerate(CASES.items()):
        video = decoded_video(total, height, width, seed=i)
        proc = Qwen2VLVideoProcessor(size=size)
        meta = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height)
        res = proc(videos=[torch.from_numpy(video).permute(0, 3, 1, 2)], video_metadata=[meta], do_sample_frames=True,
                   fps=2.0, cap_pixels_per_frame=True, return_tensors="pt", return_metadata=True)
        out[f"{name}_rows"] = res["pixel_values_videos"].numpy()
        out[f"{name}_grid"] = res["video_grid_thw"].numpy()
        md = res["video_metadata"][0]
        out[f"{name}_indices"] = np.asarray(md.frames_indices)
        out[f"{name}_sampled_fps"] = np.asarray(md.sampled_fps)
        print(name, out[f"{name}_grid"], out[f"{name}_indices"], md.sampled_fps, out[f"{name}_rows"].shape,
              torch.__version__)
    np.savez_compressed(Path(__file__).with_name("golden") / "qwen2vl_video.npz", **out)


if __name__ == "__main__":
    main()
