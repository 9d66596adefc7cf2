"""Bad-input accounting: every skipped record is counted by reason and logged with its file:line or shard:key.

In `strict` mode the first bad record raises instead, with the same one-line message.
"""

from __future__ import annotations

import logging

from .schema import BadSample

log = logging.getLogger("mindvl.data")

# Per reason, the first few are logged in full; after that one line every LOG_EVERY so a corpus with a systematic
# problem does not flood the log, but the counters stay exact.
LOG_FIRST = 5
LOG_EVERY = 1000


class SkipLog:
    def __init__(self, strict: bool = False, context: str = ""):
        self.strict = strict
        self.context = context  # e.g. "rank 0 worker 1", prefixed to log lines
        self.counts: dict[str, int] = {}

    def record(self, bad: BadSample) -> None:
        if self.strict:
            raise ValueError(f"{bad} (reason: {bad.reason}; strict mode is on: fix the record or set strict: false)")
        n = self.counts.get(bad.reason, 0) + 1
        self.counts[bad.reason] = n
        if n <= LOG_FIRST or n % LOG_EVERY == 0:
            prefix = f"[{self.context}] " if self.context else ""
            log.warning("%sskipped (%s, #%d): %s", prefix, bad.reason, n, bad)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def state_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.counts = {str(k): int(v) for k, v in d.items()}
