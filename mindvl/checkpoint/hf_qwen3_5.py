"""Qwen3.5 (`qwen3_5`, and the MoE `qwen3_5_moe`; transformers >= 5.x) config.json <-> MindVLConfig.

Qwen3.5 is natively multimodal: Qwen3-VL's vision tower without DeepStack (its merger becomes mindvl's projector)
and a hybrid LLM (text family `qwen3_5`: Gated DeltaNet layers and gated full-attention layers, `layer_types`).
Tensor names are Qwen3-VL's nested ones (`model.visual.*`, `model.language_model.*`, `lm_head`), so the key table
is Qwen3-VL's (hf_keys); the hub's multi-token-prediction tensors (`mtp.*`) are dropped on import, as transformers
does on load. Qwen3.5-MoE's experts: the hub stores them per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`,
stacked on import by the key table's `{expert}` rule, written back so on export); transformers 5's in-memory fused
`experts.gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]` (what its save_pretrained writes) is read too. Each layer
also has one shared expert (`mlp.shared_expert.*`) scaled by sigmoid(`mlp.shared_expert_gate`).

Config traps (transformers 5.23): `partial_rotary_factor` lives in `rope_parameters` (default 0.25 when absent);
the text rotary always uses the interleaved M-RoPE layout, whatever `mrope_interleaved` says, with
`mrope_section` defaulting to [11, 11, 10]; `layer_types`, when absent, follows `full_attention_interval`
(default 4: every fourth layer is full attention).
"""

from __future__ import annotations

from mindvl.models import MindVLConfig, TextConfig

from . import hf_qwen3_vl

FAMILIES = ("qwen3_5", "qwen3_5_moe")
# The language models alone (`Qwen3_5ForCausalLM`, `Qwen3_5MoeForCausalLM`: `model.layers.*`, `lm_head`).
TEXT_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text")


def text_config(config: dict, family: str = "qwen3_5") -> TextConfig:
    text = {**config, **(config.get("text_config") or {})}
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"text_config: rope type {kind!r} is not supported (default M-RoPE only)")
    if text.get("attention_bias", False):
        raise ValueError("text_config: attention_bias=true is not supported (no released Qwen3.5 uses it)")
    layers = text["num_hidden_layers"]
    interval = text.get("full_attention_interval", 4)
    layer_types = text.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                              for i in range(layers)]
    heads = text["num_attention_heads"]
    moe: dict = {}
    if family == "qwen3_5_moe":
        if text.get("mlp_only_layers"):
            raise ValueError("text_config: mlp_only_layers is not supported (every layer of Qwen3.5-MoE is sparse)")
        moe = dict(moe_intermediate_size=text["moe_intermediate_size"], n_routed_experts=text["num_experts"],
                   num_experts_per_tok=text["num_experts_per_tok"],
                   shared_expert_intermediate_size=text["shared_expert_intermediate_size"])
    return TextConfig(
        family=family,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        # Qwen3.5-MoE has no dense MLP; the field is unused there
        intermediate_size=text.get("intermediate_size") or text.get("moe_intermediate_size", 1),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(params.get("rope_theta", text.get("rope_theta", 10000.0))),
        mrope_section=list(params.get("mrope_section") or [11, 11, 10]),
        mrope_interleaved=True,
        partial_rotary_factor=float(params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=text.get("hidden_act", "silu"),
        layer_types=list(layer_types),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim", 4),
        linear_key_head_dim=text.get("linear_key_head_dim", 128),
        linear_value_head_dim=text.get("linear_value_head_dim", 128),
        linear_num_key_heads=text.get("linear_num_key_heads", 16),
        linear_num_value_heads=text.get("linear_num_value_heads", 32),
        **moe,
    )


def mindvl_config(config: dict, family: str, token_ids: dict[str, int], source: dict) -> MindVLConfig:
    if family in TEXT_FAMILIES:  # a text-only model (no vision tower)
        return MindVLConfig(text=text_config(config, family.removesuffix("_text")), vision=None, source=source,
                            **token_ids)
    text = text_config(config, family)
    raw_vision = dict(config["vision_config"])
    raw_vision["deepstack_visual_indexes"] = []  # Qwen3.5's tower has no DeepStack mergers
    vision = hf_qwen3_vl.vision_config({"vision_config": raw_vision})
    out_hidden = raw_vision.get("out_hidden_size", text.hidden_size)
    if out_hidden != text.hidden_size:
        raise ValueError(f"vision_config.out_hidden_size {out_hidden} != text hidden_size {text.hidden_size}")
    return MindVLConfig(text=text, vision=vision, source=source, **token_ids)


def is_qwen3_5(cfg: MindVLConfig) -> bool:
    return cfg.text.family in FAMILIES


def hf_config(cfg: MindVLConfig) -> dict:
    """A Qwen3.5 MindVLConfig -> transformers' nested config.json (`Qwen3_5ForConditionalGeneration`, or
    `Qwen3_5MoeForConditionalGeneration`), or for a text-only one the flat `Qwen3_5(Moe)ForCausalLM` config."""
    t, v = cfg.text, cfg.vision
    model_type = t.family
    if v is not None and (v.family != "qwen3_vl" or v.deepstack_visual_indexes):
        raise ValueError("only a Qwen3.5-shaped model (Qwen3-VL-style vision tower without DeepStack + the Qwen3.5 "
                         "LLM) has a transformers class; keep this one in mindvl's format")
    text = {
        "model_type": f"{model_type}_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "max_position_embeddings": t.max_position_embeddings,
        "hidden_act": t.hidden_act, "attention_bias": False, "tie_word_embeddings": t.tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": t.mrope_section,
                            "mrope_interleaved": True, "partial_rotary_factor": t.partial_rotary_factor},
        "layer_types": list(t.layer_types), "linear_conv_kernel_dim": t.linear_conv_kernel_dim,
        "linear_key_head_dim": t.linear_key_head_dim, "linear_value_head_dim": t.linear_value_head_dim,
        "linear_num_key_heads": t.linear_num_key_heads, "linear_num_value_heads": t.linear_num_value_heads,
    }
    if model_type == "qwen3_5_moe":
        del text["intermediate_size"]
        text.update(moe_intermediate_size=t.moe_intermediate_size, num_experts=t.n_routed_experts,
                    num_experts_per_tok=t.num_experts_per_tok,
                    shared_expert_intermediate_size=t.shared_expert_intermediate_size)
    if v is None:
        arch = "Qwen3_5MoeForCausalLM" if model_type == "qwen3_5_moe" else "Qwen3_5ForCausalLM"
        return {"architectures": [arch], **text}
    vision = {
        "model_type": f"{model_type}_vision", "depth": v.depth, "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size, "num_heads": v.num_heads, "in_channels": v.in_channels,
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size, "hidden_act": v.hidden_act, "out_hidden_size": t.hidden_size,
        "num_position_embeddings": v.num_position_embeddings,
        "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta},
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if model_type == "qwen3_5_moe"
                          else "Qwen3_5ForConditionalGeneration"], "model_type": model_type, "text_config": text,
        "vision_config": vision, "tie_word_embeddings": t.tie_word_embeddings, "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id, "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
    }
