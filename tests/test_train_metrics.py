"""FLOPs counting for MFU, against values worked out by hand."""

import pytest
import torch

from mindvl.models import MindVLConfig, TextConfig, VisionConfig
from mindvl.train import metrics
from mindvl.train.metrics import forward_flops, training_flops


def tiny_config(vision: bool) -> MindVLConfig:
    text = TextConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                      num_key_value_heads=1, head_dim=4)
    v = VisionConfig(depth=2, hidden_size=8, intermediate_size=16, num_heads=2, fullatt_block_indexes=[1])
    return MindVLConfig(text=text, vision=v if vision else None, image_token_id=5, video_token_id=6,
                        vision_start_token_id=7, vision_end_token_id=8)


def test_text_flops_by_hand():
    # per token: 2*(q 4*4 + k,v 2*4*4 + o 4*4 + mlp 3*4*8) = 2*160 = 320; 3 tokens -> 960
    # attention: 2 (QK, AV) * 2 flops * 4 dims * 6 causal pairs (3*4/2) = 96; logits: 2 labelled * 2*4*10 = 160
    assert forward_flops(tiny_config(False), [3], labelled_tokens=2) == 960 + 96 + 160
    assert training_flops(tiny_config(False), [3], labelled_tokens=2) == 3 * (960 + 96 + 160)


def test_vision_flops_by_hand():
    # one 4x4-patch image: patch embed 2*16*1176*8 = 301056; blocks 2 * 16 * 2*(4*64 + 3*8*16) = 40960;
    # attention: one window and one frame of 16 patches: 4 * 8 * (256 + 256) = 16384;
    # projector: 4 merged tokens * 2*(32*32 + 32*4) = 9216
    text_only = forward_flops(tiny_config(True), [3], 2)
    assert forward_flops(tiny_config(True), [3], 2, [[1, 4, 4]]) - text_only == 301056 + 40960 + 16384 + 9216


def test_frozen_modules_cost_less_backward():
    # Text-only row from test_text_flops_by_hand: weights 960 + 160 (head), attention 96.
    cfg = tiny_config(True)
    grid = [[1, 4, 4]]
    full = training_flops(cfg, [3], 2, grid)
    assert full == 3 * forward_flops(cfg, [3], 2, grid)
    # Warm-up: the vision tower (before the projector) has no backward; the projector trains (2x); the frozen LLM
    # passes activation gradients: 1x its weights, 2x its attention.
    vision = 301056 + 40960 + 16384
    projector = 9216
    llm_weights, llm_attention = 960 + 160, 96
    warmup = training_flops(cfg, [3], 2, grid, trainable=["projector"])
    assert warmup == vision + 3 * projector + 2 * llm_weights + 3 * llm_attention
    # Training only the LLM: nothing before it is differentiated.
    assert training_flops(cfg, [3], 2, grid, trainable=["language_model"]) == (
        vision + projector + 3 * (llm_weights + llm_attention))


def test_deepseek_flops_by_hand():
    # H=8, 2 heads, nope 4 + rope 2 (qk 6), v 4, kv_lora 4, q_lora 3, E=4 top-2 + 1 shared of width 2, 1 dense layer
    # (I=6) of 2. Per token: attention 2*(q 8*3+3*2*6 + kv 8*(4+2)+4*2*(4+4) + o 2*4*8) = 2*(60+112+64) = 472 per
    # layer; dense MLP 2*3*8*6 = 288; MoE MLP 2*(8*4 + 3*3*8*2) = 352. One token: 2*472 + 288 + 352 = 1584,
    # attention 1 pair * 2 layers * 2 * 2 heads * (6 + 4) = 80; logits 2*8*10 = 160 for one labelled token.
    text = TextConfig(family="deepseek_v3", vocab_size=10, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, head_dim=2, moe_intermediate_size=2,
                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                      q_lora_rank=3, kv_lora_rank=4, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    cfg = MindVLConfig(text=text, vision=None)
    assert forward_flops(cfg, [1], labelled_tokens=1) == 1584 + 80 + 160


def test_peak_flops_override_replaces_the_cpu_probe(monkeypatch):
    """MINDVL_PEAK_TFLOPS wins over the datasheet/probe; a bad value is a one-line error naming the variable; unset,
    the CPU peak is the measured matmul."""
    probed = []
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda *a, **k: probed.append(1) or 3.0e11)
    monkeypatch.setenv(metrics.PEAK_ENV, "989")
    assert metrics.device_peak_flops(torch.device("cpu")) == (989e12, "MINDVL_PEAK_TFLOPS=989")
    assert probed == []
    for bad in ("fast", "0", "-5", "nan"):
        monkeypatch.setenv(metrics.PEAK_ENV, bad)
        with pytest.raises(ValueError, match="MINDVL_PEAK_TFLOPS"):
            metrics.device_peak_flops(torch.device("cpu"))
    monkeypatch.delenv(metrics.PEAK_ENV)
    assert metrics.device_peak_flops(torch.device("cpu"))[0] == 3.0e11
    assert probed == [1]
