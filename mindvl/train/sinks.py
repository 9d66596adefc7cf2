"""Where training metrics go: metrics.jsonl (rank 0), TensorBoard when installed, optional Weights & Biases and
MLflow runs, on a terminal a rich progress bar and otherwise one plain flushed line every `logging.every` steps and
at least every 10 s (SLURM, torchrun and nohup logs are not terminals: a bar would print nothing there; a step
longer than that gets a "running" line from `mindvl.progress.Heartbeat`), and the loss-curve PNG at the end. The
trainer hands each step's record to `MetricSinks.log`.
"""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from pathlib import Path

from mindvl.config import Recipe
from mindvl.progress import EVERY_S, Heartbeat, quiet

from .parallel import ParallelEnv


class MetricSinks:
    """metrics.jsonl (rank 0), TensorBoard when installed, wandb/mlflow when enabled, a bar or plain lines, and the
    loss-curve PNG."""

    def __init__(self, out: Path, recipe: Recipe, env: ParallelEnv, resume_step: int):
        self.out, self.recipe, self.env = out, recipe, env
        self.losses: list[float] = []
        self.steps: list[int] = []
        self.tb = None
        self.progress = None
        self.heartbeat: Heartbeat | None = None
        self.remote: list[RemoteSink] = []
        self._t_start, self._step_start, self._total = time.perf_counter(), resume_step, 0
        self._step, self._last_line = resume_step, time.perf_counter()
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
        for enabled, make in ((recipe.logging.wandb, lambda: WandbSink(out, recipe, resume_step)),
                              (recipe.logging.mlflow, lambda: MlflowSink(recipe))):
            if enabled:
                self._add_remote(make)

    def _add_remote(self, make) -> None:
        """A metrics service that cannot be reached must not stop a long run (nor rank 0 alone): warn, go on."""
        try:
            self.remote.append(make())
        except ValueError:
            raise  # a missing extra (also refused when the recipe loads)
        except Exception as exc:  # noqa: BLE001 - any client or network failure
            warnings.warn(f"metrics service unavailable, continuing without it: {exc!r}", stacklevel=2)

    def info(self, text: str) -> None:
        if self.env.is_main:
            self._print(text)

    def _print(self, text: str) -> None:
        """A plain line; the heartbeat's clock restarts (its lines and these never interleave)."""
        self._last_line = time.perf_counter()
        if self.heartbeat is None:
            print(text, flush=True)
            return
        with self.heartbeat.lock:
            self.heartbeat.beat()
            print(text, flush=True)

    def _running_line(self) -> None:
        """The heartbeat's line while a step takes longer than EVERY_S (the first one compiles and warms up)."""
        self._last_line = time.perf_counter()
        print(f"{self.recipe.phase.name} step {self._step + 1}/{self._total or '?'} running, "
              f"{format_duration(self._last_line - self._t_start)} elapsed", flush=True)

    def start(self, step: int, total: int) -> None:
        self._t_start, self._step_start, self._total = time.perf_counter(), step, total
        self._step = step
        timed = self.env.is_main and self.recipe.logging.progress and not quiet()
        if timed and not sys.stdout.isatty():  # plain lines: one at least every EVERY_S, even inside a long step
            self.heartbeat = Heartbeat(self._running_line, EVERY_S).start()
        # The bar only on a terminal: elsewhere rich prints nothing per step, so plain lines are used instead.
        if not (timed and sys.stdout.isatty()):
            return
        from rich.progress import Progress

        self.progress = Progress(*bar_columns(self.recipe.phase.name, total))
        self.task = self.progress.add_task("train", total=total, completed=step, stats="")
        self.progress.start()

    def log(self, rec: dict, show: bool) -> None:
        if not self.env.is_main:
            return
        self.steps.append(rec["step"])
        self.losses.append(rec["loss"])
        self._step = rec["step"]
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        scalars = {k: float(v) for k, v in rec.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.tb is not None:
            for k, v in scalars.items():
                if k in TB_KEYS or k.startswith("eval/"):
                    self.tb.add_scalar(k if k.startswith("eval/") else f"train/{k}", v, rec["step"])
        for sink in list(self.remote):
            try:
                sink.log(scalars, rec["step"])
            except Exception as exc:  # noqa: BLE001 - the service went away: keep training, keep metrics.jsonl
                warnings.warn(f"{type(sink).__name__} failed, continuing without it: {exc!r}", stacklevel=2)
                self.remote.remove(sink)
        stats = f"loss {rec['loss']:.4f} lr {rec['lr']:.2e} {rec['tokens_per_s']:.0f} tok/s mfu {rec['mfu']:.1%}"
        if self.progress is not None:
            self.progress.update(self.task, completed=rec["step"], stats=stats)
            if rec.get("bad_step"):  # above the bar, so it stays visible
                self.progress.console.print(self.plain_line(rec))
        elif show or (self.heartbeat is not None and time.perf_counter() - self._last_line >= EVERY_S):
            self._print(self.plain_line(rec))

    def plain_line(self, rec: dict) -> str:
        """One log line: step/total, loss, lr, tokens/s, MFU, grad norm, ETA (and eval metrics when present)."""
        step = rec["step"]
        parts = [f"{self.recipe.phase.name} step {step}/{self._total or '?'}", f"loss {rec['loss']:.4f}",
                 f"lr {rec['lr']:.2e}", f"{rec['tokens_per_s']:.0f} tok/s", f"mfu {rec['mfu']:.1%}"]
        if rec.get("grad_norm") is not None:
            parts.append(f"grad_norm {rec['grad_norm']:.3g}")
        parts += [f"{k} {v:.4f}" for k, v in rec.items() if k.startswith("eval/") and isinstance(v, float)]
        if rec.get("bad_step"):
            parts.append("SKIPPED (non-finite)")
        done = step - self._step_start
        if self._total and done > 0:
            per_step = (time.perf_counter() - self._t_start) / done
            parts.append(f"eta {format_duration(per_step * max(0, self._total - step))}")
        return " | ".join(parts)

    def stop(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def finish(self) -> None:
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        for sink in self.remote:
            try:
                sink.close()
            except Exception as exc:  # noqa: BLE001
                warnings.warn(f"{type(sink).__name__} failed to close: {exc!r}", stacklevel=2)
        if self.recipe.logging.plot and self.losses:
            plot_loss(self.steps, self.losses, self.out / "loss.png", self.recipe.phase.name)


TB_KEYS = ("loss", "lr", "tokens_per_s", "mfu", "grad_norm", "moe_max_violation", "bad_steps")


def bar_columns(name: str, total: int) -> list:
    """The training bar's columns: phase, bar, step/total, ETA, then the stats. On a narrow terminal rich crops the
    last column, so the stats (the longest, least needed) come last and the step count and ETA never get cut."""
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.table import Column

    return [TextColumn(f"[bold]{name}", table_column=Column(no_wrap=True, min_width=len(name))),
            BarColumn(bar_width=20),
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=2 * len(str(total)) + 1)),
            TimeRemainingColumn(table_column=Column(no_wrap=True, min_width=7)),
            TextColumn("{task.fields[stats]}", table_column=Column(no_wrap=True, overflow="ellipsis"))]


def format_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class RemoteSink:
    """A metrics service (rank 0 only): `log(scalars, step)` and `close()`."""

    def log(self, scalars: dict[str, float], step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


def _import_extra(module: str, extra: str, key: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{key}: true needs the `{module}` package: pip install 'mindvl[{extra}]'") from None


class WandbSink(RemoteSink):
    """Weights & Biases: one run per output folder; a resumed run continues it (run id kept in OUTPUT_DIR)."""

    def __init__(self, out: Path, recipe: Recipe, resume_step: int):
        wandb = _import_extra("wandb", "wandb", "logging.wandb")
        id_file = out / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id)
        self.run = wandb.init(id=run_id, resume="allow", name=f"{out.name}-{recipe.phase.name}",
                              config=recipe.to_dict(), dir=str(out))

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self) -> None:
        self.run.finish()


class MlflowSink(RemoteSink):
    """MLflow: one run, parameters from the recipe, metrics per step."""

    def __init__(self, recipe: Recipe):
        self.mlflow = _import_extra("mlflow", "mlflow", "logging.mlflow")
        self.mlflow.start_run(run_name=f"{Path(recipe.output_dir).name}-{recipe.phase.name}")
        flat = {k: v for k, v in _flatten(recipe.to_dict()).items() if len(str(v)) < 500}
        self.mlflow.log_params(flat)

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "_"): v for k, v in scalars.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
