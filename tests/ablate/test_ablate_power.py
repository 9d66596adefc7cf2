"""The ablation's power numbers (issue 29): the smallest detectable difference is the one a paired t test finds with
about 80% power (checked against the noncentral t), the seeds a target interval needs, the within-seed item noise,
and how they reach the analysis and the report next to the paper's differences."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from mindvl.ablate.analysis import analyse
from mindvl.ablate.report import power_section
from mindvl.ablate.stats import detectable_difference, half_width, item_noise, seeds_for, t80_quantile, t_quantile


def test_t80_quantiles_match_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in range(1, 31):
        assert t80_quantile(df) == pytest.approx(stats.t.ppf(0.80, df), abs=6e-4), df


def test_detectable_difference_has_80_percent_power():
    stats = pytest.importorskip("scipy.stats")
    for n in range(3, 12):
        d = detectable_difference(2.0, n)
        df, t = n - 1, t_quantile(n - 1)
        nc = d / (2.0 / math.sqrt(n))  # the true mean difference in standard errors
        power = 1 - stats.nct.cdf(t, df, nc) + stats.nct.cdf(-t, df, nc)
        assert 0.76 <= power <= 0.81, (n, power)


def test_seeds_for_a_target_half_width():
    # sd 0.02: n=2 gives 12.706 * 0.02 / 1.414 = 0.18, ..., n=4: 3.182 * 0.01 = 0.0318, n=5: 2.776 * 0.02 / 2.236.
    assert half_width(0.02, 4) == pytest.approx(0.03182)
    assert seeds_for(0.02, 0.03) == 5
    assert seeds_for(0.0, 0.03) == 2
    assert seeds_for(1.0, 0.03, max_seeds=10) is None


def test_item_noise_is_the_within_seed_standard_error():
    a = np.array([[1, 1, 0, 0, 1, 0], [1, 0, 1, 1, 0, 0]], dtype=float)
    b = np.array([[0, 1, 0, 1, 1, 0], [1, 1, 1, 0, 0, 0]], dtype=float)
    per_seed = [statistics.variance(list(a[s] - b[s])) / 6 for s in range(2)]
    assert item_noise(a, b) == pytest.approx(math.sqrt(sum(per_seed) / 2))


def _seed(seed: int, ocr: dict[str, int], chart: dict[str, int], n: int = 20) -> dict:
    def score(label: str) -> dict:
        return {"items": {"ocrbench": [1.0] * ocr[label] + [0.0] * (n - ocr[label]),
                          "chartqa": [1.0] * chart[label] + [0.0] * (n - chart[label]), "docvqa": [0.0] * n},
                "text": [0.0] * n}
    return {"seed": seed, "scores": {label: score(label) for label in ocr}, "training": {}, "eval_seconds": 1.0}


def test_power_and_overall_reach_the_analysis_and_report():
    labels = ("sft-512", "sft-1024", "sft-2048", "merged")
    seeds = [_seed(0, dict(zip(labels, (10, 12, 11, 15), strict=True)), dict(zip(labels, (4, 5, 6, 8), strict=True))),
             _seed(1, dict(zip(labels, (11, 12, 13, 16), strict=True)), dict(zip(labels, (5, 5, 5, 6), strict=True))),
             _seed(2, dict(zip(labels, (9, 11, 12, 14), strict=True)), dict(zip(labels, (6, 4, 5, 7), strict=True)))]
    claim = analyse(["merge"], seeds)["claims"]["merge"]
    # overall = the mean of the three benchmarks (equal item counts): seed 0's merged = (15 + 8 + 0) / 60.
    assert claim["variants"]["merged"]["metrics"]["overall"]["values"][0] == pytest.approx(23 / 60)
    # The verdict is on overall (Table 6's headline column): merged - sft-1024 per seed over the 60 items.
    primary = {c["other"]: c for c in claim["comparisons"]}
    p = primary["sft-1024"]["power"]
    d = [(23 - 17) / 60, (22 - 17) / 60, (21 - 15) / 60]
    assert primary["sft-1024"]["metric"] == "overall"
    assert p["seed_sd"] == pytest.approx(statistics.stdev(d))
    assert p["half_width"] == pytest.approx(4.303 * statistics.stdev(d) / math.sqrt(3), rel=1e-3)
    assert p["detectable"] == pytest.approx((4.303 + 1.061) * statistics.stdev(d) / math.sqrt(3), rel=1e-3)
    assert p["paper"] == pytest.approx(0.007)  # Table 6: 86.5 - 85.8 overall
    items = [np.array([sum((s["scores"][label]["items"][b] for b in ("ocrbench", "chartqa", "docvqa")), [])
                       for s in seeds]) for label in ("merged", "sft-1024")]
    assert p["item_se"] == pytest.approx(item_noise(*items))
    # Each benchmark beside it, OCRBench with the paper's own difference.
    secondary = {(c["metric"], c["other"]): c for c in claim["secondary"]}
    assert set(secondary) == {(m, o) for m in ("ocrbench", "chartqa", "docvqa") for o in labels[:3]}
    ocr = secondary[("ocrbench", "sft-1024")]
    assert ocr["seed_ci"]["mean"] == pytest.approx(statistics.mean([0.15, 0.2, 0.15]))
    assert ocr["power"]["paper"] == pytest.approx(0.003)  # Table 6: 87.6 - 87.3 on OCRBench
    ia = np.array([s["scores"]["merged"]["items"]["ocrbench"] for s in seeds])
    ib = np.array([s["scores"]["sft-1024"]["items"]["ocrbench"] for s in seeds])
    assert ocr["power"]["item_se"] == pytest.approx(item_noise(ia, ib))
    assert secondary[("docvqa", "sft-512")]["verdict"]
    table = "\n".join(power_section(claim))
    assert "| merged > sft-1024 (ocrbench) | +0.3 | +16.7 |" in table and "Table 6" in table
    assert "| merged > sft-2048 (overall) | +1.2 | +7.8 |" in table  # (6 + 4 + 4) / 3 / 60
    one_seed = analyse(["merge"], seeds[:1], verdicts=False)["claims"]["merge"]
    assert power_section(one_seed) == ["Power: needs 2 or more seeds.", ""]


def test_report_sets_detectable_beside_the_paper(tmp_path):
    from mindvl.ablate.report import write_report

    labels = ("sft-512", "sft-1024", "sft-2048", "merged")
    chart = dict(zip(labels, (4, 5, 6, 8), strict=True))
    seeds = [_seed(s, dict(zip(labels, (10, 12, 11, 15 + s), strict=True)), chart) for s in range(3)]
    analysis = analyse(["merge"], seeds)
    analysis["config"] = {"claims": ["merge"], "scale": "custom", "steps": {}, "bench_items": 20, "grid": "4:64",
                          "overrides": []}
    analysis["seconds"] = 1.0
    report = write_report(tmp_path, analysis).read_text()
    row = next(line for line in report.splitlines() if line.startswith("| merge |"))
    detectable = [analysis["claims"]["merge"]["comparisons"][i]["power"]["detectable"] for i in range(3)]
    assert row == (f"| merge | supported | overall | {', '.join(f'{100 * d:.1f}' for d in detectable)} | "
                   "+1.2, +0.7, +1.2 |")
    assert "| comparison | paper | this run | seed sd | item se |" in report
