"""Architecture configs of the vision tower, the language models and the composed MindVL model.

Plain dataclasses, validated on construction; `from_dict` rejects unknown keys by name so a typo in a config.json
is an error, not a silently ignored field. Conversion *from* transformers' config.json lives in mindvl.checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any], where: str) -> T:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys are {sorted(names)}")
    return cls(**data)


def _require(cond: bool, where: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {msg}")


@dataclass
class VisionConfig:
    """Qwen2.5-VL vision tower (defaults: the real checkpoints' values, not transformers' class defaults)."""

    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112  # pixels; 112 // 2 // 14 = 4 merged tokens = 8 x 8 patches per window side
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6  # transformers hard-codes 1e-6 for the vision norms
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        w = "vision"
        _require(self.hidden_size % self.num_heads == 0, w, "hidden_size must be divisible by num_heads")
        _require((self.hidden_size // self.num_heads) % 4 == 0, w, "head_dim must be a multiple of 4 (2-D RoPE)")
        _require(all(0 <= i < self.depth for i in self.fullatt_block_indexes), w,
                 f"fullatt_block_indexes {self.fullatt_block_indexes} must lie in [0, depth={self.depth})")
        unit = self.spatial_merge_size * self.patch_size
        _require(self.window_size % unit == 0, w, f"window_size must be a multiple of {unit}")
        self.fullatt_block_indexes = list(self.fullatt_block_indexes)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values per patch row: C * temporal_patch * patch * patch (1176 for Qwen2.5-VL)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2


@dataclass
class TextConfig:
    """Dense decoder: `qwen3` (q/k RMSNorm, no bias) or `qwen2` (qkv bias; Qwen2.5-VL's LLM)."""

    family: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: list[int] | None = None  # set -> M-RoPE with 3-D positions; None -> 1-D RoPE
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    FAMILIES = ("qwen3", "qwen2")

    def __post_init__(self) -> None:
        w = "text"
        _require(self.family in self.FAMILIES, w, f"family {self.family!r} is not one of {self.FAMILIES}")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, w,
                 "num_attention_heads must be a multiple of num_key_value_heads")
        _require(self.head_dim % 2 == 0, w, "head_dim must be even")
        if self.mrope_section is not None:
            self.mrope_section = list(self.mrope_section)
            _require(len(self.mrope_section) == 3 and sum(self.mrope_section) == self.head_dim // 2, w,
                     f"mrope_section {self.mrope_section} must have 3 parts summing to head_dim/2 "
                     f"= {self.head_dim // 2}")

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family == "qwen3"


@dataclass
class MindVLConfig:
    """Vision tower + projector + language model. `vision=None` is a text-only model (e.g. a converted Qwen3)."""

    text: TextConfig
    vision: VisionConfig | None = None
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tokens_per_second: int = 2
    projector_seed: int | None = None  # recorded when the projector was freshly initialised (a MindVL composition)
    source: dict[str, Any] = field(default_factory=dict)  # provenance: where the towers came from

    def __post_init__(self) -> None:
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            _require(0 <= getattr(self, name) < self.text.vocab_size or self.vision is None, "mindvl",
                     f"{name}={getattr(self, name)} is outside the vocabulary (size {self.text.vocab_size})")

    @property
    def uses_mrope(self) -> bool:
        return self.text.mrope_section is not None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        return {"model_type": "mindvl", "architectures": ["MindVL"], **data}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MindVLConfig:
        data = dict(data)
        if data.pop("model_type", "mindvl") != "mindvl":
            raise ValueError("config.json: model_type is not 'mindvl'; convert it first with `mindvl convert`")
        data.pop("architectures", None)
        if "text" not in data:
            raise ValueError("config.json: missing required key 'text'")
        text = _from_dict(TextConfig, data.pop("text"), "config.json: text")
        vision_data = data.pop("vision", None)
        vision = _from_dict(VisionConfig, vision_data, "config.json: vision") if vision_data else None
        return _from_dict(cls, {**data, "text": text, "vision": vision}, "config.json")
