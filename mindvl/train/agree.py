"""Decisions that every rank must share, so no rank raises (or stops) alone while the others wait in a collective.

`agreed_error(message, env)` turns "this rank found a problem" into "every rank knows the first problem": each rank
passes its message (or None) and all of them get the lowest rank's message back (or None when no rank had one).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .parallel import ParallelEnv, all_reduce_sum


def agreed_error(message: str | None, env: ParallelEnv) -> str | None:
    """Collective: the message of the lowest rank that has one, on every rank (None if none has)."""
    if not env.distributed:
        return message
    # The common case (no problem anywhere) costs one tiny all-reduce; the messages travel only when needed.
    flag = all_reduce_sum(torch.tensor([0.0 if message is None else 1.0], device=env.device), env)
    if float(flag.cpu()) == 0:
        return None
    gathered: list[str | None] = [None] * env.world_size
    dist.all_gather_object(gathered, message)
    for rank, msg in enumerate(gathered):
        if msg is not None:
            return msg if rank == env.rank else f"{msg} (reported by rank {rank})"
    return None


def gather_objects(obj, env: ParallelEnv) -> list:
    """Collective: every rank's `obj` (picklable), in rank order, on every rank."""
    if not env.distributed:
        return [obj]
    gathered: list = [None] * env.world_size
    dist.all_gather_object(gathered, obj)
    return gathered
