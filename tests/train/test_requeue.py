"""A shell loop plays SLURM around `torchrun --nproc_per_node 2 ... mindvl train ... resume=auto` (gloo, CPU): the
README's batch script with `scontrol requeue` replaced by running it again. Mid-run the "scheduler" sends the time
limit's warning (USR1 to the batch script, `--signal=B:USR1`) or preempts (SIGTERM to every process of the job);
the run leaves OUTPUT_DIR/PREEMPTED, the loop requeues, and the run finishes with the losses and weights of an
uninterrupted run."""

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
from test_longrun_processes import free_port, losses, steps_logged, two_rank_recipe
from train_helpers import CLI, env, load_weights

# The README's batch script, with `scontrol requeue` turned into a loop; each attempt on a fresh port.
SCHEDULER = r"""#!/bin/bash
OUT=$1 RECIPE=$2 PORT=$3 CLI=$4
attempt=0
while :; do
    attempt=$((attempt + 1))
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


def schedule(tmp_path: Path, recipe: Path, out: Path) -> subprocess.Popen:
    script = tmp_path / "scheduler.sh"
    script.write_text(SCHEDULER)
    cli = tmp_path / "cli.py"
    cli.write_text(CLI + "\n")
    # Its own session: "every process of the job" is its process group, which the test can signal as SLURM would.
    return subprocess.Popen(["bash", str(script), str(out), str(recipe), str(free_port()), str(cli)],
                            env=env() | {"PYTHON": sys.executable}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The same recipe, never interrupted, through the same scheduler loop (one attempt)."""
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
        os.killpg(proc.pid, signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, (stdout[-2000:], stderr[-3000:])

    attempts = [line for line in stdout.splitlines() if line.startswith("attempt ")]
    assert len(attempts) == 2 and attempts[1] == "attempt 2: exit 0", stdout
    marker = json.loads(attempts[0].split("requeue: ", 1)[1])
    assert 2 <= marker["step"] < marker["total_steps"] == 6 and marker["exit_code"] == 75
    assert marker["reason"] == ("SIGUSR1" if how == "usr1-to-the-batch-script" else "SIGTERM")
    assert marker["checkpoint"] == str(out / "checkpoints" / f"step_{marker['step']:08d}")
    assert "exiting now without a checkpoint" not in stderr  # torchrun's forwarded copy counted once
    assert not (out / "PREEMPTED").exists()  # the resumed run removed it
    assert losses(out) == losses(reference)
    ours, ref = load_weights(out / "final"), load_weights(reference / "final")
    assert all(torch.equal(ours[n], ref[n]) for n in ref)


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
    twice in a moment and must still checkpoint; a second Ctrl-C is a human asking to stop now."""
    proc = subprocess.run([sys.executable, "-c", STOP_TWICE, sig], env=env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code, proc.stderr
    assert ("still running after " + sig in proc.stdout) == (code == 0)
    assert ("second signal" in proc.stderr) == (code != 0)


def test_the_marker_is_written_whole_and_cleared(tmp_path):
    from mindvl.train.preempt import MARKER, clear_marker, write_marker

    path = write_marker(tmp_path, 3, 6, tmp_path / "checkpoints" / "step_00000003", "SIGUSR1")
    info = json.loads(path.read_text())
    assert path == tmp_path / MARKER and [p.name for p in tmp_path.iterdir()] == [MARKER]  # no temporary left
    assert (info["step"], info["total_steps"], info["reason"], info["exit_code"]) == (3, 6, "SIGUSR1", 75)
    assert info["checkpoint"].endswith("step_00000003") and info["time"].endswith("+00:00")
    clear_marker(tmp_path)
    clear_marker(tmp_path)  # absent: nothing to do
    assert not path.exists()
