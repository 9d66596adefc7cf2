"""Model FLOPs and MFU, counted on the real packed tokens and patches of a step (no padding counted).

FLOPs are matmul FLOPs (2 per multiply-add) of the vision tower, projector and language model; attention is counted
exactly per sequence (causal: L(L+1)/2 query-key pairs; vision: full squares per window or frame). The vocabulary
projection is counted for labelled tokens only, because that is all mindvl computes (chunked loss).

Backward cost depends on what trains (a warm-up trains only the projector): a trainable module's backward is 2x its
forward (gradients of activations and of weights); a frozen module that the gradient must still cross (the LLM
between the projector and the loss) costs 1x its weight matmuls (activation gradients only) plus 2x its attention
(dQ, dK, dV have no weights to skip); a frozen module before every trainable one (the vision tower in the warm-up)
has no backward at all. With everything trainable this is the usual 3x the forward.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch

from mindvl.conventions import MODULES
from mindvl.models.config import MindVLConfig, TextConfig

PEAK_ENV = "MINDVL_PEAK_TFLOPS"
# Dense bf16 tensor-core peaks in TFLOP/s (vendor datasheets; Ascend from the MindVL paper's Table 10).
PEAK_TFLOPS_BF16 = {
    "H100": 989.0,
    "H200": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "910B1": 400.0,
    "910B2": 376.0,
    "910B": 376.0,
}

# The towers in data-flow order: the gradient flows from the language model back to the first trainable module.
MODULE_ORDER = MODULES


def _seq_pairs(lengths: list[int], causal: bool) -> int:
    return sum(n * (n + 1) // 2 if causal else n * n for n in lengths)


def _text_layer_flops(t: TextConfig) -> tuple[int, int]:
    """(weight FLOPs per token, attention FLOPs per causal query-key pair), summed over all decoder layers.

    Dense: q/k/v/o projections and a gated MLP. DeepSeek-V3: MLA's low-rank projections, attention over
    (nope + rope)-wide keys and v_head_dim-wide values, a dense gated MLP in the first `first_k_dense_replace`
    layers and, in the others, the router plus the experts a token actually uses (top-k routed + shared): MoE
    FLOPs count activated parameters, not all experts."""
    h = t.hidden_size
    if t.is_hybrid:
        return _hybrid_layer_flops(t)
    if not t.is_moe:
        q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
        mlp = 3 * h * t.intermediate_size
        if t.has_experts:  # Qwen3-MoE: the router and the top-k experts a token uses, on every layer
            mlp = h * t.n_routed_experts + t.num_experts_per_tok * 3 * h * t.moe_intermediate_size
        per_token = 2 * (h * (q + 2 * kv) + q * h + mlp)
        return t.num_hidden_layers * per_token, t.num_hidden_layers * 2 * 2 * q  # QK^T and AV
    heads, qk = t.num_attention_heads, t.qk_nope_head_dim + t.qk_rope_head_dim
    q_proj = h * heads * qk if t.q_lora_rank is None else h * t.q_lora_rank + t.q_lora_rank * heads * qk
    kv_proj = h * (t.kv_lora_rank + t.qk_rope_head_dim) + t.kv_lora_rank * heads * (t.qk_nope_head_dim + t.v_head_dim)
    attention = 2 * (q_proj + kv_proj + heads * t.v_head_dim * h)
    dense_mlp = 2 * 3 * h * t.intermediate_size
    active_experts = t.num_experts_per_tok + t.n_shared_experts
    moe_mlp = 2 * (h * t.n_routed_experts + active_experts * 3 * h * t.moe_intermediate_size)
    dense = t.first_k_dense_replace
    per_token = t.num_hidden_layers * attention + dense * dense_mlp + (t.num_hidden_layers - dense) * moe_mlp
    return per_token, t.num_hidden_layers * 2 * heads * (qk + t.v_head_dim)


def _hybrid_layer_flops(t: TextConfig, chunk: int = 64) -> tuple[int, int]:
    """Qwen3.5: only the full-attention layers have query-key pairs; a linear-attention layer costs the same per
    token whatever the length. Full layers: q_proj twice as wide (query + output gate), k, v, o, the MLP. Linear
    layers: in_proj_qkv/z/a/b and out_proj, the depthwise conv, and the chunked delta rule as mindvl runs it
    (delta_rule.py), per token and value head: its share of the C x C chunk products (K K^T, Q K^T: 2 * 2C dk;
    (QK^T * M) U: 2C dv; the triangular solves for V and K: C (dv + dk)) and of the state reads and update
    (W_k S0, Q S0, K^T U: 3 * 2 dk dv). Samples are assumed to fill their last chunk (the padding is not counted)."""
    h, layers = t.hidden_size, t.num_hidden_layers
    full = sum(1 for i in range(layers) if t.layer_kind(i) == "full_attention")
    q, kv = t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    mlp = 3 * h * t.intermediate_size
    if t.has_experts:  # Qwen3.5-MoE: router, the top-k experts a token uses, the gated shared expert
        mlp = (h * t.n_routed_experts + t.num_experts_per_tok * 3 * h * t.moe_intermediate_size
               + 3 * h * t.shared_expert_intermediate_size + h)
    full_token = 2 * (h * (2 * q + 2 * kv) + q * h + mlp)
    hv, dk, dv = t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim
    key_dim, value_dim = t.linear_num_key_heads * dk, hv * dv
    conv_dim = 2 * key_dim + value_dim
    projections = 2 * (h * (conv_dim + value_dim + 2 * hv) + value_dim * h + mlp)
    conv = 2 * conv_dim * t.linear_conv_kernel_dim
    rule = hv * (2 * 2 * chunk * dk + 2 * chunk * dv + chunk * (dv + dk) + 3 * 2 * dk * dv)
    return full * full_token + (layers - full) * (projections + conv + rule), full * 2 * 2 * q


def flops_by_module(config: MindVLConfig, text_lengths: list[int], labelled_tokens: int,
                    grid_thw: list[list[int]] | None = None) -> dict[str, tuple[float, float]]:
    """Forward FLOPs per module as (weight matmuls, attention score/value matmuls) for one packed row."""
    t = config.text
    tokens = sum(text_lengths)
    per_token, per_pair = _text_layer_flops(t)
    text_weights = tokens * per_token + 2 * labelled_tokens * t.hidden_size * t.vocab_size
    text_attention = per_pair * _seq_pairs(text_lengths, causal=True)
    out = {"language_model": (float(text_weights), float(text_attention))}
    if config.vision is not None and grid_thw:
        v = config.vision
        d, merge = v.hidden_size, v.spatial_merge_size
        patches = sum(a * b * c for a, b, c in grid_thw)
        side = v.window_size // v.patch_size  # window side in patches (8 for 112 px)
        window_pairs = frame_pairs = 0
        for gt, gh, gw in grid_thw:
            frame_pairs += gt * (gh * gw) ** 2
            # full windows, and the partial ones along the bottom and right edges
            rows = [side] * (gh // side) + ([gh % side] if gh % side else [])
            cols = [side] * (gw // side) + ([gw % side] if gw % side else [])
            window_pairs += gt * sum((r * c) ** 2 for r in rows for c in cols)
        gated = 2 if v.family == "qwen3_vl" else 3  # Qwen3-VL's ViT MLP has no gate
        per_patch = 2 * (4 * d * d + gated * d * v.intermediate_size)
        n_full = v.depth if v.family == "qwen3_vl" else len(v.fullatt_block_indexes)  # Qwen3-VL: no windows
        vision_attention = 2 * 2 * d * (n_full * frame_pairs + (v.depth - n_full) * window_pairs)
        merged = patches // (merge * merge)
        inner = d * merge * merge
        out["visual"] = (float(2 * patches * v.patch_dim * d + v.depth * patches * per_patch),
                         float(vision_attention))
        mergers = 1 + len(v.deepstack_visual_indexes or [])  # Qwen3-VL: one more merger per DeepStack block
        out["projector"] = (float(mergers * 2 * merged * (inner * inner + inner * t.hidden_size)), 0.0)
    return out


def forward_flops(config: MindVLConfig, text_lengths: list[int], labelled_tokens: int,
                  grid_thw: list[list[int]] | None = None) -> float:
    """Forward matmul FLOPs for one packed row: sample lengths, labelled-token count and image grids (t, h, w)."""
    parts = flops_by_module(config, text_lengths, labelled_tokens, grid_thw)
    return sum(w + a for w, a in parts.values())


def training_flops(config: MindVLConfig, text_lengths: list[int], labelled_tokens: int,
                   grid_thw: list[list[int]] | None = None, trainable: Sequence[str] = MODULE_ORDER) -> float:
    """Forward + backward FLOPs when the modules in `trainable` train (see the module docstring)."""
    unknown = set(trainable) - set(MODULE_ORDER)
    if unknown:
        raise ValueError(f"trainable: unknown module(s) {sorted(unknown)} (known: {MODULE_ORDER})")
    first = min((MODULE_ORDER.index(m) for m in trainable), default=len(MODULE_ORDER))
    total = 0.0
    for name, (weights, attention) in flops_by_module(config, text_lengths, labelled_tokens, grid_thw).items():
        total += weights + attention
        if MODULE_ORDER.index(name) < first:
            continue  # no gradient reaches it
        total += (2.0 if name in trainable else 1.0) * weights + 2.0 * attention
    return total


def device_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> tuple[float, str]:
    """(peak FLOP/s, how it was obtained): `MINDVL_PEAK_TFLOPS` when set (a device missing from the datasheet table,
    or a fixed figure so MFU is comparable across runs), the datasheet table for known accelerators, else a measured
    matmul."""
    override = os.environ.get(PEAK_ENV, "").strip()
    if override:
        try:
            tflops = float(override)
        except ValueError:
            tflops = float("nan")
        if not tflops > 0:
            raise ValueError(f"{PEAK_ENV}={override!r}: give the device's peak in TFLOP/s as a positive number "
                             "(e.g. 989 for an H100 in bf16), or unset it to use the datasheet table / a measured peak")
        return tflops * 1e12, f"{PEAK_ENV}={override}"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS_BF16.items():
            if key in name.replace(" ", ""):
                return tflops * 1e12, f"{name} datasheet bf16"
    if device.type == "npu":
        name = torch.npu.get_device_name(device)  # type: ignore[attr-defined]
        for key, tflops in PEAK_TFLOPS_BF16.items():
            if key in name:
                return tflops * 1e12, f"{name} datasheet bf16"
    return measure_matmul_flops(device, dtype), f"measured {dtype} matmul on {device.type}"


_MEASURED: dict[tuple[str, torch.dtype], float] = {}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int = 2048, repeats: int = 10) -> float:
    """Best achieved FLOP/s of an n x n matmul: the practical peak of a device without a datasheet entry (CPUs).

    Measured once per (device, dtype) and cached: after warm-up, the best of `repeats` runs, so a moment of
    contention on a shared machine does not lower the peak (which would push MFU above 100%).
    """
    key = (str(device), dtype)
    if key in _MEASURED:
        return _MEASURED[key]
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):  # warm-up: thread pools, caches, clocks
        a @ b
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    _MEASURED[key] = 2 * n**3 / best
    return _MEASURED[key]


def pack_training_flops(config: MindVLConfig, batch: dict, labelled_tokens: int,
                        trainable: Sequence[str] = MODULE_ORDER) -> float:
    """Training FLOPs of one packed micro-batch (the dict of `Pack.to_torch()`), on its real tokens and patches;
    `labelled_tokens` is the number of loss targets (the trainer counts them exactly, once)."""
    layout = batch.get("layout")  # host values (PackLayout) when the trainer's stream described the pack
    cu = list(layout.cu_seqlens) if layout is not None else batch["cu_seqlens"].tolist()
    lengths = [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]
    grid = batch.get("image_grid_thw")
    if layout is not None:
        grid_list = [list(g) for g in layout.grid_thw] or None
    else:
        grid_list = grid.tolist() if grid is not None and len(grid) else None
    return training_flops(config, lengths, labelled_tokens, grid_list, trainable)
