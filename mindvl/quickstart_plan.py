"""The quickstart's plan and its progress across stages: what it will run (stages, their work, an estimated time)
printed before anything starts, then at every stage boundary how far the whole is, with an ETA.

Estimates come from a speed probe timed at start: a fixed small torch workload (about 0.1 s on an idle 2-core CPU)
whose time, on the machine and load of the moment, sets the unit. Each kind of work has a measured cost in probe
units (the quickstart's own stage times divided by the probe time of the same run, `QUICKSTART_COST` below), so
a busy machine's slower probe gives proportionally longer estimates. Once stages have finished, the ETA uses the
rate measured on them instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mindvl.progress import format_duration

# Costs in probe units, measured on this pipeline (benchmarks/RESULTS.md, "Quickstart"): per synthetic sample of a
# task, per training step at data.seq_len 1024 (others scale linearly with the length), per phase for start-up and
# the final export, per evaluated benchmark item, and the merge + benchmark files + untrained model + report.
QUICKSTART_COST = {
    "synth": {"digits": 0.025, "chart": 0.12, "doc": 0.09, "ocr": 0.05, "grounding": 0.08, "reverse": 0.002},
    "step": {"warmup": 1.4, "default": 2.0},
    "phase_start": 25.0,
    "eval_item": 0.35,
    "checkpoint_load": 3.0,
    "merge": 20.0,
}


def speed_probe(rounds: int = 5) -> float:
    """Seconds of a fixed forward + backward workload the size of the tiny model's layers (median of `rounds`)."""
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    w1 = torch.randn(128, 384, generator=g, requires_grad=True)
    w2 = torch.randn(384, 128, generator=g, requires_grad=True)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(4):
            h = x
            for _ in range(4):
                h = torch.nn.functional.silu(h @ w1) @ w2 / 20
            h.square().mean().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@dataclass
class Stage:
    name: str
    detail: str  # what it runs, in the plan's words
    cost: float  # in probe units; 0 for a stage a rerun reuses
    note: str = ""  # "reused", "cached"


@dataclass
class StagePlan:
    """The stages, the probe time and the clock; `begin`/`end` print the overall line."""

    stages: list[Stage]
    probe_s: float
    log: Callable[[str], None] = print
    t0: float = field(default_factory=time.perf_counter)
    done_cost: float = 0.0
    done_seconds: float = 0.0  # wall time of the finished stages that had a cost (the measured rate's base)
    current: int = -1
    _stage_t0: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total_cost(self) -> float:
        return sum(s.cost for s in self.stages)

    def seconds_per_unit(self) -> float:
        """The probe until a stage with work has finished, then the rate measured on the finished stages."""
        if self.done_cost > 0 and self.done_seconds > 0:
            return self.done_seconds / self.done_cost
        return self.probe_s

    def estimate(self, cost: float) -> float:
        return cost * self.seconds_per_unit()

    def print_plan(self, header: str) -> None:
        width = max(len(s.name) for s in self.stages)
        self.log(f"{header}: {len(self.stages)} stages, about {format_duration(self.estimate(self.total_cost))} "
                 f"here (speed probe {1000 * self.probe_s:.0f} ms; about 100 ms on an idle 2-core CPU)")
        for i, s in enumerate(self.stages, start=1):
            est = s.note or f"~{format_duration(self.estimate(s.cost))}"
            self.log(f"  {i}/{len(self.stages)} {s.name:<{width}}  {s.detail}  [{est}]")

    def _index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.stages) if s.name == name)

    def begin(self, name: str) -> None:
        self.current = self._index(name)
        s = self.stages[self.current]
        self._stage_t0 = time.perf_counter()
        if s.cost <= 0:
            return  # a reused stage says so itself
        est = format_duration(self.estimate(s.cost))
        self.log(f"[{self.current + 1}/{len(self.stages)}] {s.name}: {s.detail} (~{est}) | {self.overall()}")

    def end(self, name: str) -> None:
        s = self.stages[self._index(name)]
        took = time.perf_counter() - self._stage_t0
        self.seconds[name] = round(took, 1)
        if s.cost > 0:
            self.done_cost += s.cost
            self.done_seconds += took

    def overall(self) -> str:
        elapsed = time.perf_counter() - self.t0
        left = self.total_cost - self.done_cost
        pct = 100 * self.done_cost / self.total_cost if self.total_cost else 100.0
        return (f"overall {pct:.0f}% done, {format_duration(elapsed)} elapsed, "
                f"eta {format_duration(self.estimate(left))}")
