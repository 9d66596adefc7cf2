"""Clustering: variance-proportional quotas, re-clustering, SemDeDup, on planted clusters."""

from __future__ import annotations

import numpy as np
import pytest

from mindvl.curate.io import ShardWriter
from mindvl.curate.items import Item
from mindvl.curate.sampling import semdedup, variance_quotas
from mindvl.curate.stages.base import plan_in_memory
from mindvl.curate.stages.cluster import Cluster

pytest.importorskip("faiss")


def test_quotas_hand_computed():
    # target 60, floor 5: 50 units shared 1:2 after the floors -> 5+16.67, 5+33.33 -> rounded 22, 38
    assert variance_quotas(np.array([100, 100]), np.array([1.0, 2.0]), 60, 5).tolist() == [22, 38]
    # a cluster smaller than its share is capped at its size and the rest goes to the others
    assert variance_quotas(np.array([10, 100, 100]), np.array([10.0, 1.0, 1.0]), 60, 0).tolist() == [10, 25, 25]
    # floors hold for zero-variance clusters: 28 units after floors -> 4+0, 4+9.33, 4+18.67 -> 4, 13, 23
    q = variance_quotas(np.array([50, 50, 50]), np.array([0.0, 1.0, 2.0]), 40, 4)
    assert q.tolist() == [4, 13, 23] and q.sum() == 40
    # a target above the corpus keeps everything
    assert variance_quotas(np.array([3, 4]), np.array([1.0, 1.0]), 100, 1).tolist() == [3, 4]


def test_semdedup_drops_later_near_copies_only():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 16)).astype(np.float32)
    copies = x[:10] + 1e-3 * rng.normal(size=(10, 16)).astype(np.float32)
    keep = semdedup(np.concatenate([x, copies]), 0.99, block=16)  # small blocks cross the block boundary
    assert keep[:50].all() and not keep[50:].any()


def _planted(tmp_path, sigmas, n_per, dim=8, seed=0, n_shards=3):
    """Clusters with far-apart centres and per-cluster spread sigma; written as sidecars of n_shards shards."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(len(sigmas), dim)) * 100
    xs, labels = [], []
    for c, (s, n) in enumerate(zip(sigmas, n_per, strict=True)):
        xs.append(centres[c] + s * rng.normal(size=(n, dim)))
        labels += [c] * n
    x = np.concatenate(xs).astype(np.float32)
    labels = np.array(labels)
    order = rng.permutation(len(x))
    x, labels = x[order], labels[order]
    shards = []
    for s, idx in enumerate(np.array_split(np.arange(len(x)), n_shards)):
        name = f"s{s:05d}"
        w = ShardWriter(str(tmp_path / f"{name}.tar"), str(tmp_path / f"{name}.arrays.npz"))
        for i in idx:
            w.write(Item(f"{name}/{i:08d}", {}, [], "", arrays={"embedding": x[i]}))
        w.close()
        shards.append((name, str(tmp_path / f"{name}.arrays.npz")))
    keys = {f"s{s:05d}/{i:08d}": labels[i] for s, idx in enumerate(np.array_split(np.arange(len(x)), n_shards))
            for i in idx}
    return shards, keys, x, labels


def test_variance_proportional_quotas_on_planted_clusters(tmp_path):
    sigmas, n_per = [0.5, 1.0, 2.0, 4.0], [150, 150, 150, 150]
    shards, keys, x, labels = _planted(tmp_path, sigmas, n_per)
    stage = Cluster({"k": 4, "target": 200, "floor": 10}, "cluster", seed=0)
    plans, report = plan_in_memory(stage, shards, str(tmp_path))
    clusters = report["clusters"]
    assert sorted(c["size"] for c in clusters) == [150] * 4
    # each found cluster is one planted cluster; its variance is the planted one (dim * sigma^2)
    by_var = sorted(clusters, key=lambda c: c["variance"])
    for c, s in zip(by_var, sigmas, strict=True):
        assert c["variance"] == pytest.approx(8 * s * s, rel=0.2)
    var = np.array([c["variance"] for c in clusters])
    expected = variance_quotas(np.array([150] * 4), var, 200, 10)
    assert [c["quota"] for c in clusters] == expected.tolist() and sum(expected) == 200
    # within rounding, quota - floor is proportional to the variance
    share = (expected - 10) / (200 - 40)
    assert np.allclose(share, var / var.sum(), atol=1 / 160)
    # the plan keeps exactly the quota of each planted cluster, and annotates every kept key with its cluster
    dropped = {k for p in plans.values() for k in p["drop"]}
    kept_labels = [keys[k] for k in keys if k not in dropped]
    counts = np.bincount(kept_labels, minlength=4)
    assert sorted(counts.tolist()) == sorted(expected.tolist())
    assert all(reason == "not_sampled" for p in plans.values() for reason in p["drop"].values())
    assert sum(len(p["meta"]) for p in plans.values()) == 200
    # deterministic: the same plan again
    again = Cluster({"k": 4, "target": 200, "floor": 10}, "cluster", seed=0)
    assert plan_in_memory(again, shards, str(tmp_path))[0] == plans


def test_broad_clusters_are_reclustered_and_semdedup_removes_planted_duplicates(tmp_path):
    # 2 planted groups, k=1: the single top-level cluster is too big and is split into sub-clusters
    shards, keys, x, labels = _planted(tmp_path, [1.0, 1.0], [120, 120], n_shards=2)
    plans, report = plan_in_memory(Cluster({"k": 1, "max_cluster_size": 150}, "cluster", 0), shards, str(tmp_path))
    assert report["reclustered"] == [0]
    assert sorted(c["cluster"] for c in report["clusters"]) == ["0.0", "0.1"]
    assert sorted(c["size"] for c in report["clusters"]) == [120, 120]
    metas = {k: m["cluster"] for p in plans.values() for k, m in p["meta"].items()}
    for c in ("0.0", "0.1"):
        assert len({labels_of for k, labels_of in keys.items() if metas[k] == c}) == 1  # a sub-cluster = a group
    # SemDeDup on centred embeddings (random directions, as normalised CLIP features are): near copies of 30
    # records in a later shard are removed, nothing else
    rng = np.random.default_rng(3)
    base = rng.normal(size=(200, 16)).astype(np.float32)
    shards2 = []
    for s, rows in enumerate((base[:100], base[100:], base[:30] + 1e-3 * rng.normal(size=(30, 16)))):
        name = f"s{s:05d}"
        w = ShardWriter(str(tmp_path / f"d{name}.tar"), str(tmp_path / f"d{name}.arrays.npz"))
        for j, row in enumerate(rows):
            w.write(Item(f"{name}/{j:08d}", {}, [], "", arrays={"embedding": row}))
        w.close()
        shards2.append((name, str(tmp_path / f"d{name}.arrays.npz")))
    plans, report = plan_in_memory(Cluster({"k": 3, "semdedup": 0.999}, "cluster", 0), shards2, str(tmp_path))
    drops = {k: r for p in plans.values() for k, r in p["drop"].items()}
    assert drops == {f"s00002/{j:08d}": "semantic_duplicate" for j in range(30)}
    assert sum(c["semantic_duplicates"] for c in report["clusters"]) == 30
