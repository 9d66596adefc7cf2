"""Import HuggingFace checkpoints into mindvl model folders, and load/save those folders.

Supported sources (detected from config.json `model_type`):
- `qwen2_5_vl`: a Qwen2.5-VL model; its merger becomes the projector, its Qwen2 LLM the language model (M-RoPE).
- `qwen3` / `qwen2`: a causal LM, imported as a text-only model (no vision tower).
- `deepseek_v3`: a DeepSeek-V3-architecture MoE causal LM (MLA + DeepSeek-MoE), text-only. Routed experts are
  stored per expert on the hub (`mlp.experts.{e}.{gate,up,down}_proj.weight`, also what transformers 5.x's
  save_pretrained writes) or fused (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`, transformers 5.x's
  in-memory form); both are read and stacked into mindvl's `mlp.experts.{gate,up,down}_proj [E, ...]`. Multi-token
  prediction layers (index >= num_hidden_layers) are dropped; FP8 checkpoints are refused (dequantize them first).
- `qwen3_vl` / `qwen3_vl_moe`: a Qwen3-VL model (hf_qwen3_vl.py): its merger becomes the projector, its DeepStack
  mergers `projector.deepstack.{j}`, its Qwen3 / Qwen3-MoE LLM the language model (interleaved M-RoPE).
- `qwen3_5` / `qwen3_5_moe`: a Qwen3.5 model (hf_qwen3_5.py): Qwen3-VL's tower without DeepStack, a hybrid
  linear/full-attention LLM (dense, or MoE with a gated shared expert); its `mtp.*` tensors are dropped.
  `qwen3_5_text` / `qwen3_5_moe_text`: that language model alone (`Qwen3_5ForCausalLM`), text-only.
- `mindvl`: already ours.

A MindVL *composition* takes the vision tower of a Qwen2.5-VL or Qwen3-VL checkpoint and the language model of
another (e.g. Qwen3-8B) and adds a freshly, seededly initialised projector (and DeepStack mergers for Qwen3-VL), as
the paper does.

Both config.json generations are read: hub-style flat text fields with `rope_scaling`, and transformers >= 5's
nested `text_config` with `rope_parameters`. Tensor names may use the hub prefixes (`visual.`, `model.`) or
transformers >= 4.52's in-memory ones (`model.visual.`, `model.language_model.`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig
from mindvl.models.projector import Projector

from . import hf_qwen3_5, hf_qwen3_vl
from .conv import conv3d_to_matmul
from .hf_keys import ImportName, key_map
from .safetensors_io import DEFAULT_SHARD_BYTES, ShardedWriter, TensorFolder, atomic_output_folder
from .side_files import KEEP_SYSTEM, Pixels, added_token_ids, read_json, write_side_files

CONFIG_NAME = "config.json"
SPECIAL_TOKENS = {
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
}

def _is_conv_patch_embed(name: str, ndim: int) -> bool:
    return name == "visual.patch_embed.weight" and ndim == 5


def _convert_tensor(name: str, tensor: torch.Tensor) -> torch.Tensor:
    return conv3d_to_matmul(tensor) if _is_conv_patch_embed(name, tensor.dim()) else tensor


def _converted_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape `_convert_tensor` will give, known from the file header alone (nothing is loaded)."""
    return (shape[0], int(torch.Size(shape[1:]).numel())) if _is_conv_patch_embed(name, len(shape)) else tuple(shape)


_FUSED_GATE_UP = re.compile(r"^(language_model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_EXPERT_TENSOR = re.compile(r"^(model\.)?(language_model\.)?layers\.\d+\.mlp\.experts\.(gate_up|down)_proj$")
_LAYER_INDEX = re.compile(r"^language_model\.layers\.(\d+)\.")


class TensorPlan:
    """How the tensors of a HF folder become mindvl tensors, known from the headers before anything is loaded.

    `names` maps HF names to mindvl names (the family's `hf_keys` table, already filtered). Most tensors are renamed
    (and the patch embedding reshaped); for a deepseek_v3 LLM, per-expert tensors are stacked into
    `experts.{proj}_proj [E, ...]` (the table names the stack), a fused `experts.gate_up_proj [E, 2I, H]` (gate
    rows first) is split in two, and multi-token prediction layers past `num_hidden_layers` are dropped. `tensors()`
    streams the results; a stack is held only until its last expert has been read.
    """

    def __init__(self, folder: TensorFolder, names: dict[str, ImportName], text: TextConfig) -> None:
        fp8 = [h for h in names if h.endswith("weight_scale_inv")]
        if fp8:
            raise ValueError(f"{folder.folder}: an FP8 checkpoint ({fp8[0]} ...); dequantize it to bf16 first")
        self.folder, self.num_experts, self.text = folder, text.n_routed_experts, text
        self.direct: dict[str, str] = {}
        self.stacks: dict[str, dict[int, str]] = {}  # mindvl name -> {expert: HF name}
        self.splits: dict[str, tuple[str, str]] = {}  # HF fused gate_up -> (mindvl gate, mindvl up)
        for hf, target in names.items():
            name = target.name
            layer = _LAYER_INDEX.match(name)
            if text.is_moe and layer and int(layer.group(1)) >= text.num_hidden_layers:
                continue  # DeepSeek-V3's MTP module (model.layers.61 on the hub); transformers ignores it too
            fused = _FUSED_GATE_UP.match(name) if text.has_experts else None
            if target.expert is not None:
                self.stacks.setdefault(name, {})[target.expert] = hf
            elif fused:
                self.splits[hf] = (f"{fused.group(1)}.gate_proj", f"{fused.group(1)}.up_proj")
            else:
                self.direct[hf] = name
        for name, pieces in self.stacks.items():
            absent = sorted(set(range(self.num_experts)) - set(pieces))
            extra = sorted(set(pieces) - set(range(self.num_experts)))
            if absent or extra:
                raise ValueError(f"{folder.folder}: {name} has experts {sorted(pieces)[:8]}... but the config has "
                                 f"{self.num_experts} (missing {absent[:8]}, unexpected {extra[:8]})")

    def _transposed(self, name: str, shape: tuple[int, ...]) -> bool:
        """Qwen3-MoE experts stored in the hub's [E, in, out] layout (hf_qwen3_vl.experts_transposed)."""
        if self.text.family != "qwen3_moe" or not _EXPERT_TENSOR.match(name):
            return False
        return hf_qwen3_vl.experts_transposed("down" if name.endswith("down_proj") else "gate_up", shape, self.text)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        hf = self.folder.shapes()
        hf = {h: (s[0], s[2], s[1]) if self._transposed(self.direct.get(h, h), s) else s for h, s in hf.items()}
        out = {name: _converted_shape(name, hf[h]) for h, name in self.direct.items()}
        for name, pieces in self.stacks.items():
            out[name] = (len(pieces), *hf[pieces[0]])
        for h, (gate, up) in self.splits.items():
            e, two_i, hidden = hf[h]
            out[gate] = out[up] = (e, two_i // 2, hidden)
        return out

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        owner = {h: name for name, pieces in self.stacks.items() for h in pieces.values()}
        pending: dict[str, dict[str, torch.Tensor]] = {}
        wanted = [*self.direct, *owner, *self.splits]
        for h, tensor in self.folder.iter_tensors(wanted):
            if h in self.direct:
                if self._transposed(self.direct[h], tuple(tensor.shape)):
                    tensor = tensor.transpose(1, 2)
                yield self.direct[h], _convert_tensor(self.direct[h], tensor).contiguous()
            elif h in self.splits:
                if self._transposed(h, tuple(tensor.shape)):
                    tensor = tensor.transpose(1, 2)
                gate, up = tensor.chunk(2, dim=1)
                yield self.splits[h][0], gate.contiguous()
                yield self.splits[h][1], up.contiguous()
            else:
                name = owner[h]
                got = pending.setdefault(name, {})
                got[h] = tensor
                if len(got) == self.num_experts:
                    yield name, torch.stack([got[self.stacks[name][e]] for e in range(self.num_experts)])
                    del pending[name]


# ---------------------------------------------------------------------------------------------------- configs


def read_config(folder: str | os.PathLike) -> dict:
    path = Path(folder) / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model folder needs its config.json")
    return read_json(path)


def _rope(text: dict) -> tuple[float, list[int] | None]:
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling") or {}
    theta = text.get("rope_theta", params.get("rope_theta", 10000.0))
    section = scaling.get("mrope_section", params.get("mrope_section"))
    kind = scaling.get("rope_type", scaling.get("type", params.get("rope_type", "default")))
    if kind not in ("default", "mrope"):
        raise ValueError(f"rope scaling type {kind!r} is not supported yet (default RoPE and M-RoPE are)")
    return float(theta), (list(section) if section else None)


def text_config_from_hf(config: dict, family: str) -> TextConfig:
    # transformers >= 5 nests the LLM under text_config; hub configs keep it flat. Top-level keys are the fallback.
    text = {**config, **(config.get("text_config") or {})}
    if family == "deepseek_v3":
        return deepseek_text_config_from_hf(text, config)
    theta, section = _rope(text)
    heads = text["num_attention_heads"]
    return TextConfig(
        family=family,
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=text.get("num_key_value_heads", heads),
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        mrope_section=section,
        max_position_embeddings=text.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        hidden_act=text.get("hidden_act", "silu"),
    )


_DEEPSEEK_KEYS = (
    "moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
    "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
)
# transformers' DeepseekV3Config defaults, for keys a config.json may leave out (its class fills them the same way).
_DEEPSEEK_HF_DEFAULTS = {"n_shared_experts": 1, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
                         "routed_scaling_factor": 2.5, "norm_topk_prob": True, "q_lora_rank": 1536}


def deepseek_text_config_from_hf(text: dict, config: dict) -> TextConfig:
    """DeepseekV3Config (hub `rope_scaling` + `rope_theta`, or transformers 5's `rope_parameters`) -> TextConfig."""
    params = dict(text.get("rope_parameters") or {})
    scaling = dict(text.get("rope_scaling") or {}) or params
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "yarn"):
        raise ValueError(f"deepseek_v3 rope scaling type {kind!r} is not supported (default RoPE and yarn are)")
    rope_scaling = None
    if kind == "yarn":
        rope_scaling = {k: v for k, v in scaling.items() if k not in ("type", "rope_theta")}
        rope_scaling["rope_type"] = "yarn"
    # Hub configs name the routing scheme (read by DeepSeek's own modeling code); mindvl implements V3's.
    for key, supported in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc"), ("moe_layer_freq", 1)):
        if text.get(key, supported) != supported:
            raise ValueError(f"deepseek_v3 config.json: {key}={text[key]!r} is not supported (only {supported!r})")
    missing = [k for k in _DEEPSEEK_KEYS if k not in text and k not in _DEEPSEEK_HF_DEFAULTS]
    if missing:
        raise ValueError(f"deepseek_v3 config.json lacks {missing}")
    moe = {k: text.get(k, _DEEPSEEK_HF_DEFAULTS.get(k)) for k in _DEEPSEEK_KEYS}
    heads = text["num_attention_heads"]
    return TextConfig(
        family="deepseek_v3",
        vocab_size=text["vocab_size"],
        hidden_size=text["hidden_size"],
        intermediate_size=text["intermediate_size"],
        num_hidden_layers=text["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=float(text.get("rope_theta", params.get("rope_theta", 10000.0))),
        max_position_embeddings=text.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        hidden_act=text.get("hidden_act", "silu"),
        rope_interleave=bool(text.get("rope_interleave", True)),
        rope_scaling=rope_scaling,
        attention_bias=bool(text.get("attention_bias", False)),
        **moe,
    )


def vision_config_from_hf(config: dict) -> VisionConfig:
    v = config["vision_config"]
    theta = (v.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return VisionConfig(
        depth=v["depth"],
        hidden_size=v["hidden_size"],
        intermediate_size=v["intermediate_size"],
        num_heads=v["num_heads"],
        in_channels=v.get("in_channels", v.get("in_chans", 3)),
        patch_size=v.get("patch_size", v.get("spatial_patch_size", 14)),
        temporal_patch_size=v.get("temporal_patch_size", 2),
        spatial_merge_size=v.get("spatial_merge_size", 2),
        window_size=v.get("window_size", 112),
        fullatt_block_indexes=list(v.get("fullatt_block_indexes", [7, 15, 23, 31])),
        hidden_act=v.get("hidden_act", "silu"),
        rope_theta=theta,
    )


def detect_family(config: dict, where: str) -> str:
    kind = config.get("model_type")
    if kind in ("qwen2_5_vl", "qwen3", "qwen2", "deepseek_v3", "mindvl", *hf_qwen3_vl.FAMILIES,
                *hf_qwen3_5.FAMILIES, *hf_qwen3_5.TEXT_FAMILIES):
        return kind
    raise ValueError(
        f"{where}: model_type {kind!r} is not supported; mindvl imports qwen2_5_vl, qwen3_vl, qwen3_vl_moe, qwen3_5 "
        "(vision+LLM), qwen3, qwen2, deepseek_v3 and qwen3_5_text (LLM)"
    )


def _token_ids(config: dict, tokenizer_folder: Path | None) -> dict[str, int]:
    """Vision special-token ids: from the tokenizer when present, else from config.json, else Qwen's defaults."""
    ids = {name: config[name] for name in SPECIAL_TOKENS if name in config}
    added = added_token_ids(tokenizer_folder) if tokenizer_folder else {}
    for name, text in SPECIAL_TOKENS.items():
        if text in added:
            ids[name] = added[text]
    return ids


def compose_token_ids(language_from: str | os.PathLike) -> tuple[dict[str, int], int]:
    """(vision special-token ids, vocabulary size) that `compose` will give a model with this language model."""
    raw = read_config(language_from)
    text = {**raw, **(raw.get("text_config") or {})}
    return _token_ids(raw, Path(language_from)), int(text["vocab_size"])


def mindvl_config_from_hf(config: dict, folder: Path) -> MindVLConfig:
    """A transformers config.json (or a mindvl one) -> MindVLConfig; errors name the file and the key."""
    where = str(Path(folder) / CONFIG_NAME)
    try:
        return _mindvl_config_from_hf(config, Path(folder))
    except KeyError as exc:  # a required key the converters index directly
        raise ValueError(f"{where}: missing key {exc}; is it a complete transformers config.json?") from None
    except ValueError as exc:
        raise ValueError(str(exc) if str(exc).startswith(where) else f"{where}: {exc}") from None


# Sizes the converters compute with (head_dim = hidden_size // heads) before any dataclass can check them.
_INT_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _mindvl_config_from_hf(config: dict, folder: Path) -> MindVLConfig:
    for section, values in (("", config), ("text_config.", config.get("text_config") or {})):
        for key in _INT_KEYS:
            value = values.get(key) if isinstance(values, dict) else None
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{section}{key} must be an integer, got {value!r}")
    family = detect_family(config, str(folder / CONFIG_NAME))
    if family == "mindvl":
        return MindVLConfig.from_dict(config, str(folder / CONFIG_NAME))
    if family in hf_qwen3_vl.FAMILIES:
        return hf_qwen3_vl.mindvl_config(config, family, _token_ids(config, folder), {"converted_from": str(folder)})
    if family in (*hf_qwen3_5.FAMILIES, *hf_qwen3_5.TEXT_FAMILIES):
        return hf_qwen3_5.mindvl_config(config, family, _token_ids(config, folder), {"converted_from": str(folder)})
    if family == "qwen2_5_vl":
        text = text_config_from_hf(config, "qwen2")
        vision = vision_config_from_hf(config)
        out_hidden = config["vision_config"].get("out_hidden_size", text.hidden_size)
        if out_hidden != text.hidden_size:
            raise ValueError(f"{folder}: vision out_hidden_size {out_hidden} != text hidden_size {text.hidden_size}")
        tps = config["vision_config"].get("tokens_per_second", 2)
        return MindVLConfig(text=text, vision=vision, tokens_per_second=tps, source={"converted_from": str(folder)},
                            **_token_ids(config, folder))
    return MindVLConfig(text=text_config_from_hf(config, family), vision=None,
                        source={"converted_from": str(folder)}, **_token_ids(config, folder))


# ----------------------------------------------------------------------------------------------- load / save


def expected_shapes(config: MindVLConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = MindVL(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_tensors(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], where: str) -> None:
    """One error listing every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    misshaped = sorted(f"{n}: checkpoint {found[n]} vs model {expected[n]}"
                       for n in set(found) & set(expected) if tuple(found[n]) != tuple(expected[n]))
    if missing or unexpected or misshaped:
        parts = []
        for label, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                shown = ", ".join(items[:20]) + (f", ... ({len(items) - 20} more)" if len(items) > 20 else "")
                parts.append(f"{len(items)} {label}: {shown}")
        raise ValueError(f"{where} does not match its config: " + "; ".join(parts))


def load_model(folder: str | os.PathLike, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> MindVL:
    """A mindvl model folder (sharded safetensors + config.json, as `mindvl convert`/`export` write) -> MindVL in
    eval mode. Built on the meta device and filled tensor by tensor from the folder (no full-size init). This is
    where loading lives: models know nothing of files. (`mindvl.checkpoint.load_model` also reads adapter folders:
    checkpoint.adapters.load_model.)"""
    folder = Path(folder)
    config = read_config(folder)
    if config.get("model_type") != "mindvl":
        raise ValueError(f"{folder} is a {config.get('model_type')!r} checkpoint; import it first: "
                         f"mindvl convert --from-hf {folder} --out OUT")
    cfg = MindVLConfig.from_dict(config, str(folder / CONFIG_NAME))
    tensors = TensorFolder(folder)
    try:  # on the meta device: a config describing an impossible model fails here, allocating nothing
        expected = expected_shapes(cfg)
    except (RuntimeError, TypeError, OverflowError) as exc:
        raise ValueError(f"{folder / CONFIG_NAME}: describes a model that cannot be built ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0][:200]})") from None
    check_tensors(tensors.shapes(), expected, str(folder))
    with torch.device("meta"):
        model = MindVL(cfg)
    state = {}
    for name, tensor in tensors.iter_tensors():
        cast = dtype if dtype is not None and tensor.is_floating_point() and not _keep_fp32(name) else None
        state[name] = tensor.to(device=device, dtype=cast)
    model.load_state_dict(state, assign=True, strict=True)
    for module in model.modules():  # non-persistent buffers (an MoE router's load counts) are not saved: zeros
        for key, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[key] = torch.zeros_like(buf, device=device)
    return model.eval()




def _keep_fp32(name: str) -> bool:
    """Tensors loaded in float32 whatever dtype is asked: the MoE routers' correction bias (as transformers does)."""
    return name.endswith("e_score_correction_bias")


def save_pretrained(model: MindVL, out: str | os.PathLike, overwrite: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    side_files_from: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
                    pixels: Pixels | None = None, tokenizer_from: str | os.PathLike | None = None,
                    system: str | None = KEEP_SYSTEM) -> Path:
    """Write config.json + sharded safetensors + side files (tokenizer, generation and processor configs, taken from
    the `side_files_from` folder(s) when they have them; see side_files.py), atomically. `pixels`: the (min, max)
    pixels the model was trained with, for its processor config; `tokenizer_from`: the tokenizer it was trained with
    (default: the first `side_files_from` folder that has one); `system`: the system turn it was trained with, which
    its chat template then adds by default (default: the template's own)."""
    if side_files_from is None or isinstance(side_files_from, str | os.PathLike):
        side_files_from = [side_files_from]
    with atomic_output_folder(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, tensor in model.state_dict().items():
            writer.add(name, tensor)
        writer.close()
        _write_config(tmp, model.config)
        write_side_files(tmp, model.config, list(side_files_from), pixels, tokenizer_from, system)
    return Path(out)


def _write_config(folder: Path, config: MindVLConfig) -> None:
    (folder / CONFIG_NAME).write_text(json.dumps(config.to_dict(), indent=2) + "\n")


# -------------------------------------------------------------------------------------------------- convert


def _import_names(tensors: TensorFolder, family: str, tied: bool) -> dict[str, ImportName]:
    """{HF name: what it becomes} for the tensors of a `family` folder that mindvl keeps."""
    keys = key_map(family)
    names = {h: keys.to_ours(h) for h in tensors.names()}
    names = {h: n for h, n in names.items() if n is not None}
    if tied:  # some exports store the tied copy anyway
        names = {h: n for h, n in names.items() if n.name != "language_model.lm_head.weight"}
    return names


def convert_from_hf(src: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                    tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Import a local HF checkpoint (the families above), streaming tensor by tensor (memory ~ one shard).
    `tokenizer_from`: a tokenizer folder to copy in (default: the source's own), checked against the model first."""
    src = Path(src)
    raw = read_config(src)
    cfg = mindvl_config_from_hf(raw, src)
    if tokenizer_from is not None:
        from mindvl.data.tokenizer import load_tokenizer

        from .side_files import tokenizer_mismatches

        wrong = tokenizer_mismatches(cfg, load_tokenizer(tokenizer_from))
        if wrong:
            raise ValueError(f"--tokenizer {tokenizer_from} does not fit {src} ({'; '.join(wrong)}); give the "
                             "tokenizer that model was released with")
    tensors = TensorFolder(src)
    family = detect_family(raw, str(src / CONFIG_NAME))
    plan = TensorPlan(tensors, _import_names(tensors, family, cfg.text.tie_word_embeddings), cfg.text)
    check_tensors(plan.shapes(), expected_shapes(cfg), str(src))
    with atomic_output_folder(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for name, tensor in plan.tensors():
            writer.add(name, tensor)
        writer.close()
        _write_config(tmp, cfg)
        write_side_files(tmp, cfg, [src], tokenizer_from=tokenizer_from)
    return Path(out)


def default_mrope_section(head_dim: int) -> list[int]:
    """Qwen2.5-VL's split of the rotary frequencies, [16, 24, 24] for head_dim 128, scaled to other head sizes."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def compose(vision_from: str | os.PathLike, language_from: str | os.PathLike, out: str | os.PathLike,
            seed: int = 0, position_encoding: str = "mrope", overwrite: bool = False,
            max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """A MindVL model: the vision tower of `vision_from` (a Qwen2.5-VL), the LLM of `language_from`, a new projector.

    The projector is initialised from `seed` alone (normal(0, 0.02) weights, zero biases, unit norm), in the
    language model's dtype. `position_encoding` is `mrope` (3-D positions for image tokens; text-only positions are
    unchanged, so the LLM's text behaviour is exactly preserved) or `rope` (plain 1-D positions).
    """
    vision_from, language_from = Path(vision_from), Path(language_from)
    vcfg_raw = read_config(vision_from)
    vision_family = detect_family(vcfg_raw, str(vision_from / CONFIG_NAME))
    if vision_family not in ("qwen2_5_vl", *hf_qwen3_vl.FAMILIES):
        raise ValueError(f"{vision_from}: --vision-from must be a Qwen2.5-VL checkpoint (model_type qwen2_5_vl) or a "
                         "Qwen3-VL one (qwen3_vl, qwen3_vl_moe)")
    qwen3 = vision_family in hf_qwen3_vl.FAMILIES
    lcfg_raw = read_config(language_from)
    lang_family = detect_family(lcfg_raw, str(language_from / CONFIG_NAME))
    if lang_family not in ("qwen3", "qwen2", "deepseek_v3"):
        raise ValueError(f"{language_from}: --language-from must be a qwen3, qwen2 or deepseek_v3 causal LM, "
                         f"not {lang_family!r}")
    if position_encoding not in ("mrope", "rope"):
        raise ValueError(f"position_encoding must be 'mrope' or 'rope', not {position_encoding!r}")
    text = text_config_from_hf(lcfg_raw, lang_family)
    section = hf_qwen3_vl.default_mrope_section if qwen3 else default_mrope_section
    text.mrope_section = section(text.head_dim) if position_encoding == "mrope" else None
    text.mrope_interleaved = qwen3 and position_encoding == "mrope"  # Qwen3-VL's tower was trained with it
    vision = hf_qwen3_vl.vision_config(vcfg_raw) if qwen3 else vision_config_from_hf(vcfg_raw)
    cfg = MindVLConfig(
        text=text, vision=vision, projector_seed=seed,
        tokens_per_second=vcfg_raw["vision_config"].get("tokens_per_second", 2),
        source={"vision_from": str(vision_from), "language_from": str(language_from)},
        **_token_ids(lcfg_raw, language_from),
    )
    expected = expected_shapes(cfg)
    vis = TensorFolder(vision_from)
    lang = TensorFolder(language_from)
    vis_names = {h: n.name for h, n in _import_names(vis, vision_family, False).items()
                 if n.name.startswith("visual.")}
    vis_shapes = vis.shapes()
    lang_plan = TensorPlan(lang, _import_names(lang, lang_family, text.tie_word_embeddings), text)
    found = {n: _converted_shape(n, vis_shapes[h]) for h, n in vis_names.items()}
    found.update(lang_plan.shapes())
    if qwen3:  # Qwen3-VL's merger layout, with new DeepStack mergers inside the projector
        proj_state = hf_qwen3_vl.fresh_mergers(cfg.vision, text.hidden_size, seed)
    else:
        projector = Projector(cfg.vision.hidden_size, text.hidden_size, cfg.vision.merge_unit)
        projector.reset_parameters(torch.Generator().manual_seed(seed))
        proj_state = {f"projector.{k}": v for k, v in projector.state_dict().items()}
    found.update({n: tuple(t.shape) for n, t in proj_state.items()})
    check_tensors(found, expected, f"composition of {vision_from} + {language_from}")

    with atomic_output_folder(out, overwrite) as tmp:
        writer = ShardedWriter(tmp, max_shard_bytes)
        for h, tensor in vis.iter_tensors(list(vis_names)):
            writer.add(vis_names[h], _convert_tensor(vis_names[h], tensor))
        dtype = None
        for name, tensor in lang_plan.tensors():
            if not _keep_fp32(name):
                dtype = dtype or tensor.dtype
            writer.add(name, tensor)
        for name, tensor in proj_state.items():
            writer.add(name, tensor.to(dtype or torch.float32))
        writer.close()
        _write_config(tmp, cfg)
        # The tokenizer (and generation defaults) are the language model's, the image processor the vision tower's.
        write_side_files(tmp, cfg, [language_from, vision_from])
    return Path(out)
