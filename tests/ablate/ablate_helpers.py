"""Shared by the ablation tests: the tiny recipes shrunk for runs of a few steps."""

from __future__ import annotations

import yaml

from mindvl.quickstart import recipe_dir


def small_recipes(folder):
    """The tiny recipes with 40-sample synthetic sets and a log line every step, written to `folder` (the step
    counts come from the test's Scale)."""
    folder.mkdir()
    for path in recipe_dir().glob("*.yaml"):
        recipe = yaml.safe_load(path.read_text())
        for source in recipe["data"]["sources"]:
            source["synth"]["n"] = 40
        recipe["logging"] = {"every": 1, "progress": False, "tensorboard": False, "plot": False}
        (folder / path.name).write_text(yaml.safe_dump(recipe))
    return folder
