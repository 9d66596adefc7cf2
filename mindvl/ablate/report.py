"""OUT/report.md and its plots from the analysis: per claim the variants' mean ± std over seeds, the claimed paired
differences with their intervals, and the verdict; per-seed score plots, Figure-4-style box plots for claim 2, and
the training losses that show every variant trained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mindvl.eval.resolution_search import box_plot
from mindvl.quickstart import pyplot

from .analysis import LEGIBLE_FRACTION, METRICS


def _pct(mean: float, std: float | None) -> str:
    return f"{100 * mean:.1f}" + (f" ± {100 * std:.1f}" if std is not None else "")


def _ci(ci: dict[str, Any] | None) -> str:
    if ci is None:
        return "—"
    if ci["low"] is None:
        return f"{100 * ci['mean']:+.1f} (one seed: no interval)"
    return f"{100 * ci['mean']:+.1f} [{100 * ci['low']:+.1f}, {100 * ci['high']:+.1f}]"


def claim_section(name: str, claim: dict[str, Any], plots: list[Path], out: Path) -> list[str]:
    verdict = claim["verdict"] or "no verdict (one-seed trial)"
    lines = [f"## {name}: {verdict}", "", f"*Claim:* {claim['statement']}", "",
             f"Exact match in %, mean ± std over {len(claim['seeds'])} seed(s) "
             f"({', '.join(str(s) for s in claim['seeds'])}), at the training resolution:", "",
             "| variant | model | " + " | ".join(METRICS) + " |", "|" + " --- |" * (2 + len(METRICS))]
    for vname, v in claim["variants"].items():
        cells = [_pct(v["metrics"][m]["mean"], v["metrics"][m]["std"]) for m in METRICS]
        lines.append(f"| {vname} | {v['model']} | " + " | ".join(cells) + " |")
    if claim["grid"]:
        benches = list(next(iter(claim["variants"].values()))["grid"])
        lines += ["", "Over the resolution grid (every (min_pixels, max_pixels) setting), min / median / max exact "
                  "match in %, mean ± std over seeds:", "",
                  "| variant | " + " | ".join(benches) + " |", "|" + " --- |" * (1 + len(benches))]
        for vname, v in claim["variants"].items():
            cells = [" / ".join(_pct(v["grid"][b][s]["mean"], v["grid"][b][s]["std"]) for s in ("min", "median",
                                                                                              "max"))
                     for b in benches]
            lines.append(f"| {vname} | " + " | ".join(cells) + " |")
        lines += ["", legibility_line(claim)]
    lines += ["", "Paired differences (points of exact match; 95% interval over seeds, and over items by bootstrap "
              "as a second view):", "", "| comparison | over seeds | over items | verdict |",
              "| --- | --- | --- | --- |"]
    for c in [*claim["comparisons"], *claim["secondary"]]:
        extra = "" if c in claim["comparisons"] else " (not part of the verdict)"
        margin = f", margin {100 * c['margin']:.0f} pp" if c["relation"] == ">=" else ""
        lines.append(f"| {c['comparison']}{margin} | {_ci(c['seed_ci'])} | {_ci(c['item_ci'])} | "
                     f"{(c['verdict'] or '—')}{extra} |")
    lines.append("")
    lines += power_section(claim)
    lines += [f"![{p.stem}]({p.relative_to(out)})" for p in plots]
    return [*lines, ""]


def _grid_size(claim: dict[str, Any]) -> int:
    """How many (min_pixels, max_pixels) settings the claim's grid has."""
    return len(next(iter(claim["variants"].values()))["settings"][claim["metric"]])


def legibility_line(claim: dict[str, Any]) -> str:
    """Which grid settings any model reads, so a minimum or median over settings nobody reads (the answer prior) is
    not taken for robustness."""
    n = _grid_size(claim)
    parts = [f"{bench} {len(sts)} of {n} ({', '.join(sts) or 'none'})" for bench, sts in claim["legible"].items()]
    warn = ("" if all(len(sts) > n // 2 for sts in claim["legible"].values()) else
            " Where half the settings or more are illegible, the minimum and median compare the models' answer "
            "priors, not their robustness: read this claim's verdict with that in mind.")
    return (f"Legible settings (some model reads at least {LEGIBLE_FRACTION:.0%} of the best score there): "
            + "; ".join(parts) + "." + warn)


def _pts(x: float | None, sign: bool = False) -> str:
    return "—" if x is None else (f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}")


def _n(x: int | None) -> str:
    return "> 100" if x is None else str(x)


def power_section(claim: dict[str, Any]) -> list[str]:
    """Per comparison: the smallest difference this run could detect next to the paper's, and the seeds a 3-point
    interval would take (issue 29)."""
    rows = [*claim["comparisons"], *claim["secondary"]]
    if not rows or rows[0]["power"]["seed_sd"] is None:
        return ["Power: needs 2 or more seeds.", ""]
    target = 100 * rows[0]["power"]["target"]
    lines = [f"Power (points): *detectable* is the smallest true difference this run finds with 80% power (paired t "
             f"over {rows[0]['power']['n']} seeds, two-sided 5%), from the per-seed differences' sd; *item se* is the "
             "part of one seed's difference the finite test set alone makes. The paper's difference: "
             f"{claim.get('paper_source') or 'not given'}. Seeds for a ±{target:.0f}-point interval at this sd, and "
             "with 4x the items (only the item part shrinks):", "",
             "| comparison | paper | this run | seed sd | item se | ± now | detectable | seeds for "
             f"±{target:.0f} | with 4x items |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in rows:
        p = c["power"]
        lines.append(f"| {c['comparison']} | {_pts(p['paper'], True)} | {_pts(c['seed_ci']['mean'], True)} | "
                     f"{_pts(p['seed_sd'])} | {_pts(p['item_se'])} | {_pts(p['half_width'])} | "
                     f"{_pts(p['detectable'])} | {_n(p['seeds_for_target'])} | "
                     f"{'—' if p['item_se'] is None else _n(p['seeds_for_target_4x_items'])} |")
    return [*lines, ""]


def vision_line(vision: str | dict[str, Any]) -> str:
    """Where every seed's vision tower started (runner.prepare_tower's record)."""
    if vision == "random":
        return ("Vision tower: each seed's own seeded init (`--vision-tower random`): no pretrained ViT, unlike the "
                "paper's.")
    if vision.get("source") != "trained":
        return f"Vision tower: taken from `{vision['final']}` into every seed's base LLM."
    seconds = sum(t["seconds"] for t in vision["training"].values())
    return (f"Vision tower: pretrained, as the paper's: the tower of one `{vision['stage']}` chain at seed "
            f"{vision['seed']} (steps {vision['steps']}; {seconds:.0f} s when trained), transplanted into every "
            f"seed's base LLM with a fresh projector. It reads ChartQA {100 * vision['reads']['chartqa']:.1f}% and "
            f"DocVQA {100 * vision['reads']['docvqa']:.1f}% at the training resolution.")


def write_report(out: Path, analysis: dict[str, Any]) -> Path:
    cfg = analysis["config"]
    n = analysis["seeds"]
    lines = ["# mindvl ablation report", "",
             f"Claims {', '.join(cfg['claims'])}; {n} seed(s); scale `{cfg['scale']}` (steps {cfg['steps']}); "
             f"{cfg['bench_items']} held-out items per benchmark; grid `{cfg['grid']}` (x 28 x 28 pixels)"
             + (f"; overrides {cfg['overrides']}" if cfg["overrides"] else "") + ". "
             + ("A report of the claims finished so far (`--report-only`)." if cfg.get("report_only") else
                f"Whole run {analysis['seconds']} s (reused runs count their original time below, not here)."),
             "", vision_line(cfg.get("vision", "random")), "",
             "Verdicts: *supported* when the 95% interval over seeds of every claimed difference lies above 0 (for "
             "\">=\": above minus the margin), *not supported* when one lies wholly at or below 0 (for \">=\": "
             "below 0), else *inconclusive* at this scale. *Detectable*: the smallest true difference each claimed "
             "comparison would detect with 80% power at this run's seed spread (the Power tables below), beside the "
             "paper's own differences.", "",
             "| claim | verdict | on | detectable (points) | paper (points) |", "| --- | --- | --- | --- | --- |"]
    for name, claim in analysis["claims"].items():
        power = [c["power"] for c in claim["comparisons"]]
        detectable = ", ".join(_pts(p["detectable"]) for p in power)
        paper = ", ".join(_pts(p["paper"], True) for p in power)
        on = claim["metric"]
        if claim["grid"]:
            on += f" over the grid ({len(claim['legible'][claim['metric']])} of {_grid_size(claim)} settings legible)"
        lines.append(f"| {name} | {claim['verdict'] or '—'} | {on} | {detectable} | {paper} |")
    lines.append("")
    for name, claim in analysis["claims"].items():
        plots = [p for p in (plot_claim(out, name, claim),) if p is not None]
        if claim["grid"]:
            # Figure 4: one box per model over the grid's settings (each setting's score averaged over seeds).
            settings = {v: entry["settings"] for v, entry in claim["variants"].items()}
            plots += [p for p in (box_plot(settings, b, "exact match (mean over seeds)",
                                           out / f"{name}_boxplot_{b}.png")
                                  for b in next(iter(settings.values()))) if p is not None]
        lines += claim_section(name, claim, plots, out)
    lines += ["## Training (every variant trained)", "",
              "Mean loss over the first and the last tenth of each run's steps (single packs are noisy), averaged "
              "over seeds, and each seed's wall time.", "",
              "| stage | steps | loss, first tenth | loss, last tenth | seconds per seed |",
              "| --- | --- | --- | --- | --- |"]
    for stage, t in analysis["training"].items():
        start, end = (t.get("loss_start", t["first_loss"]), t.get("loss_end", t["last_loss"]))
        lines.append(f"| {stage} | {t['steps']} | {sum(start) / len(start):.3f} | {sum(end) / len(end):.3f} | "
                     f"{', '.join(f'{s:.0f}' for s in t['seconds'])} |")
    lines += ["", f"Evaluation seconds per seed: {', '.join(f'{s:.0f}' for s in analysis['eval_seconds'])}.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def plot_claim(out: Path, name: str, claim: dict[str, Any]) -> Path | None:
    """The claim's metric per variant: one point per seed and the mean with its std."""
    plt = pyplot()
    if plt is None:
        return None
    metric = claim["metric"]
    names = list(claim["variants"])
    fig, ax = plt.subplots(figsize=(1.8 + 1.1 * len(names), 3.6))
    for i, vname in enumerate(names):
        m = claim["variants"][vname]["metrics"][metric]
        ax.scatter([i] * len(m["values"]), m["values"], s=18, alpha=0.7)
        ax.errorbar([i + 0.15], [m["mean"]], yerr=[m["std"] or 0.0], fmt="o", color="black", capsize=4)
    ax.set_xticks(range(len(names)), names, rotation=15)
    ax.set_ylabel(f"{metric} exact match")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{name}: per seed (dots), mean ± std (black)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
