"""Model shapes the planner can build without weights: public config.json facts of released checkpoints.

A preset names a vision tower, a language model, or both joined with `+` (`qwen2.5-vl-72b-vit+qwen3-8b` is
MindVL-8B: a native-resolution ViT, a new projector, Qwen3-8B with M-RoPE as `mindvl compose` sets it up).
"""

from __future__ import annotations

from mindvl.models.config import MindVLConfig, TextConfig, VisionConfig

# Qwen2.5-VL's vision towers: the 3B/7B/72B checkpoints share the ViT's shape (675M parameters; only the merger's
# output width differs, and MindVL replaces the merger with its own projector).
_QWEN25_VIT = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, window_size=112,
                   fullatt_block_indexes=[7, 15, 23, 31])
# Qwen3-VL's vision tower (2B ... 32B dense and 30B-A3B share it; its mergers are built to the LLM's width).
_QWEN3_VIT = dict(family="qwen3_vl", depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                  hidden_act="gelu_pytorch_tanh", num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24])
# Qwen3.5's tower: Qwen3-VL's without DeepStack.
_QWEN35_VIT = {**_QWEN3_VIT, "deepstack_visual_indexes": []}
VISION_PRESETS = {"qwen2.5-vl-7b-vit": _QWEN25_VIT, "qwen2.5-vl-72b-vit": _QWEN25_VIT, "qwen3-vl-vit": _QWEN3_VIT,
                  "qwen3.5-vit": _QWEN35_VIT}
# Qwen3-VL's LLMs: interleaved M-RoPE [24, 20, 20], rope_theta 5e6, untied.
_QWEN3_VL_ROPE = dict(rope_theta=5_000_000.0, mrope_section=[24, 20, 20], mrope_interleaved=True,
                      max_position_embeddings=262144)

TEXT_PRESETS = {
    "qwen3-1.7b": dict(family="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "qwen2.5-vl-7b-llm": dict(family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                              rope_theta=1e6, mrope_section=[16, 24, 24]),
    "qwen3-vl-8b-llm": dict(family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                            **_QWEN3_VL_ROPE),
    "qwen3-vl-30b-a3b-llm": dict(family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                                 num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                 moe_intermediate_size=768, n_routed_experts=128, num_experts_per_tok=8,
                                 **_QWEN3_VL_ROPE),
    "qwen2.5-vl-72b-llm": dict(family="qwen2", vocab_size=152064, hidden_size=8192, intermediate_size=29568,
                               num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
                               rope_theta=1e6, mrope_section=[16, 24, 24]),
    # Qwen3.5-27B (hub config.json): 48 Gated DeltaNet + 16 gated full-attention layers (every fourth).
    "qwen3.5-27b-llm": dict(family="qwen3_5", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
                            num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                            rope_theta=10_000_000.0, mrope_section=[11, 11, 10], mrope_interleaved=True,
                            partial_rotary_factor=0.25, max_position_embeddings=262144,
                            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
                            linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                            linear_num_key_heads=16, linear_num_value_heads=48),
    "deepseek-v3": dict(family="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        num_hidden_layers=61, num_attention_heads=128, moe_intermediate_size=2048,
                        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
                        first_k_dense_replace=3, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        rope_theta=10000.0, max_position_embeddings=163840),
}
# Whole models, by their usual names.
COMPOSITES = {
    "qwen2.5-vl-7b": "qwen2.5-vl-7b-vit+qwen2.5-vl-7b-llm",
    "qwen3-vl-8b": "qwen3-vl-vit+qwen3-vl-8b-llm",
    "qwen3-vl-30b-a3b": "qwen3-vl-vit+qwen3-vl-30b-a3b-llm",
    "qwen2.5-vl-72b": "qwen2.5-vl-72b-vit+qwen2.5-vl-72b-llm",
    "qwen3.5-27b": "qwen3.5-vit+qwen3.5-27b-llm",
    "mindvl-8b": "qwen2.5-vl-72b-vit+qwen3-8b",
    "mindvl-671b": "qwen2.5-vl-72b-vit+deepseek-v3",
}


def known_presets() -> str:
    return ", ".join([*COMPOSITES, *VISION_PRESETS, *TEXT_PRESETS]) + " (or VIT+LLM, e.g. qwen2.5-vl-7b-vit+qwen3-8b)"


def _mrope(head_dim: int, qwen3: bool = False) -> list[int]:
    from mindvl.checkpoint import hf_qwen3_vl
    from mindvl.checkpoint.hf import default_mrope_section

    return hf_qwen3_vl.default_mrope_section(head_dim) if qwen3 else default_mrope_section(head_dim)


def preset_config(name: str) -> MindVLConfig:
    """The MindVLConfig of a preset (see the module docstring); unknown names list the known ones."""
    key = COMPOSITES.get(name.lower(), name.lower())
    parts = key.split("+")
    vision = [p for p in parts if p in VISION_PRESETS]
    text = [p for p in parts if p in TEXT_PRESETS]
    if len(vision) + len(text) != len(parts) or len(text) != 1 or len(vision) > 1:
        raise ValueError(f"model preset {name!r} is not known: give one language model, optionally a vision tower "
                         f"first; known: {known_presets()}")
    t = dict(TEXT_PRESETS[text[0]])
    if vision and t.get("mrope_section") is None:  # as `mindvl compose` sets up a composed MindVL
        qwen3 = VISION_PRESETS[vision[0]].get("family") == "qwen3_vl"  # Qwen3-VL's tower: interleaved M-RoPE
        t["mrope_section"] = _mrope(t.get("qk_rope_head_dim") or t["head_dim"], qwen3)
        t["mrope_interleaved"] = qwen3
    vcfg = VisionConfig(**VISION_PRESETS[vision[0]]) if vision else None
    ids = {}
    if t["vocab_size"] <= 151655:  # Qwen's vision token ids lie outside this vocabulary: use its last four ids
        v = t["vocab_size"]
        ids = dict(vision_start_token_id=v - 4, vision_end_token_id=v - 3, image_token_id=v - 2, video_token_id=v - 1)
    return MindVLConfig(text=TextConfig(**t), vision=vcfg, source={"preset": name}, **ids)
