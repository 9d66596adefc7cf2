"""`mindvl moe-analyze` end to end on a small saved trace, and the report's guidance and baselines."""

from __future__ import annotations

import json

import pytest

from mindvl.cli import main
from mindvl.moe_analysis import save_trace
from mindvl.moe_analysis.report import PLOTS, random_routing_srp, recommend
from mindvl.moe_analysis.synthetic import synthetic_trace


def test_cli_writes_json_and_plots(tmp_path, capsys):
    path = save_trace(synthetic_trace(3, 12, 2, [40, 25, 33], keep=0.6, seed=1), tmp_path / "trace.npz")
    out = tmp_path / "report"
    rc = main(["moe-analyze", str(path), "--segments", "2,8", "--cache-ratios", "0.5,1,2,6", "--out", str(out),
               "--margin", "0.02", "--policies", "lru,belady,static"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "SRP" in printed and "Guidance" in printed
    report = json.loads((out / "moe_analysis.json").read_text())
    assert [r["segment"] for r in report["srp"]] == [2, 8]
    assert set(report["hit_rates"]) == {"sch@2", "sch@8", "lru", "belady", "static"}
    # ρ = 6 holds all 12 experts per layer: every warm-start cache hits everything.
    assert all(r["pooled"][-1] == 1.0 and r["layer_mean"][-1] == 1.0
               for name, r in report["hit_rates"].items() if name != "static")
    assert {(g["curve"], g["scope"]) for g in report["guidance"]} >= {("sch@8", "pooled"), ("lru", "per_layer")}
    for name in PLOTS:
        assert (out / name).stat().st_size > 1000


def test_cli_bad_input_is_one_line_error(tmp_path, capsys):
    path = save_trace(synthetic_trace(1, 4, 1, [10], seed=0), tmp_path / "t.npz")
    assert main(["moe-analyze", str(path), "--segments", "4,x"]) == 2
    assert "--segments must be a comma-separated list of ints" in capsys.readouterr().err
    assert main(["moe-analyze", str(path), "--cache-ratios", "0.4"]) == 2  # k=1: rounds to 0 slots
    assert "slot" in capsys.readouterr().err
    assert main(["moe-analyze", str(tmp_path / "none.npz")]) == 2


def test_recommend_picks_smallest_within_margin():
    assert recommend([0.5, 1, 2, 4], [0.3, 0.6, 0.795, 0.8], 0.01) == {
        "best_ratio": 4.0, "best_hit_rate": 0.8, "ratio": 2.0, "hit_rate": 0.795}
    assert recommend([1, 2], [0.5, 0.5], 0.0)["ratio"] == 1.0


@pytest.mark.parametrize("k, num_experts, expected", [
    (2, 8, [0.565, 0.452, 0.409, 0.400]), (1, 8, [0.464, 0.321, 0.253, 0.229]),
    (1, 64, [0.408, 0.161, 0.085, 0.053]), (3, 32, [0.447, 0.281, 0.210, 0.183]),
])
def test_random_routing_baseline_matches_reference_table(k, num_experts, expected):
    got = [random_routing_srp(k, num_experts, m) for m in (4, 16, 64, 256)]
    assert got == pytest.approx(expected, abs=6e-4)
