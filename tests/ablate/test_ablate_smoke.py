"""`mindvl ablate all` wired end to end at the smallest scale (one seed, 6 steps per stage, 3 items per benchmark):
the report's structure, that every variant trained (its loss fell), that each stage trains what it should (the
warm-up from the pretrained tower), and that an interrupted ablation resumes where it stopped. Not the verdicts: one
seed and six steps decide nothing."""

from __future__ import annotations

import json

import pytest
import torch
from ablate_helpers import small_recipes

from mindvl.ablate import run_ablation
from mindvl.ablate.plan import ABLATIONS, CLAIMS, MERGES, STAGES, TOWER_FROM, TOWER_SEED, Scale, stages_for
from mindvl.checkpoint.safetensors_io import TensorFolder

STEPS = 6
SMOKE = Scale({name: STEPS for name in ("text.yaml", "warmup.yaml", "pretrain.yaml", "multitask.yaml", "sft.yaml")},
              bench_items=3, grid="4,8:16,64")


def tensors(folder):
    return dict(TensorFolder(folder).iter_tensors())


@pytest.mark.slow
def test_ablate_all_smoke_and_resume(tmp_path):
    out, recipes = tmp_path / "ablate", small_recipes(tmp_path / "recipes")
    analysis = run_ablation(list(ABLATIONS), 1, out, SMOKE, recipes, verdicts=False, log=lambda line: None)

    # Structure: a section per claim with every variant's metrics and every claimed comparison, plots, JSON.
    report = (out / "report.md").read_text()
    for name in ABLATIONS:
        assert f"## {name}: no verdict" in report
        claim = analysis["claims"][name]
        assert list(claim["variants"]) == list(CLAIMS[name].variants)
        assert len(claim["comparisons"]) == len(CLAIMS[name].comparisons)
        for c in claim["comparisons"]:
            assert c["verdict"] is None and c["seed_ci"]["n"] == 1
        assert (out / f"{name}.png").stat().st_size > 0
    # Claim 2's grid covers the charts and forms (every setting) and not the digit strips (read at one size only).
    for v in analysis["claims"]["resolution"]["variants"].values():
        assert set(v["grid"]) == set(v["settings"]) == {"chartqa", "docvqa"}
        assert len(v["settings"]["docvqa"]) == len(v["settings"]["chartqa"]) == 4
    for bench in ("chartqa", "docvqa"):
        assert (out / f"resolution_boxplot_{bench}.png").stat().st_size > 0
    assert not (out / "resolution_boxplot_ocrbench.png").exists()
    assert json.loads((out / "ablation.json").read_text())["claims"].keys() == set(ABLATIONS)

    # Every variant trained: each stage ran its steps from its parent, at this seed, and its loss fell.
    seed0 = out / "seed0"
    assert set(analysis["training"]) == set(STAGES)
    for name, stage in STAGES.items():
        t = analysis["training"][name]
        assert t["steps"] == STEPS and t["last_loss"][0] < t["first_loss"][0], name
        recipe = json.loads((seed0 / name / "recipe.json").read_text())
        parent = None if stage.parent is None else str(seed0 / stage.parent) if stage.parent in MERGES else str(
            seed0 / stage.parent / "final")
        assert recipe["model"]["init_from"] == parent and recipe["data"]["seed"] == 0, name
    # The warm-up starts from the base LLM with the pretrained tower (trained once, at its own seed) transplanted in.
    start, text, tower = (tensors(seed0 / "start"), tensors(seed0 / "text" / "final"),
                          tensors(out / "tower" / f"seed{TOWER_SEED}" / TOWER_FROM / "final"))
    assert all(torch.equal(start[k], tower[k] if k.startswith("visual.") else text[k]) for k in text)
    assert any(not torch.equal(text[k], tower[k]) for k in text if k.startswith("visual."))
    # The 4-phase pretrain trains ViT + projector and leaves the language model as the warm-up left it.
    warm, pre = tensors(seed0 / "warmup" / "final"), tensors(seed0 / "4phase-pretrain" / "final")
    lm = [k for k in warm if k.startswith("language_model.")]
    vit = [k for k in warm if k.startswith("visual.")]
    assert lm and vit and all(torch.equal(warm[k], pre[k]) for k in lm)
    assert any(not torch.equal(warm[k], pre[k]) for k in vit)
    # The LM merge averages the 4K SFT model's language model with the base LLM's and keeps its vision tower.
    sft, base = tensors(seed0 / "sft-1024" / "final"), tensors(seed0 / "text" / "final")
    lmm = tensors(seed0 / "lm-merged")
    for k in lm:
        torch.testing.assert_close(lmm[k], (sft[k] + base[k]) / 2, rtol=1e-6, atol=1e-7, msg=k)
    assert all(torch.equal(lmm[k], sft[k]) for k in vit)

    # Interrupted: the last stage lost its finished marker and the seed its results; a rerun retrains nothing else
    # (the stage resumes from its checkpoint) and reproduces the analysis.
    (seed0 / "4phase-sft" / "phase.json").unlink()
    (seed0 / "results.json").unlink()
    lines: list[str] = []
    again = run_ablation(list(ABLATIONS), 1, out, SMOKE, recipes, verdicts=False, log=lines.append)
    reused = [line.split(":")[0].strip() for line in lines if "reused" in line]
    assert sorted(reused) == sorted([*stages_for([TOWER_FROM]), *(set(STAGES) - {"4phase-sft"})])
    assert again["claims"] == analysis["claims"]
    # Another budget into the same folder is refused in one line rather than mixed with these runs.
    other = Scale({**SMOKE.steps, "sft.yaml": STEPS + 1}, SMOKE.bench_items, SMOKE.grid, tower=SMOKE.steps)
    with pytest.raises(ValueError, match="another budget"):
        run_ablation(["merge"], 1, out, other, recipes, verdicts=False, log=lambda line: None)
