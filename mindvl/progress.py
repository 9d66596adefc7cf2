"""Progress of long work that is not a training run (evaluation, the resolution search, the planner's trace,
curation): a rich bar on a terminal, otherwise a plain flushed line every `every_s` seconds (10) and at the end
(logs of SLURM, nohup or CI are not terminals: a bar would print nothing useful there). Off a terminal a `Heartbeat`
thread prints the line when the work itself has not updated for `every_s` (one slow unit: a model build, an 8B
layer traced on a CPU), so a log is never silent for longer; training's plain lines use the same heartbeat.

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
import threading
import time
import weakref
from collections.abc import Callable
from typing import TextIO

EVERY_S = 10.0  # off a terminal, a line at least this often (README: "a line every 10 s")


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m05s`, `?` for unknown."""
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def quiet() -> bool:
    """MINDVL_PROGRESS=0 turns every progress report off (tests, scripts that parse stderr)."""
    return os.environ.get("MINDVL_PROGRESS", "") == "0"


class Heartbeat:
    """A daemon thread that calls `say()` whenever `every_s` seconds passed since the last line (`beat()`, which the
    owner calls when it prints one itself). `clock`: seconds (injected by tests); `stop()` ends it for good, and so
    does `say()` returning False (its owner is gone: work that failed before closing its progress)."""

    def __init__(self, say: Callable[[], None], every_s: float = EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.say, self.every_s, self.clock = say, every_s, clock
        self.lock = threading.Lock()  # the owner's lines and the heartbeat's never interleave
        self._last = clock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        self._last = self.clock()
        self._thread = threading.Thread(target=self._run, name="mindvl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = self.clock()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stopped.wait(max(0.0, min(self.every_s, self._last + self.every_s - self.clock()))):
            with self.lock:
                if self._stopped.is_set() or self.clock() - self._last < self.every_s:
                    continue
                self._last = self.clock()
                try:
                    if self.say() is False:
                        return
                except Exception:  # noqa: BLE001 - a progress line must never break the work it reports on
                    return


class Progress:
    """Work units done out of `total` (None: unknown), with elapsed time and an ETA from the rate so far."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "", every_s: float = EVERY_S,
                 stream: TextIO | None = None, bar: bool | None = None, enabled: bool = True):
        self.desc, self.total, self.unit, self.every_s = desc, total, unit, every_s
        self.stream = stream or sys.stderr
        self.enabled = enabled and not quiet()
        self.use_bar = self.enabled and (self.stream.isatty() if bar is None else bar)
        self.done = 0.0
        self._t0 = self._last = time.perf_counter()
        self._bar = self._task = None
        self._printed_done = -1.0
        self._heartbeat: Heartbeat | None = None

    # ------------------------------------------------------------------ context
    def __enter__(self) -> Progress:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(finished=exc_type is None)

    def start(self) -> None:
        self._t0 = self._last = time.perf_counter()
        if not self.use_bar:
            if self.enabled and self._heartbeat is None:  # a line even while one unit of work takes long
                ref = weakref.ref(self)  # no strong reference: a bar its work never closed does not live on
                self._heartbeat = Heartbeat(lambda: (p := ref()) is not None and p._heartbeat_line(),
                                            self.every_s).start()
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
            if self._heartbeat is not None:
                with self._heartbeat.lock:
                    self._heartbeat.beat()
                    self._line(now)
            else:
                self._line(now)

    def advance(self, n: float = 1) -> None:
        self.update(self.done + n)

    def log(self, text: str) -> None:
        """A message above the bar (or a plain line)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(text, markup=False, highlight=False)
        elif self._heartbeat is not None:
            with self._heartbeat.lock:
                self._heartbeat.beat()
                print(text, file=self.stream, flush=True)
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

    def _heartbeat_line(self) -> bool:
        self._last = time.perf_counter()
        self._line(self._last)
        return True

    def _line(self, now: float | None = None) -> None:
        self._printed_done = self.done
        print(self.line(now), file=self.stream, flush=True)

    def close(self, finished: bool = True) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif finished and self._printed_done != self.done:
            self._line()  # the final count, unless the last line already showed it


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"
