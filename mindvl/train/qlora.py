"""QLoRA: the frozen base weights of the adapted linear layers held in 4-bit NF4, the adapters in full precision.

Backend: torchao's `NF4Tensor` (`pip install 'mindvl[qlora]'`; `torchao.quantization` since 0.15, before that
`torchao.dtypes.nf4tensor`), not bitsandbytes. Why:
- torchao's `NF4Tensor` is a tensor subclass written in PyTorch ops: it dequantizes with ordinary torch kernels on
  any device torch runs on (CUDA, CPU, and NPU through torch's dispatcher), where bitsandbytes' 4-bit matmuls are
  CUDA kernels first and its other backends are partial; so the CPU tests run the real NF4 code;
- the subclass leaves the model's `nn.Linear` / `LoRALinear` in place (only the weight tensor changes: `F.linear`
  on an NF4 weight dequantizes it block by block), where bitsandbytes swaps layers for its own `Linear4bit` class,
  so the model stays plain PyTorch;
- it is what torchtune's and torchtitan's QLoRA use, and maintained by the PyTorch project itself.
The wheel has no runtime dependencies (3.4 MB for 0.18.0; its CUDA extensions load only where CUDA is).

NF4 (Dettmers et al. 2023): each block of 64 consecutive weights is scaled by its absolute maximum and every weight
stored as the index (4 bits) of the nearest of 16 fixed values (`NF4_CODEBOOK`); the block scales themselves are
quantized to int8 around their mean, in groups of `scaler_block` scales with one float factor each ("double
quantization"). torchao needs the scales to split into whole groups, so the group is the largest divisor of the
number of blocks up to 256 (256 for every real LLM layer; smaller for tiny test layers): `nf4_blocks`.

Under FSDP2 (any world size, and the bf16 policy on one device) the NF4 weights stay OUT of `fully_shard`
(`ignored_params`, `fsdp_ignored`): every rank holds the whole 4-bit base of the adapted layers, FSDP shards and
all-gathers the rest (adapters, biases, norms, embeddings, modules trained in full). Why not shard the NF4 tensors
(torchao implements FSDP2's all-gather hooks for them, as torchtune uses):
- QLoRA is for one or two accelerators: at 8B the replicated 4-bit base is ~3.6 GB per rank, and sharding it over
  2 ranks would save ~1.8 GB but all-gather it twice per micro-batch (forward and backward), every step, for
  weights that never change; replicated, the frozen base costs no communication at all;
- a sharded NF4 tensor must split into whole quantization groups on dim 0 (64 x 256 weights per group at least,
  evenly over the ranks, no padding: torchao's `narrow` refuses anything else), which ties the world size to the
  layer shapes; replicated, any world size and any layer shape runs;
- checkpoints leave the frozen base out anyway (train.frozen_base), so no NF4 tensor ever goes through DCP.
The planner counts exactly this (mindvl.plan.planner): its trace sees the adapted base weights as unsharded
parameters outside FSDP (the `lora` step marks them, `_fsdp` ignores them), in bf16, and it replaces their bytes
by NF4's per rank.

Where torchao is missing the recipe is refused in one line before anything is built. The planner does not need
torchao.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from mindvl.models.lora import LoRAConfig, lora_layers

# The 16 NF4 values (quantiles of N(0, 1) scaled to [-1, 1], with an exact 0; QLoRA's appendix E), as torchao
# stores them: the independent reference the tests quantize against.
NF4_CODEBOOK = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0,
                0.0796, 0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0)
BLOCK = 64  # weights per absmax scale
SCALER_BLOCK = 256  # scales per float factor of the double quantization (at most)
# 4 bits per weight + one int8 scale per block of 64 + one fp32 factor per 256 blocks (double quantization)
NF4_BYTES_PER_PARAM = 0.5 + 1 / BLOCK + 4 / (BLOCK * SCALER_BLOCK)
INSTALL = "pip install 'mindvl[qlora]' (torchao)"


def _backend():
    """(to_nf4, NF4Tensor) from torchao, or None where it is not installed."""
    logging.getLogger("torchao").setLevel(logging.ERROR)  # its CUDA-only extensions "fail to load" on a CPU build
    try:
        from torchao.quantization import NF4Tensor, to_nf4
    except ImportError:
        try:
            from torchao.dtypes.nf4tensor import NF4Tensor, to_nf4
        except ImportError:
            return None
    return to_nf4, NF4Tensor


def require_backend(kind: str) -> None:
    """One-line refusal where QLoRA cannot run: its backend (torchao) is not installed."""
    if kind != "nf4":
        raise ValueError(f"model.lora.quantize: unknown {kind!r} (known: nf4)")
    if _backend() is None:
        raise ValueError("model.lora.quantize: nf4 (QLoRA) needs torchao, which is not installed here; "
                         f"{INSTALL}, or set model.lora.quantize: null for LoRA on a bf16 base")


def nf4_blocks(numel: int, name: str = "weight") -> tuple[int, int]:
    """(block, scaler_block) for a weight of `numel` elements (see the module docstring)."""
    if numel % BLOCK:
        raise ValueError(f"model.lora.quantize: {name} has {numel} elements, not a multiple of NF4's block of "
                         f"{BLOCK}; leave that layer out of model.lora.targets or set model.lora.quantize: null")
    blocks = numel // BLOCK
    return BLOCK, max(d for d in range(1, min(SCALER_BLOCK, blocks) + 1) if blocks % d == 0)


def quantized(weight: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """`weight` in NF4 (torchao), in its own dtype (bf16 under a bf16 run, fp32 on a CPU fp32 run)."""
    to_nf4, _ = _backend()
    return to_nf4(weight.detach().contiguous(), *nf4_blocks(weight.numel(), name))


def is_quantized(t: torch.Tensor) -> bool:
    backend = _backend()
    return backend is not None and isinstance(t, backend[1])


def dequantized(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: an NF4 weight dequantized to its dtype (what the forward multiplies by); others as they are.
    (`NF4Tensor.float()` stays NF4; `.to(dtype)` dequantizes.)"""
    return t.to(t.dtype) if is_quantized(t) else t


def fsdp_ignored(model: nn.Module, cfg: LoRAConfig | None) -> set[nn.Parameter]:
    """The parameters FSDP must leave alone: under QLoRA, every adapted layer's base weight (see the module
    docstring). Taken on the meta-device model, before FSDP wraps it."""
    if cfg is None or cfg.quantize is None:
        return set()
    return {layer.weight for _, layer in lora_layers(model)}


class StreamQuantizer:
    """QLoRA's adapted base weights, quantized one at a time as the weights stream in (mindvl.train.materialize):
    they are taken out of the model before `to_empty`, so the full-precision base of the adapted layers is never
    allocated whole (at 8B that would be 13 GiB of bf16 before the first step); each arrives as a full tensor, is
    quantized on the device and set as the layer's NF4 weight (frozen; FSDP ignores it: `fsdp_ignored`)."""

    def __init__(self, model: nn.Module, kind: str, device: torch.device, name_of=lambda name: name) -> None:
        """`name_of`: a layer's name in the weight stream (materialize.canonical_name: without wrapper prefixes)."""
        require_backend(kind)
        self.device, self.pending = device, {}
        for name, layer in lora_layers(model):
            self.pending[name_of(name) + ".weight"] = (layer, layer.weight.dtype)
            layer._parameters["weight"] = None  # to_empty and fill_weights pass it by; `take` sets it

    def take(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass every tensor through except the adapted base weights, which become NF4 weights here."""
        for name, full in tensors:
            entry = self.pending.pop(name, None)
            if entry is None:
                yield name, full
                continue
            layer, dtype = entry
            with torch.no_grad():
                weight = quantized(full.to(device=self.device, dtype=dtype), name)
            layer.weight = nn.Parameter(weight, requires_grad=False)

    def check_done(self) -> None:
        if self.pending:
            raise ValueError(f"weights: no value for {sorted(self.pending)[:5]} ({len(self.pending)} tensors)")


@torch.no_grad()
def quantize_like_run(model: nn.Module, ref: dict) -> None:
    """`mindvl export` of a QLoRA checkpoint (its `frozen_base` entry `ref`): every adapted layer's base weight
    replaced by what the run multiplied by: its NF4 form in the run's dtype, dequantized."""
    require_backend(ref["quantize"])
    dtype = getattr(torch, ref["dtype"])
    for name, layer in lora_layers(model):
        layer.weight.copy_(dequantized(quantized(layer.weight.to(dtype), f"{name}.weight")))


# Dequantizing an NF4 weight (torchao's get_original_weight, in a forward and again in the backward) holds about 14
# bytes per weight at its high-water in bf16 (20 in fp32): int64 code indices for both nibbles, the looked-up
# halves, their scaled copies and the stacked result, alive together. Measured with c10's allocator high-water on
# (1024, 512) and (2048, 1024) weights: benchmarks/bench_qlora.py, RESULTS.md "LoRA / QLoRA".
DEQUANT_BYTES_PER_PARAM = {torch.bfloat16: 14, torch.float32: 20}


def resident_and_transient(model: nn.Module, dtype: torch.dtype) -> tuple[int, int, int]:
    """QLoRA's memory as the planner must count it (its trace holds the adapted base weights whole, outside FSDP, in
    the compute dtype, and dequantizes nothing): (their NF4 bytes, all of them on every rank; their bytes in
    `dtype`, what the trace held instead; the transient of dequantizing the largest, DEQUANT_BYTES_PER_PARAM)."""
    sizes = [layer.weight.numel() for _, layer in lora_layers(model)]
    per_param = DEQUANT_BYTES_PER_PARAM.get(dtype, DEQUANT_BYTES_PER_PARAM[torch.float32])
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(nf4_bytes(n) for n in sizes), itemsize * sum(sizes), per_param * max(sizes, default=0)


def nf4_bytes(numel: int) -> int:
    """What torchao stores for one weight of `numel` elements (fp32 factors): data, int8 scales, factors."""
    block, scaler = nf4_blocks(numel)
    return numel // 2 + numel // block + 4 * math.ceil(numel / (block * scaler))

