"""Training off a terminal prints a line at least every 10 s (issue 43 item 6), not only every `logging.every` steps:
a step's line when that much time passed since the last line, and a "running" line while one step takes longer.
Short intervals stand for the 10 s; with `logging.every` past the budget the step rule alone would print the last
step's line only."""

from __future__ import annotations

import threading

from train_helpers import raw_recipe

from mindvl.config import load_recipe
from mindvl.train.trainer import Trainer, train


class SilentHeartbeat:
    """The heartbeat's interface without its thread: only the time rule of the step lines is left."""

    def __init__(self, say, every_s):
        self.lock = threading.Lock()

    def start(self):
        return self

    def beat(self):
        pass

    def stop(self):
        pass


def recipe(tmp_path, name: str):
    return load_recipe(raw=raw_recipe(tmp_path / name, tmp_path / "cache", budget={"max_steps": 3},
                                      checkpoint={"every": None},
                                      logging={"every": 1000, "progress": True, "tensorboard": False, "plot": False}))


def step_lines(out: str) -> list[str]:
    return [line.split(" | ")[0] for line in out.splitlines()
            if line.startswith("multitask step ") and "| loss " in line]


def test_a_step_line_once_the_interval_has_passed(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mindvl.train.sinks.Heartbeat", SilentHeartbeat)
    monkeypatch.setattr("mindvl.train.sinks.EVERY_S", 1e-9)  # every step takes longer than this
    train(recipe(tmp_path, "a"))
    assert step_lines(capsys.readouterr().out) == ["multitask step 1/3", "multitask step 2/3", "multitask step 3/3"]

    monkeypatch.setattr("mindvl.train.sinks.EVERY_S", 3600.0)  # the step rule alone: the last step only
    train(recipe(tmp_path, "b"))
    assert step_lines(capsys.readouterr().out) == ["multitask step 3/3"]


def test_a_running_line_inside_a_long_step(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("mindvl.train.sinks.EVERY_S", 0.05)
    first = threading.Event()
    real_step = Trainer.train_step

    def slow_first_step(self):  # one step much longer than the interval (as a first step that compiles)
        if not first.is_set():
            first.set()
            threading.Event().wait(0.5)
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", slow_first_step)
    train(recipe(tmp_path, "c"))
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("multitask step 1/3 running, 0m0") for line in lines), lines
    assert step_lines("\n".join(lines))[-1] == "multitask step 3/3"
    assert not [t for t in threading.enumerate() if t.name == "mindvl-heartbeat"]  # stopped with the run
