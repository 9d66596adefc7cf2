"""The one mapping -> dataclass converter (mindvl.typed) behind recipes, the data section, model configs and curate
pipelines: the same errors naming the full key path everywhere, and a typed `Recipe.data` whose recipe.json is the
section as written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from mindvl.config import load_recipe
from mindvl.curate.pipeline import PipelineConfig
from mindvl.data import DataConfig
from mindvl.models import MindVLConfig
from mindvl.train.seeding import data_section
from mindvl.typed import build


@dataclass
class Inner:
    k: int = 1
    xs: list[float] = field(default_factory=list)


@dataclass
class Outer:
    name: str = ""
    inner: Inner = field(default_factory=Inner)
    items: list[Inner] = field(default_factory=list)
    flag: bool | None = None


def test_build_converts_recursively_and_names_the_key_path():
    got = build(Outer, {"name": "a", "inner": {"k": 3, "xs": [1, 2.5]}, "items": [{}, {"k": 2}]}, "top")
    assert got == Outer("a", Inner(3, [1.0, 2.5]), [Inner(), Inner(2)])
    assert isinstance(got.inner.xs[0], float)
    assert build(Outer, None) == Outer() and build(Outer, got) is got
    for bad, message in [
        ({"inner": {"kk": 1}}, "top.inner.kk: unknown key (known: k, xs)"),
        ({"items": [{}, {"k": "2"}]}, "top.items[1].k: expected an integer, got '2'"),
        ({"inner": {"xs": [1, "x"]}}, "top.inner.xs[1]: expected a number, got 'x'"),
        ({"flag": 1}, "top.flag: expected true/false, got 1"),
        ({"inner": 3}, "top.inner: must be a mapping, got 3"),
    ]:
        with pytest.raises(ValueError) as err:
            build(Outer, bad, "top")
        assert str(err.value) == message


@pytest.mark.parametrize("make, message", [
    (lambda: load_recipe("tiny/warmup", ["data.sources=[{path: a.jsonl, colour: 1}]"]),
     "data.sources[0].colour: unknown key (known: name, paths, synth, format, ratio,"),
    (lambda: load_recipe("tiny/warmup", ["data.video.fpss=1"]), "data.video.fpss: unknown key (known: fps,"),
    (lambda: load_recipe("tiny/warmup", ["model.arch.txt={}"]), "model.arch.txt: unknown key (known: text, vision)"),
    (lambda: DataConfig.from_dict({"sources": ["a.jsonl"], "seq_lenn": 1}), "data.seq_lenn: unknown key (known: "),
    (lambda: MindVLConfig.from_dict({"text": {"vocab_sise": 1}}), "config.json: text.vocab_sise: unknown key (known: "),
    (lambda: PipelineConfig.from_dict({"inputs": ["a"], "output": "o", "stage": []}, "p.yaml"),
     "p.yaml: stage: unknown key (known: inputs, format,"),
    (lambda: PipelineConfig.from_dict({"inputs": ["a"], "output": "o", "engine": {"nme": "local"}}, "p.yaml"),
     "p.yaml: engine.nme: unknown key (known: name, workers, address)"),
])
def test_every_section_has_the_same_unknown_key_error(make, message):
    with pytest.raises(ValueError) as err:
        make()
    assert str(err.value).startswith(message), str(err.value)


def test_recipe_data_is_typed_and_recipe_json_keeps_the_section_as_written(tmp_path):
    recipe = load_recipe("tiny/warmup", ["seed=7", f"output_dir={tmp_path / 'run'}"])
    assert isinstance(recipe.data, DataConfig)
    assert recipe.data.seed == 7  # data order follows `seed` unless data.seed pins it
    assert recipe.data.sources[0].synth.tasks == ["digits_sized"] and recipe.data.default_system is None
    written = recipe.to_dict()
    # the section as the YAML file gives it: no defaults filled in, no inherited seed
    assert written["data"] == {
        "sources": [{"name": "digits", "synth": {"tasks": ["digits_sized"], "n": 4000, "seed": 0}, "ratio": 0.6},
                    {"name": "charts", "synth": {"tasks": ["minichart"], "n": 1000, "seed": 0}, "ratio": 0.2},
                    {"name": "docs", "synth": {"tasks": ["minidoc"], "n": 1000, "seed": 0}, "ratio": 0.2}],
        "seq_len": 1024, "max_pixels": 50176, "min_pixels": 3136, "pack_buffer": 64, "default_system": None}
    # an old run folder's recipe.json reads back to the same recipe and writes the same JSON
    again = load_recipe(raw=json.loads(json.dumps(written)))
    assert again.to_dict() == written and again.data == recipe.data
    pinned = load_recipe("tiny/warmup", ["seed=7", "data.seed=3"])
    assert pinned.data.seed == 3 and pinned.to_dict()["data"]["seed"] == 3


def test_data_section_is_a_copy_the_trainer_may_fill_in():
    recipe = load_recipe("tiny/warmup")
    cfg = data_section(recipe)
    cfg.video.tokens_per_second = 2  # what the trainer does once it knows the model
    assert recipe.data.video.tokens_per_second is None
    assert DataConfig.from_dict(cfg) == cfg and DataConfig.from_dict(cfg) is not cfg
