"""The files beside a model's weights that other tools read: tokenizer, generation config, processor configs.

Every folder mindvl writes for a model (a run's `final/`, `mindvl export`, `convert`, `merge`) gets them through
`write_side_files`, so transformers' `AutoTokenizer` / `AutoProcessor` / `generate` and lmms-eval find what they need:

- the tokenizer files (`tokenizer.json`, and `vocab.json` / `merges.txt` / ... when the source has them), copied
  together from the first source folder that has a `tokenizer.json`;
- `tokenizer_config.json`: the source's, or a fresh one, completed with the special tokens (eos `<|im_end|>`, pad
  `<|endoftext|>`) and a chat template. A model with a vision tower is trained on mindvl's ChatML rendering
  (Qwen2-VL's template), so a source template that cannot render images (a Qwen3 LLM's) is replaced by Qwen2-VL's;
  it also goes to `chat_template.jinja`, where transformers' processors look for it;
- `generation_config.json`: the source's (sampling defaults kept), with `<|im_end|>` added to its eos ids so
  `generate` stops where `mindvl chat` does, and bos/pad ids from the tokenizer;
- the processor configs of a model with a vision tower (`PROCESSOR_CONFIGS`: today the image processor's
  `preprocessor_config.json`), the source's or fresh, with the min/max pixels the model was trained with.

Side files come from the source folders when they have them and are written fresh when they do not. To add a
processor configuration (e.g. a video processor's), add its builder to `PROCESSOR_CONFIGS`.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mindvl.data import video
from mindvl.data.image import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    MERGE_SIZE,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    PATCH_SIZE,
    TEMPORAL_PATCH_SIZE,
)
from mindvl.data.processors import QWEN3_VL
from mindvl.data.tokenizer import QWEN2_VL_CHAT_TEMPLATE, TextTokenizer
from mindvl.models import MindVLConfig
from mindvl.untrusted import UntrustedInputError, loads_json, read_regular, regular_inside

MAX_SIDE_JSON_BYTES = 256 << 20  # tokenizer.json and the small configs beside the weights
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
IMAGE_PROCESSOR_CONFIG = "preprocessor_config.json"
# Files of one tokenizer, always copied together from one folder (mixing two tokenizers' files would be wrong).
TOKENIZER_FILES = (TOKENIZER_FILE, "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json")
# transformers >= 4.43 may keep the chat template outside tokenizer_config.json; these are kept in step with it.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|im_end|>", "<|endoftext|>", "<|endoftext|>"

Pixels = tuple[int, int]


# ------------------------------------------------------------------------------------------------ reading


def read_json(path: Path, fix: str = "") -> dict[str, Any]:
    """A JSON object from a model folder's file; one-line errors naming the file (`fix`: what to do, appended)."""
    try:
        data = loads_json(read_regular(path, MAX_SIDE_JSON_BYTES, "JSON file"))
    except UntrustedInputError as exc:  # not a regular file, too large, nested too deep, an integer too long
        raise ValueError(f"{path}: not a JSON file mindvl reads ({exc}){fix}") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path}: not valid JSON ({exc}){fix}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a JSON object, got {type(data).__name__}")
    return data


def added_token_ids(folder: Path) -> dict[str, int]:
    """Special (added) tokens of the folder's tokenizer.json, by text; empty without a tokenizer.json."""
    path = folder / TOKENIZER_FILE
    if not path.is_file():
        return {}
    return {t["content"]: t["id"] for t in read_json(path).get("added_tokens", [])}


def processor_pixels(folder: Path) -> Pixels | None:
    """(min_pixels, max_pixels) of the folder's preprocessor_config.json, or None without one.

    Both transformers layouts are read (top-level min/max_pixels, and 5.x's size.shortest/longest_edge); a file whose
    two layouts disagree is refused, since tools would then resize images differently depending on what they read.
    """
    path = folder / IMAGE_PROCESSOR_CONFIG
    if not path.is_file():
        return None
    cfg = read_json(path)
    size = cfg.get("size") or {}
    out = []
    for flat, nested, default in (("min_pixels", "shortest_edge", DEFAULT_MIN_PIXELS),
                                  ("max_pixels", "longest_edge", DEFAULT_MAX_PIXELS)):
        a, b = cfg.get(flat), size.get(nested)
        if a is not None and b is not None and int(a) != int(b):
            raise ValueError(f"{path}: {flat} {a} disagrees with size.{nested} {b}; make them equal")
        out.append(int(a if a is not None else b if b is not None else default))
    return out[0], out[1]


# ------------------------------------------------------------------------------------------------ builders


def tokenizer_config(existing: dict[str, Any] | None, multimodal: bool, template: str | None = None) -> dict[str, Any]:
    """The source's tokenizer_config.json (or a fresh one) with Qwen's special tokens and a chat template: the
    source's (`template`, from a chat_template file, which transformers prefers; else the config's own) unless it is
    missing or, for a multimodal model, renders no images."""
    cfg = dict(existing or {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072})
    cfg["eos_token"] = cfg.get("eos_token") or EOS_TOKEN
    cfg["pad_token"] = cfg.get("pad_token") or PAD_TOKEN
    cfg.setdefault("bos_token", None)  # Qwen tokenizers add no BOS
    template = template or cfg.get("chat_template")
    cfg["chat_template"] = template
    if not isinstance(template, str) or (multimodal and "<|image_pad|>" not in template):
        cfg["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    return cfg


def generation_config(existing: dict[str, Any] | None, ids: dict[str, int]) -> dict[str, Any]:
    """The source's generation_config.json (or a fresh, greedy one) whose eos ids include `<|im_end|>`."""
    cfg = dict(existing or {"do_sample": False})
    eos = cfg.get("eos_token_id")
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    for token in (EOS_TOKEN, PAD_TOKEN):  # mindvl chat stops at either (mindvl.infer.chat.stop_ids)
        if token in ids and ids[token] not in eos:
            eos.append(ids[token])
    if eos:
        cfg["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    if BOS_TOKEN in ids:
        cfg.setdefault("bos_token_id", ids[BOS_TOKEN])
    if PAD_TOKEN in ids:
        cfg["pad_token_id"] = cfg.get("pad_token_id", ids[PAD_TOKEN])
    installed = _installed_transformers()
    if installed is not None:  # GenerationConfig warns without it: the version that can read what is written here
        cfg.setdefault("transformers_version", installed)
    return cfg


def _installed_transformers() -> str | None:
    """The installed transformers' version (its metadata: importing it would cost seconds), or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("transformers")
    except PackageNotFoundError:
        return None


# `write_side_files(system=...)` default: leave the chat template's default system turn as the source wrote it.
KEEP_SYSTEM: Any = type("KeepSystem", (), {"__repr__": lambda self: "KEEP_SYSTEM"})()
# A chat template's literal default system turn (Qwen2-VL's, Qwen2.5-VL's: added when messages[0] is not a system
# turn): plain text, or the Jinja string `template_with_system` writes for a text with braces.
_LITERAL_SYSTEM = re.compile(r'<\|im_start\|>system\n([^{}]*?|\{\{ "(?:[^"\\]|\\.)*" \}\})<\|im_end\|>\n')


def template_with_system(template: str, system: str | None) -> str:
    """`template` whose default system turn (the one it renders when the conversation has none) is `system`, or no
    system turn when None: what the model was trained with (`data.default_system`), so that transformers'
    `apply_chat_template` renders the prompt `mindvl chat` does. A template with a literal default (Qwen2-VL's) gets
    that text replaced or removed; one without gets a first step that puts the system turn in front of `messages`."""
    found = _LITERAL_SYSTEM.search(template)
    if found is not None:
        if system is None:
            return template[:found.start()] + template[found.end():]
        text = system if not any(c in system for c in "{}") else \
            "{{ " + json.dumps(system) + " }}"  # a Jinja string literal (JSON's escapes are Jinja's)
        return template[:found.start(1)] + text + template[found.end(1):]
    if system is None:
        return template  # no literal default: it adds no system turn of its own
    first = ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = [{'role': 'system', "
             "'content': " + json.dumps(system) + "}] + messages %}{%- endif %}")
    return first + template


def image_processor_config(existing: dict[str, Any] | None, pixels: Pixels) -> dict[str, Any]:
    """Qwen2-VL's image processor settings (what mindvl.data.image implements) with the given min/max pixels."""
    cfg = dict(existing or {
        "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "do_convert_rgb": True, "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255,
        "do_normalize": True, "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
        "patch_size": PATCH_SIZE, "temporal_patch_size": TEMPORAL_PATCH_SIZE, "merge_size": MERGE_SIZE,
    })
    lo, hi = pixels
    cfg["min_pixels"], cfg["max_pixels"] = lo, hi
    cfg["size"] = {**(cfg.get("size") or {}), "shortest_edge": lo, "longest_edge": hi}
    return cfg


# Processor configs of a model with a vision tower: file name -> builder(existing or None, (min, max) pixels).
def video_processor_config(existing: dict[str, Any] | None, pixels: Pixels) -> dict[str, Any]:
    """Qwen2-VL's video processor settings: the source's own (frame sampling and sizes) when it has them, else
    mindvl's training defaults written out in full (an absent key would mean transformers' default, which for
    `cap_pixels_per_frame` is off); video pixels are independent of the image min/max pixels."""
    settings = video.settings_from_processor_config(existing) if existing else video.VideoSettings()
    return video.video_processor_config(settings, existing)


# Processor configs of a model with a vision tower: file name -> builder(existing or None, (min, max) pixels).
PROCESSOR_CONFIGS: dict[str, Callable[[dict[str, Any] | None, Pixels], dict[str, Any]]] = {
    IMAGE_PROCESSOR_CONFIG: image_processor_config,
    video.VIDEO_PROCESSOR_CONFIG: video_processor_config,
}


# ------------------------------------------------------------------------------------------------ writing


def _first_with(sources: Sequence[Path], name: str) -> Path | None:
    return next((s for s in sources if (s / name).is_file()), None)


def copy_side_file(src: Path, name: str, out: Path) -> None:
    """Copy `src/name` into `out` only when it is a regular file inside `src` (or an HF cache snapshot's blob): a
    symlinked `merges.txt` or `recipe.json` pointing at a secret must not leave with the model."""
    try:
        path = regular_inside(src, name, "side file")
    except UntrustedInputError as exc:
        raise ValueError(f"{exc}; copy the file itself into the folder (mindvl copies only regular files inside "
                         "it)") from None
    shutil.copyfile(path, out / name)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_side_files(out: str | Path, config: MindVLConfig, sources: Sequence[str | Path | None] = (),
                     pixels: Pixels | None = None, tokenizer_from: str | Path | None = None,
                     system: str | None = KEEP_SYSTEM) -> list[str]:
    """Write the side files of a model folder `out` (whose weights and config.json are written by the caller).

    `sources`: folders to take side files from, in order of preference (each file from the first that has it; the
    tokenizer files all from one folder, `tokenizer_from` first when given). `pixels`: the (min, max) pixels the
    model was trained with; default: the source's processor config, else Qwen2-VL's. `system`: the system turn the
    model was trained with (a recipe's data.default_system; None: none), which the chat template then adds by
    default (`template_with_system`); default: the template's own. Returns the names written.
    """
    out = Path(out)

    def usable(folders) -> list[Path]:
        paths = [Path(s) for s in folders if s is not None]
        paths = [p.parent if p.is_file() else p for p in paths]  # a tokenizer.json file stands for its folder
        return [p for p in paths if p.is_dir() and p.resolve() != out.resolve()]

    srcs = usable(sources)
    written: list[str] = []
    tok_src = _first_with(usable([tokenizer_from, *srcs]), TOKENIZER_FILE)
    multimodal = config.vision is not None
    if tok_src is not None:
        for name in (*TOKENIZER_FILES, *TEMPLATE_FILES):
            if (tok_src / name).is_file():
                copy_side_file(tok_src, name, out)
        existing = read_json(tok_src / TOKENIZER_CONFIG) if (tok_src / TOKENIZER_CONFIG).is_file() else None
        tok_cfg = tokenizer_config(existing, multimodal, _template_file(tok_src))
        if system is not KEEP_SYSTEM:
            tok_cfg["chat_template"] = template_with_system(tok_cfg["chat_template"], system)
        _write_json(out / TOKENIZER_CONFIG, tok_cfg)
        if multimodal and not any((out / name).is_file() for name in TEMPLATE_FILES):
            # transformers' processors (AutoProcessor) read the template from here, not from tokenizer_config.json
            (out / "chat_template.jinja").write_text(tok_cfg["chat_template"])
        _sync_template_files(out, tok_cfg["chat_template"])
        written += [n for n in (*TOKENIZER_FILES, TOKENIZER_CONFIG, *TEMPLATE_FILES) if (out / n).is_file()]
    ids = added_token_ids(out)
    gen_src = _first_with(srcs, GENERATION_CONFIG)
    if ids or gen_src is not None:
        _write_json(out / GENERATION_CONFIG, generation_config(
            read_json(gen_src / GENERATION_CONFIG) if gen_src else None, ids))
        written.append(GENERATION_CONFIG)
    if multimodal:
        image_src = _first_with(srcs, IMAGE_PROCESSOR_CONFIG)
        qwen3 = config.vision.family == "qwen3_vl"
        trained = pixels or (processor_pixels(image_src) if image_src else None)
        trained = trained or ((QWEN3_VL.min_pixels, QWEN3_VL.max_pixels) if qwen3 else
                              (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS))
        for name, build in PROCESSOR_CONFIGS.items():
            src = _first_with(srcs, name)
            fresh = _qwen3_vl_processor_config(name) if qwen3 else None  # 16-px patches, mean/std 0.5
            _write_json(out / name, build(read_json(src / name) if src else fresh, trained))
            written.append(name)
    return written


def _qwen3_vl_processor_config(name: str) -> dict[str, Any]:
    """A fresh Qwen3-VL image or video processor config (mindvl.data.processors.QWEN3_VL's settings)."""
    p = QWEN3_VL
    common = {"do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
              "do_normalize": True, "image_mean": list(p.image_mean), "image_std": list(p.image_std),
              "patch_size": p.patch_size, "temporal_patch_size": p.temporal_patch_size, "merge_size": p.merge_size,
              "processor_class": "Qwen3VLProcessor"}
    if name == IMAGE_PROCESSOR_CONFIG:
        return {"image_processor_type": "Qwen2VLImageProcessor", **common}
    # max_video_tokens is Qwen3VLVideoProcessor's per-frame ceiling (768), not mindvl's per-video context budget
    return {"video_processor_type": "Qwen3VLVideoProcessor", **common, "max_video_tokens": p.max_video_tokens,
            "size": {"shortest_edge": p.video_min_pixels, "longest_edge": p.video_max_pixels}}


def _template_file(folder: Path) -> str | None:
    """A chat template kept outside tokenizer_config.json (transformers >= 4.43 saves it there), or None."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        return read_json(folder / "chat_template.json").get("chat_template")
    return None


def _sync_template_files(out: Path, template: str) -> None:
    """transformers prefers chat_template.jinja / .json over tokenizer_config.json: they must say the same."""
    if (out / "chat_template.jinja").is_file():
        (out / "chat_template.jinja").write_text(template)
    if (out / "chat_template.json").is_file():
        _write_json(out / "chat_template.json", {**read_json(out / "chat_template.json"), "chat_template": template})


def token_ids_for_config(folder: Path) -> dict[str, Any]:
    """bos/eos/pad ids for a transformers config.json, from the folder's generation_config.json. An id stated as
    null stays null (left out, transformers would fall back to its class default, e.g. Qwen's 151643, which may lie
    outside a small vocabulary); an id the file does not name is left out."""
    path = Path(folder) / GENERATION_CONFIG
    if not path.is_file():
        return {}
    gen = read_json(path)
    return {k: gen[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in gen}


def tokenizer_mismatches(config: MindVLConfig, tok: TextTokenizer) -> list[str]:
    """How `tok` disagrees with the model `config` (empty when it fits): vocabulary size, vision token ids. The
    tokenizer is a side file of the model folder: training's preflight and chat both check it here."""
    wrong = []
    if tok.vocab_size > config.text.vocab_size:
        wrong.append(f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary holds {config.text.vocab_size}")
    if config.vision is not None:
        pairs = {"image_token_id": tok.special.image_pad, "vision_start_token_id": tok.special.vision_start,
                 "vision_end_token_id": tok.special.vision_end, "video_token_id": tok.special.video_pad}
        wrong += [f"{k}: model {getattr(config, k)} vs tokenizer {v}" for k, v in pairs.items()
                  if v is not None and getattr(config, k) != v]
    return wrong
