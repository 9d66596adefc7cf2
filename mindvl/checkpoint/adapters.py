"""LoRA adapter folders in PEFT's layout: `adapter_config.json` + `adapter_model.safetensors`.

    save_adapter(state, config, lora, out, base="path/to/base", full_modules=["projector"])
    lora, tensors, full = read_adapter(folder, config)     # mindvl names, ready for a model with inject_lora
    model = load_adapted(folder)                          # base (a mindvl folder) + adapter, merged or not
    fold_adapter(folder, out)                             # `mindvl export ADAPTER --merge-adapters --out DIR`

Tensor names are PEFT's for the transformers model the base converts to (mindvl.checkpoint.hf_export): the module
path of that model in memory (transformers >= 4.52: `model.language_model.layers.0.self_attn.q_proj` for Qwen2.5-VL,
`model.layers.0.self_attn.q_proj` for Qwen3) under `base_model.model.`, then `.lora_A.weight` / `.lora_B.weight`.
A module the phase trained in full next to the adapters (e.g. the projector) is saved as PEFT saves
`modules_to_save`: the transformers module that holds it (`model.visual.merger` for the projector, `model.visual`
for the ViT, `model.language_model` and `lm_head` for the LLM), every tensor of that module under its plain name, in
transformers' shapes (the patch embedding as its Conv3d [D, C, T, p, p]). The list is flat: a module inside another
listed one is not listed again (the ViT in full carries its merger, the projector, trained or not). With tied
embeddings a trained LLM lists `lm_head` too, holding the trained embedding: PEFT's copy of the LLM would otherwise
leave the head tied to the base embedding. A model transformers cannot represent (a MindVL composition) keeps
mindvl's own module paths under the same prefix: PEFT has no model to load it onto, mindvl does.

Reading accepts both spellings of Qwen2.5-VL's paths (the hub's `model.layers...` of PEFT adapters saved with older
transformers, and the in-memory one) and keys that still carry PEFT's adapter name (`lora_A.default.weight`), and
undoes the same conversions (a Conv3d patch embedding back to mindvl's matmul rows; a tied model's `lm_head`, which
must equal its embedding, dropped).
What mindvl's LoRA cannot express is refused in one line: DoRA, rsLoRA, per-layer ranks, bias training.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from mindvl.models import MindVLConfig
from mindvl.models.lora import LoRAConfig, inject_lora, is_adapter_name, merge_lora
from mindvl.untrusted import load_json_file, regular_inside

from .conv import conv3d_to_matmul, matmul_to_conv3d
from .hf import CONFIG_NAME, read_config, save_pretrained
from .hf import load_model as load_plain
from .hf_export import hf_config
from .hf_keys import key_map
from .safetensors_io import atomic_output_folder

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
# transformers >= 4.52 keeps Qwen2.5-VL's towers under `model.`: hub prefix -> in-memory prefix (PEFT sees the latter)
_IN_MEMORY = {"qwen2_5_vl": (("visual.", "model.visual."), ("model.", "model.language_model."))}


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def family_of(config: MindVLConfig) -> str:
    """The transformers family the model exports to (its PEFT names), or `mindvl` when it has none."""
    try:
        return hf_config(config)["model_type"]
    except ValueError:
        return "mindvl"


def to_peft_name(name: str, family: str) -> str:
    """A mindvl tensor name -> the transformers in-memory name PEFT uses (without `base_model.model.`)."""
    if family == "mindvl":
        return name
    hf, stacked = key_map(family).to_hf(name)
    if stacked:
        raise ValueError(f"{name}: a stacked expert tensor has no single PEFT name")
    for hub, memory in _IN_MEMORY.get(family, ()):
        if hf.startswith(hub):
            return memory + hf[len(hub):]
    return hf


def from_peft_name(name: str, family: str) -> str:
    """The inverse of `to_peft_name` (either Qwen2.5-VL spelling accepted)."""
    if family == "mindvl":
        return name
    got = key_map(family).to_ours(name)
    if got is None or got.expert is not None:
        raise ValueError(f"{name}: not a tensor mindvl's LoRA adapts")
    return got.name


def _target_regex(modules: list[str]) -> str:
    """One full-match regex over the adapted modules' PEFT paths, layer numbers generalised (PEFT matches a string
    `target_modules` with re.fullmatch, so nothing else of the model is caught)."""
    patterns = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(m)) for m in modules})
    return "^(" + "|".join(patterns) + ")$" if len(patterns) > 1 else "^" + patterns[0] + "$"


def to_peft_tensor(name: str, value: torch.Tensor, config: MindVLConfig) -> torch.Tensor:
    """A mindvl tensor in the shape its transformers module has (the patch embedding: matmul rows -> Conv3d)."""
    if name == "visual.patch_embed.weight" and value.dim() == 2 and family_of(config) != "mindvl":
        v = config.vision
        return matmul_to_conv3d(value, v.in_channels, v.temporal_patch_size, v.patch_size)
    return value


def from_peft_tensor(name: str, value: torch.Tensor) -> torch.Tensor:
    """The inverse of `to_peft_tensor`, for a tensor already named the mindvl way."""
    if name == "visual.patch_embed.weight" and value.dim() == 5:
        return conv3d_to_matmul(value)
    return value


def save_adapter(state: dict[str, torch.Tensor], config: MindVLConfig, lora: LoRAConfig, out: str | os.PathLike,
                 base: str | None = None, full_modules: list[str] | tuple[str, ...] = (),
                 overwrite: bool = True) -> Path:
    """Write the adapters of `state` (the whole state dict of a model with inject_lora: mindvl names) and the
    fully trained top-level `full_modules` as a PEFT adapter folder (module docstring: what `modules_to_save` holds).
    `base`: the base model's folder."""
    from safetensors.torch import save_file

    both = sorted(set(full_modules) & set(lora.modules))
    if both:
        raise ValueError(f"save_adapter: {both} carry adapters, so their base weights are frozen, not fully trained")
    family = family_of(config)
    tensors: dict[str, torch.Tensor] = {}
    adapted: list[str] = []
    for name, value in state.items():
        if is_adapter_name(name):
            module, _, which = name.rpartition(".")
            peft_module = to_peft_name(module + ".weight", family).removesuffix(".weight")
            adapted.append(peft_module)
            tensors[f"{PREFIX}{peft_module}.{which}.weight"] = value
    if not adapted:
        raise ValueError("save_adapter: the state has no LoRA adapters")
    plain = {to_peft_name(name, family): (name, value) for name, value in state.items() if not is_adapter_name(name)}
    tied = config.text.tie_word_embeddings and "language_model.embed_tokens.weight" in state
    listed: set[str] = set()
    for peft, (name, _) in plain.items():
        if name.split(".")[0] in full_modules:
            listed.add(_top_path(peft, family))
    if tied and "language_model" in full_modules and family != "mindvl":
        listed.add("lm_head")  # PEFT's own copy of the head, holding the trained embedding (module docstring)
    to_save = {m for m in listed if not any(m.startswith(other + ".") for other in listed)}  # flat
    inside = sorted({m for m in adapted if any(m.startswith(top + ".") for top in to_save)})
    if inside:
        raise ValueError(f"save_adapter: {sorted(to_save)} trained in full hold adapted layers ({inside[0]}...): PEFT "
                         "cannot load adapters inside a module it saves whole; put the adapters on another module")
    for peft, (name, value) in plain.items():
        if any(peft == top or peft.startswith(top + ".") for top in to_save):
            tensors[PREFIX + peft] = to_peft_tensor(name, value, config)
    if "lm_head" in to_save and tied:
        tensors[PREFIX + "lm_head.weight"] = state["language_model.embed_tokens.weight"].detach().clone()  # own storage
    cfg: dict[str, Any] = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base, "revision": None,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
        "target_modules": _target_regex(adapted), "modules_to_save": sorted(to_save) or None,
        "fan_in_fan_out": False, "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "inference_mode": True, "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    with atomic_output_folder(out, overwrite) as tmp:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp / ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2) + "\n")
    return Path(out)


def _top_path(peft_name: str, family: str) -> str:
    """The module PEFT's `modules_to_save` names for a fully trained parameter: the top-level container of the
    transformers model (`model.visual.merger`, `model.visual`, `model.language_model`, `lm_head`, ...)."""
    parts = peft_name.split(".")
    if family == "mindvl":
        return parts[0]
    if parts[0] == "lm_head":
        return "lm_head"
    if parts[:3] == ["model", "visual", "merger"]:
        return "model.visual.merger"
    if parts[:2] == ["model", "visual"]:
        return "model.visual"
    return ".".join(parts[:2]) if family == "qwen2_5_vl" or parts[:2] == ["model", "language_model"] else "model"


def read_adapter(folder: str | os.PathLike, config: MindVLConfig
                 ) -> tuple[LoRAConfig, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(LoRA config, adapter tensors, fully trained tensors), names mindvl's, for a model of `config`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    where = folder / ADAPTER_CONFIG
    try:  # a received folder: a small regular JSON file, bounded in depth and numbers (mindvl.untrusted)
        raw = load_json_file(where, max_bytes=16 << 20)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: not a readable adapter config ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: not a readable adapter config (a JSON object is expected)")
    if raw.get("peft_type") != "LORA":
        raise ValueError(f"{where}: peft_type {raw.get('peft_type')!r}; mindvl reads LORA adapters only")
    for key, ok in (("use_dora", False), ("use_rslora", False), ("bias", "none"), ("rank_pattern", {}),
                    ("alpha_pattern", {}), ("fan_in_fan_out", False)):
        if raw.get(key, ok) not in (ok, None):
            raise ValueError(f"{where}: {key} = {raw[key]!r} is not supported by mindvl's LoRA (needs {ok!r})")
    family = family_of(config)
    adapters: dict[str, torch.Tensor] = {}
    full: dict[str, torch.Tensor] = {}
    try:  # the weights must be a regular file inside the folder (not a link elsewhere, a FIFO or a device)
        weights = regular_inside(folder, ADAPTER_WEIGHTS, what="adapter weights")
    except (OSError, ValueError) as exc:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: not readable adapter weights ({exc})") from None
    for key, value in load_file(weights).items():
        name = key.removeprefix(PREFIX)
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)(?:\.[^.]+)?\.weight", name)
        if m:
            module = from_peft_name(m.group(1) + ".weight", family).removesuffix(".weight")
            adapters[f"{module}.{m.group(2)}"] = value
        else:
            ours = from_peft_name(name.replace(".modules_to_save.default", ""), family)
            full[ours] = from_peft_tensor(ours, value)
    if not adapters:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS}: no lora_A/lora_B tensors")
    if config.text.tie_word_embeddings and "language_model.lm_head.weight" in full:
        # A tied model has no head of its own: PEFT saved its copy of the head, the (trained) embedding itself.
        head, embed = full.pop("language_model.lm_head.weight"), full.get("language_model.embed_tokens.weight")
        if embed is None or not torch.equal(head, embed):
            raise ValueError(f"{folder}: saves an lm_head apart from the embedding, but the base ties the two "
                             "(tie_word_embeddings); an adapter of an untied base?")
    modules = sorted({n.split(".")[0] for n in adapters})
    targets = sorted({n.rsplit(".", 2)[-2] for n in adapters})
    lora = LoRAConfig(r=int(raw["r"]), alpha=float(raw.get("lora_alpha", raw["r"])),
                      dropout=float(raw.get("lora_dropout", 0.0)), targets=targets, modules=modules)
    lora._check_built("adapter_config")
    return lora, adapters, full


def apply_adapter(model: torch.nn.Module, folder: str | os.PathLike, merge: bool = False) -> torch.nn.Module:
    """Put an adapter folder's adapters (and fully trained modules) onto a plain MindVL; `merge` folds them in."""
    lora, adapters, full = read_adapter(folder, model.config)
    names = inject_lora(model, lora)
    expected = {f"{n}.{w}" for n in names for w in ("lora_A", "lora_B")}
    if set(adapters) != expected:
        extra, missing = sorted(set(adapters) - expected), sorted(expected - set(adapters))
        raise ValueError(f"{folder}: adapters do not match the model's {lora.targets} layers "
                         f"(unexpected {extra[:3]}, missing {missing[:3]})")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in {**adapters, **full}.items():
            if name not in params:
                raise ValueError(f"{folder}: {name} is not a tensor of the base model")
            if tuple(params[name].shape) != tuple(value.shape):
                raise ValueError(f"{folder}: {name} has shape {tuple(value.shape)}, the model "
                                 f"{tuple(params[name].shape)} (an adapter of another base?)")
            params[name].copy_(value.to(params[name].dtype))
    return merge_lora(model) if merge else model


def adapter_base(folder: str | os.PathLike, base: str | os.PathLike | None = None) -> Path:
    """The base model folder of an adapter: `base` when given, else its config's base_model_name_or_path (relative
    paths are read from the adapter folder)."""
    if base is not None:
        return Path(base)
    where = Path(folder) / ADAPTER_CONFIG
    try:
        raw = load_json_file(where, max_bytes=16 << 20)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: not a readable adapter config ({exc})") from None
    given = raw.get("base_model_name_or_path") if isinstance(raw, dict) else None
    if not given:
        raise ValueError(f"{folder}/{ADAPTER_CONFIG}: base_model_name_or_path is empty; give the base model folder")
    path = Path(given)
    return path if path.is_absolute() else Path(folder) / path


def load_adapted(folder: str | os.PathLike, base: str | os.PathLike | None = None, merge: bool = True,
                 dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> torch.nn.Module:
    """The base (a mindvl model folder) with the adapter folder's adapters, merged by default (chat, eval)."""
    base_folder = adapter_base(folder, base)
    kind = read_config(base_folder).get("model_type") if (base_folder / CONFIG_NAME).is_file() else None
    if kind is not None and kind != "mindvl":  # e.g. PEFT's adapters name the transformers folder they were made on
        raise ValueError(f"{folder}: its base {base_folder} is a {kind!r} checkpoint; import it first (mindvl convert "
                         f"--from-hf {base_folder} --out OUT) and give OUT as the base (--base OUT)")
    model = load_plain(base_folder, dtype=None, device=device)
    model = apply_adapter(model, folder, merge=merge)
    return model.to(dtype) if dtype is not None else model


def fold_adapter(folder: str | os.PathLike, out: str | os.PathLike, base: str | os.PathLike | None = None,
                 overwrite: bool = False) -> Path:
    """`mindvl export ADAPTER --merge-adapters`: the base with the adapters folded in, written as a mindvl model folder
    (side files from the base). Holds the model in memory once, in the base's dtype."""
    base_folder = adapter_base(folder, base)
    model = load_adapted(folder, base=base_folder, merge=True)
    return save_pretrained(model, out, overwrite=overwrite, side_files_from=[base_folder])


def load_model(folder: str | os.PathLike, dtype: torch.dtype | None = None,
               device: torch.device | str = "cpu") -> torch.nn.Module:
    """`mindvl.checkpoint.load_model`: a mindvl model folder (checkpoint.hf.load_model), or an adapter folder loaded
    as its base with the adapters merged in (what chat and eval read)."""
    folder = Path(folder)
    if not (folder / CONFIG_NAME).is_file() and is_adapter_folder(folder):
        return load_adapted(folder, dtype=dtype, device=device).eval()
    return load_plain(folder, dtype=dtype, device=device)
