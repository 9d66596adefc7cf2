"""Clustering arithmetic: k-means (faiss), within-cluster variance, variance-proportional quotas, SemDeDup.

The paper's rule (B.1.1): "a larger variance within a cluster indicates greater diversity ... clusters with larger
variance undergo more extensive sampling". Here the variance of a cluster is the mean squared Euclidean distance of
its members to its centroid (the trace of its covariance), and a cluster's quota is

    quota_c = min(n_c, floor + share_c),   share_c proportional to variance_c,

with the shares summing to `target - sum(floors)`; a cluster that cannot take its share (quota above its size) is
capped at its size and the rest is redistributed over the others by the same rule (water-filling), then the real
quotas are rounded by largest remainder so they sum exactly to min(target, N).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np


def kmeans(x: np.ndarray, k: int, seed: int, niter: int = 20) -> np.ndarray:
    """Centroids [k', d] of k-means on x [n, d] float32 (k' = min(k, n)); deterministic for a seed."""
    try:
        import faiss
    except ImportError as exc:  # pragma: no cover - environment
        raise ImportError("clustering needs faiss: pip install 'mindvl[curate]'") from exc
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = max(1, min(k, len(x)))
    if k == len(x):
        return x.copy()
    faiss.omp_set_num_threads(1)  # one thread: k-means sums are then in a fixed order, so results are exact
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, verbose=False, min_points_per_centroid=1,
                      max_points_per_centroid=max(256, len(x)))
    km.train(x)
    return km.centroids.copy()


def assign(x: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(nearest centroid index [n], squared distance [n]) by exact search."""
    x = np.asarray(x, dtype=np.float32)
    d2 = (x * x).sum(1)[:, None] - 2 * x @ centroids.T + (centroids * centroids).sum(1)[None, :]
    idx = d2.argmin(1)
    return idx, np.maximum(d2[np.arange(len(x)), idx], 0.0)


def variance_quotas(sizes: np.ndarray, variances: np.ndarray, target: int, floor: int) -> np.ndarray:
    """Integer quotas per cluster (see the module docstring). sizes int [C], variances float [C] >= 0."""
    sizes = np.asarray(sizes, dtype=np.int64)
    var = np.asarray(variances, dtype=np.float64)
    total = int(sizes.sum())
    if target >= total:
        return sizes.copy()
    base = np.minimum(sizes, floor).astype(np.float64)
    if base.sum() >= target:  # the floors alone exceed the target: share the target by floors, largest remainder
        return _round_to(base * target / base.sum(), target, sizes)
    quota = base.copy()
    remaining = target - quota.sum()
    active = sizes > quota
    while remaining > 1e-9 and active.any():
        w = np.where(active, var, 0.0)
        w = w / w.sum() if w.sum() > 0 else active / active.sum()
        proposal = quota + remaining * w
        over = active & (proposal >= sizes)
        if not over.any():
            quota = proposal
            break
        quota[over] = sizes[over]  # capped clusters take all they have; the rest goes round again
        active &= ~over
        remaining = target - quota.sum()
    return _round_to(quota, target, sizes)


def _round_to(real: np.ndarray, target: int, sizes: np.ndarray) -> np.ndarray:
    """Floor, then hand the missing units to the largest remainders (ties: lower cluster index), never above size."""
    q = np.minimum(np.floor(real + 1e-9).astype(np.int64), sizes)
    missing = int(target - q.sum())
    order = sorted(range(len(q)), key=lambda c: (-(real[c] - q[c]), c))
    for c in order:
        if missing <= 0:
            break
        if q[c] < sizes[c]:
            q[c] += 1
            missing -= 1
    return q


def semdedup(x: np.ndarray, threshold: float, block: int = 1024) -> np.ndarray:
    """SemDeDup within one cluster: drop member i if its cosine similarity to any earlier member (j < i) is
    >= threshold (Abbas et al. 2023, in the given order). Returns a keep mask [n]. Blockwise: memory block x n."""
    x = np.asarray(x, dtype=np.float32)
    return semdedup_rows(lambda a, b: x[a:b], len(x), threshold, block)


def semdedup_rows(rows: Callable[[int, int], np.ndarray], n: int, threshold: float, block: int = 1024) -> np.ndarray:
    """`semdedup` over a cluster read piecewise: `rows(a, b)` returns members [a, b) as float [b - a, d] (e.g. from
    a spill file), so memory is a few blocks of rows and a block x block similarity tile, whatever n is.
    Returns the keep mask [n] (one byte a member)."""
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep

    def unit(a: int, b: int) -> np.ndarray:
        x = np.asarray(rows(a, b), dtype=np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    for a in range(0, n, block):
        xa = unit(a, min(a + block, n))
        best = np.full(len(xa), -np.inf, dtype=np.float32)
        for c in range(0, a + len(xa), block):  # every earlier block, then the block itself (lower triangle)
            xc = xa if c == a else unit(c, min(c + block, n))
            sims = xa @ xc.T  # [rows of a, rows of c]
            if c == a:
                sims[np.triu_indices(len(xa))] = -np.inf  # j >= i is not an earlier member
            best = np.maximum(best, sims.max(1))
        keep[a:a + len(xa)] = best < threshold
    return keep


def select_smallest(chunks: Callable[[], Iterator[np.ndarray]], k: int, gather: int = 1 << 20) -> tuple[int, int]:
    """The exact rule that keeps the `k` smallest of a stream of uint64 values, ties in stream order: keep every
    value < t and the first `take` values == t. `chunks()` yields the stream again on every call (a pass).

    Streaming radix select, 16 bits a pass, in bounded memory (a 65536-bin histogram; the remaining candidates
    are collected and sorted once at most `gather` of them are left): at most 4 passes, typically 1-2.
    Returns (t, take); k <= 0 keeps nothing (take 0)."""
    if k <= 0:
        return 0, 0
    prefix, bits = 0, 0  # the candidates are the values whose top `bits` bits equal prefix's
    while True:
        hist = np.zeros(1 << 16, dtype=np.int64)
        cand: list[np.ndarray] | None = []
        n_cand = 0
        for v in chunks():
            v = np.asarray(v, dtype=np.uint64)
            if bits:
                v = v[(v >> np.uint64(64 - bits)) == np.uint64(prefix >> (64 - bits))]
            n_cand += len(v)
            if cand is not None:
                cand.append(v)
                if n_cand > gather:
                    cand = None
            hist += np.bincount(((v >> np.uint64(48 - bits)) & np.uint64(0xFFFF)).astype(np.int64),
                                minlength=1 << 16)
        if k > n_cand:  # fewer values than asked: keep them all
            k = n_cand
            if k == 0:
                return 0, 0
        if cand is not None:
            v = np.sort(np.concatenate(cand)) if cand else np.zeros(0, np.uint64)
            t = v[k - 1]
            return int(t), int(k - np.searchsorted(v, t, side="left"))
        cum = np.cumsum(hist)
        digit = int(np.searchsorted(cum, k, side="left"))  # first digit whose cumulative count reaches k
        k -= int(cum[digit - 1]) if digit else 0
        prefix |= digit << (48 - bits)
        bits += 16
        if bits == 64:
            return prefix, k
