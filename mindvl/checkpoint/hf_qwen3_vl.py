"""Qwen3-VL (dense `qwen3_vl` and MoE `qwen3_vl_moe`) config.json <-> MindVLConfig, and the MoE expert layouts.

Config: transformers >= 4.57 nests `text_config` (with `rope_parameters` or the older `rope_scaling` holding
`mrope_section` and `mrope_interleaved`) and `vision_config` (`out_hidden_size` = the LLM width,
`deepstack_visual_indexes`, `num_position_embeddings`). The Qwen3-VL LLM is a Qwen3 (q/k norm, explicit head_dim)
with interleaved M-RoPE; the MoE one is a Qwen3-MoE (softmax top-k routing on every layer).

Expert tensors: the hub stores one fused `experts.gate_up_proj [E, H, 2I]` (gate columns first) and
`experts.down_proj [E, I, H]` per layer; transformers 5's `save_pretrained` writes its in-memory transposes
`[E, 2I, H]` / `[E, H, I]`. Import accepts both, told apart by the config's sizes (a square shape, H == 2I or
H == I, is read as transformers 5 reads it: untransposed). Export writes the hub layout.
"""

from __future__ import annotations

import torch

from mindvl.models import MindVLConfig, TextConfig, VisionConfig

FAMILIES = ("qwen3_vl", "qwen3_vl_moe")


def _rope(text: dict) -> tuple[float, list[int], bool]:
    params = {**(text.get("rope_scaling") or {}), **(text.get("rope_parameters") or {})}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"text_config: rope type {kind!r} is not supported (default M-RoPE only)")
    theta = float(text.get("rope_theta", params.get("rope_theta", 5_000_000.0)))
    section = list(params.get("mrope_section") or [24, 20, 20])
    return theta, section, bool(params.get("mrope_interleaved", True))


def text_config(config: dict, family: str) -> TextConfig:
    text = {**config, **(config.get("text_config") or {})}
    theta, section, interleaved = _rope(text)
    heads = text["num_attention_heads"]
    moe: dict = {}
    if family == "qwen3_vl_moe":
        if text.get("mlp_only_layers") or text.get("decoder_sparse_step", 1) != 1:
            raise ValueError("text_config: mlp_only_layers / decoder_sparse_step != 1 are not supported (every "
                             "layer of the released Qwen3-VL MoE models is sparse)")
        moe = dict(moe_intermediate_size=text["moe_intermediate_size"],
                   n_routed_experts=text.get("num_experts", text.get("num_local_experts")),
                   num_experts_per_tok=text["num_experts_per_tok"])
    if text.get("attention_bias", False):
        raise ValueError("text_config: attention_bias=true is not supported (no released Qwen3-VL uses it)")
    return TextConfig(
        family="qwen3_moe" if moe else "qwen3",
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        mrope_section=section,
        mrope_interleaved=interleaved,
        max_position_embeddings=text.get("max_position_embeddings", 128000),
        # The top level decides (transformers' Qwen3VLConfig.tie_word_embeddings); text_config's is a class default.
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=text.get("hidden_act", "silu"),
        **moe,
    )


def vision_config(config: dict) -> VisionConfig:
    v = config["vision_config"]
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return VisionConfig(
        family="qwen3_vl",
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        in_channels=v.get("in_channels", 3),
        patch_size=v.get("patch_size", 16),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        hidden_act=v.get("hidden_act", "gelu_pytorch_tanh"),
        rope_theta=float(theta),
        num_position_embeddings=v.get("num_position_embeddings", 2304),
        deepstack_visual_indexes=list(v.get("deepstack_visual_indexes", [8, 16, 24])),
    )


def mindvl_config(config: dict, family: str, token_ids: dict[str, int], source: dict) -> MindVLConfig:
    text = text_config(config, family)
    vision = vision_config(config)
    out_hidden = config["vision_config"].get("out_hidden_size", text.hidden_size)
    if out_hidden != text.hidden_size:
        raise ValueError(f"vision_config.out_hidden_size {out_hidden} != text hidden_size {text.hidden_size}")
    return MindVLConfig(text=text, vision=vision, source=source, **token_ids)


def is_qwen3_vl(cfg: MindVLConfig) -> bool:
    return cfg.vision is not None and cfg.vision.family == "qwen3_vl"


def hf_config(cfg: MindVLConfig) -> dict:
    """A Qwen3-VL-shaped MindVLConfig -> transformers' nested config.json (4.57 ... 5.x read it)."""
    t, v = cfg.text, cfg.vision
    if t.family not in ("qwen3", "qwen3_moe") or not t.mrope_section or not t.mrope_interleaved:
        raise ValueError("only a Qwen3-VL-shaped model (Qwen3 or Qwen3-MoE LLM with interleaved M-RoPE) has a "
                         f"transformers class; this model's LLM is {t.family!r} (mrope_interleaved="
                         f"{t.mrope_interleaved}), so keep it in mindvl's format")
    if len(v.deepstack_visual_indexes or []) > t.num_hidden_layers:
        raise ValueError("more DeepStack blocks than LLM layers")
    moe = t.family == "qwen3_moe"
    model_type = "qwen3_vl_moe" if moe else "qwen3_vl"
    rope = {"rope_type": "default", "rope_theta": t.rope_theta, "mrope_section": t.mrope_section,
            "mrope_interleaved": True}
    text = {
        "model_type": f"{model_type}_text", "vocab_size": t.vocab_size, "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size, "num_hidden_layers": t.num_hidden_layers,
        "num_attention_heads": t.num_attention_heads, "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.head_dim, "rms_norm_eps": t.rms_norm_eps, "max_position_embeddings": t.max_position_embeddings,
        "hidden_act": t.hidden_act, "attention_bias": False, "rope_theta": t.rope_theta,
        "rope_scaling": {**rope, "type": "default"}, "rope_parameters": rope,
        "tie_word_embeddings": t.tie_word_embeddings,
    }
    if moe:
        text.update(moe_intermediate_size=t.moe_intermediate_size, num_experts=t.n_routed_experts,
                    num_experts_per_tok=t.num_experts_per_tok, decoder_sparse_step=1, mlp_only_layers=[],
                    norm_topk_prob=True)
    vision = {
        "model_type": f"{model_type}_vision", "depth": v.depth, "hidden_size": v.hidden_size,
        "intermediate_size": v.intermediate_size, "num_heads": v.num_heads, "in_channels": v.in_channels,
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size,
        "spatial_merge_size": v.spatial_merge_size, "hidden_act": v.hidden_act, "out_hidden_size": t.hidden_size,
        "num_position_embeddings": v.num_position_embeddings,
        "deepstack_visual_indexes": list(v.deepstack_visual_indexes or []),
    }
    arch = "Qwen3VLMoeForConditionalGeneration" if moe else "Qwen3VLForConditionalGeneration"
    return {
        "architectures": [arch], "model_type": model_type, "text_config": text, "vision_config": vision,
        "tie_word_embeddings": t.tie_word_embeddings, "image_token_id": cfg.image_token_id,
        "video_token_id": cfg.video_token_id, "vision_start_token_id": cfg.vision_start_token_id,
        "vision_end_token_id": cfg.vision_end_token_id,
    }


# ------------------------------------------------------------------------------------------- expert tensors


def experts_transposed(kind: str, shape: tuple[int, ...], text: TextConfig) -> bool:
    """Is a Qwen3-MoE expert tensor (`gate_up` or `down`) in the hub's [E, in, out] layout (to transpose)?"""
    h, i = text.hidden_size, text.moe_intermediate_size
    ours = (2 * i, h) if kind == "gate_up" else (h, i)
    if tuple(shape[1:]) == ours:
        return False
    if tuple(shape[1:]) == ours[::-1]:
        return True
    raise ValueError(f"experts.{kind}_proj has shape {tuple(shape)}, expected [E, {ours[0]}, {ours[1]}] or "
                     f"[E, {ours[1]}, {ours[0]}]")


def hub_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """mindvl's gate/up [E, I, H] -> the hub's fused gate_up_proj [E, H, 2I] (gate columns first)."""
    return torch.cat([gate, up], dim=1).transpose(1, 2).contiguous()


def hub_down(down: torch.Tensor) -> torch.Tensor:
    """mindvl's down [E, H, I] -> the hub's down_proj [E, I, H]."""
    return down.transpose(1, 2).contiguous()


# ------------------------------------------------------------------------------------------------ composition


def default_mrope_section(head_dim: int) -> list[int]:
    """Qwen3-VL's interleaved split, [24, 20, 20] for head_dim 128, scaled to other head sizes (h = w, t the rest)."""
    half = head_dim // 2
    hw = half * 20 // 64
    return [half - 2 * hw, hw, hw]


def fresh_mergers(vision: VisionConfig, out_hidden: int, seed: int) -> dict[str, torch.Tensor]:
    """A MindVL composition's new `projector.*` tensors (Qwen3-VL's merger layout, DeepStack mergers included as
    `projector.deepstack.{j}.*`), seeded: normal(0, 0.02) weights, zero biases, unit norms."""
    from mindvl.models.vision_qwen3 import LayerNormMerger

    merger = LayerNormMerger(vision.hidden_size, out_hidden, vision.merge_unit,
                             deepstack=len(vision.deepstack_visual_indexes or []))
    merger.reset_parameters(torch.Generator().manual_seed(seed))
    return {f"projector.{k}": v for k, v in merger.state_dict().items()}
