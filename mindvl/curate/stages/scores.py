"""Aesthetic, NSFW and watermark scores (the paper's B.1.1 "aesthetic scoring, pornography and violence scoring,
watermark scoring"), computed the way LAION scored LAION-5B, with every model loaded from local files.

`aesthetic_score`: LAION's "improved aesthetic predictor": an MLP head over the L2-normalised CLIP image embedding
(ViT-L/14, 768-d), e.g. `sac+logos+ava1-l14-linearMSE.pth` (Linear 768-1024-128-64-16-1 with dropouts and, in
the linearMSE heads, no activations: `activation: none`; the `reluMSE` heads use `activation: relu`). Scores are
roughly 1-10; `min_score` keeps records scoring at least it (LAION-Aesthetics used >= 4.5, 5, 6), reason
`aesthetic`. To keep the best fraction per source instead, leave `min_score` unset and add
`top_fraction: {field: aesthetic_score, fraction: 0.8, per: source}` after it.

`nsfw_score`: LAION's CLIP-based NSFW detector: a small MLP over the same embedding (ViT-L/14: an optional input
normalisation, then Linear 768-64-512-256-1 with ReLUs and a sigmoid; 1 = NSFW), as ported to PyTorch (keys
`norm.mean`, `norm.variance`, `linear_1..4`). `max_score` drops records scoring above it, reason `nsfw`.

`watermark_score`: LAION's watermark detector is an image classifier (timm EfficientNet-B3 with a 2-class head,
class 0 = watermark). Two ways here: (a) `head:` a probe over the CLIP embedding like the NSFW one; (b)
`classifier:` a local transformers image-classification folder (`AutoModelForImageClassification` + its image
processor, e.g. a ConvNeXt or EfficientNet fine-tuned for watermarks), whose class `label` (index or name in the
config's id2label) is the watermark probability (softmax over the classes). `max_score` drops above it, reason
`watermark`.

Heads are state dicts (`.safetensors`, or `.pth`/`.pt`/`.bin` read with `weights_only`) of Linear layers
(`<name>.weight` [out, in], `<name>.bias` [out]) in natural key order (`layers.0` < `layers.2` < `layers.10`),
with an optional input normalisation (`<name>.mean`, `<name>.variance`: `(x - mean) / sqrt(variance)`, Keras'
Normalization layer). Layer sizes come from the weights; `activation` (none | relu | gelu | tanh, or a list with
one entry per gap between layers) goes between layers; the output is the raw value (`output: raw`), a sigmoid of a
1-output head, or the softmax probability of class `label` of a multi-output head (`output: auto` picks raw for
aesthetics, sigmoid or softmax by the head's output size for NSFW and watermarks).

The CLIP image embedding comes from `model:` (the same local CLIP/SigLIP folder as `clip_score`/`embed`) and is
computed once per image and model per pass (`embed.clip_image_features`): the three heads, `clip_score` and `embed`
in one pass share it. Scores go to `meta[<stage name>]` and the report's histograms.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import numpy as np

from .base import Histogram, MapStage, Options, register, with_first_image
from .embed import check_model_folder, clip_image_features, load_clip

ACTIVATIONS = ("none", "relu", "gelu", "tanh")
OUTPUTS = ("auto", "raw", "sigmoid", "softmax")
WEIGHT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin")
_CLASSIFIERS: dict[tuple[str, str], Any] = {}  # one loaded image classifier per (folder, device) per worker process


def _natural(key: str) -> list:
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def read_state_dict(path: str, where: str) -> dict[str, Any]:
    """The tensors of a local weight file (a state dict, possibly wrapped in {"state_dict": ...} or saved from
    DataParallel with `module.` prefixes)."""
    import torch

    if not os.path.isfile(path):
        raise FileNotFoundError(f"{where}: weight file not found: {path} (a local .safetensors/.pth state dict; "
                                "hubs are not used)")
    if not path.endswith(WEIGHT_SUFFIXES):
        raise ValueError(f"{where}: {path}: expected a {'/'.join(WEIGHT_SUFFIXES)} state dict")
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            sd = load_file(path)
        else:
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: one line naming it
        raise ValueError(f"{where}: {path}: not a readable state dict ({type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if isinstance(sd, dict) and set(sd) == {"state_dict"} and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict) or not sd:
        raise ValueError(f"{where}: {path}: expected a non-empty state dict (name -> tensor), got "
                         f"{type(sd).__name__}")
    for key, value in sd.items():
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where}: {path}: {key!r} is a {type(value).__name__}, not a tensor")
    if all(k.startswith("module.") for k in sd):
        sd = {k[len("module."):]: v for k, v in sd.items()}
    return sd


class Head:
    """A chain of Linear layers over an embedding, read from a state dict: [N, in_features] -> [N] scores.

    `sizes` are [in, hidden..., out] as inferred from the weights. Runs in float32 with torch on `device`."""

    def __init__(self, path: str, where: str, activation: str | list, output: str, label: int | None,
                 default_output: str):
        import torch

        sd = read_state_dict(path, where)
        self.path, self.where = path, where
        groups: dict[str, dict[str, Any]] = {}
        for key, value in sd.items():
            prefix, _, leaf = key.rpartition(".")
            groups.setdefault(prefix, {})[leaf] = value.detach().float()
        what = ("a head is Linear layers (<name>.weight [out, in], <name>.bias [out]) with an optional input "
                "normalisation (<name>.mean, <name>.variance)")
        linears: list[tuple[str, Any, Any]] = []
        self.norm: tuple[Any, Any] | None = None
        for prefix in sorted(groups, key=_natural):
            g = groups[prefix]
            name = f"{prefix}." if prefix else ""
            if set(g) <= {"weight", "bias"} and "weight" in g:
                w = g["weight"]
                if w.dim() != 2:
                    raise ValueError(f"{where}: {path}: {name}weight has shape {list(w.shape)}; {what}")
                b = g.get("bias", torch.zeros(w.shape[0]))
                if list(b.shape) != [w.shape[0]]:
                    raise ValueError(f"{where}: {path}: {name}bias has shape {list(b.shape)}, expected "
                                     f"[{w.shape[0]}] for {name}weight {list(w.shape)}")
                linears.append((f"{name}weight", w, b))
            elif set(g) <= {"mean", "variance", "count"} and {"mean", "variance"} <= set(g):
                if self.norm is not None:  # (key names cannot place it between layers: it is the input's)
                    raise ValueError(f"{where}: {path}: {name}mean: only one input normalisation is supported, "
                                     f"found also {self._norm_key}")
                self.norm = (g["mean"].reshape(-1), g["variance"].reshape(-1))
                self._norm_key = f"{name}mean"
            else:
                raise ValueError(f"{where}: {path}: unexpected key {name}{sorted(g)[0]}; {what}")
        if not linears:
            raise ValueError(f"{where}: {path}: no Linear layer (<name>.weight) found; {what}")
        for (k1, w1, _), (k2, w2, _) in zip(linears, linears[1:], strict=False):
            if w2.shape[1] != w1.shape[0]:
                raise ValueError(f"{where}: {path}: {k2} takes {w2.shape[1]} inputs but {k1} gives {w1.shape[0]}")
        if self.norm is not None and self.norm[0].numel() != linears[0][1].shape[1]:
            raise ValueError(f"{where}: {path}: {self._norm_key} has {self.norm[0].numel()} values but "
                             f"{linears[0][0]} takes {linears[0][1].shape[1]} inputs")
        self.layers = linears
        self.first_key = linears[0][0]
        self.sizes = [int(linears[0][1].shape[1])] + [int(w.shape[0]) for _, w, _ in linears]
        n_gaps = len(linears) - 1
        acts = [activation] * n_gaps if isinstance(activation, str) else list(activation)
        if len(acts) != n_gaps or any(a not in ACTIVATIONS for a in acts):
            raise ValueError(f"{where.rsplit('.', 1)[0]}.activation: expected one of {', '.join(ACTIVATIONS)} or a "
                             f"list of {n_gaps} of them (one per gap between the {len(linears)} layers of {path}), "
                             f"got {activation!r}")
        self.activations = acts
        out = self.sizes[-1]
        if output == "auto":
            output = default_output if default_output != "auto" else ("sigmoid" if out == 1 else "softmax")
        stage = where.rsplit(".", 1)[0]
        if output in ("raw", "sigmoid") and out != 1 and label is None:
            raise ValueError(f"{stage}.label: {path} has {out} outputs: name the index of the scored one")
        if output == "softmax" and out < 2:
            raise ValueError(f"{stage}.output: softmax needs a head with >= 2 outputs; {path} has {out}")
        if output == "softmax" and label is None:
            raise ValueError(f"{stage}.label: {path} has {out} outputs: name the index of the scored class")
        if label is not None and not 0 <= label < out:
            raise ValueError(f"{stage}.label: {label} is not an output index of {path} (it has {out})")
        self.output, self.label = output, (0 if label is None else label)
        self.device = "cpu"

    @property
    def in_features(self) -> int:
        return self.sizes[0]

    def to(self, device: str) -> Head:
        if device != self.device:
            self.layers = [(k, w.to(device), b.to(device)) for k, w, b in self.layers]
            if self.norm is not None:
                self.norm = (self.norm[0].to(device), self.norm[1].to(device))
            self.device = device
        return self

    def scores(self, embeddings: np.ndarray) -> np.ndarray:
        """[N, in_features] float -> [N] float64."""
        import torch
        import torch.nn.functional as F

        if embeddings.ndim != 2 or embeddings.shape[1] != self.in_features:
            raise ValueError(f"{self.where}: {self.path}: {self.first_key} takes {self.in_features}-d input but the "
                             f"embeddings have shape {list(embeddings.shape)}")
        with torch.no_grad():
            x = torch.from_numpy(np.ascontiguousarray(embeddings, dtype=np.float32)).to(self.device)
            if self.norm is not None:  # Keras' Normalization: the standard deviation floored at 1e-7
                x = (x - self.norm[0]) / self.norm[1].sqrt().clamp_min(1e-7)
            for i, (_, w, b) in enumerate(self.layers):
                x = F.linear(x, w, b)
                act = self.activations[i] if i < len(self.activations) else "none"  # none after the last
                if act != "none":
                    x = {"relu": F.relu, "gelu": F.gelu, "tanh": torch.tanh}[act](x)
            if self.output == "softmax":
                x = x.softmax(-1)
            elif self.output == "sigmoid":
                x = x.sigmoid()
            return x[:, self.label].double().cpu().numpy()


def clip_embedding_dim(path: str) -> int:
    """The image-embedding size of a local CLIP/SigLIP folder (CLIP: projection_dim; SigLIP: the vision width)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    dim = getattr(cfg, "projection_dim", None)
    return int(dim if dim else cfg.vision_config.hidden_size)


class _EmbeddingHeadStage(MapStage):
    """A score from a head over the CLIP image embedding; a threshold keeps (`min_score`) or drops (`max_score`)."""

    threshold_key = ""  # min_score | max_score
    default_activation = "none"
    default_output = "auto"
    reason = ""

    def __init__(self, cfg, where, seed):
        super().__init__(cfg, where, seed)
        self.o = Options(cfg, self.spec(), where, self.types())
        self.o.positive("batch_size")
        self.threshold = getattr(self.o, self.threshold_key)
        self.configure(where)

    def configure(self, where: str) -> None:
        self.path, self.head = self.load_embedding_head(where)

    def spec(self) -> dict[str, Any]:
        return {"model": "", "head": "", "activation": self.default_activation, "output": "auto", "label": None,
                self.threshold_key: None, "batch_size": 32, "device": "cpu"}

    def types(self) -> dict[str, tuple]:
        return {"activation": (str, list), "label": (int,), self.threshold_key: (float,)}

    def load_embedding_head(self, where: str) -> tuple[str, Head]:
        if self.o.output not in OUTPUTS:
            raise ValueError(f"{where}.output: must be one of {', '.join(OUTPUTS)}, got {self.o.output!r}")
        if not self.o.model:
            raise ValueError(f"{where}.model: required (the local CLIP folder whose image embeddings the head reads)")
        if not self.o.head:
            raise ValueError(f"{where}.head: required (a local .safetensors/.pth state dict of the head)")
        path = check_model_folder(self.o.model, f"{where}.model")
        head = Head(self.o.head, f"{where}.head", self.o.activation, self.o.output, self.o.label,
                    self.default_output)
        dim = clip_embedding_dim(path)
        if dim != head.in_features:
            raise ValueError(f"{where}.head: {self.o.head}: {head.first_key} takes {head.in_features}-d input but "
                             f"{self.o.model} gives {dim}-d image embeddings (a head for another CLIP model?)")
        return path, head

    def setup(self):
        load_clip(self.path, self.o.device)
        self.head.to(self.o.device)

    def drops(self, score: float) -> bool:
        if self.threshold is None:
            return False
        return score < self.threshold if self.threshold_key == "min_score" else score > self.threshold

    def batch_scores(self, chunk: list[tuple[Any, Any]]) -> np.ndarray:
        embeddings = clip_image_features(self.path, chunk, self.o.batch_size, self.o.device)
        return self.head.to(self.o.device).scores(embeddings)

    def process(self, batch):
        pairs, dropped = with_first_image(batch)
        kept = []
        for a in range(0, len(pairs), self.o.batch_size):
            chunk = pairs[a:a + self.o.batch_size]
            for (item, _), score in zip(chunk, self.batch_scores(chunk), strict=True):
                score = float(score)
                if not math.isfinite(score):  # broken weights or a degenerate image: counted, never kept blindly
                    dropped.append((item, f"{self.reason}_not_finite"))
                    continue
                self.observe(self.name, score)
                item.meta[self.name] = score
                if self.drops(score):
                    dropped.append((item, self.reason))
                else:
                    kept.append(item)
        return kept, dropped


@register
class AestheticScore(_EmbeddingHeadStage):
    name = "aesthetic_score"
    histograms = {"aesthetic_score": Histogram(0, 10, 40)}
    threshold_key = "min_score"
    default_activation = "none"  # LAION's linearMSE heads have no activations between their Linear layers
    default_output = "raw"
    reason = "aesthetic"


@register
class NsfwScore(_EmbeddingHeadStage):
    name = "nsfw_score"
    histograms = {"nsfw_score": Histogram(0, 1, 20)}
    threshold_key = "max_score"
    default_activation = "relu"
    reason = "nsfw"


class ImageClassifier:
    """A local transformers image-classification folder: class probabilities of a batch of PIL images."""

    def __init__(self, path: str, device: str):
        try:
            import torch
            from transformers import AutoImageProcessor, AutoModelForImageClassification
        except ImportError as exc:  # pragma: no cover - environment
            raise ImportError("the watermark classifier needs transformers and torch: pip install transformers") \
                from exc
        self.torch, self.device = torch, device
        torch.set_num_threads(1)
        self.model = AutoModelForImageClassification.from_pretrained(path).eval().to(device)
        self.processor = AutoImageProcessor.from_pretrained(path)
        self.multi_label = self.model.config.problem_type == "multi_label_classification" or \
            self.model.config.num_labels == 1

    def probabilities(self, images: list) -> np.ndarray:
        """[N, num_labels]: softmax over the classes (sigmoid per class for a 1-label or multi-label head)."""
        with self.torch.no_grad():
            pixels = self.processor(images=images, return_tensors="pt")["pixel_values"].to(self.device)
            logits = self.model(pixel_values=pixels).logits.float()
            p = logits.sigmoid() if self.multi_label else logits.softmax(-1)
        return p.double().cpu().numpy()


def load_classifier(path: str, device: str) -> ImageClassifier:
    if (path, device) not in _CLASSIFIERS:
        _CLASSIFIERS[(path, device)] = ImageClassifier(path, device)
    return _CLASSIFIERS[(path, device)]


def classifier_label_index(path: str, label: int | str | None, where: str) -> int:
    """The class index `label` names (an index, or a name in the folder's config id2label)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(path)
    names = {int(i): str(n) for i, n in cfg.id2label.items()}
    listed = ", ".join(f"{i}: {names[i]}" for i in sorted(names))
    n = cfg.num_labels
    if label is None:
        if n == 1:
            return 0
        raise ValueError(f"{where}.label: {path} has {n} classes ({listed}): name the watermark class by index or "
                         "name")
    if isinstance(label, str):
        matches = [i for i, name in names.items() if name == label]
        if len(matches) != 1:
            raise ValueError(f"{where}.label: {label!r} is not a class of {path} (id2label: {listed})")
        return matches[0]
    if not 0 <= label < n:
        raise ValueError(f"{where}.label: {label} is not a class index of {path} (it has {n} classes)")
    return label


@register
class WatermarkScore(_EmbeddingHeadStage):
    name = "watermark_score"
    histograms = {"watermark_score": Histogram(0, 1, 20)}
    threshold_key = "max_score"
    default_activation = "relu"
    reason = "watermark"

    def spec(self):
        return {**super().spec(), "classifier": ""}

    def types(self):
        return {**super().types(), "label": (int, str)}

    def configure(self, where):
        if bool(self.o.classifier) == bool(self.o.head):
            raise ValueError(f"{where}: give either head (with model: a CLIP folder) or classifier (a local "
                             "image-classification folder), not both or neither")
        if self.o.classifier:
            if self.o.model:
                raise ValueError(f"{where}.model: not used with classifier (the classifier reads the pixels)")
            self.classifier = check_model_folder(self.o.classifier, f"{where}.classifier")
            self.label = classifier_label_index(self.classifier, self.o.label, where)
            self.path, self.head = None, None
        else:
            if isinstance(self.o.label, str):
                raise ValueError(f"{where}.label: a head's class is an index, got {self.o.label!r}")
            self.classifier = None
            self.path, self.head = self.load_embedding_head(where)

    def setup(self):
        if self.classifier is None:
            super().setup()
        else:
            load_classifier(self.classifier, self.o.device)

    def batch_scores(self, chunk):
        if self.classifier is None:
            return super().batch_scores(chunk)
        probs = load_classifier(self.classifier, self.o.device).probabilities([im for _, im in chunk])
        return probs[:, self.label]
