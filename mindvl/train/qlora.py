"""QLoRA: the frozen base weights of the adapted linear layers held in 4-bit NF4, the adapters in full precision.

Backend: torchao (`torchao.dtypes.nf4tensor`), not bitsandbytes. Why:
- torchao's `NF4Tensor` is a tensor subclass written in PyTorch ops: it dequantizes with ordinary torch kernels on
  any device torch runs on (CUDA, CPU, and NPU through torch's dispatcher), where bitsandbytes' 4-bit matmuls are
  CUDA kernels first and its other backends are partial;
- the subclass leaves the model's `nn.Linear` / `LoRALinear` in place (only the weight tensor changes), where
  bitsandbytes swaps layers for its own `Linear4bit` class, so the model would stop being plain PyTorch;
- it implements FSDP2's all-gather extension hooks and is what torchtune's and torchtitan's QLoRA use, the path for
  sharding a 4-bit base later; bitsandbytes' `Params4bit` targets FSDP1 (`quant_storage`).
Both are maintained; torchao is also the PyTorch project's own.

Scope here: one process without FSDP (`parallel.fsdp: off`, `parallel.mixed_precision: fp32`: a bf16 run on one
device is FSDP over a one-rank group), the base quantized once after it is loaded. Not done: QLoRA under that bf16
one-rank FSDP policy, which the planner's verdict for `recipes/mindvl-8b/sft-8k-qlora-24g.yaml` assumes; it needs the
NF4 weights kept out of FSDP (`fully_shard(..., ignored_params=...)`) and a check of how the planner's tracker counts
them. Where torchao is missing, or the run would wrap the base in FSDP, the recipe is refused in one line before
anything is built. The planner does not need torchao: it traces the bf16 base and counts NF4's bytes for the adapted
weights instead (`NF4_BYTES_PER_PARAM`).
"""

from __future__ import annotations

import torch
from torch import nn

from mindvl.models.lora import LoRALinear, lora_layers

# torchao NF4: 4 bits per weight + one int8 scale per block of 64 + one fp32 scale per 256 blocks (double quantization)
NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)


def _backend():
    try:
        from torchao.dtypes.nf4tensor import linear_nf4, to_nf4
    except ImportError:
        return None
    return to_nf4, linear_nf4


def require_backend(kind: str, uses_fsdp: bool = False) -> None:
    """One-line refusal where QLoRA cannot run: its backend (torchao) is not installed, or the base would be
    sharded."""
    if kind != "nf4":
        raise ValueError(f"model.lora.quantize: unknown {kind!r} (known: nf4)")
    if _backend() is None:
        raise ValueError("model.lora.quantize: nf4 (QLoRA) needs torchao, which is not installed here; "
                         "pip install torchao, or set model.lora.quantize: null for LoRA on a bf16 base")
    if uses_fsdp:
        raise ValueError("model.lora.quantize: QLoRA here runs one process with an unsharded 4-bit base, outside "
                         "FSDP; set parallel.fsdp: off and parallel.mixed_precision: fp32 (a bf16 run on one device is "
                         "FSDP over one rank), or use LoRA on a bf16 base")


class NF4LoRALinear(LoRALinear):
    """A LoRALinear whose frozen base weight is an NF4Tensor: the base product dequantizes it block by block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, linear_nf4 = _backend()
        out = linear_nf4(x, self.weight)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        update = torch.nn.functional.linear(torch.nn.functional.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)),
                                            self.lora_B.to(x.dtype))
        return out + update * self.scaling


@torch.no_grad()
def quantize_frozen_base(model: nn.Module, kind: str) -> int:
    """Replace every adapted layer's frozen base weight by its NF4 form (after the weights were filled); returns how
    many layers were quantized."""
    require_backend(kind)
    to_nf4, _ = _backend()
    n = 0
    for _, layer in lora_layers(model):
        layer.weight = nn.Parameter(to_nf4(layer.weight.detach().to(torch.bfloat16)), requires_grad=False)
        layer.__class__ = NF4LoRALinear
        n += 1
    return n
