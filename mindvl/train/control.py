"""What happens after each step, decided once and shared by every rank: skip it, checkpoint, stop.

`StepControl` holds the run's stop signals, bad-step guard (guard.BadStepGuard) and time-based checkpoint clock
(preempt.StepVotes). During the step, its `allow_update` hook (called by step.optimizer_step after the gradient norm,
before the optimizer) takes the step's one agreed vote and keeps it as `self.vote`; after the step the loop asks
the control what the vote means: `skipped`, `checkpoint_wanted`, `preempted`. Keeping the vote as state of this
object (not a closure's `nonlocal`) is what lets the loop read as its steps, and the decisions be tested alone.

The vote must be taken inside the step: a bad step (non-finite loss or gradient norm on any rank) must not reach
the optimizer, and every rank must skip the same step.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mindvl.checkpoint.training import AsyncCheckpointer
from mindvl.config import Recipe

from .agree import agreed_error
from .guard import BadStepGuard
from .parallel import ParallelEnv
from .preempt import StepVotes, StopSignals, Votes
from .step import StepHooks, StepStats


class StepControl:
    def __init__(self, recipe: Recipe, env: ParallelEnv, signals: StopSignals, guard: BadStepGuard,
                 saver: AsyncCheckpointer | None):
        self.env, self.signals, self.guard, self.saver = env, signals, guard, saver
        self.every = recipe.checkpoint.every
        self.votes = StepVotes(env, recipe.checkpoint.every_minutes)
        self.step = 0  # the 1-based number of the step being run (or last run)
        self.vote: Votes | None = None  # that step's agreed vote, once taken

    # ------------------------------------------------------------------------------------- during the step

    def hooks(self, step: int) -> StepHooks:
        """The hooks of step `step` (1-based): agreed data errors, the NaN fault hook, the vote."""
        self.step, self.vote = step, None
        return StepHooks(agree=self.agree, after_backward=self.after_backward, allow_update=self.allow_update)

    def agree(self, problem: str | None) -> str | None:
        return agreed_error(problem, self.env)  # no rank fails a fetch alone

    def after_backward(self, params: list[torch.Tensor]) -> None:
        self.guard.inject(self.step, self.env.rank, params)

    def allow_update(self, stats: StepStats) -> bool:
        """One vote per step: stop signal, bad step (loss or grad norm not finite), time-based checkpoint due."""
        loss = stats.loss_sum / max(1.0, float(stats.counts[0]))
        self.vote = self.votes.vote(self.signals.received is not None, self.guard.is_bad(loss, stats.grad_norm),
                                    writing=self.saver is not None and not self.saver.written_here())
        self.guard.record(self.step, self.vote.bad_step, loss)
        return not self.vote.bad_step

    # -------------------------------------------------------------------------------------- after the step

    def _taken(self) -> Votes:
        if self.vote is None:
            raise RuntimeError(f"step {self.step}: no vote was taken (the step did not reach its allow_update hook)")
        return self.vote

    @property
    def skipped(self) -> bool:
        """The step was bad on some rank: no optimizer, scheduler or router-bias update anywhere."""
        return self._taken().bad_step

    @property
    def streak_began(self) -> bool:
        """This step began a streak of bad steps: `latest` must go back to the last good checkpoint."""
        return self.guard.began

    @property
    def saves_written(self) -> bool:
        """No rank has a background checkpoint write still running: a pending one can be put into place."""
        return self._taken().saves_written

    def checkpoint_wanted(self, done: bool) -> bool:
        """checkpoint.every, the last step, checkpoint.every_minutes (rank 0's clock), or a stop signal."""
        vote = self._taken()
        return bool((self.every and self.step % self.every == 0) or done or vote.checkpoint_due or vote.stop)

    def checkpointed(self, path: Path) -> None:
        self.guard.saved(path)
        self.votes.checkpointed()

    def check_bad_steps(self, data_position: str) -> None:
        """Raise stops.TooManyBadSteps (on every rank alike) after optim.max_bad_steps bad steps in a row."""
        self.guard.check(f"after step {self.step}, {data_position}")

    def preempted(self, done: bool) -> bool:
        """Some rank was signalled: stop after this step's checkpoint (a finished run just finishes)."""
        return self._taken().stop and not done

    @property
    def signal_name(self) -> str:
        return self.signals.received or "signal on another rank"
