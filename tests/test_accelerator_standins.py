"""CPU stand-ins for the accelerator path, in CI: what the CPU can prove before a GPU runs it.

- bf16 end to end: the trainer runs a tiny recipe with `parallel.mixed_precision=bf16` (one process: plain tensors
  under bf16 autocast, fp32 master weights, gradients and AdamW state) and full activation checkpointing;
  its losses follow the fp32 run of the same recipe and its saved weights are fp32 and load.
- torch.compile: the model with every block compiled (the trainer's `parallel.compile`, inductor on CPU through the
  system C++ compiler) equals eager forward and backward. Compiling the tiny model's two block kinds costs ~85
  CPU-seconds (219 s wall on a shared 2-core machine at load ~10); hence `slow`.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from test_accelerator_device import tiny_batch
from tiny_mindvl import tiny_model
from train.train_helpers import BASE

from mindvl.config import ParallelSection, load_recipe
from mindvl.train.parallel import ParallelEnv, parallelize

# The tiny recipe of tests/train (train_helpers.BASE), shorter: 24 samples, 3 steps, no checkpoints.
RECIPE = copy.deepcopy(BASE)
RECIPE["data"]["sources"][0]["synth"]["n"] = 24
RECIPE.update(budget={"max_steps": 3}, checkpoint={"every": None})


def run_tiny(tmp_path, name: str, parallel: dict) -> list[dict]:
    from mindvl.train.trainer import train

    raw = json.loads(json.dumps(RECIPE))
    raw.update(output_dir=str(tmp_path / name), parallel=parallel)
    raw["data"]["synth_cache"] = str(tmp_path / "cache")
    train(load_recipe(raw=raw))
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(line)]


def test_bf16_mixed_precision_trains_end_to_end_like_fp32(tmp_path):
    from mindvl.checkpoint import load_model
    from mindvl.checkpoint.safetensors_io import TensorFolder

    fp32 = run_tiny(tmp_path, "fp32", {"mixed_precision": "fp32"})
    bf16 = run_tiny(tmp_path, "bf16", {"mixed_precision": "bf16", "activation_checkpointing": "full"})
    assert len(fp32) == len(bf16) == 3
    # the same weights and packs: step 1's loss differs only by bf16 rounding; later steps also by bf16 updates
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=1e-2)
    assert bf16[0]["loss"] != fp32[0]["loss"]  # bf16 compute really ran (bit-equal losses would mean fp32)
    assert [r["loss"] for r in bf16] == pytest.approx([r["loss"] for r in fp32], rel=3e-2)
    assert all(r["grad_norm"] == pytest.approx(f["grad_norm"], rel=0.1) for r, f in zip(bf16, fp32, strict=True))
    final = tmp_path / "bf16" / "final"
    assert all(t.dtype == torch.float32 for _, t in TensorFolder(final).iter_tensors())  # fp32 master weights
    model = load_model(final)
    batch = tiny_batch(model)
    with torch.no_grad():
        loss_sum, count = model(**batch)
    assert torch.isfinite(loss_sum) and count > 0
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


@pytest.mark.slow
def test_compiled_blocks_equal_eager_forward_and_backward():
    """`parallel.compile` (each block of both towers through torch.compile, inductor) against the eager model with
    the same weights: loss to 1e-5 relative, every parameter's gradient to 1e-4 of its largest element."""
    env = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
    eager = tiny_model(std=0.05).train()
    compiled = parallelize(tiny_model(std=0.05).train(), env, ParallelSection(compile=True, mixed_precision="fp32"))
    batch = tiny_batch(eager)
    got, n = compiled(**batch)
    got.backward()
    want, n_want = eager(**batch)
    want.backward()
    assert int(n) == int(n_want)
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    ref = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        name = name.replace("._orig_mod", "")
        scale = ref[name].grad.abs().max().clamp_min(1e-12)
        assert float((p.grad - ref[name].grad).abs().max() / scale) < 1e-4, name
