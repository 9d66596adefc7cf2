"""Loss normalisation across micro-batches, and what a warm-up phase freezes."""

from __future__ import annotations

import pytest
import torch
from train_helpers import CPU_ENV, load_weights, raw_recipe, recipe_and_packs

from mindvl.config import load_recipe
from mindvl.train.materialize import build_model
from mindvl.train.optim import build_optimizer
from mindvl.train.phases import apply_phase
from mindvl.train.trainer import accumulate_gradients, labelled_targets, train

ENV = CPU_ENV


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return recipe_and_packs(tmp_path_factory.mktemp("step"))


def join(a: dict, b: dict) -> dict:
    """Two packed rows as one row: the single-batch reference."""
    n = a["input_ids"].shape[0]
    return {"input_ids": torch.cat([a["input_ids"], b["input_ids"]]), "labels": torch.cat([a["labels"], b["labels"]]),
            "position_ids": torch.cat([a["position_ids"], b["position_ids"]], dim=1),
            "cu_seqlens": torch.cat([a["cu_seqlens"], b["cu_seqlens"][1:] + n]),
            "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]]),
            "image_grid_thw": torch.cat([a["image_grid_thw"], b["image_grid_thw"]])}


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_two_micro_batches_give_the_single_batch_gradient(setup):
    recipe, tok, (a, b) = setup
    assert labelled_targets(a) != labelled_targets(b)  # different token counts, or the test proves nothing
    ref_model = build_model(recipe, tok, ENV)
    loss_sum, count = ref_model(**join(a, b))
    (loss_sum / count).backward()
    reference = grads(ref_model)

    model = build_model(recipe, tok, ENV)
    stats = accumulate_gradients(model, [a, b], ENV, model.config)
    ours = grads(model)
    assert set(ours) == set(reference)
    for name in reference:
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-4, atol=1e-8, msg=name)
    assert stats.loss_sum / float(stats.counts[0]) == pytest.approx(float(loss_sum.detach() / count), rel=1e-5)

    # The naive alternative (mean of per-micro-batch means) gives a measurably different gradient.
    naive = build_model(recipe, tok, ENV)
    for batch in (a, b):
        s, c = naive(**batch)
        (s / c / 2).backward()
    diff = max(float((p.grad - reference[n]).abs().max()) for n, p in naive.named_parameters())
    assert diff > 1e-5


def test_warmup_freezes_all_but_the_projector(setup, tmp_path):
    recipe, tok, (a, b) = setup
    model = build_model(recipe, tok, ENV)
    apply_phase(model, ["projector"])
    opt = build_optimizer(model, recipe.optim)
    accumulate_gradients(model, [a, b], ENV, model.config)
    opt.step()
    projector = {id(p) for p in model.projector.parameters()}
    assert {id(p) for p in opt.state} == projector  # no optimizer state for frozen parameters
    assert all(p.grad is None for n, p in model.named_parameters() if not n.startswith("projector."))

    raw = raw_recipe(tmp_path / "warm", tmp_path / "cache2", phase={"name": "warmup"}, budget={"max_steps": 3},
                     checkpoint={"every": None})
    raw["data"] = recipe.to_dict()["data"]
    warm = load_recipe(raw=raw)
    initial = {n: p.detach().clone() for n, p in build_model(warm, tok, ENV).state_dict().items()}
    result = train(warm)
    final = load_weights(result.final_dir)
    assert set(final) == set(initial)
    for name, t in final.items():
        if name.startswith("projector."):
            assert not torch.equal(t, initial[name]), name
        else:
            assert torch.equal(t, initial[name]), name  # bit-identical
    assert result.steps == 3 and (tmp_path / "warm" / "metrics.jsonl").read_text().count("\n") == 3
