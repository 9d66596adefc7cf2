"""Statistics for the ablation: spreads over seeds, paired differences with confidence intervals, verdicts.

    mean_std([0.7, 0.72, 0.68])                          -> (0.70, 0.02)
    paired_ci([0.72, 0.75, 0.70], [0.70, 0.71, 0.69])   -> Interval(mean, low, high, n) of the per-seed differences
    bootstrap_ci(a_items, b_items)                       -> Interval over items, resampled with seeds held fixed

The claims are about variants trained from the same seed (same init, same data order), so differences are paired by
seed and the seed-level interval is a Student t interval of the per-seed differences (n - 1 degrees of freedom). The
item bootstrap is a second view: it keeps the seeds fixed and resamples benchmark items (the same items for both
variants), so it shows how much of a difference the finite test set alone could produce, not seed-to-seed spread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

CONFIDENCE = 0.95
# Two-sided 95% Student t quantiles t_{0.975, df} for df = 1..30; above 30 the normal 1.96 is within 2%.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
# One-sided 80% Student t quantiles t_{0.80, df} for df = 1..30 (power 0.8); above 30 the normal 0.842.
_T80 = (1.376, 1.061, 0.978, 0.941, 0.920, 0.906, 0.896, 0.889, 0.883, 0.879, 0.876, 0.873, 0.870, 0.868, 0.866,
        0.865, 0.863, 0.862, 0.861, 0.860, 0.859, 0.858, 0.858, 0.857, 0.856, 0.856, 0.855, 0.855, 0.854, 0.854)
POWER = 0.80
BOOTSTRAP_RESAMPLES = 2000

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"


@dataclass
class Interval:
    """A mean difference and its 95% interval; low/high are None when it cannot be computed (one seed)."""

    mean: float
    low: float | None
    high: float | None
    n: int

    def to_dict(self) -> dict:
        return asdict(self)

    def text(self, percent: bool = True) -> str:
        f = (lambda x: f"{100 * x:+.1f}") if percent else (lambda x: f"{x:+.3g}")
        unit = " pp" if percent else ""
        if self.low is None or self.high is None:
            return f"{f(self.mean)}{unit} (no interval: n={self.n})"
        return f"{f(self.mean)}{unit} [{f(self.low)}, {f(self.high)}]"


def t_quantile(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t interval needs at least 2 paired values (df >= 1), got df={df}")
    return _T975[df - 1] if df <= len(_T975) else 1.96


def t80_quantile(df: int) -> float:
    if df < 1:
        raise ValueError(f"a t quantile needs df >= 1, got df={df}")
    return _T80[df - 1] if df <= len(_T80) else 0.842


def half_width(sd: float, n: int) -> float:
    """Half-width of the 95% t interval of a mean of n paired differences with sample sd `sd`."""
    return t_quantile(n - 1) * sd / math.sqrt(n)


def detectable_difference(sd: float, n: int) -> float:
    """The smallest true mean difference a paired t test over n seeds (two-sided 5%) finds with 80% power, for the
    per-seed differences' sd `sd`: (t_{0.975} + t_{0.80}) * sd / sqrt(n), with n - 1 degrees of freedom."""
    return (t_quantile(n - 1) + t80_quantile(n - 1)) * sd / math.sqrt(n)


def seeds_for(sd: float, target: float, max_seeds: int = 100) -> int | None:
    """The fewest seeds (>= 2) whose 95% interval's half-width is <= `target` at per-seed sd `sd`; None if more than
    `max_seeds` would be needed."""
    for n in range(2, max_seeds + 1):
        if half_width(sd, n) <= target:
            return n
    return None


def item_noise(a: np.ndarray, b: np.ndarray) -> float:
    """The part of one seed's difference that the finite test set alone makes: the standard error of mean(a - b)
    over items within a seed (per-item differences' variance / items), averaged over seeds as a variance.
    a, b: [seeds, items] per-item scores on the same items."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.ndim != 2 or d.shape[1] < 2:
        raise ValueError(f"item_noise needs [seeds, items>=2] arrays, got shape {d.shape}")
    return float(math.sqrt(np.mean(d.var(axis=1, ddof=1) / d.shape[1])))


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof 1; None for a single value)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("mean_std of no values")
    return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None)


def paired_ci(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean of a_i - b_i over seeds with its 95% Student t interval."""
    d = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    if d.ndim != 1 or len(a) != len(b) or d.size == 0:
        raise ValueError(f"paired_ci needs two equally long, non-empty lists, got {len(a)} and {len(b)}")
    mean = float(d.mean())
    if d.size < 2:
        return Interval(mean, None, None, int(d.size))
    half = half_width(float(d.std(ddof=1)), int(d.size))
    return Interval(mean, mean - half, mean + half, int(d.size))


def bootstrap_ci(a: np.ndarray, b: np.ndarray, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> Interval:
    """Percentile interval of mean(a - b) over items: a, b are [seeds, items] per-item scores on the same items;
    each resample draws items with replacement (the same draw for every seed and both variants)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if a.shape != b.shape or a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"bootstrap_ci needs two [seeds, items] arrays of one shape, got {a.shape} and {b.shape}")
    d = (a - b).mean(axis=0)  # per item, averaged over seeds: the item is the resampled unit
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, d.size, size=(resamples, d.size))
    means = d[idx].mean(axis=1)
    alpha = (1 - CONFIDENCE) / 2
    return Interval(float(d.mean()), float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha)),
                    int(d.size))


def comparison_verdict(ci: Interval, relation: str = ">", margin: float = 0.0) -> str:
    """One comparison's verdict from its seed-level interval of (claimed better) - (other).

    `>`: supported when the whole interval is above 0, not supported when it lies at or below 0 (including the
    degenerate [0, 0] of variants that scored the same in every seed: "higher" did not happen), else inconclusive.
    `>=`: non-inferiority with `margin`: supported when the interval lies above -margin, not supported when it lies
    wholly below 0 (the other variant is better), else inconclusive."""
    if ci.low is None or ci.high is None:
        return INCONCLUSIVE
    if relation == ">":
        return SUPPORTED if ci.low > 0 else NOT_SUPPORTED if ci.high <= 0 else INCONCLUSIVE
    if relation == ">=":
        return SUPPORTED if ci.low > -margin else NOT_SUPPORTED if ci.high < 0 else INCONCLUSIVE
    raise ValueError(f"unknown relation {relation!r} (use > or >=)")


def claim_verdict(verdicts: Sequence[str]) -> str:
    """A claim made of several comparisons holds when all of them do; one contradicted comparison contradicts it."""
    if not verdicts:
        return INCONCLUSIVE
    if any(v == NOT_SUPPORTED for v in verdicts):
        return NOT_SUPPORTED
    return SUPPORTED if all(v == SUPPORTED for v in verdicts) else INCONCLUSIVE
