"""The quickstart report's plots and tables read right when every score is 0: value labels on every bar, the legend
beside the axes, a title that fits, and no "best" resolution where every setting ties."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from mindvl.eval.resolution_search import best_settings  # noqa: E402
from mindvl.quickstart import scores_figure, write_report  # noqa: E402

LABELS = ["untrained", "sft-512", "merged"]
BENCHES = ["ocrbench", "chartqa"]


def summary(values: dict[str, float]) -> dict:
    scores = {label: {b: {"min4_max16": 0.0, "min4_max64": 0.0} for b in BENCHES} for label in LABELS}
    return {"evaluation": {label: {b: {"score": 0.0, "exact_match": values.get(label, 0.0)} for b in BENCHES}
                           for label in LABELS},
            "phases": {"warmup": {"steps": 2, "first_loss": 6.0, "last_loss": 5.0, "seconds": 1.0}},
            "headlines": {b: "score" for b in BENCHES}, "best": best_settings(scores), "seconds": 3.0,
            "merge_seconds": 1.0, "search_seconds": 1.0}


def test_bars_are_labelled_even_at_zero():
    fig = scores_figure(summary({"merged": 0.25, "sft-512": 0.003}))
    ax = fig.axes[0]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    labels = [t.get_text() for t in ax.texts]
    # One label per bar, in bar order (checkpoint by checkpoint), a 0% bar's included.
    assert labels == ["0%"] * 2 + ["0.3%"] * 2 + ["25%"] * 2
    assert ax.get_xlabel() and ax.get_ylabel() == "exact match" and ax.get_ylim()[1] > 1.0
    legend = ax.get_legend()
    assert [t.get_text() for t in legend.get_texts()] == LABELS
    assert legend.get_window_extent(renderer).x0 >= ax.get_window_extent(renderer).x1  # off the bars
    title = ax.title.get_window_extent(renderer)
    assert 0 <= title.x0 and title.x1 <= fig.bbox.x1 and title.y1 <= fig.bbox.y1
    plt.close(fig)


def test_report_names_no_best_resolution_when_all_scores_tie(tmp_path):
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 6.0 - s}) + "\n" for s in (1, 2)))
    report = write_report(tmp_path, summary({})).read_text()
    rows = [line for line in report.splitlines() if line.startswith("| ocrbench |")]
    assert rows[-1].startswith("| ocrbench | none | - | - | 0 (every one of the 6 (checkpoint, setting) pairs "
                               "scores 0: no setting is better) |")
    assert (tmp_path / "scores.png").stat().st_size > 0 and (tmp_path / "loss_curves.png").is_file()


def test_a_fast_report_says_its_zeros_are_expected(tmp_path):
    """Issue 43 item 8: a --fast run's all-0% tables come with the note that 10 steps are a smoke test."""
    (tmp_path / "warmup").mkdir()
    (tmp_path / "warmup" / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 6.0}) + "\n")
    note = "This is a `--fast` smoke run: 2 training steps per phase"
    assert note in write_report(tmp_path, {**summary({}), "fast": True}).read_text()
    assert "smoke run" not in write_report(tmp_path, summary({})).read_text()
