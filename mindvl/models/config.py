"""Architecture configs of the vision tower, the language models and the composed MindVL model.

Plain dataclasses, validated on construction; `from_dict` rejects unknown keys by name so a typo in a config.json
is an error, not a silently ignored field. Conversion *from* transformers' config.json lives in mindvl.checkpoint.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mindvl.typed import check_keys, field_names

T = TypeVar("T")


def _from_dict(cls: type[T], data: dict[str, Any], where: str, section: str = "") -> T:
    """`where`: the file, named in errors; `section`: the keys' prefix there ("text.")."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: {section.rstrip('.') or 'the top level'} must be a JSON object, got "
                         f"{_kind(data)}")
    try:  # mindvl.typed's wording, as for recipes: `config.json: text.foo: unknown key (known: ...)`
        check_keys(data, field_names(cls), section.rstrip("."))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    hints = typing.get_type_hints(cls)
    for key, value in data.items():
        if not _fits(value, hints[key]):
            raise ValueError(f"{where}: {section}{key} must be {_describe(hints[key])}, got {_kind(value)} "
                             f"{value!r}; fix the file")
    try:
        return cls(**data)
    except ValueError as exc:  # __post_init__'s checks name the section ("text: ..."); add the file
        raise ValueError(f"{where}: {exc}") from None


MAX_CONFIG_INT = 2**53


def _fits(value: Any, hint: Any) -> bool:
    """Does a JSON value have the field's type? (A wrong type would otherwise fail far away, e.g. a string
    hidden_size inside torch.empty with a misleading message.)"""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:  # a size beyond 2^53 (JSON's exact integers) is no model's: refused before torch sees it
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_CONFIG_INT
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list:
        (inner,) = typing.get_args(hint)
        return isinstance(value, (list, tuple)) and all(_fits(v, inner) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return True  # nested configs are checked by their own _from_dict


def _check_types(obj: Any, w: str) -> None:
    """Every field of a config dataclass has its annotated type (configs built in code or converted from another
    format; `_from_dict` checks files before construction with the file's name)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _fits(value, hints[f.name]):
            raise ValueError(f"{w}.{f.name} must be {_describe(hints[f.name])}, got {_kind(value)} {value!r}")


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin is list:
        return f"a list of {_describe(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    return names.get(hint, "an object" if origin is dict else str(hint))


def _kind(value: Any) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CONFIG_INT:
        return "an integer over 2^53"
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


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
    # "qwen2_5_vl" (the fields above) or "qwen3_vl" (vision_qwen3.py: 16-px patches, learned position embeddings
    # interpolated to each grid, LayerNorm blocks with a GELU MLP, per-frame attention (window fields unused), and
    # DeepStack: the states after blocks `deepstack_visual_indexes` go through their own mergers into the LLM).
    family: str = "qwen2_5_vl"
    num_position_embeddings: int | None = None  # qwen3_vl: a square table (e.g. 2304 = 48 x 48)
    deepstack_visual_indexes: list[int] | None = None  # qwen3_vl: e.g. [8, 16, 24]; [] turns DeepStack off

    FAMILIES = ("qwen2_5_vl", "qwen3_vl")

    def __post_init__(self) -> None:
        w = "vision"
        _check_types(self, w)
        _require(self.family in self.FAMILIES, w, f"family {self.family!r} is not one of {self.FAMILIES}")
        if self.family == "qwen3_vl":
            self._check_qwen3(w)
        _require(self.hidden_size % self.num_heads == 0, w, "hidden_size must be divisible by num_heads")
        _require((self.hidden_size // self.num_heads) % 4 == 0, w, "head_dim must be a multiple of 4 (2-D RoPE)")
        _require(self.family != "qwen2_5_vl" or (self.num_position_embeddings is None
                                                   and self.deepstack_visual_indexes is None), w,
                 "num_position_embeddings and deepstack_visual_indexes are only used by family 'qwen3_vl'")
        _require(all(0 <= i < self.depth for i in self.fullatt_block_indexes), w,
                 f"fullatt_block_indexes {self.fullatt_block_indexes} must lie in [0, depth={self.depth})")
        unit = self.spatial_merge_size * self.patch_size
        _require(self.family != "qwen2_5_vl" or self.window_size % unit == 0, w,
                 f"window_size must be a multiple of {unit}")
        self.fullatt_block_indexes = list(self.fullatt_block_indexes)

    def _check_qwen3(self, w: str) -> None:
        _require(self.num_position_embeddings is not None and self.num_position_embeddings > 0
                 and int(self.num_position_embeddings**0.5) ** 2 == self.num_position_embeddings, w,
                 f"family 'qwen3_vl' needs num_position_embeddings, a square number; got "
                 f"{self.num_position_embeddings}")
        self.deepstack_visual_indexes = list(self.deepstack_visual_indexes or [])
        _require(all(0 <= i < self.depth for i in self.deepstack_visual_indexes), w,
                 f"deepstack_visual_indexes {self.deepstack_visual_indexes} must lie in [0, depth={self.depth})")
        _require(len(set(self.deepstack_visual_indexes)) == len(self.deepstack_visual_indexes), w,
                 f"deepstack_visual_indexes {self.deepstack_visual_indexes} names a block more than once (its "
                 "merger after the first would never run)")
        self.fullatt_block_indexes = []  # every block attends over its whole frame: no windows

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


# DeepSeek-V3 fields: (neutral default filled in for family "deepseek_v3", or None when the key is required there).
_DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "moe_intermediate_size": None, "n_routed_experts": None, "num_experts_per_tok": None, "kv_lora_rank": None,
    "qk_nope_head_dim": None, "qk_rope_head_dim": None, "v_head_dim": None,
    "n_shared_experts": 0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "routed_scaling_factor": 1.0,
    "norm_topk_prob": True, "rope_interleave": True,
}
# Keys that are meaningful only for deepseek_v3 (a dense config that sets one is a mistake worth naming).
_DEEPSEEK_ONLY = (*_DEEPSEEK_DEFAULTS, "q_lora_rank", "rope_scaling")
_QWEN3_5_ONLY = ("layer_types", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                 "linear_num_key_heads", "linear_num_value_heads")


@dataclass
class TextConfig:
    """Decoder LLM: dense `qwen3` (q/k RMSNorm, no bias) or `qwen2` (qkv bias; Qwen2.5-VL's LLM), or `deepseek_v3`
    (MLA attention + DeepSeek-MoE with sigmoid, bias-corrected, group-limited routing; mindvl.models.moe).

    For `deepseek_v3`, `intermediate_size` is the width of the first `first_k_dense_replace` dense MLP layers, and
    (as in transformers' DeepseekV3Config) `head_dim` is derived = `qk_rope_head_dim` (the rotary width, which
    `mrope_section` splits) and `num_key_value_heads` = `num_attention_heads` (MLA expands its latent into one key
    and value per head). The DeepSeek keys stay None for the dense families, so older config.json files load.
    """

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
    # ---- deepseek_v3 only (see _DEEPSEEK_DEFAULTS for what is required and what defaults)
    moe_intermediate_size: int | None = None  # width of each routed expert (shared experts: x n_shared_experts)
    n_routed_experts: int | None = None
    n_shared_experts: int | None = None
    num_experts_per_tok: int | None = None  # top-k
    n_group: int | None = None  # experts are split into n_group groups; tokens may use only topk_group of them
    topk_group: int | None = None
    first_k_dense_replace: int | None = None  # layers [0, k) use a dense MLP, the rest MoE
    routed_scaling_factor: float | None = None  # multiplies the (normalised) routing weights
    norm_topk_prob: bool | None = None  # normalise the top-k weights to sum to 1
    q_lora_rank: int | None = None  # None -> a plain q_proj (DeepSeek-V2-Lite style); set -> q_a/q_b low-rank
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_interleave: bool | None = None  # rotary pairs stored interleaved (x0,x1),(x2,x3)... as in the checkpoints
    rope_scaling: dict[str, Any] | None = None  # None (plain RoPE) or transformers' yarn parameters
    attention_bias: bool = False  # bias on q_a/q/kv_a/o projections (deepseek_v3; False in released models)
    # M-RoPE layout: False = Qwen2.5-VL's contiguous t|h|w chunks, True = Qwen3-VL's interleaved t,h,w,t,h,w,...
    mrope_interleaved: bool = False
    # ---- qwen3_5 only (hybrid: Gated DeltaNet linear attention + gated full attention; see _check_qwen3_5)
    layer_types: list[str] | None = None  # per layer "linear_attention" or "full_attention"
    linear_conv_kernel_dim: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor channels (Qwen3.5: 0.25)
    shared_expert_intermediate_size: int | None = None  # qwen3_5_moe: one shared expert behind a sigmoid gate

    FAMILIES = ("qwen3", "qwen2", "deepseek_v3", "qwen3_moe", "qwen3_5", "qwen3_5_moe")

    def __post_init__(self) -> None:
        w = "text"
        _check_types(self, w)
        _require(self.family in self.FAMILIES, w, f"family {self.family!r} is not one of {self.FAMILIES}")
        if self.is_moe:
            self._check_deepseek(w)
        elif self.family == "qwen3_moe":
            self._check_qwen3_moe(w)
        elif self.is_hybrid:
            self._check_qwen3_5(w)
        else:
            for key in _DEEPSEEK_ONLY:
                _require(getattr(self, key) is None, w, f"{key} is only used by family 'deepseek_v3', not "
                         f"{self.family!r}; remove it")
            _require(not self.attention_bias, w, "attention_bias is only used by family 'deepseek_v3'")
        if not self.is_hybrid:
            for key in (*_QWEN3_5_ONLY, "shared_expert_intermediate_size"):
                _require(getattr(self, key) is None, w, f"{key} is only used by family 'qwen3_5'; remove it")
            _require(self.partial_rotary_factor == 1.0, w, "partial_rotary_factor is only used by family 'qwen3_5'")
        _require(self.num_attention_heads % self.num_key_value_heads == 0, w,
                 "num_attention_heads must be a multiple of num_key_value_heads")
        _require(self.head_dim % 2 == 0, w, "head_dim must be even")
        if self.mrope_section is not None:
            self.mrope_section = list(self.mrope_section)
            _require(len(self.mrope_section) == 3 and sum(self.mrope_section) == self.rotary_dim // 2, w,
                     f"mrope_section {self.mrope_section} must have 3 parts summing to the rotary dim / 2 "
                     f"= {self.rotary_dim // 2}")

    def _check_deepseek(self, w: str) -> None:
        for key, default in _DEEPSEEK_DEFAULTS.items():
            if getattr(self, key) is None:
                _require(default is not None, w, f"family 'deepseek_v3' requires {key}")
                setattr(self, key, default)

        def positive(*keys: str) -> None:
            for key in keys:
                _require(int(getattr(self, key)) > 0, w, f"{key} must be positive, got {getattr(self, key)}")

        positive("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "kv_lora_rank",
                 "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group")
        _require(self.qk_nope_head_dim >= 0, w, "qk_nope_head_dim must be >= 0")
        _require(self.n_shared_experts >= 0, w, "n_shared_experts must be >= 0")
        _require(self.q_lora_rank is None or self.q_lora_rank > 0, w, "q_lora_rank must be positive or null")
        _require(self.qk_rope_head_dim % 2 == 0, w, "qk_rope_head_dim must be even")
        _require(0 <= self.first_k_dense_replace <= self.num_hidden_layers, w,
                 f"first_k_dense_replace must lie in [0, num_hidden_layers={self.num_hidden_layers}]")
        e, g = self.n_routed_experts, self.n_group
        _require(e % g == 0, w, f"n_routed_experts ({e}) must be divisible by n_group ({g})")
        _require(g == 1 or e // g >= 2, w, "n_group > 1 needs at least 2 experts per group (groups score by top-2)")
        _require(self.topk_group <= g, w, f"topk_group ({self.topk_group}) must be <= n_group ({g})")
        _require(self.num_experts_per_tok <= self.topk_group * (e // g), w,
                 f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the experts of topk_group "
                 f"({self.topk_group}) groups of {e // g}")
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            _require(kind in ("yarn", "default"), w,
                     f"rope_scaling type {kind!r} is not supported for deepseek_v3 (yarn or none)")
            if kind == "default":
                self.rope_scaling = None
            else:
                for key in ("factor", "original_max_position_embeddings"):
                    _require(self.rope_scaling.get(key) is not None, w, f"rope_scaling (yarn) requires {key}")
        # Derived, as transformers' DeepseekV3Config does (see the class docstring).
        self.head_dim = self.qk_rope_head_dim
        self.num_key_value_heads = self.num_attention_heads

    def _check_qwen3_moe(self, w: str) -> None:
        """Qwen3-MoE (Qwen3-VL-30B-A3B's LLM): GQA with q/k norm; every layer's MLP is softmax-routed top-k experts
        (weights renormalised to sum 1), no shared experts, no groups, no correction bias."""
        for key in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            _require(getattr(self, key) is not None and getattr(self, key) > 0, w,
                     f"family 'qwen3_moe' requires a positive {key}")
        neutral = {"n_shared_experts": 0, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 0,
                   "routed_scaling_factor": 1.0, "norm_topk_prob": True}
        for key, value in neutral.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
            _require(getattr(self, key) == value, w, f"family 'qwen3_moe' has no {key} other than {value!r}")
        for key in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                    "rope_interleave", "rope_scaling"):
            _require(getattr(self, key) is None, w, f"{key} is only used by family 'deepseek_v3'; remove it")
        _require(not self.attention_bias, w, "attention_bias is only used by family 'deepseek_v3'")
        _require(self.num_experts_per_tok <= self.n_routed_experts, w,
                 "num_experts_per_tok must be <= n_routed_experts")

    def _check_qwen3_5(self, w: str) -> None:
        """Qwen3.5: layers of Gated DeltaNet (linear attention; Hk key heads of linear_key_head_dim, Hv value heads
        of linear_value_head_dim, Hv a multiple of Hk, a short conv of linear_conv_kernel_dim) and gated full
        attention (GQA, q/k norm, output gate, partial rotary), dense SwiGLU MLPs."""
        for key in _QWEN3_5_ONLY:
            _require(getattr(self, key) is not None, w, f"family 'qwen3_5' requires {key}")
        for key in _QWEN3_5_ONLY[1:]:
            _require(getattr(self, key) > 0, w, f"{key} must be positive, got {getattr(self, key)}")
        self.layer_types = list(self.layer_types)
        kinds = ("linear_attention", "full_attention")
        _require(len(self.layer_types) == self.num_hidden_layers, w,
                 f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        bad = sorted(set(self.layer_types) - set(kinds))
        _require(not bad, w, f"layer_types {bad} are not one of {kinds}")
        _require(self.linear_num_value_heads % self.linear_num_key_heads == 0, w,
                 "linear_num_value_heads must be a multiple of linear_num_key_heads")
        _require(0 < self.partial_rotary_factor <= 1 and self.rotary_dim % 2 == 0, w,
                 f"partial_rotary_factor {self.partial_rotary_factor} must give an even rotary dim in (0, head_dim]")
        _require(not self.attention_bias, w, "attention_bias is not supported for family 'qwen3_5'")
        if self.family == "qwen3_5_moe":  # Qwen3-MoE's softmax routing on every layer, plus a gated shared expert
            _require(self.shared_expert_intermediate_size is not None and self.shared_expert_intermediate_size >= 0,
                     w, "family 'qwen3_5_moe' requires shared_expert_intermediate_size (>= 0)")
            self._check_qwen3_moe(w)
            return
        for key in (*_DEEPSEEK_ONLY, "moe_intermediate_size", "shared_expert_intermediate_size"):
            _require(getattr(self, key) is None, w, f"{key} is not used by family 'qwen3_5'; remove it")

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates (head_dim, except Qwen3.5's partial rotary)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_hybrid(self) -> bool:
        """Qwen3.5: linear-attention and full-attention layers (text.py picks per layer)."""
        return self.family in ("qwen3_5", "qwen3_5_moe")

    def layer_kind(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types is not None else "full_attention"

    @property
    def is_moe(self) -> bool:
        """DeepSeek-V3 (MLA + DeepSeek-MoE); Qwen3-MoE is `has_experts` but keeps GQA."""
        return self.family == "deepseek_v3"

    @property
    def has_experts(self) -> bool:
        return self.family in ("deepseek_v3", "qwen3_moe", "qwen3_5_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.family == "qwen2"

    @property
    def qk_norm(self) -> bool:
        return self.family in ("qwen3", "qwen3_moe")


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
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> MindVLConfig:
        """`where`: the file the dict was read from, named in errors."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: the top level must be a JSON object, got {_kind(data)}")
        data = dict(data)
        if data.pop("model_type", "mindvl") != "mindvl":
            raise ValueError(f"{where}: model_type is not 'mindvl'; convert it first with `mindvl convert`")
        data.pop("architectures", None)
        if "text" not in data:
            raise ValueError(f"{where}: missing required key 'text'")
        text = _from_dict(TextConfig, data.pop("text"), where, "text.")
        vision_data = data.pop("vision", None)
        vision = _from_dict(VisionConfig, vision_data, where, "vision.") if vision_data else None
        return _from_dict(cls, {**data, "text": text, "vision": vision}, where)
