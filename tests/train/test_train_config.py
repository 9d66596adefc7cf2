from __future__ import annotations

import re

import pytest
from train_helpers import raw_recipe

from mindvl.config import load_recipe
from mindvl.train.optim import lr_at


def test_overrides_and_aliases(tmp_path):
    raw = raw_recipe(tmp_path / "o", tmp_path / "c")
    r = load_recipe(raw=raw, overrides=["output_dir=/x", "max_steps=7", "checkpoint_every=3", "resume=auto",
                                        "optim.lr=2e-3", "optim.betas=[0.8, 0.9]"])
    assert (r.output_dir, r.budget.max_steps, r.checkpoint.every, r.checkpoint.resume) == ("/x", 7, 3, "auto")
    assert r.optim.lr == 2e-3 and r.optim.betas == [0.8, 0.9]
    r = load_recipe(raw=raw, overrides=["max_tokens=1000"])
    assert r.budget.max_tokens == 1000 and r.budget.max_steps is None


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "optim.lrr: unknown key"),
    ("max_steps=abc", "budget.max_steps: expected an integer"),
    ("logging.tensorboard=3", "logging.tensorboard: expected true/false"),
    ("phase.name=finetune", "phase.name: must be one of"),
    ("data.seq_len=-1", "data.seq_len: must be > 0"),
    ("schedule.decay=step", "schedule.decay: must be"),
    ("phase.trainable=[vision]", "phase.trainable: unknown module"),
    ("max_step=20", "max_step: unknown key; did you mean max_steps? (short names: output_dir, max_steps"),  # issue 43
    ("bugdet.max_steps=2", "bugdet: unknown key (known: output_dir, seed"),
])
def test_errors_name_the_key(tmp_path, override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_recipe(raw=raw_recipe(tmp_path / "o", tmp_path / "c"), overrides=[override])


def test_schedule_warmup_then_cosine_to_min():
    lrs = [lr_at(s, 100, 1e-3, 1e-5, 0.1, "cosine") for s in range(100)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] == pytest.approx(1e-5)
    lin = [lr_at(s, 11, 1.0, 0.0, 0.0, "linear") for s in range(11)]
    assert lin[0] == 1.0 and lin[-1] == 0.0 and lin[5] == pytest.approx(0.5)


@pytest.mark.parametrize("path", sorted(p for p in __import__("glob").glob("recipes/**/*.yaml", recursive=True)
                                         if not p.startswith("recipes/curation/")))  # curation pipelines: tests/curate
def test_shipped_recipes_validate(path):
    r = load_recipe(path)
    assert r.budget.max_steps or r.budget.max_tokens
