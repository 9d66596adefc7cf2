"""`mindvl ablate --jobs N`: the synthetic sets are made once beforehand rather than raced by the workers. (Seeds
trained in parallel processes give the numbers of a one-process run: test_ablate_tower.py, whose module fixture is
that one-process run.)"""

from __future__ import annotations

import yaml
from ablate_helpers import small_recipes

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
