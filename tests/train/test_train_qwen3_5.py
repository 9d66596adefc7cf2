"""A tiny MindVL whose language model is a Qwen3.5 hybrid (Gated DeltaNet + gated attention) trains with the trainer
on packed multimodal rows: the loss falls, the linear-attention parameters move, and a crash + resume reproduces the
uninterrupted run exactly."""

from __future__ import annotations

import torch
from train_helpers import crash_then_resume, load_weights, raw_recipe, records

from mindvl.config import load_recipe
from mindvl.train.trainer import train

HYBRID_TEXT = {"family": "qwen3_5", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "mrope_section": [1, 1, 0],
               "mrope_interleaved": True, "partial_rotary_factor": 0.5,
               "layer_types": ["linear_attention", "full_attention", "linear_attention"],
               "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4}


def hybrid_raw(out, cache, **kw):
    raw = raw_recipe(out, cache, **kw)
    raw["model"]["arch"]["text"] = dict(HYBRID_TEXT)
    return raw


def test_hybrid_language_model_trains_and_resumes(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    result = train(load_recipe(raw=hybrid_raw(tmp_path / "a", cache, budget={"max_steps": 4},
                                              checkpoint={"every": 2, "keep": 2})))
    logged = records(tmp_path / "a")
    assert logged[-1]["loss"] < logged[0]["loss"]
    weights = load_weights(result.final_dir)
    assert "language_model.layers.0.linear_attn.A_log" in weights
    assert "language_model.layers.1.self_attn.q_proj.weight" in weights

    b = hybrid_raw(tmp_path / "b", cache, budget={"max_steps": 4}, checkpoint={"every": 2, "keep": 2})
    resumed = crash_then_resume(monkeypatch, b, 2)
    assert all(torch.equal(resumed[n], weights[n]) for n in weights)
