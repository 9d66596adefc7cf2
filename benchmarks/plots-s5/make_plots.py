"""Re-make the report plots of issue 22 from real runs' data, with today's plotting code and (`--before REV`) the
code of an earlier revision, for looking at side by side.

    python benchmarks/plots-s5/make_plots.py --quickstart runs/qs --before b616577

Sources: a finished `mindvl quickstart` folder (its quickstart.json, metrics and search/results.json; nothing is
retrained) and the 3-seed tiny ablation in
benchmarks/ablation-tiny-3seeds/ablation.json (the resolution claim's per-setting exact match, mean over seeds; the
merge claim's exact match per benchmark). Writes PNGs beside this script. (The curation report's PNGs come from
`mindvl curate` runs themselves: its histograms are counted at another resolution since this change.)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from mindvl import quickstart  # noqa: E402
from mindvl.eval import resolution_search  # noqa: E402


def old_module(rev: str, path: str, name: str):
    """`path` as it was at git revision `rev`, imported under `name` inside its package (relative imports work)."""
    source = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{path}"], check=True, capture_output=True,
                            text=True).stdout
    file = HERE / f"_old_{Path(path).name}"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    file.unlink()
    return module


def ablation_data() -> tuple[dict, dict]:
    """(box-plot scores {model: {bench: {setting: mean}}}, a quickstart-like summary of the merge claim)."""
    claims = json.loads((ROOT / "benchmarks/ablation-tiny-3seeds/ablation.json").read_text())["claims"]
    settings = {v: e["settings"] for v, e in claims["resolution"]["variants"].items()}
    merge = claims["merge"]["variants"]
    evaluation = {v: {b: {"score": m["mean"], "exact_match": m["mean"]} for b, m in e["metrics"].items()
                      if b != "text"} for v, e in merge.items()}
    return settings, {"evaluation": evaluation}


def save_box(module, scores: dict, bench: str, name: str) -> None:
    module.box_plot(scores, bench, "exact match (mean over seeds)", HERE / name)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quickstart", type=Path, help="a finished mindvl quickstart folder")
    p.add_argument("--before", help="git revision whose plotting code makes the before_*.png")
    args = p.parse_args()

    variants = [("after", resolution_search, quickstart)]
    if args.before:
        variants.append(("before",
                         old_module(args.before, "mindvl/eval/resolution_search.py", "mindvl.eval._old_rs"),
                         old_module(args.before, "mindvl/quickstart.py", "mindvl._old_quickstart")))
    settings, merge_summary = ablation_data()
    two = {k: settings[k] for k in ("sft-512", "merged")}
    for tag, rs, qs in variants:
        save_box(rs, settings, "ocrbench", f"{tag}_ablation_boxplot_ocrbench.png")
        save_box(rs, two, "ocrbench", f"{tag}_ablation_boxplot_2ckpt.png")
        qs.plot_scores(HERE, merge_summary)
        (HERE / "scores.png").rename(HERE / f"{tag}_ablation_scores.png")
        if args.quickstart:
            res = json.loads((args.quickstart / "search/results.json").read_text())
            rs.box_plot(res["scores"], "ocrbench", res["headlines"]["ocrbench"],
                        HERE / f"{tag}_quickstart_zero_boxplot_ocrbench.png")
            summary = json.loads((args.quickstart / "quickstart.json").read_text())
            qs.plot_scores(HERE, summary)
            (HERE / "scores.png").rename(HERE / f"{tag}_quickstart_zero_scores.png")
            qs.plot_losses(args.quickstart, list(summary["phases"]))
            (args.quickstart / "loss_curves.png").rename(HERE / f"{tag}_quickstart_loss_curves.png")
    plt.close("all")


if __name__ == "__main__":
    main()
