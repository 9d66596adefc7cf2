"""Exact resume after SIGKILL at several points, and a save interrupted mid-way (CPU, subprocesses)."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
import torch
from train_helpers import env, latest_step, load_weights, mindvl_cmd, raw_recipe, run, write_recipe

import mindvl.checkpoint.training as training
from mindvl.checkpoint.training import export_checkpoint, read_latest
from mindvl.config import load_recipe
from mindvl.train.trainer import train

STEPS = 6


def losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_matches_uninterrupted(tmp_path):
    cache = tmp_path / "cache"
    ref_out, out = tmp_path / "ref", tmp_path / "killed"
    ref = write_recipe(tmp_path / "ref.yaml", raw_recipe(ref_out, cache, budget={"max_steps": STEPS}))
    done = run(mindvl_cmd("train", str(ref)), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

    recipe = write_recipe(tmp_path / "k.yaml", raw_recipe(out, cache, budget={"max_steps": STEPS}))
    kills = []
    for kill_after in (1, 3):  # SIGKILL as soon as checkpoint `kill_after` is complete (mid-step or mid-save)
        proc = subprocess.Popen(mindvl_cmd("train", str(recipe), "resume=auto"), env=env(),
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 240
        while latest_step(out) < kill_after and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills.append(latest_step(out))
        assert latest_step(out) < STEPS, "the run finished before it could be killed"
    assert kills[0] >= 1 and kills[1] > kills[0]
    final = run(mindvl_cmd("train", str(recipe), "resume=auto"), timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]

    ours, reference = load_weights(out / "final"), load_weights(ref_out / "final")
    assert set(ours) == set(reference)
    for name in reference:
        assert torch.equal(ours[name], reference[name]), name
    assert losses(out) == losses(ref_out)  # the metrics of the resumed run continue the same curve, exactly


def test_save_interrupted_mid_way_leaves_previous_checkpoint(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    raw = raw_recipe(tmp_path / "run", cache, budget={"max_steps": 3}, checkpoint={"every": 1, "keep": 5})
    real_finalize = training._finalize

    def crash_on_step_2(partial, final, root):
        if final.name == training.step_name(2):
            raise KeyboardInterrupt("simulated crash after the shards were written, before the rename")
        real_finalize(partial, final, root)

    monkeypatch.setattr(training, "_finalize", crash_on_step_2)
    with pytest.raises(KeyboardInterrupt):
        train(load_recipe(raw=raw))
    root = tmp_path / "run" / "checkpoints"
    assert (root / "step_00000002.partial").is_dir()  # the half-finished save is there ...
    assert read_latest(root).name == "step_00000001"  # ... but `latest` still names the previous, complete one
    exported = load_weights(export_checkpoint(root, tmp_path / "exp1"))  # and it loads
    assert exported

    monkeypatch.setattr(training, "_finalize", real_finalize)
    train(load_recipe(raw=raw, overrides=["resume=auto"]))
    train(load_recipe(raw=raw_recipe(tmp_path / "ref", cache, budget={"max_steps": 3})))
    ours, ref = load_weights(tmp_path / "run" / "final"), load_weights(tmp_path / "ref" / "final")
    assert all(torch.equal(ours[n], ref[n]) for n in ref)
    assert not (root / "step_00000002.partial").exists()  # cleaned by the next save


def test_latest_pointing_at_a_missing_folder_falls_back_to_the_newest_complete(tmp_path):
    root = tmp_path / "checkpoints"
    for step, complete in ((1, True), (2, True), (3, False)):
        folder = root / training.step_name(step)
        folder.mkdir(parents=True)
        if complete:
            (folder / training.TRAIN_STATE).write_text("{}")
    (root / "step_00000004.partial").mkdir()
    (root / training.LATEST).write_text('"step_00000005"')  # its folder was being re-saved when the run died
    with pytest.warns(UserWarning, match="missing step_00000005"):
        assert read_latest(root).name == "step_00000002"
