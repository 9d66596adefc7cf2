"""control.StepControl alone: what one step's vote means for the loop (skip, checkpoint, stop), one process.

The multi-process behaviour (every rank skips or stops at the same step) is what test_longrun* and test_requeue
check end to end; here each decision is checked against the rule it implements."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import CPU_ENV, raw_recipe

from mindvl.config import load_recipe
from mindvl.train.control import StepControl
from mindvl.train.guard import BadStepGuard
from mindvl.train.preempt import StopSignals
from mindvl.train.step import StepStats
from mindvl.train.stops import TooManyBadSteps


def stats(loss_sum: float, labelled: float = 4.0, grad_norm: float = 1.0) -> StepStats:
    return StepStats(torch.tensor([labelled, 10.0, 100.0], dtype=torch.float64),
                     torch.tensor(loss_sum, dtype=torch.float64), 0.0, 0.0, grad_norm_t=torch.tensor(grad_norm))


def control(tmp_path, every: int = 2, every_minutes: float | None = None,
            signal: str | None = None) -> StepControl:
    recipe = load_recipe(raw=raw_recipe(tmp_path / "o", tmp_path / "c",
                                        checkpoint={"every": every, "every_minutes": every_minutes}))
    signals = StopSignals()  # not entered: no handlers installed; `received` set as a handler would
    signals.received = signal
    return StepControl(recipe, CPU_ENV, signals, BadStepGuard(max_consecutive=2), saver=None)


def test_good_step_updates_and_checkpoints_on_the_every_boundary(tmp_path):
    c = control(tmp_path, every=2)
    c.hooks(1)
    assert c.allow_update(stats(8.0)) is True
    assert not c.skipped and not c.preempted(done=False)
    assert not c.checkpoint_wanted(done=False)  # step 1, every 2
    assert c.checkpoint_wanted(done=True)  # the last step always checkpoints
    c.hooks(2)
    c.allow_update(stats(8.0))
    assert c.checkpoint_wanted(done=False)
    assert c.guard.recent[-1] == 2.0  # the per-token loss (8 / 4 labelled) is the spike guard's history


@pytest.mark.parametrize("loss_sum, grad_norm", [(math.nan, 1.0), (8.0, math.inf)])
def test_bad_step_is_skipped_and_counted(tmp_path, loss_sum, grad_norm):
    c = control(tmp_path)
    c.hooks(1)
    assert c.allow_update(stats(loss_sum, grad_norm=grad_norm)) is False
    assert c.skipped and c.streak_began and c.guard.total == 1
    c.check_bad_steps("here")  # one bad step of max 2: the run goes on
    c.hooks(2)
    c.allow_update(stats(loss_sum, grad_norm=grad_norm))
    assert not c.streak_began  # the streak began at step 1
    with pytest.raises(TooManyBadSteps, match=r"2 consecutive steps \(1..2\).*after step 2, here"):
        c.check_bad_steps("here")


def test_signal_checkpoints_and_stops_unless_the_run_is_done(tmp_path):
    c = control(tmp_path, every=100, signal="SIGTERM")
    c.hooks(3)
    assert c.allow_update(stats(8.0)) is True  # a signal does not skip the step it arrives in
    assert c.checkpoint_wanted(done=False) and c.preempted(done=False)
    assert not c.preempted(done=True)  # the last step: the run finishes instead
    assert c.signal_name == "SIGTERM"


def test_time_based_checkpoint_and_its_clock(tmp_path):
    c = control(tmp_path, every=100, every_minutes=1e-9)
    c.hooks(1)
    c.allow_update(stats(8.0))
    assert c.checkpoint_wanted(done=False) and not c.preempted(done=False)
    c.votes.every_s = 3600.0  # an hour: due only once that long has passed since `checkpointed`
    c.checkpointed(tmp_path / "step_00000001")
    c.hooks(2)
    c.allow_update(stats(8.0))
    assert not c.checkpoint_wanted(done=False)


def test_reading_a_decision_before_the_vote_is_an_error(tmp_path):
    c = control(tmp_path)
    c.hooks(1)
    with pytest.raises(RuntimeError, match="step 1: no vote was taken"):
        _ = c.skipped
