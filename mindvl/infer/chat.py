"""Chat with a mindvl model folder: images + text -> the assistant's answer.

The prompt is rendered by `mindvl.data.template.encode_conversation` (Qwen2-VL's ChatML, image pads expanded to
t*h*w/4, a default system turn) followed by the generation prompt `<|im_start|>assistant\\n`, which is what Qwen2-VL's
chat template adds with `add_generation_prompt=True`. `encode_conversation` renders finished turns only, so the
generation prompt is appended here: its ids are `<|im_start|>` + encode("assistant\\n"), exactly what tokenizing the
rendered string gives, since special tokens are hard split points. Images go through `mindvl.data.image.preprocess`
(smart_resize within min/max pixels, transformers' Qwen2-VL patch layout); videos through
`mindvl.data.video.preprocess_video` (Qwen2.5-VL's frame sampling and sizes), their rows joining the images' in
order of appearance, with their seconds per temporal patch for the M-RoPE time axis.

A Qwen3-VL-towered model takes its own processor (`mindvl.data.processors`, chosen from the model folder by
`folder_processing`): 16-px rows with mean/std 0.5, and videos as Qwen3VLProcessor lays them out: frames sampled by
its rule, each temporal patch its own vision block after a `<t.t seconds>` timestamp (`process_videos_qwen3`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from PIL import Image

from mindvl.checkpoint import load_model
from mindvl.checkpoint.side_files import read_json, tokenizer_mismatches
from mindvl.data.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, preprocess
from mindvl.data.processors import (
    PREPROCESSOR_CONFIG,
    QWEN3_VL,
    VisionProcessing,
    expand_video_rows,
    preprocess_image,
    process_video_qwen3,
    processing_from_folder,
)
from mindvl.data.schema import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Message
from mindvl.data.template import DEFAULT_SYSTEM, encode_conversation
from mindvl.data.tokenizer import TextTokenizer, load_tokenizer
from mindvl.data.video import (
    VIDEO_PROCESSOR_CONFIG,
    VideoSettings,
    expand_video_patches,
    preprocess_video,
    settings_from_processor_config,
)
from mindvl.models import MindVL
from mindvl.untrusted import loads_json, read_regular

from .device import default_device, resolve_device  # noqa: F401  (default_device: public here before)
from .generate import Prompt, check_sampling, generate

ImageInput = str | os.PathLike | bytes | Image.Image


def generation_prompt_ids(tok: TextTokenizer) -> list[int]:
    """`<|im_start|>assistant\\n`: the assistant header the model continues from."""
    return [tok.special.im_start, *tok.encode("assistant\n")]


def user_message(text: str, num_images: int, num_videos: int = 0) -> Message:
    """A user turn; without placeholders in the text, the videos and then the images go first (as in Qwen's
    examples)."""
    placed, placed_videos = text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER)
    if placed == 0 and placed_videos == 0:
        return Message("user", VIDEO_PLACEHOLDER * num_videos + IMAGE_PLACEHOLDER * num_images + text)
    if placed != num_images:
        raise ValueError(f"the prompt has {placed} {IMAGE_PLACEHOLDER} placeholders but {num_images} images were given")
    if placed_videos != num_videos:
        raise ValueError(f"the prompt has {placed_videos} {VIDEO_PLACEHOLDER} placeholders but {num_videos} videos "
                         "were given")
    return Message("user", text)


def process_videos(videos: Sequence[str | os.PathLike | bytes], settings: VideoSettings | None = None) -> tuple[
    list[torch.Tensor], list[tuple[int, int, int]], list[float]
]:
    """Video files or bytes -> (pixel rows [Pv_i, 1176] per video, grids, seconds per temporal patch)."""
    rows, grids, seconds = [], [], []
    for video in videos:
        v = preprocess_video(video, settings or VideoSettings())
        rows.append(torch.from_numpy(expand_video_patches(v.patches)))
        grids.append(v.grid)
        seconds.append(v.second_per_grid_t)
    return rows, grids, seconds


def process_videos_qwen3(videos: Sequence[str | os.PathLike | bytes], processing: VisionProcessing,
                         fps: float | None = None) -> tuple[list[torch.Tensor], list[tuple[int, int, int]],
                                                            list[list[float]]]:
    """Video files or bytes -> (float32 rows [t*h*w, 3*2*16*16] per video, grids (t, h, w), the seconds written
    before each temporal patch), as Qwen3-VL's processors make them (`fps`: default the processor's)."""
    rows, grids, stamps = [], [], []
    for video in videos:
        v = process_video_qwen3(video, processing, fps)
        rows.append(torch.from_numpy(expand_video_rows(v.patches, processing)))
        grids.append(v.grid)
        stamps.append(v.timestamps)
    return rows, grids, stamps


def process_images(images: Sequence[ImageInput], min_pixels: int = DEFAULT_MIN_PIXELS,
                   max_pixels: int = DEFAULT_MAX_PIXELS, processing: VisionProcessing | None = None
                   ) -> tuple[torch.Tensor | None, list[tuple[int, int, int]]]:
    """Paths, bytes or PIL images -> (pixel rows [P, 1176] float32 or None, grids (t, h, w) per image);
    `processing` (a Qwen3-VL model's, see `vision_processing`) -> its patch size and mean/std instead."""
    if min_pixels > max_pixels:
        raise ValueError(f"min_pixels ({min_pixels}) must not exceed max_pixels ({max_pixels})")
    rows, grids = [], []
    for image in images:
        if processing is not None:
            pixels, grid = preprocess_image(image, replace(processing, min_pixels=min_pixels, max_pixels=max_pixels))
        else:
            pixels, grid = preprocess(image, min_pixels, max_pixels)
        rows.append(torch.from_numpy(pixels))
        grids.append(grid)
    return (torch.cat(rows) if rows else None), grids


def folder_processing(model_dir: str | os.PathLike, model: MindVL) -> VisionProcessing | None:
    """The processor a model folder names (its preprocessor_config.json / video_preprocessor_config.json, read by
    `mindvl.data.processors.processing_from_folder`), checked against the model's vision tower; a folder without
    processor files gets the tower family's defaults (`vision_processing`). None for Qwen2.5-VL's layout without
    files (mindvl.data.image's defaults) or a text-only model."""
    v = model.config.vision
    model_dir = model_files_folder(model_dir)  # an adapter folder: its model's processor
    if v is None or not (Path(model_dir) / PREPROCESSOR_CONFIG).is_file():
        return vision_processing(model)
    p = processing_from_folder(model_dir)
    wrong = [f"{k} {getattr(p, k)} vs {getattr(v, a)}" for k, a in (
        ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
        ("merge_size", "spatial_merge_size")) if getattr(p, k) != getattr(v, a)]
    if wrong:
        raise ValueError(f"{Path(model_dir) / PREPROCESSOR_CONFIG} does not fit the model's {v.family} vision tower "
                         f"({'; '.join(wrong)}); fix or remove the processor config")
    return p


def vision_processing(model: MindVL) -> VisionProcessing | None:
    """The image processing a Qwen3-VL-towered model takes (16-px patches, mean/std 0.5, its merge sizes), or None
    for Qwen2.5-VL's (mindvl.data.image)."""
    v = model.config.vision
    if v is None or v.family != "qwen3_vl":
        return None
    return replace(QWEN3_VL, patch_size=v.patch_size, temporal_patch_size=v.temporal_patch_size,
                   merge_size=v.spatial_merge_size)


def conversation_prompt(tok: TextTokenizer, messages: Sequence[Message], pixel_values: torch.Tensor | None,
                        grids: Sequence[tuple[int, int, int]], system: str | None = DEFAULT_SYSTEM,
                        video_rows: Sequence[torch.Tensor] = (), video_grids: Sequence[tuple[int, int, int]] = (),
                        video_seconds: Sequence[float] = (),
                        video_timestamps: Sequence[Sequence[float]] | None = None) -> Prompt:
    """Render a conversation that ends with a user turn, plus the generation prompt, as a `Prompt` (images' and
    videos' rows and grids in one stream, in order of appearance). `video_timestamps` (Qwen3-VL): each video's
    temporal patches become their own vision items after their timestamps (grids (1, h, w) in the stream)."""
    enc = encode_conversation(tok, messages, grids, default_system=system, video_grids=video_grids,
                              video_timestamps=video_timestamps)
    ids = torch.tensor([*enc.input_ids.tolist(), *generation_prompt_ids(tok)], dtype=torch.long)
    if not video_grids:
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3) if grids else None
        return Prompt(ids, pixel_values, grid)
    image_rows = list(torch.split(pixel_values, [t * h * w for t, h, w in grids])) if grids else []
    video_items = list(zip(video_rows, video_grids, strict=True))
    if video_timestamps is not None:  # one item per temporal patch
        video_items = [(r[k * h * w:(k + 1) * h * w], (1, h, w)) for r, (t, h, w) in video_items for k in range(t)]
        video_seconds = ()
    rows, order, images, videos = [], [], iter(zip(image_rows, grids, strict=True)), iter(video_items)
    for is_video in enc.is_video or []:
        r, g = next(videos) if is_video else next(images)
        rows.append(r)
        order.append(g)
    seconds = torch.tensor(list(video_seconds), dtype=torch.float32) if video_seconds else None
    return Prompt(ids, torch.cat(rows), torch.tensor(order, dtype=torch.long).reshape(-1, 3), seconds)


def stop_ids(tok: TextTokenizer) -> list[int]:
    return [tok.special.im_end, tok.special.endoftext]


class ChatSession:
    """A multi-turn conversation about fixed images (placed in the first user turn); each turn re-encodes the
    whole conversation, so answers are exactly what a fresh prompt with that history would give."""

    def __init__(self, model: MindVL, tokenizer: TextTokenizer, images: Sequence[ImageInput] = (),
                 system: str | None = DEFAULT_SYSTEM, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
                 videos: Sequence[str | os.PathLike | bytes] = (), video_settings: VideoSettings | None = None,
                 processing: VisionProcessing | None = None) -> None:
        check_sampling(temperature, top_p, top_k)
        if (images or videos) and model.visual is None:
            raise ValueError("this is a text-only model (no vision tower); it cannot take images or videos")
        self.model, self.tok, self.system = model, tokenizer, system
        processing = processing if processing is not None else vision_processing(model)
        self.pixel_values, self.grids = process_images(images, min_pixels, max_pixels, processing)
        self.video_timestamps = None
        if processing is not None and processing.family == "qwen3_vl":
            fps = video_settings.fps if video_settings is not None else None
            self.video_rows, self.video_grids, self.video_timestamps = process_videos_qwen3(videos, processing, fps)
            self.video_seconds = []
        else:
            self.video_rows, self.video_grids, self.video_seconds = process_videos(videos, video_settings)
        self.messages: list[Message] = []
        self.last_ids: list[int] = []  # the last answer's generated ids (without its end token) and that end token
        self.last_stop: int | None = None
        self.gen = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)

    def ask(self, text: str) -> str:
        first = not self.messages
        message = user_message(text, len(self.grids) if first else 0, len(self.video_grids) if first else 0)
        prompt = conversation_prompt(self.tok, [*self.messages, message], self.pixel_values, self.grids, self.system,
                                     self.video_rows, self.video_grids, self.video_seconds,
                                     self.video_timestamps)
        ids = generate(self.model, [prompt], stop_token_ids=stop_ids(self.tok), **self.gen)[0]
        stopped = ids[-1] if ids and ids[-1] in stop_ids(self.tok) else None
        if stopped is not None:
            ids = ids[:-1]
        answer = self.tok.decode(ids, skip_special_tokens=True)
        self.last_ids, self.last_stop = ids, stopped
        self.messages += [message, Message("assistant", answer)]
        return answer

    def why_empty(self, answer: str) -> str | None:
        """Why the last answer shows nothing (None when it does): the model ended its turn at once, or its tokens
        were only special tokens / whitespace, and whether it stopped on an end token or ran out of tokens."""
        if answer.strip():
            return None
        ids, stop = self.last_ids, self.last_stop
        budget = self.gen["max_new_tokens"]
        end = f"ended its turn with {self.tok.decode([stop])}" if stop is not None else \
            f"hit --max-new-tokens {budget} without an end token"
        if not ids:
            return f"empty answer: the model {end} as its first token (0 tokens generated)"
        shown = self.tok.decode(ids[:8])
        return (f"empty answer: the model generated {len(ids)} tokens that decode to nothing visible "
                f"({shown!r}{' ...' if len(ids) > 8 else ''}) and {end}")


def chat(model: MindVL, tokenizer: TextTokenizer, text: str, images: Sequence[ImageInput] = (), **kwargs) -> str:
    """One question about `images` -> the answer (kwargs: see ChatSession)."""
    return ChatSession(model, tokenizer, images, **kwargs).ask(text)


# -------------------------------------------------------------------------------------------------- loading


def resolve_tokenizer(model_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None) -> TextTokenizer:
    """An explicit tokenizer path wins; otherwise the model folder's own tokenizer.json (what `mindvl export`,
    the trainer's final export and `mindvl convert` copy there); an adapter folder's is its model's
    (`model_files_folder`)."""
    if not Path(model_dir).is_dir():
        raise FileNotFoundError(f"model folder {model_dir} does not exist (give a folder written by mindvl export, "
                                "mindvl convert or a run's final/)")
    refuse_training_folder(Path(model_dir))
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    files = model_files_folder(model_dir)
    if (files / "tokenizer.json").is_file():
        return load_tokenizer(files)
    raise FileNotFoundError(f"{files} has no tokenizer.json; pass the tokenizer folder the model was trained "
                            "with (--tokenizer DIR)")


def model_files_folder(model_dir: str | os.PathLike) -> Path:
    """The folder whose side files (tokenizer, chat template, processor configs, its run's recipe.json) describe the
    model of `model_dir`: the folder itself, or for an adapter folder (adapter_config.json without config.json) the
    model folder it sits in (a LoRA run's `final/adapter`, `mindvl export`'s `OUT/adapter`: the merged model, trained
    with that tokenizer and system turn), else its base (adapter_config.json's base_model_name_or_path), which
    `load_model` merges it into."""
    from mindvl.checkpoint.adapters import adapter_base, is_adapter_folder

    folder = Path(model_dir)
    if (folder / "config.json").is_file() or not is_adapter_folder(folder):
        return folder
    if (folder.parent / "config.json").is_file():
        return folder.parent
    base = adapter_base(folder)
    if not base.is_dir():
        raise FileNotFoundError(f"{folder} is an adapter folder whose base model folder {base} does not exist "
                                "(adapter_config.json's base_model_name_or_path); fix it there")
    return base


def refuse_training_folder(folder: Path) -> None:
    """A run folder or training checkpoint is not a model folder: say which command makes one (as merge does)."""
    if (folder / "config.json").is_file() or not any(
            (folder / marker).exists() for marker in ("train_state.json", "latest", "checkpoints")):
        return
    if (folder / "final" / "config.json").is_file():
        raise ValueError(f"{folder} is a training run, not a model folder; use its final model, {folder / 'final'} "
                         f"(or export a checkpoint: mindvl export {folder} --out DIR)")
    raise ValueError(f"{folder} is a training run or checkpoint, not a model folder; export it first "
                     f"(mindvl export {folder} --out DIR) and use DIR")


def check_tokenizer(model: MindVL, tok: TextTokenizer) -> None:
    """The tokenizer must be the model's: same vision token ids, a vocabulary that fits the embedding."""
    wrong = tokenizer_mismatches(model.config, tok)
    if wrong:
        raise ValueError(f"tokenizer {tok.name} does not match the model ({'; '.join(wrong)}); is it the model's "
                         "tokenizer?")


def pixel_limits(model_dir: str | os.PathLike, processing: VisionProcessing | None = None) -> tuple[int, int]:
    """(min_pixels, max_pixels) from the folder's preprocessor_config.json when it has one (both transformers
    layouts; a file contradicting itself is an error naming it), else `processing`'s (the model's processor
    family defaults), else Qwen2-VL's defaults."""
    from mindvl.checkpoint.side_files import processor_pixels  # the one reader of processor configs

    fallback = (processing.min_pixels, processing.max_pixels) if processing is not None else \
        (DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
    return processor_pixels(model_files_folder(model_dir)) or fallback


def video_settings(model_dir: str | os.PathLike, fps: float | None = None) -> VideoSettings:
    """Video sampling and sizes from the folder's video_preprocessor_config.json (transformers' video processor
    file) when it has one, else transformers' Qwen2-VL video defaults; an explicit `fps` wins."""
    path = model_files_folder(model_dir) / VIDEO_PROCESSOR_CONFIG
    if not path.is_file():
        return settings_from_processor_config({}, fps)
    config = read_json(path, fix="; fix or delete it (then Qwen2-VL's defaults apply)")
    return settings_from_processor_config(config, fps)


def training_system(model_dir: str | os.PathLike) -> tuple[str | None, str]:
    """(the system turn the folder's model was trained with, where that was read).

    A run's `final/` sits beside the run's `recipe.json`: its `data.default_system` (None: trained without a system
    turn) is what training rendered. A `mindvl merge` of such folders (config.json `source.merged_from`): theirs,
    when they agree. `mindvl export` of a checkpoint copies the run's recipe.json into the folder. Other folders
    (`convert`) record no recipe: the default system turn of their chat template is then the best record there is
    (what transformers' `apply_chat_template` renders; Qwen2-VL's: "You are a helpful assistant."), which callers
    print so that a user can override it. An adapter folder: its model's (`model_files_folder`)."""
    folder = model_files_folder(model_dir)
    recipe = _run_recipe(folder)
    if recipe is not None:
        data = loads_json(read_regular(recipe, MAX_SIDE_BYTES, "run recipe")).get("data") or {}
        return data.get("default_system", DEFAULT_SYSTEM), f"data.default_system of the training run, {recipe}"
    merged = _merged_from(folder)  # a merge of runs' final/ folders: their recipes, when they agree
    recipes = [_run_recipe(Path(p)) for p in merged]
    if merged and all(recipes):
        systems = {json.dumps((loads_json(read_regular(r, MAX_SIDE_BYTES, "run recipe")).get("data") or {})
                              .get("default_system", DEFAULT_SYSTEM))
                   for r in recipes}
        if len(systems) == 1:
            return json.loads(systems.pop()), (f"data.default_system of the {len(recipes)} merged models' training "
                                               f"runs, {', '.join(str(r) for r in recipes)}")
    template, where = _chat_template(folder)
    if template is not None:
        return template_default_system(template, str(where)), f"the default of the folder's chat template, {where}"
    return DEFAULT_SYSTEM, f"Qwen's default: {folder} has no chat template or training recipe"


MAX_SIDE_BYTES = 64 << 20  # a recipe.json, chat template or tokenizer_config.json read for the system turn


def _run_recipe(folder: Path) -> Path | None:
    """The recipe.json of the training run a model folder is the `final/` of (the trainer writes both)."""
    for path in (folder / "recipe.json", folder.parent / "recipe.json" if folder.name == "final" else None):
        if path is not None and path.is_file():
            return path
    return None


def _merged_from(folder: Path) -> list[str]:
    """The input folders `mindvl merge` recorded in config.json (`source.merged_from`), or []."""
    try:
        source = loads_json(read_regular(folder / "config.json", MAX_SIDE_BYTES, "config")).get("source") or {}
    except (OSError, ValueError):
        return []
    return [str(p) for p in source.get("merged_from") or []] if isinstance(source, dict) else []


def _chat_template(folder: Path) -> tuple[str | None, Path | None]:
    """The folder's chat template where transformers looks for it first (chat_template.jinja / .json, then
    tokenizer_config.json), and the file it came from."""
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        path = folder / name
        if path.is_file():
            raw = read_regular(path, MAX_SIDE_BYTES, "chat template file").decode()
            text = raw if name.endswith(".jinja") else loads_json(raw).get("chat_template")
            if isinstance(text, str):
                return text, path
    return None, None


def template_default_system(template: str, where: str = "<chat template>") -> str | None:
    """The system turn a chat template adds to a conversation without one (None: it adds none): rendered with jinja2
    when it is installed (transformers' renderer; here sandboxed and bounded in time and size, see
    mindvl.infer.jinja_sandbox: over a limit is a one-line TemplateLimitError naming `where`), else read from the
    template's literal system block."""
    import re

    from .jinja_sandbox import TemplateLimitError, render_template

    try:
        rendered = render_template(template, where, messages=[{"role": "user", "content": "?"}],
                                   add_generation_prompt=False)
    except TemplateLimitError:
        raise
    except Exception:  # no jinja2, or a template needing transformers' extensions: its literal text then
        found = re.search(r"<\|im_start\|>system\n([^{}]*?)<\|im_end\|>", template)
        return found.group(1) if found else None
    found = re.match(r"\s*<\|im_start\|>system\n(.*?)<\|im_end\|>", rendered, re.S)
    return found.group(1) if found else None


def describe_system(system: str | None) -> str:
    return "none (no system turn)" if system is None else repr(system)


def load_for_chat(model_dir: str | os.PathLike, tokenizer: str | os.PathLike | None = None,
                  device: str | torch.device | None = None,
                  dtype: torch.dtype | None = None) -> tuple[MindVL, TextTokenizer]:
    """A model folder (+ its tokenizer) ready to generate: eval mode, bf16 on accelerators, fp32 on CPU."""
    device = resolve_device(device)  # before anything is loaded: a CUDA device on a CPU build is one line
    if dtype is None:
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    tok = resolve_tokenizer(model_dir, tokenizer)
    model = load_model(model_dir, dtype=dtype, device=device).eval()
    check_tokenizer(model, tok)
    return model, tok
