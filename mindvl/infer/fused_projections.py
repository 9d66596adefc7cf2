"""A decode step's projections of one input as one matmul: q/k/v of each attention, gate/up of each dense MLP.

    with fused_projections(model) as fused:    # how many groups were fused; generate() does this when it compiles
        generate(model, prompts, n)

Why: at small batch a decode step's time is one read of the weights plus a cost per kernel (decode_compile.py).
Compiled, a Qwen2.5-VL decoder layer is 14 kernels, seven of them matmuls; with q/k/v as one and gate/up as one it
is 9 (`benchmarks/decode_kernels.py`: three matmuls fewer, and the q and k rotations, with the cache writes, one
kernel), and a wide matmul reads its weights closer to the memory's bandwidth than a narrow one (k_proj and v_proj
of a GQA model are an eighth of q_proj's width).

How, without a second copy of the weights: the projections' parameters are moved, once, into one buffer, one after
another (`param.data = view`: the same Parameter objects, values and state_dict keys; the optimizer and the
checkpoint writers see no difference), and the fused weight is a view of that buffer. Each fused module gets it as
an attribute (`fused_qkv`, `fused_gate_up`: layers.split_linear) for the duration of the context only, so a forward
outside a generation (training, whose gradients must reach the parameters) runs the projections one by one. The
views are made again on each entry (no copy while the parameters stay laid out; compiled code guards on their
shapes, not their identity); parameters moved since (`model.to(...)`, a load with assign=True) are gathered again.

Fused only where it changes nothing but the kernel count: exactly nn.Linear projections (not LoRA's, whose adapter
the fused matmul would skip) without hooks (global ones included), plain tensors (not DTensor: FSDP and tensor
parallelism shard them), all of one device and dtype, and all made under inference mode or none (inference tensors
are moved and viewed inside it).

Numerics: each output is the same dot product, but the matmul library picks its kernel by shape, and a wider matrix
may get another one: on the CPU a bf16 decode step's logits are bit-identical fused (tests/test_fused_projections.py;
`benchmarks/decode_kernels.py --check-bits`, hidden 1024), while MKL's fp32 path for an 8-wide output sums in
another order (the test model's k/v; last-bit differences, the tokens unchanged). On a GPU cuBLAS may likewise pick
another kernel for the wider matrix, which is why this rides with compilation (decode_compile: checked on the
device by the accelerator proof's compiled arm) and MINDVL_DECODE_FUSE=off turns it off there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from mindvl.models.gated_attention import GatedAttention
from mindvl.models.layers import GatedMLP
from mindvl.models.text import GQAttention

FUSE_ENV = "MINDVL_DECODE_FUSE"

# module class -> (the attribute its forward reads, the projections it fuses, in their output order)
GROUPS: dict[type, tuple[str, tuple[str, ...]]] = {
    GQAttention: ("fused_qkv", ("q_proj", "k_proj", "v_proj")),
    GatedAttention: ("fused_qkv", ("q_proj", "k_proj", "v_proj")),
    GatedMLP: ("fused_gate_up", ("gate_proj", "up_proj")),
}


def _fusable(linears: list) -> bool:
    if not all(type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks for lin in linears):
        return False
    if len({lin.in_features for lin in linears}) != 1 or len({lin.bias is None for lin in linears}) != 1:
        return False
    params = [p for lin in linears for p in (lin.weight, lin.bias) if p is not None]
    return (all(type(p.data) is torch.Tensor and not p.is_meta for p in params)
            and len({(p.device, p.dtype, p.is_inference()) for p in params}) == 1)


def _one_after_another(parts: list[torch.Tensor]) -> bool:
    """Whether the tensors lie contiguous, in order, with no gap, in one storage."""
    storage, offset = parts[0].untyped_storage().data_ptr(), parts[0].storage_offset()
    for p in parts:
        if p.untyped_storage().data_ptr() != storage or p.storage_offset() != offset or not p.is_contiguous():
            return False
        offset += p.numel()
    return True


def _gather(params: list[nn.Parameter]) -> None:
    """Move the parameters into one new buffer, one after another (one copy of this group; the old storage is
    freed when nothing else holds it)."""
    whole = torch.cat([p.detach() for p in params])
    for p, piece in zip(params, whole.split([p.shape[0] for p in params]), strict=True):
        p.data = piece


def _span(parts: list[torch.Tensor]) -> torch.Tensor:
    """The view over parts laid out one after another: [sum of rows, *rest]."""
    first = parts[0].detach()
    return first.as_strided((sum(p.shape[0] for p in parts), *first.shape[1:]), first.stride())


def _fused(module: nn.Module, names: tuple[str, ...]) -> tuple | None:
    linears = [getattr(module, name) for name in names]
    if not _fusable(linears):
        return None
    weights = [lin.weight for lin in linears]
    biases = [lin.bias for lin in linears] if linears[0].bias is not None else []
    # Parameters made under inference mode (a model loaded inside it) are moved and viewed inside it; ordinary
    # ones outside it, so that they stay ordinary (training may follow).
    with torch.inference_mode(weights[0].is_inference()):
        for group in (weights, biases):
            if group and not _one_after_another(group):
                _gather(group)
        return _span(weights), _span(biases) if biases else None, [w.shape[0] for w in weights]


@contextlib.contextmanager
def fused_projections(model: nn.Module) -> Iterator[int]:
    """Attach the fused projections to the language model's modules for the duration (module docstring); yields
    how many groups are fused. Nested use is harmless: an inner context leaves what an outer one attached."""
    attached = []
    with torch.no_grad():
        if not (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks):
            for module in model.language_model.modules():
                attr, names = GROUPS.get(type(module), (None, ()))
                if attr is None or getattr(module, attr) is not None:
                    continue
                fused = _fused(module, names)
                if fused is not None:
                    setattr(module, attr, fused)
                    attached.append((module, attr))
    try:
        yield len(attached)
    finally:
        for module, attr in attached:
            delattr(module, attr)  # back to the class's None
