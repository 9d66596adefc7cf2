"""The quickstart's phases with a Qwen3-VL-shaped tower (`mindvl quickstart --family qwen3-vl`, the recipes in
mindvl/recipes/tiny-qwen3-vl) at the smallest budget: warm-up -> multitask -> SFT x 3 -> merge -> search/eval. The
data pipeline cuts 16-px patches (a 14-px row would not fit the tower's 1536-wide patch embedding), the loss falls
from the untrained warm-up to every SFT model, and evaluation and the resolution search size images in Qwen3-VL's
32 x 32 pixels per merged token."""

from __future__ import annotations

import json

from mindvl.cli.quickstart import FAMILY_RECIPES
from mindvl.data.processors import processing_from_folder
from mindvl.quickstart import SFT_VARIANTS, phase_specs, quickstart, recipe_dir


def test_qwen3_vl_quickstart_phases(tmp_path):
    out = tmp_path / "qs"
    tiny_data = "data.sources=[{name: d, synth: {tasks: [digits, chart], n: 24, seed: 0}}]"
    summary = quickstart(out, recipes=recipe_dir().parent / FAMILY_RECIPES["qwen3-vl"],
                         overrides=["max_steps=2", "logging.progress=false", "logging.tensorboard=false", tiny_data],
                         bench_items=2, grid="4:64", log=lambda line: None)
    phases = summary["phases"]
    assert list(phases) == ["warmup", "multitask", *SFT_VARIANTS]
    # Seeded run: the untrained warm-up starts at 6.54 and every SFT model ends below 5.7.
    assert all(phases[name]["last_loss"] < phases["warmup"]["first_loss"] - 0.5 for name in SFT_VARIANTS)
    for name in [*phases, "merged"]:
        folder = out / name / "final" if name != "merged" else out / "merged"
        p = processing_from_folder(folder)
        assert (p.family, p.patch_size, p.image_mean) == ("qwen3_vl", 16, (0.5, 0.5, 0.5)), name
        assert json.loads((folder / "config.json").read_text())["vision"]["patch_size"] == 16
    # Evaluation and search: min4_max64 is 4 .. 64 merged tokens of 32 x 32 pixels for every checkpoint.
    results = json.loads((out / "search" / "results.json").read_text())
    assert results["token_pixels"] == {label: 32 * 32 for label in ("untrained", *SFT_VARIANTS, "merged")}
    used = json.loads((out / "search" / "merged" / "ocrbench" / "min4_max64.jsonl.settings.json").read_text())
    assert (used["min_pixels"], used["max_pixels"]) == (4 * 1024, 64 * 1024)
    assert set(summary["evaluation"]["merged"]) == {"ocrbench", "chartqa", "docvqa"}
    # The SFT variants are 16/48/64 merged tokens of this tower's 32 x 32 pixels, as trained.
    for name, (_, tokens) in SFT_VARIANTS.items():
        assert json.loads((out / name / "recipe.json").read_text())["data"]["max_pixels"] == tokens * 32 * 32, name


def test_sft_variants_count_merged_tokens_of_each_family():
    for family, token_px in (("qwen2.5-vl", 28 * 28), ("qwen3-vl", 32 * 32)):
        folder = recipe_dir().parent / FAMILY_RECIPES[family] if FAMILY_RECIPES[family] else recipe_dir()
        sft = {name: extra for name, _, _, extra in phase_specs(folder) if name in SFT_VARIANTS}
        assert sft == {name: [f"data.seq_len={seq}", f"data.max_pixels={tokens * token_px}"]
                       for name, (seq, tokens) in SFT_VARIANTS.items()}, family
