"""Seeded random weights, produced one tensor at a time.

The same sequence of tensors initialises a plain model in place (`MindVL.init_weights`) and fills a sharded model
built on the meta device (mindvl.train.materialize), so a run's initial weights do not depend on how it is
parallelised: every rank draws the full tensor from one generator, in parameter order, and keeps its shard.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def seeded_init_tensors(named_shapes: Iterable[tuple[str, torch.Size]], seed: int = 0, std: float = 0.02
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) in the given order: zero biases (names ending in `bias`, which includes a router's
    correction bias), unit 1-D weights (norms), N(0, std) for every matrix, drawn from one CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in named_shapes:
        if name.endswith("bias"):
            yield name, torch.zeros(shape)
        elif len(shape) == 1:
            yield name, torch.ones(shape)
        else:
            yield name, torch.randn(shape, generator=gen, dtype=torch.float32) * std
