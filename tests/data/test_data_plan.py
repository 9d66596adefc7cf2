"""`mindvl data plan`: the recipes reproduce the paper's data tables (appendix B), and a plan on local files
measures tokens, vision share and epochs as computed by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from data_helpers import png_bytes, qa, write_jsonl

from mindvl.cli import main
from mindvl.data import DataConfig
from mindvl.data.plan import PHASE_TABLES, paper_rows, paper_subtotals, plan_recipe

RECIPES = Path(__file__).resolve().parents[2] / "recipes" / "mindvl-8b"

# Table 11 rows copied by hand from the paper (seed 002, appendix B.1): dataset -> (category, percent).
TABLE_11_SAMPLE = {
    "Caption-CN-Rawcaption": ("Caption", 21.92), "Caption-EN-Recaption": ("Caption", 16.90),
    "HiVision": ("Caption", 0.30), "UMG-en": ("Grounding", 6.97), "GRIT-en": ("Grounding", 1.39),
    "WuKong-Text-zh": ("OCR", 5.49), "Scene-Text": ("OCR", 0.09), "PubTables-zh": ("Table&Chart", 0.02),
    "STEM-Shuffle": ("STEM", 0.16), "Screen-Navi-zh": ("GUI", 0.02),
}
TABLE_11_SUBTOTALS = {"Caption": 55.81, "Grounding": 16.45, "OCR": 16.16, "Table&Chart": 2.06, "STEM": 0.90,
                      "GUI": 0.14}


def _recipe(name: str) -> dict:
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())


def test_warmup_plan_reproduces_table_11(capsys):
    assert main(["data", "plan", str(RECIPES / "warmup.yaml"), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["phase"] == "warmup" and plan["budget_tokens"] == 256_000_000_000
    shares = {s["name"]: s for s in plan["sources"]}
    for name, (category, percent) in TABLE_11_SAMPLE.items():
        assert shares[name]["category"] == category
        assert round(shares[name]["share"], 2) == percent, name
    rows = paper_rows("warmup")
    assert len(rows) == 37 and {r.dataset for r in rows} | {"Unattributed"} == set(shares)
    for r in rows:  # every dataset's share of the mixture is its published percentage, to 0.01
        assert round(shares[r.dataset]["share"], 2) == r.percent, r.dataset
    assert plan["differences"]["percent"] == []
    # Category subtotals: equal to the published ones where the paper's rows add up to them. Caption's rows add
    # up to 21.92 + 16.90 + 6.93 + 5.91 + 4.17 + 0.30 = 56.13 (published 55.81), OCR's to 16.24 (16.16), and
    # Table&Chart's to 2.07 (2.06): the plan reports these as the paper's own inconsistencies.
    assert paper_subtotals("warmup") == TABLE_11_SUBTOTALS
    subtotals = {c: round(v["share"], 2) for c, v in plan["categories"].items()}
    assert subtotals == {"Caption": 56.13, "Grounding": 16.45, "OCR": 16.24, "Table&Chart": 2.07, "STEM": 0.90,
                         "GUI": 0.14, "Unattributed": 8.07}
    assert {d["category"]: (d["paper"], d["paper_rows_sum"]) for d in plan["differences"]["subtotals"]} == {
        "Caption": (55.81, 56.13), "OCR": (16.16, 16.24), "Table&Chart": (2.06, 2.07)}
    # Tokens over the 256B budget follow the shares when no file is local (equal sample length assumed).
    assert plan["tokens_assumed_equal_per_sample"]
    assert shares["Caption-CN-Rawcaption"]["tokens"] == pytest.approx(256e9 * 0.2192, rel=1e-9)


@pytest.mark.parametrize("recipe", ["multitask", "sft-2k", "sft-4k", "sft-8k"])
def test_other_recipes_name_every_dataset_of_their_tables(recipe):
    raw = _recipe(recipe)
    cfg = DataConfig.from_dict(raw["data"])
    phase = raw["phase"]["name"]
    rows = [r for t in PHASE_TABLES[phase] for r in paper_rows(t)]
    names = [s.name for s in cfg.sources]
    assert {r.dataset for r in rows} <= set(names)
    plan = plan_recipe(raw, recipe)
    assert plan["differences"]["missing_from_recipe"] == []
    if phase == "multitask":
        # Each table's datasets renormalised among themselves give the published percentages.
        assert plan["differences"]["percent"] == []
        assert plan["differences"]["not_in_paper"] == ["Web2Code"]
        cats = {c: round(v["share"], 2) for c, v in plan["categories"].items()}
        assert cats == {"Interleaved": 35.2, "Instruction": 44.69, "Text": 20.0, "Web2code": 0.11}
    else:
        # The SFT table's published percentages add up to 100.48%: each share is its percentage / 1.004839.
        assert sum(s.ratio for s in cfg.sources) == pytest.approx(100.4839)
        lang = sum(s["share"] for s in plan["sources"] if s["category"] == "Language")
        assert lang == pytest.approx(100 * 36.0840 / 100.4839, abs=1e-3)


def test_plan_measures_local_sources(tmp_path, tok):
    (tmp_path / "a.png").write_bytes(png_bytes(56, 56))  # with the pixel bounds below: grid (1, 4, 4) -> 4 pads
    write_jsonl(tmp_path / "img.jsonl", [qa("<image>What?", "Noise.", images=["a.png"])] * 3)
    write_jsonl(tmp_path / "txt.jsonl", [{"text": "plain text"}] * 5 + [{"text": ""}])
    raw = {"phase": {"name": "custom"}, "budget": {"max_tokens": 1_000_000},
           "data": {"sources": [{"name": "img", "path": str(tmp_path / "img.jsonl"), "ratio": 3, "category": "A"},
                                {"name": "txt", "path": str(tmp_path / "txt.jsonl"), "ratio": 1, "category": "B"},
                                {"name": "away", "path": str(tmp_path / "none/*.jsonl"), "ratio": 1}],
                    "min_pixels": 56 * 56, "max_pixels": 56 * 56}}
    plan = plan_recipe(raw, "local", tokenizer=tok)
    img, txt, away = plan["sources"]
    from mindvl.data.template import encode_conversation, encode_document

    n_img = len(encode_conversation(tok, [*map(_msg, qa("<image>What?", "Noise.")["messages"])], [(1, 4, 4)]).input_ids)
    n_txt = len(encode_document(tok, "plain text", []).input_ids)
    assert (img["tokens_per_sample"], img["vision_per_sample"], img["local_records"]) == (n_img, 4, 3)
    assert (txt["tokens_per_sample"], txt["local_records"], txt["skipped"]) == (n_txt, 6, {"empty_document": 1})
    assert away["local_records"] is None and away["tokens_per_sample"] is None
    mean = (n_img + n_txt) / 2  # the unmeasured source takes the mean of the measured ones
    weights = [60 * n_img, 20 * n_txt, 20 * mean]
    assert img["tokens"] == pytest.approx(1e6 * weights[0] / sum(weights))
    assert img["epochs"] == pytest.approx(img["tokens"] / n_img / 3)
    assert txt["epochs"] == pytest.approx(txt["tokens"] / n_txt / 6)
    vision = img["tokens"] * 4 / n_img
    assert plan["vision_token_share"] == pytest.approx(100 * vision / (img["tokens"] + txt["tokens"]))


def _msg(m):
    from mindvl.data.schema import Message

    return Message(m["role"], m["content"])


def test_plan_text_output(capsys):
    assert main(["data", "plan", str(RECIPES / "warmup.yaml")]) == 0
    out = capsys.readouterr().out
    assert "phase warmup  budget 256.00B tokens" in out
    row = next(line for line in out.splitlines() if line.startswith("Caption-CN-Rawcaption"))
    assert row.split()[1:5] == ["Caption", "21.9200", "21.92", "56.12B"]  # share, paper, 256B x 21.92%
    assert "subtotal Caption: plan 56.13% vs paper 55.81% (the paper's own rows add up to 56.13%)" in out
    assert "in the recipe, not in the paper's tables: Unattributed" in out
    assert main(["data", "plan", "nowhere.yaml"]) == 2


def test_a_step_recipe_reports_its_own_budget_and_no_paper_comparison(capsys):
    tiny = RECIPES.parent / "tiny" / "warmup.yaml"
    raw = yaml.safe_load(tiny.read_text())
    steps, batch, seq = raw["budget"]["max_steps"], raw["batch"]["global_batch_size"], raw["data"]["seq_len"]
    assert main(["data", "plan", str(tiny), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["budget_tokens"] == steps * batch * seq == 60 * 1 * 1024  # not the paper's 256B
    assert plan["budget_from_recipe"] and not plan["paper_recipe"]
    assert plan["differences"] == {"percent": [], "subtotals": [], "missing_from_recipe": [], "not_in_paper": []}
    assert sum(s["tokens"] for s in plan["sources"]) == pytest.approx(61440)
    assert main(["data", "plan", str(tiny)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (f"recipe {tiny}  phase warmup  budget 61.44K tokens (budget.max_steps 60 x "
                                   "batch.global_batch_size 1 x data.seq_len 1024, packed slots)")
    assert "256.00B" not in out and "subtotal Caption" not in out and "in the paper, not in the recipe" not in out
    assert "not compared: none of the recipe's sources is a dataset of the paper's warmup tables" in out

    # A paper recipe is still compared, and a token budget other than the paper's says so.
    raw = _recipe("warmup")
    raw["budget"] = {"max_tokens": 1_000_000}
    plan = plan_recipe(raw, "w.yaml")
    assert plan["paper_recipe"] and plan["budget_tokens"] == 1_000_000 and plan["differences"]["subtotals"]
    from mindvl.data.plan import format_plan

    assert format_plan(plan).splitlines()[0] == "recipe w.yaml  phase warmup  budget 1.00M tokens (paper: 256.00B)"
