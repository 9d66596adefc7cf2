"""Test-time resolution search (paper sections 5.4 and 6.3, Figure 4): evaluate each checkpoint at every
(min_pixels, max_pixels) pair of a grid, keep the best pair per benchmark, and plot the spread across settings.

    result = search_resolution({"sft-2k": DIR2, "merged": DIRM}, {"ocrbench": PATH}, GRIDS["paper"], OUT, settings)

Layout under OUT: `<checkpoint>/<benchmark>/min<a>_max<b>.jsonl` (per-item predictions, resumable like
`mindvl eval`), `results.json` (every score), `best.json` (best setting per benchmark, per checkpoint and overall),
`results.md` (the table) and `boxplot_<benchmark>.png` (one box per checkpoint over the grid's settings).

Pixel counts are multiples of 28 x 28 (one merged image token per 28 x 28 patch); a grid is given in those units.
Pairs with min > max are skipped. Ties keep the earlier setting in grid order (smaller min, then smaller max).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .runner import EvalSettings, evaluate_benchmark, write_json

TOKEN_PIXELS = 28 * 28

# In units of 28 x 28 pixels. `paper`: the grid of section 6.3; `quick`: a 2 x 2 corner of it for smoke runs.
GRIDS: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "paper": ((4, 16, 32, 64), (1280, 2048, 2560, 3072, 4096, 8192)),
    "quick": ((4, 64), (1280, 4096)),
}


def parse_grid(spec: str) -> list[tuple[int, int]]:
    """`paper`, `quick`, or `MINS:MAXES` in units of 28x28 (e.g. `4,16:16,64`) -> (min_pixels, max_pixels) pairs."""
    if spec in GRIDS:
        mins, maxes = GRIDS[spec]
    else:
        try:
            left, right = spec.split(":")
            mins = tuple(int(x) for x in left.split(","))
            maxes = tuple(int(x) for x in right.split(","))
        except ValueError:
            raise ValueError(f"--grid {spec!r}: expected {', '.join(GRIDS)} or MINS:MAXES in units of 28x28 "
                             "pixels, e.g. 4,16:16,64") from None
        if min(mins + maxes) < 1:
            raise ValueError(f"--grid {spec!r}: pixel counts must be >= 1 (units of 28x28)")
    pairs = [(a * TOKEN_PIXELS, b * TOKEN_PIXELS) for a in mins for b in maxes if a <= b]
    if not pairs:
        raise ValueError(f"--grid {spec!r}: no pair with min <= max")
    return pairs


def setting_label(min_pixels: int, max_pixels: int) -> str:
    return f"min{min_pixels // TOKEN_PIXELS}_max{max_pixels // TOKEN_PIXELS}"


def search_resolution(checkpoints: dict[str, str | os.PathLike], benches: dict[str, Path],
                      grid: Sequence[tuple[int, int]], out: str | os.PathLike, settings: EvalSettings,
                      tokenizer: str | os.PathLike | None = None, device: str | None = None,
                      log=print) -> dict[str, Any]:
    """Scores {checkpoint: {benchmark: {setting: headline}}} plus the best settings; writes the files above."""
    from mindvl.infer.chat import load_for_chat
    from mindvl.progress import Progress

    out = Path(out)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    exact: dict[str, dict[str, dict[str, float]]] = {}
    headlines: dict[str, str] = {}
    # Progress in evaluations (checkpoint x benchmark x setting), advanced by each evaluation's share of its items.
    bar = Progress("resolution search", total=len(checkpoints) * len(benches) * len(grid), unit="evaluations")
    bar.start()
    finished = 0
    for label, folder in checkpoints.items():
        model, tok = load_for_chat(folder, tokenizer, device)
        for bench, path in benches.items():
            for lo, hi in grid:
                name = setting_label(lo, hi)
                run = replace(settings, min_pixels=lo, max_pixels=hi)
                bar.update(finished, desc=f"search {label} {bench} {name}")
                summary = evaluate_benchmark(model, tok, bench, path, run, out / label / bench / f"{name}.jsonl",
                                             progress=lambda done, total, k=finished: bar.update(
                                                 k + (done / total if total else 0)))
                finished += 1
                bar.update(finished)
                headlines[bench] = summary["headline"]
                scores.setdefault(label, {}).setdefault(bench, {})[name] = summary[summary["headline"]]
                exact.setdefault(label, {}).setdefault(bench, {})[name] = summary["exact_match"]
                log(f"{label} {bench} {name}: {summary['headline']} {summary[summary['headline']]:.4g}, "
                    f"exact {summary['exact_match']:.1%}")
        del model
    bar.close()
    best = best_settings(scores)
    result = {"grid": [list(p) for p in grid], "headlines": headlines, "scores": scores, "exact_match": exact,
              "best": best}
    write_json(out / "results.json", result)
    write_json(out / "best.json", best)
    (out / "results.md").write_text(results_table(scores, headlines))
    for bench in benches:
        box_plot(scores, bench, headlines[bench], out / f"boxplot_{bench}.png")
    return result


def best_settings(scores: dict[str, dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per checkpoint and benchmark the best setting, and per benchmark the best (checkpoint, setting) overall."""
    per_ckpt: dict[str, dict[str, Any]] = {}
    overall: dict[str, dict[str, Any]] = {}
    for label, per_bench in scores.items():
        for bench, by_setting in per_bench.items():
            name = max(by_setting, key=lambda s: by_setting[s])  # max() keeps the first of equal scores
            entry = {"setting": name, **_pixels(name), "score": by_setting[name]}
            per_ckpt.setdefault(label, {})[bench] = entry
            if bench not in overall or entry["score"] > overall[bench]["score"]:
                overall[bench] = {"checkpoint": label, **entry}
    return {"per_checkpoint": per_ckpt, "overall": overall}


def _pixels(name: str) -> dict[str, int]:
    lo, hi = name.removeprefix("min").split("_max")
    return {"min_pixels": int(lo) * TOKEN_PIXELS, "max_pixels": int(hi) * TOKEN_PIXELS}


def results_table(scores: dict[str, dict[str, dict[str, float]]], headlines: dict[str, str]) -> str:
    """Markdown: one table per benchmark, checkpoints as rows and settings as columns, the best cell in bold."""
    parts = []
    for bench in sorted({b for per in scores.values() for b in per}):
        settings = list(next(per[bench] for per in scores.values() if bench in per))
        parts.append(f"### {bench} ({headlines[bench]})\n")
        parts.append("| checkpoint | " + " | ".join(settings) + " |")
        parts.append("|" + " --- |" * (1 + len(settings)))
        for label, per in scores.items():
            row = per.get(bench, {})
            top = max(row.values(), default=None)
            cells = [(f"**{row[s]:.4g}**" if row[s] == top else f"{row[s]:.4g}") if s in row else "" for s in settings]
            parts.append(f"| {label} | " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def box_plot(scores: dict[str, dict[str, dict[str, float]]], bench: str, metric: str, path: Path) -> Path | None:
    """The paper's Figure 4: one box per checkpoint of its scores across the resolution settings."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional (extra `plots`)
        return None
    labels = [label for label in scores if bench in scores[label]]
    data = [list(scores[label][bench].values()) for label in labels]
    fig, ax = plt.subplots(figsize=(1.6 + 1.2 * len(labels), 3.6))
    ax.boxplot(data, showmeans=True)
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20)
    for i, values in enumerate(data, start=1):  # the settings themselves, so a 2-setting box is still readable
        ax.scatter([i] * len(values), values, s=10, alpha=0.6)
    ax.set_ylabel(metric)
    ax.set_title(f"{bench}: scores across (min, max) pixel settings")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
