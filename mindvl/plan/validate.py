"""The planner's check against reality: the same step on real tensors, measured by the same tracker.

    python -m mindvl.plan.validate RECIPE.yaml [key=value ...]     # under torchrun for several processes

Each process builds the recipe's model as the trainer does (meta device, `prepare_model`, filled shards), reads
its own data shard (the trainer's data config: `data.seed` defaults to the recipe's seed), runs the same optimizer
steps as `simulate.trace_step` (one of 1 micro-batch, one of 2) under FSDP2's memory tracker, and rank 0 prints one
JSON line: the tracker's peak and breakdown, and the process's peak-RSS increase over the step (`ru_maxrss` after
building the model vs after the steps).
"""

from __future__ import annotations

import json
import resource
import sys

import torch


def measure_real_step(recipe, micro_batches: tuple[int, ...] = (1, 2)) -> dict:
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
    torch.manual_seed(0)
    out = measure_real_step(load_recipe(argv[0], argv[1:]))
    if out["rank"] == 0:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
