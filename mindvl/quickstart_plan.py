"""The quickstart's plan and its progress across stages: what it will run (stages, their work, an estimated time)
printed before anything starts, then at every stage boundary how far the whole is, with an ETA.

A stage's time has parts that scale differently on a busy machine, so the estimate measures its speeds at start
(a second or two on an idle machine) and prices each part in its own:

- training and evaluation steps: torch's small kernels. Unit: one steady training step of the multitask model on a
  random 1,024-token pack labelled like a real one (`step_probe`), on the torch threads the run will use (on a busy
  CPU machine fewer, `busy_threads`: two threads on a 2-core machine at load 6 collapsed to 6-15 s a step, 1.3 s
  on one).
- fixed costs that do not scale with the step: a phase's start-up (preflight, model build, the loader's first
  packs), its checkpoint and export, the search's start-up and checkpoint loads, the merge. Mostly single-threaded
  Python; unit: the CPU seconds of one small synthetic form drawn with Pillow over the share of a core a sustained
  process gets now (`host_probe`, `cpu_share`). The first phase's matmul-peak measurement is priced in steps.
- synthetic data: each task's own CPU seconds per sample over that share (a doc ~26 ms, a digit strip ~1.4 ms, a
  text sample 0.05 ms on an idle core), times the samples of the sets the cache does not hold yet; cached sets
  cost nothing.

The costs in those units (`QUICKSTART_COST`) are the quickstart's own per-stage times divided by the probes taken
around each stage (benchmarks/calibrate_quickstart.py; quickstart.json records the probes and, per stage, the
estimate and the seconds). Once stages have finished, the ETA scales what is left by how the finished stages
compared with their estimates.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mindvl.progress import format_duration

# Costs, calibrated with benchmarks/calibrate_quickstart.py on the shared 2-core machine (benchmarks/RESULTS.md,
# "The plan, its estimate and the progress lines"): a phase's seconds split into its steps (metrics.jsonl's
# step_time_s, divided by the step probe) and the rest (divided by the host probe).
QUICKSTART_COST = {
    # step-probe units per steady training step of the phase (other phases scale "default" with data.seq_len/1024)
    "step": {"warmup": 0.9, "multitask": 1.15, "sft-512": 0.6, "sft-1024": 1.05, "sft-2048": 2.0, "default": 1.05},
    "first_step": 0.3,  # step-probe units: a phase's first step over its steady one (allocations, AdamW's state)
    "phase_fixed": 360.0,  # host units per phase: preflight, model build, the first packs, checkpoint, export
    "first_phase": 25.0,  # step-probe units, once: the trainer's matmul peak (MFU) and the process's first step
    "search_fixed": 350.0,  # host units: the search's start-up and benchmark loading
    "checkpoint_load": 40.0,  # host units per checkpoint the search evaluates
    "eval_batch": 0.3,  # step-probe units per generation batch (up to 16 items, 16 new tokens) of an evaluation
    "merge": 280.0,  # host units: the merge, the benchmark files, the untrained floor
}
PROBE_LABELS = 64  # labelled targets of the probe's pack: a real 1,024-token pack of the tiny recipes has 50-100


def cpu_share(seconds: float = 0.3) -> float:
    """The share of one core a single-threaded process gets now (0-1]: CPU time over wall time of a busy loop of
    `seconds`. A probe of a few milliseconds runs inside one scheduler slice and so sees an idle core even at load 6
    on 2 cores, where sustained work gets about a third of one: the data stage then took 3x its estimate."""
    wall0, cpu0 = time.perf_counter(), time.process_time()
    x = 0
    while time.perf_counter() - wall0 < seconds:
        x += 1
    return max(0.05, min(1.0, (time.process_time() - cpu0) / (time.perf_counter() - wall0)))


def synth_probe(tasks, samples: int = 3, share: float = 1.0) -> dict[str, float]:
    """Seconds per synthetic sample of each task, sustained: the CPU seconds of one drawn and PNG-encoded in memory
    (the median of `samples`) over `share` (cpu_share)."""
    import io

    from mindvl.data.synth import make_record

    rates = {}
    for task in tasks:
        times = []
        for i in range(samples):
            t0 = time.process_time()
            _, img, _ = make_record(i, 0, [task])
            if img is not None:
                img.save(io.BytesIO(), format="PNG")
            times.append(time.process_time() - t0)
        rates[task] = statistics.median(times) / share
    return rates


def host_probe(samples: int = 7, share: float = 1.0) -> float:
    """Seconds of one unit of single-threaded host work, sustained: a small synthetic form (`minidoc`) drawn and
    PNG-encoded (about 3 ms of CPU) over `share`. Fixed costs are priced in it."""
    return synth_probe(["minidoc"], samples, share)["minidoc"]


def busy_threads(current: int, cores: int, load: float) -> int:
    """torch threads for a CPU run now: `current` unless the other processes (the 1-minute `load`) leave fewer
    cores free. On a 2-core machine at load 6 a training step took 1.3 s on one thread and 6-15 s on two (torch's
    threads wait on each other whenever one is descheduled), and the estimate could not follow such swings."""
    free = cores - load
    return max(1, min(current, int(free + 0.5)))


def step_probe(recipe, steps: int = 3, budget_s: float = 3.0) -> float:
    """Seconds of one steady-state training step of `recipe`'s model (seeded random weights, a 1,024-token text pack
    of four samples with `PROBE_LABELS` labelled targets like a real pack, forward + backward + AdamW): the fastest
    of up to `steps` timed steps after one untimed step, at least two of them, fewer than `steps` once `budget_s` is
    spent. The first steps of a fresh process carry start-up (allocations, AdamW's state, thread pools: 3.3 s
    against 0.3 s later, issue 43), sometimes into the second step, and a busy moment only ever slows a step down:
    the fastest timed step is the steady rate. Labelling every token would time a 150k-vocabulary loss head over
    1,024 rows, a matmul-bound step unlike the real ones (a few dozen targets, many small kernels), whose ratio to
    the real step then changed with the load. Well under a second on an idle machine."""
    import torch

    from mindvl.data import IGNORE_INDEX, DataConfig, load_tokenizer
    from mindvl.train.materialize import build_model
    from mindvl.train.parallel import ParallelEnv

    tok = load_tokenizer(DataConfig.from_dict(recipe.data).tokenizer)
    model = build_model(recipe, tok, ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1024,), generator=g)  # ordinary tokens (special ids, image pads, come later)
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[-PROBE_LABELS:] = ids[-PROBE_LABELS:]  # the answers of the last sample, as in a chat sample
    cu = torch.tensor([0, 256, 512, 768, 1024], dtype=torch.int32)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < steps + 1 and not (len(times) >= 3 and time.perf_counter() - start > budget_s):
        t0 = time.perf_counter()
        loss_sum, count = model(input_ids=ids, labels=labels, cu_seqlens=cu)
        (loss_sum / count).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return min(times[1:])


@dataclass(frozen=True)
class Speeds:
    """What the estimate is priced in, measured at start: `step_s` (step_probe), `host_s` (host_probe) and the
    seconds per sample of each synthetic task still to generate (synth_probe)."""

    step_s: float
    host_s: float
    synth_s: dict[str, float] = field(default_factory=dict)
    share: float = 1.0  # cpu_share at the probe (already in host_s and synth_s)
    threads: int = 0  # torch threads the run uses (0: not recorded)

    def seconds(self, step_units: float = 0.0, host_units: float = 0.0) -> float:
        return step_units * self.step_s + host_units * self.host_s

    def data_seconds(self, sets) -> float:
        """Seconds to generate `sets` ((tasks, n, seed), not in the cache): each sample is one of its set's tasks
        at random, so a set costs n times the mean of its tasks' rates."""
        return sum(n * statistics.mean(self.synth_s[t] for t in tasks) for tasks, n, _ in sets)


def phase_seconds(speeds: Speeds, name: str, steps: int, seq_len: int, first: bool) -> float:
    """Estimated seconds of one training phase: its steps, its first step's extra, its fixed start-up/checkpoint/
    export, and for the process's `first` phase the trainer's matmul peak measurement."""
    cost = QUICKSTART_COST
    per_step = cost["step"].get(name, cost["step"]["default"] * seq_len / 1024)
    step_units = per_step * (steps + cost["first_step"]) + (cost["first_phase"] if first else 0.0)
    return speeds.seconds(step_units, cost["phase_fixed"])


def search_seconds(speeds: Speeds, checkpoints: int, evaluations: int, items: int, batch_size: int) -> float:
    """Estimated seconds of the resolution search: its start-up, each checkpoint's load, and each evaluation's
    generation batches. Priced per batch, not per item: a batch of 16 costs little more than one of 10 (the full
    run's 100-item evaluations took 11 ms an item, the --fast run's 10-item ones 31 ms)."""
    cost = QUICKSTART_COST
    batches = evaluations * -(-items // batch_size)
    return speeds.seconds(batches * cost["eval_batch"], cost["search_fixed"] + checkpoints * cost["checkpoint_load"])


@dataclass
class Stage:
    name: str
    detail: str  # what it runs, in the plan's words
    seconds: float  # estimated at the plan, on this machine now; 0 for a stage a rerun reuses
    note: str = ""  # "reused", "cached"


@dataclass
class StagePlan:
    """The stages, the probe time and the clock; `begin`/`end` print the overall line."""

    stages: list[Stage]
    probe_s: float
    log: Callable[[str], None] = print
    speeds: Speeds | None = None  # what the estimates were priced in (recorded with the run's timings)
    t0: float = field(default_factory=lambda: time.perf_counter())
    done_estimate: float = 0.0  # estimated seconds of the finished stages that had work
    done_seconds: float = 0.0  # their wall time: the measured pace's base
    current: int = -1
    _stage_t0: float = 0.0
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        """Estimated seconds of the whole plan, as printed at start."""
        return sum(s.seconds for s in self.stages)

    def pace(self) -> float:
        """1 until a stage with work has finished, then its measured seconds over its estimate (the finished
        stages together): a machine busier than at the probe stretches what is left alike."""
        if self.done_estimate > 0 and self.done_seconds > 0:
            return self.done_seconds / self.done_estimate
        return 1.0

    def estimate(self, seconds: float) -> float:
        return seconds * self.pace()

    def print_plan(self, header: str) -> None:
        width = max(len(s.name) for s in self.stages)
        self.log(f"{header}: {len(self.stages)} stages, about {format_duration(self.estimate(self.total))} "
                 f"here (measured: {1000 * self.probe_s:.0f} ms per training step of 1,024 tokens)")
        for i, s in enumerate(self.stages, start=1):
            est = s.note or f"~{format_duration(self.estimate(s.seconds))}"
            self.log(f"  {i}/{len(self.stages)} {s.name:<{width}}  {s.detail}  [{est}]")

    def _index(self, name: str) -> int:
        return next(i for i, s in enumerate(self.stages) if s.name == name)

    def begin(self, name: str) -> None:
        self.current = self._index(name)
        s = self.stages[self.current]
        self._stage_t0 = time.perf_counter()
        if s.seconds <= 0:
            return  # a reused stage says so itself
        est = format_duration(self.estimate(s.seconds))
        self.log(f"[{self.current + 1}/{len(self.stages)}] {s.name}: {s.detail} (~{est}) | {self.overall()}")

    def end(self, name: str) -> None:
        s = self.stages[self._index(name)]
        took = time.perf_counter() - self._stage_t0
        self.seconds[name] = round(took, 1)
        if s.seconds > 0:
            self.done_estimate += s.seconds
            self.done_seconds += took

    def overall(self) -> str:
        elapsed = time.perf_counter() - self.t0
        left = self.total - self.done_estimate
        pct = 100 * self.done_estimate / self.total if self.total else 100.0
        return (f"overall {pct:.0f}% done, {format_duration(elapsed)} elapsed, "
                f"eta {format_duration(self.estimate(left))}")

    def comparison(self) -> str:
        """One line: each stage's estimate at start against its measured time."""
        return ", ".join(f"{s.name} {format_duration(s.seconds)} -> {format_duration(self.seconds[s.name])}"
                         for s in self.stages if s.seconds > 0 and s.name in self.seconds)
