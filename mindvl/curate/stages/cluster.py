"""Hierarchical clustering of image embeddings, SemDeDup and variance-proportional sampling (paper B.1.1).

Driver-side plan, reading only the shards' sidecar embeddings, in memory that does not grow with the corpus
(it grows with k, the number of leaves and `max_train`; per-record state lives in spill files under the plan
folder):
1. k-means (faiss) with `k` centroids, trained on at most `max_train` records (those with the smallest
   seeded hash of their key: a deterministic uniform sample);
2. one pass assigns every record to its centroid and measures each cluster's size and radius (root mean squared
   distance to its centroid); clusters above `max_cluster_size` or `max_radius` are *re-clustered* with their own
   k-means (ceil(size / max_cluster_size) sub-clusters, or 2 when only the radius is over), trained on their own
   bounded sample (at most `max_train` records of each, collected in one more pass only when some cluster is
   too broad): the paper's re-clustering of overly broad clusters;
3. a second pass assigns every record to its leaf (parent centroid, then child centroid), appends its embedding
   and its priority (the seeded hash of its key) to the leaf's spill files, its leaf to the shard's spill file,
   and adds it to the leaf's streaming statistics (count, sum and sum of squares of the offsets to the leaf
   centroid);
4. per leaf, SemDeDup (optional, `semdedup: <cosine threshold>`; a member is a duplicate of an earlier member in
   corpus order), read block by block from the spill file; the within-cluster variance of the survivors (mean
   squared distance to their mean) from the streaming statistics (recomputed over the survivors when SemDeDup
   removed some);
5. quotas: `variance_quotas(sizes, variances, target, floor)` (mindvl.curate.sampling); in each leaf exactly
   `quota` survivors are kept: those with the smallest priorities (ties, which need a 64-bit hash collision, in
   corpus order), found by a streaming radix select (`select_smallest`) over the leaf's priority file, and the
   leaf's per-member decision (kept / semantic_duplicate / not_sampled) is written to a status file. Without
   `target`, nothing is sampled away (cluster annotations and SemDeDup only);
6. the plan is emitted shard by shard: each record's leaf (shard spill file) and decision (the leaf's status file,
   read at the leaf's cursor: a leaf's members are in corpus order). Every kept record gets `meta["cluster"]`
   ("3" or "3.1").
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np

from ..io import SPILL_CHUNK, read_sidecar, spill_append, spill_read
from ..sampling import assign, kmeans, select_smallest, semdedup_rows, variance_quotas
from .base import GlobalStage, Options, register, stable_u64


def _read(path: str) -> tuple[list[str], np.ndarray | None]:
    side = read_sidecar(path, ("embedding",))
    if "embedding" not in side:
        return [], None
    keys, x = side["embedding"]
    return keys, x.astype(np.float32)


class _Smallest:
    """The `cap` items with the smallest priorities seen so far (bounded memory)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.pri = np.zeros(0, dtype=np.uint64)
        self.x: np.ndarray | None = None

    def add(self, pri: np.ndarray, x: np.ndarray) -> None:
        p = np.concatenate([self.pri, pri])
        v = x if self.x is None else np.concatenate([self.x, x])
        if len(p) > self.cap:
            order = np.argsort(p, kind="stable")[: self.cap]
            p, v = p[order], v[order]
        self.pri, self.x = p, v


@register
class Cluster(GlobalStage):
    name = "cluster"

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"k": 16, "niter": 20, "max_train": 100_000, "max_cluster_size": None,
                               "max_radius": None, "target": None, "floor": 1, "semdedup": None, "examples": 4},
                         where, {"max_cluster_size": (int,), "max_radius": (float,), "target": (int,),
                                 "semdedup": (float,)})
        self.o.positive("k", "niter", "max_train", "max_cluster_size", "max_radius", "target", "examples")
        if self.o.floor < 0:
            raise ValueError(f"{where}.floor: must be >= 0, got {self.o.floor}")
        if self.o.semdedup is not None and not 0 < self.o.semdedup <= 1:
            raise ValueError(f"{where}.semdedup: a cosine threshold in (0, 1], got {self.o.semdedup}")

    def annotate(self, batch):
        kept, dropped = [], []
        for item in batch:
            (kept if "embedding" in item.arrays else dropped).append(item)
        return kept, [(item, "no_embedding") for item in dropped]

    def _priorities(self, keys: list[str]) -> np.ndarray:
        return np.array([stable_u64("cluster", self.seed, k) for k in keys], dtype=np.uint64)

    def plan(self, shards, workdir, emit):
        paths = [p for _, p in shards]
        # 1. top-level k-means on a bounded, seeded sample
        sample = _Smallest(self.o.max_train)
        n_total = 0
        for path in paths:
            keys, x = _read(path)
            if x is not None:
                sample.add(self._priorities(keys), x)
                n_total += len(keys)
        if n_total == 0:
            return {"clusters": []}
        top = kmeans(sample.x, self.o.k, self.seed, self.o.niter)
        dim = top.shape[1]
        del sample
        # 2. sizes and radii of the top-level clusters; then, only if some are too broad, a bounded sample of each
        # of those (one more pass) for re-clustering
        sizes = np.zeros(len(top), dtype=np.int64)
        sq = np.zeros(len(top))
        for path in paths:
            _keys, x = _read(path)
            if x is None:
                continue
            idx, d2 = assign(x, top)
            np.add.at(sizes, idx, 1)
            np.add.at(sq, idx, d2)
        radius = np.sqrt(sq / np.maximum(sizes, 1))
        broad: dict[int, int] = {}  # cluster -> number of sub-clusters
        for c in range(len(top)):
            too_big = self.o.max_cluster_size is not None and sizes[c] > self.o.max_cluster_size
            too_wide = self.o.max_radius is not None and radius[c] > self.o.max_radius
            if (too_big or too_wide) and sizes[c] >= 2:
                broad[c] = math.ceil(sizes[c] / self.o.max_cluster_size) if too_big else 2
        per_cluster = {c: _Smallest(self.o.max_train) for c in broad}
        for path in paths if broad else []:
            keys, x = _read(path)
            if x is None:
                continue
            idx, _ = assign(x, top)
            pri = self._priorities(keys)
            for c in np.unique(idx):
                if c in per_cluster:
                    per_cluster[c].add(pri[idx == c], x[idx == c])
        children = {c: kmeans(per_cluster[c].x, sub_k, self.seed + 1 + c, self.o.niter) for c, sub_k in broad.items()}
        del per_cluster
        # 3. leaf assignment: embeddings and priorities spilled per leaf, leaves per shard, streaming statistics
        leaves = [str(c) if c not in children else f"{c}.{j}" for c in range(len(top))
                  for j in range(len(children[c]) if c in children else 1)]
        centre = np.concatenate([children[c] if c in children else top[c:c + 1] for c in range(len(top))])
        spill = os.path.join(workdir, "cluster_spill")
        shutil.rmtree(spill, ignore_errors=True)
        os.makedirs(spill)
        emb = lambda li: os.path.join(spill, f"leaf{li}.f32")  # noqa: E731
        prio = lambda li: os.path.join(spill, f"leaf{li}.u64")  # noqa: E731
        stats = _LeafStats(len(leaves), dim)
        for s, path in enumerate(paths):
            keys, x = _read(path)
            if x is None:
                continue
            leaf = self._leaves(x, top, children, leaves)
            pri = self._priorities(keys)
            spill_append(os.path.join(spill, f"shard{s}.i32"), leaf.astype(np.int32))
            for li in np.unique(leaf):
                m = leaf == li
                spill_append(emb(li), x[m].astype(np.float32))
                spill_append(prio(li), pri[m])
                stats.add(li, x[m], centre[li])
        # 4. SemDeDup per leaf (block by block from its spill file), variance of the survivors
        counts = stats.n.copy()
        dup_counts = np.zeros(len(leaves), dtype=np.int64)
        keep_path = lambda li: os.path.join(spill, f"leaf{li}.keep")  # noqa: E731
        for li in range(len(leaves)):
            n = int(stats.n[li])
            if self.o.semdedup is None or n < 2:
                continue
            keep = semdedup_rows(lambda a, b, li=li: spill_read(emb(li), np.float32, a, b - a, dim), n,
                                 self.o.semdedup, SEMDEDUP_BLOCK)
            dup_counts[li] = int((~keep).sum())
            spill_append(keep_path(li), keep)
            if dup_counts[li]:  # the variance is that of the survivors
                survivors = _LeafStats(1, dim)
                for a in range(0, n, SPILL_CHUNK):
                    x = spill_read(emb(li), np.float32, a, min(SPILL_CHUNK, n - a), dim)
                    survivors.add(0, x[keep[a:a + len(x)]], centre[li])
                counts[li] = survivors.n[0]
                stats.replace(li, survivors, 0)
            del keep
        variances = stats.variances()
        # 5. variance-proportional quotas; in each leaf, the `quota` survivors of smallest priority
        quotas = counts.copy() if self.o.target is None else variance_quotas(counts, variances, self.o.target,
                                                                             self.o.floor)
        for li in range(len(leaves)):
            n = int(stats.n_all[li])
            if n == 0:
                continue
            has_keep = os.path.exists(keep_path(li))

            def survivor_chunks(li=li, n=n, has_keep=has_keep):
                for a in range(0, n, SPILL_CHUNK):
                    p = spill_read(prio(li), np.uint64, a, min(SPILL_CHUNK, n - a))
                    yield p[spill_read(keep_path(li), bool, a, len(p))] if has_keep else p

            t, take = select_smallest(survivor_chunks, int(quotas[li]))
            ties = 0
            for a in range(0, n, SPILL_CHUNK):  # the leaf's decisions, in corpus order
                p = spill_read(prio(li), np.uint64, a, min(SPILL_CHUNK, n - a))
                alive = spill_read(keep_path(li), bool, a, len(p)) if has_keep else np.ones(len(p), bool)
                chosen = alive & (p < np.uint64(t))
                at_t = np.nonzero(alive & (p == np.uint64(t)))[0][: max(take - ties, 0)]
                chosen[at_t] = True
                ties += len(at_t)
                status = np.where(chosen, KEPT, np.where(alive, NOT_SAMPLED, SEMANTIC_DUPLICATE)).astype(np.uint8)
                spill_append(os.path.join(spill, f"leaf{li}.status"), status)
        # 6. the plan, shard by shard
        cursor = np.zeros(len(leaves), dtype=np.int64)
        examples: list[list[str]] = [[] for _ in leaves]
        for s, (name, path) in enumerate(shards):
            leaf = spill_read(os.path.join(spill, f"shard{s}.i32"), np.int32)
            if not len(leaf):
                continue
            keys = read_sidecar(path, ("embedding",))["embedding"][0]
            status = np.empty(len(leaf), dtype=np.uint8)
            for li in np.unique(leaf):
                m = leaf == li
                status[m] = spill_read(os.path.join(spill, f"leaf{li}.status"), np.uint8, cursor[li], int(m.sum()))
                cursor[li] += int(m.sum())
            plan: dict[str, dict] = {"drop": {}, "meta": {}}
            for k, li, st in zip(keys, leaf.tolist(), status.tolist(), strict=True):
                if st == KEPT:
                    plan["meta"][k] = {"cluster": leaves[li]}
                    if len(examples[li]) < self.o.examples:
                        examples[li].append(k)
                else:
                    plan["drop"][k] = REASONS[st]
            emit(name, plan)
        shutil.rmtree(spill, ignore_errors=True)
        report = [{"cluster": leaves[li], "size": int(stats.n_all[li]), "semantic_duplicates": int(dup_counts[li]),
                   "variance": float(variances[li]), "quota": int(quotas[li]), "examples": examples[li]}
                  for li in range(len(leaves)) if stats.n_all[li]]
        return {"records": n_total, "top_level": len(top), "reclustered": sorted(int(c) for c in children),
                "target": self.o.target, "floor": self.o.floor, "clusters": report}

    @staticmethod
    def _leaves(x: np.ndarray, top: np.ndarray, children: dict[int, np.ndarray], leaves: list[str]) -> np.ndarray:
        """Leaf index [n] of each embedding: nearest top-level centroid, then nearest child centroid."""
        leaf_index = {name: i for i, name in enumerate(leaves)}
        idx, _ = assign(x, top)
        leaf = np.empty(len(x), dtype=np.int64)
        for c in np.unique(idx):
            m = idx == c
            if c in children:
                sub, _ = assign(x[m], children[c])
                leaf[m] = [leaf_index[f"{c}.{j}"] for j in sub]
            else:
                leaf[m] = leaf_index[str(c)]
        return leaf


SEMDEDUP_BLOCK = 1024  # members compared at once: a 1024 x 1024 similarity tile (4 MB)
KEPT, SEMANTIC_DUPLICATE, NOT_SAMPLED = 0, 1, 2
REASONS = {SEMANTIC_DUPLICATE: "semantic_duplicate", NOT_SAMPLED: "not_sampled"}


class _LeafStats:
    """Per-leaf streaming statistics of offsets to a reference point c (the leaf centroid, close to the mean, so
    the float64 sums do not cancel): count, sum of (x - c), sum of |x - c|^2. variance = mean |x - c|^2 -
    |mean(x - c)|^2, the mean squared distance to the members' mean. Memory: leaves x dim."""

    def __init__(self, n_leaves: int, dim: int):
        self.n = np.zeros(n_leaves, dtype=np.int64)
        self.n_all = self.n  # members before SemDeDup (replace() splits the two)
        self.s1 = np.zeros((n_leaves, dim))
        self.s2 = np.zeros(n_leaves)

    def add(self, li: int, x: np.ndarray, c: np.ndarray) -> None:
        d = x.astype(np.float64) - c.astype(np.float64)
        self.n[li] += len(x)
        self.s1[li] += d.sum(0)
        self.s2[li] += float((d * d).sum())

    def replace(self, li: int, other: _LeafStats, oi: int) -> None:
        if self.n_all is self.n:
            self.n_all = self.n.copy()
        self.n[li], self.s1[li], self.s2[li] = other.n[oi], other.s1[oi], other.s2[oi]

    def variances(self) -> np.ndarray:
        n = np.maximum(self.n, 1)[:, None]
        mean = self.s1 / n
        return np.maximum(self.s2 / n[:, 0] - (mean * mean).sum(1), 0.0)
