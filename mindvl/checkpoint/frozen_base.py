"""A LoRA run's base model: referenced by its training checkpoints, not copied into them.

A LoRA or QLoRA run trains a few million adapter parameters on a base of billions that never change. Its
checkpoints hold what does change (adapters, modules trained in full, buffers, optimizer state, data position, RNG;
DCP's `ignore_frozen_params`) and, in `train_state.json` under `frozen_base`, a reference to the base:

    {"folder": "/abs/path/to/base" | null, "seed": 0, "fingerprint": "<blake2b hex>", "tensors": 123}

`folder` is the mindvl model folder the run started from, or null for seeded random weights of the recipe's
architecture (`seed`: `model.init_seed` / `seed`). A resume, and `mindvl export` of a checkpoint, read the base
from there again (`base_tensors`, the same stream the trainer filled the model from) and refuse in one line when
its fingerprint differs from the saved one (the folder was overwritten or replaced, another seed).

Fingerprint: BLAKE2b over every tensor of the base as it is read (name, dtype, shape, bytes), combined in name order
so it does not depend on the order a folder's shards are listed. It costs one pass over bytes that are read anyway
(~1 GB/s on one core: about 15 s for an 8B bf16 base).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

KEY = "frozen_base"  # train_state.json: the reference (its presence says the checkpoint holds no frozen weight)


def base_tensors(folder: Path | None, seed: int, config) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, full tensor) for every entry of a plain model's state dict, one tensor in memory at a time: seeded
    random weights (`folder` None: `mindvl.models.random_init`, in parameter order; persistent buffers at zero) or
    a mindvl model folder (shapes checked first)."""
    if folder is None:
        from mindvl.models import MindVL
        from mindvl.models.random_init import seeded_init_tensors

        with torch.device("meta"):
            reference = MindVL(config)
        yield from seeded_init_tensors(((n, p.shape) for n, p in reference.named_parameters()), seed)
        saved = reference.state_dict()
        for name, buffer in reference.named_buffers():
            if name in saved:  # persistent buffers (e.g. a router's correction bias) start at zero
                yield name, torch.zeros(buffer.shape, dtype=buffer.dtype)
        return
    from .hf import check_tensors, expected_shapes
    from .safetensors_io import TensorFolder

    tensors = TensorFolder(folder)
    check_tensors(tensors.shapes(), expected_shapes(config), str(folder))
    yield from tensors.iter_tensors()


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


class FrozenBase:
    """Where a run's base comes from and, once its tensors went through `observe`, their fingerprint."""

    def __init__(self) -> None:
        self.folder: Path | None = None
        self.seed = 0
        self.digests: dict[str, bytes] = {}

    def observe(self, folder: Path | None, seed: int, tensors: Iterator[tuple[str, torch.Tensor]]
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """Pass the base's tensors through, fingerprinting each."""
        self.folder, self.seed, self.digests = (Path(folder).resolve() if folder else None), seed, {}
        for name, t in tensors:
            self.digests[name] = tensor_digest(name, t)
            yield name, t

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=16)
        for name in sorted(self.digests):
            h.update(self.digests[name])
        return h.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        return {"folder": str(self.folder) if self.folder else None, "seed": self.seed,
                "fingerprint": self.fingerprint, "tensors": len(self.digests)}

    def check(self, saved: dict[str, Any], where: str) -> None:
        """One-line refusal when the base read now is not the one the checkpoint `where` was trained on."""
        if saved.get("fingerprint") == self.fingerprint:
            return
        was = saved.get("folder") or f"seeded random weights (seed {saved.get('seed')})"
        now = str(self.folder) if self.folder else f"seeded random weights (seed {self.seed})"
        raise ValueError(f"{where}: the checkpoint holds adapters for the base {was} (fingerprint "
                         f"{str(saved.get('fingerprint'))[:12]}), but the base read now, {now}, has fingerprint "
                         f"{self.fingerprint[:12]}: it changed since; restore that base (model.init_from, "
                         "model.init_seed), or start over (overwrite=true)")


def read_base(saved: dict[str, Any], config, where: str) -> dict[str, torch.Tensor]:
    """The base a checkpoint references (its `frozen_base` entry), read again and checked against its fingerprint."""
    base = FrozenBase()
    folder = saved.get("folder")
    tensors = dict(base.observe(Path(folder) if folder else None, int(saved.get("seed") or 0),
                                base_tensors(Path(folder) if folder else None, int(saved.get("seed") or 0), config)))
    base.check(saved, where)
    return tensors
