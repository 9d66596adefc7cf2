"""Running a pipeline: segments of stages over shards, global plans in between, resume at shard granularity.

The stage list is cut at every global stage into *segments*. Segment k, run independently per shard by the
engine's workers: apply global stage k-1's plan (drop/annotate by key), run the map stages, run global stage k's
`annotate`, write the shard (intermediate: `OUT/.work/seg<k>/<shard>.tar` + sidecar arrays; last segment:
`OUT/shards/<shard>.tar`). Between segments the driver runs the global stage's `plan` over the sidecars and writes
one plan file per shard, shard by shard. Memory per worker is one batch, the stages' models and one shard's sidecar
vectors (an embedding row per record of the shard: 100k records x 768 float32 = 300 MB; `split` makes shards
smaller); the driver holds what a global plan needs, which does not grow with the number of records (per-record
state goes to spill files in the plan's folder; see GlobalStage.plan and each global stage).

Resume: a shard is done when its `.done.json` exists (written after the shard was renamed into place), a plan when
its `summary.json` exists; a rerun skips both, so an interrupted run redoes only unfinished shards and never
duplicates output. `OUT/pipeline.json` records the pipeline's fingerprint; a different pipeline in the same folder is
refused.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mindvl.data.schema import BadSample
from mindvl.progress import Progress

from .io import SHARDS_DIR, ShardTask, ShardWriter, input_tasks, iter_input, iter_shard, write_json_atomic
from .items import Item
from .pipeline import PipelineConfig
from .stages import GlobalStage, Stage

log = logging.getLogger("mindvl.curate")
LOG_FIRST = 3  # drops logged in full per (stage, reason) per shard; the counters are always exact


@dataclass
class Segment:
    index: int
    apply: int | None  # index of the global stage whose plan is applied first
    maps: list[int]  # indices of map stages
    annotate: int | None  # index of the global stage annotated at the end
    last: bool


def segments(stages: list[Stage]) -> list[Segment]:
    out: list[Segment] = []
    apply, maps = None, []
    for i, st in enumerate(stages):
        if st.kind == "global":
            out.append(Segment(len(out), apply, maps, i, False))
            apply, maps = i, []
        else:
            maps.append(i)
    out.append(Segment(len(out), apply, maps, None, True))
    return out


def stage_label(i: int, stage: Stage) -> str:
    return f"{i}:{stage.name}"


class Layout:
    """Where everything of a run lives under OUT."""

    def __init__(self, out: str):
        self.out = os.path.abspath(out)
        self.work = os.path.join(self.out, ".work")
        self.shards = os.path.join(self.out, SHARDS_DIR)

    def seg_dir(self, k: int) -> str:
        return os.path.join(self.work, f"seg{k}")

    def shard_out(self, seg: Segment, name: str) -> tuple[str, str | None]:
        if seg.last:
            return os.path.join(self.shards, f"{name}.tar"), None
        d = self.seg_dir(seg.index)
        return os.path.join(d, f"{name}.tar"), os.path.join(d, f"{name}.arrays.npz")

    def shard_in(self, seg: Segment, name: str) -> tuple[str, str]:
        d = self.seg_dir(seg.index - 1)
        return os.path.join(d, f"{name}.tar"), os.path.join(d, f"{name}.arrays.npz")

    def done(self, seg: Segment, name: str) -> str:
        return os.path.join(self.seg_dir(seg.index), f"{name}.done.json")

    def plan_dir(self, stage_index: int) -> str:
        return os.path.join(self.work, f"plan{stage_index}")


# ----------------------------------------------------------------------------------------------- worker side

_CACHE: dict[str, tuple[PipelineConfig, list[Stage]]] = {}


def _pipeline(config: dict, source: str) -> tuple[PipelineConfig, list[Stage]]:
    """The pipeline and its stage objects, built (and their models loaded) once per worker process."""
    key = json.dumps(config, sort_keys=True)
    if key not in _CACHE:
        cfg = PipelineConfig.from_dict(config, source)
        stages = cfg.build_stages()
        for st in stages:
            st.setup()
        _CACHE[key] = (cfg, stages)
    return _CACHE[key]


class _Counter:
    def __init__(self, shard: str):
        self.shard = shard
        self.stages: dict[str, dict[str, Any]] = {}

    def add(self, label: str, n_in: int, kept: int, dropped: list[tuple[Item, str]], seconds: float,
            cpu_seconds: float) -> None:
        s = self.stages.setdefault(label, {"in": 0, "out": 0, "dropped": {}, "seconds": 0.0, "cpu_seconds": 0.0})
        s["in"] += n_in
        s["out"] += kept
        s["seconds"] += seconds
        s["cpu_seconds"] += cpu_seconds
        for item, reason in dropped:
            n = s["dropped"].get(reason, 0) + 1
            s["dropped"][reason] = n
            if n <= LOG_FIRST:
                log.info("[%s] %s dropped %s (%s)", self.shard, label, item.where, reason)


def _batches(items: Iterator[Item | BadSample], size: int, counter: _Counter) -> Iterator[list[Item]]:
    batch: list[Item] = []
    t0 = time.perf_counter()
    for it in items:
        if isinstance(it, BadSample):
            s = counter.stages.setdefault("read", {"in": 0, "out": 0, "dropped": {}, "seconds": 0.0})
            s["in"] += 1
            s["dropped"][it.reason] = s["dropped"].get(it.reason, 0) + 1
            if s["dropped"][it.reason] <= LOG_FIRST:
                log.warning("[%s] skipped %s", counter.shard, it)
            continue
        batch.append(it)
        if len(batch) == size:
            _count_read(counter, batch, time.perf_counter() - t0)
            yield batch
            batch = []
            t0 = time.perf_counter()
    if batch:
        _count_read(counter, batch, time.perf_counter() - t0)
        yield batch


def _count_read(counter: _Counter, batch: list[Item], seconds: float) -> None:
    s = counter.stages.setdefault("read", {"in": 0, "out": 0, "dropped": {}, "seconds": 0.0})
    s["in"] += len(batch)
    s["out"] += len(batch)
    s["seconds"] += seconds


def _plan_step(plan: dict) -> Callable[[list[Item]], tuple[list[Item], list[tuple[Item, str]]]]:
    drop, meta = plan.get("drop", {}), plan.get("meta", {})

    def apply(batch: list[Item]):
        kept, dropped = [], []
        for item in batch:
            if item.key in drop:
                dropped.append((item, drop[item.key]))
                continue
            item.meta.update(meta.get(item.key, {}))
            kept.append(item)
        return kept, dropped

    return apply


def run_shard(job: dict) -> dict:
    """One shard through one segment (what every engine's worker runs). Returns the shard's done record."""
    t_start = time.perf_counter()
    cfg, stages = _pipeline(job["config"], job["source"])
    layout = Layout(job["out"])
    seg = segments(stages)[job["segment"]]
    task = ShardTask.from_dict(job["task"])
    counter = _Counter(task.name)
    steps: list[tuple[str, Callable]] = []
    if seg.apply is not None:
        plan_path = os.path.join(layout.plan_dir(seg.apply), f"{task.name}.json")
        plan = json.load(open(plan_path)) if os.path.exists(plan_path) else {}
        steps.append((stage_label(seg.apply, stages[seg.apply]), _plan_step(plan)))
    for i in seg.maps:
        steps.append((stage_label(i, stages[i]), stages[i].process))
    if seg.annotate is not None:
        st = stages[seg.annotate]
        assert isinstance(st, GlobalStage)
        steps.append((stage_label(seg.annotate, st) + ":annotate", st.annotate))
    if seg.index == 0:
        source: Iterator[Item | BadSample] = iter_input(task)
    else:
        source = iter_shard(*layout.shard_in(seg, task.name))
    out_path, arrays_path = layout.shard_out(seg, task.name)
    writer = ShardWriter(out_path, arrays_path)
    try:
        for batch in _batches(source, cfg.batch_size, counter):
            for label, fn in steps:
                if not batch:
                    break
                t0, c0 = time.perf_counter(), time.process_time()
                n_in = len(batch)
                batch, dropped = fn(batch)
                counter.add(label, n_in, len(batch), dropped, time.perf_counter() - t0, time.process_time() - c0)
            for item in batch:
                if seg.last:
                    item.arrays = {}
                writer.write(item)
    except BaseException:
        writer.abort()
        raise
    writer.close()
    hist, extra = {}, {}
    for i, st in enumerate(stages):
        h, e = st.take_histograms(), st.take_extra()
        if h:
            hist[stage_label(i, st)] = h
        if e:
            extra[stage_label(i, st)] = e
    done = {"shard": task.name, "segment": seg.index, "fingerprint": job["fingerprint"], "written": writer.count,
            "stages": counter.stages, "histograms": hist, "extra": extra, "seconds": time.perf_counter() - t_start,
            "pid": os.getpid()}
    write_json_atomic(layout.done(seg, task.name), done)
    return done


# ----------------------------------------------------------------------------------------------- driver side


@dataclass
class RunResult:
    out: str
    done: list[list[dict]]  # per segment, per shard: the done records (loaded for skipped shards)
    plans: dict[str, dict]  # stage label -> plan summary
    shards_run: int  # shard-segments executed by this call (0 on a complete rerun)
    seconds: float
    segment_seconds: list[float]


def _check_fingerprint(layout: Layout, cfg: PipelineConfig) -> None:
    os.makedirs(layout.out, exist_ok=True)
    path = os.path.join(layout.out, "pipeline.json")
    fp = cfg.fingerprint()
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f).get("fingerprint")
        if old != fp:
            raise ValueError(f"{layout.out}: holds the output of a different pipeline (fingerprint {old}, this "
                             f"pipeline {fp}); use a new output folder or delete it")
        return
    write_json_atomic(path, {"fingerprint": fp, "pipeline": cfg.to_dict()})


def run_pipeline(cfg: PipelineConfig, execute: Callable[[list[dict]], list[dict]] | None = None,
                 report: bool = True) -> RunResult:
    """Run (or resume) `cfg`; `execute(jobs) -> done records` is the engine (default: from cfg.engine)."""
    from .executors import make_executor

    t0 = time.perf_counter()
    layout = Layout(cfg.output)
    stages = cfg.build_stages()
    files = cfg.resolve_inputs()
    tasks = input_tasks(files, cfg.format, cfg.split, cfg.max_record_bytes)
    _check_fingerprint(layout, cfg)
    own_executor = execute is None
    execute = execute or make_executor(cfg.engine, run_shard)
    try:
        return _run_segments(cfg, layout, stages, tasks, execute, report, t0)
    finally:
        if own_executor and hasattr(execute, "close"):
            execute.close()


def _run_segments(cfg: PipelineConfig, layout: Layout, stages: list[Stage], tasks: list[ShardTask],
                  execute: Callable[[list[dict]], list[dict]], report: bool, t0: float) -> RunResult:
    segs = segments(stages)
    base = {"config": cfg.to_dict(), "source": cfg.source, "out": layout.out, "fingerprint": cfg.fingerprint()}
    all_done: list[list[dict]] = []
    plans: dict[str, dict] = {}
    shards_run = 0
    seg_seconds = []
    # Progress in shard-passes (every input shard through every segment of stages), advanced per segment.
    bar = Progress("curate", total=len(segs) * len(tasks), unit="shard-passes")
    bar.start()
    for seg in segs:
        ts = time.perf_counter()
        work = [i for i in (seg.apply, *seg.maps, seg.annotate) if i is not None]
        names = ", ".join(stages[i].name for i in work)
        bar.update(bar.done, desc=f"curate segment {seg.index + 1}/{len(segs)}" + (f" ({names})" if names else ""))
        if seg.apply is not None:
            plans[stage_label(seg.apply, stages[seg.apply])] = _ensure_plan(layout, seg, stages, tasks)
        os.makedirs(layout.seg_dir(seg.index), exist_ok=True)
        done: dict[str, dict] = {}
        todo = []
        for task in tasks:
            path = layout.done(seg, task.name)
            if os.path.exists(path):
                with open(path) as f:
                    done[task.name] = json.load(f)
            else:
                todo.append(dict(base, segment=seg.index, task=task.to_dict()))
        if todo:
            for d in execute(todo):
                done[d["shard"]] = d
            shards_run += len(todo)
        all_done.append([done[t.name] for t in tasks])
        seg_seconds.append(time.perf_counter() - ts)
        bar.advance(len(tasks))
    bar.close()
    result = RunResult(layout.out, all_done, plans, shards_run, time.perf_counter() - t0, seg_seconds)
    if report:
        from .report import write_report

        write_report(cfg, stages, result)
    return result


def _ensure_plan(layout: Layout, seg: Segment, stages: list[Stage], tasks: list[ShardTask]) -> dict:
    pdir = layout.plan_dir(seg.apply)  # type: ignore[arg-type]
    summary_path = os.path.join(pdir, "summary.json")
    if os.path.exists(summary_path):
        with open(summary_path) as f:
            return json.load(f)
    os.makedirs(pdir, exist_ok=True)
    stage = stages[seg.apply]  # type: ignore[index]
    assert isinstance(stage, GlobalStage)
    sidecars = [(t.name, layout.shard_in(seg, t.name)[1]) for t in tasks]
    sidecars = [(n, p) for n, p in sidecars if os.path.exists(p)]
    t0 = time.perf_counter()
    for name in os.listdir(pdir):  # an interrupted plan's shard files: this plan writes its own
        if name.endswith(".json"):
            os.remove(os.path.join(pdir, name))

    def emit(name: str, plan: dict) -> None:  # one shard's plan to disk as soon as it is decided
        write_json_atomic(os.path.join(pdir, f"{name}.json"), plan)

    summary = stage.plan(sidecars, pdir, emit)
    summary = dict(summary, seconds=time.perf_counter() - t0)
    write_json_atomic(summary_path, summary)
    return summary


