"""The prepared accelerator proof (benchmarks/accelerator_proof.py) in its CPU dry run, so it cannot rot before a GPU
is lent: every section runs at tiny shapes and succeeds, the mid model's three arms agree on the step-0 loss, and a
crashing section is recorded with its traceback while the next one still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "accelerator_proof.py"


def run_proof(out: Path, *extra: str, env_extra: dict | None = None) -> tuple[int, dict, str]:
    env = {**os.environ, **(env_extra or {})}
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--dry-run", *extra], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=1800)
    proof = json.loads((out / "proof.json").read_text()) if (out / "proof.json").exists() else {}
    return run.returncode, proof, run.stdout + run.stderr


@pytest.mark.slow
def test_dry_run_every_section_succeeds(tmp_path):
    rc, proof, output = run_proof(tmp_path)
    sections = proof["sections"]
    failed = {k: v.get("error") for k, v in sections.items() if not v.get("ok")}
    assert rc == 0 and not failed, (failed, output[-3000:])
    assert set(sections) == {"environment", "tests", "prepare", "plan", "mindvl", "hf_packed", "hf_padded", "moe",
                             "tiny", "generate"}
    assert all(row["identical"] == {"static": True, "graphs": True} for row in sections["generate"]["batches"].values())
    assert sections["environment"]["missing_packages"] == []
    assert sections["tests"]["skipped"] >= 10 and sections["tests"]["failure"] == 0  # no CUDA here: all skip
    mid = sections["mindvl"]
    assert mid["fused_adamw"] and mid["tokens_per_s"] > 0 and 0 < mid["mfu"]
    # same weights, samples and bf16 compute: transformers' padded and padding-free arms give mindvl's loss
    for arm in ("hf_packed", "hf_padded"):
        assert sections[arm]["losses"][0] == pytest.approx(mid["losses"][0], rel=1e-3), arm
    assert sections["plan"]["peak_bytes_per_rank"] > 0
    assert sections["plan"]["device"]["card"] is None and sections["plan"]["device"]["spec"] == "h100-80g"
    assert sections["moe"]["bf16_loss0_rel_diff_vs_cpu_fp32"] < 1e-2
    for part in (mid, sections["moe"]["grouped_mm"], sections["moe"]["unbind_fallback"]):  # the profiled steps
        assert part["profile"]["split_ms"]["backward"] > 0 and part["profile"]["aten_ops"] > 0
    assert sections["tiny"]["tokens_per_s_median"] > 0
    md = (tmp_path / "proof.md").read_text()
    assert "| mindvl | yes |" in md and "Step-0 loss" in md
    assert all(v["section_s"] > 0 for v in sections.values())
    assert len(list(tmp_path.iterdir())) <= 8  # what the device tool brings back


def test_a_crashing_section_is_recorded_and_the_next_runs(tmp_path):
    rc, proof, output = run_proof(tmp_path, "--sections", "environment,tests",
                                  env_extra={"MINDVL_PROOF_FAIL": "environment"})
    assert rc == 1, output[-2000:]
    env, tests = proof["sections"]["environment"], proof["sections"]["tests"]
    assert not env["ok"] and "injected failure" in env["error"] and "Traceback" in env["traceback"]
    assert tests["ok"] and tests["skipped"] >= 10
    assert "environment: RuntimeError" in (tmp_path / "proof.md").read_text()


def load_proof_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("accelerator_proof", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("card, mib, spec", [
    ("NVIDIA H200", 143771, "h200"),
    ("NVIDIA H100 80GB HBM3", 81559, "h100-80g"),
    ("NVIDIA A100-SXM4-80GB", 81920, "a100-80g"),
    ("NVIDIA H100 NVL", 95830, "custom"),  # an H100 whose memory is not the preset's
    ("NVIDIA L40S", 46068, "custom"),  # a card the planner's table does not know
    (None, None, "h100-80g"),  # no GPU (the dry run)
])
def test_the_plan_section_plans_for_the_card_it_runs_on(tmp_path, card, mib, spec):
    """The card the environment section recorded decides the planner's device: its preset, else a custom spec whose
    memory is the card's (not the h100-80g the section once planned for on every card)."""
    from mindvl.plan import get_device

    proof = load_proof_module()
    memory = mib * 2**20 if mib else None
    (tmp_path / "environment.result.json").write_text(json.dumps({"ok": True, "gpu": card,
                                                                  "gpu_memory_bytes": memory}))
    got, info = proof.plan_device(*proof.detected_gpu(tmp_path))
    assert got.split(":")[0] == spec and info["spec"] == got and info["card"] == card
    device = get_device(got)
    if memory:
        assert abs(device.memory_bytes - memory) < 1e-4 * memory
        assert device.peak_flops == get_device("a100-80g" if "A100" in card else "h100-80g").peak_flops
    if card == "NVIDIA H100 NVL":
        assert info["preset"] == "h100-80g" and "another memory" in info["why"]


def test_profiled_step_splits_the_step_on_cpu():
    """The proof's profiled step (its mindvl and moe sections call it) on a tiny MindVL on the CPU: every part of the
    split is present and took time, the step's host reads are counted, the top-10 list is filled; the model and its
    optimizer are left as they were (no hook, no wrapped loss)."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_mindvl import tiny_model, tiny_pack

    from mindvl.config import OptimSection
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import ParallelEnv
    from mindvl.train.step import optimizer_step

    proof = load_proof_module()
    env = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
    model = tiny_model()
    opt = build_optimizer(model, OptimSection(lr=1e-3))
    batch = tiny_pack(model.config, 0)
    ce = model.cross_entropy
    out = proof.profiled_step(lambda: optimizer_step(model, opt, [batch], env, model.config, grad_clip=1.0), model,
                              opt, torch.device("cpu"))
    split = out["split_ms"]
    assert set(split) == {"vit_forward", "llm_forward", "loss_forward", "optimizer", "backward", "loss_backward"}
    assert all(v > 0 for v in split.values()), split
    assert split["loss_backward"] < split["backward"] and out["step_ms"] >= split["backward"]
    assert out["aten_ops"] > 100 and out["device_reads"] >= 1 and len(out["top10"]) == 10
    assert out["kernel_launches"] is None and out["gpu_busy"] is None and out["split_clock"] == "host"
    assert model.cross_entropy is ce and not model.visual._forward_hooks and not opt._optimizer_step_pre_hooks
    json.dumps(out)  # goes into proof.json as it is


def test_busy_fraction_is_the_union_of_kernel_intervals():
    proof = load_proof_module()
    assert proof.busy_fraction([(0, 2), (1, 3), (5, 6), (9, 12)], 0, 10) == 0.5  # [0,3] [5,6] [9,10]
    assert proof.busy_fraction([], 0, 10) == 0.0 and proof.busy_fraction([(0, 1)], 5, 5) is None
