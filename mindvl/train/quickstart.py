"""The quickstart: the tiny recipe's three phases chained, each starting from the previous phase's `final` export
with a fresh optimizer (as the paper does), on synthetic data generated into `OUT/synth`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from mindvl.config import load_recipe

from .trainer import train

PHASE_FILES = ("warmup", "multitask", "sft")


def default_recipe_dir() -> Path:
    """The tiny recipes, shipped inside the package (`recipes/tiny` of a checkout links to them)."""
    return Path(__file__).resolve().parents[1] / "recipes" / "tiny"


def quickstart(out: str | Path, recipe_dir: str | Path | None = None, overrides: list[str] | None = None) -> dict:
    out = Path(out)
    recipe_dir = Path(recipe_dir) if recipe_dir else default_recipe_dir()
    summary: dict = {"phases": []}
    start = time.perf_counter()
    previous = None
    for name in PHASE_FILES:
        path = recipe_dir / f"{name}.yaml"
        items = [f"output_dir={out / name}", f"data.synth_cache={out / 'synth'}", *(overrides or [])]
        if previous is not None:
            items.append(f"init_from={previous}")
        t0 = time.perf_counter()
        result = train(load_recipe(path, items))
        losses = result.losses
        summary["phases"].append({"phase": name, "steps": result.steps, "first_loss": losses[0],
                                  "last_loss": losses[-1], "seconds": round(time.perf_counter() - t0, 1),
                                  "final": str(result.final_dir)})
        previous = result.final_dir
    summary["seconds"] = round(time.perf_counter() - start, 1)
    (out / "quickstart.json").write_text(json.dumps(summary, indent=1))
    for p in summary["phases"]:
        print(f"{p['phase']:>9}: loss {p['first_loss']:.3f} -> {p['last_loss']:.3f} in {p['steps']} steps "
              f"({p['seconds']} s); model in {p['final']}")
    print(f"quickstart done in {summary['seconds']} s")
    return summary
