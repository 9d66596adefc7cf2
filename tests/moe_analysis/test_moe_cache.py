"""Cache policies against the slow reference for every semantics switch, plus the invariants of §10.4."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from moe_ref import pooled_tokens, ref_hits, ref_static

from mindvl.moe_analysis import hit_rate, sch
from mindvl.moe_analysis.synthetic import synthetic_trace

SEMANTICS = [dict(lookup=lk, pin=pin, warm_start=warm)
             for lk, pin, warm in itertools.product(("pre", "seq"), (False, True), (True, False))]


def _case(seed: int):
    rng = np.random.default_rng(seed)
    num_experts = int(rng.integers(2, 6))
    k = int(rng.integers(1, min(3, num_experts) + 1))
    num_layers = int(rng.integers(1, 3))
    lengths = [int(x) for x in rng.integers(1, 10, size=int(rng.integers(1, 4)))]
    trace = synthetic_trace(num_layers, num_experts, k, lengths, keep=float(rng.uniform(0, 0.9)),
                            skew=float(rng.uniform(0, 1.5)), seed=seed)
    # layers[l][s] = sequence s of layer l as lists of expert ids.
    layers = [[seq[layer].tolist() for seq in trace.sequences()] for layer in range(num_layers)]
    return trace, layers


@pytest.mark.parametrize("policy, segment", [("lru", None), ("lfu", None), ("belady", None), ("fsf", 1),
                                             ("fsf", 2), ("fsf", 3), ("fsf", 7)])
@pytest.mark.parametrize("seed", range(3))
def test_policies_match_reference_per_layer_and_pooled(policy, segment, seed):
    trace, layers = _case(seed * 7 + len(policy) + (segment or 0))
    num_layers, num_experts, k = trace.num_layers, trace.num_experts, trace.k
    tokens = trace.num_tokens
    layer_sizes = list(range(1, num_experts + 2))  # one past E: a cache larger than the expert count
    pooled_sizes = list(range(1, num_layers * num_experts + 2))
    for sem in SEMANTICS:
        per_layer = hit_rate(trace, policy=policy, segment=segment, cache_sizes=[c / k for c in layer_sizes],
                             pooled=False, **sem)
        assert per_layer.layer_slots == tuple(layer_sizes)
        for layer in range(num_layers):
            for ci, c in enumerate(layer_sizes):
                hits = sum(ref_hits(seq, c, policy, segment, sem["lookup"], sem["pin"], sem["warm_start"])
                           for seq in layers[layer])
                assert per_layer.layer[layer, ci] == hits / (tokens * k), (sem, layer, c)
        pooled = hit_rate(trace, policy=policy, segment=segment, per_layer=False,
                          cache_sizes=[c / (num_layers * k) for c in pooled_sizes], **sem)
        for ci, c in enumerate(pooled_sizes):
            hits = sum(ref_hits(pooled_tokens([layers[l][s] for l in range(num_layers)], num_experts), c, policy,
                                segment, sem["lookup"], sem["pin"], sem["warm_start"])
                       for s in range(trace.num_sequences))
            assert pooled.pooled[ci] == hits / (tokens * k * num_layers), (sem, c)


@pytest.mark.parametrize("seed", range(4))
def test_static_matches_reference(seed):
    trace, layers = _case(50 + seed)
    num_layers, num_experts, k = trace.num_layers, trace.num_experts, trace.k
    res = hit_rate(trace, policy="static", cache_sizes=[c / k for c in range(1, num_experts + 1)])
    for layer in range(num_layers):
        for c in range(1, num_experts + 1):
            assert res.layer[layer, c - 1] == ref_static(layers[layer], c) / (trace.num_tokens * k)
    pooled = [pooled_tokens([layers[l][s] for l in range(num_layers)], num_experts)
              for s in range(trace.num_sequences)]
    for ci, c in enumerate(res.pooled_slots):
        assert res.pooled[ci] == ref_static(pooled, c) / (trace.num_tokens * k * num_layers)


def test_lookahead_of_one_is_lru():
    trace = synthetic_trace(3, 12, 3, [50, 31, 44], keep=0.5, seed=9)
    ratios = [1 / 3, 2 / 3, 1, 2, 3, 4]
    lru = hit_rate(trace, policy="lru", cache_sizes=ratios)
    fsf = sch(trace, segment=1, cache_sizes=ratios)
    np.testing.assert_array_equal(lru.layer, fsf.layer)
    np.testing.assert_array_equal(lru.pooled, fsf.pooled)


@pytest.mark.parametrize("policy, segment", [("lru", None), ("lfu", None), ("belady", None), ("fsf", 4)])
def test_full_cache_hits_everything_after_free_first_uses(policy, segment):
    trace = synthetic_trace(2, 8, 2, [30, 12], keep=0.3, seed=1)
    L, E, k = trace.num_layers, trace.num_experts, trace.k
    warm = hit_rate(trace, policy=policy, segment=segment, cache_sizes=[E / k, 2 * E / k])
    np.testing.assert_array_equal(warm.layer, 1.0)
    np.testing.assert_array_equal(warm.pooled, 1.0)
    # Cold start (old CHR): with room for every expert, only each sequence's first use of an expert misses.
    cold = hit_rate(trace, policy=policy, segment=segment, cache_sizes=[E / k], warm_start=False)
    for layer in range(L):
        first_uses = sum(len(np.unique(seq[layer])) for seq in trace.sequences())
        assert cold.layer[layer, 0] == 1 - first_uses / (trace.num_tokens * k)


@pytest.mark.parametrize("policy, segment", [("lru", None), ("lfu", None), ("belady", None), ("fsf", 3),
                                             ("fsf", 16), ("static", None)])
def test_hit_rate_is_monotone_in_cache_size(policy, segment):
    trace = synthetic_trace(2, 10, 2, [60, 40], keep=0.6, seed=2)
    res = hit_rate(trace, policy=policy, segment=segment, cache_sizes=np.arange(1, 21) / 2)
    assert np.all(np.diff(res.layer, axis=1) >= 0) and np.all(np.diff(res.pooled) >= 0)


@pytest.mark.parametrize("seed", range(5))
def test_belady_is_optimal_for_top1(seed):
    trace = synthetic_trace(1, 7, 1, [40, 25], keep=0.4, seed=seed)
    ratios = [1, 2, 3, 4, 5, 6]
    best = hit_rate(trace, policy="belady", cache_sizes=ratios).pooled
    for policy, segment in [("lru", None), ("lfu", None), ("static", None), ("fsf", 2), ("fsf", 8)]:
        assert np.all(best >= hit_rate(trace, policy=policy, segment=segment, cache_sizes=ratios).pooled)


@pytest.mark.parametrize("policy, segment", [("lru", None), ("belady", None), ("fsf", 4), ("static", None)])
def test_pooled_equals_per_layer_with_one_layer(policy, segment):
    trace = synthetic_trace(1, 9, 3, [33, 20, 41], keep=0.5, seed=4)
    res = hit_rate(trace, policy=policy, segment=segment, cache_sizes=[1 / 3, 1, 2, 3])
    assert res.pooled_slots == res.layer_slots
    np.testing.assert_array_equal(res.pooled, res.layer[0])
    np.testing.assert_array_equal(res.layer_mean, res.layer[0])


def test_sequence_stride_keeps_every_nth_sequence():
    trace = synthetic_trace(2, 6, 2, [10, 20, 30, 40, 50], seed=5)
    strided = hit_rate(trace, policy="lru", cache_sizes=[1, 2], sequence_stride=2)
    direct = hit_rate([trace.sequence(i) for i in (0, 2, 4)], 6, policy="lru", cache_sizes=[1, 2])
    assert strided.sequences == 3
    np.testing.assert_array_equal(strided.layer, direct.layer)
    np.testing.assert_array_equal(strided.pooled, direct.pooled)


@pytest.mark.parametrize("kwargs, message", [
    (dict(policy="fifo"), "unknown cache policy"),
    (dict(policy="fsf"), "segment"),
    (dict(policy="lru", segment=4), "takes none"),
    (dict(policy="lru", lookup="post"), "lookup"),
    (dict(policy="lru", cache_sizes=[0.1]), "slot"),
    (dict(policy="lru", cache_sizes=[-1]), "positive"),
    (dict(policy="lru", sequence_stride=0), "stride"),
])
def test_bad_arguments(kwargs, message):
    trace = synthetic_trace(1, 4, 2, [5], seed=0)
    with pytest.raises(ValueError, match=message):
        hit_rate(trace, **kwargs)
