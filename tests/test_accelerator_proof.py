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
LAUNCHER_ENV = "MINDVL_PROOF_LAUNCHER"  # the script's LAUNCHER_ENV: how it starts its sections


def run_proof(out: Path, *extra: str, env_extra: dict | None = None, forked: bool = False) -> tuple[int, dict, str]:
    """The dry run; `forked`: the driver and every section forked from the tests' fork server (tests/prefork.py:
    torch and mindvl imported once) rather than started as fresh interpreters."""
    env = {**os.environ, **(env_extra or {})}
    cmd = [sys.executable, str(SCRIPT), "--out", str(out), "--dry-run", *extra]
    if forked:
        import prefork

        env[LAUNCHER_ENV] = json.dumps(prefork.command([], env))
        cmd = prefork.command(cmd[1:], env)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    proof = json.loads((out / "proof.json").read_text()) if (out / "proof.json").exists() else {}
    return run.returncode, proof, run.stdout + run.stderr


@pytest.mark.slow
def test_dry_run_every_section_succeeds(tmp_path):
    # Forked (~50 s less): test_a_crashing_section_is_recorded_and_the_next_runs still starts the driver and its
    # sections as fresh interpreters.
    rc, proof, output = run_proof(tmp_path, forked=True)
    sections = proof["sections"]
    failed = {k: v.get("error") for k, v in sections.items() if not v.get("ok")}
    assert rc == 0 and not failed, (failed, output[-3000:])
    assert set(sections) == {"environment", "tests", "prepare", "plan", "mindvl", "hf_packed", "hf_padded", "moe",
                             "tiny", "generate", "decode_bits"}
    for row in sections["generate"]["batches"].values():
        assert row["identical"] == dict.fromkeys(("static", "graphs", "graphs_compiled", "static_no_cudnn",
                                                  "graphs_no_cudnn"), True)
        compiled = row["graphs_compiled"]
        assert compiled["compiled"] and compiled["common_prefix"] == 8 and compiled["warmup_s"] > 0
        assert row["capture"]["first_call_s"] > 0 and row["sdpa"] and "transformers_no_cudnn" in row
    bits = sections["generate"]["batches"]["1"]["compiled_step_bits"]  # aot_eager runs eager's ops: equal
    assert bits["equal"] and bits["steps"] == 7 and bits["fused_matmul_equal"] and bits["argmax_differs"] == 0
    # aot_eager runs each piece's own ops: equal to eager under every option set (rows 1) and mindvl's (rows 4),
    # except SiLU by eager's CUDA formula against the CPU's fused silu kernel, which in fp32 differ in the last bit
    # (bf16 rounds it away): the same fraction under every option set, since nothing was compiled
    pieces = sections["decode_bits"]["pieces"]
    assert set(pieces) == {"1", "4"} and all(len(pieces[rows]) == 6 for rows in pieces)
    formula = pieces["1"].pop("swiglu_product_by_formula")
    assert len({r["fraction_differing"] for r in formula.values()}) == 1
    assert all(len(sets) == 3 and all(r["equal"] for r in sets.values()) for sets in pieces["1"].values())
    pieces["4"].pop("swiglu_product_by_formula")
    assert all(set(sets) == {"mindvl"} and sets["mindvl"]["equal"] for sets in pieces["4"].values())
    assert sections["environment"]["missing_packages"] == []
    assert sections["tests"]["skipped"] >= 10 and sections["tests"]["failure"] == 0  # no CUDA here: all skip
    mid = sections["mindvl"]
    assert mid["fused_adamw"] and mid["tokens_per_s"] > 0 and 0 < mid["mfu"]
    # same weights, samples and bf16 compute: transformers' padded and padding-free arms give mindvl's loss
    for arm in ("hf_packed", "hf_padded"):
        assert sections[arm]["losses"][0] == pytest.approx(mid["losses"][0], rel=1e-3), arm
    # activation checkpointing off (the AC-off arms): timed, and mindvl's fresh model from the same folder computes
    # the full-AC arm's step-0 loss. On the CPU both arms run the same eager ops on the same bits in one process, so
    # the losses are equal (bit for bit when measured; 1e-7 is ~2 fp32 roundings of the loss sum), while weights
    # perturbed by 0.1% (x (1 + 1e-3 N(0,1))) move it by 2.7e-6. Step 1 too: AC changes no gradient, so the first
    # update and the loss after it are the same.
    off, hf_off = mid["ac_off"], sections["hf_packed"]["ac_off"]
    assert "skipped" not in off and "error" not in off, off
    assert "skipped" not in hf_off and "error" not in hf_off, hf_off
    assert off["prepared"] == {"compiled": False, "checkpointing": "off", "compile_fallbacks": []}
    assert sections["hf_packed"]["checkpointed_modules"] >= 4 and hf_off["checkpointed_modules"] == 0  # 2 + 2 blocks
    assert off["tokens_per_s"] > 0 and off["mfu"] > 0 and hf_off["tokens_per_s"] > 0 and hf_off["mfu"] > 0
    assert off["losses"][0] == pytest.approx(mid["losses"][0], rel=1e-7, abs=0)
    assert off["loss0_rel_diff_vs_full_ac"] <= 1e-7 and off["loss0_match"]
    assert off["losses"][1] == pytest.approx(mid["losses"][1], rel=1e-7, abs=0)
    assert "hf_padded" not in sections or "ac_off" not in sections["hf_padded"]
    # the planner's worst-case packs ran through both arms (on a GPU: the allocator's peaks beside the plan)
    assert "memory_planner_packs" in mid and "memory_planner_packs" in off and "memory_error" not in off
    assert sections["plan"]["peak_bytes_per_rank"] > 0
    assert sections["plan"]["device"]["card"] is None and sections["plan"]["device"]["spec"] == "h100-80g"
    assert sections["moe"]["bf16_loss0_rel_diff_vs_cpu_fp32"] < 1e-2
    for part in (mid, sections["moe"]["grouped_mm"], sections["moe"]["unbind_fallback"]):  # the profiled steps
        assert part["profile"]["split_ms"]["backward"] > 0 and part["profile"]["aten_ops"] > 0
    assert sections["tiny"]["tokens_per_s_median"] > 0
    md = (tmp_path / "proof.md").read_text()
    assert "| mindvl | yes |" in md and "Step-0 loss" in md
    for name, ac in (("mindvl", "full"), ("transformers packed", "full"), ("mindvl", "off"),
                     ("transformers packed", "off")):
        row = next(line for line in md.splitlines() if line.startswith(f"| {name} | {ac} | "))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] != "-" and cells[3].endswith("%"), row  # tokens/s and MFU
        if name == "mindvl":  # mindvl / transformers packed at the same checkpointing
            peer = off if ac == "off" else mid
            hf = hf_off if ac == "off" else sections["hf_packed"]
            assert cells[6] == f"{peer['tokens_per_s'] / hf['tokens_per_s']:.2f}x", row
    assert "Step-0 loss, mindvl AC off vs full" in md
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


def test_kernels_per_step_is_the_difference_of_two_calls():
    """The generate section's kernel count (CUDA there) counted with CPU ops: call(n) runs n matmuls and n additions
    after a fixed prefix, so one step is one matmul and one addition, named, with their time."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("proof_generate", ROOT / "benchmarks" / "proof_generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    x = torch.randn(64, 64)

    def call(n: int) -> None:
        y = x.sin()  # the "prefill": in both calls
        for _ in range(n):
            y = (y @ x).add(1.0)

    out = generate.kernels_per_step(call, top=50, device="cpu")  # every name (CPU ops nest: matmul -> mm)
    named = {k["name"]: k for k in out["by_kernel"]}
    assert named["aten::mm"]["count"] == named["aten::add"]["count"] == 1
    assert isinstance(named["aten::mm"]["us"], float)  # a CPU op's time is noisy; a kernel's is not
    assert out["decode_step"] == sum(k["count"] for k in out["by_kernel"]) and out["prefill"] > out["decode_step"]
    json.dumps(out)


def test_busy_fraction_is_the_union_of_kernel_intervals():
    proof = load_proof_module()
    assert proof.busy_fraction([(0, 2), (1, 3), (5, 6), (9, 12)], 0, 10) == 0.5  # [0,3] [5,6] [9,10]
    assert proof.busy_fraction([], 0, 10) == 0.0 and proof.busy_fraction([(0, 1)], 5, 5) is None


def test_the_ac_off_arm_is_skipped_or_fails_beside_the_section_figures():
    """The AC-off arm's bounds: skipped, with the reason, when the full-AC arm's times say it would pass the
    section's limit; an out-of-memory while it runs is recorded in its sub-dict (the section goes on)."""
    import argparse
    import time

    import torch

    proof = load_proof_module()
    first = {"load_s": 10.0, "step_s": [30.0, 20.0, 5.0], "step_s_median": 5.0, "peak_flops": 1e12, "losses": [7.0]}
    s = {"warmup": 2, "ac_off_timed": 3}

    def oom():
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.00 GiB")

    def run(limit: float, spent: float) -> dict:
        args = argparse.Namespace(limit=limit, started=time.perf_counter() - spent)
        return proof.mindvl_ac_off(args, s, torch.device("cpu"), None, oom, first, [{}] * 7, [100] * 7)

    # needs 10 + 30 + 20 + 3 x 5 = 75 s; the margin is 5 s + 5% of the limit
    skipped = run(limit=180, spent=100)
    assert "needs ~75 s" in skipped["skipped"] and skipped["left_s"] < 75 and "error" not in skipped
    failed = run(limit=180, spent=10)
    assert "skipped" not in failed and failed["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert "Traceback" in failed["traceback"] and failed["memory_at_error"] == {}


def test_a_section_killed_in_its_optional_part_keeps_its_figures(tmp_path):
    """A section that wrote its figures (save_partial) and is then killed at its limit in the AC-off arm: the driver
    keeps the figures, the section stays ok and the arm's sub-dict says what happened; a section killed before
    writing anything is a failure, as before."""
    import argparse
    import time

    proof = load_proof_module()
    result = tmp_path / "mindvl.result.json"
    args = argparse.Namespace(result=str(result), started=time.perf_counter())
    proof.save_partial(args, {"tokens_per_s": 123.0}, "ac_off")
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(sleeper, start_new_session=True)
    data = proof.finish("mindvl", proc, result, time.perf_counter(), timeout=1)
    assert data["ok"] and data["tokens_per_s"] == 123.0 and "partial" not in data, data
    assert data["ac_off"]["error"].startswith("timed out after 1 s in this part")
    result.unlink()
    proc = subprocess.Popen(sleeper, start_new_session=True)
    data = proof.finish("mindvl", proc, result, time.perf_counter(), timeout=1)
    assert not data["ok"] and data["error"] == "timed out after 1 s" and "ac_off" not in data


def test_a_decode_piece_that_fails_to_compile_is_recorded_and_the_others_run(monkeypatch):
    """decode_bits on a device: a compilation that fails (an option or a kernel the device's triton lacks) is one
    entry with its error; the other pieces and option sets are still compared, and the section's figures are saved
    after every piece."""
    import importlib.util

    import torch
    from family_models import build

    spec = importlib.util.spec_from_file_location("proof_generate", ROOT / "benchmarks" / "proof_generate.py")
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    compiled = []

    def backend(gm, example_inputs):  # the traced ops as they are; the second compilation fails
        compiled.append(gm)
        if len(compiled) == 2:
            raise RuntimeError("no triton here")
        return gm.forward

    monkeypatch.setattr(generate, "option_sets", lambda: {"first": {}, "second": {}})  # 12 compilations, not 18
    saved = []
    pieces = generate.piece_bits(build("dense"), (1,), backend, progress=lambda: saved.append(1))["1"]
    assert len(saved) == len(pieces) == 6 and all(len(sets) == 2 for sets in pieces.values())
    results = [r for sets in pieces.values() for r in sets.values()]
    assert [i for i, r in enumerate(results) if "error" in r] == [1] and "no triton here" in results[1]["error"]
    assert pieces["rms_norm"]["second"] is results[1]
    assert all(r["equal"] for name, sets in pieces.items() if name != "swiglu_product_by_formula"
               for r in sets.values() if "error" not in r)
    assert "rms_norm/second" in generate.decode_bits_summary({"pieces": {"1": pieces}})
    torch._dynamo.reset()
