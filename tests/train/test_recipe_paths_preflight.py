"""Recipe paths (relative to the recipe file, packaged recipes by name, `mindvl train --list`) and the trainer's
preflight: the tokenizer default, a tokenizer that does not fit the model, a folder without weights, and an image
resolution left unset while the init model was trained at another one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from tiny_mindvl import tiny_model_folder
from tokenizers import Tokenizer, models, pre_tokenizers
from train_helpers import raw_recipe

from mindvl.cli import main
from mindvl.config import PACKAGED_RECIPES, load_recipe, packaged_recipes
from mindvl.data.tokenizer import SPECIAL_TOKENS, load_tokenizer
from mindvl.train.preflight import check_inputs, tokenizer_source
from mindvl.train.trainer import train

# ------------------------------------------------------------------------------------------------- recipe paths


def test_relative_inputs_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project" / "recipes"
    folder.mkdir(parents=True)
    raw = raw_recipe(Path("runs/o"), Path("cache"))
    raw["model"] = {"init_from": "../models/start"}
    raw["data"].update(tokenizer="tok", sources=[{"paths": ["data/a.jsonl", "/abs/b.jsonl"]}, "c/*.jsonl",
                                                 {"path": "d.tar"}])
    (folder / "r.yaml").write_text(yaml.safe_dump(raw))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    r = load_recipe(folder / "r.yaml", ["seed=3"])
    assert r.model.init_from == str(tmp_path / "project" / "models" / "start")
    assert r.data.tokenizer == str(folder / "tok")
    assert r.data.sources[0].paths == [str(folder / "data/a.jsonl"), "/abs/b.jsonl"]
    assert r.data.sources[1].paths == [str(folder / "c/*.jsonl")] and r.data.sources[2].paths == [str(folder / "d.tar")]
    assert r.data.seed == 3  # data order follows the recipe's seed unless data.seed pins it
    # recipe.json keeps the section as written (resolved paths, no defaults filled in)
    written = r.to_dict()["data"]
    assert written["sources"][1] == str(folder / "c/*.jsonl") and written["sources"][2]["path"] == str(folder / "d.tar")
    assert "seed" not in written and written["tokenizer"] == str(folder / "tok")
    # Outputs and command-line overrides stay relative to the working directory.
    assert (r.output_dir, r.data.synth_cache) == ("runs/o", "cache")
    assert load_recipe(folder / "r.yaml", ["init_from=here/m"]).model.init_from == "here/m"
    # compose folders resolve too
    raw["model"] = {"compose": {"vision": "v", "language": "/l"}}
    (folder / "c.yaml").write_text(yaml.safe_dump(raw))
    assert load_recipe(folder / "c.yaml").model.compose == {"vision": str(folder / "v"), "language": "/l"}


def test_packaged_recipes_by_name_from_any_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert {"tiny/warmup", "tiny/multitask", "tiny/sft"} <= set(packaged_recipes())
    want = load_recipe(PACKAGED_RECIPES / "tiny" / "warmup.yaml")
    for name in ("tiny/warmup", "tiny/warmup.yaml", "recipes/tiny/warmup.yaml"):
        assert load_recipe(name) == want
    with pytest.raises(FileNotFoundError, match=r"no packaged recipe 'tiny/nope'.*tiny/warmup"):
        load_recipe("tiny/nope")
    assert main(["train", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == packaged_recipes()
    assert main(["train"]) == 2 and "mindvl train --list" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ preflight


@pytest.fixture(scope="module")
def start(tmp_path_factory) -> Path:
    """A tiny mindvl folder on mindvl's default tokenizer, trained (per its processor config) at 3136..50176."""
    folder = tiny_model_folder(tmp_path_factory.mktemp("preflight") / "start")
    cfg = json.loads((folder / "preprocessor_config.json").read_text())
    cfg.update(min_pixels=3136, max_pixels=50176, size={"shortest_edge": 3136, "longest_edge": 50176})
    (folder / "preprocessor_config.json").write_text(json.dumps(cfg))
    return folder


def other_tokenizer(folder: Path) -> Path:
    """A tokenizer with Qwen's special tokens at other ids (0..13) than mindvl's default: not the model's."""
    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "[UNK]", "a", "b"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))
    return folder


def recipe_from(start: Path, tmp_path: Path, *overrides: str):
    raw = raw_recipe(tmp_path / "out", tmp_path / "cache")
    raw["model"] = {"init_from": str(start)}
    return load_recipe(raw=raw, overrides=list(overrides))


def test_tokenizer_defaults_to_the_model_folders(start, tmp_path):
    assert tokenizer_source(recipe_from(start, tmp_path)) == str(start)
    assert tokenizer_source(recipe_from(start, tmp_path, "data.tokenizer=/t")) == "/t"
    compose = load_recipe(raw={**raw_recipe(tmp_path / "o", tmp_path / "c"),
                               "model": {"compose": {"vision": "/v", "language": str(start)}}})
    assert tokenizer_source(compose) == str(start)
    assert tokenizer_source(load_recipe(raw=raw_recipe(tmp_path / "o", tmp_path / "c"))) is None  # arch: built-in
    check_inputs(recipe_from(start, tmp_path), load_tokenizer(start))  # the folder's own tokenizer fits


def test_a_tokenizer_that_is_not_the_models_fails_before_building(start, tmp_path):
    tok_dir = other_tokenizer(tmp_path / "other")
    recipe = recipe_from(start, tmp_path, f"data.tokenizer={tok_dir}")
    with pytest.raises(ValueError) as err:
        train(recipe)  # fails in the preflight: nothing is built, nothing is written
    message = str(err.value)
    assert "\n" not in message and str(tok_dir) in message and str(start / "config.json") in message
    assert "image_token_id: model" in message and "data.tokenizer" in message
    assert not (tmp_path / "out").exists()


def test_a_folder_without_weights_is_named(start, tmp_path, capsys):
    empty = tmp_path / "no-weights"
    empty.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(start / name, empty / name)
    with pytest.raises(FileNotFoundError, match=rf"{empty}: no model.safetensors"):
        check_inputs(recipe_from(empty, tmp_path), load_tokenizer(empty))
    assert main(["chat", str(empty), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{empty}: no model.safetensors" in err


def test_resolution_left_unset_while_the_model_was_trained_at_another(start, tmp_path):
    raw = raw_recipe(tmp_path / "out", tmp_path / "cache")
    raw["model"] = {"init_from": str(start)}
    del raw["data"]["min_pixels"], raw["data"]["max_pixels"]
    tok = load_tokenizer(start)
    with pytest.raises(ValueError) as err:
        check_inputs(load_recipe(raw=raw), tok)
    message = str(err.value)
    assert "\n" not in message and str(start / "preprocessor_config.json") in message
    assert "data.max_pixels is not set (default 1003520)" in message and "max_pixels 50176" in message
    # Set explicitly (any value: a new phase may change the resolution on purpose), the recipe wins.
    check_inputs(load_recipe(raw=raw, overrides=["data.min_pixels=3136", "data.max_pixels=200704"]), tok)


def test_a_processor_config_that_contradicts_itself(start, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(start, bad)
    cfg = json.loads((bad / "preprocessor_config.json").read_text())
    cfg["size"]["longest_edge"] = 100352
    (bad / "preprocessor_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"preprocessor_config.json: max_pixels 50176 disagrees with "
                                         r"size.longest_edge 100352"):
        check_inputs(recipe_from(bad, tmp_path), load_tokenizer(bad))
    # chat, eval and the lmms-eval adapter read the same file through the same reader
    assert main(["chat", str(bad), "--prompt", "hi", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{bad / 'preprocessor_config.json'}: max_pixels 50176 disagrees" in err


@pytest.mark.slow
def test_train_a_packaged_recipe_by_name_from_another_folder(tmp_path, monkeypatch, capsys):
    """`mindvl train tiny/warmup` outside the checkout; its final/ is a complete folder at the recipe's resolution."""
    monkeypatch.chdir(tmp_path)
    data = "data.sources=[{synth: {tasks: [digits], n: 6, seed: 0}}]"
    assert main(["train", "tiny/warmup", "max_steps=1", "output_dir=runs/w", f"data.synth_cache={tmp_path / 'c'}",
                 data, "logging.progress=false", "logging.tensorboard=false", "logging.plot=false"]) == 0
    final = tmp_path / "runs" / "w" / "final"
    assert f"final model: {Path('runs/w/final')}" in capsys.readouterr().out
    proc = json.loads((final / "preprocessor_config.json").read_text())
    assert (proc["min_pixels"], proc["max_pixels"]) == (3136, 50176)  # the tiny recipe's
    assert json.loads((final / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"
    assert (final / "generation_config.json").is_file() and (final / "chat_template.jinja").is_file()
