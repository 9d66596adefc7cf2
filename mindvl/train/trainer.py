"""The training loop: `train(recipe)` runs one phase; `Trainer.run` is the loop, one method per step of it:

    while not done():
        train_step()        mindvl.train.step.optimizer_step (streamed micro-batches, global loss normalisation,
                            clipping, AdamW; the planner runs the same function), the step's agreed vote taken
                            inside it (control.StepControl: bad step, stop signal, checkpoint due), LR schedule
        maybe_evaluate()    validation loss / benchmark every eval.every steps and at the end
        log()               metrics.jsonl and the other sinks
        check_bad_steps()   optim.max_bad_steps bad steps in a row: stop (exit 3)
        maybe_checkpoint()  checkpoint.every, every_minutes, the last step, a stop signal
        should_stop()       a stop signal: preempt() (PREEMPTED marker, exit 75)
    finish()                final/ exported, data report

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

from mindvl.checkpoint.frozen_base import KEY as FROZEN_BASE
from mindvl.checkpoint.frozen_base import FrozenBase
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

from .agree import gather_objects
from .control import StepControl
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
from .preempt import StopSignals, clear_marker, resume_hint, write_marker
from .preflight import fill_processor, preflight
from .runfolder import claim_run_folder
from .seeding import data_section, seed_everything
from .sinks import MetricSinks
from .step import (  # noqa: F401  (accumulate_gradients, labelled_targets, to_device, StepStats: public names here)
    MicroBatchStream,
    StepStats,
    accumulate_gradients,
    batch_layout,
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
        """Was the checkpoint written with this many data shards and loader workers (exact resume), by this version's
        deal of the data (a state of the whole-file deal continues through the elastic path)?"""
        from mindvl.data.stream import STATE_VERSION

        old = list(_states_by_shard(old_rank_states).values())
        return len(old) == self.n_shards and all(ld["num_streams"] == self.loaders[0].n_streams for ld in old) and \
            all(st is None or st["version"] == STATE_VERSION for ld in old for st in ld["streams"])

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
    """A resume with another max_steps / max_tokens (or another LR: optim.lr, optim.min_lr, optim.lr_scale,
    schedule.warmup_ratio, schedule.decay) would silently bend the LR schedule: refuse unless asked."""
    saved = train_state.get("recipe", {})
    before = saved.get("budget")
    now = {"max_steps": recipe.budget.max_steps, "max_tokens": recipe.budget.max_tokens}
    if before is not None and before != now and not recipe.schedule.allow_change:
        raise ValueError(f"budget: the checkpoint {ckpt.name} was trained with {before}, this run asks for {now}; "
                         "the LR schedule depends on it. Resume with the same budget, or set "
                         "schedule.allow_change=true to recompute the schedule from this step on")
    old_scale = saved.get("optim", {}).get("lr_scale")
    if old_scale is not None and old_scale != recipe.optim.lr_scale:  # allow_change too: groups keep their scales
        raise ValueError(f"optim.lr_scale: the checkpoint {ckpt.name} was trained with {old_scale}, this run asks for "
                         f"{recipe.optim.lr_scale}; the optimizer's parameter groups carry their scales, so a resume "
                         "keeps them. Resume with the same value, or start a new run from the exported model")
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
        scheduler.base_lrs = [recipe.optim.lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True):
            group["lr"] = group.get("lr_scale", 1.0) * recipe.optim.lr * fn(scheduler.last_epoch)
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
            return Trainer(recipe, env, signals, data_cfg, checked).run()
    finally:
        if lock is not None:
            lock.release()
        destroy(env)


def batch_split(recipe: Recipe, env: ParallelEnv) -> tuple[int, int]:
    """(data shards, micro-batches per rank and step), checked against the recipe's batch section."""
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
    return shards, accum


def match_video_time(data_cfg: DataConfig, config: MindVLConfig) -> None:
    """data.video.tokens_per_second defaults to the model's; with M-RoPE a different one is refused."""
    if data_cfg.video.tokens_per_second is None:
        data_cfg.video.tokens_per_second = config.tokens_per_second
    elif config.uses_mrope and data_cfg.video.tokens_per_second != config.tokens_per_second:
        # Video positions are computed by the data pipeline: a different time scale would train positions that
        # generation (the model's own M-RoPE) never produces.
        raise ValueError(f"data.video.tokens_per_second is {data_cfg.video.tokens_per_second} but the model's "
                         f"tokens_per_second is {config.tokens_per_second}; set them equal")


class Trainer:
    """One phase: everything built (model, optimizer, data, sinks), resumed if asked; `run()` is the loop.

    Each step's decisions (skip a bad step, checkpoint, stop on a signal) are one agreed vote held by
    `self.control` (control.StepControl), taken inside the step and read after it."""

    def __init__(self, recipe: Recipe, env: ParallelEnv, signals: StopSignals, data_cfg: DataConfig,
                 checked: tuple[Any, str, dict]):
        self.recipe, self.env, self.data_cfg = recipe, env, data_cfg
        self.out = Path(recipe.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        seed_everything(recipe.seed + env.rank)
        self.tok, self.tokenizer_dir, self.side_files = checked
        self.adapters = AdapterExport.of(recipe, self.side_files)  # a LoRA run: final/adapter, `mindvl export`
        shards, self.accum = batch_split(recipe, env)
        self.total_steps = plan_steps(recipe, data_cfg.seq_len)

        prepared = Prepared()  # prepare_model on the meta device (freeze, checkpointing, compile, EP, FSDP)
        self.headline = PlannerHeadline(recipe, env, self.out)  # accelerators: `mindvl plan` in a child process
        # a LoRA run's checkpoints reference its base (fingerprinted as it is read) instead of copying it
        self.base = FrozenBase() if self.adapters is not None else None
        self.model = build_model(recipe, self.tok, env, lambda meta: prepare_model(meta, recipe, env, prepared),
                                 self.base)
        self.config = self.model.config
        match_video_time(data_cfg, self.config)
        fill_processor(data_cfg, recipe, self.config)  # the model folder's processor cuts the patches (16 px: Qwen3-VL)
        self.optimizer = build_optimizer(self.model, recipe.optim)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, recipe.optim, recipe.schedule)
        self.batches = ShardedBatches(data_cfg, self.tok, env, shards)

        self.step, self.tokens_seen = 0, 0
        ckpt, resumed_how = self.resume()
        self.sinks = MetricSinks(self.out, recipe, env, resume_step=self.step if ckpt is not None else 0)
        self.peak, peak_how = device_peak_flops(env.device, param_dtype(recipe.parallel, env.device))
        if env.is_main:
            n_params = sum(p.numel() for p in self.model.parameters())
            self.sinks.info(f"phase {recipe.phase.name}: {self.total_steps} steps x "
                            f"{recipe.batch.global_batch_size} packs of {data_cfg.seq_len} tokens; "
                            f"{env.world_size} rank(s) on {env.device.type}; trainable {prepared.trainable} of "
                            f"{n_params:,} params; peak {self.peak / 1e12:.2f} TFLOP/s ({peak_how})"
                            + (f"; resumed from {ckpt.name}{resumed_how}" if ckpt else ""))

        self.balance_routers = (self.config.text.is_moe and "language_model" in recipe.trainable_modules
                                and recipe.optim.router_bias_rate > 0)
        guard = BadStepGuard(recipe.optim.max_bad_steps, self.step, ckpt, recipe.optim.loss_spike_factor,
                             recipe.optim.loss_spike_window)
        self.saver = AsyncCheckpointer() if recipe.checkpoint.async_save else None
        self.control = StepControl(recipe, env, signals, guard, self.saver)
        self.evaluator = Evaluator(recipe, data_cfg, self.tok, env, self.out)

    def resume(self) -> tuple[Path | None, str]:
        """checkpoint.resume (`auto`: `latest`, or the newest older checkpoint that reads, if it is truncated or
        damaged): weights, optimizer, LR schedule, data position, step and tokens. Returns the checkpoint (None: a
        fresh start) and how the data position was restored."""
        resume = self.recipe.checkpoint.resume
        ckpt, resumed_how = None, ""
        if resume == "auto":
            found = load_newest_readable(self.ckpt_root, self.model, self.optimizer)
            if found is not None:
                ckpt, train_state, _ = found
        elif resume:
            ckpt = resolve_checkpoint(resume)
            train_state, _ = load_checkpoint(ckpt, self.model, self.optimizer, require_rank_state=False)
        if ckpt is None:
            return None, ""
        if self.base is not None and FROZEN_BASE in train_state:  # the base it was trained on, or one line
            self.base.check(train_state[FROZEN_BASE], str(ckpt))
        resume_schedule(self.scheduler, self.optimizer, train_state, self.recipe, ckpt)
        old_ranks = read_rank_states(ckpt)
        if self.batches.same_layout(old_ranks):
            self.batches.load_shards(old_ranks)  # exact: the same packs as an uninterrupted run
        else:  # elastic: another world size, data_shards or num_workers (DCP resharded the model and optimizer)
            self.batches.load_elastic(old_ranks)
            resumed_how = f" (elastic: written by {len(old_ranks)} rank(s))"
        self.step, self.tokens_seen = train_state["step"], train_state["tokens"]
        return ckpt, resumed_how

    # ------------------------------------------------------------------------------------------------ the loop

    def run(self) -> RunResult:
        """Raises stops.Preempted after a stop signal (a checkpoint was written) and stops.TooManyBadSteps after
        optim.max_bad_steps bad steps in a row, on every rank alike."""
        self.sinks.start(self.step, self.total_steps)
        try:
            while not self.done():
                record = self.train_step()
                self.maybe_evaluate(record)
                self.log(record)
                self.control.check_bad_steps(self.batches.position())
                self.maybe_checkpoint()
                if self.should_stop():
                    raise self.preempt()
            return self.finish()
        finally:
            self.sinks.stop()  # also after an error: no progress line outlives the run

    def done(self) -> bool:
        max_tokens = self.recipe.budget.max_tokens
        return self.step >= self.total_steps or (max_tokens is not None and self.tokens_seen >= max_tokens)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step (a bad one skipped on every rank), then the LR schedule and the MoE router biases;
        returns the step's metrics."""
        env, recipe = self.env, self.recipe
        t0 = time.perf_counter()
        # The schedule's LR (optim.lr's curve): group 0 may be one that optim.lr_scale scales.
        lr = self.scheduler.get_last_lr()[0] / self.optimizer.param_groups[0].get("lr_scale", 1.0)
        hooks = self.control.hooks(self.step + 1)
        micro = MicroBatchStream(self.batches.next, self.accum, env.device, agree=hooks.agree,  # a prefetch window
                                 layout=batch_layout(self.config))  # host values: no device reads in the step
        stats = optimizer_step(self.model, self.optimizer, micro, env, self.config, recipe.trainable_modules,
                               recipe.optim.grad_clip, recipe.parallel.grad_accumulation, hooks)
        if self.control.streak_began and env.is_main:  # the weights this streak began on are suspect
            point_latest(self.ckpt_root, self.control.guard.last_good())  # `latest` goes back
        tc = time.perf_counter()
        if not self.control.skipped:
            self.scheduler.step()
        moe_violation = None
        if self.balance_routers and not self.control.skipped:  # from the loads this step's forwards counted
            moe_violation = update_router_bias(self.model, recipe.optim.router_bias_rate, all_reduce=self.all_reduce)
        t_opt = stats.optimizer_s + time.perf_counter() - tc
        self.step += 1
        self.tokens_seen += int(stats.counts[1])
        return self.step_record(stats, lr, time.perf_counter() - t0, t_opt, moe_violation)

    def all_reduce(self, loads: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(loads, self.env)

    def step_record(self, stats: StepStats, lr: float, dt: float, t_opt: float,
                    moe_violation: float | None) -> dict[str, Any]:
        counts = stats.counts
        n_global = max(1.0, float(counts[0]))
        record = {"step": self.step, "loss": stats.loss_sum / n_global, "lr": lr, "tokens_per_s": float(counts[1]) / dt,
                  "mfu": float(counts[2]) / (dt * self.peak * self.env.world_size), "grad_norm": stats.grad_norm,
                  "tokens": self.tokens_seen, "labelled_tokens": int(n_global), "step_time_s": dt,
                  "data_s": stats.data_s, "forward_s": stats.forward_s, "backward_s": stats.backward_s,
                  "optimizer_s": t_opt}
        if moe_violation is not None:
            record["moe_max_violation"] = moe_violation  # DeepSeek's MaxVio: max expert load / mean - 1
        if self.control.guard.total:
            record.update(bad_step=self.control.skipped, bad_steps=self.control.guard.total)
        return record

    def maybe_evaluate(self, record: dict[str, Any]) -> None:
        if self.evaluator.due(self.step, self.done()):
            record.update(self.evaluator.run(self.model, self.config, self.step))

    def log(self, record: dict[str, Any]) -> None:
        """The step's metrics (printed every logging.every steps, the last and every bad one), the planner's line."""
        self.sinks.log(record, self.step % self.recipe.logging.every == 0 or self.step == self.total_steps
                       or self.control.skipped)
        if (line := self.headline.poll()) is not None:
            self.sinks.info(line)

    def maybe_checkpoint(self) -> None:
        if self.saver is not None and self.saver.pending is not None and self.control.saves_written:
            self.saver.finish()  # every rank's background write is done: rename into place, move `latest`
        if self.control.checkpoint_wanted(self.done()):
            self.checkpoint()

    def checkpoint(self) -> Path:
        guard = self.control.guard
        args = (self.ckpt_root, self.step, self.model, self.optimizer, self.train_state(),
                {"data": self.batches.state_dict()})
        kw = {"keep": self.recipe.checkpoint.keep, "protect": guard.protected, "trusted": guard.trusts}
        path = self.saver.save(*args, **kw) if self.saver is not None else save_checkpoint(*args, **kw)
        self.control.checkpointed(path)
        return path

    def train_state(self) -> dict[str, Any]:
        """What a checkpoint records beside the weights, optimizer and data position (the step is added)."""
        return {"tokens": self.tokens_seen, "scheduler": self.scheduler.state_dict(),
                "model_config": self.config.to_dict(), "tokenizer_dir": self.tokenizer_dir,
                "side_files": self.side_files, "phase": self.recipe.phase.name, "total_steps": self.total_steps,
                "recipe": self.recipe.to_dict(),
                **({"adapters": self.adapters.to_dict()} if self.adapters is not None else {}),
                **({FROZEN_BASE: self.adapters.base_reference(
                    self.base, param_dtype(self.recipe.parallel, self.env.device))} if self.base is not None else {})}

    def should_stop(self) -> bool:
        return self.control.preempted(self.done())

    def preempt(self) -> Preempted:
        """After a stop signal's checkpoint: finish it, tell the scheduler (PREEMPTED), return what to raise."""
        env = self.env
        if self.saver is not None:
            self.saver.finish()
        self.sinks.stop()
        if env.is_main:
            self.sinks.finish()
        where = self.ckpt_root / f"step_{self.step:08d}"
        msg = (f"preempted ({self.control.signal_name}) after step {self.step}/{self.total_steps}: "
               f"checkpoint {where}; resume with: {resume_hint(self.recipe.output_dir)}")
        self.sinks.info(msg)
        if env.is_main:  # for schedulers: the checkpoint is complete (saved and finished above)
            write_marker(self.out, self.step, self.total_steps, where, self.control.signal_name)
        barrier(env)  # no rank exits 75 before the marker exists (torchrun stops the others on the first exit)
        return Preempted(msg)

    def finish(self) -> RunResult:
        """The budget is spent: the last checkpoint into place, `final/` exported, the data report written."""
        env = self.env
        if self.saver is not None:
            self.saver.finish()
        self.sinks.stop()
        final_dir = export_final(self.model, self.config, self.out / "final", self.tokenizer_dir, env,
                                 self.side_files, self.adapters)
        # by shard: the ranks of a context- or tensor-parallel group read (and report) the same shards
        reports = sorted({r["shard"]: r for rank in gather_objects(self.batches.report(), env) for r in rank}.values(),
                         key=lambda r: r["shard"])
        if env.is_main:  # every data shard of every rank, in shard order
            (self.out / "data_report.json").write_text(json.dumps(reports, indent=1))
            self.sinks.finish()
        barrier(env)  # no rank tears the process group down while another still talks (gloo aborts on a closed peer)
        return RunResult(self.out, final_dir, self.step, self.sinks.losses)


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
                        pixels=tuple(side["pixels"]) if side.get("pixels") else None, tokenizer_from=tokenizer_dir,
                        **({"system": side["system"]} if "system" in side else {}))  # its template's default
        if adapters is not None:
            adapters.write(adapted, config, out)
    barrier(env)
    return out if env.is_main else None
