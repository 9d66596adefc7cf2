"""The planner's margin from measurement (mindvl.plan.margin): the reserve's arithmetic by hand, the shipped
margin.json's provenance, the recorded 671B verdicts before/after by hand, recording a GPU proof's figures, the
CPU allocator's high-water reader, and a traced plan that uses all of it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from test_plan import MOE, reduced_recipe

from mindvl.config import load_recipe
from mindvl.plan import format_report, get_device, plan, preset_config
from mindvl.plan import margin as margin_module
from mindvl.plan.margin import MARGIN_FILE, Margin, load_margin, main, reserve_from_proof, stated_reserve_bytes
from mindvl.plan.skew import routing_skew

ROOT = Path(__file__).resolve().parents[2]
GIB = 2**30


def margin(alloc=1.0, reserved=1.0, factor=1.0, context=1.0, comm=1.0) -> Margin:
    return Margin(int(context * GIB), int(comm * GIB), alloc, reserved, factor, {})


def test_reserve_arithmetic_by_hand():
    m = margin(alloc=1.05, reserved=1.2)
    assert m.growth == pytest.approx(1.26)
    assert m.reserve_bytes(50 * GIB) == int(2 * GIB + 0.26 * 50 * GIB)  # 15.0 GiB
    # a plan that over-counts (allocator high-water below the plan) earns no credit; neither does reserved < alloc
    assert margin(alloc=0.8, reserved=1.1).growth == pytest.approx(1.1)
    assert margin(alloc=0.8, reserved=0.9).reserve_bytes(50 * GIB) == 2 * GIB
    assert margin(context=0.5, comm=0.0).reserve_bytes(10 * GIB) == GIB // 2
    # the stated reserve it replaces: 2 GiB + 5% of capacity (64 GiB: 5.2 GiB, as the recorded plans hold)
    assert stated_reserve_bytes(64 * GIB) == int(2 * GIB + 3.2 * GIB)


def test_shipped_margin_file_states_its_sources():
    m = load_margin()
    assert m.skew_factor >= 1.0 and m.growth >= 1.0 and m.fixed_bytes > 0
    raw = json.loads(MARGIN_FILE.read_text())
    for key in ("runtime_context_gib", "comm_buffers_gib", "allocated_over_planned", "reserved_over_allocated"):
        source = raw["reserve"].get(key.removesuffix("_gib") + "_source", "")
        assert len(source) > 20 and "PLACEHOLDER" not in source, key
    assert "PLACEHOLDER" not in raw["reserve"]["measured_on"] and len(raw["routing_skew"]["source"]) > 20


@pytest.mark.parametrize("change,match", [
    (lambda r: r["reserve"].pop("comm_buffers_gib"), "reserve.comm_buffers_gib must be a number"),
    (lambda r: r["reserve"].update(allocated_over_planned=-1), "reserve.allocated_over_planned must be"),
    (lambda r: r["routing_skew"].update(factor=0.9), "routing_skew.factor must be a number >= 1"),
    (lambda r: r.pop("routing_skew"), "not a planner margin file"),
])
def test_a_bad_margin_file_is_one_line(tmp_path, change, match):
    raw = json.loads(MARGIN_FILE.read_text())
    change(raw)
    path = tmp_path / "margin.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=match) as e:
        load_margin(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_recorded_671b_sft_256_910b_before_and_after_by_hand():
    """The recorded 256 x 910B2-64G plan: 54.98 GiB traced peak of 64 GiB. Before: 5.2 GiB reserve, balanced routing
    (6% headroom). After, with a margin of 2 GiB + 10% growth and skew factor 1.25: skew term 0.25 x 32,768 rows x
    99,924.8 B = 0.762 GiB; reserve 2 + 0.1 x (54.98 + 0.763) = 7.574 GiB; headroom 1 - 63.317 / 64 = 1.07%."""
    d = json.loads((ROOT / "recipes/mindvl-671b/plan_sft_256x_910b2-64g.json").read_text())
    peak, cap = d["peak_bytes_per_rank"], d["capacity_bytes"]
    assert (peak, cap, d["reserve_bytes"]) == (59035026728, 64 * GIB, stated_reserve_bytes(cap))
    m = margin(reserved=1.1, factor=1.25)
    k = routing_skew(preset_config("mindvl-671b"), 4096, 16, "full", m.skew_factor)
    per_row = 392 + 2 * (5.8 * 7168 + 4 * 2048)  # 99,924.8 B (mindvl.plan.skew)
    assert k.extra_bytes == int(0.25 * int(32768 * per_row))
    reserve = m.reserve_bytes(peak + k.extra_bytes)
    assert reserve / GIB == pytest.approx(2 + 0.1 * (59035026728 + 0.25 * 32768 * per_row) / GIB, abs=1e-6)
    assert reserve / GIB == pytest.approx(7.574, abs=0.001)
    assert 1 - (peak + k.extra_bytes + reserve) / cap == pytest.approx(0.0107, abs=0.0001)
    # the sensitivity the report prints: the reserve of the balanced peak, the skew term grown by the same 10%
    balanced = m.reserve_bytes(peak)
    assert k.headroom_at(1.25, peak, balanced, cap, m.growth) == pytest.approx(
        1 - (peak + k.extra_bytes + reserve) / cap, abs=1e-9)
    assert k.headroom_at(2.0, peak, balanced, cap, m.growth) < 0  # +1.0 of factor: +3.05 GiB x 1.1 does not fit
    assert k.break_even(peak, balanced, cap, m.growth) == pytest.approx(
        1 + (64 - 54.98 - 2 - 5.498) / (1.1 * 3.0495), abs=0.01)


def proof(**over) -> dict:
    gpu = {"max_allocated_bytes": 20 * GIB, "max_reserved_bytes": 23 * GIB, "outside_allocator_bytes": GIB // 2}
    return {"dry_run": False, "sections": {"environment": {"ok": True, "gpu": "NVIDIA H100 80GB HBM3"},
                                           "plan": {"ok": True, "peak_bytes_per_rank": 19 * GIB},
                                           "mindvl": {"ok": True, "memory_planner_packs": gpu}}, **over}


def test_a_gpu_proof_records_the_reserve(tmp_path, capsys):
    r = reserve_from_proof(proof())
    assert r["allocated_over_planned"] == round(20 / 19, 4) and r["reserved_over_allocated"] == 1.15
    assert r["runtime_context_gib"] == 0.5 and r["comm_buffers_gib"] == 1.0  # one GPU: no NCCL buffers measured
    assert "H100" in r["measured_on"]
    with pytest.raises(ValueError, match="dry-run"):
        reserve_from_proof(proof(dry_run=True))
    with pytest.raises(ValueError, match="no planner peak"):
        reserve_from_proof({"sections": {}})
    # the command rewrites the margin file's reserve and keeps its routing skew
    path = tmp_path / "margin.json"
    shutil.copy(MARGIN_FILE, path)
    (tmp_path / "proof.json").write_text(json.dumps(proof()))
    assert main(["--from-proof", str(tmp_path / "proof.json"), "--file", str(path)]) == 0
    m = load_margin(path, "h100-80g")  # recorded for the proof's device kind; the others keep theirs
    assert m.growth == pytest.approx(round(20 / 19, 4) * 1.15) and m.fixed_bytes == int(1.5 * GIB)
    assert m.measured_on == "h100-80g" and load_margin(path, "910b2-64g") == load_margin(None, "910b2-64g")
    assert m.skew_factor == load_margin().skew_factor and "H100" in capsys.readouterr().out
    # a re-plan of the proof's packs replaces the proof's own planned peak
    assert main(["--from-proof", str(tmp_path / "proof.json"), "--file", str(path), "--planned-bytes",
                 str(20 * GIB), "--planned-how", "re-planned"]) == 0
    assert load_margin(path, "h100-80g").allocated_over_planned == 1.0
    assert "re-planned" in load_margin(path, "h100-80g").sources["allocated_over_planned_source"]
    assert main(["--from-proof", str(tmp_path / "missing.json"), "--file", str(path)]) == 2


def test_allocator_high_water_by_hand():
    from torch.profiler import ProfilerActivity, profile

    from mindvl.plan.validate import allocator_high_water

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        a = torch.empty(2**20)  # 4 MiB
        b = torch.empty(2**21)  # 8 MiB: 12 MiB live
        del a
        c = torch.empty(2**19)  # 2 MiB: 10 MiB live
        del b, c
    assert allocator_high_water(prof) == 12 * 2**20


def test_a_traced_plan_uses_the_margin(tmp_path, monkeypatch):
    m = margin(alloc=1.02, reserved=1.1, factor=1.5, context=0.5)
    monkeypatch.setattr(margin_module, "load_margin", lambda path=None, device=None: m)
    raw = reduced_recipe(tmp_path, 4).to_dict()
    raw["model"] = {"arch": MOE}
    raw["parallel"]["expert_parallel"] = 2
    raw["phase"] = {"name": "multitask", "trainable": ["language_model"]}
    r = plan(load_recipe(raw=raw), 2, get_device("h100-80g"))  # no factor given: the margin's 1.5
    assert r.skew.factor == 1.5 and r.skew_bytes == r.skew.bytes_per_unit // 2 > 0
    assert r.reserve_bytes == int(1.5 * GIB + (1.02 * 1.1 - 1) * (r.peak_bytes_per_rank + r.skew_bytes))
    assert r.headroom == pytest.approx(1 - (r.peak_bytes_per_rank + r.skew_bytes + r.reserve_bytes) / r.capacity_bytes)
    summary = r.to_dict()["routing_skew"]
    assert summary["headroom_at"]["1.5"] == pytest.approx(r.headroom, abs=1e-9)
    balanced = dataclasses.replace(r, skew=dataclasses.replace(r.skew, factor=1.0),
                                   reserve_bytes=m.reserve_bytes(r.peak_bytes_per_rank))
    assert summary["headroom_at"]["1.0"] == pytest.approx(balanced.headroom, abs=1e-9)
    assert "allocator growth" in format_report(r) and r.to_dict()["reserve_source"] == m.describe()


def test_8b_sft_8k_before_and_after_by_hand():
    """MindVL-8B SFT-8K on 8 x H100-80G (the recorded 26.4 GiB peak; dense: no skew term at any factor). Before:
    2 + 0.05 x 79.647 = 5.982 GiB reserve, headroom 1 - 32.382 / 79.647 = 59.3%. After, at 2 GiB + 10% growth:
    2 + 2.64 = 4.64 GiB, headroom 1 - 31.04 / 79.647 = 61.0%."""
    cap = get_device("h100-80g").memory_bytes
    assert cap / GIB == pytest.approx(79.647, abs=0.001)
    peak = int(26.4 * GIB)
    assert 1 - (peak + stated_reserve_bytes(cap)) / cap == pytest.approx(0.593, abs=0.001)
    m = margin(reserved=1.1, factor=2.0)
    assert routing_skew(preset_config("mindvl-8b"), 8192, 1, "full", m.skew_factor).extra_bytes == 0
    assert m.reserve_bytes(peak) / GIB == pytest.approx(4.64, abs=1e-6)
    assert 1 - (peak + m.reserve_bytes(peak)) / cap == pytest.approx(0.610, abs=0.001)
