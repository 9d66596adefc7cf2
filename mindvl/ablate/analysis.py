"""Turn per-seed scores into the ablation's numbers: per variant mean and spread over seeds, the claimed paired
differences with intervals (over seeds; over items as a second view) and a verdict per claim.

Input: a list (one entry per seed) of `runner.run_seed` results, whose `scores[label]` hold per-item exact matches
at the training resolution (`items[bench]`), the text probe's (`text`) and, for claim 2's models, the exact match at
every setting of the resolution grid (`grid[bench][setting]`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .plan import BENCHES, CLAIMS, GRID_STATS, Claim, Comparison
from .stats import (
    bootstrap_ci,
    claim_verdict,
    comparison_verdict,
    detectable_difference,
    half_width,
    item_noise,
    mean_std,
    paired_ci,
    seeds_for,
)

# Exact match on each synthetic benchmark, their mean (`overall`: the paper's Overall column, over equal item counts
# the mean of the three), and the text probe.
METRICS = (*BENCHES, "overall", "text")
POWER_TARGET = 0.03  # the half-width (3 points) the seed-count suggestion aims at (issue 29)
_STAT = {"min": np.min, "median": np.median, "max": np.max}


def item_vector(score: dict[str, Any], metric: str) -> list[float]:
    if metric == "overall":  # the three benchmarks' items one after the other: its mean weighs each by its items
        return [x for b in BENCHES for x in score["items"][b]]
    return score["text"] if metric == "text" else score["items"][metric]


def value(score: dict[str, Any], metric: str, stat: str | None = None) -> float:
    """One model's (one seed's) number: mean exact match on `metric`, or `stat` of it over the grid's settings."""
    if stat is not None:
        return float(_STAT[stat](list(score["grid"][metric].values())))
    return float(np.mean(item_vector(score, metric)))


def _summary(values: list[float]) -> dict[str, Any]:
    mean, std = mean_std(values)
    return {"values": values, "mean": mean, "std": std}


def compare(claim: Claim, cmp: Comparison, per_seed: list[dict[str, Any]], verdicts: bool) -> dict[str, Any]:
    metric = cmp.metric or claim.metric
    better, other = claim.variants[cmp.better], claim.variants[cmp.other]
    a = [value(s["scores"][better], metric, cmp.stat) for s in per_seed]
    b = [value(s["scores"][other], metric, cmp.stat) for s in per_seed]
    seed_ci = paired_ci(a, b)
    item_ci, item_se = None, None
    if cmp.stat is None:  # a min/median/max over settings has no per-item form
        ia = np.array([item_vector(s["scores"][better], metric) for s in per_seed])
        ib = np.array([item_vector(s["scores"][other], metric) for s in per_seed])
        item_ci = bootstrap_ci(ia, ib).to_dict()
        item_se = item_noise(ia, ib) if ia.shape[1] > 1 else None
    return {"comparison": cmp.label(claim.metric), "better": cmp.better, "other": cmp.other, "metric": metric,
            "stat": cmp.stat, "relation": cmp.relation, "margin": cmp.margin, "seed_ci": seed_ci.to_dict(),
            "item_ci": item_ci, "verdict": comparison_verdict(seed_ci, cmp.relation, cmp.margin) if verdicts else None,
            "power": power(a, b, item_se, cmp.paper)}


def power(a: list[float], b: list[float], item_se: float | None, paper: float | None) -> dict[str, Any]:
    """What the run could resolve for one comparison: the per-seed differences' sd (`seed_sd`), the part of it the
    finite test set alone makes (`item_se`: within-seed standard error over items), the interval's half-width, the
    smallest true difference detected with 80% power (`detectable`), and the seeds a 3-point half-width needs at
    this sd (`seeds_for_target`) and with 4x the items (`seeds_for_target_4x_items`: only the item part shrinks)."""
    n = len(a)
    out: dict[str, Any] = {"n": n, "paper": paper, "item_se": item_se, "seed_sd": None, "half_width": None,
                           "detectable": None, "seeds_for_target": None, "seeds_for_target_4x_items": None,
                           "target": POWER_TARGET}
    if n < 2:
        return out
    sd = float(np.std(np.asarray(a) - np.asarray(b), ddof=1))
    out.update(seed_sd=sd, half_width=half_width(sd, n), detectable=detectable_difference(sd, n),
               seeds_for_target=seeds_for(sd, POWER_TARGET))
    if item_se is not None:
        model_var = max(0.0, sd ** 2 - item_se ** 2)  # what another seed changes beyond the test set's noise
        out["seeds_for_target_4x_items"] = seeds_for(float(np.sqrt(model_var + item_se ** 2 / 4)), POWER_TARGET)
    return out


# A grid setting is legible where some model reads at least this fraction of the best score any model reaches on
# that benchmark (its training resolution, in practice). Where no model does, every model answers by the prior, so
# a minimum or median taken over such settings compares priors, not robustness (RESULTS, Testbed, session 11).
LEGIBLE_FRACTION = 0.25


def legible_settings(variants: dict[str, Any]) -> dict[str, list[str]]:
    """Per grid benchmark, the settings (in grid order) where the best model's seed-mean exact match is at least
    LEGIBLE_FRACTION of the best anywhere."""
    benches = next(iter(variants.values()))["settings"]
    out: dict[str, list[str]] = {}
    for bench, settings in benches.items():
        best_at = {st: max(v["settings"][bench][st] for v in variants.values()) for st in settings}
        top = max(best_at.values())
        out[bench] = [st for st, x in best_at.items() if top > 0 and x >= LEGIBLE_FRACTION * top]
    return out


def analyse_claim(claim: Claim, per_seed: list[dict[str, Any]], verdicts: bool) -> dict[str, Any]:
    variants: dict[str, Any] = {}
    for name, label in claim.variants.items():
        scores = [s["scores"][label] for s in per_seed]
        entry: dict[str, Any] = {"model": label, "metrics": {m: _summary([value(x, m) for x in scores])
                                                             for m in METRICS}}
        if claim.grid:
            entry["grid"] = {bench: {stat: _summary([value(x, bench, stat) for x in scores]) for stat in GRID_STATS}
                             for bench in scores[0]["grid"]}
            # Per setting, the seed-mean: what the box plots draw (one box per model over the grid's settings).
            entry["settings"] = {bench: {st: float(np.mean([x["grid"][bench][st] for x in scores]))
                                         for st in scores[0]["grid"][bench]} for bench in scores[0]["grid"]}
        variants[name] = entry
    comparisons = [compare(claim, c, per_seed, verdicts) for c in claim.comparisons]
    secondary = [compare(claim, c, per_seed, verdicts) for c in claim.secondary]
    verdict = claim_verdict([c["verdict"] for c in comparisons]) if verdicts else None
    return {"statement": claim.statement, "seeds": [s["seed"] for s in per_seed], "metric": claim.metric,
            "grid": claim.grid, "variants": variants, "legible": legible_settings(variants) if claim.grid else {},
            "comparisons": comparisons, "secondary": secondary, "verdict": verdict, "paper_source": claim.paper_source}


def analyse(claims: list[str], per_seed: list[dict[str, Any]], verdicts: bool = True) -> dict[str, Any]:
    """The whole analysis (what ablation.json holds, less its config). Each claim is analysed over the seeds that
    finished it (all of them, except in a report of a run still under way)."""
    training: dict[str, Any] = {}
    for s in per_seed:
        for stage, t in s["training"].items():
            keys = [k for k in ("first_loss", "last_loss", "loss_start", "loss_end", "seconds") if k in t]
            entry = training.setdefault(stage, {"steps": t["steps"], **{k: [] for k in keys}})
            for key in keys:
                entry[key].append(t[key])
    finished = {c: [s for s in per_seed if c in s.get("claims", claims)] for c in claims}
    return {"seeds": len(per_seed), "claims": {c: analyse_claim(CLAIMS[c], finished[c], verdicts) for c in claims},
            "training": training, "eval_seconds": [s["eval_seconds"] for s in per_seed]}
