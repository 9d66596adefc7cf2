"""Ways a run stops on purpose, each with a documented exit code of `mindvl train`.

| code | meaning |
| --- | --- |
| 0  | the phase finished (`final/` written) |
| 2  | bad input or configuration (a one-line message naming what to fix) |
| 3  | too many consecutive bad steps (non-finite loss or gradient norm); the message names the last good checkpoint |
| 75 | preempted (SIGTERM, SIGUSR1 or SIGINT): a checkpoint was written; run the same command with `resume=auto` |

75 is EX_TEMPFAIL ("try again later"), which schedulers and wrapper scripts can use to requeue the job. A second
signal exits at once with 128 + the signal number (143 for SIGTERM, 130 for SIGINT), as an unhandled signal would.
"""

from __future__ import annotations

EXIT_BAD_STEPS = 3
EXIT_PREEMPTED = 75


class RunStopped(Exception):
    """A run that stopped on purpose on every rank; `exit_code` is what `mindvl train` exits with."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Preempted(RunStopped):
    exit_code = EXIT_PREEMPTED


class TooManyBadSteps(RunStopped):
    exit_code = EXIT_BAD_STEPS
