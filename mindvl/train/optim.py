"""AdamW over the trainable parameters and the paper's LR schedule: linear warm-up over `warmup_ratio` of the
steps to the maximum LR, then cosine (or linear) decay to the minimum LR at the last step."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

from mindvl.config import OptimSection, ScheduleSection
from mindvl.conventions import MODULES


def _kernel(params: list[torch.Tensor]) -> dict[str, bool]:
    """The fastest AdamW implementation torch has for one (type, device, dtype) group: the fused kernel (one pass per
    parameter reading/writing param, grad, m and v once) where the device supports it for floating-point tensors --
    including FSDP2's DTensors, whose fused/foreach ops dispatch to their local shards -- else the multi-tensor
    (foreach) path, else torch's default. torch's own default takes the per-parameter loop on CPU and for DTensors."""
    p = params[0]
    if p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices():
        return {"fused": True}
    if p.device.type in _get_foreach_kernels_supported_devices():
        return {"foreach": True}
    return {}


def _lr_scales(model: nn.Module, lr_scale: dict[str, float]) -> dict[int, float]:
    """id(parameter) -> its module's `optim.lr_scale` (parameters of modules not named there: 1)."""
    scales: dict[int, float] = {}
    for name, scale in lr_scale.items():
        module = getattr(model, name, None) if name in MODULES else None
        trainable = [p for p in module.parameters() if p.requires_grad] if module is not None else []
        if not trainable:
            raise ValueError(f"optim.lr_scale.{name}: the model has no trainable {name!r} in this phase; remove the "
                             "key or train the module (phase.trainable)")
        scales.update((id(p), float(scale)) for p in trainable)
    return scales


def build_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed). Frozen parameters are not
    passed in, so they hold no optimizer state. Parameters are grouped by (decay, LR scale, tensor type, device,
    dtype) so each group runs one fused kernel; a resumed run on the same device type takes the same kernels, so
    resume stays exact. A group's `lr` is optim.lr times its module's `optim.lr_scale`: the scheduler's factor
    multiplies each group's own base LR, so the whole schedule scales."""
    scales = _lr_scales(model, cfg.lr_scale)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for _, p in model.named_parameters():
        if p.requires_grad:
            key = (p.dim() >= 2, scales.get(id(p), 1.0), type(p).__name__, str(p.device), str(p.dtype))
            groups.setdefault(key, []).append(p)
    if not groups:
        raise ValueError("phase.trainable: nothing to train (every parameter is frozen)")
    # Decayed groups first, then in first-seen order: the group order is part of the optimizer's state_dict.
    order = sorted(groups, key=lambda k: not k[0])
    param_groups = [{"params": groups[k], "weight_decay": cfg.weight_decay if k[0] else 0.0, "lr": cfg.lr * k[1],
                     "lr_scale": k[1], **_kernel(groups[k])} for k in order]
    return torch.optim.AdamW(param_groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` before clipping (a plain 0-d tensor), after clipping them to
    `max_norm` when given (None: the norm only), as `torch.nn.utils.clip_grad_norm_` does.

    - Parameters may live on different DeviceMeshes (expert parallelism puts the experts on a 2-D mesh, FSDP the rest
      on the world mesh): one norm per mesh, combined, then the same scale on every group (foreach ops refuse mixed
      meshes).
    - Multi-tensor kernels on every device (torch's default loops per tensor on CPU and for DTensors).
    - No rescale when the norm is within bounds: torch would multiply every gradient by exactly 1.0, a full pass over
      them for an identical result. The check reads the norm back to the host, which the trainer does anyway to log it.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    # torch's clip coefficient max_norm / (norm + 1e-6) is < 1, or NaN: only then do the gradients change. A fake
    # tensor (the planner's simulated step) has no value to read: clip, the costlier branch.
    if max_norm is not None and (is_fake(total) or not float(total) + 1e-6 <= max_norm):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=True)
    return total


def lr_at(step: int, total_steps: int, max_lr: float, min_lr: float, warmup_ratio: float, decay: str) -> float:
    """LR used for optimizer step `step` (0-based) of `total_steps`."""
    warmup = int(math.ceil(warmup_ratio * total_steps))
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if decay == "constant":
        return max_lr
    span = max(1, total_steps - warmup - 1)
    frac = min(1.0, (step - warmup) / span)
    if decay == "linear":
        return max_lr + (min_lr - max_lr) * frac
    return min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * frac))


def build_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, optim: OptimSection,
                    schedule: ScheduleSection) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR (its state is just the step counter, saved with the checkpoint)."""

    def factor(step: int) -> float:
        return lr_at(min(step, total_steps - 1), total_steps, optim.lr, optim.min_lr, schedule.warmup_ratio,
                     schedule.decay) / optim.lr

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
