"""Calibrate the ablation's testbed (issue 29): exact match of model folders on the held-out synthetic benchmarks
(the ablation's own files and evaluation) and on the text probe, at the training resolution and, with --grid, over
the resolution grid, so a recipe change can be judged (best variant >= 30%, none at ceiling; grid settings legible)
before a whole `mindvl ablate` run.

    python benchmarks/testbed_calibrate.py runs/cal/seed0/sft-1024/final runs/cal/seed0/multitask/final \
        --out runs/calib --items 100 [--grid 4,36,48:16,24,28,64]

A training checkpoint (not yet exported) is evaluated after `mindvl export RUN/checkpoints/step_N --out DIR`.
Prints one row per model: OCRBench / ChartQA / DocVQA / text exact match in %, then per grid setting.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model folders (a run's final/, or an exported checkpoint)")
    p.add_argument("--out", required=True, help="where the benchmark files and predictions go (reused by a rerun)")
    p.add_argument("--items", type=int, default=100, help="held-out items per benchmark (default 100)")
    p.add_argument("--grid", default=None, help="also over this grid (e.g. 4,36,48:16,24,28,64, x 28 x 28 pixels)")
    args = p.parse_args()

    from mindvl.ablate.plan import Scale
    from mindvl.ablate.runner import _benchmarks, evaluate_models
    from mindvl.eval.resolution_search import parse_grid, search_resolution
    from mindvl.quickstart import eval_settings

    out = Path(args.out)
    benches = _benchmarks(out / "bench", args.items)
    models = {f"m{i}-{Path(m).resolve().parent.name}": Path(m) for i, m in enumerate(args.models)}
    # At the training resolution (and the text probe): the ablation's own evaluation.
    scores = evaluate_models(models, ["merge"], out / "eval", benches, Scale({}, args.items, "4:64"),
                             log=lambda line: None)
    print("| model | ocrbench | chartqa | docvqa | text |")
    print("| --- | --- | --- | --- | --- |")
    for label, s in scores.items():
        cells = [f"{100 * sum(s['items'][b]) / len(s['items'][b]):.1f}" for b in ("ocrbench", "chartqa", "docvqa")]
        cells.append(f"{100 * sum(s['text']) / len(s['text']):.1f}")
        print(f"| {label} ({models[label]}) | " + " | ".join(cells) + " |")
    if args.grid:  # the same predictions folder: the training-resolution setting is not evaluated twice
        search = search_resolution(models, benches, parse_grid(args.grid), out / "eval", eval_settings(),
                                   device="cpu", log=lambda line: None)
        for label in models:
            for bench, per in search["exact_match"][label].items():
                print(f"{label} {bench}: " + ", ".join(f"{k} {100 * v:.0f}" for k, v in per.items()))


if __name__ == "__main__":
    main()
