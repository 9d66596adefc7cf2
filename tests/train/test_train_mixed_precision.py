"""bf16 mixed precision with activation checkpointing and accumulation: two gloo processes train like one process
on the same global batch (`batch.data_shards=2`) running FSDP's policy over one rank (`parallel.fsdp=on`: a single
process otherwise runs plain tensors under autocast, whose fp32 residual stream is another rounding than FSDP's
bf16 one; that layout is checked against fp32 in tests/test_accelerator_standins.py and
tests/train/test_prepare_one_device.py)."""

from __future__ import annotations

import pytest
import torch
from test_train_distributed import losses, train_one_and_two
from train_helpers import CLI, load_weights, raw_recipe, write_recipe


@pytest.mark.slow
def test_two_processes_bf16_checkpointed_accumulation_match_one_process(tmp_path):
    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")
    common = {"budget": {"max_steps": 2}, "checkpoint": {"every": None},
              "parallel": {"mixed_precision": "bf16", "activation_checkpointing": True}}
    one = write_recipe(tmp_path / "one.yaml", raw_recipe(tmp_path / "one", cache, **common,
                                                         batch={"global_batch_size": 4, "data_shards": 2}))
    two = write_recipe(tmp_path / "two.yaml", raw_recipe(tmp_path / "two", cache, **common,
                                                         batch={"global_batch_size": 4}))
    train_one_and_two(script, one, two, "parallel.fsdp=on")  # the same mixed-precision policy on both sides

    l1, l2 = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(l1) == len(l2) == 2
    assert l1 == pytest.approx(l2, rel=2e-3)  # same packs, bf16 compute, different reduction order
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    assert all(t.dtype == torch.float32 for t in w1.values())  # fp32 master weights, not a bf16 model
    for name in w1:
        # one AdamW step moves a weight by <= lr (1e-3) per step: bf16 rounding of the gradient may flip small ones
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=2.5e-3, msg=name)


def test_single_device_bf16_uses_fsdp_numerics(tmp_path):
    """One process, mixed_precision=bf16 (plain tensors under autocast): compute in bf16, fp32 master weights and
    fp32 gradients, as FSDP's policy."""
    from mindvl.config import ParallelSection, load_recipe
    from mindvl.data import DataConfig, build_loader, load_tokenizer
    from mindvl.train.materialize import build_model
    from mindvl.train.parallel import ParallelEnv, destroy, parallelize

    env = ParallelEnv(0, 1, 0, torch.device("cpu"), "gloo")
    recipe = load_recipe(raw=raw_recipe(tmp_path / "o", tmp_path / "cache"))
    tok = load_tokenizer()
    try:
        model = build_model(recipe, tok, env, lambda m: parallelize(m, env, ParallelSection(mixed_precision="bf16")))
        seen = []
        model.language_model.layers[0].mlp.register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        batch = next(iter(build_loader(DataConfig.from_dict(recipe.data), tok))).to_torch()
        loss_sum, _ = model(**batch)
        loss_sum.backward()
        assert seen == [torch.bfloat16]
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    finally:
        destroy(env)
