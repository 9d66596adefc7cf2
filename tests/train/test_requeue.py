"""A shell loop plays SLURM around `torchrun --nproc_per_node 2 ... mindvl train ... resume=auto` (gloo, CPU): the
README's batch script with `scontrol requeue` replaced by running it again. Mid-run the "scheduler" sends the time
limit's warning (USR1 to the batch script, `--signal=B:USR1`) or preempts (SIGTERM to every process of the job);
the run leaves OUTPUT_DIR/PREEMPTED, the loop requeues, and the run finishes with the losses and weights of an
uninterrupted run. Also against that run: SIGTERM to one of two ranks started by hand, then resume=auto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_longrun_processes import losses, steps_logged, two_rank_recipe
from train_helpers import CLI, env, finish, free_port, launch, load_weights, raw_recipe, run

from mindvl.checkpoint.training import read_latest
from mindvl.config import load_recipe
from mindvl.train.preempt import MARKER, clear_marker, write_marker
from mindvl.train.stops import EXIT_PREEMPTED
from mindvl.train.trainer import train

# The README's batch script, with `scontrol requeue` turned into a loop; each attempt on a fresh port.
SCHEDULER = r"""#!/bin/bash
OUT=$1 RECIPE=$2 PORT=$3 CLI=$4
attempt=0
while :; do
    attempt=$((attempt + 1))
    rm -f "$OUT/PREEMPTED"
    "$PYTHON" -m torch.distributed.run --nproc_per_node 2 --master_port $((PORT + attempt)) \
        --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout 120 "$CLI" train "$RECIPE" resume=auto &
    launcher=$!
    trap 'kill -USR1 $launcher' USR1
    trap 'echo "SIGTERM: waiting for the checkpoint"' TERM
    wait $launcher; rc=$?
    while kill -0 $launcher 2>/dev/null; do wait $launcher; rc=$?; done
    trap - USR1 TERM
    if [ -f "$OUT/PREEMPTED" ]; then
        echo "attempt $attempt: launcher exit $rc, requeue: $(tr -d '\n' < "$OUT/PREEMPTED")"
        continue
    fi
    echo "attempt $attempt: exit $rc"
    exit $rc
done
"""


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (from /proc): what SLURM signals as "every process of the job" (its cgroup);
    torchrun starts each worker in a session of its own, so a process group would miss them."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").is_file() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def schedule(tmp_path: Path, recipe: Path, out: Path) -> subprocess.Popen:
    script = tmp_path / "scheduler.sh"
    script.write_text(SCHEDULER)
    cli = tmp_path / "cli.py"
    cli.write_text(CLI + "\n")
    return subprocess.Popen(["bash", str(script), str(out), str(recipe), str(free_port()), str(cli)],
                            env=env() | {"PYTHON": sys.executable}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same recipe, never interrupted, through the same scheduler loop (one attempt): the run every preempted
    run of this module (through the loop, or ranks started by hand) must reproduce bit for bit."""
    tmp = tmp_path_factory.mktemp("reference")
    proc = schedule(tmp, two_rank_recipe(tmp, "ref"), tmp / "ref")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert out.strip().splitlines()[-1] == "attempt 1: exit 0", out
    return tmp / "ref"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["usr1-to-the-batch-script", "sigterm-to-every-process"])
def test_a_preempted_torchrun_job_requeues_until_done_with_an_uninterrupted_runs_losses(tmp_path, reference, how):
    out = tmp_path / "run"
    proc = schedule(tmp_path, two_rank_recipe(tmp_path, "run"), out)
    deadline = time.time() + 300
    while steps_logged(out) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert proc.poll() is None and steps_logged(out) >= 2
    if how == "usr1-to-the-batch-script":  # sbatch --signal=B:USR1@N: the time limit is near
        proc.send_signal(signal.SIGUSR1)
    else:  # preemption: SIGTERM to the batch script, torchrun, the workers and their loader workers at once
        job = [proc.pid, *descendants(proc.pid)]
        assert len(job) >= 4  # bash, torchrun, 2 workers (and their loader workers)
        for pid in job:
            os.kill(pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout[-2000:], stderr[-3000:])

    attempts = [line for line in stdout.splitlines() if line.startswith("attempt ")]
    assert len(attempts) == 2 and attempts[1] == "attempt 2: exit 0", stdout
    marker = json.loads(attempts[0].split("requeue: ", 1)[1])
    assert 2 <= marker["step"] < marker["total_steps"] == 6 and marker["exit_code"] == 75
    assert marker["reason"] == ("SIGUSR1" if how == "usr1-to-the-batch-script" else "SIGTERM")
    assert marker["checkpoint"] == str(out / "checkpoints" / f"step_{marker['step']:08d}")
    assert "exiting now without a checkpoint" not in stderr  # torchrun's forwarded copy counted once
    assert not (out / "PREEMPTED").exists()
    assert losses(out) == losses(reference)
    ours, ref = load_weights(out / "final"), load_weights(reference / "final")
    assert all(torch.equal(ours[n], ref[n]) for n in ref)


@pytest.mark.slow
def test_sigterm_on_one_rank_checkpoints_on_both_and_resume_is_bit_identical(tmp_path, reference):
    """Ranks started by hand (no torchrun, no scheduler loop), SIGTERM to rank 1 only: both ranks finish the step,
    checkpoint, exit 75; resume=auto on 2 ranks ends with the weights and losses of the uninterrupted run of the
    same recipe (`reference`), bit for bit."""
    # The interrupted run also writes a checkpoint every step in the background (async DCP on its own gloo group).
    recipe = two_rank_recipe(tmp_path, "run", checkpoint={"every": 1, "keep": 2, "async_save": True})
    out = tmp_path / "run"
    procs = launch(tmp_path, ["train", str(recipe)])
    deadline = time.time() + 240
    while steps_logged(out) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)  # only rank 1 is told: the decision must still be shared
    (code0, out0, err0), (code1, _, err1) = finish(procs)
    assert code0 == code1 == EXIT_PREEMPTED, (err0[-2000:], err1[-2000:])
    ckpt = read_latest(out / "checkpoints")
    stopped_at = int(ckpt.name.split("_")[1])
    assert 2 <= stopped_at < 6 and steps_logged(out) == stopped_at
    assert f"checkpoint {ckpt}" in err0 and "resume=auto" in err0 and "Traceback" not in err0 + err1
    assert "SIGTERM received" in err1

    resumed = finish(launch(tmp_path, ["train", str(recipe), "resume=auto"]))
    assert [r[0] for r in resumed] == [0, 0], resumed[0][2][-3000:]
    ours, ref = load_weights(out / "final"), load_weights(reference / "final")
    assert all(torch.equal(ours[n], ref[n]) for n in ref)
    assert losses(out) == losses(reference)


@pytest.mark.slow
def test_workers_of_a_launcher_killed_outright_checkpoint_and_stop_instead_of_training_on(tmp_path):
    """SIGUSR1 to a torchrun not told to forward it kills torchrun (its default action): the workers take their
    parent's death as SIGTERM (PR_SET_PDEATHSIG), checkpoint, leave the marker and exit; none trains on."""
    recipe = two_rank_recipe(tmp_path, "run")
    out = tmp_path / "run"
    cli = tmp_path / "cli.py"
    cli.write_text(CLI + "\n")
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(free_port()), str(cli), "train", str(recipe)],
                                env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while steps_logged(out) < 2 and time.time() < deadline and launcher.poll() is None:
        time.sleep(0.05)
    assert launcher.poll() is None and steps_logged(out) >= 2
    workers = descendants(launcher.pid)
    assert len(workers) >= 2
    launcher.send_signal(signal.SIGUSR1)
    assert launcher.wait(timeout=60) == -signal.SIGUSR1
    deadline = time.time() + 180
    while any(alive(w) for w in workers) and time.time() < deadline:
        time.sleep(0.2)
    left = [w for w in workers if alive(w)]
    for w in left:
        os.kill(w, signal.SIGKILL)
    assert not left, "workers still running 180 s after their launcher died"
    marker = json.loads((out / "PREEMPTED").read_text())
    assert marker["reason"] == "SIGTERM" and 2 <= marker["step"] < 6 == marker["total_steps"]
    assert steps_logged(out) == marker["step"] and not (out / "final").exists()
    assert (out / "checkpoints" / "latest").read_text().strip().strip('"') == f"step_{marker['step']:08d}"


STOP_TWICE = """
import os, signal, sys, time
from mindvl.train.preempt import StopSignals
sig = getattr(signal, sys.argv[1])
with StopSignals() as stop:
    for _ in range(2):  # each delivered on its own: Python runs the handler between the sleeps
        os.kill(os.getpid(), sig)
        time.sleep(0.2)
    print("still running after", stop.received)
"""


@pytest.mark.parametrize("sig,code", [("SIGTERM", 0), ("SIGUSR1", 0), ("SIGINT", 128 + signal.SIGINT)])
def test_the_same_sigterm_twice_is_one_request_but_a_second_ctrl_c_exits_at_once(sig, code):
    """A scheduler signals every process and torchrun forwards its copy: a worker sees the same SIGTERM (or USR1)
    twice in a moment and must still checkpoint; a second Ctrl-C is a human asking to stop now. (Forked from the
    tests' fork server, `run`: the signal dispositions of a fresh interpreter, without its ~5 s of torch import.)"""
    proc = run([sys.executable, "-c", STOP_TWICE, sig], timeout=120)
    assert proc.returncode == code, proc.stderr
    assert ("still running after " + sig in proc.stdout) == (code == 0)
    assert ("second signal" in proc.stderr) == (code != 0)


def test_the_marker_is_written_whole_and_cleared(tmp_path):
    path = write_marker(tmp_path, 3, 6, tmp_path / "checkpoints" / "step_00000003", "SIGUSR1")
    info = json.loads(path.read_text())
    assert path == tmp_path / MARKER and [p.name for p in tmp_path.iterdir()] == [MARKER]  # no temporary left
    assert (info["step"], info["total_steps"], info["reason"], info["exit_code"]) == (3, 6, "SIGUSR1", 75)
    assert info["checkpoint"].endswith("step_00000003") and info["time"].endswith("+00:00")
    clear_marker(tmp_path)
    clear_marker(tmp_path)  # absent: nothing to do
    assert not path.exists()


def test_the_next_run_in_the_folder_removes_a_stale_marker(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    write_marker(out, 3, 6, out / "checkpoints" / "step_00000003", "SIGTERM")
    train(load_recipe(raw=raw_recipe(out, tmp_path / "cache", budget={"max_steps": 1}, checkpoint={"every": None})))
    assert not (out / MARKER).exists() and (out / "final").is_dir()
