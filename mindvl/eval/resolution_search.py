"""Test-time resolution search (paper sections 5.4 and 6.3, Figure 4): evaluate each checkpoint at every
(min_pixels, max_pixels) pair of a grid, keep the best pair per benchmark, and plot the spread across settings.

    result = search_resolution({"sft-2k": DIR2, "merged": DIRM}, {"ocrbench": PATH}, GRIDS["paper"], OUT, settings)

Layout under OUT: `<checkpoint>/<benchmark>/min<a>_max<b>.jsonl` (per-item predictions, resumable like
`mindvl eval`), `results.json` (every score), `best.json` (best setting per benchmark, per checkpoint and overall),
`results.md` (the table) and `boxplot_<benchmark>.png` (one box per checkpoint over the grid's settings).

A grid is given in merged image tokens: one per 28 x 28 pixels for Qwen2-VL's processor (pairs of pixel counts,
the form `parse_grid` returns, are read in those units), and each checkpoint is searched at the same token budgets
in its own processor's pixels (`mindvl.infer.chat.folder_processing`: 32 x 32 per token for Qwen3-VL's 16-px
patches), so `min4_max1280` means at least 4 and at most 1280 image tokens per image for every checkpoint.
Pairs with min > max are skipped. Ties keep the earlier setting in grid order (smaller min, then smaller max).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from .runner import EvalSettings, evaluate_benchmark, with_system, write_json

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
                      log=print, system_from_model: bool = False) -> dict[str, Any]:
    """Scores {checkpoint: {benchmark: {setting: headline}}} plus the best settings; writes the files above.
    `system_from_model`: each checkpoint with the system turn it was trained with (`runner.with_system`)."""
    from mindvl.infer.chat import folder_processing, load_for_chat
    from mindvl.progress import Progress

    out = Path(out)
    scores: dict[str, dict[str, dict[str, float]]] = {}
    exact: dict[str, dict[str, dict[str, float]]] = {}
    headlines: dict[str, str] = {}
    plotted: dict[str, dict[str, dict[str, float]]] = {}  # what the box plots show (`plot_value`)
    axis: dict[str, str] = {}
    token_pixels: dict[str, int] = {}
    # Progress in evaluations (checkpoint x benchmark x setting), advanced by each evaluation's share of its items.
    bar = Progress("resolution search", total=len(checkpoints) * len(benches) * len(grid), unit="evaluations")
    bar.start()
    finished = 0
    for label, folder in checkpoints.items():
        model, tok = load_for_chat(folder, tokenizer, device)
        own = with_system(settings, folder, system_from_model, log)
        processing = folder_processing(folder, model)
        unit = token_pixels[label] = processing.factor ** 2 if processing is not None else TOKEN_PIXELS
        for bench, path in benches.items():
            for lo, hi in grid:
                name = setting_label(lo, hi)
                # the grid's token budgets in this checkpoint's pixels (28 x 28 or 32 x 32 per token)
                run = replace(own, min_pixels=lo // TOKEN_PIXELS * unit, max_pixels=hi // TOKEN_PIXELS * unit)
                bar.update(finished, desc=f"search {label} {bench} {name}")
                summary = evaluate_benchmark(model, tok, bench, path, run, out / label / bench / f"{name}.jsonl",
                                             processing=processing, progress=lambda done, total, k=finished: bar.update(
                                                 k + (done / total if total else 0)))
                finished += 1
                bar.update(finished)
                headlines[bench] = summary["headline"]
                scores.setdefault(label, {}).setdefault(bench, {})[name] = summary[summary["headline"]]
                exact.setdefault(label, {}).setdefault(bench, {})[name] = summary["exact_match"]
                plotted.setdefault(label, {}).setdefault(bench, {})[name], axis[bench] = plot_value(summary)
                log(f"{label} {bench} {name}: {summary['headline']} {summary[summary['headline']]:.4g}, "
                    f"exact {summary['exact_match']:.1%}")
        del model
    bar.close()
    best = best_settings(scores, token_pixels)
    result = {"token_pixels": token_pixels, "grid": [list(p) for p in grid], "headlines": headlines,
              "scores": scores, "exact_match": exact, "best": best}
    write_json(out / "results.json", result)
    write_json(out / "best.json", best)
    (out / "results.md").write_text(results_table(scores, headlines))
    for bench in benches:
        box_plot(plotted, bench, axis[bench], out / f"boxplot_{bench}.png")
    return result


# Headlines that count hits out of OCRBench's 1000 items whatever the number scored (0-0.094 for 94 of 100 items)
OCRBENCH_HEADLINES = ("ocrbench_accuracy", "Final Score")


def plot_value(summary: dict[str, Any]) -> tuple[float, str]:
    """(the value a box plot shows, its axis label): the headline, except OCRBench's hits-per-1000, which is shown
    as the accuracy in percent of the items scored (hits / n), the unit of the reports' tables."""
    headline = summary["headline"]
    if headline in OCRBENCH_HEADLINES and "accuracy" in summary:
        return 100 * summary["accuracy"], "accuracy (% of the items)"
    return summary[headline], headline


def best_settings(scores: dict[str, dict[str, dict[str, float]]],
                  token_pixels: dict[str, int] | None = None) -> dict[str, Any]:
    """Per checkpoint and benchmark the best setting, and per benchmark the best (checkpoint, setting) overall.

    Where no setting is better than another (every score equal, e.g. all 0, or none a number) the entry names none:
    `setting` (and `checkpoint`, overall) is None and `no_best` says why, so a tie is never reported as a best."""
    per_ckpt: dict[str, dict[str, Any]] = {}
    overall: dict[str, dict[str, Any]] = {}
    for label, per_bench in scores.items():
        for bench, by_setting in per_bench.items():
            name, score, why = _top(by_setting, f"{len(by_setting)} settings")
            entry = {"setting": name, **_pixels(name, (token_pixels or {}).get(label, TOKEN_PIXELS)), "score": score}
            per_ckpt.setdefault(label, {})[bench] = {**entry, "no_best": why} if why else entry
    for bench in dict.fromkeys(b for per in scores.values() for b in per):
        cells = {(label, name): v for label, per in scores.items() for name, v in per.get(bench, {}).items()}
        key, score, why = _top(cells, f"{len(cells)} (checkpoint, setting) pairs")
        if key is None:
            overall[bench] = {"checkpoint": None, "setting": None, **_pixels(None), "score": score, "no_best": why}
        else:  # the checkpoint's own best entry (setting None when its own settings all tie)
            overall[bench] = {"checkpoint": key[0], **per_ckpt[key[0]][bench]}
    return {"per_checkpoint": per_ckpt, "overall": overall}


def _top(by_key: dict[Any, float], what: str) -> tuple[Any, float, str | None]:
    """(key of the highest score: the first of equal ones, in grid order; that score; None), or (None, the common
    score, why) when every score is equal or none is a number: then no setting is better than another."""
    numbers = {k: v for k, v in by_key.items() if not math.isnan(v)}
    if len(set(numbers.values())) > 1:
        key = max(numbers, key=lambda k: numbers[k])  # max() keeps the first of equal scores
        return key, numbers[key], None
    score = next(iter(numbers.values()), math.nan)
    if not numbers:
        return None, score, f"none of the {what} has a score: no setting is better"
    if len(numbers) == len(by_key):
        return None, score, f"every one of the {what} scores {score:.4g}: no setting is better"
    return None, score, (f"{len(by_key) - len(numbers)} of the {what} have no score, the others all score "
                         f"{score:.4g}: no setting is better")


def best_lines(best: dict[str, Any]) -> list[str]:
    """The search's printed summary: per benchmark the best checkpoint and setting, or why there is none."""
    lines = []
    for bench, b in best["overall"].items():
        if b["checkpoint"] is None:
            lines.append(f"no best setting for {bench}: {b['no_best']}")
        elif b["setting"] is None:
            lines.append(f"best for {bench}: {b['checkpoint']} ({b['score']:.4g}) at any setting: {b['no_best']}")
        else:
            lines.append(f"best for {bench}: {b['checkpoint']} at min_pixels={b['min_pixels']} "
                         f"max_pixels={b['max_pixels']} ({b['score']:.4g})")
    return lines


def _pixels(name: str | None, unit: int = TOKEN_PIXELS) -> dict[str, int | None]:
    """A setting's pixel limits for a checkpoint whose merged token covers `unit` pixels."""
    if name is None:
        return {"min_pixels": None, "max_pixels": None}
    lo, hi = name.removeprefix("min").split("_max")
    return {"min_pixels": int(lo) * unit, "max_pixels": int(hi) * unit}


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
            top = max(row.values(), default=None) if len(set(row.values())) > 1 else None  # all equal: none bold
            cells = [(f"**{row[s]:.4g}**" if row[s] == top else f"{row[s]:.4g}") if s in row else "" for s in settings]
            parts.append(f"| {label} | " + " | ".join(cells) + " |")
        parts.append("")
    return "\n".join(parts)


def box_plot(scores: dict[str, dict[str, dict[str, float]]], bench: str, metric: str, path: Path) -> Path | None:
    """The paper's Figure 4: one box per checkpoint of its scores across the resolution settings, saved as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional (extra `plots`)
        return None
    fig = box_plot_figure(scores, bench, metric)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


MEDIAN_COLOR, MEAN_COLOR, POINT_COLOR = "#d62728", "#2ca02c", "#555555"


def box_plot_figure(scores: dict[str, dict[str, dict[str, float]]], bench: str, metric: str):
    """The box plot as a matplotlib Figure: boxes, each setting's score as a dot, a legend for the median, mean and
    dots beside the axes, and a note instead of a spread when every score is the same."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    labels = [label for label in scores if bench in scores[label]]
    data = [[v for v in scores[label][bench].values() if not math.isnan(v)] for label in labels]
    fig, ax = plt.subplots(figsize=(3.2 + 1.1 * len(labels), 3.8))
    ax.boxplot(data, showmeans=True, medianprops={"color": MEDIAN_COLOR},
               meanprops={"marker": "^", "markerfacecolor": MEAN_COLOR, "markeredgecolor": MEAN_COLOR})
    ax.set_xticks(range(1, len(labels) + 1), labels, rotation=20)
    for i, values in enumerate(data, start=1):  # the settings themselves, so a 2-setting box is still readable
        ax.scatter([i] * len(values), values, s=12, alpha=0.6, color=POINT_COLOR, zorder=3)
    values = [v for vs in data for v in vs]
    if values and min(values) == max(values):  # a flat line on the axis would read as "no data"
        pad = max(abs(values[0]) * 0.1, 0.05)
        ax.set_ylim(values[0] - pad, values[0] + pad)
        ax.text(0.5, 0.75, f"every setting of every checkpoint scores {values[0]:.4g}:\nno setting is better",
                transform=ax.transAxes, ha="center", va="center", fontsize=9)
    ax.set_xlabel("checkpoint")
    ax.set_ylabel(metric)
    ax.set_title(f"{bench}: {metric} across the\n(min, max) pixel settings of the grid", fontsize=10)
    handles = [Line2D([], [], color=MEDIAN_COLOR, label="median"),
               Line2D([], [], marker="^", linestyle="", color=MEAN_COLOR, label="mean"),
               Line2D([], [], marker="o", linestyle="", color=POINT_COLOR, alpha=0.6, label="one setting")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
