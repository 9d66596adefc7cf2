"""Two-engine OCR on rendered text images: word precision and recall of each engine alone and of their intersection.

Images: `mindvl.curate.synth.text_image` (1-3 lines of words and numbers; Pillow's TrueType font at 18/24/32 px,
bold by stroke, or its bitmap font upscaled; white, cream, dark and light-blue backgrounds; 30% lightly blurred).
Words are compared case-folded, as multisets per image: precision = matched / predicted words, recall = matched /
true words. Needs `mindvl[curate]` and the tesseract binary.

    python benchmarks/bench_curate_ocr.py --n 40
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from collections import Counter

from mindvl.curate import PipelineConfig, iter_output, run_pipeline
from mindvl.curate.synth import ocr_corpus


def words(lines: list[str]) -> Counter:
    return Counter(w for t in lines for w in t.casefold().split())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, truth = ocr_corpus(os.path.join(tmp, "in"), args.n, args.seed)
        cfg = PipelineConfig.from_dict({"inputs": [path], "output": os.path.join(tmp, "out"),
                                        "stages": [{"ocr": {"drop_without_agreement": False}}]})
        t0 = time.perf_counter()
        run_pipeline(cfg)
        seconds = time.perf_counter() - t0
        items = list(iter_output(os.path.join(tmp, "out")))
    stats = {k: Counter() for k in ("rapidocr", "tesseract", "kept")}
    kinds = Counter()
    for it in items:
        i = int(it.where.rsplit(":", 1)[1]) - 1
        gt = words(truth[i])
        kinds["images"] += 1
        kinds["true_words"] += sum(gt.values())
        for k in stats:
            pred = words(it.meta["ocr"][k])
            stats[k]["pred"] += sum(pred.values())
            stats[k]["hit"] += sum((pred & gt).values())
            stats[k]["exact_images"] += int(pred == gt)
    print(f"images {kinds['images']}, true words {kinds['true_words']}, {seconds:.1f} s "
          f"({kinds['images'] / seconds:.2f} images/s, both engines)")
    print("| engine | words predicted | precision | recall | images read exactly |")
    print("|---|---|---|---|---|")
    for k, name in (("rapidocr", "PP-OCRv4 (RapidOCR)"), ("tesseract", "Tesseract 5"), ("kept", "intersection")):
        s = stats[k]
        print(f"| {name} | {s['pred']} | {s['hit'] / max(1, s['pred']):.3f} | {s['hit'] / kinds['true_words']:.3f} "
              f"| {s['exact_images']}/{kinds['images']} |")
    print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


if __name__ == "__main__":
    main()
