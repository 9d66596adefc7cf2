"""AdamW over the trainable parameters and the paper's LR schedule: linear warm-up over `warmup_ratio` of the
steps to the maximum LR, then cosine (or linear) decay to the minimum LR at the last step."""

from __future__ import annotations

import math

import torch
from torch import nn

from mindvl.config import OptimSection, ScheduleSection


def build_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed). Frozen parameters are not
    passed in, so they hold no optimizer state."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    if not decay and not no_decay:
        raise ValueError("phase.trainable: nothing to train (every parameter is frozen)")
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # torch's default implementation per device (multi-tensor on accelerators, per-parameter on CPU): a resumed run
    # on the same device type takes the same kernels, so resume stays exact.
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)


@torch.no_grad()
def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of the gradients of `params` before clipping (a plain 0-d tensor), after clipping them to
    `max_norm` when given (None: norm only), as `torch.nn.utils.clip_grad_norm_` does. Parameters may live on
    different DeviceMeshes (expert parallelism puts the experts on a 2-D mesh, FSDP the rest on the world mesh):
    one norm per mesh, combined, then the same scale on every group (foreach ops refuse mixed meshes)."""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    if not norms:
        return torch.zeros(())
    total = norms[0] if len(norms) == 1 else torch.stack([n.float() ** 2 for n in norms]).sum().sqrt()
    if max_norm is not None:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
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
