"""Video preprocessing speed: mindvl's `preprocess_video` (decode the sampled frames, resize, patch rows) against
the floor of decoding every frame with PyAV, interleaved arm by arm, medians and spreads, with the load printed.

    python benchmarks/bench_video.py [--seconds 4] [--height 360] [--width 640] [--fps 25] [--repeats 5]

The clip is written once with PyAV (mpeg4, random frames: the worst case for the codec) into a temporary folder.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from mindvl.data.video import VideoSettings, expand_video_patches, preprocess_video, write_test_video


def decode_all(path: Path) -> int:
    import av

    with av.open(str(path)) as container:
        return sum(1 for f in container.decode(video=0) if f.to_ndarray(format="rgb24") is not None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--height", type=int, default=360)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--fps", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    n = int(args.seconds * args.fps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "clip.mp4"
        rng = np.random.default_rng(0)
        write_test_video(path, rng.integers(0, 256, (n, args.height, args.width, 3), dtype=np.uint8), fps=args.fps)
        arms = {
            "decode every frame (PyAV floor)": lambda: decode_all(path),
            "preprocess_video (uint8 rows)": lambda: preprocess_video(path, VideoSettings()),
            "preprocess_video + float32 rows": lambda: expand_video_patches(preprocess_video(path).patches),
        }
        times: dict[str, list[float]] = {k: [] for k in arms}
        for _ in range(args.repeats):  # interleaved: each repeat runs every arm once
            for name, fn in arms.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        v = preprocess_video(path)
        print(f"clip: {n} frames of {args.height}x{args.width} at {args.fps} fps -> grid {v.grid}, "
              f"{v.patches.shape[0]} rows, second_per_grid_t {v.second_per_grid_t:.3f}")
        print(f"load average: {os.getloadavg()}")
        floor = statistics.median(times["decode every frame (PyAV floor)"])
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"{name:<34} median {med * 1e3:8.1f} ms  (min {min(ts) * 1e3:.1f}, max {max(ts) * 1e3:.1f})  "
                  f"x{med / floor:.2f} of the floor")


if __name__ == "__main__":
    main()
