"""Deliberately simple, slow pure-Python reference implementations of SRP and the expert caches.

Written straight from the definitions in shared/reference/moe-routing-consistency.md (§2, §3.1, §4): every window
is counted from scratch, and every eviction recomputes every candidate's priority from the raw sequence. The
vectorised code in mindvl.moe_analysis must agree with these exactly.
"""

from __future__ import annotations

from collections import Counter
from fractions import Fraction


def ref_srp(layers: list[list[list[list[int]]]], num_experts: int, m: int) -> tuple[Fraction, int, Fraction] | None:
    """(SRP, θ*, ρ̂) pooled over layers[l][s] = sequence as a list of tokens (lists of expert ids); None if no window."""
    counts = []
    for seqs in layers:
        for seq in seqs:
            for w in range(len(seq) - m + 1):
                for e in range(num_experts):
                    counts.append(sum(e in seq[t] for t in range(w, w + m)))
    if not counts:
        return None
    actual = sum(counts)
    best, best_theta, best_pred = None, None, None
    for theta in range(m + 1):
        tp = sum(c for c in counts if c >= theta)
        pred = m * sum(1 for c in counts if c >= theta)
        f1 = Fraction(2 * tp, max(pred + actual, 1))
        if best is None or f1 > best:  # strict: the first maximiser wins ties
            best, best_theta, best_pred = f1, theta, pred
    return best, best_theta, Fraction(best_pred, actual)


def ref_hits(seq: list[list[int]], c: int, policy: str, m: int | None = None, lookup: str = "pre",
             pin: bool = False, warm: bool = True) -> int:
    """Hits of one cache of c slots over one sequence (tokens of item ids in score order)."""
    width = len(seq[0])
    flat = [e for tok in seq for e in tok]
    cache: set[int] = set()
    last: dict[int, int] = {}
    freq: Counter = Counter()
    seen: set[int] = set()
    hits = 0
    for i, tok in enumerate(seq):
        pre = [e in cache for e in tok]
        processed: set[int] = set()
        for j, e in enumerate(tok):
            now = i * width + j

            def prio(y: int, i=i, now=now, processed=processed):
                return _priority(y, policy, seq, flat, i, now, m, processed, last, freq)

            resident = e in cache
            hit = pre[j] if lookup == "pre" else resident
            if not resident:
                if len(cache) < c:
                    cache.add(e)
                    if warm and e not in seen:
                        hit = True
                else:
                    candidates = [y for y in cache if not (pin and y in tok)]
                    if candidates:
                        cache.remove(min(candidates, key=prio))
                        cache.add(e)
            hits += hit
            seen.add(e)
            last[e] = now
            freq[e] += 1
            processed.add(e)
    return hits


def _priority(y, policy, seq, flat, i, now, m, processed, last, freq):
    """Eviction priority of cached expert y while access `now` (of token i) is processed; the lowest goes."""
    if policy == "lru":
        return last[y]
    if policy == "lfu":
        return (freq[y], last[y])
    if policy == "fsf":
        start = i + 1 if y in processed else i
        return (sum(y in seq[t] for t in range(start, min(i + m, len(seq)))), last[y])
    if policy == "belady":
        return -next((q for q in range(now + 1, len(flat)) if flat[q] == y), len(flat) + y)
    raise AssertionError(policy)


def pooled_tokens(layer_seqs: list[list[list[int]]], num_experts: int) -> list[list[int]]:
    """One sequence's tokens for the pooled cache: layer l's ids offset by l·E, layers concatenated per token."""
    return [[layer * num_experts + e for layer, seq in enumerate(layer_seqs) for e in seq[t]]
            for t in range(len(layer_seqs[0]))]


def ref_static(streams: list[list[list[int]]], c: int) -> int:
    """Hits of a preloaded cache of the c most used items over all the given streams."""
    counts = Counter(e for seq in streams for tok in seq for e in tok)
    top = sorted(counts, key=lambda e: (-counts[e], e))[:c]
    return sum(counts[e] for e in top)
