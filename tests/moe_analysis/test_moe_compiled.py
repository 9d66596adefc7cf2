"""The numba kernels against the numpy paths: the same hit counts and SRP histograms on random ragged traces, for
every policy and semantic switch (the numpy paths are themselves checked against the reference in the other
files; those tests run on the compiled path whenever numba is installed)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from mindvl.moe_analysis import _compiled, hit_rate, srp_curve
from mindvl.moe_analysis.synthetic import synthetic_trace

pytestmark = pytest.mark.skipif(_compiled.numba is None, reason="numba (the `fast` extra) is not installed")


@pytest.fixture
def numpy_path(monkeypatch):
    def run(fn, *args, **kwargs):
        monkeypatch.setenv("MINDVL_MOE_NUMPY", "1")
        try:
            return fn(*args, **kwargs)
        finally:
            monkeypatch.setenv("MINDVL_MOE_NUMPY", "0")
    return run


TRACES = {  # (layers, experts, k, sequence lengths): ragged, a sequence shorter than some segments, k = 1
    "ragged": (3, 16, 2, [40, 25, 33, 7, 40]),
    "top1": (2, 6, 1, [30, 12]),
    "wide": (2, 40, 6, [20, 31]),
}


@pytest.mark.parametrize("name", sorted(TRACES))
def test_srp_histograms_match_numpy(name, numpy_path):
    layers, experts, k, lengths = TRACES[name]
    trace = synthetic_trace(layers, experts, k, lengths, keep=0.5, skew=0.8, seed=3)
    segments = (1, 3, 8, 32, 64)
    ours = srp_curve(trace, segments=segments)
    ref = numpy_path(srp_curve, trace, segments=segments)
    for a, b in zip(ours, ref, strict=True):
        assert (a.theta, a.windows) == (b.theta, b.windows)
        np.testing.assert_array_equal(a.layer_theta, b.layer_theta)
        np.testing.assert_array_equal(a.f1, b.f1)  # exact: both come from the same integer histogram
        np.testing.assert_array_equal(a.layer_srp, b.layer_srp)


@pytest.mark.parametrize("name", sorted(TRACES))
@pytest.mark.parametrize("policy,segment", [("lru", None), ("lfu", None), ("belady", None), ("fsf", 1),
                                            ("fsf", 4), ("fsf", 16)])
def test_hit_counts_match_numpy_for_every_switch(name, policy, segment, numpy_path):
    layers, experts, k, lengths = TRACES[name]
    trace = synthetic_trace(layers, experts, k, lengths, keep=0.5, skew=0.8, seed=5)
    sizes = (0.5, 1, 2, 4, 3 * experts / k)  # the last one holds more slots than there are experts
    for lookup, pin, warm, stride in itertools.product(("pre", "seq"), (False, True), (True, False), (1, 2)):
        kw = dict(policy=policy, segment=segment, cache_sizes=sizes, lookup=lookup, pin=pin, warm_start=warm,
                  sequence_stride=stride)
        ours, ref = hit_rate(trace, **kw), numpy_path(hit_rate, trace, **kw)
        case = (lookup, pin, warm, stride)
        np.testing.assert_array_equal(ours.layer, ref.layer, err_msg=str(case))
        np.testing.assert_array_equal(ours.pooled, ref.pooled, err_msg=str(case))


def test_numpy_fallback_switch(monkeypatch):
    monkeypatch.setenv("MINDVL_MOE_NUMPY", "1")
    assert not _compiled.available()
    monkeypatch.setenv("MINDVL_MOE_NUMPY", "0")
    assert _compiled.available()
