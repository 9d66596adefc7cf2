"""Image embeddings and CLIP scores from a local CLIP or SigLIP folder (transformers' classes), or a model-free
thumbnail embedding.

`embed`: `item.arrays["embedding"]` for the clustering stage. `model: thumbnail` is the model-free embedding (the
first image box-resized to `thumbnail x thumbnail` RGB, values / 255, flattened): cheap, deterministic, and enough
for near-identical content; `model: /path/to/clip-or-siglip` uses the model's image tower (`get_image_features`,
L2-normalised).

`clip_score`: cosine similarity of the first image and the caption (the assistant turns) in the model's joint space,
stored in `meta["clip_score"]` and `arrays["clip_score"]`; `threshold` drops pairs below it (reason `clip_score`);
`mark_below` only marks them (`meta["low_clip"]`), for the re-caption stage. `top_fraction` (a global stage after
it) keeps the best-scoring fraction per source file instead of a fixed threshold.

Folders hold `config.json` + weights, the image processor's and the tokenizer's files (what `save_pretrained` writes
for the model, its image processor and its tokenizer). torch and transformers are imported only here.
"""

from __future__ import annotations

import math
import os
import shutil
from typing import Any

import numpy as np

from .base import GlobalStage, Histogram, MapStage, Options, register, with_first_image

_MODELS: dict[tuple[str, str], Any] = {}  # one loaded model per (folder, device) per worker process


def check_model_folder(path: str, where: str) -> str:
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{where}: model folder not found: {path} (a local CLIP/SigLIP folder; hubs are "
                                "not used)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"{where}: {path} has no config.json; save the model with save_pretrained")
    return os.path.abspath(path)


class ClipModel:
    """A local CLIP/SigLIP model: normalised image and text embeddings in its joint space."""

    def __init__(self, path: str, device: str = "cpu"):
        try:
            import torch
            from transformers import AutoImageProcessor, AutoModel, AutoTokenizer
        except ImportError as exc:  # pragma: no cover - environment
            raise ImportError("CLIP stages need transformers and torch: pip install transformers") from exc
        self.torch, self.device = torch, device
        torch.set_num_threads(1)
        self.model = AutoModel.from_pretrained(path).eval().to(device)
        self.image_processor = AutoImageProcessor.from_pretrained(path)
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.is_siglip = "siglip" in type(self.model).__name__.lower()

    @staticmethod
    def _tensor(out: Any):
        return out if not hasattr(out, "pooler_output") else out.pooler_output

    def image_embeddings(self, images: list) -> np.ndarray:
        with self.torch.no_grad():
            pixels = self.image_processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
            e = self._tensor(self.model.get_image_features(pixel_values=pixels))
            e = e / e.norm(dim=-1, keepdim=True)
        return e.float().cpu().numpy()

    def text_embeddings(self, texts: list[str]) -> np.ndarray:
        padding = "max_length" if self.is_siglip else True  # SigLIP was trained on max-length padding
        with self.torch.no_grad():
            tok = self.tokenizer(texts, padding=padding, truncation=True, return_tensors="pt",
                                 max_length=self.model.config.text_config.max_position_embeddings)
            mask = None if self.is_siglip else tok.get("attention_mask")
            mask = None if mask is None else mask.to(self.device)
            e = self._tensor(self.model.get_text_features(input_ids=tok["input_ids"].to(self.device),
                                                          attention_mask=mask))
            e = e / e.norm(dim=-1, keepdim=True)
        return e.float().cpu().numpy()


def load_clip(path: str, device: str = "cpu") -> ClipModel:
    if (path, device) not in _MODELS:
        _MODELS[(path, device)] = ClipModel(path, device)
    return _MODELS[(path, device)]


def clip_image_features(path: str, pairs: list[tuple[Any, Any]], batch_size: int, device: str = "cpu") -> np.ndarray:
    """[N, D] normalised image embeddings of `pairs` [(item, its first image)] from the CLIP/SigLIP folder `path`.
    Each item's embedding is computed once per model and kept in `item.features[path]`, so clip_score, embed and
    the heads over CLIP embeddings (stages/scores.py) in one pass embed every image once (on the device of the
    first stage that needs it)."""
    todo = [(item, image) for item, image in pairs if path not in item.features]
    if todo:
        model = load_clip(path, device)
        for a in range(0, len(todo), batch_size):
            chunk = todo[a:a + batch_size]
            for (item, _), e in zip(chunk, model.image_embeddings([im for _, im in chunk]), strict=True):
                item.features[path] = e
    if not pairs:
        return np.zeros((0, 0), dtype=np.float32)
    return np.stack([item.features[path] for item, _ in pairs])


def thumbnail_embedding(image, side: int) -> np.ndarray:
    from PIL import Image

    thumb = image.convert("RGB").resize((side, side), Image.Resampling.BOX)
    return (np.asarray(thumb, dtype=np.float32) / 255.0).reshape(-1)


@register
class Embed(MapStage):
    name = "embed"

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"model": "thumbnail", "thumbnail": 8, "batch_size": 32}, where)
        self.o.positive("thumbnail", "batch_size")
        self.path = None if self.o.model == "thumbnail" else check_model_folder(self.o.model, f"{where}.model")

    def setup(self):
        if self.path is not None:
            load_clip(self.path)

    def process(self, batch):
        pairs, dropped = with_first_image(batch)
        if self.path is None:
            for item, image in pairs:
                item.arrays["embedding"] = thumbnail_embedding(image, self.o.thumbnail)
        elif pairs:
            for (item, _), e in zip(pairs, clip_image_features(self.path, pairs, self.o.batch_size), strict=True):
                item.arrays["embedding"] = e
        return [item for item, _ in pairs], dropped


@register
class ClipScore(MapStage):
    name = "clip_score"
    histograms = {"clip_score": Histogram(-1, 1, 40)}

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"model": "", "threshold": None, "mark_below": None, "batch_size": 32,
                               "field": "assistant"},
                         where, {"threshold": (float,), "mark_below": (float,)})
        if not self.o.model:
            raise ValueError(f"{where}.model: required (a local CLIP/SigLIP folder)")
        self.path = check_model_folder(self.o.model, f"{where}.model")

    def setup(self):
        load_clip(self.path)

    def process(self, batch):
        pairs, dropped = with_first_image(batch)
        model = load_clip(self.path)
        kept = []
        for a in range(0, len(pairs), self.o.batch_size):
            chunk = pairs[a:a + self.o.batch_size]
            img = clip_image_features(self.path, chunk, self.o.batch_size)  # shared with embed and scores.py
            txt = model.text_embeddings([item.texts(self.o.field) or " " for item, _ in chunk])
            for (item, _), score in zip(chunk, (img * txt).sum(1), strict=True):
                score = float(score)
                self.observe("clip_score", score)
                item.meta["clip_score"] = score
                item.arrays["clip_score"] = np.float32(score)
                if self.o.threshold is not None and score < self.o.threshold:
                    dropped.append((item, "clip_score"))
                    continue
                if self.o.mark_below is not None and score < self.o.mark_below:
                    item.meta["low_clip"] = True
                kept.append(item)
        return kept, dropped


@register
class TopFraction(GlobalStage):
    """Keep the `fraction` of records with the highest score (`field`, e.g. `clip_score` from a clip_score stage)
    per source file (`per: source`) or over the whole corpus (`per: all`); ties by key. Drops: `below_top_fraction`."""

    name = "top_fraction"

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, {"field": "clip_score", "fraction": 0.5, "per": "source"}, where)
        if not 0 < self.o.fraction <= 1:
            raise ValueError(f"{where}.fraction: must be in (0, 1], got {self.o.fraction}")
        if self.o.per not in ("source", "all"):
            raise ValueError(f"{where}.per: must be source or all, got {self.o.per!r}")

    def annotate(self, batch):
        kept, dropped = [], []
        for item in batch:
            score = item.meta.get(self.o.field)
            if not isinstance(score, (int, float)):
                dropped.append((item, f"no_{self.o.field}"))
                continue
            item.arrays[f"top_{self.o.field}"] = np.float64(score)
            item.arrays["top_source"] = np.str_(item.meta.get("source", "") if self.o.per == "source" else "")
            kept.append(item)
        return kept, dropped

    def plan(self, shards, workdir, emit):
        """Per group, the n_keep = ceil(fraction x size) best scores: scores spilled per group (as uint64 keys that
        sort highest score first), an exact threshold per group by streaming radix select, then the plan shard by
        shard (ties at the threshold go to the earliest keys, i.e. corpus order). Driver memory: O(groups)."""
        from ..io import read_sidecar, spill_append, spill_chunks
        from ..sampling import select_smallest

        name = f"top_{self.o.field}"
        spill = os.path.join(workdir, "top_spill")
        shutil.rmtree(spill, ignore_errors=True)
        os.makedirs(spill)
        groups: dict[str, int] = {}
        sizes: list[int] = []
        for _, path in shards:
            side = read_sidecar(path, (name, "top_source"))
            if name not in side:
                continue
            g = np.array([groups.setdefault(str(src), len(groups)) for src in side["top_source"][1]])
            sizes += [0] * (len(groups) - len(sizes))
            v = best_first(side[name][1])
            for gi in np.unique(g):
                spill_append(os.path.join(spill, f"g{gi}.u64"), v[g == gi])
                sizes[gi] += int((g == gi).sum())
        rule = []
        for gi, n in enumerate(sizes):
            path = os.path.join(spill, f"g{gi}.u64")
            rule.append(select_smallest(lambda path=path: spill_chunks(path, np.uint64),
                                        math.ceil(self.o.fraction * n)))
        ties = np.zeros(len(sizes), dtype=np.int64)
        for shard, path in shards:
            side = read_sidecar(path, (name, "top_source"))
            if name not in side:
                continue
            drop = {}
            for k, v, src in zip(side[name][0], best_first(side[name][1]), side["top_source"][1], strict=True):
                gi = groups[str(src)]
                t, take = rule[gi]
                if v < t or (v == t and ties[gi] < take):
                    ties[gi] += v == t
                    continue
                drop[k] = "below_top_fraction"
            emit(shard, {"drop": drop, "meta": {}})
        shutil.rmtree(spill, ignore_errors=True)
        report = {}
        for src, gi in sorted(groups.items()):
            n_keep = math.ceil(self.o.fraction * sizes[gi])
            report[src or "all"] = {"records": sizes[gi], "kept": n_keep,
                                    "min_kept_score": score_of(rule[gi][0]) if n_keep else None}
        return {"field": self.o.field, "fraction": self.o.fraction, "groups": report}


def best_first(scores: np.ndarray) -> np.ndarray:
    """uint64 keys of float scores that sort highest score first (IEEE-754 order made unsigned, then inverted)."""
    b = (np.asarray(scores, dtype=np.float64) + 0.0).view(np.uint64)  # + 0.0: -0.0 becomes 0.0
    sign = np.uint64(1) << np.uint64(63)
    return ~np.where(b & sign, ~b, b | sign)


def score_of(key: int) -> float:
    """The score a `best_first` key came from."""
    b = ~np.uint64(key)
    sign = np.uint64(1) << np.uint64(63)
    return float((b ^ sign if b & sign else ~b).view(np.float64))
