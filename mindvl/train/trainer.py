"""The training loop: one readable function, `train(recipe)`.

    step:  mindvl.train.step.optimizer_step (streamed micro-batches, global loss normalisation, clipping, AdamW;
           the planner runs the same function) -> bad-step vote -> LR schedule; log; evaluate; checkpoint.

Data shards: the stream is split into `batch.data_shards` shards (default: the parallel layout's data-parallel size
D); data-parallel rank r reads shards r, r + D, ... round-robin over its micro-batches. With data_shards=2 one
process consumes exactly the global batch that two ranks would, which is how the distributed test compares 1 vs 2
processes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mindvl.checkpoint.training import (
    AsyncCheckpointer,
    full_model_state,
    load_checkpoint,
    load_newest_readable,
    point_latest,
    read_rank_states,
    resolve_checkpoint,
    save_checkpoint,
)
from mindvl.config import Recipe
from mindvl.data import DataConfig, build_loader
from mindvl.models import MindVL, MindVLConfig
from mindvl.models.moe import update_router_bias

from .agree import agreed_error, gather_objects
from .evaluate import Evaluator
from .guard import BadStepGuard
from .lora import AdapterExport
from .materialize import build_model
from .metrics import device_peak_flops
from .optim import build_optimizer, build_scheduler
from .parallel import (
    ParallelEnv,
    Prepared,
    all_reduce_sum,
    barrier,
    destroy,
    init_distributed,
    param_dtype,
    prepare_model,
)
from .plan_headline import PlannerHeadline
from .preempt import StepVotes, StopSignals, clear_marker, resume_hint, write_marker
from .preflight import preflight
from .runfolder import claim_run_folder
from .seeding import data_section, seed_everything
from .sinks import MetricSinks
from .step import (  # noqa: F401  (accumulate_gradients, labelled_targets, to_device, StepStats: public names here)
    MicroBatchStream,
    StepHooks,
    StepStats,
    accumulate_gradients,
    labelled_targets,
    optimizer_step,
    to_device,
)
from .stops import Preempted


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    losses: list[float]


# -------------------------------------------------------------------------------------------------------- data


def _states_by_shard(old_rank_states: list[dict]) -> dict[int, dict]:
    """Each old data shard's loader state, in shard order (the ranks of a context-parallel group held the same
    shards, as do those of a tensor-parallel group: their identical copies count once)."""
    by_shard = {s: ld for r in old_rank_states for s, ld in zip(r["data"]["shards"], r["data"]["loaders"],
                                                                 strict=True)}
    return dict(sorted(by_shard.items()))


class ShardedBatches:
    """This rank's micro-batches: round-robin over its data shards (see the module docstring)."""

    def __init__(self, data_cfg: DataConfig, tok, env: ParallelEnv, shards: int):
        self.rank, self.n_shards, self.data_cfg = env.rank, shards, data_cfg
        self.shard_ids = list(range(env.layout.dp_rank, shards, env.layout.dp_size))
        self.loaders = [build_loader(data_cfg, tok, rank=s, world_size=shards) for s in self.shard_ids]
        self._iters: list[Any] = [None] * len(self.loaders)
        self.turn = 0

    def next(self):
        i = self.turn
        if self._iters[i] is None:
            self._iters[i] = iter(self.loaders[i])
        self.turn = (i + 1) % len(self.loaders)
        return next(self._iters[i])

    def state_dict(self) -> dict:
        return {"turn": self.turn, "shards": self.shard_ids, "loaders": [ld.state_dict() for ld in self.loaders]}

    def load_state_dict(self, state: dict) -> None:
        if state["shards"] != self.shard_ids:
            raise ValueError(f"checkpoint data shards {state['shards']} differ from this rank's {self.shard_ids}; "
                             "resume with the same world size and batch.data_shards")
        for ld, s in zip(self.loaders, state["loaders"], strict=True):
            ld.load_state_dict(s)
        self.turn = state["turn"]
        self._iters = [None] * len(self.loaders)

    def same_layout(self, old_rank_states: list[dict]) -> bool:
        """Was the checkpoint written with this many data shards and loader workers (exact resume)?"""
        old = list(_states_by_shard(old_rank_states).values())
        return len(old) == self.n_shards and all(ld["num_streams"] == self.loaders[0].n_streams for ld in old)

    def load_shards(self, old_rank_states: list[dict]) -> None:
        """Exact resume with the same data shards and workers, whichever rank held which shard before (a step
        always ends with every rank's round-robin back at its first shard: accum is a multiple of its shards)."""
        by_shard = _states_by_shard(old_rank_states)
        for s, ld in zip(self.shard_ids, self.loaders, strict=True):
            ld.load_state_dict(by_shard[s])
        self.turn = 0
        self._iters = [None] * len(self.loaders)

    def load_elastic(self, old_rank_states: list[dict]) -> None:
        """Continue a stream saved with another number of data shards or loader workers (mindvl.data.elastic):
        no record lost or repeated within the epoch; the order differs."""
        from mindvl.data.elastic import reshard_loader_states

        old = list(_states_by_shard(old_rank_states).values())
        new = reshard_loader_states(old, self.data_cfg, self.loaders[0].files, self.n_shards)
        for s, ld in zip(self.shard_ids, self.loaders, strict=True):
            ld.load_state_dict(new[s])
        self.turn = 0
        self._iters = [None] * len(self.loaders)

    def report(self) -> list[dict]:
        return [{"shard": s, **ld.report()} for s, ld in zip(self.shard_ids, self.loaders, strict=True)]

    def position(self) -> str:
        """Where this rank is in the data stream, for messages."""
        return "data shards " + ", ".join(f"{s}: {ld.packs_consumed} packs" for s, ld in
                                          zip(self.shard_ids, self.loaders, strict=True)) + f" (rank {self.rank})"


def check_budget_unchanged(train_state: dict, recipe: Recipe, ckpt: Path) -> None:
    """A resume with another max_steps / max_tokens (or another LR: optim.lr, optim.min_lr, schedule.warmup_ratio,
    schedule.decay) would silently bend the LR schedule: refuse unless asked."""
    saved = train_state.get("recipe", {})
    before = saved.get("budget")
    now = {"max_steps": recipe.budget.max_steps, "max_tokens": recipe.budget.max_tokens}
    if before is not None and before != now and not recipe.schedule.allow_change:
        raise ValueError(f"budget: the checkpoint {ckpt.name} was trained with {before}, this run asks for {now}; "
                         "the LR schedule depends on it. Resume with the same budget, or set "
                         "schedule.allow_change=true to recompute the schedule from this step on")
    for section, key in (("optim", "lr"), ("optim", "min_lr"), ("schedule", "warmup_ratio"), ("schedule", "decay")):
        old, new = saved.get(section, {}).get(key), getattr(getattr(recipe, section), key)
        if old is not None and old != new and not recipe.schedule.allow_change:
            raise ValueError(f"{section}.{key}: the checkpoint {ckpt.name} was trained with {old}, this run asks for "
                             f"{new}; a resume keeps the checkpoint's LR schedule. Resume with the same value, or set "
                             "schedule.allow_change=true to follow this recipe's schedule from this step on")


def resume_schedule(scheduler, optimizer: torch.optim.Optimizer, train_state: dict, recipe: Recipe,
                    ckpt: Path) -> None:
    """Restore the LR schedule; with schedule.allow_change the recipe's LR (not the checkpoint's) from this step on."""
    check_budget_unchanged(train_state, recipe, ckpt)
    scheduler.load_state_dict(train_state["scheduler"])
    if recipe.schedule.allow_change:  # the saved base LR would otherwise stay, whatever optim.lr now says
        scheduler.base_lrs = [recipe.optim.lr] * len(scheduler.base_lrs)
        for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = recipe.optim.lr * fn(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


# ---------------------------------------------------------------------------------------------------- the loop


def plan_steps(recipe: Recipe, seq_len: int) -> int:
    if recipe.budget.max_steps is not None:
        return recipe.budget.max_steps
    return math.ceil(recipe.budget.max_tokens / (recipe.batch.global_batch_size * seq_len))


def train(recipe: Recipe) -> RunResult:
    """Run one phase. Raises stops.Preempted after a stop signal (a checkpoint was written) and
    stops.TooManyBadSteps after `optim.max_bad_steps` consecutive non-finite steps, on every rank."""
    env = init_distributed(recipe.parallel.device, recipe.parallel)
    lock = None
    try:
        data_cfg = data_section(recipe)
        # data.tokenizer, else the init/compose model's own; checked against the model before anything is built
        # or written (the run folder included)
        checked = preflight(recipe, data_cfg)
        lock = claim_run_folder(Path(recipe.output_dir), bool(recipe.checkpoint.resume), recipe.overwrite, env)
        if env.is_main:
            clear_marker(recipe.output_dir)  # an earlier attempt's PREEMPTED: this one is the run now
        with StopSignals() as signals:
            return _train(recipe, env, signals, data_cfg, checked)
    finally:
        if lock is not None:
            lock.release()
        destroy(env)


def _train(recipe: Recipe, env: ParallelEnv, signals: StopSignals, data_cfg: DataConfig,
           checked: tuple[Any, str, dict]) -> RunResult:
    out = Path(recipe.output_dir)
    ckpt_root = out / "checkpoints"
    seed_everything(recipe.seed + env.rank)
    tok, tokenizer_dir, side_files = checked

    dp = env.layout.dp_size
    shards = recipe.batch.data_shards or dp
    gb = recipe.batch.global_batch_size
    if shards % dp or gb % shards:
        raise ValueError(f"batch: global_batch_size ({gb}) must be a multiple of data_shards ({shards}), which must be "
                         f"a multiple of the data-parallel size ({dp})")
    accum = gb // dp
    if recipe.batch.gradient_accumulation not in (None, accum):
        raise ValueError(f"batch.gradient_accumulation: {recipe.batch.gradient_accumulation} does not match "
                         f"global_batch_size / data-parallel size = {accum}")
    total_steps = plan_steps(recipe, data_cfg.seq_len)

    prepared = Prepared()  # prepare_model on the meta device (freeze, checkpointing, compile, EP, FSDP): no allocation
    headline = PlannerHeadline(recipe, env, out)  # accelerators: `mindvl plan` in a child process, printed when ready
    model = build_model(recipe, tok, env, lambda meta: prepare_model(meta, recipe, env, prepared))
    trainable = prepared.trainable
    config = model.config
    if data_cfg.video.tokens_per_second is None:
        data_cfg.video.tokens_per_second = config.tokens_per_second
    elif config.uses_mrope and data_cfg.video.tokens_per_second != config.tokens_per_second:
        # Video positions are computed by the data pipeline: a different time scale would train positions that
        # generation (the model's own M-RoPE) never produces.
        raise ValueError(f"data.video.tokens_per_second is {data_cfg.video.tokens_per_second} but the model's "
                         f"tokens_per_second is {config.tokens_per_second}; set them equal")
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, total_steps, recipe.optim, recipe.schedule)
    batches = ShardedBatches(data_cfg, tok, env, shards)

    step, tokens_seen = 0, 0
    resume = recipe.checkpoint.resume
    ckpt, resumed_how = None, ""
    if resume == "auto":  # `latest`, or the newest older checkpoint that reads, if it is truncated or damaged
        found = load_newest_readable(ckpt_root, model, optimizer)
        if found is not None:
            ckpt, train_state, rank_state = found
    elif resume:
        ckpt = resolve_checkpoint(resume)
        train_state, rank_state = load_checkpoint(ckpt, model, optimizer, require_rank_state=False)
    if ckpt is not None:
        resume_schedule(scheduler, optimizer, train_state, recipe, ckpt)
        old_ranks = read_rank_states(ckpt)
        if batches.same_layout(old_ranks):
            batches.load_shards(old_ranks)  # exact: the same packs as an uninterrupted run
        else:  # elastic: another world size, data_shards or num_workers (DCP resharded the model and optimizer)
            batches.load_elastic(old_ranks)
            resumed_how = f" (elastic: written by {len(old_ranks)} rank(s))"
        step, tokens_seen = train_state["step"], train_state["tokens"]

    sinks = MetricSinks(out, recipe, env, resume_step=step if ckpt is not None else 0)
    peak, peak_how = device_peak_flops(env.device, param_dtype(recipe.parallel, env.device))
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        sinks.info(f"phase {recipe.phase.name}: {total_steps} steps x {gb} packs of {data_cfg.seq_len} tokens; "
                   f"{env.world_size} rank(s) on {env.device.type}; trainable {trainable} of {n_params:,} params; "
                   f"peak {peak / 1e12:.2f} TFLOP/s ({peak_how})"
                   + (f"; resumed from {ckpt.name}{resumed_how}" if ckpt else ""))

    adapters = AdapterExport.of(recipe, side_files)  # a LoRA run: what final/adapter and `mindvl export` write

    def train_state() -> dict:
        return {"tokens": tokens_seen, "scheduler": scheduler.state_dict(), "model_config": config.to_dict(),
                "tokenizer_dir": tokenizer_dir, "side_files": side_files, "phase": recipe.phase.name,
                "total_steps": total_steps, "recipe": recipe.to_dict(),
                **({"adapters": adapters.to_dict()} if adapters is not None else {})}

    balance_routers = (config.text.is_moe and "language_model" in recipe.trainable_modules
                       and recipe.optim.router_bias_rate > 0)
    every = recipe.checkpoint.every
    votes = StepVotes(env, recipe.checkpoint.every_minutes)
    guard = BadStepGuard(recipe.optim.max_bad_steps, step, ckpt, recipe.optim.loss_spike_factor,
                         recipe.optim.loss_spike_window)
    saver = AsyncCheckpointer() if recipe.checkpoint.async_save else None
    evaluator = Evaluator(recipe, data_cfg, tok, env, out)

    def checkpoint() -> Path:
        args = (ckpt_root, step, model, optimizer, train_state(), {"data": batches.state_dict()})
        kw = {"keep": recipe.checkpoint.keep, "protect": guard.protected, "trusted": guard.trusts}
        path = saver.save(*args, **kw) if saver is not None else save_checkpoint(*args, **kw)
        guard.saved(path)
        votes.checkpointed()
        return path

    sinks.start(step, total_steps)
    while step < total_steps and (recipe.budget.max_tokens is None or tokens_seen < recipe.budget.max_tokens):
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        vote = None

        def allow_update(stats: StepStats, step: int = step) -> bool:
            # One vote per step: stop signal, bad step (loss or grad norm not finite), time-based checkpoint due.
            nonlocal vote
            loss = stats.loss_sum / max(1.0, float(stats.counts[0]))
            vote = votes.vote(signals.received is not None, guard.is_bad(loss, stats.grad_norm),
                              writing=saver is not None and not saver.written_here())
            guard.record(step + 1, vote.bad_step, loss)
            return not vote.bad_step

        hooks = StepHooks(agree=lambda problem: agreed_error(problem, env),  # no rank fails a fetch alone
                          after_backward=lambda params, step=step: guard.inject(step + 1, env.rank, params),
                          allow_update=allow_update)
        micro = MicroBatchStream(batches.next, accum, env.device, agree=hooks.agree)  # a small prefetch window
        stats = optimizer_step(model, optimizer, micro, env, config, recipe.trainable_modules,
                               recipe.optim.grad_clip, recipe.parallel.grad_accumulation, hooks)
        if guard.began and env.is_main:  # the weights this streak began on are suspect: `latest` goes back
            point_latest(ckpt_root, guard.last_good())
        counts, loss_total, t_data = stats.counts, stats.loss_sum, stats.data_s
        t_fwd, t_bwd, grad_norm = stats.forward_s, stats.backward_s, stats.grad_norm
        n_global = max(1.0, float(counts[0]))
        tc = time.perf_counter()
        if not vote.bad_step:
            scheduler.step()
        moe_violation = None
        if balance_routers and not vote.bad_step:  # after the step, from the loads this step's forwards counted
            moe_violation = update_router_bias(model, recipe.optim.router_bias_rate,
                                               all_reduce=lambda loads: all_reduce_sum(loads, env))
        t_opt = stats.optimizer_s + time.perf_counter() - tc
        loss = loss_total / n_global
        step += 1
        tokens_seen += int(counts[1])
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": float(counts[1]) / dt,
                  "mfu": float(counts[2]) / (dt * peak * env.world_size), "grad_norm": grad_norm,
                  "tokens": tokens_seen, "labelled_tokens": int(n_global), "step_time_s": dt, "data_s": t_data,
                  "forward_s": t_fwd, "backward_s": t_bwd, "optimizer_s": t_opt}
        if moe_violation is not None:
            record["moe_max_violation"] = moe_violation  # DeepSeek's MaxVio: max expert load / mean - 1
        if guard.total:
            record.update(bad_step=vote.bad_step, bad_steps=guard.total)
        done = step >= total_steps or (recipe.budget.max_tokens is not None and tokens_seen >= recipe.budget.max_tokens)
        if evaluator.due(step, done):
            record.update(evaluator.run(model, config, step))
        sinks.log(record, step % recipe.logging.every == 0 or step == total_steps or vote.bad_step)
        if (line := headline.poll()) is not None:
            sinks.info(line)
        guard.check(f"after step {step}, {batches.position()}")
        if saver is not None and saver.pending is not None and vote.saves_written:
            saver.finish()  # every rank's background write is done: rename into place, move `latest`
        if (every and step % every == 0) or done or vote.checkpoint_due or vote.stop:
            checkpoint()
        if vote.stop and not done:
            if saver is not None:
                saver.finish()
            sinks.stop()
            if env.is_main:
                sinks.finish()
            where = ckpt_root / f"step_{step:08d}"
            msg = (f"preempted ({signals.received or 'signal on another rank'}) after step {step}/{total_steps}: "
                   f"checkpoint {where}; resume with: {resume_hint(recipe.output_dir)}")
            sinks.info(msg)
            if env.is_main:  # for schedulers: the checkpoint is complete (saved and finished above)
                write_marker(out, step, total_steps, where, signals.received or "signal on another rank")
            barrier(env)  # no rank exits 75 before the marker exists (torchrun stops the others on the first exit)
            raise Preempted(msg)
    if saver is not None:
        saver.finish()
    sinks.stop()

    final_dir = export_final(model, config, out / "final", tokenizer_dir, env, side_files, adapters)
    # by shard: the ranks of a context- or tensor-parallel group read (and report) the same shards
    reports = sorted({r["shard"]: r for rank in gather_objects(batches.report(), env) for r in rank}.values(),
                     key=lambda r: r["shard"])
    if env.is_main:  # every data shard of every rank, in shard order
        (out / "data_report.json").write_text(json.dumps(reports, indent=1))
        sinks.finish()
    barrier(env)  # no rank tears the process group down while another still talks (gloo aborts on a closed peer)
    return RunResult(out, final_dir, step, sinks.losses)


def export_final(model, config: MindVLConfig, out: Path, tokenizer_dir: str, env: ParallelEnv,
                 side_files: dict | None = None, adapters: AdapterExport | None = None) -> Path | None:
    """Collective: gather the full weights and write `OUTPUT_DIR/final` (a `mindvl.checkpoint.load_model` folder, with
    the side files of `side_files`: {"from": folders, "pixels": [min, max]}) on rank 0. A LoRA run writes its
    adapters merged into the weights there, and in PEFT's layout in `final/adapter` (train.lora)."""
    from mindvl.checkpoint import save_pretrained

    state = adapted = full_model_state(model)
    if adapters is not None:
        state = adapters.merged(adapted)
    if env.is_main:
        with torch.device("meta"):
            plain = MindVL(config)
        plain.load_state_dict(state, assign=True)
        side = side_files or {}
        save_pretrained(plain, out, overwrite=True, side_files_from=side.get("from") or [],
                        pixels=tuple(side["pixels"]) if side.get("pixels") else None, tokenizer_from=tokenizer_dir)
        if adapters is not None:
            adapters.write(adapted, config, out)
    barrier(env)
    return out if env.is_main else None
