"""What a run reads, decided and checked before anything is built: the tokenizer and the model folder it starts from.

    tok, tokenizer_dir, side_files = preflight(recipe, data_cfg)     # what trainer.py calls; in steps:
    tokenizer_dir = tokenizer_source(recipe)       # data.tokenizer, else the init_from / compose language folder's
    tok = load_tokenizer(tokenizer_dir)
    check_inputs(recipe, tok)                       # one-line errors naming both files when they disagree

A tokenizer that is not the model's makes the first step fail far from the cause ("the text has 0 image-pad
tokens") or, worse, trains on the wrong token ids; an image resolution silently different from the one the starting
model was trained with changes what the run learns. Both are caught here, before composition or weight loading.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mindvl.checkpoint.hf import CONFIG_NAME, compose_token_ids, read_config
from mindvl.checkpoint.safetensors_io import TensorFolder
from mindvl.checkpoint.side_files import processor_pixels, tokenizer_mismatches
from mindvl.config import Recipe
from mindvl.data import DataConfig
from mindvl.data.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from mindvl.data.processors import (
    PREPROCESSOR_CONFIG,
    QWEN2_VL,
    QWEN3_VL,
    VisionProcessing,
    processing_from_folder,
)
from mindvl.data.tokenizer import DEFAULT_TOKENIZER_PATH, TextTokenizer, load_tokenizer
from mindvl.models import MindVLConfig, VisionConfig


def preflight(recipe: Recipe, data_cfg: DataConfig) -> tuple[TextTokenizer, str, dict[str, Any]]:
    """(the run's tokenizer, its folder, the side files of its exports) after `check_inputs`. The side files are
    {"from": [the start model's folder], "pixels": [min, max] trained, "system": data.default_system}, what `final/`
    and `mindvl export` write (the system turn becomes the chat template's default)."""
    from .lora import check_lora_recipe

    check_lora_recipe(recipe)  # model.lora's keys and values, QLoRA's backend: before the run folder is claimed
    tokenizer_dir = tokenizer_source(recipe)
    tok = load_tokenizer(tokenizer_dir)
    check_inputs(recipe, tok)
    start = start_folder(recipe)
    side_files = {"from": [str(start)] if start else [], "pixels": [data_cfg.min_pixels, data_cfg.max_pixels],
                  "system": data_cfg.default_system}
    return tok, tokenizer_dir or str(DEFAULT_TOKENIZER_PATH.parent), side_files


def start_folder(recipe: Recipe) -> Path | None:
    """The mindvl model folder the run starts from: `init_from`, or the composition under output_dir (None for a
    seeded random `arch`). Its side files (generation and processor configs) carry over to the run's `final/`."""
    m = recipe.model
    if m.init_from:
        return Path(m.init_from)
    if m.compose is not None:
        return Path(recipe.output_dir) / "composed"
    return None


def tokenizer_source(recipe: Recipe) -> str | None:
    """`data.tokenizer` when set; else the folder the model comes from (init_from, or compose's language model)
    when it holds a tokenizer.json; else None (mindvl's built-in tokenizer, which `arch` models are built on)."""
    given = recipe.data.tokenizer
    if given:
        return str(given)
    m = recipe.model
    folder = Path(m.init_from) if m.init_from else Path(m.compose["language"]) if m.compose else None
    if folder is not None and (folder / "tokenizer.json").is_file():
        return str(folder)
    return None


def check_inputs(recipe: Recipe, tok: TextTokenizer) -> None:
    """Fail in one line naming both files when the tokenizer does not fit the model the run starts from, or when
    the recipe leaves the image resolution unset while the init_from model was trained at another one (a fresh
    composition has no MindVL training resolution yet, so its vision tower's processor config is not binding)."""
    m = recipe.model
    if m.init_from:
        where = Path(m.init_from) / CONFIG_NAME
        if not where.is_file():
            raise FileNotFoundError(f"model.init_from: {m.init_from} is not a mindvl model folder (no {CONFIG_NAME})")
        TensorFolder(m.init_from)  # a folder without weights fails here, naming it, not after the model is built
        _check_tokenizer(MindVLConfig.from_dict(read_config(m.init_from), str(where)), tok, str(where))
        _check_pixels(recipe, Path(m.init_from))
    elif m.compose is not None:
        language = Path(m.compose["language"])
        ids, vocab = compose_token_ids(language)
        wrong = [f"tokenizer has {tok.vocab_size} tokens but the language model's vocabulary holds {vocab}"
                 ] if tok.vocab_size > vocab else []
        pairs = {"image_token_id": tok.special.image_pad, "vision_start_token_id": tok.special.vision_start,
                 "vision_end_token_id": tok.special.vision_end}
        wrong += [f"{k}: model {ids[k]} vs tokenizer {v}" for k, v in pairs.items() if k in ids and ids[k] != v]
        if wrong:
            raise ValueError(f"tokenizer {tok.name} does not match {language / CONFIG_NAME} ({'; '.join(wrong)}); "
                             "set data.tokenizer to the language model's tokenizer folder (or leave it unset)")


def _check_tokenizer(config: MindVLConfig, tok: TextTokenizer, where: str) -> None:
    wrong = tokenizer_mismatches(config, tok)
    if wrong:
        raise ValueError(f"tokenizer {tok.name} does not match {where} ({'; '.join(wrong)}); set data.tokenizer to "
                         "the model's tokenizer folder (or leave it unset to use the model folder's)")


def _check_pixels(recipe: Recipe, folder: Path) -> None:
    trained = processor_pixels(folder)
    if trained is None:
        return
    defaults = {"min_pixels": DEFAULT_MIN_PIXELS, "max_pixels": DEFAULT_MAX_PIXELS}
    for key, value in zip(("min_pixels", "max_pixels"), trained, strict=True):
        if key not in recipe.data_keys_given and value != defaults[key]:
            raise ValueError(
                f"data.{key} is not set (default {defaults[key]}) but {folder / 'preprocessor_config.json'} has "
                f"{key} {value}: set data.min_pixels and data.max_pixels in the recipe (the folder's values "
                f"{trained[0]} and {trained[1]} continue its training resolution)")


def vision_processing_for(recipe: Recipe, config: MindVLConfig) -> tuple[VisionProcessing | None, str]:
    """(the vision processor the model takes, where it was read): the `init_from` folder's or the composed vision
    folder's processor configs (mindvl.data.processors.processing_from_folder) when they exist, else the defaults of
    the vision tower's family at its patch/merge sizes (a random `arch` model, a planner preset). None: no tower."""
    v = config.vision
    if v is None:
        return None, "no vision tower"
    m = recipe.model
    folder = Path(m.init_from) if m.init_from else Path(m.compose["vision"]) if m.compose else None
    if folder is not None and (folder / PREPROCESSOR_CONFIG).is_file():
        return processing_from_folder(folder), str(folder / PREPROCESSOR_CONFIG)
    base = QWEN3_VL if v.family == "qwen3_vl" else QWEN2_VL
    return (dataclasses.replace(base, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                                merge_size=v.spatial_merge_size), f"the {v.family} vision tower's defaults")


def fill_processor(data_cfg: DataConfig, recipe: Recipe, config: MindVLConfig) -> None:
    """data.processor defaults to the model's (vision_processing_for); one given in the recipe must cut the patches
    the vision tower takes (patch, temporal patch and merge sizes), else a one-line error naming both."""
    v = config.vision
    if v is None:
        return
    own, where = vision_processing_for(recipe, config)
    given = data_cfg.vision_processing() if data_cfg.processor is not None else None
    p, name = (given, "data.processor") if given is not None else (own, where)
    wrong = [f"{key} {getattr(p, key)} vs {getattr(v, attr)}" for key, attr in (
        ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size")) if getattr(p, key) != getattr(v, attr)]
    if wrong:
        raise ValueError(f"{name}: the processor does not fit the model's {v.family} vision tower "
                         f"({'; '.join(wrong)}); " + ("set data.processor to match it (or leave it unset)"
                                                      if given is not None else "fix the processor config"))
    data_cfg.processor = p


def arch_token_pixels(recipe: Recipe) -> int | None:
    """Pixels of one merged image token, (patch x merge)^2, of the vision tower in `recipe`'s `model.arch` (28 x 28
    for Qwen2.5-VL's, 32 x 32 for Qwen3-VL's); None when the recipe has no arch vision tower (a model folder)."""
    vision = (recipe.model.arch or {}).get("vision")
    if vision is None:
        return None
    v = VisionConfig(**vision)
    return (v.patch_size * v.spatial_merge_size) ** 2

