"""LoRA in training: the recipe's `model.lora`, the `lora` transform of `prepare_model`, the adapters' initial values.

    cfg = lora_config(recipe)                      # None, or a checked mindvl.models.lora.LoRAConfig
    TRANSFORMS: freeze -> lora -> activation checkpointing -> compile -> EP -> FSDP

The transform runs on the meta-device model after the phase froze what it freezes: it wraps the chosen linear layers
(mindvl.models.lora.inject_lora), leaves only the adapters trainable in `lora.modules`, and, when the run computes in
bf16, stores every frozen weight in bf16 (FSDP2 would cast it to bf16 for every forward anyway, so the numerics are
the same and the frozen base takes half the memory; adapters, like every trainable weight, keep fp32 master copies).
Because it is a step of TRANSFORMS, the planner's trace and counts see exactly this model: optimizer state,
gradients and reductions only for the adapters (and any module the phase trains in full).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from mindvl.models.lora import (
    LoRAConfig,
    freeze_for_lora,
    inject_lora,
    merge_state,
)
from mindvl.typed import build

if TYPE_CHECKING:
    from mindvl.checkpoint.frozen_base import FrozenBase
    from mindvl.config import Recipe


def lora_config(recipe: Recipe) -> LoRAConfig | None:
    """`model.lora` built and checked (one-line errors naming the key), or None when the recipe has none."""
    raw = recipe.model.lora
    return None if raw is None else build(LoRAConfig, raw, "model.lora")


def apply_lora(model: nn.Module, cfg: LoRAConfig, compute_dtype: torch.dtype) -> tuple[dict[str, int], int, int]:
    """The `lora` step of TRANSFORMS (see the module docstring); returns ({module: trainable adapter parameters},
    adapted layers, their frozen base weights' elements)."""
    names = inject_lora(model, cfg)
    trainable = freeze_for_lora(model, cfg)
    base = sum(model.get_submodule(n).weight.numel() for n in names)
    if compute_dtype != torch.float32:  # every frozen weight (the adapted modules' and those the phase froze) in bf16
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(compute_dtype)
    return trainable, len(names), base


def check_lora_recipe(recipe: Recipe) -> LoRAConfig | None:
    """`lora_config` plus what only a run needs (the planner does not): QLoRA's backend. Called before anything is
    built, on every rank."""
    cfg = lora_config(recipe)
    if cfg is not None and cfg.quantize is not None:
        from .qlora import require_backend

        require_backend(cfg.quantize)
    return cfg


ADAPTER_DIR = "adapter"  # final/adapter: the run's adapters in PEFT's layout, beside the merged weights in final/


@dataclass
class AdapterExport:
    """What a LoRA run's `final/` holds besides the merged weights: its adapters (PEFT layout) in `final/adapter`,
    with the modules the phase trained in full (PEFT's modules_to_save) and the base model's folder."""

    lora: LoRAConfig
    full_modules: list[str]
    base: str | None

    @classmethod
    def of(cls, recipe: Recipe, side_files: dict | None = None) -> AdapterExport | None:
        cfg = lora_config(recipe)
        if cfg is None:
            return None
        full = [m for m in recipe.trainable_modules if m not in cfg.modules]
        start = (side_files or {}).get("from") or []
        return cls(cfg, full, str(Path(start[0]).resolve()) if start else None)

    def to_dict(self) -> dict:
        """For the checkpoints' train state (what `mindvl export` writes OUT/adapter from)."""
        from dataclasses import asdict

        return {"lora": asdict(self.lora), "full_modules": self.full_modules, "base": self.base}

    def base_reference(self, base: FrozenBase, compute_dtype: torch.dtype) -> dict:
        """The checkpoints' `frozen_base` entry (checkpoint.frozen_base): where the base comes from, its
        fingerprint, and for QLoRA how it was quantized (what `mindvl export` of a checkpoint redoes)."""
        ref = base.to_dict()
        if self.lora.quantize is not None:  # the frozen weights are stored (and quantized) in the compute dtype
            ref.update(quantize=self.lora.quantize, dtype=str(compute_dtype).removeprefix("torch."))
        return ref

    def merged(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The merged plain state: QLoRA's NF4 base weights dequantized (what the run multiplied by) + B A."""
        if self.lora.quantize is not None:
            from .qlora import dequantized

            state = {k: dequantized(v) for k, v in state.items()}
        return merge_state(state, self.lora.scaling)

    def write(self, state: dict[str, torch.Tensor], config, folder: Path) -> Path:
        from mindvl.checkpoint.adapters import save_adapter

        return save_adapter(state, config, self.lora, folder / ADAPTER_DIR, base=self.base,
                            full_modules=self.full_modules)
