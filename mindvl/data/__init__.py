"""mindvl.data: from files on disk to packed multimodal micro-batches (ARCHITECTURE.md §1, §3).

Entry points:
    DataConfig.from_dict(d)                     validated config (the recipe's `data:` section)
    build_loader(cfg, tokenizer, rank, world)   a rank's PackLoader: iterate Packs, state_dict()/load_state_dict()
    Pack / Pack.to_torch()                      the model's input (input_ids, labels, position_ids, cu_seqlens,
                                                pixel_values, image_grid_thw)
    load_tokenizer(path_or_None)                HF tokenizer folder or mindvl's shipped default
    preprocess(image, min_pixels, max_pixels)   Qwen2-VL patch rows, bit-identical to transformers' PIL processor
    encode_conversation(...)                    ChatML ids + labels; mrope_positions(...) M-RoPE positions
    synth.generate(out_dir, n, seed, tasks)     synthetic OCR / chart / grounding / doc data
    video.preprocess_video(path, settings)      Qwen2.5-VL video frames -> patch rows (PyAV; the `video` extra)
    template.encode_document(...)               interleaved / plain-text documents (no chat template)
    captions, grounding                         caption prompt sets; box/point conventions through smart_resize
    plan.plan_recipe(recipe)                    `mindvl data plan`: a mixture over its budget vs the paper's tables

`build_loader`/`PackLoader` live in loader.py, the only module that imports torch; they are imported lazily here
so that `import mindvl.data` stays light (inference and tests of the pure parts do not pay for torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .config import DataConfig, SourceConfig, SynthConfig
from .image import load_image, preprocess, smart_resize
from .schema import IGNORE_INDEX, PACK_KEYS, BadSample, Conversation, Message, Pack, Sample
from .template import encode_conversation, mrope_positions
from .tokenizer import TextTokenizer, load_tokenizer

if TYPE_CHECKING:
    from .loader import PackLoader, build_loader

__all__ = [
    "IGNORE_INDEX",
    "PACK_KEYS",
    "BadSample",
    "Conversation",
    "DataConfig",
    "Message",
    "Pack",
    "PackLoader",
    "Sample",
    "SourceConfig",
    "SynthConfig",
    "TextTokenizer",
    "build_loader",
    "encode_conversation",
    "load_image",
    "load_tokenizer",
    "mrope_positions",
    "preprocess",
    "smart_resize",
]


def __getattr__(name: str):
    if name in ("build_loader", "PackLoader"):
        from . import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'mindvl.data' has no attribute {name!r}")
