"""Corpus-scale plans: exact multi-index near-duplicate search, exact streaming selections, and driver memory that
does not grow with the number of records (global plans keep per-record state in spill files)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from mindvl.curate.io import ShardWriter, read_sidecar
from mindvl.curate.items import Item
from mindvl.curate.sampling import select_smallest, semdedup, semdedup_rows
from mindvl.curate.stages.base import plan_in_memory
from mindvl.curate.stages.cluster import Cluster
from mindvl.curate.stages.dedup import PhashDedup, block_layout, near_pairs, near_pairs_scan
from mindvl.curate.stages.embed import TopFraction


def _planted_hashes(n: int, copies: int, flips: int, seed: int) -> np.ndarray:
    """n // copies random 64-bit hashes, each `copies` times with up to `flips` random bits flipped, shuffled."""
    rng = np.random.default_rng(seed)
    h = np.repeat(rng.integers(0, 2**63, size=n // copies, dtype=np.uint64) * np.uint64(2) + np.uint64(1), copies)
    for _ in range(flips):
        m = rng.random(len(h)) < 0.6
        h[m] ^= np.uint64(1) << rng.integers(0, 64, size=int(m.sum())).astype(np.uint64)
    return h[rng.permutation(len(h))]


@pytest.mark.parametrize("n,d,flips", [(600, 0, 1), (1200, 3, 3), (3000, 8, 7), (900, 12, 9), (20000, 8, 7)])
def test_multi_index_search_finds_exactly_the_pairs_of_the_full_scan(n, d, flips):
    h = _planted_hashes(n, 3, flips, seed=n + d)
    blocks, r = block_layout(d, len(h))
    assert sum(w for _, w in blocks) == 64 and len(blocks) * (r + 1) > d  # the pigeonhole holds
    found = near_pairs(h, d)
    assert len(found) == len(set(found))  # each pair once, though it may qualify in several blocks
    assert set(found) == set(near_pairs_scan(h, d))
    assert len(found) > n // 10  # planted pairs exist at this distance


def test_block_layout_switches_to_flips_on_large_corpora():
    # d = 8: exact block match (9 blocks) on small corpora; 2-bit flips in 3 blocks once buckets would be large
    assert block_layout(8, 1000)[1] == 0 and len(block_layout(8, 1000)[0]) == 9
    blocks, r = block_layout(8, 10**7)
    assert (len(blocks), r) == (3, 2)


def _sidecars(tmp_path, columns: dict[str, np.ndarray], per_shard: int, prefix: str = "") -> list[tuple[str, str]]:
    """Shard sidecars as ShardWriter lays them out ({name: values, name__keys: keys}), written directly (fast)."""
    n = len(next(iter(columns.values())))
    shards = []
    for s, a in enumerate(range(0, n, per_shard)):
        name = f"s{s:05d}"
        path = str(tmp_path / f"{prefix}{name}.arrays.npz")
        keys = np.asarray([f"{name}/{i:08d}" for i in range(min(per_shard, n - a))], dtype=str)
        arrays = {k: v[a:a + per_shard] for k, v in columns.items()}
        np.savez(path, **arrays, **{f"{k}__keys": keys for k in columns})
        shards.append((name, path))
    return shards


def test_sidecar_layout_is_the_writers(tmp_path):
    w = ShardWriter(str(tmp_path / "s00000.tar"), str(tmp_path / "w.arrays.npz"))
    for i in range(3):
        w.write(Item(f"s00000/{i:08d}", {}, [], "", arrays={"phash": np.uint64(i), "sha1": np.uint64(7)}))
    w.close()
    direct = _sidecars(tmp_path, {"phash": np.arange(3, dtype=np.uint64), "sha1": np.full(3, 7, np.uint64)}, 3)
    a, b = read_sidecar(str(tmp_path / "w.arrays.npz")), read_sidecar(direct[0][1])
    assert a.keys() == b.keys() and all(a[k][0] == b[k][0] and (a[k][1] == b[k][1]).all() for k in a)


def test_partitioned_dedup_plan_equals_the_in_memory_reference(tmp_path):
    d = 8
    h = _planted_hashes(2400, 4, 9, seed=5)
    sha = np.arange(len(h), dtype=np.uint64)
    sha[1::7] = sha[0::7][: len(sha[1::7])]  # some records carry the same bytes as an earlier one
    h[1::7] = h[0::7][: len(h[1::7])]
    shards = _sidecars(tmp_path, {"phash": h, "sha1": sha}, per_shard=500)
    # reference: a record is dropped when an earlier one is within d (exact when an earlier one has its bytes)
    pairs = near_pairs_scan(h, d)
    expected: dict[int, str] = {}
    for i, j in pairs:
        if sha[i] == sha[j] or expected.get(j) != "exact_duplicate":
            expected[j] = "exact_duplicate" if sha[i] == sha[j] else "near_duplicate"
    key = lambda j: f"s{j // 500:05d}/{j % 500:08d}"  # noqa: E731
    for rows in (1 << 20, 64):  # one partition; 2^p partitions joined pairwise (flip masks crossing partitions)
        plans, report = plan_in_memory(PhashDedup({"max_distance": d, "partition_rows": rows}, "dedup", 0), shards,
                                       str(tmp_path))
        got = {k: r for p in plans.values() for k, r in p["drop"].items()}
        assert got == {key(j): r for j, r in expected.items()}, rows
        assert report["pairs"] == len(pairs) and report["dropped"] == len(expected)
        assert report["partitions"] == (1 if rows > 2400 else 64)
    assert 0 < sum(r == "exact_duplicate" for r in expected.values()) < len(expected)


def test_select_smallest_is_the_stable_sort_rule():
    rng = np.random.default_rng(0)
    for trial in range(60):
        n = int(rng.integers(0, 2000))
        kind = trial % 3  # few distinct values (ties), full-range values, values sharing their top bits
        v = (rng.integers(0, 5, size=n).astype(np.uint64) if kind == 0 else
             rng.integers(0, 2**63, size=n, dtype=np.uint64) * np.uint64(2) if kind == 1 else
             (rng.integers(0, 40, size=n).astype(np.uint64) << np.uint64(44)) | np.uint64(3))
        k = int(rng.integers(0, n + 2))
        t, take = select_smallest(lambda v=v: (v[a:a + 97] for a in range(0, len(v), 97)), k,
                                  gather=int(rng.choice([0, 10, 1 << 20])))
        keep = v < np.uint64(t)
        keep[np.nonzero(v == np.uint64(t))[0][:take]] = True
        expected = np.zeros(n, dtype=bool)
        expected[np.argsort(v, kind="stable")[:k]] = True
        assert (keep == expected).all(), (trial, n, k)


def test_semdedup_read_in_blocks_equals_the_dense_rule():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(230, 12)).astype(np.float32)
    x = np.concatenate([x, x[:40] + 1e-4 * rng.normal(size=(40, 12)).astype(np.float32), x[200:]])
    dense = semdedup(x, 0.99, block=len(x))
    assert dense[:230].all() and not dense[230:].any()
    for block in (1, 7, 64):
        assert (semdedup_rows(lambda a, b: x[a:b], len(x), 0.99, block) == dense).all()


def test_top_fraction_ties_go_to_the_earliest_keys(tmp_path):
    scores = np.array([0.5, 0.9, 0.5, 0.5, 0.1, 0.9, 0.5, -0.0, 0.0, 0.5], dtype=np.float64)
    src = np.array(["a"] * 10)
    shards = _sidecars(tmp_path, {"top_clip_score": scores, "top_source": src}, per_shard=3)
    plans, report = plan_in_memory(TopFraction({"fraction": 0.4}, "top", 0), shards, str(tmp_path))
    order = sorted(range(10), key=lambda i: (-scores[i], i))  # the rule: highest score first, ties by key
    keys = [f"s{i // 3:05d}/{i % 3:08d}" for i in range(10)]
    assert {k for p in plans.values() for k in p["drop"]} == {keys[i] for i in order[4:]}
    assert report["groups"]["a"] == {"records": 10, "kept": 4, "min_kept_score": 0.5}


def _plan_peak(stage, shards, workdir) -> int:
    """Peak traced allocation of `stage.plan`, each shard's plan dropped once emitted (as the runner writes it)."""
    tracemalloc.start()
    stage.plan(shards, workdir, lambda name, plan: None)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("which", ["phash_dedup", "cluster"])
def test_driver_memory_of_a_plan_does_not_grow_with_the_corpus(tmp_path, which, monkeypatch):
    """Same shard size, 4x the shards: the plan's peak Python/numpy allocation (tracemalloc) stays flat: here
    0.39 -> 0.43 MB (dedup) and 1.19 -> 1.19 MB (cluster). The plans before spill files held every key, hash and
    pair, or key and embedding: 38.2 -> 44.8 MB and 12.0 -> 27.9 MB on these corpora."""
    if which == "cluster":
        pytest.importorskip("faiss")
    # the working-set bounds, small enough that both corpora reach them (a leaf is larger than a block, ...)
    monkeypatch.setattr("mindvl.curate.stages.dedup.CANDIDATES", 4096)
    monkeypatch.setattr("mindvl.curate.stages.cluster.SEMDEDUP_BLOCK", 128)
    monkeypatch.setattr("mindvl.curate.stages.cluster.SPILL_CHUNK", 256)
    peaks = []
    for n in (600, 3000, 12000):  # the first run only warms up (lazy imports, numpy caches): not compared
        rng = np.random.default_rng(n)
        if which == "phash_dedup":
            h = _planted_hashes(n, 4, 6, seed=n)
            cols = {"phash": h, "sha1": np.arange(len(h), dtype=np.uint64)}
            stage = PhashDedup({"max_distance": 8, "partition_rows": 1000}, "dedup", 0)
        else:
            cols = {"embedding": (rng.normal(size=(n, 16)) + 8 * rng.integers(0, 6, size=(n, 1))).astype(np.float32)}
            stage = Cluster({"k": 6, "max_train": 1000, "target": n // 2, "semdedup": 0.999}, "cluster", 0)
        d = tmp_path / str(n)
        d.mkdir()
        peaks.append(_plan_peak(stage, _sidecars(d, cols, per_shard=500), str(d)))
    assert peaks[2] < peaks[1] + 200_000, peaks  # < 23 bytes a record more
