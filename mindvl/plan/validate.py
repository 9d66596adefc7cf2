"""The planner's check against reality: the same step on real tensors, measured by the same tracker.

    python -m mindvl.plan.validate RECIPE.yaml [key=value ...]     # under torchrun for several processes

Each process builds the recipe's model as the trainer does (meta device, `prepare_model`, filled shards), reads
its own data shard (the trainer's data config: `data.seed` defaults to the recipe's seed), runs the same optimizer
steps as `simulate.trace_step` (one of 1 micro-batch, one of 2) under FSDP2's memory tracker, and rank 0 prints one
JSON line: the tracker's peak and breakdown, and the process's peak-RSS increase over the step (`ru_maxrss` after
building the model vs after the steps).

    python -m mindvl.plan.validate --allocator RECIPE.yaml [key=value ...]     # one process

adds the CPU allocator's high-water (`allocator_peak_bytes`): c10's CPU allocator keeps a running total of the bytes it
has handed out while the profiler records memory (`profile_memory=True`), and every allocation event carries that
total; its maximum over the model build and the steps is the allocator's high-water. The total only moves on the
threads the profiler watches (allocations and frees on other threads, e.g. gloo's, are missed: then it is an upper
bound), so it is read honestly in ONE process, where the backward runs on the calling thread. With it come the
peak-RSS increase over the same window (`rss_window_bytes`, from before the build: what the C library's heap
holds on to, plus memory outside the allocator).
"""

from __future__ import annotations

import json
import resource
import sys

import torch


def allocator_high_water(prof) -> int:
    """The largest running total c10's CPU allocator reported to `prof` (a finished torch.profiler.profile with
    profile_memory=True): its high-water over the profiled window."""
    from torch._C._profiler import _EventType

    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            peak = max(peak, e.extra_fields.total_allocated)
    return peak


def measure_real_step(recipe, micro_batches: tuple[int, ...] = (1, 2), allocator: bool = False) -> dict:
    """The tracker's peak of the real step; with `allocator` (one process only), also the CPU allocator's
    high-water and the peak-RSS increase over the build and the steps (see the module docstring)."""
    import contextlib
    import os

    from torch.profiler import ProfilerActivity, profile

    if allocator and int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise ValueError("--allocator reads the CPU allocator's total honestly in one process only "
                         f"(WORLD_SIZE is {os.environ['WORLD_SIZE']})")
    window = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if allocator else None
    rss_start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with window if window is not None else contextlib.nullcontext():
        out = _measure(recipe, micro_batches)
    if window is not None:
        out["allocator_peak_bytes"] = allocator_high_water(window)
        out["rss_window_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_start
    return out


def _measure(recipe, micro_batches: tuple[int, ...]) -> dict:
    import dataclasses

    from mindvl.data import DataConfig, load_tokenizer
    from mindvl.train.materialize import build_model
    from mindvl.train.optim import build_optimizer
    from mindvl.train.parallel import destroy, init_distributed, prepare_model
    from mindvl.train.preflight import tokenizer_source
    from mindvl.train.seeding import data_section
    from mindvl.train.step import optimizer_step
    from mindvl.train.trainer import ShardedBatches

    from .simulate import PlanTracker, TrackedStream, loss_region, peak_breakdown, plan_parallel

    pcfg = plan_parallel(recipe)
    env = init_distributed("cpu", pcfg)
    try:
        data_cfg = DataConfig.from_dict(data_section(recipe))  # as the trainer builds it (the same data seed)
        tok = load_tokenizer(tokenizer_source(recipe))  # the trainer's choice (train.preflight)
        planned = dataclasses.replace(recipe, parallel=pcfg)
        model = build_model(recipe, tok, env, lambda meta: prepare_model(meta, planned, env))
        model.set_attention_backend("sdpa")
        optimizer = build_optimizer(model, recipe.optim)
        batches = ShardedBatches(data_cfg, tok, env, recipe.batch.data_shards or env.layout.dp_size)
        tracker = PlanTracker(model, optimizer)

        def fetch():
            batch = batches.next().to_torch()
            tracker.track_inputs((batch["pixel_values"],))
            return batch

        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with tracker, loss_region(tracker):
            for n in micro_batches:
                optimizer_step(model, optimizer, TrackedStream(fetch, n, env.device, 2, tracker), env, model.config,
                               recipe.trainable_modules, recipe.optim.grad_clip, pcfg.grad_accumulation)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
        peak, breakdown = peak_breakdown(tracker)
        return {"rank": env.rank, "world_size": env.world_size, "peak_bytes": peak, "breakdown": breakdown,
                "rss_increase_bytes": rss}
    finally:
        destroy(env)


def main(argv: list[str] | None = None) -> int:
    from mindvl.config import load_recipe

    argv = sys.argv[1:] if argv is None else argv
    allocator = bool(argv) and argv[0] == "--allocator"
    argv = argv[1:] if allocator else argv
    torch.manual_seed(0)
    out = measure_real_step(load_recipe(argv[0], argv[1:]), allocator=allocator)
    if out["rank"] == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
