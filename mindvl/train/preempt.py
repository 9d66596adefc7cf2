"""Preemption: a signal finishes the current step on every rank, then the run checkpoints and stops.

SIGTERM (what SLURM, Kubernetes and torchrun send before killing), SIGUSR1 (SLURM's `--signal=USR1@120`) and SIGINT
(Ctrl-C) only set a flag; the loop reads it between steps. The flags of all ranks are summed in one small
all-reduce per step (`StepVotes`), together with the bad-step vote and rank 0's clock for time-based checkpoints,
so every rank takes the same decision at the same step even when only one rank was signalled. A second signal
exits at once (128 + signal number), except the same SIGTERM or SIGUSR1 again within `REPEAT_WINDOW_S`: a scheduler
signals every process of the job and torchrun forwards what it receives, so a worker gets each of them twice within
milliseconds (a second Ctrl-C, SIGINT, still exits at once).

Loader worker processes ignore these signals (mindvl.data.loader): Ctrl-C reaches the whole process group, and a
worker that died on it would break the main process's data stream before the checkpoint.

For schedulers, a preempted run leaves `OUTPUT_DIR/PREEMPTED` (`write_marker`): JSON with the step, the checkpoint,
the signal and the time, written atomically by rank 0 once the checkpoint is complete, before any rank exits 75, and
removed by the next run in that folder once it holds the folder's lock. It is the contract under torchrun, whose own
exit status is 1 whenever a worker exits non-zero (75 included). Under torchrun a worker also asks the kernel for
SIGTERM when the launcher dies (`watch_launcher`): a launcher killed by a signal it does not forward (SIGUSR1
without `--signals-to-handle`) no longer leaves orphaned workers training on; they checkpoint and stop.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from .parallel import ParallelEnv, all_reduce_sum

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REPEAT_WINDOW_S = 5.0  # the same SIGTERM/SIGUSR1 again within this is one request delivered twice


class StopSignals:
    """Installs the handlers for the duration of a run (`with StopSignals() as stop:`); `stop.received` is the
    first signal's name or None."""

    def __init__(self):
        self.received: str | None = None
        self._received_at = 0.0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
            watch_launcher()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal.Signals(signum).name
        if (self.received == name and signum != signal.SIGINT
                and time.monotonic() - self._received_at < REPEAT_WINDOW_S):
            return  # the same request delivered twice (scheduler and launcher): not an order to exit at once
        if self.received is not None:
            print(f"mindvl: second signal ({name}): exiting now without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        self.received, self._received_at = name, time.monotonic()
        print(f"mindvl: {name} received: finishing this step, then writing a checkpoint (send it again to exit at "
              "once)", file=sys.stderr, flush=True)


@dataclass
class Votes:
    stop: bool  # some rank received a stop signal
    bad_step: bool  # some rank saw a non-finite loss or gradient norm
    checkpoint_due: bool  # rank 0's clock: checkpoint.every_minutes elapsed since the last checkpoint
    saves_written: bool  # no rank has a background checkpoint write still running


class StepVotes:
    """One all-reduce per step that every rank joins, summing [signalled, bad, time due, write still running]."""

    def __init__(self, env: ParallelEnv, every_minutes: float | None):
        self.env, self.every_s = env, None if every_minutes is None else every_minutes * 60.0
        self.last_checkpoint = time.monotonic()

    def checkpointed(self) -> None:
        self.last_checkpoint = time.monotonic()

    def vote(self, signalled: bool, bad: bool, writing: bool = False) -> Votes:
        due = self.env.is_main and self.every_s is not None and time.monotonic() - self.last_checkpoint >= self.every_s
        v = torch.tensor([float(signalled), float(bad), float(due), float(writing)], dtype=torch.float64)
        v = all_reduce_sum(v.to(self.env.device), self.env).cpu()
        return Votes(bool(v[0] > 0), bool(v[1] > 0), bool(v[2] > 0), bool(v[3] == 0))


# The command that reruns a multi-phase driver (the quickstart, the ablation) as a whole: its phases resume on a
# rerun, so that (not `mindvl train RECIPE resume=auto`, one phase only) is what a stopped phase must advise.
_RERUN: list[str] = []


@contextmanager
def rerun_command(command: str) -> Iterator[None]:
    """While inside, a stopped run advises `command` (finished phases reused, this one resumed) instead of
    `mindvl train ... resume=auto`."""
    _RERUN.append(command)
    try:
        yield
    finally:
        _RERUN.pop()


def resume_hint(output_dir: str) -> str:
    if _RERUN:
        return f"{_RERUN[-1]}   (the same command: finished phases are reused, {output_dir} resumes)"
    argv = [a for a in sys.argv[1:] if not a.startswith("resume=")] if sys.argv else []
    cmd = "mindvl " + " ".join(argv) if argv and argv[0] == "train" else "mindvl train RECIPE"
    return f"{cmd} resume=auto   (output_dir {output_dir})"


# ---------------------------------------------------------------------------------------------- for schedulers

MARKER = "PREEMPTED"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def write_marker(output_dir: str | os.PathLike, step: int, total_steps: int, checkpoint: str | os.PathLike,
                 reason: str) -> Path:
    """`OUTPUT_DIR/PREEMPTED`, written atomically (a temporary file renamed over it): rank 0 only, after the
    checkpoint is complete. A scheduler script requeues the job when it exists after the launcher returns."""
    path = Path(output_dir) / MARKER
    info = {"step": step, "total_steps": total_steps, "checkpoint": str(checkpoint), "reason": reason,
            "time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "exit_code": 75,
            "resume": resume_hint(str(output_dir))}
    tmp = path.with_name(f".{MARKER}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def clear_marker(output_dir: str | os.PathLike) -> None:
    """A run that resumed (or started afresh) in the folder is no longer preempted."""
    (Path(output_dir) / MARKER).unlink(missing_ok=True)


def watch_launcher() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set), Linux: SIGTERM this worker when its parent, the launcher, dies,
    so its death becomes a preemption (step finished, checkpoint, exit 75) instead of an orphan training on.
    The setting is not inherited by loader workers (fork clears it)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: nothing to watch with
        pass
