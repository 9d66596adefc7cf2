"""Progress of long work that is not a training run (evaluation, the resolution search, the planner's trace,
curation): a rich bar on a terminal, otherwise a plain flushed line at most every `every_s` seconds and at the end
(logs of SLURM, nohup or CI are not terminals: a bar would print nothing useful there).

Both go to stderr, so that a command's result on stdout (`mindvl plan --json`) stays clean.

    with Progress("eval ocrbench", total=100, unit="items") as bar:
        for batch in batches:
            ...
            bar.update(done)            # or bar.advance(len(batch))
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m05s`, `?` for unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def quiet() -> bool:
    """MINDVL_PROGRESS=0 turns every progress report off (tests, scripts that parse stderr)."""
    return os.environ.get("MINDVL_PROGRESS", "") == "0"


class Progress:
    """Work units done out of `total` (None: unknown), with elapsed time and an ETA from the rate so far."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "", every_s: float = 10.0,
                 stream: TextIO | None = None, bar: bool | None = None, enabled: bool = True):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.enabled = enabled and not quiet()
        self.use_bar = self.enabled and (self.stream.isatty() if bar is None else bar)
        self.done = 0.0
        self._t0 = self._last = time.perf_counter()
        self._bar = self._task = None
        self._printed_done = -1.0

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Progress:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        if not self.use_bar:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
        from rich.progress import Progress as RichProgress
        from rich.table import Column

        count = MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=9))
        self._bar = RichProgress(TextColumn("{task.description}", table_column=Column(overflow="ellipsis",
                                                                                      no_wrap=True, ratio=1)),
                                 BarColumn(bar_width=None, table_column=Column(ratio=1)), count,
                                 TimeElapsedColumn(), TimeRemainingColumn(),
                                 console=Console(file=self.stream), expand=True, transient=False)
        self._task = self._bar.add_task(self.desc, total=self.total)
        self._bar.start()

    # ------------------------------------------------------------------ updates
    def update(self, done: float, total: float | None = None, desc: str | None = None) -> None:
        """Set the units done (and the total or the description when they change)."""
        self.done = done
        if total is not None:
            self.total = total
        if desc is not None:
            self.desc = desc
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=self.total, description=self.desc)
            return
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            self._line(now)

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def log(self, text: str) -> None:
        """A message above the bar (or a plain line)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def eta(self, now: float | None = None) -> float:
        """Seconds left at the rate so far (inf while unknown)."""
        elapsed = (time.perf_counter() if now is None else now) - self._t0
        if not self.total or self.done <= 0:
            return math.inf
        return elapsed / self.done * max(0.0, self.total - self.done)

    def line(self, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = now - self._t0
        unit = f" {self.unit}" if self.unit else ""
        if self.total:
            count = f"{_num(self.done)}/{_num(self.total)}{unit} ({100 * self.done / self.total:.0f}%)"
            if self.done >= self.total:
                return f"{self.desc}: {count}, done in {format_duration(elapsed)}"
            return f"{self.desc}: {count}, {format_duration(elapsed)} elapsed, eta {format_duration(self.eta(now))}"
        return f"{self.desc}: {_num(self.done)}{unit}, {format_duration(elapsed)} elapsed"

    def _line(self, now: float | None = None) -> None:
        self._printed_done = self.done
        print(self.line(now), file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif finished and self._printed_done != self.done:
            self._line()  # the final count, unless the last line already showed it


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"
