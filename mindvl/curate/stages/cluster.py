"""Hierarchical clustering of image embeddings, SemDeDup and variance-proportional sampling (paper B.1.1).

Driver-side plan, reading only the shards' sidecar embeddings, in bounded memory:
1. k-means (faiss) with `k` centroids, trained on at most `max_train` records (those with the smallest
   seeded hash of their key: a deterministic uniform sample);
2. one pass assigns every record to its centroid and measures each cluster's size and radius (root mean squared
   distance to its centroid); clusters above `max_cluster_size` or `max_radius` are *re-clustered* with their own
   k-means (ceil(size / max_cluster_size) sub-clusters, or 2 when only the radius is over), trained on their own
   bounded sample: the paper's re-clustering of overly broad clusters;
3. a second pass assigns every record to its leaf (parent centroid, then child centroid) and appends its embedding
   to the leaf's bucket file on disk, so one leaf at a time is held in memory later;
4. per leaf: SemDeDup (optional, `semdedup: <cosine threshold>`; a member is a duplicate of an earlier member in
   corpus order), then the within-cluster variance of the survivors (mean squared distance to their mean);
5. quotas: `variance_quotas(sizes, variances, target, floor)` (mindvl.curate.sampling), and in each leaf the
   `quota` survivors with the smallest seeded hash of their key are kept (`not_sampled` for the rest). Without
   `target`, nothing is sampled away (cluster annotations and SemDeDup only).
Every kept record gets `meta["cluster"]` ("3" or "3.1").
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np

from ..io import read_sidecar
from ..sampling import assign, kmeans, semdedup, variance_quotas
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

    def plan(self, shards, workdir):
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
            return {}, {"clusters": []}
        top = kmeans(sample.x, self.o.k, self.seed, self.o.niter)
        # 2. sizes and radii of the top-level clusters, and a bounded sample of each for re-clustering
        sizes = np.zeros(len(top), dtype=np.int64)
        sq = np.zeros(len(top))
        per_cluster = [_Smallest(self.o.max_train) for _ in range(len(top))]
        for path in paths:
            keys, x = _read(path)
            if x is None:
                continue
            idx, d2 = assign(x, top)
            np.add.at(sizes, idx, 1)
            np.add.at(sq, idx, d2)
            pri = self._priorities(keys)
            for c in np.unique(idx):
                per_cluster[c].add(pri[idx == c], x[idx == c])
        radius = np.sqrt(sq / np.maximum(sizes, 1))
        children: dict[int, np.ndarray] = {}
        for c in range(len(top)):
            too_big = self.o.max_cluster_size is not None and sizes[c] > self.o.max_cluster_size
            too_wide = self.o.max_radius is not None and radius[c] > self.o.max_radius
            if (too_big or too_wide) and sizes[c] >= 2:
                sub_k = math.ceil(sizes[c] / self.o.max_cluster_size) if too_big else 2
                children[c] = kmeans(per_cluster[c].x, sub_k, self.seed + 1 + c, self.o.niter)
        del per_cluster
        # 3. leaf assignment, embeddings appended to one bucket file per leaf
        leaves = [str(c) if c not in children else f"{c}.{j}" for c in range(len(top))
                  for j in range(len(children[c]) if c in children else 1)]
        leaf_index = {name: i for i, name in enumerate(leaves)}
        bucket_dir = os.path.join(workdir, "cluster_buckets")
        shutil.rmtree(bucket_dir, ignore_errors=True)
        os.makedirs(bucket_dir)
        leaf_keys: list[list[str]] = [[] for _ in leaves]
        for path in paths:
            keys, x = _read(path)
            if x is None:
                continue
            idx, _ = assign(x, top)
            leaf = np.empty(len(keys), dtype=np.int64)
            for c in np.unique(idx):
                m = idx == c
                if c in children:
                    sub, _ = assign(x[m], children[c])
                    leaf[m] = [leaf_index[f"{c}.{j}"] for j in sub]
                else:
                    leaf[m] = leaf_index[str(c)]
            for li in np.unique(leaf):
                m = leaf == li
                with open(os.path.join(bucket_dir, f"{li}.f32"), "ab") as f:
                    f.write(np.ascontiguousarray(x[m], dtype=np.float32).tobytes())
                leaf_keys[li].extend(k for k, mm in zip(keys, m, strict=True) if mm)
        dim = sample.x.shape[1]
        # 4. SemDeDup and variance per leaf, one leaf in memory at a time
        plans: dict[str, dict] = {}
        survivors: list[list[str]] = []
        variances = np.zeros(len(leaves))
        dup_counts = np.zeros(len(leaves), dtype=np.int64)
        for li, keys in enumerate(leaf_keys):
            if not keys:
                survivors.append([])
                continue
            x = np.fromfile(os.path.join(bucket_dir, f"{li}.f32"), dtype=np.float32).reshape(len(keys), dim)
            keep = semdedup(x, self.o.semdedup) if self.o.semdedup is not None else np.ones(len(keys), bool)
            for k in (k for k, kk in zip(keys, keep, strict=True) if not kk):
                self._drop(plans, k, "semantic_duplicate")
            dup_counts[li] = int((~keep).sum())
            xs = x[keep].astype(np.float64)
            variances[li] = float(((xs - xs.mean(0)) ** 2).sum(1).mean())
            survivors.append([k for k, kk in zip(keys, keep, strict=True) if kk])
        shutil.rmtree(bucket_dir, ignore_errors=True)
        # 5. variance-proportional quotas and seeded selection inside each leaf
        counts = np.array([len(s) for s in survivors], dtype=np.int64)
        quotas = counts.copy() if self.o.target is None else variance_quotas(counts, variances, self.o.target,
                                                                             self.o.floor)
        report = []
        for li, keys in enumerate(survivors):
            order = sorted(keys, key=lambda k: stable_u64("cluster", self.seed, k))
            chosen = order[: int(quotas[li])]
            for k in order[int(quotas[li]):]:
                self._drop(plans, k, "not_sampled")
            for k in chosen:
                self._meta(plans, k, {"cluster": leaves[li]})
            report.append({"cluster": leaves[li], "size": len(leaf_keys[li]), "semantic_duplicates": int(
                dup_counts[li]), "variance": float(variances[li]), "quota": int(quotas[li]),
                "examples": sorted(chosen)[: self.o.examples]})
        return plans, {"records": n_total, "top_level": len(top), "reclustered": sorted(int(c) for c in children),
                       "target": self.o.target, "floor": self.o.floor, "clusters": report}

    @staticmethod
    def _drop(plans: dict, key: str, reason: str) -> None:
        plans.setdefault(key.split("/", 1)[0], {"drop": {}, "meta": {}})["drop"][key] = reason

    @staticmethod
    def _meta(plans: dict, key: str, meta: dict) -> None:
        plans.setdefault(key.split("/", 1)[0], {"drop": {}, "meta": {}})["meta"][key] = meta
