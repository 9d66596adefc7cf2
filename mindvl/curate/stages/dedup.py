"""Exact and near-duplicate images by perceptual hash (imagehash's pHash: DCT of a 32x32 greyscale thumbnail,
64 bits).

Workers hash the first image of each record (and a SHA-1 of its bytes, for exact duplicates). The driver then finds
every pair at Hamming distance <= `max_distance`, joins them into groups (union-find) and keeps, in each group, the
record that comes first in corpus order (shard, then position); the others are dropped as `exact_duplicate` (same
bytes or same pixels hash with distance 0 and same bytes) or `near_duplicate`.

Pair search is exact: blockwise XOR + popcount over all pairs (numpy), O(N^2 / 64) word operations, about a second
for 20k records. Memory: 8 bytes a record for the hashes plus one block of distances.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..io import read_sidecar
from .base import GlobalStage, Options, register, with_first_image

BLOCK = 2048


def phash64(image) -> int:
    try:
        import imagehash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("stage phash_dedup needs imagehash: pip install 'mindvl[curate]'") from exc
    bits = imagehash.phash(image, hash_size=8).hash.flatten()
    return int(np.packbits(bits.astype(np.uint8)).view(">u8")[0])


def near_pairs(hashes: np.ndarray, max_distance: int) -> list[tuple[int, int]]:
    """All (i, j), i < j, with popcount(h_i ^ h_j) <= max_distance. hashes: uint64 [N]."""
    pairs = []
    n = len(hashes)
    for a in range(0, n, BLOCK):  # 2-D blocks bound memory to BLOCK^2 distances
        rows = hashes[a:a + BLOCK]
        for b in range(a, n, BLOCK):
            d = np.bitwise_count(rows[:, None] ^ hashes[None, b:b + BLOCK])
            ii, jj = np.nonzero(d <= max_distance)
            ii, jj = ii + a, jj + b
            keep = jj > ii
            pairs.extend(zip(ii[keep].tolist(), jj[keep].tolist(), strict=True))
    return pairs


def duplicate_groups(n: int, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Union-find over pairs: root[i] is the smallest index in i's group."""
    parent = np.arange(n)

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for i, j in pairs:
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) for i in range(n)])


@register
class PhashDedup(GlobalStage):
    name = "phash_dedup"

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"max_distance": 8}, where)
        if not 0 <= self.o.max_distance <= 64:
            raise ValueError(f"{where}.max_distance: must be in [0, 64], got {self.o.max_distance}")

    def annotate(self, batch):
        pairs, dropped = with_first_image(batch, keep_text_only=True)
        for item, image in pairs:
            if image is not None:  # text-only records are not image duplicates
                item.arrays["phash"] = np.uint64(phash64(image))
                item.arrays["sha1"] = np.frombuffer(hashlib.sha1(item.images[0]).digest()[:8], dtype="<u8")[0]
        return [item for item, _ in pairs], dropped

    def plan(self, shards, workdir):
        keys, hashes, shas = [], [], []
        for _name, path in shards:
            side = read_sidecar(path, ("phash", "sha1"))
            if "phash" not in side:
                continue
            keys.extend(side["phash"][0])
            hashes.append(side["phash"][1].astype(np.uint64))
            shas.append(side["sha1"][1].astype(np.uint64))
        plans: dict[str, dict] = {}
        if not keys:
            return plans, {"groups": 0}
        h, s = np.concatenate(hashes), np.concatenate(shas)
        pairs = near_pairs(h, self.o.max_distance)
        root = duplicate_groups(len(keys), pairs)
        n_groups = 0
        for i in range(len(keys)):
            r = int(root[i])
            if r == i:
                continue
            reason = "exact_duplicate" if s[i] == s[r] else "near_duplicate"
            shard = keys[i].split("/", 1)[0]
            plans.setdefault(shard, {"drop": {}, "meta": {}})["drop"][keys[i]] = reason
        n_groups = len(set(root[root != np.arange(len(keys))].tolist()))
        return plans, {"records": len(keys), "pairs": len(pairs), "groups": n_groups,
                       "max_distance": self.o.max_distance}
