"""Activation checkpointing of both towers (full and selective) leaves the gradients of a training step unchanged."""

from __future__ import annotations

import itertools

import pytest
import torch
from train_helpers import raw_recipe

from mindvl.config import ParallelSection, load_recipe
from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.train.materialize import build_model
from mindvl.train.parallel import ParallelEnv, parallelize
from mindvl.train.step import accumulate_gradients

ENV = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ac")
    recipe = load_recipe(raw=raw_recipe(tmp / "o", tmp / "cache"))
    tok = load_tokenizer()
    packs = [p.to_torch() for p in itertools.islice(build_loader(DataConfig.from_dict(recipe.data), tok), 2)]
    return recipe, tok, packs


def step_grads(recipe, tok, packs, mode: str) -> tuple[dict, torch.nn.Module]:
    cfg = ParallelSection(fsdp="off", mixed_precision="fp32", activation_checkpointing=mode)
    model = build_model(recipe, tok, ENV, lambda m: parallelize(m, ENV, cfg))
    accumulate_gradients(model, packs, ENV, model.config)
    return {n.replace("_checkpoint_wrapped_module.", ""): p.grad.clone() for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpointed_towers_give_the_same_gradients(setup, mode):
    recipe, tok, packs = setup
    reference, _ = step_grads(recipe, tok, packs, "off")
    grads, model = step_grads(recipe, tok, packs, mode)
    wrapped = [type(b).__name__ for b in (*model.visual.blocks, *model.language_model.layers)]
    assert wrapped and all(name == "CheckpointWrapper" for name in wrapped)  # both towers, every block
    assert set(grads) == set(reference)
    for name in reference:
        torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-7, msg=name)
