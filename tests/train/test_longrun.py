"""Long-run safety in one process: bad-step guard, run-folder lock and refusals, budget changes on resume, seeds,
non-TTY log lines, CLI exit codes and tracebacks."""

from __future__ import annotations

import itertools
import json
import os
import socket
import sys

import pytest
import torch
from train_helpers import load_weights, raw_recipe, run, write_recipe

from mindvl.checkpoint.training import complete_checkpoints, export_checkpoint, read_latest
from mindvl.cli import main
from mindvl.config import load_recipe
from mindvl.train.runfolder import RunFolderError, RunLock
from mindvl.train.stops import EXIT_BAD_STEPS, TooManyBadSteps
from mindvl.train.trainer import train


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def dcp_weights(ckpt, tmp_path) -> dict[str, torch.Tensor]:
    return load_weights(export_checkpoint(ckpt, tmp_path / f"exp_{ckpt.name}"))


# ------------------------------------------------------------------------------------------------------ bad steps


def test_non_finite_steps_change_nothing_and_are_counted(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDVL_FAULT_NAN_STEPS", "2,3")
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 4}, checkpoint={"every": 1, "keep": 10})
    train(load_recipe(raw=raw))
    recs = metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    assert [r.get("bad_step", False) for r in recs] == [False, True, True, False]
    assert recs[-1]["bad_steps"] == 2
    assert not torch.isfinite(torch.tensor(recs[1]["grad_norm"]))
    root = out / "checkpoints"
    w1, w2, w3, w4 = (dcp_weights(root / f"step_0000000{i}", tmp_path) for i in (1, 2, 3, 4))
    for name in w1:  # skipped steps leave the weights exactly as they were; the step after trains again
        assert torch.equal(w1[name], w2[name]) and torch.equal(w1[name], w3[name]), name
    assert any(not torch.equal(w1[n], w4[n]) for n in w1)
    # ... and the optimizer state too (AdamW's step count and moments)
    opt = {}
    for i in (1, 3):
        state = json.loads((root / f"step_0000000{i}" / "train_state.json").read_text())
        opt[i] = state["scheduler"]["last_epoch"]
    assert opt[1] == opt[3]


def test_a_bad_step_streak_stops_naming_the_last_good_checkpoint_which_rotation_keeps(tmp_path, monkeypatch):
    monkeypatch.setenv("MINDVL_FAULT_NAN_STEPS", "3,4,5")
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 8}, checkpoint={"every": 1, "keep": 1},
                     optim={"max_bad_steps": 3})
    with pytest.raises(TooManyBadSteps) as info:
        train(load_recipe(raw=raw))
    msg = str(info.value)
    # step_2's weights gave the bad step 3, so they are not known good; step_1's were verified by the good step 2
    assert "3 consecutive steps (3..5)" in msg and "checkpoint: " in msg and "data shards 0: 10 packs" in msg
    assert msg.split("last good checkpoint: ")[1].split(" ")[0].endswith("step_00000001")
    assert info.value.exit_code == EXIT_BAD_STEPS
    names = [p.name for p in complete_checkpoints(out / "checkpoints")]
    assert "step_00000001" in names  # keep: 1, yet the last good checkpoint survived rotation
    assert names[-1] == "step_00000004"  # rotation still works for the others (step 5 stopped before its save)
    assert "step_00000002" not in names and "step_00000003" not in names
    assert read_latest(out / "checkpoints").name == "step_00000001"  # the streak's saves never moved `latest`


# ---------------------------------------------------------------------------------------------------- run folders


def test_fresh_run_into_a_used_folder_is_refused_unless_resume_or_overwrite(tmp_path):
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 2}, checkpoint={"every": 1, "keep": 5})
    train(load_recipe(raw=raw))
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(RunFolderError, match="already holds a run .*resume=auto.*overwrite=true"):
        train(load_recipe(raw=raw))
    assert (out / "metrics.jsonl").read_text() == before  # nothing was touched
    train(load_recipe(raw=raw, overrides=["overwrite=true", "max_steps=1"]))
    assert [r["step"] for r in metrics(out)] == [1]  # old metrics, checkpoints and final are gone
    assert [p.name for p in complete_checkpoints(out / "checkpoints")] == ["step_00000001"]


def test_a_second_run_into_a_locked_folder_fails_naming_the_holder(tmp_path, capsys):
    out = tmp_path / "run"
    lock = RunLock(out)
    lock.acquire()  # plays the first run (flock locks conflict between open files, even in one process)
    try:
        recipe = write_recipe(tmp_path / "r.yaml", raw_recipe(out, tmp_path / "cache"))
        code = main(["train", str(recipe)])
    finally:
        lock.release()
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"in use by another run (pid {os.getpid()} on host {socket.gethostname()})" in err
    assert "Traceback" not in err and not (out / "metrics.jsonl").exists()


def test_the_lock_of_a_dead_run_does_not_block(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = f"import fcntl, os; fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT); fcntl.flock(fd, 2)"
    assert run([sys.executable, "-c", holder]).returncode == 0  # it exited holding the lock: the kernel dropped it
    lock = RunLock(out)
    lock.acquire()
    lock.release()


# ---------------------------------------------------------------------------------------------- resume and seeds


def test_a_changed_budget_on_resume_is_refused_unless_allowed(tmp_path):
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 2}, checkpoint={"every": 1})
    train(load_recipe(raw=raw))
    with pytest.raises(ValueError, match="max_steps.: 2.*max_steps.: 3.*schedule.allow_change=true"):
        train(load_recipe(raw=raw, overrides=["resume=auto", "max_steps=3"]))
    result = train(load_recipe(raw=raw, overrides=["resume=auto", "max_steps=3", "schedule.allow_change=true"]))
    assert result.steps == 3


def test_seed_reaches_model_init_and_data_order(tmp_path):
    cache = tmp_path / "cache"
    # Two sources: the mixture's draws (data order) depend on the data seed.
    two = raw_recipe(tmp_path / "x", cache)["data"] | {
        "sources": [{"synth": {"tasks": ["ocr"], "n": 24, "seed": 5}, "ratio": 0.5},
                    {"synth": {"tasks": ["chart"], "n": 24, "seed": 6}, "ratio": 0.5}]}

    def first_step(name: str, seed: int, **extra) -> tuple[float, dict]:
        out = tmp_path / name
        data = two | extra.pop("data", {})
        raw = raw_recipe(out, cache, budget={"max_steps": 1}, checkpoint={"every": None}, seed=seed, data=data,
                         **extra)
        train(load_recipe(raw=raw))
        return metrics(out)[0]["loss"], load_weights(out / "final")

    l0, w0 = first_step("s0", 0)
    l1, w1 = first_step("s1", 1)
    assert l0 != l1 and any(not torch.equal(w0[n], w1[n]) for n in w0)
    # Each seed alone: init pinned -> seed=1 still changes the data order (and so the loss) ...
    l1_init0, _ = first_step("s1_init0", 1, model={"init_seed": 0})
    assert l1_init0 != l0
    # ... and with both pinned by their own seeds, seed=1 is bit-identical to seed=0.
    l1_both, w1_both = first_step("s1_both", 1, model={"init_seed": 0}, data={"seed": 0})
    assert l1_both == l0 and all(torch.equal(w0[n], w1_both[n]) for n in w0)


# ------------------------------------------------------------------------------------------------------------ logs


def test_non_tty_output_prints_one_plain_line_per_logging_every(tmp_path, capsys):
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 4}, checkpoint={"every": None},
                     logging={"progress": True, "every": 2, "tensorboard": False, "plot": False})
    assert main(["train", str(write_recipe(tmp_path / "r.yaml", raw))]) == 0  # captured stdout is not a terminal
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("multitask step ")]
    assert [ln.split()[2] for ln in lines] == ["2/4", "4/4"]
    for key in ("loss ", "lr ", "tok/s", "mfu ", "grad_norm ", "eta "):
        assert key in lines[0], (key, lines[0])


def test_cli_shows_a_short_message_for_bad_input_and_the_traceback_with_debug(tmp_path, capsys):
    raw = raw_recipe(tmp_path / "run", tmp_path / "cache")
    raw["optim"]["lr"] = -1.0
    recipe = str(write_recipe(tmp_path / "r.yaml", raw))
    assert main(["train", recipe]) == 2
    assert "optim.lr: must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="optim.lr: must be > 0"):  # --debug: the exception (and traceback) go on
        main(["--debug", "train", recipe])


def test_value_errors_from_torch_internals_are_bugs():
    from mindvl.cli import _is_bug

    with pytest.raises(ValueError) as inner:  # raised inside torch: a shape bug, the CLI keeps its traceback
        torch.nn.functional.cross_entropy(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))
    assert _is_bug(inner.value)
    with pytest.raises(ValueError) as ours:  # raised by mindvl's own validation: bad input, one line
        load_recipe(raw={"optim": {"lr": -1.0}})
    assert not _is_bug(ours.value)


# ---------------------------------------------------------------------------------------------- eval during training


def test_held_out_fraction_splits_records_without_overlap(tmp_path):
    from mindvl.data import DataConfig, load_tokenizer
    from mindvl.data.loader import PackLoader

    tok = load_tokenizer()
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "q"},
                                                     {"role": "assistant", "content": f"id r{i} end"}]}) + "\n"
                            for i in range(60)))
    cfg = DataConfig.from_dict({"sources": [str(path)], "seq_len": 64, "default_system": None,
                                "eval_fraction": 0.25, "pack_buffer": 2})

    def ids(c) -> list[str]:
        import re

        return [i for p in PackLoader(c, tok, max_epochs=1)
                for i in re.findall(r"id (r\d+) end", tok.decode(p.input_ids.tolist()))]

    train_ids, eval_ids = ids(cfg), ids(cfg.eval_config())
    assert sorted(train_ids + eval_ids) == sorted(f"r{i}" for i in range(60))  # every record in exactly one split
    assert 5 <= len(eval_ids) <= 25


def test_validation_loss_and_benchmark_during_training(tmp_path):
    from mindvl.checkpoint.hf import load_model
    from mindvl.data import DataConfig, build_loader, load_tokenizer
    from mindvl.eval.benchmarks import BENCHMARKS
    from mindvl.eval.synth_bench import write_synthetic_benchmarks
    from mindvl.models.loss import IGNORE_INDEX, next_token_targets

    benches = write_synthetic_benchmarks(tmp_path / "bench", n=3, seed=1, benchmarks=["chartqa"])
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 4}, checkpoint={"every": None},
                     eval={"every": 2, "batches": 2, "benchmark": "chartqa", "benchmark_path": str(benches["chartqa"]),
                           "limit": 2, "max_new_tokens": 3})
    raw["data"]["eval_fraction"] = 0.25
    train(load_recipe(raw=raw))
    recs = metrics(out)
    assert [("eval/val_loss" in r) for r in recs] == [False, True, False, True]
    headline = BENCHMARKS["chartqa"].headline("lmms-eval")
    for r in (recs[1], recs[3]):
        assert {f"eval/chartqa/{headline}", "eval/chartqa/exact_match"} <= set(r)
    assert len(read_lines(out / "eval" / "step_00000004" / "chartqa.jsonl")) == 2
    # Reference: the final weights on the same held-out packs, computed by hand.
    model = load_model(out / "final").eval()
    cfg = DataConfig.from_dict({"seed": 0, **raw["data"]}).eval_config()
    total = count = 0.0
    with torch.no_grad():
        for pack in itertools.islice(build_loader(cfg, load_tokenizer()), 2):
            batch = pack.to_torch()
            loss_sum, _ = model(**batch)
            total += float(loss_sum)
            count += float((next_token_targets(batch["labels"], batch["cu_seqlens"]) != IGNORE_INDEX).sum())
    assert recs[-1]["eval/val_loss"] == pytest.approx(total / count, rel=1e-5)


def read_lines(path) -> list[str]:
    return path.read_text().splitlines()


# ------------------------------------------------------------------------------------------------- checkpoints


def test_time_based_and_async_checkpoints_match_synchronous_ones(tmp_path):
    """checkpoint.every_minutes (tiny here: every step is due) with async writes gives the same checkpoints and final
    weights as a synchronous every-step run."""
    cache = tmp_path / "cache"
    sync = raw_recipe(tmp_path / "sync", cache, budget={"max_steps": 3}, checkpoint={"every": 1, "keep": 5})
    timed = raw_recipe(tmp_path / "timed", cache, budget={"max_steps": 3},
                       checkpoint={"every": None, "every_minutes": 1e-6, "keep": 5, "async_save": True})
    train(load_recipe(raw=sync))
    train(load_recipe(raw=timed))
    names = [p.name for p in complete_checkpoints(tmp_path / "timed" / "checkpoints")]
    assert names == ["step_00000001", "step_00000002", "step_00000003"]
    assert not list((tmp_path / "timed" / "checkpoints").glob("*.partial"))
    a = dcp_weights(tmp_path / "sync" / "checkpoints" / names[1], tmp_path / "a")
    b = dcp_weights(tmp_path / "timed" / "checkpoints" / names[1], tmp_path / "b")
    assert all(torch.equal(a[n], b[n]) for n in a)
    a, b = load_weights(tmp_path / "sync" / "final"), load_weights(tmp_path / "timed" / "final")
    assert all(torch.equal(a[n], b[n]) for n in a)
    ra = json.loads((tmp_path / "sync" / "checkpoints" / names[1] / "rank_00000.json").read_text())
    rb = json.loads((tmp_path / "timed" / "checkpoints" / names[1] / "rank_00000.json").read_text())
    assert ra["data"] == rb["data"]  # the data position of that very step, although the shards were written later


def test_a_twenty_record_source_trains_at_thirty_two_reading_slots(tmp_path):
    """A small curated source mixed into a larger one, at 32 reading slots (data shards here; 8 GPUs x 4 workers on
    a cluster): it used to fail with 'no records for reading slot'."""
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                      {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                             for i in range(20)))
    out = tmp_path / "run"
    raw = raw_recipe(out, tmp_path / "cache", budget={"max_steps": 1}, checkpoint={"every": None},
                     batch={"global_batch_size": 32, "data_shards": 32})
    raw["data"]["sources"] = [{"name": "synth", "synth": {"tasks": ["ocr"], "n": 48, "seed": 5}, "ratio": 0.8},
                              {"name": "small", "paths": [str(small)], "ratio": 0.2}]
    raw["data"]["pack_buffer"] = 2
    train(load_recipe(raw=raw))
    report = json.loads((out / "data_report.json").read_text())
    assert len(report) == 32
    assert sum(r["consumed"]["small"]["samples"] for r in report) > 0
    assert sum(sum(r["skipped"].values()) for r in report) == 0


# ------------------------------------------------------------------------------------------------ remote sinks


def test_mlflow_and_wandb_sinks_are_optional_extras(tmp_path, monkeypatch):
    import sys
    import types

    raw = raw_recipe(tmp_path / "run", tmp_path / "cache", budget={"max_steps": 2}, checkpoint={"every": None},
                     logging={"mlflow": True, "tensorboard": False, "plot": False, "progress": False})
    # Not installed: a one-line error naming the extra when the recipe loads (on every rank, before any work).
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ValueError, match=r"logging.mlflow: true needs the `mlflow` package: .*'mindvl\[mlflow\]'"):
        load_recipe(raw=raw)
    assert not (tmp_path / "run").exists()

    calls: list[tuple] = []  # a recording stand-in with mlflow's module-level API
    fake = types.SimpleNamespace(start_run=lambda **kw: calls.append(("start", kw)),
                                 log_params=lambda p: calls.append(("params", p)),
                                 log_metrics=lambda m, step: calls.append(("metrics", step, m)),
                                 end_run=lambda: calls.append(("end",)))
    monkeypatch.setitem(sys.modules, "mlflow", fake)
    train(load_recipe(raw=raw))
    steps = [c[1] for c in calls if c[0] == "metrics"]
    assert steps == [1, 2] and calls[0][0] == "start" and calls[-1] == ("end",)
    logged = next(c[2] for c in calls if c[0] == "metrics")
    assert logged["loss"] == metrics(tmp_path / "run")[0]["loss"] and "lr" in logged
    assert dict(calls[1][1])["optim.lr"] == raw["optim"]["lr"]

    def down(m, step):
        raise ConnectionError("tracking server unreachable")

    monkeypatch.setitem(sys.modules, "mlflow", types.SimpleNamespace(**{**vars(fake), "log_metrics": down}))
    with pytest.warns(UserWarning, match="MlflowSink failed, continuing without it"):
        result = train(load_recipe(raw=raw, overrides=["overwrite=true"]))
    assert result.steps == 2 and len(metrics(tmp_path / "run")) == 2  # the run and metrics.jsonl went on


def test_same_shards_on_another_world_size_resume_exactly(tmp_path):
    """1 rank reading data shards {0, 1} -> 2 ranks reading {0} and {1}: each shard continues exactly where it was
    (the packs equal those the single rank would have read next)."""
    from mindvl.data import DataConfig, load_tokenizer
    from mindvl.train.parallel import ParallelEnv
    from mindvl.train.trainer import ShardedBatches

    tok = load_tokenizer()
    cfg = DataConfig.from_dict({"seed": 0, **raw_recipe(tmp_path, tmp_path / "cache")["data"]})

    def env(rank: int, world: int) -> ParallelEnv:
        return ParallelEnv(rank, world, rank, torch.device("cpu"), "gloo")

    one = ShardedBatches(cfg, tok, env(0, 1), shards=2)
    for _ in range(4):
        one.next()
    saved = [{"data": one.state_dict()}]
    expected = [one.next().input_ids.tolist() for _ in range(4)]  # shard 0, 1, 0, 1
    ranks = [ShardedBatches(cfg, tok, env(r, 2), shards=2) for r in (0, 1)]
    assert all(b.same_layout(saved) for b in ranks)
    for b in ranks:
        b.load_shards(saved)
    got = [ranks[i % 2].next().input_ids.tolist() for i in range(4)]
    assert got == expected
