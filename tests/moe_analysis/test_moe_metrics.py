"""SRP and SCH against the reference doc's worked examples (§9), hand-computed cases and a slow pure-Python
reference on random small traces."""

from __future__ import annotations

import numpy as np
import pytest
from moe_ref import pooled_tokens, ref_hits, ref_srp

from mindvl.moe_analysis import sch, srp, srp_curve
from mindvl.moe_analysis.synthetic import synthetic_trace

# §9 example 1: E = 4, k = 2, T = 6, one layer, one sequence.
EX1 = [[0, 1], [1, 0], [0, 2], [2, 3], [3, 2], [0, 1]]
# §9 example 2: E = 3, k = 1.
EX2 = [[0], [1], [0], [2], [1], [0], [2], [1]]


def test_example1_srp_number_for_number():
    r2 = srp(np.array([EX1]), 4, segment=2)
    assert (r2.srp, r2.theta, r2.rho, r2.act_r, r2.windows) == (pytest.approx(40 / 48), 1, 1.4, 0.5, 5)
    assert r2.f1 == pytest.approx([40 / 60, 40 / 48, 24 / 32])
    r4 = srp(np.array([EX1]), 4, segment=4)
    assert (r4.srp, r4.theta, r4.rho, r4.windows) == (pytest.approx(0.70), 2, 1.5, 3)
    assert r4.f1 == pytest.approx([48 / 72, 48 / 72, 42 / 60, 18 / 36, 0.0])


def test_example1_sch_and_policies():
    ratios = [0.5, 1, 1.5, 2]  # c = 1, 2, 3, 4 slots for k = 2
    expected = [5 / 12, 8 / 12, 10 / 12, 1.0]
    for m in (2, 4):
        res = sch(np.array([EX1]), 4, segment=m, cache_sizes=ratios)
        assert res.layer_slots == (1, 2, 3, 4)
        assert res.pooled == pytest.approx(expected) and res.layer[0] == pytest.approx(expected)
    from mindvl.moe_analysis import hit_rate

    for policy in ("lru", "lfu", "belady"):
        assert hit_rate(np.array([EX1]), 4, policy, ratios).pooled == pytest.approx(expected)


def test_example2_policies_differ():
    from mindvl.moe_analysis import hit_rate

    trace = np.array([EX2])
    got = {p: hit_rate(trace, 3, p, [2]).pooled[0] for p in ("lru", "belady", "lfu")}
    assert got == pytest.approx({"lru": 0.375, "belady": 0.625, "lfu": 0.5})
    assert sch(trace, 3, segment=2, cache_sizes=[2]).pooled[0] == pytest.approx(0.625)
    assert sch(trace, 3, segment=4, cache_sizes=[2]).pooled[0] == pytest.approx(0.5)
    r2, r4 = srp_curve(trace, 3, (2, 4))
    assert (r2.srp, r2.rho) == (pytest.approx(2 / 3), 2.0)
    assert (r4.srp, r4.theta, r4.rho) == (0.5, 0, 3.0)


def test_hand_computed_two_layers_pooled_theta():
    # Layer 0 alternates two experts, layer 1 is constant; E = 2, k = 1, one sequence of 4 tokens, m = 2.
    # Layer 0 windows: counts (1,1) x3 -> 6 cells of 1. Layer 1: counts (2,0) x3 -> 3 cells of 2, 3 of 0.
    # Pooled: A = 12; θ=1: TP=12, P=2·9=18 -> 24/30; θ=2: TP=6, P=6 -> 12/18. SRP = 0.8 at θ = 1, ρ̂ = 1.5.
    ids = np.array([[[[0], [1], [0], [1]]], [[[1], [1], [1], [1]]]])
    r = srp(ids, 2, segment=2)
    assert (r.srp, r.theta, r.rho) == (pytest.approx(0.8), 1, 1.5)
    # Per layer, θ is chosen per layer (A = 6 each). Layer 0: θ=0 and θ=1 both give 12/18, the first wins.
    # Layer 1: θ=1 and θ=2 both give 12/12 = 1, so θ* = 1.
    assert r.layer_srp == pytest.approx([2 / 3, 1.0])
    assert list(r.layer_theta) == [0, 1]


def _random_layers(rng, num_layers, num_experts, k, lengths):
    trace = synthetic_trace(num_layers, num_experts, k, lengths, keep=float(rng.uniform(0, 0.9)),
                            skew=float(rng.uniform(0, 1.5)), seed=int(rng.integers(1 << 30)))
    return trace, [[s.tolist() for s in seq_l] for seq_l in zip(*[list(q) for q in trace.sequences()], strict=True)]


@pytest.mark.parametrize("seed", range(12))
def test_srp_matches_naive_reference(seed):
    rng = np.random.default_rng(seed)
    num_experts = int(rng.integers(2, 7))
    k = int(rng.integers(1, min(3, num_experts) + 1))
    lengths = [int(x) for x in rng.integers(1, 14, size=int(rng.integers(1, 4)))]
    trace, layers = _random_layers(rng, int(rng.integers(1, 4)), num_experts, k, lengths)
    segments = (1, 2, 3, 4, 8)
    results = srp_curve(trace, segments=segments)
    for m, res in zip(segments, results, strict=True):
        ref = ref_srp(layers, num_experts, m)
        if ref is None:
            assert np.isnan(res.srp) and res.theta == -1
            continue
        assert (res.srp, res.theta, res.rho) == (float(ref[0]), ref[1], float(ref[2]))
        for layer, seqs in enumerate(layers):
            ref_l = ref_srp([seqs], num_experts, m)
            assert (res.layer_srp[layer], res.layer_theta[layer]) == (float(ref_l[0]), ref_l[1])


@pytest.mark.parametrize("seed", range(6))
def test_srp_invariants(seed):
    trace = synthetic_trace(3, 8, 2, [40, 17, 25], keep=0.5, seed=seed)
    one, *rest = srp_curve(trace, segments=(1, 2, 4, 8, 16))
    assert one.srp == 1.0 and one.theta == 1 and one.rho == 1.0
    floor = 2 * trace.k / (trace.num_experts + trace.k)
    assert all(r.srp >= floor for r in rest) and all(r.act_r == pytest.approx(trace.k / trace.num_experts)
                                                      for r in rest)
    # i.i.d. routing with many experts sits near the floor at long segments; a constant router is perfect.
    const = np.zeros((1, 30, 2), np.int64)
    const[..., 1] = 1
    assert srp(const, 8, 16).srp == 1.0


def test_srp_input_forms_agree_and_no_window_is_nan():
    trace = synthetic_trace(2, 6, 2, [9, 5, 12], seed=3)
    as_trace = srp(trace, segment=4)
    as_list = srp(trace.sequences(), 6, segment=4)
    assert (as_trace.srp, as_trace.theta) == (as_list.srp, as_list.theta)
    same_len = synthetic_trace(2, 6, 2, [7, 7], seed=4)
    arr = np.stack([np.stack([s[layer] for s in same_len.sequences()]) for layer in range(2)])  # [L, S, T, k]
    assert srp(arr, 6, 3).srp == srp(same_len, segment=3).srp
    assert np.isnan(srp(trace, segment=13).srp)


@pytest.mark.parametrize("bad, message", [
    (np.array([[[0, 4]]]), "expert ids must lie in"),
    (np.array([[[1, 1]]]), "twice"),
    (np.array([[[0.0, 1.0]]]), "integers"),
    (np.zeros((2, 2)), "shape"),
])
def test_srp_bad_input(bad, message):
    with pytest.raises(ValueError, match=message):
        srp(bad, 4, 2)


def test_srp_bad_segment_and_missing_experts():
    with pytest.raises(ValueError, match="segment"):
        srp(np.array([EX1]), 4, 0)
    with pytest.raises(ValueError, match="num_experts is required"):
        srp(np.array([EX1]), None, 2)


@pytest.mark.parametrize("seed", range(8))
def test_sch_matches_naive_reference(seed):
    rng = np.random.default_rng(100 + seed)
    num_experts = int(rng.integers(2, 6))
    k = int(rng.integers(1, min(2, num_experts) + 1))
    num_layers = int(rng.integers(1, 3))
    lengths = [int(x) for x in rng.integers(1, 11, size=int(rng.integers(1, 3)))]
    trace, layers = _random_layers(rng, num_layers, num_experts, k, lengths)
    m = int(rng.integers(1, 6))
    items = num_layers * num_experts
    res = sch(trace, segment=m, cache_sizes=[c / (num_layers * k) for c in range(1, items + 2)], per_layer=False)
    for ci, c in enumerate(range(1, items + 2)):
        hits = sum(ref_hits(pooled_tokens([layers[l][s] for l in range(num_layers)], num_experts), c, "fsf", m)
                   for s in range(len(lengths)))
        assert res.pooled[ci] == hits / (sum(lengths) * k * num_layers)  # both correctly rounded: exact match
