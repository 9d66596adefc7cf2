"""One path rule for `mindvl curate` and `mindvl train`: relative input paths written in a file resolve against the
file's folder, `output` and command-line paths against the working directory."""

from __future__ import annotations

import os

import yaml

from mindvl.config import load_recipe
from mindvl.curate import PipelineConfig


def write(path, data) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_file_paths_resolve_against_the_pipeline_file(tmp_path, monkeypatch):
    folder = tmp_path / "pipelines" / "mine"
    head = folder / "heads" / "h.pth"
    (folder / "models" / "clip").mkdir(parents=True)
    file = write(folder / "p.yaml", {
        "inputs": ["../corpus/*.jsonl", "/abs/x.jsonl"], "output": "curated/out",
        "stages": [{"embed": {"model": "thumbnail"}}, {"image_filter": {"min_side": 8}},
                   {"aesthetic_score": {"model": "models/clip", "head": "heads/h.pth", "min_score": 1}}]})
    monkeypatch.chdir(tmp_path)
    raw = yaml.safe_load(open(file))
    from mindvl.curate.pipeline import resolve_file_paths

    resolve_file_paths(raw, os.path.dirname(os.path.abspath(file)))
    assert raw["inputs"] == [str(tmp_path / "pipelines" / "corpus" / "*.jsonl"), "/abs/x.jsonl"]
    assert raw["output"] == "curated/out"  # an output: the working directory's
    assert raw["stages"][0]["embed"]["model"] == "thumbnail"  # a built-in, not a folder
    assert raw["stages"][2]["aesthetic_score"] == {"model": str(folder / "models" / "clip"), "head": str(head),
                                                    "min_score": 1}


def test_command_line_paths_stay_relative_to_the_working_directory(tmp_path, monkeypatch):
    file = write(tmp_path / "pipelines" / "p.yaml", {"inputs": ["corpus/*.jsonl"], "output": "out",
                                                     "stages": [{"image_filter": {"min_side": 8}}]})
    monkeypatch.chdir(tmp_path)
    from_file = PipelineConfig.load(file)
    assert from_file.inputs == [str(tmp_path / "pipelines" / "corpus" / "*.jsonl")] and from_file.output == "out"
    cli = PipelineConfig.load(file, {"inputs": ["here/*.jsonl"], "output": "there"})
    assert cli.inputs == ["here/*.jsonl"] and cli.output == "there"


def test_train_follows_the_same_rule(tmp_path, monkeypatch):
    """The same layout as a training recipe: data paths in the file are the file folder's, output_dir is not."""
    from mindvl.quickstart import recipe_dir

    raw = yaml.safe_load((recipe_dir() / "warmup.yaml").read_text())
    raw["output_dir"] = "runs/x"
    raw["data"]["sources"] = [{"name": "a", "paths": ["../corpus/*.jsonl"]}]
    file = write(tmp_path / "recipes" / "r.yaml", raw)
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(file, ["data.tokenizer=tok"])
    assert recipe.output_dir == "runs/x"
    assert recipe.data.sources[0].paths == [str(tmp_path / "corpus" / "*.jsonl")]
    assert recipe.data.tokenizer == "tok"  # a command-line override: the working directory's
