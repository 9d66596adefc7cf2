"""A LoRA run's training checkpoints hold what trains (adapters, modules trained in full), buffers, optimizer and
data state, and reference the frozen base (folder or seed + a content fingerprint) instead of copying it; a resume
whose base changed since is refused in one line; an in-place resume equals the uninterrupted run
(tests/train/test_lora_train.py: SIGKILL)."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file, save_file
from test_lora_train import LORA, lora_recipe
from train_helpers import load_weights

from mindvl.checkpoint.dcp_io import read_metadata
from mindvl.checkpoint.frozen_base import KEY
from mindvl.checkpoint.training import read_train_state
from mindvl.config import load_recipe
from mindvl.train.trainer import train


def model_keys(ckpt) -> set[str]:
    return {k.removeprefix("model.") for k in read_metadata(ckpt).state_dict_metadata if k.startswith("model.")}


def test_checkpoints_hold_the_trained_tensors_and_refuse_a_changed_base(tmp_path):
    raw = lora_recipe(tmp_path, "a", steps=2)
    raw["phase"]["trainable"] = ["projector"]
    raw["model"]["lora"] = {**LORA, "modules": ["language_model"], "targets": ["q_proj", "v_proj"]}
    result = train(load_recipe(raw=raw))
    ckpt = result.output_dir / "checkpoints" / "step_00000002"
    final = load_weights(result.final_dir)
    keys = model_keys(ckpt)
    adapters = {f"language_model.layers.{i}.self_attn.{p}.lora_{m}" for i in (0, 1) for p in ("q_proj", "v_proj")
                for m in "AB"}
    projector = {n for n in final if n.startswith("projector.")}
    assert adapters | projector <= keys  # what trains
    assert not {n for n in final if n.startswith(("visual.", "language_model."))} & keys  # no frozen weight
    ref = read_train_state(ckpt)[KEY]
    assert ref["folder"] is None and ref["seed"] == 0 and len(ref["fingerprint"]) == 32

    # the same run's base with another seed: one line naming the checkpoint, both bases and what to do
    again = {**raw, "model": {**raw["model"], "init_seed": 1}, "checkpoint": {**raw["checkpoint"], "resume": "auto"}}
    with pytest.raises(ValueError) as err:
        train(load_recipe(raw=again))
    msg = str(err.value)
    assert msg.startswith(f"{ckpt}: the checkpoint holds adapters for the base seeded random weights (seed 0) "
                          f"(fingerprint {ref['fingerprint'][:12]}), but the base read now, seeded random weights "
                          "(seed 1), has fingerprint "), msg
    assert "restore that base (model.init_from, model.init_seed), or start over (overwrite=true)" in msg
    assert "\n" not in msg


def test_a_base_folder_overwritten_since_the_checkpoint_is_refused(tmp_path):
    """A LoRA run on a model folder (the first run's final/); one tensor of that folder changed afterwards: resume
    says so; restored, the same resume runs."""
    first = train(load_recipe(raw=lora_recipe(tmp_path, "base", steps=1)))
    folder = first.final_dir
    raw = lora_recipe(tmp_path, "b", steps=2)
    raw["model"] = {"init_from": str(folder), "lora": LORA}
    train(load_recipe(raw=raw))
    ckpt = tmp_path / "b" / "checkpoints" / "step_00000002"
    assert read_train_state(ckpt)[KEY]["folder"] == str(folder.resolve())

    shard = sorted(folder.glob("*.safetensors"))[0]
    original = load_file(str(shard))
    name = sorted(original)[0]
    save_file({**original, name: original[name] + 1e-3}, str(shard), metadata={"format": "pt"})
    raw["budget"]["max_steps"] = 3
    raw["checkpoint"]["resume"] = "auto"
    raw["schedule"] = {"allow_change": True}
    with pytest.raises(ValueError, match=rf"^{ckpt}: the checkpoint holds adapters for the base {folder.resolve()} "
                                         r"\(fingerprint [0-9a-f]{12}\), but the base read now, "):
        train(load_recipe(raw=raw))
    save_file(original, str(shard), metadata={"format": "pt"})
    assert train(load_recipe(raw=raw)).steps == 3


def test_full_checkpoints_of_runs_without_adapters_are_unchanged(tmp_path):
    """A run without model.lora still checkpoints every weight (and no base reference)."""
    from train_helpers import raw_recipe

    result = train(load_recipe(raw=raw_recipe(tmp_path / "p", tmp_path / "cache", budget={"max_steps": 1})))
    ckpt = result.output_dir / "checkpoints" / "step_00000001"
    assert KEY not in read_train_state(ckpt)
    assert set(load_weights(result.final_dir)) <= model_keys(ckpt)
