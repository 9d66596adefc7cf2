"""Local routing consistency metrics of MoE routers: SRP and SCH (arXiv 2505.16056, reference code ljcleo/moe-lrc).

Both work on the top-k expert ids of every token, in descending-score order; gate weights are never used.

**SRP, Segment Routing best Performance** (`srp`). For one layer and one sequence, slide a window of m tokens with
stride 1 over all T-m+1 start positions (windows never cross a sequence boundary) and count, per expert e,
c_w(e) = number of the window's tokens that route to e. The window's predicted group is {e : c_w(e) >= θ}, assumed
active for all m tokens. Pooled over every window, expert and sequence (and layer, for the model-level figure):

    TP(θ) = Σ c_w(e)·[c_w(e) >= θ]      P(θ) = m·Σ [c_w(e) >= θ]      A = Σ c_w(e)
    F1(θ) = 2·TP(θ) / max(P(θ) + A, 1)  SRP = max over integer θ in 0..m of F1(θ)

One θ is chosen per aggregation group (the first maximiser on ties, like torch.max), never per window. ρ̂ = P(θ*)/A
is the best group size relative to k, and act_r = A/P(0) = k/E. θ = 0 predicts every expert, so SRP >= 2k/(E+k); a
window of one token is predicted exactly, so SRP(m=1) = 1. Every token counts once in each window containing it.

**SCH, Segment Cache best Hit rate** (`sch`). The hit rate of a look-ahead expert cache that, when it must evict,
drops the cached expert used least in the next `segment` tokens, ties broken by least recent use. Its exact
semantics (batched pre-token lookups, score-order inserts, free first uses) are those of `mindvl.moe_analysis.cache`,
which also provides the LRU/LFU/Belady/static baselines under the same rules.

**Pooling of ragged input.** Sequences may have different lengths. SRP sums TP/P/A over all windows of all
sequences, so a sequence weighs by its number of windows, T_i-m+1 (none when T_i < m); a figure with no window at all
is NaN, as in the reference for Switch's 65-token decoder at m = 256. SCH and the cache policies sum hits and
accesses over sequences, so a sequence weighs by its tokens (for equal lengths this equals the reference's mean of
per-sequence hit rates).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mindvl.moe_analysis import _compiled
from mindvl.moe_analysis._routing import Routing, as_routing
from mindvl.moe_analysis.cache import HitRateResult, hit_rate


@dataclass(frozen=True)
class SRPResult:
    """SRP of one segment length.

    `srp`, `theta`, `rho`, `act_r` are model-level (pooled over all layers with one θ; the reference's `mg` table).
    The `layer_*` arrays hold the same per layer with θ chosen per layer (the reference's `lg` table); with one
    layer they equal the model-level values. `f1[θ]` is the pooled F1 for θ = 0..segment. `windows` counts windows
    of all sequences of one layer. Figures without any window are NaN (theta -1).
    """

    segment: int
    srp: float
    theta: int
    rho: float
    act_r: float
    windows: int
    f1: np.ndarray = field(repr=False)
    layer_srp: np.ndarray = field(repr=False)
    layer_theta: np.ndarray = field(repr=False)
    layer_rho: np.ndarray = field(repr=False)

    def to_dict(self) -> dict:
        return {
            "segment": self.segment, "srp": _num(self.srp), "theta": self.theta, "rho": _num(self.rho),
            "act_r": _num(self.act_r), "windows": self.windows,
            "layer_srp": [_num(v) for v in self.layer_srp], "layer_theta": [int(v) for v in self.layer_theta],
            "layer_rho": [_num(v) for v in self.layer_rho],
        }


def _num(v: float) -> float | None:
    """JSON has no NaN: missing figures become null."""
    return None if not np.isfinite(v) else float(v)


def srp(topk, num_experts: int | None = None, segment: int = 16) -> SRPResult:
    """SRP at one segment length m (see the module docstring); input forms as in `as_routing`."""
    return srp_curve(topk, num_experts, (segment,))[0]


def srp_curve(topk, num_experts: int | None = None, segments: Sequence[int] = (4, 16, 64, 256)) -> list[SRPResult]:
    """SRP at several segment lengths, sharing the per-layer sort of routing events between them."""
    routing = as_routing(topk, num_experts)
    segments = _check_segments(segments)
    hists = window_count_histograms(routing, segments)
    return [_srp_from_hist(m, hists[m], routing.num_experts) for m in segments]


def _check_segments(segments: Sequence[int]) -> tuple[int, ...]:
    out = tuple(int(m) for m in segments)
    if not out or any(m < 1 for m in out) or any(m != s for m, s in zip(out, segments, strict=True)):
        raise ValueError(f"segment lengths must be positive integers, got {list(segments)}")
    return out


def window_count_histograms(routing: Routing, segments: Sequence[int]) -> dict[int, np.ndarray]:
    """hist[m][l, v] = number of (window, expert) cells of layer l whose count c_w(e) equals v, v = 0..m.

    The histogram is all SRP needs: TP, P and A are sums over it. Instead of the dense [windows, experts] count
    matrix (N·E cells per layer) it is built from routing events (N·k per layer). Per (sequence, expert), the window
    count is a step function of the window start w that rises at w = t-m+1 and falls at w = t+1 for every use t.
    The length of w where the count is >= θ is the sum of the positions where it falls from θ minus those where it
    rises to θ, so only the count right after each event is needed: after use j's rise it is the number of uses in
    [t_j-m+1, t_j], after use i's fall the number in [t_i+1, t_i+m]. Sorting the uses by (expert, sequence, time)
    once per layer turns both into index differences found by one binary search per segment.
    """
    if _compiled.available():
        starts, ends = routing.offsets[:-1], routing.offsets[1:]
        return {m: _compiled.srp_histograms(routing.ids, starts, ends, m, routing.num_experts) for m in segments}
    lengths = routing.lengths
    seq_of_tok = routing.seq_of_token
    num_seqs, k, num_experts = lengths.shape[0], routing.k, routing.num_experts
    t_max = int(lengths.max())
    local_t = (np.arange(routing.num_tokens) - routing.offsets[seq_of_tok]).astype(np.int64)
    max_key = num_experts * num_seqs * (t_max + max(segments) + 2)
    key_dtype = np.int32 if max_key < np.iinfo(np.int32).max else np.int64
    out = {m: np.zeros((routing.num_layers, m + 1), np.int64) for m in segments}
    for layer in range(routing.num_layers):
        experts = routing.ids[layer].reshape(-1)
        # Stable radix sort by expert keeps token order inside each expert, so (expert, sequence) groups are
        # contiguous and time-sorted.
        order = np.argsort(experts, kind="stable")
        tok = order // k
        seq = seq_of_tok[tok]
        group = experts[order].astype(np.int64) * num_seqs + seq
        t = local_t[tok]
        idx = np.arange(order.shape[0], dtype=np.int64)
        seq_len = lengths[seq]
        # One key for all segments: groups are spaced wider than any search offset ±m.
        key = (group * (t_max + max(segments) + 2) + t).astype(key_dtype)
        del group, tok, order
        for m in segments:
            out[m][layer] = _layer_hist(key, t, idx, seq_len - m + 1, m, num_experts, lengths)
    return out


def _layer_hist(key, t, idx, n_windows, m, num_experts, lengths) -> np.ndarray:
    """Count histogram of one layer for segment m from time-sorted uses (see `window_count_histograms`)."""
    n = idx.shape[0]
    n_windows = np.maximum(n_windows, 0)
    # Falls of uses i with t_i <= t_j-m precede the rise of use j (falls first on ties: the count never
    # exceeds that of a real window). `before` is the global index of the first use not yet fallen.
    before = np.searchsorted(key, key - m, side="right")
    rise_level = idx + 1 - before
    # Use i has fallen before use j rises iff i < before_j, so the rises preceding i's fall are the j with
    # before_j <= i: a prefix count over `before`. Uses of earlier groups count on both sides and cancel.
    fall_level = np.cumsum(np.bincount(before, minlength=n + 1))[:n] - idx - 1
    rise_pos = np.minimum(np.maximum(t - (m - 1), 0), n_windows).astype(np.float64)
    fall_pos = np.minimum(t + 1, n_windows).astype(np.float64)
    # above[θ] = number of cells with count >= θ (θ >= 1).
    above = (np.bincount(fall_level + 1, weights=fall_pos, minlength=m + 2)[: m + 2]
             - np.bincount(rise_level, weights=rise_pos, minlength=m + 2)[: m + 2])
    above = np.rint(above).astype(np.int64)
    hist = np.zeros(m + 1, np.int64)
    hist[1:] = above[1 : m + 1] - above[2 : m + 2]
    total_cells = int(np.maximum(lengths - m + 1, 0).sum()) * num_experts
    hist[0] = total_cells - above[1]
    return hist


def _best_theta(hist: np.ndarray, m: int) -> tuple[float, int, float, float, np.ndarray]:
    """(SRP, θ*, ρ̂, act_r, F1 per θ) of a pooled count histogram; θ* is the first exact maximiser."""
    cells = int(hist.sum())
    if cells == 0:
        return float("nan"), -1, float("nan"), float("nan"), np.full(m + 1, np.nan)
    v = np.arange(m + 1, dtype=np.int64)
    # Python ints: exact, and the comparisons below cannot overflow for any trace size.
    tp = [int(x) for x in np.cumsum((v * hist)[::-1])[::-1]]
    npred = [int(x) for x in np.cumsum(hist[::-1])[::-1]]
    actual = tp[0]
    num = [2 * tp[th] for th in range(m + 1)]
    den = [max(m * npred[th] + actual, 1) for th in range(m + 1)]
    best = 0
    for th in range(1, m + 1):
        # Compare fractions exactly (num/den > best) so ties pick the first θ, as torch.max does.
        if num[th] * den[best] > num[best] * den[th]:
            best = th
    f1 = np.array([a / b for a, b in zip(num, den, strict=True)])
    rho = m * npred[best] / actual if actual else float("nan")
    act_r = actual / (m * npred[0])
    return f1[best], best, rho, act_r, f1


def _srp_from_hist(m: int, hist: np.ndarray, num_experts: int) -> SRPResult:
    srp_v, theta, rho, act_r, f1 = _best_theta(hist.sum(axis=0), m)
    per_layer = [_best_theta(h, m) for h in hist]
    windows = int(hist[0].sum()) // num_experts  # every window has one cell per expert
    return SRPResult(
        segment=m, srp=float(srp_v), theta=int(theta), rho=float(rho), act_r=float(act_r),
        windows=windows, f1=f1,
        layer_srp=np.array([p[0] for p in per_layer], float),
        layer_theta=np.array([p[1] for p in per_layer], np.int64),
        layer_rho=np.array([p[2] for p in per_layer], float),
    )


def sch(
    topk,
    num_experts: int | None = None,
    segment: int = 16,
    cache_sizes: Sequence[float] | float = (0.5, 1, 2, 4),
    *,
    lookup: str = "pre",
    pin: bool = False,
    warm_start: bool = True,
    sequence_stride: int = 1,
    per_layer: bool = True,
    pooled: bool = True,
) -> HitRateResult:
    """SCH: hit rates of the look-ahead ("fsf") cache with a `segment`-token look-ahead, per layer and pooled.

    `cache_sizes` are ratios ρ of cache slots to active experts: c = ρ·k slots for each per-layer cache and
    c = ρ·L·k for the pooled cache shared by all layers (expert ids offset by layer·E; a token's accesses are layer
    0's top-k, then layer 1's, ...). The reference semantics are the defaults; `lookup`, `pin` and `warm_start` are
    the switches of `mindvl.moe_analysis.cache.hit_rate`. The reference computes SCH on every 16th sequence
    (`sequence_stride=16`); the default here uses all sequences given.
    """
    return hit_rate(topk, num_experts, "fsf", cache_sizes, segment=segment, lookup=lookup, pin=pin,
                    warm_start=warm_start, sequence_stride=sequence_stride, per_layer=per_layer, pooled=pooled)
