"""Routing skew in the planner (mindvl.plan.skew): the bytes per routed row against a MemTracker measurement of the
routed experts, the term by hand for DeepSeek-V3 at EP 16, the recorded 671B verdict's sensitivity, and the term in
a traced plan's fit, headroom and report."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from test_plan import MOE, reduced_recipe

from mindvl.config import load_recipe
from mindvl.models import MindVLConfig, TextConfig
from mindvl.plan import format_report, get_device, plan, preset_config
from mindvl.plan.skew import Skew, rank_factor, routed_row_bytes, routing_skew

ROOT = Path(__file__).resolve().parents[2]


def measured_row_bytes(hidden: int, inner: int, experts: int = 16, k: int = 4) -> float:
    """Slope of the peak (MemTracker) of RoutedExperts' bf16 forward + backward over the routed row count."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from mindvl.models.moe import RoutedExperts

    peaks = []
    for tokens in (1024, 2048):
        g = torch.Generator().manual_seed(tokens)
        m = RoutedExperts(experts, hidden, inner, "silu").to(torch.bfloat16)
        for p in m.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).requires_grad_()
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        tracker = MemTracker()
        tracker.track_external(m, x)
        with tracker:
            m(x, ids, torch.rand(tokens, k, generator=g)).float().square().sum().backward()
        peaks.append(sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values()))
    return (peaks[1] - peaks[0]) / (1024 * k)


@pytest.mark.parametrize("hidden,inner", [(256, 128), (128, 384), (256, 384)])
def test_bytes_per_routed_row_match_the_measured_slope(hidden, inner):
    cfg = MindVLConfig(text=TextConfig(family="deepseek_v3", hidden_size=hidden, moe_intermediate_size=inner,
                                       **{k: v for k, v in MOE["text"].items()
                                          if k not in ("family", "hidden_size", "moe_intermediate_size")}))
    measured = measured_row_bytes(hidden, inner)
    assert measured <= routed_row_bytes(cfg) <= 1.1 * measured  # the model is an upper bound, and a close one


def test_deepseek_v3_at_ep16_by_hand():
    cfg = preset_config("mindvl-671b")
    s = routing_skew(cfg, 4096, 16, "full", 1.5)
    rows = 4096 * 8
    per_row = 392 + 2 * (5.8 * 7168 + 4 * 2048)  # 99,925 bytes
    assert (s.rows_balanced, s.layers_in_flight) == (rows, 1)
    assert s.bytes_per_unit == int(rows * per_row)  # 3.05 GiB per +1.0 of factor
    assert s.extra_bytes == int(0.5 * rows * per_row)
    assert routing_skew(cfg, 4096, 16, "off").layers_in_flight == 61 - 3  # every MoE layer's saved rows
    assert routing_skew(cfg, 4096, 1, "full", 2.0).extra_bytes == 0  # no EP: rows move between local experts
    assert routing_skew(preset_config("mindvl-8b"), 8192, 16, "full", 2.0).extra_bytes == 0  # dense
    with pytest.raises(ValueError, match=">= 1"):
        routing_skew(cfg, 4096, 16, "full", 0.9)


def test_qwen3_moe_experts_count_under_ep_by_hand():
    """Qwen3-VL-30B-A3B's LLM (family qwen3_moe: 48 layers, all MoE, top-8 of 128, hidden 2048, expert width 768):
    its routed rows count in the skew term and the EP all-to-all bytes (they were ignored: not DeepSeek-V3)."""
    from mindvl.plan.estimate import expert_all_to_all_bytes

    cfg = preset_config("qwen3-vl-30b-a3b")
    assert cfg.text.family == "qwen3_moe"
    s = routing_skew(cfg, 8192, 8, "full", 1.25)
    rows = 8192 * 8
    per_row = 392 + 2 * (5.8 * 2048 + 4 * 768)  # 30,294.4 bytes
    assert (s.rows_balanced, s.layers_in_flight) == (rows, 1)
    assert s.bytes_per_unit == int(rows * per_row)  # 1.85 GiB per +1.0 of factor
    assert routing_skew(cfg, 8192, 8, "off").layers_in_flight == 48  # no dense layers in front
    # balanced all-to-all: 8192 x 8 rows, 7/8 of them leave the rank, bf16, 48 layers, x4 (x6 with recompute)
    assert expert_all_to_all_bytes(cfg, 8192, 8, 1, recompute=True) == 48 * 6 * rows * 7 / 8 * 2048 * 2
    assert expert_all_to_all_bytes(cfg, 8192, 1, 1, recompute=True) == 0


def test_recorded_671b_sft_verdict_with_skew():
    """256 x 910B2-64G: 6% headroom balanced (the recorded plan) is ~3.8 GiB of slack, gone at factor ~2.25."""
    d = json.loads((ROOT / "recipes/mindvl-671b/plan_sft_256x_910b2-64g.json").read_text())
    s = routing_skew(preset_config("mindvl-671b"), max(p["tokens"] for p in d["packs"]), 16, "full")
    args = (d["peak_bytes_per_rank"], d["reserve_bytes"], d["capacity_bytes"])
    assert s.headroom_at(1.0, *args) == pytest.approx(d["headroom"])
    assert s.break_even(*args) == pytest.approx(1 + (64 - 54.98 - 5.2) / 3.05, abs=0.01)
    assert s.headroom_at(2.0, *args) > 0 > s.headroom_at(2.5, *args)


def test_a_traced_ep_plan_carries_the_skew_term(tmp_path):
    raw = reduced_recipe(tmp_path, 4).to_dict()
    raw["model"] = {"arch": MOE}
    raw["parallel"]["expert_parallel"] = 2
    raw["phase"] = {"name": "multitask", "trainable": ["language_model"]}
    recipe = load_recipe(raw=raw)
    r = plan(recipe, 2, get_device("h100-80g"), routing_skew_factor=1.5)
    assert r.skew.bytes_per_unit > 0 and r.skew_bytes == r.skew.bytes_per_unit // 2
    # balanced: no skew term, and the reserve of the balanced peak (the reserve grows with planned bytes)
    balanced = dataclasses.replace(r, skew=Skew(1.0, r.skew.bytes_per_unit, r.skew.rows_balanced,
                                                r.skew.layers_in_flight),
                                   reserve_bytes=r.reserve_bytes - int((r.reserve_growth - 1) * r.skew_bytes))
    assert r.headroom == pytest.approx(balanced.headroom - r.reserve_growth * r.skew_bytes / r.capacity_bytes)
    summary = r.to_dict()["routing_skew"]
    assert summary["factor"] == 1.5 and summary["headroom_at"]["1.0"] == pytest.approx(balanced.headroom)
    report = format_report(r)
    assert "routing skew" in report and "fits up to factor" in report and "routing skew (factor 1.5)" in report


def test_rank_factor_by_hand():
    loads = [[4, 0, 2, 2, 1, 1, 3, 3],  # ranks of 2 experts at EP 4: 4, 4, 2, 6 -> max/mean 6/4
             [1, 1, 1, 1, 1, 1, 1, 1]]  # balanced
    assert rank_factor(loads, 4) == pytest.approx(1.5)
    assert rank_factor(loads, 1) == 1.0  # one rank holds every expert: no skew between ranks
    assert rank_factor(loads, 8) == pytest.approx(4 / 2)  # per expert: 4 over the mean 2
    assert rank_factor([[0] * 8], 4) == 1.0
    with pytest.raises(ValueError, match="divide"):
        rank_factor(loads, 3)
