"""Activation checkpointing of both towers (full and selective) leaves the gradients of a training step unchanged."""

from __future__ import annotations

import pytest
import torch
from train_helpers import CPU_ENV, recipe_and_packs

from mindvl.config import ParallelSection
from mindvl.train.materialize import build_model
from mindvl.train.parallel import parallelize
from mindvl.train.step import accumulate_gradients

ENV = CPU_ENV


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return recipe_and_packs(tmp_path_factory.mktemp("ac"))


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
