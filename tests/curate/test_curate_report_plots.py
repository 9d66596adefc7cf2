"""The curation report's plots: histograms span the data's range (not the score's whole range) with labelled axes,
every funnel bar carries its counts, the cluster legend sits off the data."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mindvl.curate.report import (  # noqa: E402
    _same_bins,
    clusters_figure,
    funnel_figure,
    histogram_bars,
    histograms_figure,
)
from mindvl.curate.stages.base import Histogram, Stage  # noqa: E402


class Scored(Stage):
    name = "scored"
    histograms = {"min_side": Histogram(0, 2048, 32), "chars": Histogram(0, 2000, 40)}


def observed(values: dict[str, list[float]]) -> dict[str, list[int]]:
    stage = Scored(None, "stages[0]", 0)
    for name, vs in values.items():
        for v in vs:
            stage.observe(name, v)
    return stage.take_histograms()


def test_histogram_bars_span_the_data():
    rng = np.random.default_rng(0)
    sides = rng.uniform(150, 250, 300).tolist()
    counts = observed({"min_side": sides})["min_side"]
    edges, bars = histogram_bars(counts, 0, 2048, 32)
    # Every value lands in a bar, the bars cover [min, max] of the data and not much more (one stored bin either
    # side at most), and there are several of them (the whole-range histogram put all 300 into 2 bars).
    assert bars.sum() == 300 and len(bars) <= 32
    fine = 2048 / Histogram(0, 2048, 32).stored_bins
    assert edges[0] <= min(sides) < edges[0] + fine and edges[-1] - fine <= max(sides) <= edges[-1] + fine
    assert len(bars) >= 10
    for lo, hi, n in zip(edges[:-1], edges[1:], bars, strict=True):
        assert n == sum(lo <= v < hi for v in sides)  # each bar counts exactly its values (hand-counted)
    edges, bars = histogram_bars([0] * 64, 0, 1, 4)
    assert bars.tolist() == [0]  # nothing observed: one empty bar, no crash


def test_histograms_figure_labels_and_limits():
    chars = [40, 41, 42, 45, 47, 2500]  # 2500 is beyond the score's range: counted in its last bin
    sides = [150, 160, 170]
    summary = {"histograms": {"0:scored": observed({"min_side": sides, "chars": chars})}}
    specs = {"0:scored/min_side": (0, 2048, 32), "0:scored/chars": (0, 2000, 40)}
    fig = histograms_figure(summary, specs)
    by_title = {ax.get_title(): ax for ax in fig.axes}
    side = by_title["0:scored/min_side"]
    assert side.get_xlabel() == "min_side" and side.get_ylabel() == "records"
    lo, hi = side.get_xlim()
    assert lo <= 150 and hi >= 170 and hi - lo < 100  # the data's range, not 0-2048
    text = by_title["0:scored/chars"]
    assert text.get_xlabel() == "chars\n(the last bar also counts values > 2000)"
    assert sum(p.get_height() for p in text.patches) == len(chars)
    assert [t.get_text() for t in text.texts] == ["n = 6"]  # outliers a bar cannot show still count
    plt.close(fig)


def test_same_bins_sums_a_finer_histogram_down():
    assert _same_bins([1, 2, 3, 4], [5, 6]) == ([3, 7], [5, 6])
    assert _same_bins([5, 6], [1, 2, 3, 4]) == ([5, 6], [3, 7])
    with pytest.raises(ValueError, match="fresh output folder"):
        _same_bins([1, 2, 3], [1, 2])


def test_funnel_and_cluster_plots():
    summary = {"stages": {"read": {"in": 10, "out": 10}, "0:image_filter": {"in": 10, "out": 0}}}
    fig = funnel_figure(summary)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.texts] == ["10 / 10", "0 / 10"]  # a stage that kept nothing shows 0
    assert ax.get_xlabel() == "records"
    plt.close(fig)

    clusters = [{"cluster": str(i), "size": s, "quota": q, "variance": v}
                for i, (s, q, v) in enumerate([(29, 16, 9.5), (40, 16, 10.2), (9, 9, 8.1)])]
    fig = clusters_figure(clusters)
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    bars_ax, var_ax = fig.axes
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["size", "quota (kept)"]
    assert legend.get_window_extent(renderer).y0 >= bars_ax.get_window_extent(renderer).y1  # above the bars
    assert [t.get_text() for t in bars_ax.texts] == ["29", "40", "9", "16", "16", "9"]
    assert bars_ax.get_ylabel() == "records" and var_ax.get_ylabel() == "variance"
    assert var_ax.get_xlabel() == "cluster"
    plt.close(fig)
