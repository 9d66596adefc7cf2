"""A tiny Qwen3.5-shaped MindVL (the hybrid Gated DeltaNet + gated attention LLM behind Qwen3-VL's tower without
DeepStack, as `qwen3_5` composes them) trains with the trainer on packed multimodal rows cut by that tower's own
processor (16-px patches): the loss falls, the linear-attention parameters move, and a crash + resume reproduces the
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


QWEN35_VISION = {"family": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                 "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "num_position_embeddings": 16,
                 "deepstack_visual_indexes": []}


def hybrid_raw(out, cache, **kw):
    raw = raw_recipe(out, cache, **kw)
    raw["model"]["arch"]["text"] = dict(HYBRID_TEXT)
    raw["model"]["arch"]["vision"] = dict(QWEN35_VISION)
    raw["data"]["max_pixels"], raw["data"]["min_pixels"] = 64 * 32 * 32, 4 * 32 * 32
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
    assert weights["visual.patch_embed.weight"].shape[1] == 3 * 2 * 16 * 16  # 16-px rows reached the tower

    b = hybrid_raw(tmp_path / "b", cache, budget={"max_steps": 4}, checkpoint={"every": 2, "keep": 2})
    resumed = crash_then_resume(monkeypatch, b, 2)
    assert all(torch.equal(resumed[n], weights[n]) for n in weights)
