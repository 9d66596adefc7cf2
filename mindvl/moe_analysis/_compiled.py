"""Compiled (numba) kernels for SRP histograms and cache simulations: the same numbers as the numpy paths.

The numpy paths vectorise across independent streams and still pay per-access gathers and scatters over whole
arrays; these kernels walk one stream at a time with its state in cache-sized arrays, which is what the sequential
rules of `mindvl.moe_analysis.cache` want. numba is an optional extra (`pip install mindvl[fast]`): without it, or
with MINDVL_MOE_NUMPY=1, the numpy paths run. Tests compare both on random traces for every policy and switch.

Conventions shared with the numpy code: ids `[L, N, k]` (any integer dtype), sequences as token ranges
`[starts[s], ends[s])`; a pooled stream's token carries layer 0's k experts, then layer 1's, ... offset by layer·E.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import numba
except ImportError:  # the optional `fast` extra
    numba = None

POLICY_CODES = {"lru": 0, "lfu": 1, "belady": 2, "fsf": 3}


def available() -> bool:
    return numba is not None and os.environ.get("MINDVL_MOE_NUMPY", "") in ("", "0")


def _jit(fn):
    return numba.njit(cache=True, nogil=True, boundscheck=False)(fn) if numba is not None else fn


# ---- SRP -----------------------------------------------------------------------------------------------------------
@_jit
def _srp_hist(ids, starts, ends, m, num_experts, out):
    """out[l, v] += number of (window, expert) cells of layer l with count v >= 1 (v = 0 is filled by the caller).

    Slides the m-token window over each sequence keeping per-expert counts; a count that changes at window boundary
    w adds the windows it held its old level (w - since) to that level. Counts changed twice at one boundary add a
    zero-length stay, so the order of removals and additions does not matter.
    """
    num_layers, _, k = ids.shape
    count = np.zeros(num_experts, np.int64)
    since = np.zeros(num_experts, np.int64)
    for layer in range(num_layers):
        for s in range(starts.shape[0]):
            a, b = starts[s], ends[s]
            n_windows = b - a - m + 1
            if n_windows <= 0:
                continue
            count[:] = 0
            since[:] = 0
            for t in range(a, a + m):  # window 0, entered at boundary 0
                for j in range(k):
                    count[ids[layer, t, j]] += 1
            for w in range(1, n_windows):  # boundary w: token a+w-1 leaves, token a+w+m-1 enters
                for j in range(k):
                    e = ids[layer, a + w - 1, j]
                    out[layer, count[e]] += w - since[e]
                    since[e] = w
                    count[e] -= 1
                    e = ids[layer, a + w + m - 1, j]
                    out[layer, count[e]] += w - since[e]
                    since[e] = w
                    count[e] += 1
            for e in range(num_experts):
                out[layer, count[e]] += n_windows - since[e]
    return out


def srp_histograms(ids: np.ndarray, starts: np.ndarray, ends: np.ndarray, segment: int, num_experts: int
                   ) -> np.ndarray:
    """hist[l, v] = (window, expert) cells of layer l whose count equals v, v = 0..segment (as the numpy path)."""
    out = np.zeros((ids.shape[0], segment + 1), np.int64)
    _srp_hist(ids, starts, ends, segment, num_experts, out)
    # Cells at level 0 are counted by the kernel only from each expert's last change; recount them exactly.
    total = int(np.maximum(ends - starts - segment + 1, 0).sum()) * num_experts
    out[:, 0] = total - out[:, 1:].sum(1)
    return out


# ---- cache simulation ----------------------------------------------------------------------------------------------
@_jit
def _item(ids, layer, t, j, k, num_experts):
    """Access j of token t: layer `layer`'s j-th expert, or for a pooled stream (layer < 0) layer j // k's."""
    if layer >= 0:
        return np.int64(ids[layer, t, j])
    lay = j // k
    return np.int64(ids[lay, t, j - lay * k]) + lay * num_experts


@_jit
def _gather(ids, layer, a, T, W, k, num_experts, items):
    """The accesses of one stream, flat [T·W] (token-major), into `items`."""
    for t in range(T):
        for j in range(W):
            items[t * W + j] = _item(ids, layer, a + t, j, k, num_experts)


@_jit
def _stream_keys(items, T, W, num_items, policy, segment, one, keys, first, scratch):
    """Priority after each access of one stream (keys[t·W + j]) and whether it is the item's first use; returns the
    number of distinct items. Same keys as `cache._access_keys`, computed online instead of by sorting."""
    uses = scratch[0]
    uses[:num_items] = 0
    distinct = 0
    win = scratch[1]
    if policy == 3:  # fsf: window count over tokens (t, t+m) of each item
        win[:num_items] = 0
        for t in range(1, min(segment, T)):
            for j in range(W):
                win[items[t * W + j]] += 1
    for t in range(T):
        if policy == 3 and t >= 1:  # slide: token t leaves (t, t+m), token t+m-1 enters
            for j in range(W):
                win[items[t * W + j]] -= 1
            if t + segment - 1 < T:
                for j in range(W):
                    win[items[(t + segment - 1) * W + j]] += 1
        for j in range(W):
            it = items[t * W + j]
            stamp = t * W + j
            first[stamp] = uses[it] == 0
            if uses[it] == 0:
                distinct += 1
            if policy == 0:
                keys[stamp] = stamp
            elif policy == 1:
                keys[stamp] = (uses[it] + 1) * one + stamp
            elif policy == 3:
                keys[stamp] = win[it] * one + stamp
            uses[it] += 1
    if policy == 2:  # belady: minus the stamp of the next access, sentinels after the end in id order
        nxt = scratch[1]
        for it in range(num_items):
            nxt[it] = T * W + it
        for t in range(T - 1, -1, -1):
            for j in range(W - 1, -1, -1):
                it = items[t * W + j]
                stamp = t * W + j
                keys[stamp] = -nxt[it]
                nxt[it] = stamp
    return distinct


@_jit
def _simulate_stream(items, T, W, num_items, capacity, segment, one, keys, first, lookup_pre, pin, warm, where,
                     evicted_at, slot_item, prio):
    """Hits of one stream in one cache of `capacity` slots (rules of `mindvl.moe_analysis.cache`, pinned warm first
    uses included; unpinned warm first uses are added by the caller)."""
    pin_amount = np.int64(1) << 60
    pin_level = np.int64(1) << 59
    where[:num_items] = -1
    evicted_at[:num_items] = -1
    filled = 0
    hits = 0
    for t in range(T):
        if segment > 0 and t + segment - 1 < T:  # fsf: token t+m-1 joins the look-ahead window
            for j in range(W):
                s = where[items[(t + segment - 1) * W + j]]
                if s >= 0:
                    prio[s] += one
        if pin:
            for j in range(W):
                s = where[items[t * W + j]]
                if s >= 0:
                    if lookup_pre:
                        hits += 1
                    prio[s] += pin_amount
        for j in range(W):
            it = items[t * W + j]
            key = keys[t * W + j] + (pin_amount if pin else 0)
            s = where[it]
            if s >= 0:
                if not (pin and lookup_pre):
                    # Resident now means resident before the token too: only its own access inserts an expert.
                    hits += 1
                prio[s] = key
                continue
            if lookup_pre and not pin and evicted_at[it] == t:
                hits += 1  # evicted earlier in this token by another of its experts: cached before the token
            if filled < capacity:  # free slots fill in index order, as numpy's argmin takes the first
                v = filled
                filled += 1
                if pin and warm and first[t * W + j]:
                    hits += 1
            else:
                v = 0
                best = prio[0]
                for c in range(1, capacity):
                    if prio[c] < best:
                        best = prio[c]
                        v = c
                if pin and best >= pin_level:  # every cached expert is pinned: served without caching
                    continue
                where[slot_item[v]] = -1
                evicted_at[slot_item[v]] = t
            where[it] = v
            slot_item[v] = it
            prio[v] = key
        if pin:
            for j in range(W):
                s = where[items[t * W + j]]
                if s >= 0:
                    prio[s] -= pin_amount
    return hits


@_jit
def _stack_stream(items, T, W, num_items, depth, segment, one, keys, lookup_pre, slots, pos, stack, prio, hits):
    """Hits of one stream for every cache size at once (unpinned caches; warm first uses added by the caller).

    Every policy here evicts the cached expert of lowest priority, and an expert's priority at any time depends
    only on the stream, never on the cache (last use, use count, next use, uses in the look-ahead window). Such
    policies are stack algorithms (Mattson et al., 1970): the cache of c slots always holds the top c entries of
    one stack. A reference moves its expert to the top and carries the displaced entries down, each level keeping
    the higher-priority one of (carried, resident) -- the entry the cache of that size would keep -- until the
    expert's old level (or the bottom). Levels below `depth` = the largest cache are dropped.
    """
    n = 0  # stack entries in use
    pos[:num_items] = depth  # level of every expert; `depth` = in no cache
    level_hits = np.zeros(depth + 1, np.int64)  # accesses that found their expert at each level (depth: absent)
    for t in range(T):
        if segment > 0 and t + segment - 1 < T:  # fsf: token t+m-1 joins the look-ahead window
            for j in range(W):
                lv = pos[items[(t + segment - 1) * W + j]]
                if lv < depth:
                    prio[lv] += one
        if lookup_pre:
            for j in range(W):
                level_hits[pos[items[t * W + j]]] += 1
        for j in range(W):
            it = items[t * W + j]
            key = keys[t * W + j]
            old = pos[it]
            if not lookup_pre:
                level_hits[old] += 1
            if old == 0:
                prio[0] = key
                continue
            carry = stack[0]
            carry_prio = prio[0]
            stop = old if old < depth else n  # entries below the expert's old level are untouched
            for lv in range(1, stop):
                # Keep the higher-priority one of (carried, resident) here; the other is evicted at this size and
                # carried on. Written as selects, not a branch: the outcome is unpredictable.
                resident, resident_prio = stack[lv], prio[lv]
                down = resident_prio < carry_prio
                stack[lv] = carry if down else resident
                prio[lv] = carry_prio if down else resident_prio
                pos[stack[lv]] = lv
                carry = resident if down else carry
                carry_prio = resident_prio if down else carry_prio
            if n > 0:
                if stop < depth:  # the carried entry takes the expert's old level, or a new level at the bottom
                    stack[stop], prio[stop] = carry, carry_prio
                    pos[carry] = stop
                    if stop == n:
                        n += 1
                else:
                    pos[carry] = depth  # falls out of the largest cache
            else:
                n = 1
            stack[0], prio[0] = it, key
            pos[it] = 0
    for i in range(slots.shape[0]):  # a cache of c slots holds levels 0..c-1
        hits[i] += level_hits[: min(slots[i], depth)].sum()
    return hits


@_jit
def _simulate(ids, layers, starts, ends, num_experts, num_items, policy, segment, slots, lookup_pre, pin, warm, one,
              items, keys, first, scratch, where, evicted_at, slot_item, prio, stack, stack_hits, hits):
    """hits[r, i] for stream r = (layers[r // S], sequence r % S) and cache size slots[i]; the buffers hold one
    stream (items/keys/first: t_max·W accesses; scratch [2, num_items]; where/evicted_at [num_items]; slot_item/prio
    [min(max slots, num_items)])."""
    k = ids.shape[2]
    W = k if layers[0] >= 0 else k * ids.shape[0]
    n_seq = starts.shape[0]
    for li in range(layers.shape[0]):
        for s in range(n_seq):
            a, T = starts[s], ends[s] - starts[s]
            _gather(ids, layers[li], a, T, W, k, num_experts, items)
            distinct = _stream_keys(items, T, W, num_items, policy, segment, one, keys, first, scratch)
            if not pin:
                stack_hits[:] = 0
                _stack_stream(items, T, W, num_items, stack.shape[0], segment if policy == 3 else 0, one, keys,
                              lookup_pre, slots, where, stack, prio, stack_hits)
                for i in range(slots.shape[0]):
                    hits[li * n_seq + s, i] = stack_hits[i] + (min(slots[i], distinct) if warm else 0)
                continue
            for i in range(slots.shape[0]):
                cap = min(slots[i], num_items)
                h = _simulate_stream(items, T, W, num_items, cap, segment if policy == 3 else 0, one, keys, first,
                                     lookup_pre, pin, warm, where, evicted_at, slot_item, prio)
                if warm and not pin:  # nothing leaves while there is room: the first min(c, distinct) uses are free
                    h += min(slots[i], distinct)
                hits[li * n_seq + s, i] = h
    return hits


def simulate(ids: np.ndarray, layers: np.ndarray, starts: np.ndarray, ends: np.ndarray, num_experts: int,
             policy: str, segment: int | None, slots: tuple[int, ...], lookup: str, pin: bool, warm: bool
             ) -> np.ndarray:
    """Hits [len(layers), S, len(slots)]; `layers = [-1]` simulates the pooled cache of all layers."""
    pooled = layers[0] < 0
    num_items = num_experts * (ids.shape[0] if pooled else 1)
    width = ids.shape[2] * (ids.shape[0] if pooled else 1)
    starts, ends = np.asarray(starts, np.int64), np.asarray(ends, np.int64)
    t_max = int((ends - starts).max())
    accesses = t_max * width
    # One unit of a (count, stamp) key lies above every stamp, so keys order lexicographically; int32 buffers
    # whenever the keys fit halve the stream's footprint in the L1/L2 caches.
    one = 1 << int(accesses + num_items + 1).bit_length()
    key_dtype = np.int32 if (t_max + _segment_or(segment) + 2) * one < 2**31 else np.int64
    c_max = min(max(slots), num_items)
    hits = np.zeros((len(layers) * len(starts), len(slots)), np.int64)
    _simulate(ids, np.asarray(layers, np.int64), starts, ends, num_experts, num_items, POLICY_CODES[policy],
              _segment_or(segment), np.asarray(slots, np.int64), lookup == "pre", bool(pin), bool(warm), one,
              np.empty(accesses, np.int32), np.empty(accesses, key_dtype), np.empty(accesses, np.bool_),
              np.empty((2, num_items), np.int32), np.empty(num_items, np.int32), np.empty(num_items, np.int32),
              np.empty(c_max, np.int32), np.empty(c_max, np.int64), np.empty(c_max, np.int32),
              np.zeros(len(slots), np.int64), hits)
    return hits.reshape(len(layers), len(starts), len(slots))


def _segment_or(segment: int | None) -> int:
    return int(segment or 0)
