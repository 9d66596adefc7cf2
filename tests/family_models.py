"""One small model of every language-model family mindvl decodes and trains (dense GQA, DeepSeek-V3's MoE with
MLA latents, Qwen3-VL's interleaved M-RoPE + DeepStack, Qwen3.5's hybrid linear attention), each with its vision
tower: the families the decode and device-read tests walk. Odd sizes (vocabulary 211, 5 query heads over 1 KV head),
so a size bug cannot hide in a power of two."""

from __future__ import annotations

from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

VOCAB = 211  # odd, so a vocabulary-sized bug cannot hide in a power of two
IMAGE, VIDEO, START, END = 200, 201, 202, 203

TEXT = {
    "dense": dict(family="qwen2", hidden_size=40, intermediate_size=56, num_hidden_layers=2, num_attention_heads=5,
                  num_key_value_heads=1, head_dim=8, mrope_section=[1, 1, 2]),
    "moe_mla": dict(family="deepseek_v3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=8,
                    num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, first_k_dense_replace=1,
                    kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16,
                    head_dim=16, mrope_section=[2, 3, 3]),
    "qwen3_vl": dict(family="qwen3", hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=12, mrope_section=[2, 2, 2],
                     mrope_interleaved=True),
    "qwen3_5": dict(family="qwen3_5", hidden_size=48, intermediate_size=80, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, mrope_section=[2, 1, 1],
                    mrope_interleaved=True, partial_rotary_factor=0.5, linear_conv_kernel_dim=4,
                    linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
                    linear_num_value_heads=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
}
QWEN3_TOWER = dict(family="qwen3_vl", depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16,
                   hidden_act="gelu_pytorch_tanh", num_position_embeddings=16)


def build(name: str, text: dict | None = None) -> MindVL:
    """The family's model; `text` replaces its TEXT entry (e.g. more layers)."""
    if name in ("qwen3_vl", "qwen3_5"):
        vision = VisionConfig(**QWEN3_TOWER, deepstack_visual_indexes=[0, 2] if name == "qwen3_vl" else [])
    else:
        vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
    cfg = MindVLConfig(text=TextConfig(vocab_size=VOCAB, **(text or TEXT[name])), vision=vision, image_token_id=IMAGE,
                       video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    model = MindVL(cfg)
    model.init_weights(seed=5, std=0.15)  # large enough that the tokens depend on the context
    return model.eval()
