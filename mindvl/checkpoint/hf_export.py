"""Export a mindvl model folder back to transformers' layout, for the families transformers can represent.

- vision + Qwen2 LLM with M-RoPE (a converted or fine-tuned Qwen2.5-VL) -> `Qwen2_5_VLForConditionalGeneration`;
- text-only Qwen3 / Qwen2 -> `Qwen3ForCausalLM` / `Qwen2ForCausalLM`.
- text-only DeepSeek-V3 -> `DeepseekV3ForCausalLM`, routed experts written per expert as on the hub
  (`mlp.experts.{e}.{gate,up,down}_proj.weight`), which transformers 4.51+ and 5.x both load.
A MindVL composition (Qwen2.5-VL vision tower + Qwen3 LLM) has no transformers class, so it is refused with a
clear message rather than written in a layout nothing can load.

The config is written in the hub's flat layout (text fields at the top level, `rope_scaling`, `vision_config`),
which transformers 4.49 ... 5.x read; tensors get the hub names and the patch embedding goes back to Conv3d.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mindvl.models import MindVLConfig

from . import hf_qwen3_5, hf_qwen3_vl
from .conv import matmul_to_conv3d
from .hf import CONFIG_NAME, read_config
from .hf_keys import key_map
from .safetensors_io import DEFAULT_SHARD_BYTES, ShardedWriter, TensorFolder, atomic_output_folder
from .side_files import token_ids_for_config, write_side_files


def _deepseek_config(t) -> dict:
    keys = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group",
            "topk_group", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave", "attention_bias")
    extra = {k: getattr(t, k) for k in keys}
    if t.rope_scaling is not None:
        extra["rope_scaling"] = {**t.rope_scaling, "type": t.rope_scaling.get("rope_type", "yarn")}
    return extra


def hf_config(cfg: MindVLConfig) -> dict:
    t = cfg.text
    text = {
        "vocab_size": t.vocab_size, "hidden_size": t.hidden_size, "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_hidden_layers, "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads, "rms_norm_eps": t.rms_norm_eps, "rope_theta": t.rope_theta,
        "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": t.tie_word_embeddings,
        "hidden_act": t.hidden_act,
    }
    if hf_qwen3_5.is_qwen3_5(cfg):
        return hf_qwen3_5.hf_config(cfg)
    if hf_qwen3_vl.is_qwen3_vl(cfg):
        return hf_qwen3_vl.hf_config(cfg)
    if cfg.vision is None:
        arch = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
        arch = arch[t.family]
        extra = {"head_dim": t.head_dim, "attention_bias": False} if t.family == "qwen3" else {}
        if t.family == "deepseek_v3":
            extra = _deepseek_config(t)
        return {"architectures": [arch], "model_type": t.family, **text, **extra}
    if t.family != "qwen2" or t.mrope_section is None or t.head_dim * t.num_attention_heads != t.hidden_size:
        raise ValueError(
            "only a Qwen2.5-VL-shaped model (Qwen2 LLM with M-RoPE and head_dim = hidden/heads) has a transformers "
            f"class; this model has a {t.family} LLM, so keep it in mindvl's format"
        )
    v = cfg.vision
    vision = {
        "depth": v.depth, "hidden_size": v.hidden_size, "intermediate_size": v.intermediate_size,
        "num_heads": v.num_heads, "in_channels": v.in_channels, "patch_size": v.patch_size,
        "temporal_patch_size": v.temporal_patch_size, "spatial_merge_size": v.spatial_merge_size,
        "window_size": v.window_size, "fullatt_block_indexes": v.fullatt_block_indexes, "hidden_act": v.hidden_act,
        "out_hidden_size": t.hidden_size, "tokens_per_second": cfg.tokens_per_second, "model_type": "qwen2_5_vl",
    }
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl", **text,
        "rope_scaling": {"type": "mrope", "mrope_section": t.mrope_section}, "vision_config": vision,
        "image_token_id": cfg.image_token_id, "video_token_id": cfg.video_token_id,
        "vision_start_token_id": cfg.vision_start_token_id, "vision_end_token_id": cfg.vision_end_token_id,
    }


def export_to_hf(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """mindvl model folder -> transformers model folder, streaming tensor by tensor."""
    src = Path(src)
    cfg = MindVLConfig.from_dict(read_config(src), str(src / CONFIG_NAME))
    config = hf_config(cfg)  # refuses unrepresentable models before anything is written
    keys = key_map(config["model_type"])  # qwen2_5_vl, qwen3, qwen2 or deepseek_v3: the import table, read backwards
    tensors = TensorFolder(src)
    pending: dict[str, torch.Tensor] = {}  # Qwen3-MoE: a layer's expert gate, until its up arrives
    with atomic_output_folder(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, tensor in tensors.iter_tensors():
            if cfg.text.family == "qwen3_moe" and name.endswith(("experts.gate_proj", "experts.up_proj",
                                                                  "experts.down_proj")):
                _write_qwen3_experts(writer, keys, name, tensor, pending)
                continue
            if tensor.is_floating_point() and not name.endswith("e_score_correction_bias"):  # that one stays fp32
                # transformers >= 5 loads in the dtype the config names (4.x reads torch_dtype): state the real one.
                config["torch_dtype"] = config["dtype"] = str(tensor.dtype).removeprefix("torch.")
            if name == "visual.patch_embed.weight":
                v = cfg.vision
                tensor = matmul_to_conv3d(tensor, v.in_channels, v.temporal_patch_size, v.patch_size)
            for hf, piece in keys.hf_tensors(name, tensor):
                writer.add(hf, piece)
        if pending:
            raise ValueError(f"{src}: expert tensors without their pair: {sorted(pending)}")
        writer.close()
        write_side_files(tmp, cfg, [src])
        # bos/eos/pad at the top level of the flat layout: transformers 5 moves them into text_config, where
        # `generate` and the embedding-range checks read them (its class defaults are the real Qwen vocabulary's).
        config.update(token_ids_for_config(tmp))
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    return Path(out)


def _write_qwen3_experts(writer: ShardedWriter, keys, name: str, tensor: torch.Tensor,
                         pending: dict[str, torch.Tensor]) -> None:
    """Qwen3-MoE experts in the hub's layout: gate and up fused into `gate_up_proj [E, H, 2I]`; `down_proj
    [E, I, H]`."""
    base = name.rsplit(".", 1)[0]  # language_model.layers.{l}.mlp.experts
    hf_base = keys.to_hf(base + ".down_proj")[0].rsplit(".", 1)[0]
    if name.endswith("down_proj"):
        writer.add(hf_base + ".down_proj", hf_qwen3_vl.hub_down(tensor))
        return
    pending[name] = tensor
    gate, up = pending.get(base + ".gate_proj"), pending.get(base + ".up_proj")
    if gate is not None and up is not None:
        writer.add(hf_base + ".gate_up_proj", hf_qwen3_vl.hub_gate_up(gate, up))
        del pending[base + ".gate_proj"], pending[base + ".up_proj"]
