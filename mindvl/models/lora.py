"""LoRA: low-rank adapters on chosen linear layers, injected from outside the model (the model stays plain PyTorch).

    cfg = build(LoRAConfig, {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"]}, "model.lora")
    names = inject_lora(model, cfg)       # every matching nn.Linear becomes a LoRALinear (same weight, same bias)

`LoRALinear` is an `nn.Linear` with two more parameters, `lora_A` [r, in] and `lora_B` [out, r]:

    y = x W^T + b + (dropout(x) A^T) B^T * alpha / r

(PEFT's LoRA forward, in the same order of operations, so PEFT and mindvl agree to float rounding). The base weight
and bias keep their names (`...q_proj.weight`), so weight filling, checkpoints and the key tables see the model they
know plus `...q_proj.lora_A` / `...q_proj.lora_B`. A starts as PEFT's default (Kaiming-uniform, a = sqrt(5)), B at
zero, so the adapted model starts equal to the base.

Which layers: `targets` are attribute names of `nn.Linear` layers (q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj in the LLMs; qkv, proj, gate_proj, up_proj, down_proj in the vision tower; fc1, fc2 in the
projector) inside the top-level `modules` (visual, projector, language_model). The LM head is read directly by the
chunked loss, so it takes no adapter.

In a DeepSeek-style MoE model the adapters go on the attention (MLA's q_proj or q_a_proj/q_b_proj,
kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense MLPs of the first layers and the shared experts; the routed experts
and the router take none and stay frozen. Why: the routed experts are stacked [E, out, in] tensors run by grouped
matmuls, not linear layers, and an adapter each would multiply the adapters by E (256 per layer at 671B), to be
sharded by expert parallelism and dispatched with the tokens, for weights each token meets top-k of; PEFT's
adapters for fused 3-D experts (`target_parameters`) are not a layout serving stacks load; an adapted router would
move the expert load that the balancing keeps even. The shared experts see every token, so they carry the MoE
layers' adaptation. Under expert parallelism nothing changes for the adapters (their layers are not expert-sharded).
A module named in `modules` trains only its adapters; the others train or stay frozen as the phase says
(`phase.trainable`), so "projector fully trained + LLM LoRA" is `phase.trainable: [projector]` +
`model.lora.modules: [language_model]`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from mindvl.conventions import MODULES

LLM_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")
QUANTIZE = ("nf4",)


@dataclass
class LoRAConfig:
    """`model.lora` of a recipe: rank, scale alpha / r, dropout on the adapter's input, which linear layers."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: list[str] = field(default_factory=lambda: list(LLM_LINEARS))
    modules: list[str] = field(default_factory=lambda: ["language_model"])
    quantize: str | None = None  # "nf4": QLoRA, the frozen base of the adapted layers in 4 bits (train.qlora)

    def _check_built(self, where: str) -> None:
        if self.r < 1:
            raise ValueError(f"{where}.r: must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ValueError(f"{where}.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"{where}.dropout: must lie in [0, 1), got {self.dropout}")
        if not self.targets:
            raise ValueError(f"{where}.targets: name at least one linear layer (e.g. {list(LLM_LINEARS)})")
        if "lm_head" in self.targets:
            raise ValueError(f"{where}.targets: lm_head takes no adapter (the loss reads its weight directly)")
        if not self.modules:
            raise ValueError(f"{where}.modules: name at least one of {MODULES}")
        for m in self.modules:
            if m not in MODULES:
                raise ValueError(f"{where}.modules: unknown module {m!r} (known: {', '.join(MODULES)})")
        if self.quantize is not None and self.quantize not in QUANTIZE:
            raise ValueError(f"{where}.quantize: must be null or one of {', '.join(QUANTIZE)}, got {self.quantize!r}")

    @property
    def scaling(self) -> float:
        return self.alpha / self.r


class LoRALinear(nn.Linear):
    """nn.Linear + a rank-r update (see the module docstring). Built around an existing layer's parameters (on any
    device, the meta device included): the base weight and bias are the same Parameter objects."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias  # a Parameter or None (nn.Module.__setattr__ registers either)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Parameter(torch.empty(r, self.in_features, **kw))
        self.lora_B = nn.Parameter(torch.empty(self.out_features, r, **kw))
        self.r, self.alpha = r, alpha
        self.scaling = alpha / r
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if not base.weight.is_meta:
            reset_adapter(self, torch.Generator().manual_seed(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        update = F.linear(F.linear(self.lora_dropout(x), self.lora_A.to(x.dtype)), self.lora_B.to(x.dtype))
        return out + update * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """B A * scaling [out, in] in float32: what merging adds to the base weight."""
        return (self.lora_B.float() @ self.lora_A.float()) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def initial_adapter(shape_a: tuple[int, int], shape_b: tuple[int, int], gen: torch.Generator
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's default start: A ~ U(-1/sqrt(in), 1/sqrt(in)) (Kaiming-uniform with a = sqrt(5)), B = 0."""
    bound = 1.0 / math.sqrt(shape_a[1])
    a = torch.rand(shape_a, generator=gen, dtype=torch.float32) * (2 * bound) - bound
    return a, torch.zeros(shape_b)


@torch.no_grad()
def reset_adapter(layer: LoRALinear, gen: torch.Generator) -> None:
    a, b = initial_adapter(tuple(layer.lora_A.shape), tuple(layer.lora_B.shape), gen)
    layer.lora_A.copy_(a)
    layer.lora_B.copy_(b)


def _linear_layers(model: nn.Module, modules: list[str]) -> Iterator[tuple[str, nn.Module, str, nn.Linear]]:
    """(full name, parent, attribute, layer) for every nn.Linear under the chosen top-level modules."""
    for top in modules:
        root = getattr(model, top, None)
        if root is None:
            raise ValueError(f"model.lora.modules: the model has no {top!r} (a text-only model?)")
        for name, parent in root.named_modules():
            for attr, child in parent.named_children():
                if isinstance(child, nn.Linear):
                    yield ".".join(filter(None, (top, name, attr))), parent, attr, child


def inject_lora(model: nn.Module, cfg: LoRAConfig) -> list[str]:
    """Replace every `nn.Linear` named in `cfg.targets` under `cfg.modules` by a LoRALinear around the same
    parameters; returns the adapted layers' names. A target that matches nothing is an error naming the choices."""
    found: list[str] = []
    available: set[str] = set()
    for name, parent, attr, layer in list(_linear_layers(model, cfg.modules)):
        available.add(attr)
        if attr in cfg.targets and not isinstance(layer, LoRALinear):
            setattr(parent, attr, LoRALinear(layer, cfg.r, cfg.alpha, cfg.dropout))
            found.append(name)
    missing = [t for t in cfg.targets if t not in available]
    if missing:
        raise ValueError(f"model.lora.targets: {missing} match no linear layer in {cfg.modules} "
                         f"(linear layers there: {', '.join(sorted(available))})")
    return found


def lora_layers(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def is_adapter_name(name: str) -> bool:
    """Is this state-dict entry an adapter tensor (`...q_proj.lora_A` / `.lora_B`)?"""
    return name.endswith(ADAPTER_SUFFIXES)


def freeze_for_lora(model: nn.Module, cfg: LoRAConfig) -> dict[str, int]:
    """Under `cfg.modules` only the adapters train; returns {module: trainable adapter parameters}."""
    counts = {}
    for top in cfg.modules:
        n = 0
        for name, p in getattr(model, top).named_parameters():
            on = is_adapter_name(name)
            p.requires_grad_(on)
            n += p.numel() if on else 0
        counts[top] = n
    return counts


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its base weight (W += B A * scaling, in float32, cast back) and put plain nn.Linear
    layers back: the model is a plain MindVL again, with the adapted function. In place; returns the model."""
    for name, layer in list(lora_layers(model)):
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                          device=layer.weight.device, dtype=layer.weight.dtype)
        plain.weight.copy_((layer.weight.float() + layer.delta_weight()).to(layer.weight.dtype))
        if layer.bias is not None:
            plain.bias.copy_(layer.bias)
        plain.weight.requires_grad_(layer.weight.requires_grad)
        setattr(parent, name.rpartition(".")[2], plain)
    return model


def merge_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A state dict with adapters -> the merged plain state dict (each `X.weight` += `X.lora_B @ X.lora_A * scaling`
    in float32, kept in the weight's dtype); the adapter entries are dropped."""
    out = {k: v for k, v in state.items() if not is_adapter_name(k)}
    for key in state:
        if key.endswith(".lora_A"):
            base = key[: -len(".lora_A")]
            a, b, w = state[key].float(), state[base + ".lora_B"].float(), out[base + ".weight"]
            out[base + ".weight"] = (w.float() + (b @ a) * scaling).to(w.dtype)
    return out
