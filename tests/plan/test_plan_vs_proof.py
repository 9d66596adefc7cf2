"""The planner held to what a GPU measured: the H200 proof's figures (tests/plan/data/proof_h200.json, copied from
../shared/measurements/2026-11-28-h200/proof/proof.json with its provenance) against the planner's peak, reserve and
time for the same recipe. A change that moves the planner away from the device fails here."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
from pathlib import Path

import pytest

from mindvl.plan import estimate, get_device, verdict
from mindvl.plan.margin import efficiency_for, load_margin

ROOT = Path(__file__).resolve().parents[2]
PROOF = json.loads((Path(__file__).parent / "data" / "proof_h200.json").read_text())
GIB = 2**30
FULL = (28, 32)  # the proof's decoder layers and ViT blocks


def test_the_recorded_measurement_is_the_proof():
    """The checked-in figures are the proof's own (where the shared folder is present)."""
    src = ROOT.parent / "shared/measurements/2026-11-28-h200/proof/proof.json"
    if not src.is_file():
        pytest.skip("the shared measurements folder is not beside this checkout")
    proof = json.loads(src.read_text())["sections"]
    mem = proof["mindvl"]["memory_planner_packs"]
    assert PROOF["max_allocated_bytes"] == mem["max_allocated_bytes"] == 50100320768
    assert PROOF["reserve_bytes"] == mem["max_reserved_bytes"] - mem["max_allocated_bytes"] \
        + mem["outside_allocator_bytes"]
    assert PROOF["throughput"]["mfu"] == proof["mindvl"]["mfu"]


def test_the_h200_margin_is_fed_from_the_proof():
    m = load_margin(device="h200")
    assert m.measured_on == "h200"
    assert m.reserved_over_allocated == round(PROOF["max_reserved_bytes"] / PROOF["max_allocated_bytes"], 4)
    assert m.runtime_context_bytes == pytest.approx(PROOF["outside_allocator_bytes"], abs=2**20)
    # allocated / planned from a plan of the same packs that counts AdamW as the device does (near 1), never the
    # proof's own torch-2.11 plan (0.58)
    assert 0.9 < m.allocated_over_planned < 1.1
    assert str(PROOF["max_allocated_bytes"]) in m.sources["allocated_over_planned_source"]
    # an H100 borrows it and says so; a 910B has no measurement and says so
    h100, npu = load_margin(device="h100-80g"), load_margin(device="910b2-64g")
    assert h100.growth == m.growth and h100.measured_on == "h200" and "h100-80g not measured" in h100.describe()
    assert npu.measured_on == "" and "no reserve measured on 910b2-64g" in npu.describe()


def _result(device: str, world: int = 1):
    """A PlanResult of the proof's shape for verdict text (numbers by hand, no trace)."""
    from mindvl.plan.planner import PlanResult

    dev = get_device(device)
    m = load_margin(device=device)
    peak = PROOF["max_allocated_bytes"]
    return PlanResult(
        recipe="proof", model_source="test", device=dev, world_size=world, accumulation=2, grad_accumulation="sharded",
        activation_checkpointing="full", peak_bytes_per_rank=peak, breakdown={"optimizer_state": peak},
        capacity_bytes=dev.memory_bytes, reserve_bytes=m.reserve_bytes(peak, peers=world > 1), flops_per_step=1.0,
        flops_by_part={}, comm_bytes_per_step={}, timing=None, tokens_per_step=8192, params={}, packs=[],
        trace_s=0.0, reserve_measured_on=m.measured_on)


@pytest.mark.parametrize("device,says", [("h200", None), ("h100-80g", "reserve measured on h200, not on h100-80g"),
                                         ("910b2-64g", "reserve not measured on 910b2-64g (CPU stand-ins)")])
def test_the_verdict_says_where_its_reserve_comes_from(device, says):
    line = verdict(_result(device))
    assert "\n" not in line
    if says is None:
        assert "measured" not in line
    else:
        assert says in line


def test_time_only_from_a_measured_efficiency():
    """The H200's measured 3.2% MFU (3.1-5.2% over the timed steps) for a ViT + dense LLM gives the proof's own
    step back; no other device kind or family has one, so they get no time."""
    from mindvl.plan.presets import preset_config

    eff = efficiency_for("h200", "vit+dense-llm")
    assert eff is not None and eff.mfu == pytest.approx(PROOF["throughput"]["mfu"], abs=5e-4)
    assert "75f3c42" in eff.source and eff.low <= eff.mfu <= eff.high
    step_s = PROOF["throughput"]["step_s_median"]
    flops = PROOF["throughput"]["mfu"] * step_s * PROOF["throughput"]["peak_flops"]  # the proof's FLOPs per step
    t = estimate.measured_step_time(get_device("h200"), 1, flops, {"all_gather": 0.0}, eff)
    assert t["step_s"] == pytest.approx(step_s, rel=0.02)
    assert t["step_s_low"] < t["step_s"] < t["step_s_high"]
    # collectives slower than the compute bound the step
    slow = estimate.measured_step_time(get_device("h200"), 16, flops, {"all_gather": 100 * 50e9}, eff)
    assert slow["step_s"] == pytest.approx(100.0)
    assert efficiency_for("h100-80g", "vit+dense-llm") is None and efficiency_for("h200", "vit+moe-llm") is None
    assert estimate.model_family(preset_config("mindvl-8b")) == "vit+dense-llm"
    assert estimate.model_family(preset_config("mindvl-671b")) == "vit+moe-llm"
    assert estimate.model_family(preset_config("qwen3-8b")) == "dense-llm"


def _plan_proof(layers):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_plan_vs_proof import plan_proof

    with tempfile.TemporaryDirectory() as tmp:
        return plan_proof(Path(tmp), 1, layers)


def test_the_report_of_an_h200_plan_names_its_efficiency_and_an_h100_plan_has_no_time(tmp_path):
    from test_plan_torch_independent import small_recipe

    from mindvl.plan import format_report, plan

    r = plan(small_recipe(tmp_path), 1, get_device("h200"))
    assert r.est_mfu == pytest.approx(0.0324)  # one rank: no collectives, the measured efficiency itself
    report = format_report(r)
    assert "MFU 3.2%" in report and "measured on h200" in report and "75f3c42" in report
    other = dataclasses.replace(r, timing=None, time_source="no time: none measured")
    assert "MFU" not in format_report(other) and "time: no time" in format_report(other)


def extrapolated_peak(peaks: dict[tuple[int, int], int], to: tuple[int, int] = FULL) -> float:
    """The peak at `to` = (decoder layers, ViT blocks) from traces at (2, 2), (4, 2) and (2, 4): what a rank holds
    per layer and per block (its fp32 parameters, gradients and AdamW state; the checkpointed inputs) grows linearly
    with each; the rest (the embeddings and head, the layer in flight, the loss head, the pack) does not grow."""
    base = peaks[(2, 2)]
    per_layer = (peaks[(4, 2)] - base) / 2
    per_block = (peaks[(2, 4)] - base) / 2
    return base + per_layer * (to[0] - 2) + per_block * (to[1] - 2)


def test_the_planner_peak_and_reserve_for_the_proof_recipe_match_the_h200():
    """The proof's recipe at its real widths, vocabulary, packs and settings, traced shallow (three traces of 2-4
    layers and blocks, ~10x cheaper than the 60-block trace) and extrapolated to its 28 layers and 32 blocks; the rule
    reproduces the full trace (RESULTS.md, "The planner meets a real device"). Against the H200: the peak within 10%
    of max_allocated, the reserve within 25% of reserved - allocated + outside the allocator."""
    results = {layers: _plan_proof(layers) for layers in ((2, 2), (4, 2), (2, 4))}
    for r in results.values():  # the fused AdamW of the device: two fp32 moments per parameter
        assert r.breakdown["optimizer_state"] == pytest.approx(8 * r.params["trainable"], rel=0.001)
    peak = extrapolated_peak({k: r.peak_bytes_per_rank for k, r in results.items()})
    assert peak == pytest.approx(PROOF["max_allocated_bytes"], rel=0.10)
    reserve = load_margin(device="h200").reserve_bytes(int(peak), peers=False)
    assert reserve == pytest.approx(PROOF["reserve_bytes"], rel=0.25)
