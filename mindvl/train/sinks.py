"""Where training metrics go: metrics.jsonl (rank 0), TensorBoard when installed, a progress bar or plain lines,
and the loss-curve PNG at the end. The trainer hands each step's record to `MetricSinks.log`."""

from __future__ import annotations

import json
from pathlib import Path

from mindvl.config import Recipe

from .parallel import ParallelEnv


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
