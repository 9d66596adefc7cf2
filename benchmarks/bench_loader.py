"""Loader throughput: samples/s and images/s per worker, against raw Pillow decode + resize of the same images (the
floor: no normalisation, no patches, no text) and against transformers' PIL Qwen2-VL image processor.

    python benchmarks/bench_loader.py [--photos 120] [--synth 300] [--workers 2]

Two image sets, written to a temporary folder: the synthetic OCR/chart/grounding/doc set (PNG, small) and
"photos" (JPEG, 1280x960 smooth noise, resized under max_pixels = 1280*28*28 like a real photo corpus).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.data.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, load_image, preprocess, smart_resize
from mindvl.data.synth import generate


def make_photos(out: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    (out / "img").mkdir(parents=True, exist_ok=True)
    with open(out / "data.jsonl", "w") as f:
        for i in range(n):
            small = rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)
            img = Image.fromarray(small).resize((1280, 960), Image.BICUBIC)  # smooth, JPEG-compressible
            img.save(out / "img" / f"{i}.jpg", quality=90)
            rec = {"messages": [{"role": "user", "content": "<image>Describe the photo."},
                                {"role": "assistant", "content": "A colourful blurry pattern " * 4}],
                   "images": [f"img/{i}.jpg"]}
            f.write(json.dumps(rec) + "\n")
    return out / "data.jsonl"


def image_paths(jsonl: Path) -> list[Path]:
    return [jsonl.parent / json.loads(line)["images"][0] for line in jsonl.read_text().splitlines()]


def raw_pillow(paths: list[Path]) -> float:
    t = time.perf_counter()
    for p in paths:
        img = Image.open(p).convert("RGB")
        h, w = smart_resize(img.height, img.width, 28, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
        np.asarray(img.resize((w, h), Image.BICUBIC))
    return time.perf_counter() - t


def hf_processor(paths: list[Path]) -> float | None:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        return None
    proc = Qwen2VLImageProcessorPil(min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS)
    t = time.perf_counter()
    for p in paths:
        proc(images=[Image.open(p)], return_tensors="np")
    return time.perf_counter() - t


def ours(paths: list[Path]) -> float:
    t = time.perf_counter()
    for p in paths:
        preprocess(load_image(p), DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    return time.perf_counter() - t


def loader(jsonl: Path, workers: int, tok, n_samples: int) -> tuple[float, int, int]:
    """Full pipeline (parse, decode, patchify, tokenize, pack) for one epoch; returns (seconds, samples, images)."""
    cfg = DataConfig.from_dict({"sources": [str(jsonl)], "seq_len": 8192, "num_workers": workers,
                                "pack_buffer": 64})
    t = time.perf_counter()
    samples = images = 0
    for pack in build_loader(cfg, tok, max_epochs=1):
        samples += pack.num_samples
        images += len(pack.image_grid_thw)
    assert samples == n_samples
    return time.perf_counter() - t, samples, images


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--photos", type=int, default=120)
    ap.add_argument("--synth", type=int, default=300)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    tok = load_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        sets = {
            "synth (PNG, <=644px)": generate(Path(d) / "synth", args.synth, seed=0),
            "photos (JPEG 1280x960)": make_photos(Path(d) / "photos", args.photos),
        }
        for name, jsonl in sets.items():
            paths = image_paths(jsonl)
            n = len(paths)
            ours(paths[:5])  # warm caches
            floor, mine, hf = raw_pillow(paths), ours(paths), hf_processor(paths)
            print(f"\n== {name}: {n} images, min/max pixels {DEFAULT_MIN_PIXELS}/{DEFAULT_MAX_PIXELS}")
            print(f"{'stage (1 process)':<44} | {'images/s':>9} | {'vs Pillow floor':>15} | {'vs transformers':>15}")
            rows = [("raw Pillow decode + resize (floor)", floor), ("transformers Qwen2VLImageProcessorPil", hf),
                    ("mindvl load_image + preprocess", mine)]
            for label, secs in rows:
                if secs is None:
                    print(f"{label:<44} | {'n/a':>9} |")
                    continue
                vs_hf = f"{hf / secs:>14.2f}x" if hf else "n/a"
                print(f"{label:<44} | {n / secs:>9.1f} | {floor / secs:>14.2f}x | {vs_hf:>15}")
            print(f"{'full loader (parse+image+tokens+pack)':<44} | {'samples/s':>9} | {'images/s':>9} | "
                  f"{'per worker':>10}")
            for workers in sorted({0, args.workers}):
                secs, s, im = loader(jsonl, workers, tok, n)
                per = max(1, workers)
                print(f"{f'  num_workers={workers}':<44} | {s / secs:>9.1f} | {im / secs:>9.1f} | "
                      f"{s / secs / per:>10.1f}")


if __name__ == "__main__":
    main()
