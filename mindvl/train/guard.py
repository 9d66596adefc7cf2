"""The bad-step guard: a step whose loss or gradient norm is not finite changes nothing.

The vote is summed over ranks (preempt.StepVotes), so every rank skips the same step: no optimizer step, no
scheduler step, no router-bias update, gradients dropped. Skipped steps are counted (`bad_steps` in the metrics);
`optim.max_bad_steps` in a row stop the run on every rank with a message naming the steps, the data position and
the last good checkpoint. Optionally (`optim.loss_spike_factor`, off by default) a step whose loss exceeds that
factor times the median of the last `optim.loss_spike_window` good steps' losses counts as bad too.

Which checkpoint is good: a checkpoint written after step c holds the weights W_c, and W_c is only known to be good
once step c + 1 (which runs on W_c) had a finite loss and gradient norm. So when a streak begins at step s, the
checkpoint of step s - 1 is not good (its weights gave the bad step: e.g. an update with lr=1e30 leaves finite but
huge weights), nor is any checkpoint written during the streak (the weights are still W_{s-1}). The last good
checkpoint is the newest one whose weights a later step verified. It is protected from rotation
(`checkpoint.keep`), `latest` is moved back to it when a streak begins (`trusts` keeps the streak's saves from moving
it forward; with no verified checkpoint `latest` is removed and resume=auto refuses), and the stop message names it.

`MINDVL_FAULT_NAN_STEPS=3,5` (with `MINDVL_FAULT_RANK`, default 0) poisons the gradients of those steps on that rank:
the fault hook the tests use to check that all ranks skip together.
"""

from __future__ import annotations

import math
import os
import statistics
from collections import deque
from pathlib import Path

import torch

from .stops import TooManyBadSteps

TRAIN_STATE = "train_state.json"  # a checkpoint folder is complete once it has this file (checkpoint.training)


def is_finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


def checkpoint_step(path: Path) -> int:
    return int(Path(path).name.split("_")[1].split(".")[0])


class BadStepGuard:
    def __init__(self, max_consecutive: int, start_step: int = 0, resumed_from: Path | None = None,
                 spike_factor: float | None = None, spike_window: int = 32):
        self.max_consecutive = max_consecutive
        self.total = 0
        self.streak: list[int] = []  # steps of the current run of bad steps
        self.began = False  # the last recorded step began a streak (the trainer moves `latest` back)
        # The weights after this step gave a good step (start_step - 1: nothing verified yet, not even the weights
        # a resume loaded); checkpoints (step, path) written or resumed from, newest last.
        self.verified_step = start_step - 1
        self.checkpoints: list[tuple[int, Path]] = [(start_step, Path(resumed_from))] if resumed_from else []
        self.spike_factor = spike_factor
        self.recent: deque[float] = deque(maxlen=spike_window)  # losses of the latest good steps
        self.spikes = 0
        self.fault_steps = {int(s) for s in os.environ.get("MINDVL_FAULT_NAN_STEPS", "").split(",") if s.strip()}
        self.fault_rank = int(os.environ.get("MINDVL_FAULT_RANK", "0"))

    def inject(self, step: int, rank: int, params: list[torch.Tensor]) -> None:
        """Fault hook: NaN gradients on `MINDVL_FAULT_RANK` at the listed steps (1-based step numbers)."""
        if step not in self.fault_steps or rank != self.fault_rank:
            return
        for p in params:
            g = p.grad
            local = g.to_local() if hasattr(g, "to_local") else g
            if local is not None and local.numel():
                local.fill_(float("nan"))
                return

    def is_bad(self, loss: float | None, grad_norm: float | None) -> bool:
        """A non-finite loss or gradient norm, or (loss-spike guard on) a loss above factor x the running median.
        `loss` is the global per-token loss, the same on every rank, so every rank decides alike."""
        if not (is_finite(loss) and is_finite(grad_norm)):
            return True
        if self.spike_factor is None or loss is None or len(self.recent) < min(8, self.recent.maxlen or 8):
            return False  # a median of fewer than 8 steps (or the window if smaller) is not a baseline yet
        if loss > self.spike_factor * statistics.median(self.recent):
            self.spikes += 1
            return True
        return False

    def record(self, step: int, bad: bool, loss: float | None = None) -> None:
        self.began = bad and not self.streak
        if not bad:
            self.verified_step = step - 1  # this step ran on the weights after step - 1, and they were fine
            self.streak = []
            if loss is not None and is_finite(loss):
                self.recent.append(loss)
            return
        self.total += 1
        self.streak.append(step)

    def saved(self, path: Path) -> None:
        self.checkpoints.append((checkpoint_step(path), Path(path)))
        good = self.last_good_step()
        if good is not None:  # forget what is older than the newest verified checkpoint
            self.checkpoints = [(s, p) for s, p in self.checkpoints if s >= good]

    def trusts(self, path: Path) -> bool:
        """May this checkpoint move `latest`? Not during a streak unless a later good step verified its weights."""
        return not self.streak or checkpoint_step(path) <= self.verified_step

    def last_good_step(self) -> int | None:
        steps = [s for s, _ in self.checkpoints if s <= self.verified_step]
        return max(steps) if steps else None

    def last_good(self) -> Path | None:
        """The newest complete checkpoint whose weights a later good step verified (None if there is none)."""
        for s, p in reversed(self.checkpoints):
            if s <= self.verified_step and (p / TRAIN_STATE).is_file():
                return p
        return None

    @property
    def protected(self) -> Path | None:
        """Never rotated out: the last good checkpoint."""
        return self.last_good()

    def check(self, data_position: str) -> None:
        """Raise TooManyBadSteps (on every rank: the streak is agreed) after `max_consecutive` bad steps in a row."""
        if len(self.streak) < self.max_consecutive:
            return
        found = self.last_good()
        what = "a non-finite loss or gradient norm" + (" or a loss spike" if self.spike_factor else "")
        head = (f"stopping: {len(self.streak)} consecutive steps ({self.streak[0]}..{self.streak[-1]}) had {what} and "
                f"were skipped; data position: {data_position}; ")
        if found is None:
            raise TooManyBadSteps(head + "last good checkpoint: none (no checkpoint was followed by a good step, so "
                                  "`latest` was removed). Inspect the data around that position or lower optim.lr and "
                                  "start over (overwrite=true), or raise optim.max_bad_steps")
        raise TooManyBadSteps(
            head + f"last good checkpoint: {found} (`latest` names it). Inspect the data around that position or "
            "lower optim.lr (with schedule.allow_change=true), then resume=auto, or raise optim.max_bad_steps")
