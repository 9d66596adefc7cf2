"""The pretrained vision tower of `mindvl ablate` (issue 29): one chain trained once, at its own seed and budget,
before any seed; every seed's warm-up starts from its base LLM with that tower transplanted in; a changed tower
budget, a tower that cannot read, or a run made with another tower is refused in one line rather than mixed in."""

from __future__ import annotations

import json

import pytest
import torch
from ablate_helpers import small_recipes

from mindvl.ablate import run_ablation
from mindvl.ablate.plan import STAGES, TOWER_FROM, TOWER_SEED, Scale, stages_for
from mindvl.checkpoint.safetensors_io import TensorFolder
from mindvl.cli import main

pytestmark = pytest.mark.slow  # ~3 min of short training runs: scheduled early in CI (conftest)

RECIPES = ("text.yaml", "warmup.yaml", "pretrain.yaml", "multitask.yaml", "sft.yaml")
# The seeds' stages take 2 steps, the tower's chain 3: which budget each stage ran shows in its step count.
TWO = Scale({name: 2 for name in RECIPES}, bench_items=2, grid="4:64", tower={name: 3 for name in RECIPES})


def tensors(folder):
    return dict(TensorFolder(folder).iter_tensors())


def quiet(line):
    pass


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """lm-merge (the shortest chain) over 2 seeds with the trained tower, and its log."""
    tmp = tmp_path_factory.mktemp("tower")
    recipes, out, lines = small_recipes(tmp / "recipes"), tmp / "out", []
    analysis = run_ablation(["lm-merge"], 2, out, TWO, recipes, verdicts=False, log=lines.append)
    return recipes, out, analysis, lines


def test_tower_is_trained_once_at_its_seed_and_budget(trained):
    recipes, out, analysis, lines = trained
    root = out / "tower" / f"seed{TOWER_SEED}"
    chain = stages_for([TOWER_FROM])
    assert chain == ["text", "warmup", "4phase-pretrain", "4phase-multitask", "4phase-sft"]
    for name in chain:
        recipe = json.loads((root / name / "recipe.json").read_text())
        assert recipe["budget"]["max_steps"] == 3 and recipe["seed"] == recipe["data"]["seed"] == TOWER_SEED, name
    # Its own chain starts from its own seeded text model: no tower of its own to take.
    assert json.loads((root / "warmup" / "recipe.json").read_text())["model"]["init_from"] == str(
        root / "text" / "final")
    info = json.loads((root / "tower.json").read_text())
    assert info["final"] == str(root / TOWER_FROM / "final") and set(info["reads"]) == {"chartqa", "docvqa"}
    assert analysis["config"]["vision"]["seed"] == TOWER_SEED
    # Trained once: each of its stages logs one training line, for 2 seeds.
    trained_lines = [line for line in lines if "in 3 steps" in line]
    assert len(trained_lines) == len(chain)
    # The report says where the towers came from, also when it is written from the finished seeds alone.
    said = f"Vision tower: pretrained, as the paper's: the tower of one `{TOWER_FROM}` chain at seed {TOWER_SEED}"
    assert said in (out / "report.md").read_text()
    again = run_ablation(["lm-merge"], 2, out, TWO, recipes, verdicts=False, log=quiet, report_only=True)
    assert again["config"]["vision"] == info and said in (out / "report.md").read_text()


def test_every_seed_starts_from_its_text_model_with_the_tower(trained):
    _, out, analysis, _ = trained
    tower = tensors(out / "tower" / f"seed{TOWER_SEED}" / TOWER_FROM / "final")
    starts = []
    for seed in (0, 1):
        root = out / f"seed{seed}"
        start, text = tensors(root / "start"), tensors(root / "text" / "final")
        assert all(torch.equal(start[k], tower[k] if k.startswith("visual.") else text[k]) for k in text), seed
        recipe = json.loads((root / "warmup" / "recipe.json").read_text())
        assert recipe["model"]["init_from"] == str(root / "start") and recipe["budget"]["max_steps"] == 2
        starts.append(start)
    # The seeds differ in their LLM and projector, not in the tower they start from.
    assert any(not torch.equal(starts[0][k], starts[1][k]) for k in starts[0] if k.startswith("projector."))
    assert analysis["training"].keys() == set(stages_for(["lm-merged"])) <= set(STAGES)


def test_parallel_seeds_match_one_process(tmp_path, trained):
    """`mindvl ablate --jobs 2`: seeds trained in parallel processes give the numbers of the one-process run of the
    same ablation and budget (the module's `trained` run: lm-merge over 2 seeds with the tower's chain). lm-merge's
    chain (text, warm-up, multitask, one SFT) is the shortest that has every kind of stage: a trained one from
    seeded init, trained ones from a parent, and a merge."""
    recipes, _, one, _ = trained
    two = run_ablation(["lm-merge"], 2, tmp_path / "two", TWO, recipes, verdicts=False, log=quiet, jobs=2)
    assert two["claims"]["lm-merge"]["seeds"] == [0, 1]
    assert set(one["training"]) == {"text", "warmup", "multitask", "sft-1024"}
    for stage, t in one["training"].items():
        assert two["training"][stage]["steps"] == t["steps"]
        # Another thread count may reorder float sums, nothing more: the same data, init and steps per seed.
        assert two["training"][stage]["first_loss"] == pytest.approx(t["first_loss"], rel=1e-4), stage
        assert two["training"][stage]["last_loss"] == pytest.approx(t["last_loss"], rel=1e-3), stage


def test_rerun_reuses_the_tower_and_a_changed_tower_budget_is_refused(trained):
    recipes, out, _, _ = trained
    lines: list[str] = []
    run_ablation(["lm-merge"], 2, out, TWO, recipes, verdicts=False, log=lines.append)
    assert not [line for line in lines if " steps (" in line]  # nothing trained again
    other = Scale(TWO.steps, TWO.bench_items, TWO.grid, tower={**TWO.tower, "sft.yaml": 4})
    with pytest.raises(ValueError, match="another recipe"):
        run_ablation(["lm-merge"], 2, out, other, recipes, verdicts=False, log=quiet)


def test_a_tower_that_cannot_read_stops_before_any_seed(tmp_path, trained):
    recipes, out, _, _ = trained
    strict = Scale(TWO.steps, TWO.bench_items, TWO.grid, tower=TWO.tower, tower_reads=0.5)
    with pytest.raises(ValueError) as err:  # reused chain, so only the check runs: 3 steps read nothing
        run_ablation(["lm-merge"], 3, out, strict, recipes, verdicts=False, log=quiet)
    assert "\n" not in str(err.value) and "--tower-seed" in str(err.value) and "under the 50%" in str(err.value)
    assert not (out / "seed2").exists()


def test_random_tower_starts_from_text_and_a_run_of_another_tower_is_refused(tmp_path, trained):
    recipes, trained_out, _, _ = trained
    out = tmp_path / "out"
    run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=quiet, vision="random")
    recipe = json.loads((out / "seed0" / "warmup" / "recipe.json").read_text())
    assert recipe["model"]["init_from"] == str(out / "seed0" / "text" / "final")
    assert not (out / "tower").exists() and not (out / "seed0" / "start").exists()
    assert "Vision tower: each seed's own seeded init" in (out / "report.md").read_text()
    again = run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=quiet, report_only=True)
    assert again["config"]["vision"] == "random"
    # A seed made before the pretrained tower existed (no `vision` in its budget) counts as random: reused as such,
    # refused under a trained tower.
    done = out / "seed0" / "results.json"
    result = json.loads(done.read_text())
    del result["budget"]["vision"]
    done.write_text(json.dumps(result))
    lines: list[str] = []
    run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=lines.append, vision="random")
    assert any("seed 0: reused" in line for line in lines)
    folder = trained_out / "tower" / f"seed{TOWER_SEED}" / TOWER_FROM / "final"
    with pytest.raises(ValueError, match="differs in vision"):
        run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=quiet, vision=str(folder))


def test_a_model_folder_as_the_tower(tmp_path, trained):
    recipes, trained_out, _, _ = trained
    folder = trained_out / "seed0" / "sft-1024" / "final"  # any model of the same vision architecture
    out = tmp_path / "out"
    analysis = run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=quiet, vision=str(folder))
    start, tower = tensors(out / "seed0" / "start"), tensors(folder)
    assert all(torch.equal(start[k], tower[k]) for k in start if k.startswith("visual."))
    assert analysis["config"]["vision"] == {"source": str(folder), "final": str(folder)}
    assert not (out / "tower").exists()
    # A report of the finished seeds alone names the same folder.
    again = run_ablation(["lm-merge"], 1, out, TWO, recipes, verdicts=False, log=quiet, report_only=True)
    assert again["config"]["vision"] == analysis["config"]["vision"]
    assert f"Vision tower: taken from `{folder}`" in (out / "report.md").read_text()
    # The folder of another run's trained tower brings that run's record (its seed, budget and what it reads).
    made = trained_out / "tower" / f"seed{TOWER_SEED}"
    other = run_ablation(["lm-merge"], 1, tmp_path / "other", TWO, recipes, verdicts=False, log=quiet,
                         vision=str(made / TOWER_FROM / "final"))
    assert other["config"]["vision"] == json.loads((made / "tower.json").read_text())


def test_cli_vision_tower_that_is_no_model_is_one_line(tmp_path, capsys):
    out = tmp_path / "a"
    assert main(["ablate", "merge", "--vision-tower", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--vision-tower" in err and "nowhere" in err
    assert not out.exists()


def test_overrides_reach_the_seeds_and_never_the_towers_chain(tmp_path, monkeypatch):
    """`mindvl ablate merge max_steps=40`: the tower's chain trains on its own recipes and budget (the override
    would starve it under its reading gate, refused only after the whole chain had trained); the seeds' runs take
    the override. Training is recorded, not run."""
    import mindvl.ablate.runner as runner

    calls = []

    class _Stop(Exception):
        pass

    def train_stages(names, root, seed, steps, recipes, cache, overrides, models, log=print):
        calls.append((root.parent.name, list(overrides)))
        if root.parent.name != "tower":
            raise _Stop  # the first seed's first training: enough seen
        for name in names:
            models[name] = root / name / "final"
        return {}

    monkeypatch.setattr(runner, "train_stages", train_stages)
    monkeypatch.setattr(runner, "_reads_pages", lambda model, out, benches: {"chartqa": 0.9, "docvqa": 0.9})
    monkeypatch.setattr(runner, "_benchmarks", lambda folder, n: {})
    monkeypatch.setattr(runner, "make_merge", lambda name, root, models, log=print: root / name)
    with pytest.raises(_Stop):
        run_ablation(["lm-merge"], 2, tmp_path / "out", TWO, small_recipes(tmp_path / "recipes"),
                     overrides=["max_steps=40"], verdicts=False, log=quiet)
    assert calls[0] == ("tower", []) and calls[1] == ("out", ["max_steps=40"]), calls
