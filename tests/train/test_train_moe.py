"""A tiny MindVL whose language model is DeepSeek-V3-style MoE trains with the trainer: the loss falls, the routers'
correction biases move by exactly the balancing rule, and the run resumes exactly."""

from __future__ import annotations

import pytest
import torch
from train_helpers import crash_then_resume, load_weights, raw_recipe, records

from mindvl.config import load_recipe
from mindvl.train.trainer import train

MOE_TEXT = {"family": "deepseek_v3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 4, "mrope_section": [0, 1, 1],
            "moe_intermediate_size": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
            "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8}


def moe_raw(out, cache, **kw):
    raw = raw_recipe(out, cache, **kw)
    raw["model"]["arch"]["text"] = dict(MOE_TEXT)
    raw["optim"]["router_bias_rate"] = 0.01
    return raw


def test_moe_language_model_trains_balances_and_resumes(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    result = train(load_recipe(raw=moe_raw(tmp_path / "a", cache, budget={"max_steps": 6},
                                           checkpoint={"every": 3, "keep": 2})))
    logged = records(tmp_path / "a")
    assert logged[-1]["loss"] < logged[0]["loss"]
    assert all(r["moe_max_violation"] >= 0 for r in logged)
    weights = load_weights(result.final_dir)
    bias = weights["language_model.layers.1.mlp.gate.e_score_correction_bias"]
    # Each step moves every bias by +-rate (or 0 for an expert at exactly the mean load): after 6 steps every
    # entry is a multiple of 0.01 within [-0.06, 0.06], and the routers did move.
    steps = bias / 0.01
    assert torch.allclose(steps, steps.round(), atol=1e-4) and bias.abs().max() <= 0.06 + 1e-6
    assert bias.abs().sum() > 0

    # A crash right after the step-3 checkpoint, then resume=auto, reproduces the uninterrupted run exactly (the
    # biases are checkpointed buffers; the load counters restart at zero, which they are after every step).
    b = moe_raw(tmp_path / "b", cache, budget={"max_steps": 6}, checkpoint={"every": 3, "keep": 2})
    resumed = crash_then_resume(monkeypatch, b, 3)
    assert all(torch.equal(resumed[n], weights[n]) for n in weights)


@pytest.mark.slow
def test_moe_two_processes_fsdp_match_one_process(tmp_path):
    """Experts live inside the decoder blocks, so FSDP2 shards them with the block; 2 ranks = 1 process."""
    import sys

    from train_helpers import CLI, run, run_ranks, write_recipe

    cache = tmp_path / "cache"
    script = tmp_path / "cli.py"
    script.write_text(CLI + "\n")
    one = write_recipe(tmp_path / "one.yaml", moe_raw(tmp_path / "one", cache, budget={"max_steps": 3},
                                                      batch={"global_batch_size": 2, "data_shards": 2}))
    two = write_recipe(tmp_path / "two.yaml", moe_raw(tmp_path / "two", cache, budget={"max_steps": 3},
                                                      batch={"global_batch_size": 2}))
    r1 = run([sys.executable, str(script), "train", str(one), "parallel.fsdp=off"], timeout=300)
    assert r1.returncode == 0, r1.stderr[-2000:]
    r2 = run_ranks(tmp_path, 2, ["train", str(two)], script=script)
    assert r2.returncode == 0, r2.stderr[-3000:]

    a, b = records(tmp_path / "one"), records(tmp_path / "two")
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-5)
    assert [r["moe_max_violation"] for r in a] == pytest.approx([r["moe_max_violation"] for r in b], rel=1e-6)
    w1, w2 = load_weights(tmp_path / "one" / "final"), load_weights(tmp_path / "two" / "final")
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-5, msg=name)
