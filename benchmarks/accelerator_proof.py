"""The prepared accelerator proof: one command, <= 8 minutes on one H100, offline; one JSON + one markdown summary.

    python benchmarks/accelerator_proof.py --out $OUT            # on the lent GPU, from the repository root
    python benchmarks/accelerator_proof.py --out /tmp/p --dry-run  # CPU, tiny shapes (CI runs this: tests/)

Install: nothing is installed and the machine's torch is never touched. The children run with the repository root on
PYTHONPATH (`pip install -e .` would need setuptools from an index, which the machine cannot reach). mindvl needs at
import numpy, pillow, pyyaml, rich, tokenizers, safetensors (+ pyarrow, matplotlib for reports), all in the lent
image (KINDS.md); transformers is only the peer arm. The `environment` section names any that is missing; then carry
wheels as the device README says (`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ...
-d .whl NAME==VERSION`, `carry: [".whl"]`, and start the command with `python3 -m pip install -q --no-index --no-deps
--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site`; this script keeps that PYTHONPATH ahead of its own).

Sections, each in its own process with its own time limit; a crash or timeout is recorded (exit code, traceback
tail) and the next section runs:
- environment: python, torch, CUDA, GPU, transformers; mindvl's imports.
- tests: `pytest -m accelerator` (tests/test_accelerator_device.py: attention backends, bf16 FSDP step with fused
  AdamW, streamed copies, KV/MLA-cache generation, grouped experts, each against CPU fp32 references).
- prepare: a mid-size composition with random weights, saved once: a Qwen2.5-VL-7B-shaped ViT (32 blocks, 1280 wide)
  + a Qwen3-1.7B-shaped LLM (28 layers, 2048 wide, GQA 16/8, vocab 151,936), built as transformers'
  Qwen2_5_VLForConditionalGeneration (its decoder is Qwen2's: q/k/v biases, no q/k norms, untied head; transformers
  has no Qwen2.5-VL ViT + Qwen3 class) and imported with `mindvl.checkpoint.convert_from_hf`, so both sides hold the
  same weights.
- generate (benchmarks/proof_generate.py, right after prepare): the mid model's decode in bf16 at batch 1 and 32,
  64 greedy tokens: mindvl's eager loop, static cache and replayed CUDA graph (tokens identical to the eager loop),
  the graph with the layers compiled (fused kernels; kernels per decode step counted eager against compiled),
  the static and graph arms again without cuDNN in sdpa's choice, transformers `generate` with and without cuDNN,
  the capture's cost, the sdpa backend picked per call, and the bandwidth bound (weight bytes / copy bandwidth).
- decode_bits (after generate): the compiled decode step's pieces (norm, residual add + norm, SwiGLU product, the
  same with SiLU as eager's formula, rotation, the norm with its mean of squares by eager's kernels), each compiled
  alone at batch 1 and 32 and compared with eager bit for bit under inductor's defaults,
  decode_compile.INDUCTOR_OPTIONS and those without their triton pair: which piece leaves eager's bits on the
  device, and which options or formula bring it back (COMPILE_BY_DEFAULT waits on it).
- plan: `mindvl.plan.plan` for that recipe on one of the card the proof runs on (CPU, fake tensors; runs beside the
  GPU sections): the planner's preset for the detected GPU (H200 -> h200, H100 -> h100-80g, ...), a `custom:` spec
  from its memory when mindvl has none, h100-80g without a GPU (the dry run); proof.json's `plan.device` says which.
- mindvl: the mid model through the trainer's pieces (load_model, parallelize as on one GPU: plain tensors, bf16
  autocast, full activation checkpointing, blocks compiled where `parallel.compile: auto` compiles them,
  build_optimizer, step.optimizer_step on one 8K pack per step); tokens/s and MFU as the trainer logs them (real
  tokens / step time, pack_training_flops / (step time x device_peak_flops)); then the planner's
  exact traced sequence (a step of 1 and one of 2 worst-case packs) with torch.cuda.max_memory_allocated/reserved;
  then `ac_off`: the full-AC model freed, a fresh one from the same folder with activation checkpointing off (all
  else the same) on the first packs (2 warm-up + 3 timed steps): tokens/s, MFU, peak memory, its step-0 loss
  against the full-AC arm's (the same forward: within one bf16 rounding, 2^-8; bit for bit on the CPU), then the
  planner's worst-case packs again (`ac_off.memory_planner_packs`: the AC-off plan meets the device). Why: MFU
  counts model FLOPs only, and full AC recomputes every block's forward, so under it MFU cannot pass 3/4 of the
  hardware's utilisation; and without AC the model fits a 141 GB H200 (the planner's peak for the plan section's
  packs: 116.6 GiB, 74.0 of it activations, against 46.3 GiB with full AC; the H200 measured 46.7 with it).
- hf_packed / hf_padded: the same weights and samples through transformers (fp32 master weights, bf16 autocast,
  gradient checkpointing, torch's fused AdamW + clip_grad_norm_): one padding-free packed row per step, or the
  step's samples right-padded in micro-batches of 8 rows (gradients accumulated, loss weighted per labelled token).
  hf_packed then adds `ac_off`: `gradient_checkpointing_disable()` and the first packs again (1 warm-up + 3 timed;
  the same model and optimizer, which changes the losses, not the work). proof.md sets both AC-off arms beside the
  full-AC ones, with mindvl / transformers packed at equal AC.
- The AC-off arms are optional parts: each runs only when the full-AC arm's load and step times say it fits in
  what is left of its section's limit (else `ac_off.skipped` says so), an error there (out of memory above all)
  lands in `ac_off.error` with its traceback, and the section's figures are written before it starts, so a kill at
  the limit keeps them (`ac_off.error` then says so). `--section-limit mindvl=360` gives a rerun room for them.
- moe: a small DeepSeek-V3-shaped MoE LLM (MLA, 64 routed experts top-8 in 8 groups, a shared expert) training in
  bf16 with grouped_mm experts against the unbind fallback, step-0 loss against the CPU fp32 forward.
- tiny: the packaged tiny SFT recipe through `mindvl.train.trainer.train`; tokens/s and MFU from its metrics.jsonl.
- profile (not a process of its own: a switch of the mindvl and moe sections, on in a full run; name it in
  `--sections` to keep it in a subset): after their timed steps, one more step under torch.profiler, summarised as
  `profile` in their JSON (`profiled_step`): kernel launches, host syncs (cudaStreamSynchronize /
  cudaDeviceSynchronize / cudaEventSynchronize calls, and `.item()`-style reads), GPU-busy fraction of the step,
  the top-10 kernels by device time, and the step split into ViT / LLM / loss forward, backward (the loss's own
  part of it), optimizer. On a CPU (the dry run) the same summary has host times and aten ops instead of kernels.

Outputs under --out: proof.json (everything, with tracebacks), proof.md (the summary table), proof.log, and on a GPU
margin_reserve.json (the planner's reserve as measured: `python -m mindvl.plan.margin --from-proof OUT/proof.json`).

On the lent machine (15 minutes of device time in all, a start included): one call of the device tool with
`python3 benchmarks/accelerator_proof.py --out $OUT` and timeout_s 540 (the sections stop at --budget-s 450, the
background planner 10 s later); then, if something broke and was fixed, rerun only that part, e.g.
`--sections prepare,mindvl,profile --budget-s 240` (prepare is needed by mindvl, hf_packed and hf_padded; on the
H200 of 2026-11-28 prepare took 20 s and mindvl 44 s before compile and the profiled step: well under 4 minutes).
The AC-off arms cost about what their full-AC arms took for as many steps (mindvl: its load and 5 steps, reusing
the first arm's compiled blocks; hf_packed: 4 steps, ~10 s at the H200's 2.5 s steps) and fit in the default limits
(mindvl 240 s, hf_packed 90 s) only when the full-AC arms are quick; when proof.json says `ac_off.skipped`, get them
with `--sections prepare,mindvl,hf_packed --section-limit mindvl=360 --section-limit hf_packed=150 --budget-s 420`.
Issue 39 (generation) first: `--sections environment,prepare,generate,decode_bits --budget-s 450` with timeout_s
520 (environment 6 s and prepare 20 s on the H200, generate up to its 300 s: six mindvl arms at batch 1 and 32,
inductor compiling the decode layers twice, the two transformers arms; decode_bits up to 90 s: each piece of the
compiled step compiled alone, its bits against eager's under each option set), then the rest
(`--sections tests,prepare,mindvl,profile,...`) with what is left.
Not yet known: how long inductor takes for the mid model's blocks (the H200 run of 2026-11-28 compiled nothing: the
blocks' graph breaks inside checkpoint wrappers ran them eagerly, fixed since); the first run's proof.json has it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GIB = 2**30
MINDVL_IMPORTS = ("numpy", "PIL", "yaml", "rich", "tokenizers", "safetensors", "pyarrow", "matplotlib")

# (name, seconds on the GPU, seconds in --dry-run); run in this order, each capped by what is left of --budget-s.
# (The dry run's limits are generous: CI machines and shared ones are slow; a quiet 2-core run takes ~20-50 s each.)
# mindvl's 240 s: its blocks compile for real now (inside the checkpoint wrappers), several graphs per block type.
SECTIONS = [("environment", 60, 120), ("tests", 150, 180), ("prepare", 120, 180), ("mindvl", 240, 240),
            ("hf_packed", 90, 180), ("moe", 75, 180), ("tiny", 60, 180), ("hf_padded", 90, 180)]
# issue 39, right after prepare: benchmarks/proof_generate.py (300 s: its compiled arm compiles the layers twice,
# at batch 1 and again with a dynamic batch)
SECTIONS.insert(3, ("generate", 300, 240))
# then each of the compiled decode step's pieces alone, eager's bits or not, under each option set (proof_generate)
SECTIONS.insert(4, ("decode_bits", 90, 180))
PLAN_TIMEOUT = (240, 300)  # the planner runs in the background from after `prepare`
PROFILE = "profile"  # the switch that adds a profiled step to the mindvl and moe sections (see the docstring)
FAIL_ENV = "MINDVL_PROOF_FAIL"  # a section name: that section raises at once (tests of the failure isolation)
# A JSON list: the command that starts a section's interpreter, in place of this Python (its script and arguments
# follow). Unset on the GPU; the dry run's CI test forks the sections from its fork server (tests/prefork.py:
# torch already imported, ~3-4 s less per section; its output, exit code and kill-on-timeout are a process's).
LAUNCHER_ENV = "MINDVL_PROOF_LAUNCHER"


# ------------------------------------------------------------------------------------------------------ shapes


def shapes(dry: bool) -> dict:
    """The mid-size composition (GPU) or a miniature of it (--dry-run), and its data."""
    if dry:
        vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128,
                      fullatt_block_indexes=[1])
        text = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=2048, mrope_section=[4, 6, 6])
        return dict(vision=vision, text=text, row_tokens=512, steps=2, warmup=1, samples=10,
                    max_pixels=16 * 28 * 28, micro_rows=4, ac_off_timed=1)
    vision = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=2048,
                  fullatt_block_indexes=[7, 15, 23, 31])
    text = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                num_key_value_heads=8, vocab_size=151936, mrope_section=[16, 24, 24])
    # ac_off_timed: the timed steps of the activation-checkpointing-off arms (after their warm-up steps)
    return dict(vision=vision, text=text, row_tokens=8192, steps=7, warmup=2, samples=480,
                max_pixels=256 * 28 * 28, micro_rows=8, ac_off_timed=3)


def hf_config(s: dict, peers) -> dict:
    v, t = s["vision"], s["text"]
    peers.set_vocab(t["vocab_size"])
    return dict(
        vision_config=dict(depth=v["depth"], hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                           num_heads=v["num_heads"], out_hidden_size=v["out_hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=v["fullatt_block_indexes"], in_channels=3),
        hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
        num_hidden_layers=t["num_hidden_layers"], num_attention_heads=t["num_attention_heads"],
        num_key_value_heads=t["num_key_value_heads"], vocab_size=t["vocab_size"], rope_theta=1e6,
        rope_scaling={"type": "mrope", "mrope_section": t["mrope_section"]}, max_position_embeddings=32768,
        rms_norm_eps=1e-6, image_token_id=peers.IMAGE_TOKEN, video_token_id=peers.VIDEO_TOKEN,
        vision_start_token_id=peers.VISION_START, vision_end_token_id=peers.VISION_END, bos_token_id=0,
        eos_token_id=1, tie_word_embeddings=False)


def peers_module():
    sys.path.insert(0, str(HERE))
    import bench_peers

    return bench_peers


def make_samples(n: int, seed: int, max_pixels: int) -> list[dict]:
    """bench_peers' sample mix (30% text, 70% one native-resolution image) under this run's max_pixels."""
    import math
    import random

    from mindvl.data.image import smart_resize

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.7:
            h, w = smart_resize(rng.randint(224, 1792), rng.randint(224, 1792), max_pixels=max_pixels)
            out.append({"text": max(8, int(rng.lognormvariate(math.log(120), 0.8))), "grid": [1, h // 14, w // 14]})
        else:
            out.append({"text": max(8, int(rng.lognormvariate(math.log(300), 0.9))), "grid": None})
    return out


def step_data(s: dict, arm: str, image_token: int, merge: int) -> tuple[list, list[int], list[list[int]]]:
    """(batches of `arm`, real tokens per step, sample groups): the same samples and groups for every arm."""
    peers = peers_module()
    peers.set_vocab(s["text"]["vocab_size"])
    samples = make_samples(s["samples"], 0, s["max_pixels"])
    groups = peers.step_groups(samples, s["steps"], s["row_tokens"])
    real = [sum(peers.length(samples[i]) for i in g) for g in groups]
    batches = peers.build_batches("mindvl" if arm == "mindvl" else arm, samples, groups, s["text"]["vocab_size"], 0,
                                  image_token, merge)
    return batches, real, groups


def plan_recipe(work: Path, s: dict) -> dict:
    """The recipe the planner plans and the real memory step runs: the prepared model, 8K packs, bf16, full AC,
    2 micro-batches per step on one rank (the planner traces a step of 1 and one of 2)."""
    return {"output_dir": str(work / "plan-out"), "model": {"init_from": str(work / "mindvl")},
            "data": {"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 64, "seed": 3}}],
                     "seq_len": s["row_tokens"], "max_pixels": s["max_pixels"], "min_pixels": 4 * 28 * 28,
                     "pack_buffer": 16, "synth_cache": str(work / "synth"), "default_system": None},
            "phase": {"name": "sft"}, "batch": {"global_batch_size": 2}, "budget": {"max_steps": 1},
            "parallel": {"mixed_precision": "bf16", "activation_checkpointing": "full"}}


# ------------------------------------------------------------------------------------------------------ helpers


def record_margin(res: dict, out: Path, say) -> None:
    """The planner's reserve as this GPU measured it (mindvl.plan.margin), written beside proof.json as
    margin_reserve.json; `python -m mindvl.plan.margin --from-proof OUT/proof.json` puts it into
    mindvl/plan/margin.json (a reviewed step: the proof never edits the repository)."""
    if str(ROOT) not in sys.path:
        sys.path.append(str(ROOT))  # the repository, as the sections' children import it (no install)
    from mindvl.plan.margin import reserve_from_proof

    try:
        reserve = reserve_from_proof(res)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        say(f"planner margin not recorded: {exc}")
        return
    (out / "margin_reserve.json").write_text(json.dumps(reserve, indent=1))
    say(f"planner margin measured: allocated/planned {reserve['allocated_over_planned']}, reserved/allocated "
        f"{reserve['reserved_over_allocated']}, outside the allocator {reserve['runtime_context_gib']} GiB "
        f"(margin_reserve.json; record it with python -m mindvl.plan.margin --from-proof {out / 'proof.json'})")


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device) -> dict:
    import torch

    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "max_reserved_bytes": torch.cuda.max_memory_reserved(device), "reserved_bytes": reserved,
            "outside_allocator_bytes": total - free - reserved, "total_bytes": total}


def the_device():
    import torch

    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def summary(times: list[float], tokens: list[int], flops: list[float], peak: float, warmup: int) -> dict:
    t, n, f = times[warmup:], tokens[warmup:], flops[warmup:]
    return {"tokens_per_s": sum(n) / sum(t), "mfu": sum(f) / (sum(t) * peak) if f else None,
            "step_s_median": statistics.median(t), "step_s": [round(x, 4) for x in times], "timed_steps": len(t),
            "timed_tokens": sum(n)}


# ------------------------------------------------------------------------------------------------------ AC off
# The same model and packs once more without activation checkpointing. Under full AC every block's forward runs
# twice, and the trainer's MFU counts model FLOPs only: its ceiling is 3/4 of what the hardware achieves. These arms
# are optional: bounded by the section's limit (skipped, with the reason, when the first arm's times say they would
# not fit), their failures (out of memory included) recorded in their own sub-dict, and the section's figures
# written before they start (save_partial), so a kill at the section's limit keeps them.

AC_OFF = "ac_off"  # the sub-dict of the mindvl and hf_packed sections
AC_OFF_LOSS_MATCH = 2.0**-8  # step-0 loss, AC off vs full: the same forward; compiled graphs may round differently,
# by less than one bf16 rounding (unit roundoff 2^-8) of the loss; the CPU dry run's eager forward is the same ops


def time_left(args) -> float:
    """Seconds left of this section's limit (the driver kills the process there), less a margin for the result."""
    return args.limit - (time.perf_counter() - args.started) - (5.0 + 0.05 * args.limit)


def save_partial(args, data: dict, running: str) -> None:
    """The section's result so far, written where its final result goes, naming the optional part that runs now
    (`running`): if that part is killed at the limit or crashes the process, `finish` keeps these figures."""
    partial = {"ok": True, **data, "partial": running,
               "section_s": round(time.perf_counter() - args.started, 1)}
    Path(args.result).write_text(json.dumps(partial, default=str))


def free_device(dev) -> None:
    """Drop what a freed model left behind: cycles, the allocator's cache; then the peak statistics start again.
    Compiled code is kept: the blocks are compiled inside their checkpoint wrappers, so the AC-off arm runs the same
    block code and reuses the first arm's graphs (guarded on the block's type and shapes, not on the model object)
    instead of spending device time compiling them again."""
    import gc

    import torch

    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)


def ac_off_failure(exc: BaseException, dev) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc(),
            "memory_at_error": memory(dev)}


def ac_off_skip(estimate: float, args) -> dict | None:
    """None when `estimate` seconds fit in what is left of the section's limit; else the recorded skip."""
    left = time_left(args)
    if estimate <= left:
        return None
    return {"skipped": f"needs ~{estimate:.0f} s (from the full-AC arm's load and step times), {left:.0f} s left "
                       f"of the section's {args.limit:.0f} s", "estimate_s": round(estimate, 1),
            "left_s": round(left, 1)}


# ------------------------------------------------------------------------------------------------------ profile

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
            "cudaLaunchCooperativeKernel")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
RANGES = ("vit_forward", "llm_forward", "loss_forward", "optimizer")


class StepRanges:
    """record_function ranges around a MindVL's parts, opened and closed by hooks from outside the model: the
    vision tower's and the language model's forwards (module hooks), the loss (the model's `cross_entropy`
    attribute, where the vocabulary-parallel loss also plugs in) and the optimizer's step (optimizer hooks)."""

    def __init__(self, model, optimizer) -> None:
        from torch.autograd.profiler import record_function

        self.handles, self.open, self.model = [], {}, model
        self.saved_ce = getattr(model, "cross_entropy", None)

        def opener(name):
            def enter(*_):
                self.open[name] = record_function(name)
                self.open[name].__enter__()
            return enter

        def closer(name):
            def leave(*_):
                if name in self.open:
                    self.open.pop(name).__exit__(None, None, None)
            return leave

        for name, module in (("vit_forward", getattr(model, "visual", None)),
                             ("llm_forward", getattr(model, "language_model", None))):
            if module is not None:
                self.handles += [module.register_forward_pre_hook(opener(name)),
                                 module.register_forward_hook(closer(name), always_call=True)]
        self.handles += [optimizer.register_step_pre_hook(opener("optimizer")),
                         optimizer.register_step_post_hook(closer("optimizer"))]
        if self.saved_ce is not None:
            inner = self.saved_ce

            def loss(*args, **kwargs):
                with record_function("loss_forward"):
                    return inner(*args, **kwargs)
            model.cross_entropy = loss

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.saved_ce is not None:
            self.model.cross_entropy = self.saved_ce


def busy_fraction(intervals: list[tuple[float, float]], start: float, end: float) -> float | None:
    """The share of [start, end] covered by the union of the (start, end) intervals (kernels on the device)."""
    if end <= start:
        return None
    covered, reach = 0.0, start
    for a, b in sorted(intervals):
        a, b = max(a, reach), min(b, end)
        if b > a:
            covered += b - a
            reach = b
    return covered / (end - start)


def profile_summary(prof, device) -> dict:
    """What one profiled step shows: launches, host syncs, busy fraction, top kernels, the split into ranges."""
    events = prof.events()
    on_gpu = device.type == "cuda"
    by_name = {e.key: e for e in prof.key_averages()}
    count = lambda names: sum(by_name[n].count for n in names if n in by_name)  # noqa: E731
    step = [e for e in events if e.name == "proof_step"]
    t0, t1 = (step[0].time_range.start, step[0].time_range.end) if step else (0.0, 0.0)
    kernels = [e for e in events if e.device_type == torch_device_type("CUDA")] if on_gpu else []
    end = max([t1, *(k.time_range.end for k in kernels)])
    time_of = (lambda e: e.device_time_total) if on_gpu else (lambda e: e.cpu_time_total)  # noqa: E731
    split = {name: time_of(by_name[name]) / 1e3 for name in RANGES if name in by_name}
    autograd = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")]
    split["backward"] = sum(time_of(e) for e in autograd) / 1e3
    split["loss_backward"] = sum(time_of(e) for e in autograd if "ChunkedLinearCrossEntropy" in e.name
                                 or "VocabParallelCE" in e.name) / 1e3
    if on_gpu:
        top = sorted((e for e in prof.key_averages() if e.self_device_time_total > 0 and e.device_type ==
                      torch_device_type("CUDA")), key=lambda e: -e.self_device_time_total)[:10]
        top10 = [{"kernel": e.key[:160], "ms": round(e.self_device_time_total / 1e3, 3), "calls": e.count} for e in top]
    else:  # no kernels on a CPU: the aten ops by self host time
        top = sorted((e for e in prof.key_averages() if e.key.startswith("aten::")),
                     key=lambda e: -e.self_cpu_time_total)[:10]
        top10 = [{"op": e.key, "ms": round(e.self_cpu_time_total / 1e3, 3), "calls": e.count} for e in top]
    return {"device": str(device), "step_ms": round((end - t0) / 1e3, 3),
            "kernel_launches": count(LAUNCHES) if on_gpu else None, "kernels": len(kernels) if on_gpu else None,
            "aten_ops": sum(e.count for e in prof.key_averages() if e.key.startswith("aten::")),
            "host_syncs": count(SYNCS) if on_gpu else None,  # includes the profiled window's closing synchronize
            "device_reads": count(("aten::_local_scalar_dense",)),  # .item()/.tolist()/bool(t): each a sync on a GPU
            "memcpy": count(("cudaMemcpyAsync", "cudaMemcpy")) if on_gpu else None,
            "copies": count(("aten::copy_",)), "casts": count(("aten::_to_copy",)),
            "gpu_busy": busy_fraction([(k.time_range.start, k.time_range.end) for k in kernels], t0, end)
            if on_gpu else None,
            "split_ms": {k: round(v, 3) for k, v in split.items()},
            "split_clock": "device" if on_gpu else "host", "top10": top10}


def torch_device_type(name: str):
    from torch.autograd import DeviceType

    return getattr(DeviceType, name)


def profiled_step(run_step, model, optimizer, device) -> dict:
    """`run_step()` once more under torch.profiler (CPU activity, and CUDA's on a GPU), inside a `proof_step` range
    with the model's parts marked (StepRanges); the summary of `profile_summary`."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    ranges = StepRanges(model, optimizer)
    try:
        sync(device)
        with profile(activities=activities) as prof:
            with record_function("proof_step"):
                run_step()
                sync(device)
    finally:
        ranges.remove()
    return profile_summary(prof, device)


# ------------------------------------------------------------------------------------------------------ sections


def sec_environment(args, work: Path) -> dict:
    import importlib
    import platform

    import torch

    out = {"python": sys.version.split()[0], "executable": sys.executable, "platform": platform.platform(),
           "torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
           "threads": torch.get_num_threads(), "load_average": os.getloadavg()}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, sm_count=p.multi_processor_count,
                   capability=list(torch.cuda.get_device_capability(0)))
    missing = []
    for name in (*MINDVL_IMPORTS, "transformers"):
        try:
            mod = importlib.import_module(name)
            out[f"version_{name}"] = getattr(mod, "__version__", "?")
        except ImportError as exc:
            missing.append(f"{name} ({exc})")
    import mindvl
    from mindvl.train.metrics import device_peak_flops

    out["mindvl_file"] = mindvl.__file__
    out["missing_packages"] = missing
    peak, how = device_peak_flops(the_device())
    out.update(peak_flops=peak, peak_how=how)
    return out


def sec_tests(args, work: Path) -> dict:
    xml = work / "tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-v", "-m", "accelerator", "-p", "no:cacheprovider",
           f"--junitxml={xml}", str(ROOT / "tests" / "test_accelerator_device.py")]
    # pytest stops short of the section's limit, so a slow compile cannot take the results of the finished tests
    # with it: on a timeout the verbose lines (one per finished test) are kept.
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=max(10.0, args.limit - 15))
        stdout, stderr, rc = run.stdout, run.stderr, run.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, rc = "pytest stopped: section time limit", None
    out = {"returncode": rc, "output_tail": stdout[-4000:] + stderr[-2000:]}
    if not xml.exists():
        lines = [ln for ln in stdout.splitlines() if "::" in ln and any(
            w in ln for w in (" PASSED", " FAILED", " ERROR", " SKIPPED"))]
        out["finished_tests"] = lines
        out["passed"] = sum(" PASSED" in ln for ln in lines)
        out["failure"] = sum(" FAILED" in ln or " ERROR" in ln for ln in lines)
        out["skipped"] = sum(" SKIPPED" in ln for ln in lines)
        if rc is None:
            raise RuntimeError(f"pytest timed out after {len(lines)} finished tests: {out['passed']} passed, "
                               f"{out['failure']} failed (lines in proof.log)")
    if xml.exists():
        import xml.etree.ElementTree as ET

        cases = []
        for case in ET.parse(xml).getroot().iter("testcase"):
            status = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    status = child.tag
                    if child.tag != "skipped":
                        cases.append({"name": case.get("name"), "status": status,
                                      "message": (child.get("message") or "")[:800]})
                    break
            if status == "passed":
                cases.append({"name": case.get("name"), "status": status})
            elif status == "skipped":
                cases.append({"name": case.get("name"), "status": status})
        out["cases"] = cases
        for status in ("passed", "failure", "error", "skipped"):
            out[status] = sum(c["status"] == status for c in cases)
    return out


def sec_prepare(args, work: Path) -> dict:
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from mindvl.checkpoint import convert_from_hf

    s, peers = shapes(args.dry_run), peers_module()
    dev = the_device()
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with torch.device(dev):  # initialise on the GPU: seconds instead of a minute of CPU normal draws
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**hf_config(s, peers)))
        with torch.no_grad():  # randomise norms and biases too (transformers sets them to 1 and 0)
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.02) + (1.0 if "norm" in name else 0.0))
    n = sum(p.numel() for p in model.parameters())
    # bf16 on disk halves the I/O; both arms load it as fp32 master weights (the same values on both sides)
    model.to(torch.bfloat16).save_pretrained(work / "hf")
    del model
    t1 = time.perf_counter()
    convert_from_hf(work / "hf", work / "mindvl")
    return {"parameters": n, "build_and_save_s": t1 - t0, "convert_s": time.perf_counter() - t1,
            "folder_bytes": sum(f.stat().st_size for f in (work / "mindvl").iterdir())}


def stream_of(packs: list, dev, config):
    """The trainer's stream over host packs: each described on the host (`batch_layout`) before its copy to the
    device, as the trainer does, so the step reads nothing back in forward/backward."""
    from mindvl.train.step import MicroBatchStream, batch_layout

    return MicroBatchStream(iter(packs).__next__, len(packs), dev, layout=batch_layout(config))


def train_step(model, opt, packs: list, dev, env, config):
    """One optimizer step of the trainer's pieces over `packs` (its micro-batches), gradients clipped at 1.0."""
    from mindvl.train.step import optimizer_step

    return optimizer_step(model, opt, stream_of(packs, dev, config), env, config, grad_clip=1.0)


def timed_step(model, opt, batch: dict, dev, env, config):
    """(seconds, stats, loss) of one optimizer step on one pack; reading the loss is the step's host sync."""
    sync(dev)
    ta = time.perf_counter()
    stats = train_step(model, opt, [batch], dev, env, config)
    loss = stats.loss_sum / float(stats.counts[0])
    sync(dev)
    return time.perf_counter() - ta, stats, loss


NO_GPU_PRESET = "h100-80g"  # what the planner plans for where no GPU is seen (the CPU dry run)
MEMORY_MATCH = 0.05  # a preset whose memory is further than this from the card's is not the card (H100 NVL: 94 GB)


def plan_device(gpu: str | None, memory_bytes: int | None) -> tuple[str, dict]:
    """The planner's device spec for the card the proof runs on, and what proof.json records about the choice.

    `gpu`, `memory_bytes`: the runtime's name and total memory (None: no GPU). The preset of the planner's table
    that the name matches (mindvl.plan.devices.device_for_name: H200 -> h200, H100/H800 -> h100-80g, ...) when its
    memory is the card's; else a `custom:` spec with the card's memory and the matched preset's (or, for a card
    the table does not know, h100-80g's) FLOP/s and bandwidths, which the one-rank plan uses only for its time
    estimate. Without a GPU: h100-80g."""
    from mindvl.plan.devices import GB, get_device
    from mindvl.plan.devices import device_for_name as preset_for

    if not gpu:
        return NO_GPU_PRESET, {"card": None, "memory_bytes": None, "preset": NO_GPU_PRESET, "spec": NO_GPU_PRESET,
                               "why": "no GPU seen (CPU dry run): the planner's h100-80g"}
    preset = preset_for(gpu)
    info = {"card": gpu, "memory_bytes": memory_bytes, "preset": preset.name if preset else None}
    if preset is not None and (not memory_bytes or abs(preset.memory_bytes - memory_bytes)
                               <= MEMORY_MATCH * memory_bytes):
        return preset.name, {**info, "spec": preset.name, "why": f"{gpu} is the planner's {preset.name}"}
    if not memory_bytes:
        raise ValueError(f"{gpu}: no planner preset matches it and its memory is unknown; run the environment "
                         "section (it records the card) or add the card to mindvl/plan/devices.py")
    like = preset or get_device(NO_GPU_PRESET)
    spec = (f"custom:mem_gb={memory_bytes / GB:.3f},tflops={like.peak_flops / 1e12:g},"
            f"hbm_gbs={like.hbm_bytes_s / GB:g},intra_gbs={like.intra_bytes_s / GB:g},"
            f"inter_gbs={like.inter_bytes_s / GB:g},per_node={like.per_node}")
    why = (f"{gpu}: {'its preset ' + preset.name + ' has another memory' if preset else 'no planner preset'}; "
           f"the card's memory with {like.name}'s FLOP/s and bandwidths")
    return spec, {**info, "spec": spec, "why": why}


def detected_gpu(work: Path) -> tuple[str | None, int | None]:
    """The card's name and memory as the environment section recorded them (that child has exited, so the planner
    beside the GPU sections never opens a CUDA context of its own); read from torch only when it did not run."""
    env = work / "environment.result.json"
    if env.exists():
        data = json.loads(env.read_text())
        if data.get("ok"):
            return data.get("gpu"), data.get("gpu_memory_bytes")
    import torch

    if not torch.cuda.is_available():
        return None, None
    p = torch.cuda.get_device_properties(0)
    return p.name, p.total_memory


def sec_plan(args, work: Path) -> dict:
    import torch

    from mindvl.config import load_recipe
    from mindvl.plan import get_device, plan

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))  # leave the cores to the GPU sections beside it
    spec, device = plan_device(*detected_gpu(work))
    recipe = load_recipe(raw=plan_recipe(work, shapes(args.dry_run)))
    r = plan(recipe, 1, get_device(spec), recipe_name="proof mid-size SFT 8K")
    d = r.to_dict()
    return {"device": device, **{k: d[k] for k in (
        "fits", "headroom", "peak_bytes_per_rank", "reserve_bytes", "capacity_bytes", "breakdown", "flops_per_step",
        "est_step_time_s", "est_mfu", "params", "packs", "trace_s", "notes", "torch", "time_source")}}


def sec_mindvl(args, work: Path) -> dict:
    import torch

    from mindvl.checkpoint import load_model
    from mindvl.config import OptimSection, ParallelSection, load_recipe
    from mindvl.data import DataConfig
    from mindvl.plan.packs import worst_case_packs
    from mindvl.train.metrics import device_peak_flops
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import ParallelEnv, Prepared, destroy, parallelize

    s = shapes(args.dry_run)
    dev = the_device()
    env = ParallelEnv(0, 1, 0, dev, "nccl" if dev.type == "cuda" else "gloo")
    out: dict = {}
    def build(compile_mode: str, checkpointing: str = "full"):
        """The trainer's defaults on one GPU: plain tensors, bf16 autocast, blocks compiled (`auto`)."""
        model = load_model(work / "mindvl", dtype=torch.float32, device=dev)
        model.train()
        pcfg = ParallelSection(mixed_precision="bf16", activation_checkpointing=checkpointing, compile=compile_mode)
        prepared = Prepared()
        model = parallelize(model, env, pcfg, prepared)
        return model, build_optimizer(model, OptimSection(lr=1e-5, weight_decay=0.1)), prepared

    try:
        t0 = time.perf_counter()
        model, opt, prepared = build("auto")
        config = model.config
        out["load_s"] = time.perf_counter() - t0
        out["fused_adamw"] = all(bool(g.get("fused")) for g in opt.param_groups)
        batches, real, groups = step_data(s, "mindvl", config.image_token_id, config.vision.spatial_merge_size)
        peak, how = device_peak_flops(dev)
        times, flops, losses = [], [], []
        parts = {"forward_s": [], "backward_s": [], "optimizer_s": []}
        for i, batch in enumerate(batches):
            try:
                seconds, stats, loss = timed_step(model, opt, batch, dev, env, config)
            except Exception as exc:  # a compile failure costs the compiled figures, not the section
                # (inductor's own failures fall back per graph under `auto`, listed in prepared.compile_fallbacks;
                # this takes the rest: dynamo's tracing, a compiled kernel that fails when it runs)
                if i > 0 or not prepared.compiled:
                    raise
                out.update(compile_error=f"{type(exc).__name__}: {exc}"[:2000],
                           compile_traceback=traceback.format_exc())
                del model, opt
                torch._dynamo.reset()
                model, opt, prepared = build("off")
                seconds, stats, loss = timed_step(model, opt, batch, dev, env, config)
            times.append(seconds)
            losses.append(loss)
            flops.append(float(stats.counts[2]))
            for k in parts:
                parts[k].append(getattr(stats, k))
        out.update(summary(times, real, flops, peak, s["warmup"]), peak_flops=peak, peak_how=how, losses=losses,
                   samples=sum(len(g) for g in groups), tokens_per_step=real,
                   **{k: statistics.median(v[s["warmup"]:]) for k, v in parts.items()},
                   note="forward_s/backward_s are host times (kernels are asynchronous): only the step time is exact")
        out["memory_after_throughput"] = memory(dev)
        out["prepared"] = {"fsdp": prepared.fsdp, "compiled": prepared.compiled, "autocast": str(prepared.autocast),
                           # block graphs inductor could not compile, run eagerly (`auto`): the figures are theirs
                           "compile_fallbacks": prepared.compile_fallbacks}
        if args.profile:  # the last timed step's pack once more, profiled
            batch = batches[-1]
            out["profile"] = profiled_step(lambda: train_step(model, opt, [batch], dev, env, config), model, opt, dev)
        # The planner's traced sequence on its own worst-case packs: a step of 1 micro-batch, then one of 2. An
        # out-of-memory here is a finding, recorded beside the throughput figures above (not instead of them).
        packs = None
        try:
            recipe = load_recipe(raw=plan_recipe(work, s))
            packs = worst_case_packs(DataConfig.from_dict(recipe.data), config)
            out["planner_packs"] = [{"tokens": p.tokens, "images": len(p.images), "patches": p.patches}
                                    for p in packs]
        except Exception as exc:
            out.update(memory_error=f"{type(exc).__name__}: {exc}"[:2000], memory_traceback=traceback.format_exc())
        if packs:
            out.update(planner_packs_memory(model, opt, env, config, dev, packs))
        # The same packs without activation checkpointing, on a fresh model from the same folder (same weights):
        # the full-AC model, its optimizer and the allocator's cache are freed first.
        save_partial(args, out, AC_OFF)
        compile_mode = "off" if out.get("compile_error") else "auto"
        model = opt = prepared = None  # (cells of the profiled step's closure: rebinding frees them too)
        free_device(dev)
        out[AC_OFF] = mindvl_ac_off(args, s, dev, env, lambda: build(compile_mode, "off"), out, batches, real, packs)
        return out
    finally:
        destroy(env)


def planner_packs_memory(model, opt, env, config, dev, packs) -> dict:
    """The planner's traced sequence on its worst-case `packs` (a step of 1 micro-batch, then one of 2) through
    `model`: {"memory_planner_packs": the allocator's peaks}, or the error (out of memory above all) with the memory
    at that moment."""
    import torch

    from mindvl.plan.packs import fake_pack

    try:
        gen = torch.Generator().manual_seed(1)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(dev)
        for n in (1, 2):
            made = [fake_pack(packs[i % len(packs)], config, lambda shape: torch.randn(shape, generator=gen))
                    for i in range(n)]
            train_step(model, opt, made, dev, env, config)
        sync(dev)
        return {"memory_planner_packs": memory(dev)}
    except Exception as exc:
        return {"memory_error": f"{type(exc).__name__}: {exc}"[:2000], "memory_traceback": traceback.format_exc(),
                "memory_at_error": memory(dev)}


def mindvl_ac_off(args, s: dict, dev, env, build, first: dict, batches: list, real: list[int],
                  packs: list | None = None) -> dict:
    """`build()`'s model (activation checkpointing off, the rest as the first arm) on the first arm's first packs:
    its warm-up steps (compile: a static graph, then a dynamic one) and `ac_off_timed` timed ones. `first`: the
    full-AC arm's figures (its load and step times bound this arm; its step-0 loss is this arm's reference)."""
    warmup = s["warmup"]
    n = min(len(batches), warmup + s["ac_off_timed"])
    estimate = first["load_s"] + sum(first["step_s"][:warmup]) + (n - warmup) * first["step_s_median"]
    skip = ac_off_skip(estimate, args)
    if skip:
        return skip
    res: dict = {"activation_checkpointing": "off", "estimate_s": round(estimate, 1)}
    try:
        t0 = time.perf_counter()
        model, opt, prepared = build()
        config = model.config
        res.update(load_s=time.perf_counter() - t0, allocated_after_load_bytes=memory(dev).get("max_allocated_bytes"),
                   prepared={"compiled": prepared.compiled, "checkpointing": prepared.checkpointing})
        times, flops, losses = [], [], []
        for batch in batches[:n]:
            seconds, stats, loss = timed_step(model, opt, batch, dev, env, config)
            times.append(seconds)
            losses.append(loss)
            flops.append(float(stats.counts[2]))
        res.update(summary(times, real[:n], flops, first["peak_flops"], warmup), losses=losses, memory=memory(dev))
        res["prepared"]["compile_fallbacks"] = prepared.compile_fallbacks  # graphs run eagerly: the figures are theirs
        # step 0: the same forward; later steps also follow the same gradients (AC changes neither), so they
        # drift apart only by the rounding of the optimizer's updates
        rels = [abs(a - b) / abs(b) for a, b in zip(losses, first["losses"], strict=False)]
        res.update(loss0_rel_diff_vs_full_ac=rels[0], loss0_match=rels[0] <= AC_OFF_LOSS_MATCH,
                   losses_rel_diff_vs_full_ac=rels)
        if packs:  # the planner's worst-case packs without AC: its 116.6 GiB on an H200 (RESULTS) meets the device
            save_partial(args, first | {AC_OFF: res}, AC_OFF)
            res.update(planner_packs_memory(model, opt, env, config, dev, packs))
    except Exception as exc:  # out of memory above all: a finding, beside the full-AC figures
        res.update(ac_off_failure(exc, dev))
    return res


def hf_arm(args, work: Path, arm: str) -> dict:
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from mindvl.models.config import MindVLConfig
    from mindvl.train.metrics import device_peak_flops, training_flops

    s, peers = shapes(args.dry_run), peers_module()
    dev = the_device()
    t0 = time.perf_counter()
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(work / "hf", attn_implementation="sdpa",
                                                               dtype=torch.float32).to(dev)
    model.train()
    # as the mindvl arm's full activation checkpointing; non-reentrant, so blocks whose inputs need no gradient
    # (the ViT's first) still get their weights' gradients
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.1, fused=dev.type == "cuda")
    load_s = time.perf_counter() - t0
    batches, real, groups = step_data(s, arm, peers.IMAGE_TOKEN, 2)
    samples = make_samples(s["samples"], 0, s["max_pixels"])
    # MFU on the same FLOP count as the mindvl arm (the real tokens and patches; padding is not useful work)
    cfg = MindVLConfig.from_dict(json.loads((work / "mindvl" / "config.json").read_text()))
    peak, how = device_peak_flops(dev)
    flops = []
    for g in groups:
        lengths = [peers.length(samples[i]) for i in g]
        grids = [samples[i]["grid"] for i in g if samples[i]["grid"]]
        labelled = sum(lengths) - sum(gr[1] * gr[2] // 4 + 1 for gr in grids) - len(g)
        flops.append(training_flops(cfg, lengths, labelled, grids or None))

    def micro_batches(batch: dict) -> list[dict]:
        if arm == "hf_packed":
            return [batch]
        rows, out, k = batch["input_ids"].shape[0], [], s["micro_rows"]
        pix_rows = [0]  # pixel rows per image, cumulated, to split pixel_values with the rows
        grid = batch["image_grid_thw"]
        images_per_row = ((batch["input_ids"] == peers.VISION_START).sum(1)).tolist()
        if grid is not None:
            for g in grid.tolist():
                pix_rows.append(pix_rows[-1] + g[0] * g[1] * g[2])
        img = 0
        for a in range(0, rows, k):
            b = min(rows, a + k)
            n_img = sum(images_per_row[a:b])
            per_row = ("input_ids", "labels", "attention_mask", "mm_token_type_ids")
            mb = {key: (v[a:b] if key in per_row else v) for key, v in batch.items()}
            if grid is not None:
                mb["pixel_values"] = batch["pixel_values"][pix_rows[img]:pix_rows[img + n_img]] if n_img else None
                mb["image_grid_thw"] = grid[img:img + n_img] if n_img else None
            img += n_img
            width = int(mb["attention_mask"].sum(1).max())
            for key in per_row:
                mb[key] = mb[key][:, :width]
            out.append(mb)
        return out

    def step(batch: dict) -> tuple[float, float]:
        """One timed optimizer step: (seconds, loss)."""
        sync(dev)
        ta = time.perf_counter()
        parts = [{k: (v.to(dev, non_blocking=True) if torch.is_tensor(v) else v) for k, v in mb.items()}
                 for mb in micro_batches(batch)]
        total = sum(int((mb["labels"][..., 1:] != -100).sum()) for mb in parts)
        loss_total = 0.0
        for mb in parts:
            n = int((mb["labels"][..., 1:] != -100).sum())
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = model(**mb).loss * (n / total)  # transformers' mean over this micro-batch's labels
            loss.backward()
            loss_total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(dev)
        return time.perf_counter() - ta, loss_total

    times, losses = map(list, zip(*(step(batch) for batch in batches), strict=True))
    out = summary(times, real, flops, peak, s["warmup"])
    # transformers' modules that checkpoint (their `gradient_checkpointing` flag): the layers, blocks and towers
    checkpointed = lambda: sum(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())  # noqa: E731
    out.update(load_s=load_s, losses=losses, peak_how=how, micro_batches_per_step=len(micro_batches(batches[0])),
               padded_tokens_per_step=[int(b["input_ids"].numel()) for b in batches], memory=memory(dev),
               checkpointed_modules=checkpointed())
    if arm != "hf_packed":  # the padded arm is last in the order and the least telling: no AC-off figures
        return out
    # The first packs once more without gradient checkpointing, on the same model and optimizer: the weights and
    # Adam's moments are those the timed steps left (a fresh model and optimizer would only cost load time), so
    # the losses are not step 0's; the work per step is the same, and so are the timing and the memory, the
    # optimizer state existing already in both. One warm-up step (no compile here: the allocator grows).
    save_partial(args, out, AC_OFF)
    n = min(len(batches), 1 + s["ac_off_timed"])
    estimate = times[0] + (n - 1) * out["step_s_median"]
    out[AC_OFF] = ac_off_skip(estimate, args) or {"activation_checkpointing": "off", "estimate_s": round(estimate, 1)}
    if "skipped" in out[AC_OFF]:
        return out
    try:
        model.gradient_checkpointing_disable()
        out[AC_OFF]["checkpointed_modules"] = checkpointed()
        free_device(dev)
        off_times, off_losses = map(list, zip(*(step(batch) for batch in batches[:n]), strict=True))
        out[AC_OFF].update(summary(off_times, real[:n], flops[:n], peak, 1), losses=off_losses, memory=memory(dev))
    except Exception as exc:  # out of memory above all: a finding, beside the figures above
        out[AC_OFF].update(ac_off_failure(exc, dev))
    return out


def sec_hf_packed(args, work: Path) -> dict:
    return hf_arm(args, work, "hf_packed")


def sec_hf_padded(args, work: Path) -> dict:
    return hf_arm(args, work, "hf_padded")


def sec_moe(args, work: Path) -> dict:
    """A DeepSeek-V3-shaped MoE LLM (MLA, grouped routing over 64 experts, a shared expert), bf16 autocast on one
    device: tokens/s and MFU with grouped_mm experts and with the unbind fallback; step-0 loss vs CPU fp32."""
    import torch

    from mindvl.config import OptimSection, ParallelSection
    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.models.moe import RoutedExperts, routers, update_router_bias
    from mindvl.plan.skew import rank_factor
    from mindvl.train.metrics import device_peak_flops
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import ParallelEnv, destroy, parallelize

    dry = args.dry_run
    text = TextConfig(family="deepseek_v3", vocab_size=2048 if dry else 32000, hidden_size=128 if dry else 1024,
                      intermediate_size=256 if dry else 2816, num_hidden_layers=2 if dry else 8,
                      num_attention_heads=4 if dry else 16, num_key_value_heads=4 if dry else 16,
                      moe_intermediate_size=64 if dry else 256, n_routed_experts=16 if dry else 64,
                      num_experts_per_tok=4 if dry else 8, n_shared_experts=1, n_group=4 if dry else 8,
                      topk_group=2 if dry else 4, first_k_dense_replace=1, routed_scaling_factor=2.5,
                      norm_topk_prob=True, q_lora_rank=64 if dry else 384, kv_lora_rank=32 if dry else 256,
                      qk_nope_head_dim=32 if dry else 64, qk_rope_head_dim=16 if dry else 32,
                      v_head_dim=32 if dry else 64, head_dim=16 if dry else 32)
    config = MindVLConfig(text=text, vision=None)
    seq, steps, warmup = (256, 2, 1) if dry else (4096, 6, 2)
    gen = torch.Generator().manual_seed(0)
    packs = []
    for _ in range(steps):
        lengths = [int(x) for x in torch.randint(seq // 16, seq // 4, (64,), generator=gen).tolist()]
        keep, total = [], 0
        for n in lengths:
            if total + n > seq:
                break
            keep.append(n)
            total += n
        keep.append(seq - total)
        ids = torch.randint(5, text.vocab_size, (seq,), generator=gen)
        cu = torch.tensor([0, *itertools.accumulate(keep)], dtype=torch.int32)
        packs.append({"input_ids": ids, "labels": ids.clone(), "cu_seqlens": cu})
    dev = the_device()
    torch.manual_seed(0)
    ref = MindVL(config)
    ref.init_weights(seed=0)
    with torch.no_grad():
        ref_loss_sum, ref_count = ref.train()(**packs[0])
    out: dict = {"params": sum(p.numel() for p in ref.parameters()), "tokens_per_step": seq,
                 "cpu_fp32_loss0": float(ref_loss_sum / ref_count)}
    env = ParallelEnv(0, 1, 0, dev, "nccl" if dev.type == "cuda" else "gloo")
    try:
        model = parallelize(ref.to(dev), env, ParallelSection(mixed_precision="bf16"))
        opt = build_optimizer(model, OptimSection(lr=1e-4))
        peak, how = device_peak_flops(dev)
        for grouped in (True, False):
            for m in model.modules():
                if isinstance(m, RoutedExperts):
                    m.use_grouped_mm = grouped
            times, flops, losses, factors = [], [], [], []
            for p in packs:
                seconds, stats, loss = timed_step(model, opt, p, dev, env, config)
                times.append(seconds)
                losses.append(loss)
                flops.append(float(stats.counts[2]))
                # the routing's skew as the planner's capacity factor at EP 8 and MaxVio (untimed; resets counts)
                loads = torch.stack([r.expert_load for r in routers(model)]).cpu()
                factors.append({"ep8_factor": rank_factor(loads, 8), "max_vio": update_router_bias(model, 0.0)})
            out["grouped_mm" if grouped else "unbind_fallback"] = {**summary(times, [seq] * steps, flops, peak,
                                                                               warmup), "losses": losses,
                                                                   "routing": factors}
            if args.profile:  # one more step of the last pack, profiled, per expert path
                pk = packs[-1]
                out["grouped_mm" if grouped else "unbind_fallback"]["profile"] = profiled_step(
                    lambda pk=pk: train_step(model, opt, [pk], dev, env, config), model, opt, dev)
        out["bf16_loss0_rel_diff_vs_cpu_fp32"] = abs(out["grouped_mm"]["losses"][0] - out["cpu_fp32_loss0"]) / abs(
            out["cpu_fp32_loss0"])
        out.update(peak_how=how, memory=memory(dev))
        return out
    finally:
        destroy(env)


def sec_tiny(args, work: Path) -> dict:
    import yaml

    import mindvl
    from mindvl.config import load_recipe
    from mindvl.train.trainer import train

    steps = 3 if args.dry_run else 40
    out_dir = work / "tiny"
    raw = yaml.safe_load((Path(mindvl.__file__).parent / "recipes" / "tiny" / "sft.yaml").read_text())
    # Fewer synthetic samples than the recipe's 7,200 (generated before the first step; the shapes come from the
    # same generators): enough for the steps run here.
    for source in raw["data"]["sources"]:
        source["synth"]["n"] = max(8, source["synth"]["n"] // (150 if args.dry_run else 5))
    if args.dry_run:
        raw["data"].update(seq_len=512, pack_buffer=8)
    # compile off: this section checks the trainer end to end (data, metrics, MFU); compiled blocks are the mindvl
    # section's, and compiling the tiny model's would spend its whole limit on inductor
    recipe = load_recipe(raw=raw, overrides=[
        f"output_dir={out_dir}", f"max_steps={steps}", f"data.synth_cache={work}/synth", "checkpoint.every=null",
        "logging.every=1", "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
        "parallel.compile=off"])
    t0 = time.perf_counter()
    train(recipe)
    wall = time.perf_counter() - t0
    recs = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if "tokens_per_s" in r][max(1, steps // 4):]  # past the warm-up steps
    return {"steps": steps, "train_wall_s": wall, "synth_samples": sum(x["synth"]["n"] for x in raw["data"]["sources"]),
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in recs),
            "mfu_median": statistics.median(r["mfu"] for r in recs), "loss_last": recs[-1]["loss"],
            "records": len(recs)}


WORKERS = {"environment": sec_environment, "tests": sec_tests, "prepare": sec_prepare, "plan": sec_plan,
           "mindvl": sec_mindvl, "hf_packed": sec_hf_packed, "hf_padded": sec_hf_padded, "moe": sec_moe,
           "tiny": sec_tiny}


def _proof_generate():
    """benchmarks/proof_generate.py, the generate section, loaded by path: this file runs as a script and is also
    loaded by path (tests), so `benchmarks/` is not always on sys.path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("proof_generate", HERE / "proof_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sec_generate(args, work: Path) -> dict:
    return _proof_generate().sec_generate(args, work, save_partial)


WORKERS["generate"] = sec_generate


def sec_decode_bits(args, work: Path) -> dict:
    return _proof_generate().sec_decode_bits(args, work, save_partial)


WORKERS["decode_bits"] = sec_decode_bits


# ------------------------------------------------------------------------------------------------------ driver


def worker_main(args) -> int:
    """Run one section in this process; its JSON goes to --result (a crash leaves the traceback there)."""
    result = Path(args.result)
    t0 = args.started = time.perf_counter()  # time_left() counts the section's limit from here
    try:
        if os.environ.get(FAIL_ENV) == args.worker:  # the failure-isolation test
            raise RuntimeError(f"{FAIL_ENV}={args.worker}: injected failure")
        data = {"ok": True, **WORKERS[args.worker](args, Path(args.work))}
    except BaseException as exc:  # noqa: B036  (record everything, including SystemExit from deep inside)
        data = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()}
    data["section_s"] = round(time.perf_counter() - t0, 1)  # the work itself (wall_s adds the child's start)
    result.write_text(json.dumps(data, default=str))
    return 0 if data["ok"] else 1


def child_env(dry: bool) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    # the repository first (no install), after any carried wheels already on PYTHONPATH
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(ROOT)) if p)
    if dry:
        env["MINDVL_PEAK_TFLOPS"] = env.get("MINDVL_PEAK_TFLOPS", "0.1")  # no CPU matmul probe in the dry run
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run is a CPU run even where a GPU is present
    return env


def start(name: str, args, work: Path, log, limit: float) -> tuple[subprocess.Popen, Path, float]:
    result = work / f"{name}.result.json"
    launcher = json.loads(os.environ.get(LAUNCHER_ENV) or "null") or [sys.executable]
    cmd = [*launcher, str(Path(__file__).resolve()), "--worker", name, "--work", str(work), "--result",
           str(result), "--limit", str(int(limit))] + (["--dry-run"] if args.dry_run else []) + (
           ["--profile"] if args.profile else [])
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(args.dry_run), cwd=ROOT,
                            start_new_session=True)
    return proc, result, time.perf_counter()


def finish(name: str, proc: subprocess.Popen, result: Path, started: float, timeout: float) -> dict:
    try:
        rc = proc.wait(timeout=max(1.0, timeout))
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the section's own process group (its pytest / compile children too)
        rc, timed_out = proc.wait(), True
    data = json.loads(result.read_text()) if result.exists() else {"ok": False}
    part = data.pop("partial", None)  # the section wrote its figures, then an optional part of it did not finish
    if part:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"the process ended with exit code {rc}"
        data[part] = {"error": f"{why} in this part (the section's figures before it are kept; see proof.log)"}
    elif timed_out:
        data.update(ok=False, error=f"timed out after {timeout:.0f} s")
    elif "error" not in data and not data.get("ok"):
        data["error"] = f"exit code {rc} without a result (crashed: see proof.log)"
    # wall_s: from the child's start to its end or, for the background planner, to when it was collected
    data.update(returncode=rc, wall_s=round(time.perf_counter() - started, 1))
    return data


def ratio(a, b):
    return a / b if a and b else None


def fmt(x, spec=".3g") -> str:
    return "-" if x is None else format(x, spec)


def ac_table(sections: dict) -> list[str]:
    """proof.md's rows of the mid model with full activation checkpointing and without it (the AC-off arms of the
    mindvl and hf_packed sections), and mindvl over transformers packed at equal checkpointing."""
    mid, hf = sections.get("mindvl", {}), sections.get("hf_packed", {})
    if not (mid.get("ok") or hf.get("ok")):
        return []
    rows = [("mindvl", "full", mid if mid.get("ok") else {}, mid.get("memory_after_throughput")),
            ("transformers packed", "full", hf if hf.get("ok") else {}, hf.get("memory")),
            ("mindvl", "off", mid.get(AC_OFF) or {}, None), ("transformers packed", "off", hf.get(AC_OFF) or {}, None)]
    lines = ["", "Activation checkpointing full and off (mid model, same packs; MFU counts model FLOPs only, so under "
             "full AC, which recomputes every block's forward, it cannot pass 3/4 of the hardware's utilisation):", "",
             "| arm | AC | tokens/s | MFU | step s median (timed) | max allocated GiB | mindvl / transformers packed |",
             "|---|---|---|---|---|---|---|"]
    for name, ac, d, mem in rows:
        why = d.get("skipped") or d.get("error")
        if why or not d:
            what = f"skipped: {why}" if d.get("skipped") else f"failed: {why}" if why else "not run"
            lines.append(f"| {name} | {ac} | - | - | - | - | {what[:200].replace('|', '/')} |")
            continue
        mem = (mem if mem is not None else d.get("memory")) or {}
        peer = (hf if ac == "full" else hf.get(AC_OFF) or {}).get("tokens_per_s")
        r = ratio(d.get("tokens_per_s"), peer) if name == "mindvl" else None
        versus = f"{r:.2f}x" if r else "-" if name == "mindvl" else ""
        lines.append(f"| {name} | {ac} | {fmt(d.get('tokens_per_s'), ',.0f')} | {fmt(d.get('mfu'), '.1%')} | "
                     f"{fmt(d.get('step_s_median'), '.3f')} ({d.get('timed_steps')}) | "
                     f"{fmt((mem.get('max_allocated_bytes') or 0) / GIB or None, '.2f')} | {versus} |")
    off = mid.get(AC_OFF) or {}
    if off.get("loss0_rel_diff_vs_full_ac") is not None:
        lines += ["", f"Step-0 loss, mindvl AC off vs full (same weights and pack): relative difference "
                  f"{off['loss0_rel_diff_vs_full_ac']:.1e} ({'within' if off['loss0_match'] else 'NOT within'} "
                  f"{AC_OFF_LOSS_MATCH:.1e}, one bf16 rounding)"]
    return lines


def report(res: dict) -> str:
    env = res.get("environment", {})
    gpu = env.get("gpu") or "CPU (dry run)"
    lines = [f"# Accelerator proof ({'dry run, ' if res['dry_run'] else ''}{gpu})", "",
             f"torch {env.get('torch')}, CUDA {env.get('cuda')}, transformers {env.get('version_transformers')}, "
             f"python {env.get('python')}; peak {fmt((env.get('peak_flops') or 0) / 1e12)} TFLOP/s "
             f"({env.get('peak_how')}); total {res['wall_s']:.0f} s", "",
             "| section | ok | wall s (work s) | result |", "|---|---|---|---|"]
    mid = res.get("mindvl", {})
    for name, data in res["sections"].items():
        if not data.get("ok"):
            what = (data.get("error") or "")[:200].replace("|", "/").replace("\n", " ")
        elif name == "tests":
            what = f"{data.get('passed')} passed, {data.get('failure', 0) + data.get('error', 0)} failed, " \
                   f"{data.get('skipped')} skipped"
        elif name in ("mindvl", "hf_packed", "hf_padded"):
            what = f"{fmt(data.get('tokens_per_s'), ',.0f')} tokens/s, MFU {fmt(data.get('mfu'), '.1%')}"
            if name != "mindvl":
                what += f"; mindvl / this: {fmt(ratio(mid.get('tokens_per_s'), data.get('tokens_per_s')), '.2f')}x"
        elif name == "moe":
            g, u = data.get("grouped_mm", {}), data.get("unbind_fallback", {})
            what = (f"grouped {fmt(g.get('tokens_per_s'), ',.0f')} tokens/s (MFU {fmt(g.get('mfu'), '.1%')}), "
                    f"fallback {fmt(u.get('tokens_per_s'), ',.0f')}; loss0 vs CPU fp32 "
                    f"{fmt(data.get('bf16_loss0_rel_diff_vs_cpu_fp32'), '.1e')}; routing at EP 8: capacity factor up "
                    f"to {fmt(max((x['ep8_factor'] for x in g.get('routing', [])), default=None), '.2f')}")
        elif name == "tiny":
            what = f"{fmt(data.get('tokens_per_s_median'), ',.0f')} tokens/s, MFU {fmt(data.get('mfu_median'), '.2%')}"
        elif name == "generate":
            what = _proof_generate().generate_summary(data)
        elif name == "decode_bits":
            what = _proof_generate().decode_bits_summary(data)
        elif name == "plan":
            what = (f"planned peak {fmt(data.get('peak_bytes_per_rank', 0) / GIB, '.2f')} GiB on "
                    f"{(data.get('device') or {}).get('spec', '?')}")
        elif name == "prepare":
            what = f"{data.get('parameters', 0) / 1e6:,.1f}M parameters"
        else:
            what = f"{len(data.get('missing_packages', []))} missing packages: {data.get('missing_packages')}"
        took = f"{data.get('wall_s')} ({data.get('section_s', '-')})"
        lines.append(f"| {name} | {'yes' if data.get('ok') else 'NO'} | {took} | {what} |")
    losses = {n: res["sections"].get(n, {}).get("losses") for n in ("mindvl", "hf_packed", "hf_padded")}
    if losses["mindvl"]:
        agree = [f"{n} {abs(v[0] - losses['mindvl'][0]) / abs(v[0]):.1e}" for n, v in losses.items()
                 if v and n != "mindvl"]
        lines += ["", f"Step-0 loss of the mid model, mindvl {losses['mindvl'][0]:.5f}; relative difference to "
                  f"{', '.join(agree) or '-'} (same weights and samples, bf16 compute on both sides)"]
    lines += ac_table(res["sections"])
    moe = res["sections"].get("moe", {})
    profiles = [("mindvl", mid.get("profile"))] + [
        (f"moe {k}", moe.get(k, {}).get("profile")) for k in ("grouped_mm", "unbind_fallback")]
    profiles = [(n, p) for n, p in profiles if p]
    if profiles:
        lines += ["", "One profiled step (ms on the " + profiles[0][1]["split_clock"] + " clock):", "",
                  "| step | ms | launches | host syncs | reads | copy_ / _to_copy | GPU busy | ViT fwd | LLM fwd | "
                  "loss fwd | backward (loss) | optimizer | top kernel |", "|---" * 13 + "|"]
        for name, p in profiles:
            sp, top = p["split_ms"], (p["top10"] or [{}])[0]
            lines.append(
                f"| {name} | {p['step_ms']:.0f} | {fmt(p['kernel_launches'], ',')} | {fmt(p['host_syncs'], ',')} | "
                f"{p['device_reads']} | {p['copies']} / {p['casts']} | {fmt(p['gpu_busy'], '.0%')} | "
                f"{fmt(sp.get('vit_forward'), '.0f')} | {fmt(sp.get('llm_forward'), '.0f')} | "
                f"{fmt(sp.get('loss_forward'), '.0f')} | {sp['backward']:.0f} ({sp['loss_backward']:.0f}) | "
                f"{fmt(sp.get('optimizer'), '.0f')} | {str(top.get('kernel') or top.get('op'))[:60]} |")
    plan, mem = res["sections"].get("plan", {}), mid.get("memory_planner_packs", {})
    if plan.get("ok") and mem:
        p, a, r = plan["peak_bytes_per_rank"], mem["max_allocated_bytes"], mem["max_reserved_bytes"]
        outside = mem["outside_allocator_bytes"]
        lines += ["", "Planner vs the real step (same packs, same step sequence):", "",
                  "| planned peak GiB | max_allocated GiB | max_reserved GiB | outside allocator GiB | "
                  "planned / allocated | planned reserve GiB | real (reserved - allocated + outside) GiB |",
                  "|---|---|---|---|---|---|---|",
                  f"| {p / GIB:.2f} | {a / GIB:.2f} | {r / GIB:.2f} | {outside / GIB:.2f} | {p / a:.3f} | "
                  f"{plan['reserve_bytes'] / GIB:.2f} | {(r - a + outside) / GIB:.2f} |"]
    if mid.get("memory_error"):
        lines += ["", f"The real step on the planner's packs failed: {mid['memory_error'][:300]}"]
    lost = [n for n, d in res["sections"].items() if not d.get("ok")]
    if lost:
        lines += ["", "Failures (tracebacks in proof.json):"] + [
            f"- {n}: {(res['sections'][n].get('error') or '')[:300]}" for n in lost]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="folder for proof.json, proof.md, proof.log")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes (CI)")
    ap.add_argument("--budget-s", type=float, default=None, help="total seconds (default 450 on a GPU, 1500 dry)")
    ap.add_argument("--sections", default=None, help="comma-separated subset, e.g. tests,tiny")
    ap.add_argument("--section-limit", action="append", default=[], metavar="NAME=SECONDS",
                    help="a section's time limit instead of its default (e.g. mindvl=300: room for its AC-off arm); "
                         "still capped by what is left of --budget-s")
    ap.add_argument("--work", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=float, default=600.0, help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)  # set from --sections (see docstring)
    args = ap.parse_args()
    if args.worker:
        return worker_main(args)
    if not args.out:
        ap.error("--out is required")
    limits_given = {}
    for item in args.section_limit:
        name, _, seconds = item.partition("=")
        if name not in {n for n, *_ in SECTIONS} or not seconds.replace(".", "", 1).isdigit():
            ap.error(f"--section-limit {item}: expected NAME=SECONDS with NAME one of {[n for n, *_ in SECTIONS]}")
        limits_given[name] = float(seconds)
    t_start = time.perf_counter()
    budget = args.budget_s or (1500.0 if args.dry_run else 450.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = set(args.sections.split(",")) if args.sections else None
    args.profile = wanted is None or PROFILE in wanted
    shm = Path("/dev/shm")
    big_shm = shm.is_dir() and shutil.disk_usage(shm).free > 40 * GIB  # the mid model's folders (~11 GB)
    work = Path(tempfile.mkdtemp(prefix="mindvl-proof-", dir=shm if big_shm and not args.dry_run else None))
    res: dict = {"dry_run": args.dry_run, "budget_s": budget, "work": str(work), "sections": {}}
    idx = 1 if args.dry_run else 0
    with open(out / "proof.log", "w") as log:
        def say(msg: str) -> None:
            line = f"[{time.perf_counter() - t_start:6.1f}s] {msg}"
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        background = None
        try:
            for name, *limits in SECTIONS:
                if wanted is not None and name not in wanted:
                    continue
                left = budget - (time.perf_counter() - t_start)
                if name in ("mindvl", "hf_packed", "hf_padded") and not res["sections"].get("prepare", {}).get("ok"):
                    res["sections"][name] = {"ok": False, "error": "skipped: prepare did not succeed"}
                    continue
                if left < 20:
                    res["sections"][name] = {"ok": False, "error": f"skipped: budget spent ({budget:.0f} s)"}
                    continue
                limit = min(limits_given.get(name, limits[idx]), left)
                say(f"section {name} (limit {limit:.0f} s)")
                proc, result, started = start(name, args, work, log, limit)
                res["sections"][name] = data = finish(name, proc, result, started, limit)
                say(f"section {name}: {'ok' if data.get('ok') else 'FAILED: ' + str(data.get('error'))[:300]} "
                    f"({data['wall_s']} s)")
                if name == "prepare" and data.get("ok") and (wanted is None or "plan" in wanted):
                    background = start("plan", args, work, log, PLAN_TIMEOUT[idx])  # CPU only: beside the GPU
                    say("section plan started in the background")
            if background is not None:
                left = max(10.0, budget + 10 - (time.perf_counter() - t_start))
                res["sections"]["plan"] = finish("plan", *background, min(PLAN_TIMEOUT[idx], left))
                say(f"section plan: {'ok' if res['sections']['plan'].get('ok') else 'FAILED'}")
        finally:
            res["environment"] = res["sections"].get("environment", {})
            res["mindvl"] = res["sections"].get("mindvl", {})
            res["wall_s"] = time.perf_counter() - t_start
            (out / "proof.json").write_text(json.dumps(res, indent=1, default=str))
            (out / "proof.md").write_text(report(res))
            shutil.rmtree(work, ignore_errors=True)
            say(f"wrote {out / 'proof.json'} and proof.md")
            record_margin(res, out, say)
    print((out / "proof.md").read_text())
    ok = all(d.get("ok") for d in res["sections"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
