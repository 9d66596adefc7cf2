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
    n = len(x)
    keep = np.ones(n, dtype=bool)
    if n < 2:
        return keep
    x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    for a in range(0, n, block):
        sims = x[a:a + block] @ x[: a + block].T  # [b, a+b]: each row against every earlier member
        rows = np.arange(a, min(a + block, n))
        sims[np.arange(len(rows))[:, None] <= (np.arange(sims.shape[1])[None, :] - a)] = -np.inf
        keep[rows] = sims.max(1) < threshold
    return keep
