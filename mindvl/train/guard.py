"""The bad-step guard: a step whose loss or gradient norm is not finite changes nothing.

The vote is summed over ranks (preempt.StepVotes), so every rank skips the same step: no optimizer step, no
scheduler step, no router-bias update, gradients dropped. Skipped steps are counted (`bad_steps` in the metrics);
`optim.max_bad_steps` in a row stop the run on every rank with a message naming the steps, the data position and
the last good checkpoint. That checkpoint (the last one written before the current streak) is protected from
rotation (`checkpoint.keep`) so a streak can never rotate every good checkpoint out.

`MINDVL_FAULT_NAN_STEPS=3,5` (with `MINDVL_FAULT_RANK`, default 0) poisons the gradients of those steps on that rank:
the fault hook the tests use to check that all ranks skip together.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from .stops import TooManyBadSteps


def is_finite(value: float | None) -> bool:
    return value is None or math.isfinite(value)


class BadStepGuard:
    def __init__(self, max_consecutive: int):
        self.max_consecutive = max_consecutive
        self.total = 0
        self.streak: list[int] = []  # steps of the current run of bad steps
        self.last_checkpoint: Path | None = None  # newest checkpoint written
        self.protected: Path | None = None  # the last checkpoint written before the current or latest streak
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

    def record(self, step: int, bad: bool) -> None:
        if not bad:
            self.streak = []
            return
        if not self.streak:
            self.protected = self.last_checkpoint
        self.total += 1
        self.streak.append(step)

    def saved(self, path: Path) -> None:
        self.last_checkpoint = path

    def check(self, data_position: str) -> None:
        """Raise TooManyBadSteps (on every rank: the streak is agreed) after `max_consecutive` bad steps in a row."""
        if len(self.streak) < self.max_consecutive:
            return
        good = str(self.protected) if self.protected is not None else "none (no checkpoint before the streak)"
        raise TooManyBadSteps(
            f"stopping: {len(self.streak)} consecutive steps ({self.streak[0]}..{self.streak[-1]}) had a non-finite "
            f"loss or gradient norm and were skipped; data position: {data_position}; last good checkpoint: {good}. "
            "Inspect the data around that position or lower optim.lr, then resume from that checkpoint "
            "(resume=PATH), or raise optim.max_bad_steps")
