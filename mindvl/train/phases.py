"""What a phase trains (paper Table 1): warm-up trains only the MLP projector; multitask and SFT train everything.

Frozen parameters get `requires_grad=False` *before* the optimizer is built, so AdamW never allocates state for them
(at 8B scale the frozen LLM's Adam moments would be ~64 GB we do not need during the warm-up).
"""

from __future__ import annotations

from torch import nn

from mindvl.conventions import MODULES  # the recipe's names of MindVL's top-level modules, defined once


def apply_phase(model: nn.Module, trainable: list[str]) -> dict[str, int]:
    """Freeze every top-level module not in `trainable`; returns {module: trainable parameter count}."""
    for name in trainable:
        if name not in MODULES:
            raise ValueError(f"phase.trainable: unknown module {name!r} (known: {MODULES})")
        if getattr(model, name, None) is None:
            raise ValueError(f"phase.trainable: the model has no {name!r} (a text-only model?)")
    counts = {}
    for name in MODULES:
        module = getattr(model, name, None)
        if module is None:
            continue
        on = name in trainable
        for p in module.parameters():
            p.requires_grad_(on)
        counts[name] = sum(p.numel() for p in module.parameters()) if on else 0
    return counts


def trainable_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]
