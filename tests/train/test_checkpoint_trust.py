"""Checkpoint trust: no code runs from a checkpoint, readers never race the pruner, `latest` and "last good" name
checkpoints whose weights a good step verified, a damaged newest checkpoint falls back, a full disk says so."""

from __future__ import annotations

import errno
import io
import json
import pickle
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from train_helpers import (
    latest_name,
    load_weights,
    mindvl_cmd,
    raw_recipe,
    run,
    training_in_background,
    write_recipe,
)

from mindvl.checkpoint import dcp_io
from mindvl.checkpoint.dcp_io import (
    CheckpointReadError,
    UnsafeCheckpointError,
    pinned,
    read_metadata,
    remove_unpinned,
)
from mindvl.checkpoint.training import (
    LATEST,
    complete_checkpoints,
    export_checkpoint,
    load_checkpoint,
    read_latest,
    read_train_state,
)
from mindvl.cli import main
from mindvl.config import OptimSection, load_recipe
from mindvl.models import MindVL, MindVLConfig
from mindvl.train.guard import BadStepGuard
from mindvl.train.optim import build_optimizer
from mindvl.train.stops import TooManyBadSteps
from mindvl.train.trainer import train


class _RunsCode:
    """What an attacker pickles: unpickling it calls exec (here: write a marker file)."""

    def __init__(self, marker: Path):
        self.code = f"open({str(marker)!r}, 'w').write('ran')"

    def __reduce__(self):
        return (exec, (self.code,))


@pytest.fixture(autouse=True)
def _no_progress_lines(monkeypatch):
    """These tests count stderr lines (one line per error): the synthetic-data progress line would be one more."""
    monkeypatch.setenv("MINDVL_PROGRESS", "0")


def _train(tmp: Path, name: str = "run", **sections) -> Path:
    out = tmp / name
    train(load_recipe(raw=raw_recipe(out, tmp / "cache", **sections)))
    return out


def _one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


# ------------------------------------------------------------------------------------------- no code from checkpoints


def test_metadata_allow_list_reads_real_metadata_and_refuses_anything_else(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)).to(torch.bfloat16)
    model[1].float()  # mixed dtypes, as in a real model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4, dtype=torch.bfloat16)).float().sum().backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(state, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    meta = read_metadata(tmp_path / "ck")  # a genuine metadata passes the allow-list
    assert "optim.param_groups.0.betas" in meta.state_dict_metadata

    # The payload is live: a plain unpickler runs it (the control) ...
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_RunsCode(control)))
    assert control.read_text() == "ran"
    # ... mindvl's refuses it by name, before it runs
    marker = tmp_path / "marker"
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"ck/\.metadata: refusing to load it: it names builtins\.exec"):
        read_metadata(tmp_path / "ck")
    assert not marker.exists()

    # exact names only: no attribute walk from an allowed class to what it can reach
    module, name = b"torch.distributed.checkpoint.metadata", b"Metadata.__init__"  # PROTO 4, STACK_GLOBAL, STOP
    dotted = b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93."
    (tmp_path / "ck" / ".metadata").write_bytes(dotted)
    with pytest.raises(UnsafeCheckpointError, match=r"Metadata\.__init__"):
        read_metadata(tmp_path / "ck")

    (tmp_path / "ck" / ".metadata").write_bytes(b"\x80\x04\x95")  # truncated
    with pytest.raises(CheckpointReadError, match="truncated or damaged"):
        read_metadata(tmp_path / "ck")


def _plant_metadata(ckpt: Path, marker: Path) -> None:
    (ckpt / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))


def _plant_optimizer_entry(ckpt: Path, marker: Path) -> None:
    """Re-save `ckpt` with one optimizer param-group value that runs code when torch.load(weights_only=False)
    reads it (what DCP's default load planner does); the metadata itself stays genuine."""
    train_state = read_train_state(ckpt)
    model = MindVL(MindVLConfig.from_dict(train_state["model_config"]))
    opt = build_optimizer(model, OptimSection(**train_state["recipe"]["optim"]))
    for group in opt.param_groups:  # what the trainer's LR scheduler adds
        group["initial_lr"] = group["lr"]
    load_checkpoint(ckpt, model, opt)
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    state["optim"]["param_groups"][0]["eps"] = _RunsCode(marker)
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)


def test_a_planted_checkpoint_is_refused_by_resume_export_and_merge_and_runs_nothing(tmp_path):
    out = _train(tmp_path, budget={"max_steps": 2}, checkpoint={"every": 1, "keep": 5})
    recipe = write_recipe(tmp_path / "r.yaml", raw_recipe(out, tmp_path / "cache", budget={"max_steps": 3}))
    ckpt = read_latest(out / "checkpoints")
    marker = tmp_path / "marker"
    _plant_metadata(ckpt, marker)
    for cmd in (("train", str(recipe), "resume=auto"), ("export", str(out), "--out", str(tmp_path / "exp")),
                ("merge", str(out), str(out), "--out", str(tmp_path / "merged"))):
        done = run(mindvl_cmd(*cmd), timeout=300)
        assert done.returncode == 2, (cmd, done.stderr[-3000:])
        line = _one_line(done.stderr)
        if cmd[0] == "merge":  # merge reads model folders only: it never opens a DCP checkpoint
            assert "is a training run or checkpoint, not a model folder; export it first" in line
        else:
            assert f"{ckpt}/.metadata: refusing to load it: it names builtins.exec" in line, line
        assert not marker.exists(), cmd

    # the other pickle DCP reads: a non-tensor entry of the shards (the optimizer's param groups)
    other = _train(tmp_path, "other", budget={"max_steps": 1}, checkpoint={"every": 1, "keep": 5})
    _plant_optimizer_entry(read_latest(other / "checkpoints"), marker)
    recipe = write_recipe(tmp_path / "o.yaml", raw_recipe(other, tmp_path / "cache", budget={"max_steps": 1}))
    done = run(mindvl_cmd("train", str(recipe), "resume=auto"), timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    line = _one_line(done.stderr)
    assert ".distcp: refusing to load it: its entry optim.param_groups.0.eps names builtins.exec" in line, line
    assert not marker.exists()


# ---------------------------------------------------------------------------------------- damaged newest checkpoint


def test_a_truncated_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    out = _train(tmp_path, budget={"max_steps": 4}, checkpoint={"every": 1, "keep": 5})
    uninterrupted = load_weights(out / "final")
    newest = read_latest(out / "checkpoints")
    assert newest.name == "step_00000004"
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    assert main(["export", str(newest), "--out", str(tmp_path / "exp")]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"{shard} is truncated (" in line and "its metadata needs" in line, line

    capsys.readouterr()
    result = train(load_recipe(raw=raw_recipe(out, tmp_path / "cache", budget={"max_steps": 4},
                                              checkpoint={"every": 1, "keep": 5}), overrides=["resume=auto"]))
    captured = capsys.readouterr()
    warning = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warning) == 1 and f"checkpoint {newest} is unreadable, resuming from step_00000003" in warning[0]
    assert "truncated" in warning[0]
    assert "resumed from step_00000003" in captured.out and result.steps == 4  # step 4 trained again ...
    again = load_weights(out / "final")
    assert all(torch.equal(again[n], uninterrupted[n]) for n in uninterrupted)  # ... to the same weights


# -------------------------------------------------------------------------------------------------------- full disk


def test_a_full_disk_while_saving_says_so_in_one_line_and_keeps_latest(tmp_path, monkeypatch, capsys):
    real = FileSystem.create_stream

    def full_on_step_2(self, path, mode):
        if "step_00000002" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, path, mode)

    monkeypatch.setattr(FileSystem, "create_stream", full_on_step_2)
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", raw_recipe(out, tmp_path / "cache", budget={"max_steps": 3},
                                                          checkpoint={"every": 1, "keep": 5}))
    assert main(["train", str(recipe)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mindvl train: error: disk full while writing checkpoint step_00000002 at "
                           f"{out}/checkpoints")
    assert "latest still names step_00000001" in line
    assert read_latest(out / "checkpoints").name == "step_00000001"
    assert export_checkpoint(out, tmp_path / "exp")  # and it still loads

    monkeypatch.setattr(FileSystem, "create_stream", real)  # space freed: resume=auto continues
    assert main(["train", str(recipe), "resume=auto"]) == 0
    assert read_latest(out / "checkpoints").name == "step_00000003"
    assert not (out / "checkpoints" / "step_00000002.partial").exists()


def test_a_real_full_tmpfs_says_disk_full(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:  # one checkpoint of the tiny model (~1.7 MB) fits, a second does not
        out = mnt / "run"
        recipe = write_recipe(tmp_path / "r.yaml", raw_recipe(out, tmp_path / "cache", budget={"max_steps": 3},
                                                              checkpoint={"every": 1, "keep": 5}))
        done = run(mindvl_cmd("train", str(recipe)), timeout=300)
        assert done.returncode == 2, done.stderr[-3000:]
        line = _one_line(done.stderr)
        assert "disk full while writing checkpoint step_00000002" in line and "latest still names step_00000001" in line
        assert json.loads((out / "checkpoints" / LATEST).read_text()) == "step_00000001"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


# ------------------------------------------------------------------------------------------ readers vs the pruner


def test_a_pinned_checkpoint_is_not_pruned_and_a_pruned_one_is_seen_as_gone(tmp_path):
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    dcp_io.create_pin(folder)
    (folder / ".metadata").write_bytes(b"x")
    with pinned(folder) as ok:
        assert ok
        assert not remove_unpinned(folder, tmp_path / "grave.partial")  # a reader holds it: kept
        assert folder.is_dir()
    assert remove_unpinned(folder, tmp_path / "grave.partial")
    assert not folder.exists() and not (tmp_path / "grave.partial").exists()

    # a reader that opened the pin just before the pruner took it: it waits, then sees the folder gone
    folder.mkdir()
    dcp_io.create_pin(folder)
    import fcntl
    import os

    fd = os.open(folder / dcp_io.PIN, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the pruner, mid-removal
    seen = []

    def reader():
        with pinned(folder) as ok:
            seen.append(ok)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(0.2)
    assert not seen  # blocked behind the pruner
    os.replace(folder, tmp_path / "grave.partial")
    os.close(fd)
    t.join(10)
    assert seen == [False]


def test_exports_during_a_keep_1_training_succeed_or_print_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 40}, checkpoint={"every": 1, "keep": 1})
    with training_in_background(write_recipe(tmp_path / "r.yaml", raw), out) as trainer:
        results, seen_latest = [], set()
        while trainer.poll() is None and len(results) < 12:
            seen_latest.add(latest_name(out))
            rc = main(["export", str(out), "--out", str(tmp_path / "exp"), "--overwrite"])
            results.append((rc, capsys.readouterr().err))
        assert trainer.wait(600) == 0, trainer.stderr.read()[-3000:]
    assert len(results) >= 5 and len(seen_latest) >= 3, "the training finished before the exports could overlap it"
    for rc, err in results:
        assert rc == 0 or (rc == 2 and len(err.strip().splitlines()) == 1), err[-3000:]
    assert sum(rc == 0 for rc, _ in results) >= len(results) - 1


# ----------------------------------------------------------------------------------------------- good means good


def test_lr_1e30_names_no_bad_checkpoint_and_resume_auto_refuses(tmp_path):
    raw = raw_recipe(tmp_path / "run", tmp_path / "cache", budget={"max_steps": 6},
                     checkpoint={"every": 1, "keep": 5}, optim={"lr": 1e30, "max_bad_steps": 2})
    with pytest.raises(TooManyBadSteps) as info:
        train(load_recipe(raw=raw))
    # step 1 ran on the initial weights (finite loss), its update blew them up (finite, but ~1e30): step_1 is not good
    assert "last good checkpoint: none" in str(info.value)
    root = tmp_path / "run" / "checkpoints"
    assert "step_00000001" in [p.name for p in complete_checkpoints(root)]
    assert not (root / LATEST).exists()
    with pytest.raises(ValueError, match="holds checkpoints but no `latest`"):
        train(load_recipe(raw=raw, overrides=["resume=auto"]))


def test_the_last_good_checkpoint_holds_finite_weights_and_resumes_to_finite_losses(tmp_path):
    cache = tmp_path / "cache"
    out = tmp_path / "run"
    sane = raw_recipe(out, cache, budget={"max_steps": 3}, checkpoint={"every": 1, "keep": 5},
                      optim={"max_bad_steps": 2})
    train(load_recipe(raw=sane))
    # the LR jumps to 1e30 on resume: step 4 runs on step 3's weights (fine), its update blows them up
    wild = raw_recipe(out, cache, budget={"max_steps": 8}, checkpoint={"every": 1, "keep": 5},
                      optim={"lr": 1e30, "max_bad_steps": 2})
    with pytest.raises(ValueError, match="optim.lr: the checkpoint step_00000003 was trained with 0.001"):
        train(load_recipe(raw=wild, overrides=["resume=auto", "schedule.allow_change=false",
                                               "budget.max_steps=3"]))
    with pytest.raises(TooManyBadSteps) as info:
        train(load_recipe(raw=wild, overrides=["resume=auto", "schedule.allow_change=true"]))
    msg = str(info.value)
    assert "2 consecutive steps (5..6)" in msg
    named = Path(msg.split("last good checkpoint: ")[1].split(" ")[0])
    assert named.name == "step_00000003"  # written before the streak, and step 4 verified its weights
    root = out / "checkpoints"
    assert read_latest(root) == named  # step_4 (bad weights) and the streak's saves did not keep `latest`
    bad = load_weights(export_checkpoint(root / "step_00000004", tmp_path / "bad"))
    assert max(float(t.abs().max()) for t in bad.values()) > 1e20  # the checkpoint it did not name
    good = load_weights(export_checkpoint(named, tmp_path / "good"))
    assert all(torch.isfinite(t).all() for t in good.values())
    assert max(float(t.abs().max()) for t in good.values()) < 100

    result = train(load_recipe(raw=raw_recipe(out, cache, budget={"max_steps": 8}, checkpoint={"every": 1, "keep": 5}),
                               overrides=["resume=auto", "schedule.allow_change=true"]))
    assert result.steps == 8 and len(result.losses) == 8  # the metrics history up to step 3, then 4..8 again
    assert all(torch.isfinite(torch.tensor(result.losses))), result.losses
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["lr"] for r in records if r["step"] > 3 and r.get("bad_step") is not True) <= 1e-3


def test_loss_spike_guard_counts_a_spike_as_a_bad_step():
    guard = BadStepGuard(max_consecutive=2, spike_factor=3.0, spike_window=16)
    for step in range(1, 9):
        assert not guard.is_bad(1.0 + 0.01 * step, 0.5)
        guard.record(step, False, 1.0 + 0.01 * step)
    assert guard.is_bad(2.9, 0.5) is False  # below 3 x median (~1.045 x 3)
    assert guard.is_bad(4.0, 0.5) is True
    assert guard.spikes == 1
    off = BadStepGuard(max_consecutive=2)
    for step in range(1, 9):
        off.record(step, False, 1.0)
    assert off.is_bad(1e6, 0.5) is False  # off by default
    assert off.is_bad(float("nan"), 0.5) is True
    with pytest.raises(ValueError, match="optim.loss_spike_factor: must be > 1"):
        load_recipe(raw=raw_recipe(Path("/tmp/unused"), Path("/tmp/unused"), optim={"loss_spike_factor": 0.5}))


def test_pickled_bytes_are_never_read_with_weights_only_false():
    """The planner hook itself: torch.load(weights_only=True) refuses a global; and no unrestricted torch.load
    anywhere in mindvl (the grep is part of this test)."""
    root = Path(__file__).resolve().parents[2] / "mindvl"
    hits = [str(p) for p in root.rglob("*.py") if "weights_only=False" in p.read_text()]
    assert not hits, hits
    buf = io.BytesIO()
    torch.save(_RunsCode(Path("/nonexistent/marker")), buf)
    buf.seek(0)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global: GLOBAL exec"):
        torch.load(buf, weights_only=True)
