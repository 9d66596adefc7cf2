"""Expert-cache simulation: hit rates of LRU, LFU, Belady, the SCH look-ahead oracle and a static cache.

**Semantics (the reference's "repo-compatible mode", the defaults).** One cache per sequence, starting empty:
1. *Batched pre-token lookup* (`lookup="pre"`): all k experts of token i are checked against the cache as it was
   before token i; each one found is a hit.
2. *Sequential inserts in score order*: afterwards the k experts are processed one after another. An expert already
   cached only refreshes its bookkeeping; a missing one evicts the lowest-priority cached expert, which may be an
   expert of the same token that has not been processed yet (it is still counted as a hit by step 1).
3. *Warm start* (`warm_start=True`): a first-ever use of an expert in the sequence that finds a free slot counts as
   a hit (compulsory misses into free slots are free), so the hit rate is exactly 1 once the cache holds every
   expert. `warm_start=False` counts those first uses as misses (the old repo's CHR).
4. The hit rate is hits / accesses, accesses = tokens·k, summed over sequences (token-weighted).

Switches for physically faithful variants: `lookup="seq"` counts a hit only if the expert is resident when it is
processed; `pin=True` forbids evicting experts of the current token (when every cached expert is pinned, a missing
expert is served without being cached).

**Eviction priorities** (the lowest is evicted; stamps count expert accesses, so they are unique):
- `lru`: last-access stamp.
- `lfu`: (uses since the sequence start, counted also while not cached, then last-access stamp).
- `belady`: minus the stamp of the next access (per access, not per token); experts never used again get stamps
  after the sequence's end in id order, so the highest id goes first. For k = 1 this is the exact MIN; for k > 1 the
  within-token rules make it a heuristic, not a bound.
- `fsf` (SCH's look-ahead oracle, `segment` = m): (uses in tokens [i, i+m), then last-access stamp). An expert of
  token i that has been processed no longer counts token i (window [i+1, i+m)). Windows are clipped at the sequence
  end. With m = 1 it behaves as LRU.
- `static`: a fixed cache of the c experts used most often over all the given sequences (per layer, or over all
  layers for the pooled cache; ties by lower id); it is preloaded, so none of the switches apply.

**Cache sizes** are ratios ρ of slots to active experts: ρ·k slots per layer, ρ·L·k for the pooled cache, which
one cache serves for all layers (expert ids offset by layer·E, a token's accesses are layer 0's top-k, then layer
1's, ...). `round(ρ·k)` (half up) gives the slots actually used, which the results report. A cache with more
slots than experts behaves like one holding every expert.

**Implementation.** With numba installed, `mindvl.moe_analysis._compiled` runs every policy but `static` as compiled
kernels: one stream at a time, all cache sizes in one stack-algorithm pass (per-size simulations when pinned). The
numpy fallback below gives the same numbers (tested). The numpy policies are stack-free per-size simulations,
vectorised across every independent cache at once (sequences × layers × cache sizes), looping only over token
positions and the k (or L·k) accesses of a token, which are inherently sequential. Priorities that do not depend
on the cache (next use, future counts, use counts) are precomputed from one sort of all accesses; the look-ahead
counts of cached experts are kept current by adding one when an expert enters the far end of the window.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from mindvl.moe_analysis import _compiled
from mindvl.moe_analysis._routing import Routing, as_routing, parse_cache_slots

POLICIES = ("lru", "lfu", "belady", "fsf", "static")
LOOKUPS = ("pre", "seq")

_CHUNK_ACCESSES = 1 << 24  # accesses simulated together; bounds memory (~1 GB peak) on a full trace


@dataclass(frozen=True)
class HitRateResult:
    """Hit rates of one policy at several cache sizes.

    `layer[l, i]` is layer l's own cache (c = `layer_slots[i]`), `layer_mean[i]` pools hits and accesses of all
    per-layer caches, and `pooled[i]` is the one cache shared by all layers (c = `pooled_slots[i]`); `pooled` is
    None when it was not asked for. With a single layer, `pooled` equals `layer[0]`.
    """

    policy: str
    segment: int | None
    ratios: tuple[float, ...]
    layer_slots: tuple[int, ...] | None
    pooled_slots: tuple[int, ...] | None
    layer: np.ndarray | None
    layer_mean: np.ndarray | None
    pooled: np.ndarray | None
    semantics: dict
    sequences: int

    def to_dict(self) -> dict:
        def arr(a):
            return None if a is None else np.asarray(a, float).tolist()

        return {
            "policy": self.policy, "segment": self.segment, "ratios": list(self.ratios),
            "layer_slots": None if self.layer_slots is None else list(self.layer_slots),
            "pooled_slots": None if self.pooled_slots is None else list(self.pooled_slots),
            "layer": arr(self.layer), "layer_mean": arr(self.layer_mean), "pooled": arr(self.pooled),
            "semantics": dict(self.semantics), "sequences": self.sequences,
        }


def hit_rate(
    topk,
    num_experts: int | None = None,
    policy: str = "lru",
    cache_sizes: Sequence[float] | float = (0.5, 1, 2, 4),
    *,
    segment: int | None = None,
    lookup: str = "pre",
    pin: bool = False,
    warm_start: bool = True,
    sequence_stride: int = 1,
    per_layer: bool = True,
    pooled: bool = True,
) -> HitRateResult:
    """Hit rates of `policy` for per-layer caches and the pooled cache (module docstring for every rule).

    `topk` is any routing input of `mindvl.moe_analysis.metrics` (arrays [S, T, k] / [L, S, T, k], ragged lists,
    a RouterTrace). `segment` is the look-ahead m of `fsf` and must be omitted for other policies.
    `sequence_stride` keeps every n-th sequence (the reference's SCH uses 16).
    """
    policy = _check_policy(policy, segment, lookup)
    if not (per_layer or pooled):
        raise ValueError("nothing to simulate: enable per_layer or pooled caches")
    routing = as_routing(topk, num_experts).every(int(sequence_stride))
    ratios, layer_slots = parse_cache_slots(cache_sizes, routing.k * (1 if per_layer else routing.num_layers))
    layer_slots = layer_slots if per_layer else ()
    pooled_slots = parse_cache_slots(ratios, routing.k * routing.num_layers)[1] if pooled else ()
    layer_rates = layer_mean = pooled_rates = None
    static = _static_hits(routing, layer_slots, pooled_slots) if policy == "static" else None
    compiled = static is None and _compiled.available()
    starts, ends = routing.offsets[:-1], routing.offsets[1:]
    if per_layer:
        hits = np.zeros((routing.num_layers, len(ratios)), np.int64)
        if static is not None:
            hits = static[0]
        elif compiled:
            hits = _compiled.simulate(routing.ids, np.arange(routing.num_layers), starts, ends, routing.num_experts,
                                      policy, segment, layer_slots, lookup, pin, warm_start).sum(1)
        else:
            for chunk in _layer_chunks(routing):
                got = _run(chunk, routing.num_experts, policy, segment, layer_slots, lookup, pin, warm_start)
                np.add.at(hits, chunk.owner, got)
        accesses = routing.num_tokens * routing.k
        layer_rates = hits / accesses
        layer_mean = hits.sum(0) / (accesses * routing.num_layers)
    if pooled:
        hits = np.zeros(len(ratios), np.int64)
        items = routing.num_experts * routing.num_layers
        if static is not None:
            hits = static[1]
        elif compiled:
            hits = _compiled.simulate(routing.ids, np.array([-1]), starts, ends, routing.num_experts, policy,
                                      segment, pooled_slots, lookup, pin, warm_start).sum((0, 1))
        else:
            for chunk in _pooled_chunks(routing):
                hits += _run(chunk, items, policy, segment, pooled_slots, lookup, pin, warm_start).sum(0)
        pooled_rates = hits / (routing.num_tokens * routing.k * routing.num_layers)
    return HitRateResult(
        policy=policy, segment=segment, ratios=ratios, layer_slots=layer_slots if per_layer else None,
        pooled_slots=pooled_slots if pooled else None, layer=layer_rates, layer_mean=layer_mean,
        pooled=pooled_rates, sequences=int(routing.lengths.shape[0]),
        semantics={"lookup": lookup, "pin": bool(pin), "warm_start": bool(warm_start),
                   "sequence_stride": int(sequence_stride)},
    )


def _check_policy(policy: str, segment: int | None, lookup: str) -> str:
    policy = str(policy).lower()
    if policy not in POLICIES:
        raise ValueError(f"unknown cache policy {policy!r}; choose one of {', '.join(POLICIES)}")
    if policy == "fsf":
        if segment is None or int(segment) != segment or segment < 1:
            raise ValueError(f"the fsf (SCH) policy needs a positive integer segment length, got {segment}")
    elif segment is not None:
        raise ValueError(f"segment is the look-ahead of the fsf policy; policy {policy!r} takes none")
    if lookup not in LOOKUPS:
        raise ValueError(f"lookup must be one of {LOOKUPS}, got {lookup!r}")
    return policy


# ---- streams: one independent cache per row ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Chunk:
    """Access streams simulated together: ids [n, T_max, K] (padded), lengths [n] (descending), owner [n]."""

    ids: np.ndarray
    lengths: np.ndarray
    owner: np.ndarray


def _layer_chunks(routing: Routing) -> Iterator[_Chunk]:
    """One stream per (layer, sequence), a few layers per chunk."""
    per_layer = routing.num_tokens * routing.k
    group = max(1, _CHUNK_ACCESSES // max(per_layer, 1))
    for first in range(0, routing.num_layers, group):
        layers = list(range(first, min(first + group, routing.num_layers)))
        seqs = [(layer, routing.ids[layer]) for layer in layers]
        yield _make_chunk([(layer, ids[a:b]) for layer, ids in seqs
                           for a, b in zip(routing.offsets[:-1], routing.offsets[1:], strict=True)])


def _pooled_chunks(routing: Routing) -> Iterator[_Chunk]:
    """One stream per sequence whose token carries all layers' experts, offset by layer·E."""
    offset = (np.arange(routing.num_layers, dtype=np.int32) * routing.num_experts)[:, None, None]
    per_seq = int(routing.lengths.max()) * routing.k * routing.num_layers
    group = max(1, _CHUNK_ACCESSES // per_seq)
    bounds = list(zip(routing.offsets[:-1], routing.offsets[1:], strict=True))
    for first in range(0, len(bounds), group):
        streams = []
        for a, b in bounds[first:first + group]:
            block = routing.ids[:, a:b].astype(np.int32) + offset  # [L, T, k]
            streams.append((0, block.transpose(1, 0, 2).reshape(b - a, -1)))
        yield _make_chunk(streams)


def _make_chunk(streams: list[tuple[int, np.ndarray]]) -> _Chunk:
    """Pad streams to one array, longest first, so the live streams at any position are a prefix."""
    lengths = np.array([s.shape[0] for _, s in streams], np.int64)
    order = np.argsort(-lengths, kind="stable")
    t_max, width = int(lengths.max()), streams[0][1].shape[1]
    ids = np.zeros((len(streams), t_max, width), np.int32)
    for row, src in enumerate(order):
        ids[row, : lengths[src]] = streams[src][1]
    owner = np.array([streams[i][0] for i in order], np.int64)
    return _Chunk(ids, lengths[order], owner)


# ---- per-access precomputation --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Scale:
    """Integer encoding of priorities: primary·one + stamp, plus sentinels, in int32 whenever it fits.

    Narrow priorities halve the memory traffic of the argmin that dominates the simulation.
    """

    dtype: type
    one: int  # one unit of the primary key (use count); stamps stay below it
    free: int  # an empty slot: always taken first
    locked: int  # a slot past this row's cache size: never taken
    pin: int  # added while an expert belongs to the current token (pin=True)
    pin_level: int  # priorities at or above this are pinned or locked

    @staticmethod
    def for_chunk(chunk: _Chunk, num_items: int, policy: str, segment: int | None) -> _Scale:
        t_max, width = chunk.ids.shape[1:]
        shift = int(t_max * width + num_items + 1).bit_length()
        primary = {"lru": 0, "belady": 0, "lfu": t_max + 1, "fsf": (segment or 0) + 1}[policy]
        top = shift + int(primary).bit_length()
        if top <= 27:
            return _Scale(np.int32, 1 << shift, -(1 << 30), 1 << 30, 1 << 28, 1 << 27)
        if top > 58:
            raise ValueError(f"sequences of {t_max} tokens x {width} accesses are too long to simulate")
        return _Scale(np.int64, 1 << shift, -(1 << 62), 1 << 62, 1 << 60, 1 << 59)


def _access_keys(chunk: _Chunk, num_items: int, policy: str, segment: int | None, scale: _Scale,
                 need_first: bool = True):
    """(key [n, T, K], first [n, T, K] bool or None, distinct [n]): priority after each access, first uses (only
    when `need_first`), distinct items per stream.

    Accesses are sorted once by (item, stream, time) (a stable radix sort by item keeps stream-major time order), so
    every (stream, item) history is contiguous: its previous/next access and its uses within the next m tokens are
    neighbours and binary searches away.
    """
    n, t_max, width = chunk.ids.shape
    if np.all(chunk.lengths == t_max):
        flat_valid = None  # the common equal-length case: every access is real
        items = chunk.ids.reshape(-1)
    else:
        valid = np.arange(t_max)[None, :] < chunk.lengths[:, None]  # [n, T]
        flat_valid = np.flatnonzero(np.broadcast_to(valid[:, :, None], chunk.ids.shape).reshape(-1))
        items = chunk.ids.reshape(-1)[flat_valid]
    order = np.argsort(items.astype(np.int16 if num_items < 32768 else np.int32), kind="stable")
    pos = order if flat_valid is None else flat_valid[order]  # flat [n, T, K] position of each sorted access
    row, stamp = np.divmod(pos, t_max * width)  # the stamp counts accesses within the stream
    group = items[order].astype(np.int64) * n + row
    idx = np.arange(pos.shape[0], dtype=np.int64)
    same_next = np.zeros(pos.shape[0], bool)
    same_next[:-1] = group[1:] == group[:-1]
    new_group = np.ones(pos.shape[0], bool)
    new_group[1:] = ~same_next[:-1]
    occ = idx - np.maximum.accumulate(np.where(new_group, idx, 0))  # earlier uses in this stream
    if policy == "lru":
        val = stamp
    elif policy == "lfu":
        val = (occ + 1) * scale.one + stamp
    elif policy == "belady":
        nxt = np.minimum(idx + 1, idx.shape[0] - 1)
        sentinel = chunk.lengths[row] * width + items[order]
        val = -np.where(same_next, stamp[nxt], sentinel)
    else:  # fsf: uses in tokens (t, t+m) of the same stream, i.e. the window after this access
        key = group * (t_max + segment + 2) + stamp // width
        future = np.searchsorted(key, key + segment, side="left") - idx - 1
        val = future * scale.one + stamp
    keys = np.zeros(n * t_max * width, scale.dtype)
    keys[pos] = val
    is_first = occ == 0
    first = None
    if need_first:
        first = np.zeros(n * t_max * width, bool)
        first[pos] = is_first
        first = first.reshape(chunk.ids.shape)
    return keys.reshape(chunk.ids.shape), first, np.bincount(row[is_first], minlength=n)


# ---- the simulation ---------------------------------------------------------------------------------------------
def _run(chunk: _Chunk, num_items: int, policy: str, segment: int | None, slots: tuple[int, ...],
         lookup: str, pin: bool, warm: bool) -> np.ndarray:
    """Hits [n, len(slots)] of every stream of the chunk for every cache size (not for `static`)."""
    scale = _Scale.for_chunk(chunk, num_items, policy, segment)
    keys, first, distinct = _access_keys(chunk, num_items, policy, segment, scale, need_first=warm and pin)
    hits = _simulate(chunk, keys, first, num_items, slots,
                     segment if policy == "fsf" else None, lookup, pin, scale)
    if warm and not pin:
        # Unpinned, nothing leaves the cache while it has room, so the first uses that find a free slot are
        # exactly the first min(c, distinct) ones.
        hits += np.minimum(np.asarray(slots)[None, :], distinct[:, None])
    return hits


def _simulate(chunk: _Chunk, keys: np.ndarray, first: np.ndarray | None, num_items: int, slots: tuple[int, ...],
              lookahead: int | None, lookup: str, pin: bool, scale: _Scale) -> np.ndarray:
    """Lock-step simulation of n streams × C cache sizes (row = stream·C + size index); hits without warm ones
    unless `first` is given (pinned mode, where free slots can outlive the first uses).

    State per row: `prio`/`item` per slot and `where` (slot of each item, -1 if absent). Slots past a row's size
    are LOCKED, empty ones FREE, so one argmin picks the victim for every row; rows of a shorter stream simply drop
    out of the live prefix. Each access updates the priority of rows where it is cached and runs the eviction only
    on the rows where it is missing.
    """
    n, t_max, width = chunk.ids.shape
    n_sizes = len(slots)
    c_max = min(max(slots), num_items)  # more slots than items are never used
    rows = n * n_sizes
    # One spare element at the end takes the priority writes of rows where an access is not cached.
    prio_flat = np.full(rows * c_max + 1, scale.free, scale.dtype)
    spare = rows * c_max
    prio = prio_flat[:spare].reshape(rows, c_max)
    for i, c in enumerate(slots):
        prio[i::n_sizes, min(c, c_max):] = scale.locked
    dummy = num_items  # the item held by empty slots: a spare column of `where`
    item = np.full(rows * c_max, dummy, np.int32)
    where = np.full(rows * (num_items + 1), -1, np.int8 if c_max < 127 else np.int16 if c_max < 32767 else np.int32)
    base_where = np.arange(rows, dtype=np.int64) * (num_items + 1)
    base_slot = np.arange(rows, dtype=np.int64) * c_max
    hits = np.zeros(rows, np.int64)
    live = (chunk.lengths[None, :] > np.arange(t_max)[:, None]).sum(1)  # live streams per position
    pin_amount = scale.dtype(scale.pin)
    for t in range(t_max):
        nr = int(live[t]) * n_sizes
        bw, bs = base_where[:nr], base_slot[:nr]
        ids_t = np.repeat(chunk.ids[: live[t], t].T, n_sizes, axis=1)  # [K, nr], contiguous per access
        at = bw + ids_t  # index into `where` of every access
        new_prio = np.repeat(keys[: live[t], t].T, n_sizes, axis=1)
        is_first = np.repeat(first[: live[t], t].T, n_sizes, axis=1) if first is not None else None
        if lookahead is not None and t + lookahead - 1 < t_max:
            _enter_window(chunk, t + lookahead - 1, live, n_sizes, base_where, base_slot, where, prio_flat,
                          scale.dtype(scale.one))
        if lookup == "pre" or pin:
            before = where[at]
            if lookup == "pre":
                hits[:nr] += (before >= 0).sum(0)
            if pin:
                _shift(prio_flat, bs + before, before >= 0, pin_amount)
                new_prio += pin_amount
        for j in range(width):
            a = at[j]
            p = where[a]
            present = p >= 0
            if lookup == "seq":
                hits[:nr] += present
            prio_flat[np.where(present, bs + p, spare)] = new_prio[j]
            miss = np.flatnonzero(~present)
            if miss.size == 0:
                continue
            victim = prio[miss].argmin(1)
            target = bs[miss] + victim
            vprio = prio_flat[target]
            if pin:
                # Every cached expert is pinned: serve the miss without caching it.
                keep = vprio < scale.pin_level
                miss, victim, target, vprio = miss[keep], victim[keep], target[keep], vprio[keep]
            if is_first is not None:
                hits[miss] += is_first[j, miss] & (vprio == scale.free)
            old = item[target]
            where[bw[miss] + old] = -1
            where[a[miss]] = victim
            item[target] = ids_t[j, miss]
            prio_flat[target] = new_prio[j, miss]
        if pin:
            after = where[at]
            _shift(prio_flat, bs + after, after >= 0, -pin_amount)
    return hits.reshape(n, n_sizes)


def _shift(prio_flat: np.ndarray, slot_idx: np.ndarray, mask: np.ndarray, amount) -> None:
    """Add `amount` to the priority of the slots where mask holds (distinct slots, so fancy += is exact)."""
    prio_flat[slot_idx[mask]] += amount


def _enter_window(chunk: _Chunk, t_enter: int, live: np.ndarray, n_sizes: int, base_where: np.ndarray,
                  base_slot: np.ndarray, where: np.ndarray, prio_flat: np.ndarray, one) -> None:
    """Token t_enter joins the look-ahead window: its cached experts gain one future use."""
    nr = int(live[t_enter]) * n_sizes
    if nr == 0:
        return
    at = base_where[:nr] + np.repeat(chunk.ids[: live[t_enter], t_enter].T, n_sizes, axis=1)
    p = where[at]
    _shift(prio_flat, base_slot[:nr] + p, p >= 0, one)


def _static_hits(routing: Routing, layer_slots: tuple[int, ...], pooled_slots: tuple[int, ...]):
    """Hits [L, C] of per-layer static caches and [C] of the pooled one.

    A static cache holds the c most used experts over all given sequences. Which of several equally frequent experts
    fills the last slot does not change the hit count, so the hits are the sum of the c largest use counts.
    """
    num_experts = routing.num_experts
    counts = np.stack([np.bincount(routing.ids[layer].reshape(-1).astype(np.int64), minlength=num_experts)
                       for layer in range(routing.num_layers)])
    per_layer = np.concatenate([np.zeros((routing.num_layers, 1), np.int64),
                                np.cumsum(-np.sort(-counts, axis=1), axis=1)], axis=1)
    layer_hits = per_layer[:, [min(c, num_experts) for c in layer_slots]]
    pooled = np.concatenate([[0], np.cumsum(-np.sort(-counts.reshape(-1)))])
    pooled_hits = pooled[[min(c, pooled.shape[0] - 1) for c in pooled_slots]]
    return layer_hits, pooled_hits
