"""The ablation's statistics against independent references: scipy's Student t, hand-computed intervals, and
verdicts on per-seed scores built by hand."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from mindvl.ablate.analysis import analyse
from mindvl.ablate.report import legibility_line
from mindvl.ablate.stats import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    SUPPORTED,
    bootstrap_ci,
    claim_verdict,
    comparison_verdict,
    mean_std,
    paired_ci,
    t_quantile,
)


def test_t_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 31):
        assert t_quantile(df) == pytest.approx(stats.t.ppf(0.975, df), abs=6e-4), df
    with pytest.raises(ValueError, match="at least 2"):
        t_quantile(0)


def test_paired_ci_is_the_t_interval_of_the_differences():
    a, b = [0.72, 0.75, 0.70, 0.80], [0.70, 0.71, 0.69, 0.74]
    d = [x - y for x, y in zip(a, b, strict=True)]  # 0.02, 0.04, 0.01, 0.06
    half = 3.182 * statistics.stdev(d) / math.sqrt(4)
    ci = paired_ci(a, b)
    assert ci.mean == pytest.approx(statistics.mean(d))
    assert (ci.low, ci.high) == pytest.approx((statistics.mean(d) - half, statistics.mean(d) + half))
    stats = pytest.importorskip("scipy.stats")
    low, high = stats.ttest_rel(a, b).confidence_interval(0.95)
    assert (ci.low, ci.high) == pytest.approx((low, high), abs=1e-4)
    one = paired_ci([0.5], [0.4])
    assert one.low is None and one.mean == pytest.approx(0.1) and comparison_verdict(one) == INCONCLUSIVE


def test_mean_std_uses_the_sample_deviation():
    assert mean_std([0.7, 0.72, 0.68]) == pytest.approx((0.7, statistics.stdev([0.7, 0.72, 0.68])))
    assert mean_std([0.3]) == (0.3, None)


def test_bootstrap_over_items():
    rng = np.random.default_rng(0)
    a = (rng.random((3, 50)) < 0.6).astype(float)
    same = bootstrap_ci(a, a)
    assert (same.mean, same.low, same.high) == (0.0, 0.0, 0.0)
    # b is a with 10 of 50 items flipped from right to wrong: every resample's difference lies in [0, 1].
    b = a.copy()
    wrong = np.flatnonzero(a.min(axis=0) == 1)[:10]
    b[:, wrong] = 0.0
    ci = bootstrap_ci(a, b)
    assert ci.mean == pytest.approx(len(wrong) / 50)
    assert 0 <= ci.low < ci.mean < ci.high <= 1
    assert bootstrap_ci(a, b).to_dict() == ci.to_dict()  # seeded: the same interval every time
    with pytest.raises(ValueError, match="one shape"):
        bootstrap_ci(a, b[:, :10])


def test_verdict_rules():
    from mindvl.ablate.stats import Interval

    assert comparison_verdict(Interval(0.05, 0.01, 0.09, 3)) == SUPPORTED
    assert comparison_verdict(Interval(-0.05, -0.09, -0.01, 3)) == NOT_SUPPORTED
    assert comparison_verdict(Interval(0.01, -0.02, 0.04, 3)) == INCONCLUSIVE
    assert comparison_verdict(Interval(0.0, 0.0, 0.0, 3)) == NOT_SUPPORTED  # equal in every seed: not higher
    # ">=" within a 2-point margin: a small, certain deficit is still "no worse", a clear one is not.
    assert comparison_verdict(Interval(-0.005, -0.01, 0.0, 3), ">=", 0.02) == SUPPORTED
    assert comparison_verdict(Interval(-0.05, -0.08, -0.03, 3), ">=", 0.02) == NOT_SUPPORTED
    assert comparison_verdict(Interval(0.0, -0.05, 0.05, 3), ">=", 0.02) == INCONCLUSIVE
    assert claim_verdict([SUPPORTED, SUPPORTED]) == SUPPORTED
    assert claim_verdict([SUPPORTED, INCONCLUSIVE]) == INCONCLUSIVE
    assert claim_verdict([SUPPORTED, INCONCLUSIVE, NOT_SUPPORTED]) == NOT_SUPPORTED


def _seed(seed: int, merged_hits: int, sft_hits: dict[str, int], n: int = 20) -> dict:
    """One seed's scores: `hits` right answers out of n OCR items (the first ones), nothing else right."""
    def score(hits: int) -> dict:
        return {"items": {"ocrbench": [1.0] * hits + [0.0] * (n - hits), "chartqa": [0.0] * n,
                          "docvqa": [0.0] * n}, "text": [0.0] * n}
    scores = {name: score(h) for name, h in sft_hits.items()} | {"merged": score(merged_hits)}
    return {"seed": seed, "scores": scores, "training": {"multitask": {"steps": 5, "first_loss": 5.0, "last_loss": 1.0,
                                                        "seconds": 2.0}}, "eval_seconds": 1.0}


def test_merge_claim_numbers_and_verdicts():
    seeds = [_seed(0, 15, {"sft-512": 10, "sft-1024": 12, "sft-2048": 11}),
             _seed(1, 16, {"sft-512": 11, "sft-1024": 12, "sft-2048": 13}),
             _seed(2, 14, {"sft-512": 9, "sft-1024": 11, "sft-2048": 12})]
    claim = analyse(["merge"], seeds)["claims"]["merge"]
    merged = claim["variants"]["merged"]["metrics"]["ocrbench"]
    assert merged["values"] == [0.75, 0.8, 0.7] and merged["std"] == pytest.approx(0.05)
    assert claim["metric"] == "overall" and claim["variants"]["merged"]["metrics"]["overall"]["values"] == \
        pytest.approx([0.25, 16 / 60, 14 / 60])
    cmp = {c["other"]: c for c in claim["comparisons"]}
    # On overall (the 60 items of the three benchmarks), merged - sft-1024 per seed: 3/60, 4/60, 3/60; t(2) = 4.303
    d = [3 / 60, 4 / 60, 3 / 60]
    half = 4.303 * statistics.stdev(d) / math.sqrt(3)
    assert cmp["sft-1024"]["seed_ci"]["mean"] == pytest.approx(statistics.mean(d))
    assert cmp["sft-1024"]["seed_ci"]["low"] == pytest.approx(statistics.mean(d) - half)
    assert all(c["verdict"] == SUPPORTED for c in claim["comparisons"]) and claim["verdict"] == SUPPORTED
    # One seed where an SFT model wins by far makes the interval straddle 0: inconclusive, not supported.
    seeds[2] = _seed(2, 8, {"sft-512": 9, "sft-1024": 11, "sft-2048": 18})
    assert analyse(["merge"], seeds)["claims"]["merge"]["verdict"] == INCONCLUSIVE
    no_verdict = analyse(["merge"], seeds[:1], verdicts=False)["claims"]["merge"]
    assert no_verdict["verdict"] is None and no_verdict["comparisons"][0]["seed_ci"]["low"] is None


def _grid_seed(seed: int, grid: dict[str, dict[str, float]]) -> dict:
    """One seed of claim 2: every model's `grid` (bench -> setting -> exact match) and 10 items per benchmark."""
    scores = {name: {"items": {b: [0.0] * 10 for b in ("ocrbench", "chartqa", "docvqa")}, "text": [0.0] * 10,
                     "grid": grid[name]} for name in grid}
    return {"seed": seed, "scores": scores, "training": {}, "eval_seconds": 1.0}


def test_legible_settings_flag_a_grid_nobody_reads():
    # DocVQA: native read 0.8 by the best model; "up" read 0.3 by one model (>= 0.25 x 0.8: legible); "down" at most
    # 0.1 (the prior: illegible). ChartQA: the best score anywhere is 0.4, at "down" (0.12 >= 0.1 at native too).
    def grid(native: float, up: float, down: float, chart_down: float) -> dict[str, dict[str, float]]:
        return {"docvqa": {"down": down, "native": native, "up": up},
                "chartqa": {"down": chart_down, "native": 0.12, "up": 0.05}}

    models = {"sft-512": grid(0.5, 0.1, 0.1, 0.4), "sft-1024": grid(0.8, 0.3, 0.05, 0.2),
              "sft-2048": grid(0.7, 0.1, 0.0, 0.1), "merged": grid(0.75, 0.2, 0.1, 0.3)}
    claim = analyse(["resolution"], [_grid_seed(0, models), _grid_seed(1, models)])["claims"]["resolution"]
    assert claim["legible"] == {"docvqa": ["native", "up"], "chartqa": ["down", "native"]}
    line = legibility_line(claim)
    assert "docvqa 2 of 3 (native, up)" in line and "answer priors" not in line
    models = {name: {**g, "docvqa": {**g["docvqa"], "up": 0.1}} for name, g in models.items()}
    claim = analyse(["resolution"], [_grid_seed(0, models), _grid_seed(1, models)])["claims"]["resolution"]
    assert claim["legible"]["docvqa"] == ["native"] and "answer priors" in legibility_line(claim)
