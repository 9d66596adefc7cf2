"""The training loop: one readable function, `train(recipe)`.

    step:  stream `accum` micro-batches (one packed row each, a 2-pack prefetch window) -> forward
           -> (loss_sum * world).backward; scale gradients by 1/N_global; clip; AdamW; LR schedule; log; checkpoint.

Loss normalisation (paper: the mean over all labelled tokens of the global batch): see mindvl.train.step. Each
pack's labelled-target count is read from its labels as it arrives, the counts are all-reduced once per step to
N_global, and the accumulated gradients are divided by it before clipping: exactly d(sum of all loss_sums)/N_global,
whatever the split of tokens between micro-batches and ranks, without holding the step's packs.

Data shards: the stream is split into `batch.data_shards` shards (default: the world size); rank r reads shards
r, r + world, ... round-robin over its micro-batches. With data_shards=2 one process consumes exactly the global batch
that two ranks would, which is how the distributed test compares 1 vs 2 processes.
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
    full_model_state,
    load_checkpoint,
    read_latest,
    resolve_checkpoint,
    save_checkpoint,
)
from mindvl.config import Recipe
from mindvl.data import DataConfig, build_loader
from mindvl.models import MindVL, MindVLConfig
from mindvl.models.moe import update_router_bias

from .materialize import build_model
from .metrics import device_peak_flops
from .optim import build_optimizer, build_scheduler
from .parallel import (
    ParallelEnv,
    all_reduce_sum,
    barrier,
    destroy,
    init_distributed,
    parallelize,
    param_dtype,
)
from .phases import apply_phase
from .plan_headline import PlannerHeadline
from .preflight import preflight
from .step import (  # noqa: F401  (accumulate_gradients, labelled_targets, to_device, StepStats: public names here)
    MicroBatchStream,
    StepStats,
    accumulate_gradients,
    labelled_targets,
    optimizer_step,
    to_device,
)


@dataclass
class RunResult:
    output_dir: Path
    final_dir: Path | None
    steps: int
    losses: list[float]


# -------------------------------------------------------------------------------------------------------- data


class ShardedBatches:
    """This rank's micro-batches: round-robin over its data shards (see the module docstring)."""

    def __init__(self, data_cfg: DataConfig, tok, env: ParallelEnv, shards: int):
        self.shard_ids = list(range(env.rank, shards, env.world_size))
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

    def report(self) -> list[dict]:
        return [ld.report() for ld in self.loaders]


# ---------------------------------------------------------------------------------------------------- the loop


def plan_steps(recipe: Recipe, seq_len: int) -> int:
    if recipe.budget.max_steps is not None:
        return recipe.budget.max_steps
    return math.ceil(recipe.budget.max_tokens / (recipe.batch.global_batch_size * seq_len))


def train(recipe: Recipe) -> RunResult:
    env = init_distributed(recipe.parallel.device)
    try:
        return _train(recipe, env)
    finally:
        destroy(env)


def _train(recipe: Recipe, env: ParallelEnv) -> RunResult:
    out = Path(recipe.output_dir)
    ckpt_root = out / "checkpoints"
    torch.manual_seed(recipe.seed + env.rank)
    data_cfg = DataConfig.from_dict(recipe.data)
    # data.tokenizer, else the init/compose model's own; checked against the model before anything is built
    tok, tokenizer_dir, side_files = preflight(recipe, data_cfg)

    shards = recipe.batch.data_shards or env.world_size
    gb = recipe.batch.global_batch_size
    if shards % env.world_size or gb % shards:
        raise ValueError(f"batch: global_batch_size ({gb}) must be a multiple of data_shards ({shards}), which must be "
                         f"a multiple of the world size ({env.world_size})")
    accum = gb // env.world_size
    if recipe.batch.gradient_accumulation not in (None, accum):
        raise ValueError(f"batch.gradient_accumulation: {recipe.batch.gradient_accumulation} does not match "
                         f"global_batch_size / world size = {accum}")
    total_steps = plan_steps(recipe, data_cfg.seq_len)

    trainable: dict[str, int] = {}

    def prepare(meta_model):  # on the meta device: freeze, then checkpointing/compile/FSDP, before any allocation
        trainable.update(apply_phase(meta_model, recipe.trainable_modules))
        return parallelize(meta_model, env, recipe.parallel)

    headline = PlannerHeadline(recipe, env, out)  # accelerators: `mindvl plan` in a child process, printed when ready
    model = build_model(recipe, tok, env, prepare)
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
    ckpt = None
    if resume == "auto":
        ckpt = read_latest(ckpt_root)
    elif resume:
        ckpt = resolve_checkpoint(resume)
    if ckpt is not None:
        train_state, rank_state = load_checkpoint(ckpt, model, optimizer)
        scheduler.load_state_dict(train_state["scheduler"])
        batches.load_state_dict(rank_state["data"])
        step, tokens_seen = train_state["step"], train_state["tokens"]

    sinks = MetricSinks(out, recipe, env, resume_step=step if ckpt is not None else 0)
    peak, peak_how = device_peak_flops(env.device, param_dtype(recipe.parallel, env.device))
    if env.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        sinks.info(f"phase {recipe.phase.name}: {total_steps} steps x {gb} packs of {data_cfg.seq_len} tokens; "
                   f"{env.world_size} rank(s) on {env.device.type}; trainable {trainable} of {n_params:,} params; "
                   f"peak {peak / 1e12:.2f} TFLOP/s ({peak_how})" + (f"; resumed from {ckpt.name}" if ckpt else ""))

    def train_state() -> dict:
        return {"tokens": tokens_seen, "scheduler": scheduler.state_dict(), "model_config": config.to_dict(),
                "tokenizer_dir": tokenizer_dir, "side_files": side_files, "phase": recipe.phase.name,
                "total_steps": total_steps,
                "recipe": recipe.to_dict()}

    balance_routers = (config.text.is_moe and "language_model" in recipe.trainable_modules
                       and recipe.optim.router_bias_rate > 0)
    every = recipe.checkpoint.every
    sinks.start(step, total_steps)
    while step < total_steps and (recipe.budget.max_tokens is None or tokens_seen < recipe.budget.max_tokens):
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        micro = MicroBatchStream(batches.next, accum, env.device)  # a small prefetch window, not the whole step
        stats = optimizer_step(model, optimizer, micro, env, config, recipe.trainable_modules,
                               recipe.optim.grad_clip, recipe.parallel.grad_accumulation)
        counts, loss_total, t_data = stats.counts, stats.loss_sum, stats.data_s
        t_fwd, t_bwd, t_opt, grad_norm = stats.forward_s, stats.backward_s, stats.optimizer_s, stats.grad_norm
        n_global = max(1.0, float(counts[0]))
        scheduler.step()
        moe_violation = None
        if balance_routers:  # after the step, from the loads this step's forwards counted
            moe_violation = update_router_bias(model, recipe.optim.router_bias_rate,
                                               all_reduce=lambda loads: all_reduce_sum(loads, env))
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
        sinks.log(record, step % recipe.logging.every == 0 or step == total_steps)
        if (line := headline.poll()) is not None:
            sinks.info(line)
        done = step >= total_steps or (recipe.budget.max_tokens is not None and tokens_seen >= recipe.budget.max_tokens)
        if (every and step % every == 0) or done:
            save_checkpoint(ckpt_root, step, model, optimizer, train_state(), {"data": batches.state_dict()},
                            keep=recipe.checkpoint.keep)
    sinks.stop()

    final_dir = export_final(model, config, out / "final", tokenizer_dir, env, side_files)
    if env.is_main:
        (out / "data_report.json").write_text(json.dumps(batches.report(), indent=1))
        sinks.finish()
    return RunResult(out, final_dir, step, sinks.losses)


def export_final(model, config: MindVLConfig, out: Path, tokenizer_dir: str, env: ParallelEnv,
                 side_files: dict | None = None) -> Path | None:
    """Collective: gather the full weights and write `OUTPUT_DIR/final` (a MindVL.from_pretrained folder, with the
    side files of `side_files`: {"from": folders, "pixels": [min, max]}) on rank 0."""
    from mindvl.checkpoint import save_pretrained

    state = full_model_state(model)
    if env.is_main:
        with torch.device("meta"):
            plain = MindVL(config)
        plain.load_state_dict(state, assign=True)
        side = side_files or {}
        save_pretrained(plain, out, overwrite=True, side_files_from=side.get("from") or [],
                        pixels=tuple(side["pixels"]) if side.get("pixels") else None, tokenizer_from=tokenizer_dir)
    barrier(env)
    return out if env.is_main else None


# ----------------------------------------------------------------------------------------------- observability


class MetricSinks:
    """metrics.jsonl (rank 0), TensorBoard when installed, a rich progress bar, and the loss-curve PNG."""

    def __init__(self, out: Path, recipe: Recipe, env: ParallelEnv, resume_step: int):
        self.out, self.recipe, self.env = out, recipe, env
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.tb = None
        self.progress = None
        if not env.is_main:
            return
        out.mkdir(parents=True, exist_ok=True)
        (out / "recipe.json").write_text(json.dumps(recipe.to_dict(), indent=1))
        path = out / "metrics.jsonl"
        # A resumed run continues the file; lines a killed run wrote after its last checkpoint are dropped.
        kept = []
        if resume_step and path.is_file():
            for line in path.read_text().splitlines():
                if line.strip() and json.loads(line)["step"] <= resume_step:
                    kept.append(line)
                    rec = json.loads(line)
                    self.steps.append(rec["step"])
                    self.losses.append(rec["loss"])
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")
        if recipe.logging.tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
            except ImportError:  # tensorboard is optional (extra `plots`)
                self.tb = None

    def info(self, text: str) -> None:
        if self.env.is_main:
            print(text, flush=True)

    def start(self, step: int, total: int) -> None:
        if not (self.env.is_main and self.recipe.logging.progress):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.progress = Progress(TextColumn(f"[bold]{self.recipe.phase.name}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeRemainingColumn())
        self.task = self.progress.add_task("train", total=total, completed=step, stats="")
        self.progress.start()

    def log(self, rec: dict, show: bool) -> None:
        if not self.env.is_main:
            return
        self.steps.append(rec["step"])
        self.losses.append(rec["loss"])
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k in ("loss", "lr", "tokens_per_s", "mfu", "grad_norm", "moe_max_violation"):
                if rec.get(k) is not None:
                    self.tb.add_scalar(f"train/{k}", rec[k], rec["step"])
        stats = f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s mfu {rec['mfu']:.1%}"
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"], stats=stats)
        elif show:
            print(f"{self.recipe.phase.name} step {rec['step']}: {stats}", flush=True)

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.recipe.logging.plot and self.losses:
            plot_loss(self.steps, self.losses, self.out / "loss.png", self.recipe.phase.name)


def plot_loss(steps: list[int], losses: list[float], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # matplotlib is optional (extra `plots`)
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, losses)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per labelled token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
