"""The quickstart's plan and its progress across stages: what it will run (stages, their work, an estimated time)
printed before anything starts, then at every stage boundary how far the whole is, with an ETA.

Estimates come from a step rate measured at start: the steady-state time of a real training step of the multitask
model on a random 1,024-token pack (`step_probe`), whose time on the machine and load of the moment sets the unit.
Each kind of work has a measured cost in those units (the quickstart's own stage times divided by the probe of the
same run, `QUICKSTART_COST` below), so a busy machine's slower steps give proportionally longer estimates. Once
stages have finished, the ETA uses the rate measured on them instead.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mindvl.progress import format_duration

# Costs in probe units (one measured training step of 1,024 tokens, `step_probe`), from the quickstart's own stage
# times divided by the probe of the same run (benchmarks/RESULTS.md, "Quickstart"): per training step of a phase
# (others scale with data.seq_len / 1024), per phase for start-up, checkpoints and the final export, per evaluated
# benchmark item, per checkpoint loaded by the search, and the merge + benchmark files + untrained model.
# Synthetic data is drawn with Pillow, not torch, so its rate is measured on its own (`synth_probe`).
QUICKSTART_COST = {
    # Re-measured on the testbed recipes (issue 29; packs carry 32-token charts and forms): one run, 1 thread, load ~2.
    "step": {"warmup": 1.4, "multitask": 1.4, "sft-512": 0.8, "sft-1024": 1.5, "sft-2048": 2.3, "default": 1.4},
    "phase_start": 2.0,
    "eval_item": 0.04,
    "checkpoint_load": 0.3,
    "merge": 0.4,
}


def synth_probe(tasks, samples: int = 3) -> dict[str, float]:
    """Seconds per synthetic sample of each task (drawn and PNG-encoded in memory; the median of `samples`)."""
    import io

    from mindvl.data.synth import make_record

    rates = {}
    for task in tasks:
        times = []
        for i in range(samples):
            t0 = time.perf_counter()
            _, img, _ = make_record(i, 0, [task])
            if img is not None:
                img.save(io.BytesIO(), format="PNG")
            times.append(time.perf_counter() - t0)
        rates[task] = statistics.median(times)
    return rates


def step_probe(recipe, steps: int = 3, budget_s: float = 3.0) -> float:
    """Seconds of one steady-state training step of `recipe`'s model (seeded random weights, a 1,024-token text pack
    of four samples, forward + backward + AdamW): the fastest of up to `steps` timed steps after one untimed step,
    at least two of them, fewer than `steps` once `budget_s` is spent. The first steps of a fresh process carry
    start-up (allocations, AdamW's state, thread pools: 3.3 s against 0.3 s later, issue 43), sometimes into the
    second step, and a busy moment only ever slows a step down: the fastest timed step is the steady rate. About a
    second on an idle machine."""
    import torch

    from mindvl.data import DataConfig, load_tokenizer
    from mindvl.train.materialize import build_model
    from mindvl.train.parallel import ParallelEnv

    tok = load_tokenizer(DataConfig.from_dict(recipe.data).tokenizer)
    model = build_model(recipe, tok, ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1024,), generator=g)  # ordinary tokens (special ids, image pads, come later)
    cu = torch.tensor([0, 256, 512, 768, 1024], dtype=torch.int32)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps + 1 and not (len(times) >= 3 and time.perf_counter() - start > budget_s):
        t0 = time.perf_counter()
        loss_sum, count = model(input_ids=ids, labels=ids, cu_seqlens=cu)
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


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
    t0: float = field(default_factory=lambda: time.perf_counter())
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
                 f"here (measured: {1000 * self.probe_s:.0f} ms per training step of 1,024 tokens)")
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
