"""`mindvl ablate --jobs N`: seeds trained in parallel processes give the numbers a one-process run gives (the
reference), and the synthetic sets are made once beforehand rather than raced by the workers."""

from __future__ import annotations

import pytest
import yaml
from ablate_helpers import small_recipes

from mindvl.ablate import run_ablation
from mindvl.ablate.plan import STAGES, Scale, labels_for, stages_for
from mindvl.ablate.runner import prepare_synth
from mindvl.cli import main

TWO = Scale({name: 2 for name in ("text.yaml", "warmup.yaml", "pretrain.yaml", "multitask.yaml", "sft.yaml")},
            bench_items=2, grid="4:64")


def test_jobs_below_one_is_one_line(tmp_path, capsys):
    assert main(["ablate", "merge", "--jobs", "0", "--out", str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--jobs 0" in err


def test_prepare_synth_makes_every_set_the_stages_read(tmp_path):
    recipes = small_recipes(tmp_path / "recipes")
    prepare_synth(["lm-merge"], tmp_path / "out", recipes, TWO, [], log=lambda line: None)
    made = sorted(p.name for p in (tmp_path / "out" / "synth").iterdir() if not p.name.startswith("."))
    expected = set()
    for name in stages_for(labels_for(["lm-merge"])):
        for s in yaml.safe_load((recipes / STAGES[name].recipe).read_text())["data"]["sources"]:
            expected.add(f"{'-'.join(s['synth']['tasks'])}_n40_s{s['synth']['seed']}")
    assert sorted({m.rsplit('_v', 1)[0] for m in made}) == sorted(expected)


@pytest.mark.slow
def test_parallel_seeds_match_one_process(tmp_path):
    recipes = small_recipes(tmp_path / "recipes")
    # lm-merge's chain (text, warm-up, multitask, one SFT) is the shortest that has every kind of stage: a trained
    # one from seeded init, trained ones from a parent, and a merge.
    one = run_ablation(["lm-merge"], 2, tmp_path / "one", TWO, recipes, verdicts=False, log=lambda line: None)
    two = run_ablation(["lm-merge"], 2, tmp_path / "two", TWO, recipes, verdicts=False, log=lambda line: None,
                       jobs=2)
    assert two["claims"]["lm-merge"]["seeds"] == [0, 1]
    assert set(one["training"]) == {"text", "warmup", "multitask", "sft-1024"}
    for stage, t in one["training"].items():
        assert two["training"][stage]["steps"] == t["steps"]
        # Another thread count may reorder float sums, nothing more: the same data, init and steps per seed.
        assert two["training"][stage]["first_loss"] == pytest.approx(t["first_loss"], rel=1e-4), stage
        assert two["training"][stage]["last_loss"] == pytest.approx(t["last_loss"], rel=1e-3), stage
