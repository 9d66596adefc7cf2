"""Exact and near-duplicate images by perceptual hash (imagehash's pHash: DCT of a 32x32 greyscale thumbnail,
64 bits).

Workers hash the first image of each record (and a SHA-1 of its bytes, for exact duplicates). The driver then finds
every pair at Hamming distance <= `max_distance` (d) and drops every record that has such a pair with an *earlier*
record (corpus order: shard, then position), as `exact_duplicate` (an earlier neighbour has the same bytes) or
`near_duplicate`. The first record of every group of near copies is kept. (A decision per record from its own
pairs, so it needs no union-find over the corpus; it differs from "keep one per connected group" only when a chain
a-b-c has b earlier than its only neighbour c: b is then kept.)

Crops, and mirrored copies. A 64-bit pHash sees the whole frame, so a copy cropped by 3-5% per side (a 6-11% zoom)
is often more than 8 bits away (issue 28 measured recall 0.84 / 0.66 / 0.45 at 3 / 4 / 5% per side). Each record
therefore also stores `window` hashes: the pHashes of sub-windows of its image at the scales `crop_windows`
(default 0.92 and 0.85 of each side), each at five anchors (centre and the four corners: a crop that takes more from
one side than the other shifts the content), plus the pHash of its mirror image (`mirror`). A cropped copy's whole
frame is close to one of its original's windows; the copy may come first in corpus order, so both directions are
searched: a record is also a near copy of an earlier record when its whole hash is within `window_distance`
(default 6, at most max_distance) of one of that record's window hashes, or one of its window hashes is within it
of that record's whole hash. Window-to-window matches are not used (two unrelated images'
windows are more alike than their frames). Measured (benchmarks/RESULTS.md): crops of 1-6% per side found at
0.98-1.00 where pHash alone finds 0.89 / 0.85 / 0.46 at 3 / 4 / 5%, mirrored copies at 1.00, and the windows add
no false drop among 1,000-2,000 distinct images. Why not CLIP features: they exist only where a local CLIP folder
is configured (embed/clip_score), and the cluster stage's SemDeDup already drops embedding near-copies there; the
window hashes need no model and keep the search exact.
Cost: eleven more pHashes per image (from one greyscale copy of at most 256 px, one batched DCT) and a second
multi-index search: the window hashes are indexed under their own block layout (for window_distance over ~12x the
rows) and only the frames are looked up among them, in either corpus order (the later record of a pair is dropped),
so the lookups stay one per frame and mask.

Pair search is exact and sub-quadratic: multi-index hashing (Norouzi et al., CVPR 2012). The 64 bits are cut into
m blocks; by pigeonhole, two hashes within distance d are within floor(d / m) = r in at least one block. Per block,
every record is looked up under its block value with each flip mask of <= r bits (sorted block values +
searchsorted), and each candidate is verified on all 64 bits; a pair is counted in the first block where it
qualifies, so each pair is found once. m is chosen by a cost model (masks per lookup x expected bucket size): for
d = 8, 9 blocks of 7 bits with exact block match on small corpora, 3 blocks of 21-22 bits with 2-bit flips from
about 10^5 records.

Bounded driver memory (the global index): the driver streams the sidecars once and spills, per block, rows of
(block value, hash, SHA-1 prefix, corpus position) into 2^p partition files by the top p bits of the block value,
with p chosen so a partition holds about `partition_rows` rows. A flip mask that changes top bits t sends the
lookup to partition A ^ t, so partition pairs (A, A ^ t) with popcount(t) <= r are joined, two partitions in
memory at a time (32 bytes a row, a few copies: about 130 MB at the default 2^20 rows) and at most CANDIDATES
candidate pairs at once. Drops go to one spill file per shard, and the plan is emitted shard by shard. The
partitions are read (1 + p + ... + C(p, r)) times each per block: the I/O price of the bound.
Limit: the bound assumes hashes spread over block values; a corpus dominated by one hash (e.g. millions of blank
images) puts them all in one partition and one bucket.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
from itertools import combinations

import numpy as np

from ..io import read_sidecar, spill_append, spill_read
from .base import GlobalStage, Options, register, with_first_image

BLOCK = 2048
WINDOW_SIDE = 256  # window hashes are taken from a greyscale copy at most this many pixels a side
CANDIDATES = 1 << 20  # candidate pairs checked at once (about 40 bytes each): bounds the join's working memory
LOOKUP = 2  # measured: one lookup (two binary searches) costs about as much as 2 vectorised candidate checks
TABLE_PER_ROW = 16  # a bucket-start table is used when it has at most 16 entries (64 bytes) a data row,
TABLE_MIN = 1 << 22  # or at most 2^22 entries (16 MB)
ROW = np.dtype([("v", "<u8"), ("h", "<u8"), ("sha", "<u8"), ("gid", "<i8")])  # gid = shard << 32 | row


def phash64(image) -> int:
    try:
        import imagehash
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("stage phash_dedup needs imagehash: pip install 'mindvl[curate]'") from exc
    bits = imagehash.phash(image, hash_size=8).hash.flatten()
    return int(np.packbits(bits.astype(np.uint8)).view(">u8")[0])


def window_boxes(width: int, height: int, scales: list[float]) -> list[tuple[int, int, int, int]]:
    """The sub-windows hashed for crop robustness: per scale, the centre and the four corners (PIL boxes)."""
    boxes = []
    for s in scales:
        w, h = max(1, round(width * s)), max(1, round(height * s))
        for ax, ay in ((0.5, 0.5), (0, 0), (1, 0), (0, 1), (1, 1)):
            x0, y0 = round((width - w) * ax), round((height - h) * ay)
            boxes.append((x0, y0, x0 + w, y0 + h))
    return boxes


def window_hashes(image, scales: list[float], mirror: bool) -> np.ndarray:
    """uint64 [5 * len(scales) + mirror]: the pHashes of `window_boxes` and (last) of the mirror image."""
    from PIL import Image, ImageOps

    # pHash reads a 32x32 greyscale thumbnail: converting once and shrinking once to WINDOW_SIDE keeps the eleven
    # hashes cheap on large images (each would otherwise resample the full image) and changes them very little.
    g = image.convert("L")
    if max(g.size) > WINDOW_SIDE:
        f = WINDOW_SIDE / max(g.size)
        g = g.resize((max(1, round(g.width * f)), max(1, round(g.height * f))), Image.Resampling.LANCZOS)
    thumbs = [g.resize((32, 32), Image.Resampling.LANCZOS, box=box) for box in window_boxes(g.width, g.height, scales)]
    if mirror:
        thumbs.append(ImageOps.mirror(g).resize((32, 32), Image.Resampling.LANCZOS))
    if not thumbs:
        return np.zeros(0, dtype=np.uint64)
    return phash64_thumbnails(np.stack([np.asarray(t, dtype=np.float64) for t in thumbs]))


# imagehash's pHash on 32x32 thumbnails, batched: the 8x8 lowest frequencies of scipy's unnormalised DCT-II along
# both axes (2 cos(pi k (2n + 1) / 64)), each bit "above the median of the 64"; bits row-major, big-endian.
_DCT8 = 2 * np.cos(np.pi * np.arange(8)[:, None] * (2 * np.arange(32)[None, :] + 1) / 64)


def phash64_thumbnails(thumbs: np.ndarray) -> np.ndarray:
    """uint64 [n] pHashes of greyscale thumbnails float [n, 32, 32] (phash64's value for the same thumbnail)."""
    low = (_DCT8 @ thumbs @ _DCT8.T).reshape(len(thumbs), 64)
    bits = low > np.median(low, axis=1, keepdims=True)
    return np.packbits(bits.astype(np.uint8), axis=1).view(">u8")[:, 0].astype(np.uint64)


def near_pairs_scan(hashes: np.ndarray, max_distance: int) -> list[tuple[int, int]]:
    """The quadratic reference: all (i, j), i < j, with popcount(h_i ^ h_j) <= max_distance, by blockwise XOR +
    popcount over all pairs (O(N^2 / 64) word operations). hashes: uint64 [N]."""
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


# ------------------------------------------------------------------------------------------ multi-index hashing


def n_masks(width: int, radius: int) -> int:
    return sum(math.comb(width, t) for t in range(min(radius, width) + 1))


def block_layout(max_distance: int, n: int) -> tuple[list[tuple[int, int]], int]:
    """([(bit offset, width)] of the m blocks, flip radius r = d // m), m minimising the expected work per record:
    m x masks(w, r) x (LOOKUP + n / 2^w), a lookup (binary search) costing about LOOKUP candidate checks."""
    best = None
    for m in range(1, min(max_distance + 1, 64) + 1):
        w, r = 64 // m, max_distance // m
        masks = n_masks(w, r)
        if masks > 1 << 22:
            continue
        cost = m * masks * (LOOKUP + n / 2.0 ** w)
        if best is None or cost < best[0]:
            best = (cost, m)
    m = best[1] if best else max_distance + 1
    widths = [64 // m + (1 if i < 64 % m else 0) for i in range(m)]
    offsets = np.cumsum([0, *widths[:-1]]).tolist()
    return list(zip(offsets, widths, strict=True)), max_distance // m


def flip_masks(width: int, radius: int) -> np.ndarray:
    """Every width-bit mask with at most `radius` bits set, uint64 [masks(w, r)]."""
    out = [0]
    for t in range(1, min(radius, width) + 1):
        out += [sum(1 << b for b in bits) for bits in combinations(range(width), t)]
    return np.array(out, dtype=np.uint64)


def block_value(h: np.ndarray, offset: int, width: int) -> np.ndarray:
    return (h >> np.uint64(offset)) & np.uint64((1 << width) - 1)


def join(q: np.ndarray, d: np.ndarray, masks: np.ndarray, max_distance: int, blocks: list[tuple[int, int]],
         k: int, radius: int, either_order: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pairs (query, data) of ROW arrays with data earlier than query (gid), hashes within max_distance, whose
    block values differ by one of `masks`, and not within `radius` in any block before k (found there already).
    Returns (query gid, data gid, same SHA-1) arrays. `either_order`: data rows earlier or later than the query
    (not the query's own record), returned as (later gid, earlier gid, same SHA-1)."""
    if not len(q) or not len(d):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=bool)
    order = np.argsort(d["v"], kind="stable")
    dv, dh, dsha, dgid = d["v"][order], d["h"][order], d["sha"][order], d["gid"][order]
    q = q[np.argsort(q["v"], kind="stable")]  # sorted queries: v ^ mask stays in few runs, lookups stay in cache
    out_q, out_d, out_x = [], [], []
    # queries per step: at most CANDIDATES candidates per mask, even if every lookup hits the largest bucket
    bucket = int(np.diff(np.flatnonzero(np.r_[True, dv[1:] != dv[:-1], True])).max())
    step = max(1, CANDIDATES // bucket)
    # where the block values are dense enough, a table of bucket starts (two gathers a lookup) replaces the two
    # binary searches: at most max(TABLE_PER_ROW entries a data row, TABLE_MIN) int32 entries
    base, span = dv[0], int(dv[-1] - dv[0]) + 1
    starts = (np.searchsorted(dv, base + np.arange(span + 1, dtype=np.uint64)).astype(np.int32)
              if span <= max(TABLE_PER_ROW * len(dv), TABLE_MIN) and len(dv) < 1 << 31 else None)
    for a in range(0, len(q), step):
        qc = q[a:a + step]
        for mask in masks:
            keys = qc["v"] ^ mask
            if starts is not None:
                rel = keys - base  # wraps to a huge value below base
                inside = rel < np.uint64(span)
                r_in = rel[inside].astype(np.int64)
                lo = np.zeros(len(keys), dtype=np.int64)
                cnt = np.zeros(len(keys), dtype=np.int64)
                lo[inside] = starts[r_in]
                cnt[inside] = starts[r_in + 1] - lo[inside]
            else:
                lo = np.searchsorted(dv, keys, side="left")
                cnt = np.searchsorted(dv, keys, side="right") - lo
            hit = np.nonzero(cnt)[0]
            if not len(hit):
                continue
            c = cnt[hit]
            qi = np.repeat(hit, c)
            di = np.repeat(lo[hit], c) + (np.arange(c.sum()) - np.repeat(np.cumsum(c) - c, c))
            x = qc["h"][qi] ^ dh[di]
            ok = np.bitwise_count(x) <= max_distance
            ok &= (dgid[di] != qc["gid"][qi]) if either_order else (dgid[di] < qc["gid"][qi])
            for off, width in blocks[:k]:  # found in an earlier block already
                ok &= np.bitwise_count(block_value(x, off, width)) > radius
            qi, di = qi[ok], di[ok]
            a, b = qc["gid"][qi], dgid[di]
            out_q.append(np.maximum(a, b) if either_order else a)
            out_d.append(np.minimum(a, b) if either_order else b)
            out_x.append(qc["sha"][qi] == dsha[di])
    if not out_q:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros(0, dtype=bool)
    return np.concatenate(out_q), np.concatenate(out_d), np.concatenate(out_x)


def near_pairs(hashes: np.ndarray, max_distance: int) -> list[tuple[int, int]]:
    """All (i, j), i < j, with popcount(h_i ^ h_j) <= max_distance, by multi-index hashing in memory (one
    partition). hashes: uint64 [N]. Same result as `near_pairs_scan`."""
    h = np.asarray(hashes, dtype=np.uint64)
    blocks, r = block_layout(max_distance, len(h))
    pairs = []
    for k, (off, width) in enumerate(blocks):
        rows = np.zeros(len(h), dtype=ROW)
        rows["v"], rows["h"], rows["gid"] = block_value(h, off, width), h, np.arange(len(h))
        qg, dg, _ = join(rows, rows, flip_masks(width, r), max_distance, blocks, k, r)
        pairs.extend(zip(dg.tolist(), qg.tolist(), strict=True))
    return sorted(pairs)


def duplicate_groups(n: int, pairs: list[tuple[int, int]]) -> np.ndarray:
    """Union-find over pairs: root[i] is the smallest index in i's group (for analysis; the stage drops by
    earlier neighbour)."""
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
        self.o = Options(cfg, {"max_distance": 8, "partition_rows": 1 << 20, "crop_windows": [0.92, 0.85],
                               "mirror": True, "window_distance": None}, where, {"window_distance": (int,)})
        if not 0 <= self.o.max_distance <= 64:
            raise ValueError(f"{where}.max_distance: must be in [0, 64], got {self.o.max_distance}")
        self.o.positive("partition_rows")
        scales = self.o.crop_windows
        if not isinstance(scales, list) or not all(isinstance(x, (int, float)) and 0.5 <= x < 1 for x in scales):
            raise ValueError(f"{where}.crop_windows: must be a list of scales in [0.5, 1) (e.g. [0.92, 0.85]; [] turns "
                             f"the crop windows off), got {scales!r}")
        dw = self.o.window_distance
        self.window_distance = min(6, self.o.max_distance) if dw is None else dw
        if not 0 <= self.window_distance <= self.o.max_distance:
            raise ValueError(f"{where}.window_distance: must be in [0, max_distance = {self.o.max_distance}], got "
                             f"{dw}")
        self.windows = len(scales) * 5 + bool(self.o.mirror)

    def annotate(self, batch):
        pairs, dropped = with_first_image(batch, keep_text_only=True)
        for item, image in pairs:
            if image is not None:  # text-only records are not image duplicates
                item.arrays["phash"] = np.uint64(phash64(image))
                item.arrays["sha1"] = np.frombuffer(hashlib.sha1(item.images[0]).digest()[:8], dtype="<u8")[0]
                if self.windows:
                    item.arrays["phash_windows"] = window_hashes(image, self.o.crop_windows, self.o.mirror)
        return [item for item, _ in pairs], dropped

    def plan(self, shards, workdir, emit):
        d, dw = self.o.max_distance, self.window_distance
        n = n_windows = 0
        for _name, path in shards:  # a first pass for the corpus size only (it sets the layout)
            side = read_sidecar(path, ("phash", "phash_windows"))
            n += len(side["phash"][0]) if "phash" in side else 0
            n_windows += side["phash_windows"][1].size if "phash_windows" in side else 0
        if n == 0:
            return {"records": 0, "pairs": 0, "dropped": 0}
        blocks, r = block_layout(d, n)
        bits = lambda rows, bl: min(max(0, math.ceil(math.log2(rows / self.o.partition_rows))),  # noqa: E731
                                    min(w for _, w in bl))
        p = bits(n, blocks)
        # Window rows get their own layout, for dw over all the rows they are looked up among (frames + windows,
        # ~12x the frames): with the frames' layout the buckets would hold ~12x the candidates. The frames are
        # spilled a second time under it ("f"), beside the windows ("w").
        blocks_w, r_w = block_layout(dw, n + n_windows) if n_windows else ([], 0)
        p_w = bits(max(n, n_windows), blocks_w) if n_windows else 0
        spill = os.path.join(workdir, "dedup_spill")
        shutil.rmtree(spill, ignore_errors=True)
        os.makedirs(spill)
        part = lambda kind, k, a: os.path.join(spill, f"{kind}{k}.p{a}")  # noqa: E731

        def spill_rows(kind: str, layout: list[tuple[int, int]], pb: int, h: np.ndarray, sha: np.ndarray,
                       gid: np.ndarray) -> None:
            rows = np.zeros(len(h), dtype=ROW)
            rows["h"], rows["sha"], rows["gid"] = h, sha, gid
            for k, (off, width) in enumerate(layout):
                rows["v"] = block_value(h, off, width)
                pa = (rows["v"] >> np.uint64(width - pb)).astype(np.int64) if pb else np.zeros(len(h), np.int64)
                order = np.argsort(pa, kind="stable")
                bounds = np.searchsorted(pa[order], np.arange((1 << pb) + 1))
                for a in np.unique(pa):
                    spill_append(part(kind, k, a), rows[order[bounds[a]:bounds[a + 1]]])

        # 1. the index, spilled per block and partition: frames ("b"), and under the window layout frames ("f") and
        # window hashes ("w", SHA-1 0)
        for s, (_name, path) in enumerate(shards):
            side = read_sidecar(path, ("phash", "sha1", "phash_windows"))
            if "phash" not in side:
                continue
            h = side["phash"][1].astype(np.uint64)
            sha = side["sha1"][1].astype(np.uint64)
            gid = (s << 32) + np.arange(len(h), dtype=np.int64)
            spill_rows("b", blocks, p, h, sha, gid)
            if "phash_windows" in side:
                if side["phash_windows"][0] != side["phash"][0]:
                    raise ValueError(f"{path}: phash_windows rows do not match phash rows (a sidecar written by "
                                     "another version? rerun the phash_dedup stage)")
                win = side["phash_windows"][1].astype(np.uint64)
                spill_rows("f", blocks_w, p_w, h, sha, gid)
                spill_rows("w", blocks_w, p_w, win.reshape(-1), np.zeros(win.size, np.uint64),
                           np.repeat(gid, win.shape[1]))

        # 2. per block, partition pairs (A, A ^ t) joined two at a time; drops spilled per shard: frames vs frames
        # within d, then frames vs windows within dw
        def joins(layout, radius, pb, kinds, dist, either_order=False):
            found = 0
            for k, (_off, width) in enumerate(layout):
                masks = flip_masks(width, radius)
                tops = masks >> np.uint64(width - pb) if pb else np.zeros(len(masks), np.uint64)
                by_top = {int(t): masks[tops == t] for t in np.unique(tops)}
                for a in range(1 << pb):
                    qs = {qk: spill_read(part(qk, k, a), ROW) for qk, _ in kinds}
                    if not any(len(q) for q in qs.values()):
                        continue
                    for t, masks_t in by_top.items():
                        for qk, dk in kinds:
                            q = qs[qk]
                            if not len(q):
                                continue
                            data = qs[dk] if t == 0 and dk in qs else spill_read(part(dk, k, a ^ t), ROW)
                            qg, _dg, exact = join(q, data, masks_t, dist, layout, k, radius, either_order)
                            found += len(qg)
                            self._spill_drops(spill, qg, exact if qk == dk else np.zeros(len(qg), dtype=bool))
            return found

        pairs = joins(blocks, r, p, [("b", "b")], d)
        # one join, frames looked up among the windows, either order (the later record of a pair is dropped):
        # the lookups are the frames', not the ~12x more windows'
        window_pairs = joins(blocks_w, r_w, p_w, [("f", "w")], dw, either_order=True) if n_windows else 0
        # 3. the plan, shard by shard
        counts = {"exact_duplicate": 0, "near_duplicate": 0}
        for s, (name, path) in enumerate(shards):
            code = spill_read(os.path.join(spill, f"drops{s}"), np.int64)
            if not len(code):
                continue
            code = np.unique(code)  # row * 2 + exact: a row found exact and near keeps its last code (exact)
            rows, exact = code >> 1, code & 1
            last = np.r_[rows[1:] != rows[:-1], True]
            keys = read_sidecar(path, ("phash",))["phash"][0]
            drop = {keys[i]: "exact_duplicate" if x else "near_duplicate"
                    for i, x in zip(rows[last].tolist(), exact[last].tolist(), strict=True)}
            for reason in drop.values():
                counts[reason] += 1
            emit(name, {"drop": drop, "meta": {}})
        shutil.rmtree(spill, ignore_errors=True)
        return {"records": n, "pairs": pairs, "window_pairs": window_pairs, "dropped": sum(counts.values()),
                **counts, "max_distance": d, "window_distance": dw, "windows_per_record": n_windows // n,
                "blocks": len(blocks), "flip_radius": r, "partitions": 1 << p,
                **({"window_blocks": len(blocks_w), "window_flip_radius": r_w, "window_partitions": 1 << p_w}
                   if n_windows else {})}

    @staticmethod
    def _spill_drops(spill: str, gid: np.ndarray, exact: np.ndarray) -> None:
        if not len(gid):
            return
        shard = gid >> 32
        code = ((gid & 0xFFFFFFFF) << 1) | exact.astype(np.int64)
        order = np.argsort(shard, kind="stable")
        shard, code = shard[order], code[order]
        for s in np.unique(shard):
            lo, hi = np.searchsorted(shard, [s, s + 1])
            spill_append(os.path.join(spill, f"drops{s}"), code[lo:hi])
