"""What long work shows: the training bar keeps its step count and ETA on a narrow terminal; the shared Progress
prints lines (with the count, elapsed time and ETA) off a terminal and nothing when turned off."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress as RichProgress

from mindvl.progress import Progress, format_duration
from mindvl.train.sinks import bar_columns


def render_bar(width: int) -> str:
    console = Console(width=width, color_system=None)
    bar = RichProgress(*bar_columns("multitask", 2000), console=console)
    bar.add_task("train", total=2000, completed=830, stats="loss 3.4567 lr 1.00e-03 6619 tok/s mfu 30.6%")
    with console.capture() as cap:
        console.print(bar.make_tasks_table(bar.tasks))
    return cap.get().rstrip("\n")


@pytest.mark.parametrize("width", [40, 60, 80, 120])
def test_training_bar_never_cuts_the_step_count(width):
    line = render_bar(width)
    assert len(line) <= width
    assert "multitask" in line and " 830/2000 " in line and "-:--:--" in line  # the ETA column (unknown yet)
    if width >= 80:
        assert "loss 3.4567" in line


def test_lines_off_a_terminal(monkeypatch):
    clock = iter([0.0, 0.0, 5.0, 12.0, 30.0, 40.0, 40.0, 40.0])
    monkeypatch.setattr("mindvl.progress.time.perf_counter", lambda: next(clock))
    out = io.StringIO()
    with Progress("eval ocrbench", total=100, unit="items", every_s=10, stream=out, bar=False) as p:
        p.update(10)  # t=5: too soon for a line
        p.update(40)  # t=12: a line; 40 items in 12 s -> 60 left at 0.3 s each = 18 s
        p.update(100)  # t=30: a line (18 s since the last)
    lines = out.getvalue().splitlines()
    assert lines == ["eval ocrbench: 40/100 items (40%), 0m12s elapsed, eta 0m18s",
                     "eval ocrbench: 100/100 items (100%), done in 0m30s"]


def test_final_line_when_no_line_was_due(monkeypatch):
    out = io.StringIO()
    with Progress("search", total=3, stream=out, bar=False) as p:
        for _ in range(3):
            p.advance()
    assert out.getvalue().startswith("search: 3/3 (100%), done in ")


def test_turned_off(monkeypatch):
    monkeypatch.setenv("MINDVL_PROGRESS", "0")
    out = io.StringIO()
    with Progress("x", total=2, stream=out, bar=False, every_s=0) as p:
        p.advance(2)
        p.log("hello")
    assert out.getvalue() == ""


def test_format_duration():
    assert [format_duration(s) for s in (0, 59.6, 61, 3600 + 125, float("inf"))] == \
        ["0m00s", "1m00s", "1m01s", "1h02m", "?"]


def test_planner_trace_moves_through_the_blocks(monkeypatch):
    """The planner's trace: each micro-batch moves half a unit over its blocks' forward, never back on a recompute."""
    import torch

    from mindvl.plan.simulate import TraceProgress

    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    monkeypatch.setenv("MINDVL_PROGRESS", "0")  # the counts, without lines
    bar = TraceProgress(total=2, desc="plan")
    hooks = bar.hook_blocks(model)
    seen = []
    bar.step = "plan: step 1/1"
    for _ in range(2):
        bar.micro_batch()
        x = torch.ones(1, 2)
        for block in model[0]:
            x = block(x)
            seen.append(bar.done)
        model[0][0](torch.ones(1, 2))  # a recomputation of the first block (activation checkpointing)
        seen.append(bar.done)
    assert seen == [0.25, 0.5, 0.5, 1.25, 1.5, 1.5]
    assert bar.desc == "plan: step 1/1, micro-batch 2: forward block 1/2"
    for h in hooks:
        h.remove()


def wait_for(condition, timeout: float = 60.0) -> bool:
    """Poll `condition` (no fixed sleep: a busy machine only makes it slower, never wrong)."""
    import time

    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_line_while_one_unit_of_work_takes_long():
    """Issue 43 item 6: off a terminal a line comes every `every_s` even when the work itself does not update (one
    slow block, a model build); none after close. A short interval stands for the 10 s."""
    out = io.StringIO()
    with Progress("plan: building the model", total=4, unit="micro-batches", every_s=0.02, stream=out, bar=False):
        assert wait_for(lambda: out.getvalue().count("\n") >= 3), out.getvalue()  # no update() is ever called
    lines = out.getvalue().splitlines()
    assert all(line.startswith("plan: building the model: 0/4 micro-batches (0%), ") for line in lines[:3])
    after = out.getvalue()
    assert not wait_for(lambda: out.getvalue() != after, timeout=0.2)  # closed: silent


def test_the_heartbeat_counts_from_the_last_line_on_an_injected_clock():
    from mindvl.progress import Heartbeat

    # The thread sleeps in real seconds, at most every_s: half a second keeps the test short. The times are binary
    # fractions, so "every_s since the last line" is exact.
    now = [0.0]
    said = []
    beat = Heartbeat(lambda: said.append(now[0]), every_s=0.5, clock=lambda: now[0]).start()
    try:
        now[0] = 0.25
        assert not wait_for(lambda: said, timeout=0.1)  # half of every_s since the start: not yet
        beat.beat()  # the owner printed at t=0.25
        now[0] = 0.71875
        assert not wait_for(lambda: said, timeout=0.1)  # 15/16 of every_s since that line
        now[0] = 0.75
        assert wait_for(lambda: said == [0.75])  # every_s since the owner's line
        now[0] = 1.0
        assert not wait_for(lambda: len(said) > 1, timeout=0.1)
    finally:
        beat.stop()


def test_a_bar_its_work_never_closed_stops_its_heartbeat():
    """Work that fails before closing its progress (an error mid-evaluation): once the bar is gone, so are its lines."""
    import gc
    import threading

    out = io.StringIO()
    bar = Progress("eval", total=3, every_s=0.02, stream=out, bar=False)
    bar.start()
    assert wait_for(lambda: out.getvalue().count("\n") >= 1)
    thread = bar._heartbeat._thread
    del bar
    gc.collect()
    assert wait_for(lambda: not thread.is_alive()), [t.name for t in threading.enumerate()]
