"""Evaluation during training: validation loss on held-out data, and optionally a small benchmark run.

Validation loss: every rank runs the same number of packs (`eval.batches`) of its data-parallel share of the
held-out stream, read from the start each time (the same packs at every evaluation, so the curve compares like with
like); the (loss sum, labelled targets) pair is summed over ranks: the mean loss per labelled token, as in
training. The model is switched to eval mode for it, which also keeps MoE routers from counting these tokens as
training load.

Benchmark: the full weights are gathered (collective) and rank 0 runs `mindvl.eval.runner.evaluate_benchmark` on the
first `eval.limit` items; predictions go to OUTPUT_DIR/eval/step_N/.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

from mindvl.checkpoint.training import full_model_state
from mindvl.config import Recipe
from mindvl.data import DataConfig, build_loader
from mindvl.models import MindVL, MindVLConfig
from mindvl.models.loss import IGNORE_INDEX, next_token_targets

from .agree import agreed_error
from .context_parallel import shard_labels
from .parallel import ParallelEnv, all_reduce_sum


class Evaluator:
    def __init__(self, recipe: Recipe, data_cfg: DataConfig, tok, env: ParallelEnv, out: Path):
        self.recipe, self.tok, self.env, self.out = recipe, tok, env, out
        self.eval_cfg = data_cfg.eval_config()
        self.data_cfg = data_cfg

    def due(self, step: int, done: bool) -> bool:
        every = self.recipe.eval.every
        return every is not None and (step % every == 0 or done)

    def run(self, model, config: MindVLConfig, step: int) -> dict[str, float]:
        """Collective. Metrics named `eval/...`."""
        metrics: dict[str, float] = {}
        if self.eval_cfg is not None:
            metrics["eval/val_loss"] = self.validation_loss(model)
        if self.recipe.eval.benchmark is not None:
            metrics.update(self.benchmark(model, config, step))
        return metrics

    @torch.no_grad()
    def validation_loss(self, model) -> float:
        env = self.env
        loader = build_loader(self.eval_cfg, self.tok, rank=env.layout.dp_rank, world_size=env.layout.dp_size)
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64)
        try:
            for pack in itertools.islice(loader, self.recipe.eval.batches):
                batch = {k: (v.to(env.device) if torch.is_tensor(v) else v) for k, v in pack.to_torch().items()}
                batch = shard_labels(batch, env.layout.cp, env.layout.cp_rank)  # context parallelism: own chunk
                loss_sum, _ = model(**batch)
                targets = (next_token_targets(batch["labels"], batch["cu_seqlens"]) != IGNORE_INDEX).sum()
                totals += torch.stack([loss_sum.detach().double().cpu(), targets.double().cpu()])
        finally:
            model.train(was_training)
        totals = all_reduce_sum(totals.to(env.device), env).cpu()
        return float(totals[0] / max(1.0, float(totals[1])))

    def benchmark(self, model, config: MindVLConfig, step: int) -> dict[str, float]:
        from mindvl.eval.runner import EvalSettings, evaluate_benchmark

        ev = self.recipe.eval
        state = full_model_state(model)  # collective: every rank takes part
        metrics: dict[str, float] = {}
        problem = None
        if self.env.is_main:
            try:
                with torch.device("meta"):
                    plain = MindVL(config)
                plain.load_state_dict(state, assign=True)
                plain.to(self.env.device).eval()
                settings = EvalSettings(min_pixels=self.data_cfg.min_pixels, max_pixels=self.data_cfg.max_pixels,
                                        system=self.data_cfg.default_system, limit=ev.limit,
                                        max_new_tokens=ev.max_new_tokens)
                predictions = self.out / "eval" / f"step_{step:08d}" / f"{ev.benchmark}.jsonl"
                # the processor the run trains with (data.processor, filled in from the model by the trainer)
                processing = self.data_cfg.vision_processing() if config.vision is not None else None
                summary = evaluate_benchmark(plain, self.tok, ev.benchmark, ev.benchmark_path, settings, predictions,
                                             processing=processing)
                metrics[f"eval/{ev.benchmark}/{summary['headline']}"] = float(summary[summary["headline"]])
                metrics[f"eval/{ev.benchmark}/exact_match"] = float(summary["exact_match"])
            except (ValueError, OSError) as exc:  # bad benchmark files: stop every rank with this message
                problem = f"eval.benchmark {ev.benchmark} at {ev.benchmark_path}: {exc}"
        problem = agreed_error(problem, self.env)  # collective: also the other ranks' wait for rank 0
        if problem is not None:
            raise ValueError(problem)
        return metrics
