"""A simulated cluster in one CPU process: a fake process group of N ranks, and fake tensors for everything large.

    with fake_world(world_size) as world:        # rank 0 of N on the "fake" backend; DTensor gets its own fake mode
        model = world.materialize(meta_model)    # parameters become fake tensors (shapes, dtypes, no storage)
        ... run the trainer's real step ...

Why a gateway mode: the model reads small integer metadata (cu_seqlens, image grids, labels) as Python numbers,
which a fake tensor cannot give. `MetadataGateway` keeps integer/bool tensors REAL (they are data, kilobytes) and
everything floating FAKE (parameters, activations, gradients, optimizer state, pixel rows): an op whose tensor
inputs are all real runs for real; a factory that makes an integer tensor runs for real; everything else is fake.
A real boolean mask indexing a fake tensor becomes the equivalent integer index, so the output shape is known.
`topk` over fake scores (a router's choice of experts) returns real, perfectly balanced indices: the planner's
stated routing assumption for mixture-of-experts models, whatever their expert implementation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map_only

_INT_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def _is_fake(t) -> bool:
    return isinstance(t, FakeTensor)


class MetadataGateway(TorchDispatchMode):
    """Runs integer metadata for real and floating tensors fake (see the module docstring). Enter it innermost."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if tensors and not any(_is_fake(t) for t in tensors):
            with _disable_current_modes():  # all-real inputs: metadata arithmetic, for real (untracked, tiny)
                return func(*args, **kwargs)
        if func is torch.ops.aten.index.Tensor or func is torch.ops.aten.index_put_.default \
                or func is torch.ops.aten.index_put.default:
            # a real boolean mask over a fake tensor: its count is known, so index by positions instead
            args = list(args)
            with _disable_current_modes():
                args[1] = _positional_indices(args[1])
        out = func(*args, **kwargs)
        if func is torch.ops.aten.topk.default and _is_fake(out[1]):
            # Routing (MoE): which experts a fake score picks is unknowable; assume perfectly balanced routing, a
            # stated assumption: row t takes experts (t*k + j) mod E, j < k (distinct within a row when k <= E).
            with _disable_current_modes():
                return out[0], _balanced_indices(tuple(out[1].shape), args[0].shape[args[2] if len(args) > 2 else -1])
        if not tensors and isinstance(out, torch.Tensor) and out.dtype in _INT_DTYPES and _is_fake(out):
            with _disable_current_modes():  # integer factory (arange, full, zeros): metadata, make it real
                return func(*args, **kwargs)
        return out


def _balanced_indices(shape: tuple[int, ...], choices: int) -> torch.Tensor:
    """[..., k] int64 indices: entry i (row-major) picks i mod `choices`."""
    n = 1
    for d in shape:
        n *= d
    return (torch.arange(n) % choices).reshape(shape)


def _positional_indices(indices: list) -> list:
    """aten.index's index list with every real boolean mask (k dims) replaced by its k integer index tensors."""
    out: list = []
    for i in indices:
        if isinstance(i, torch.Tensor) and not _is_fake(i) and i.dtype == torch.bool:
            out.extend(i.nonzero().unbind(1))
        else:
            out.append(i)
    return out


@contextlib.contextmanager
def _dtensor_own_fake_mode() -> Iterator[None]:
    """DTensor's sharding propagation builds full-size fake tensors under the *active* fake mode, which a memory
    tracker entered under that mode would count; give the propagation a private fake mode instead."""
    from torch.distributed.tensor import _sharding_prop

    private = FakeTensorMode(allow_non_fake_inputs=True)
    original = _sharding_prop.detect_fake_mode
    _sharding_prop.detect_fake_mode = lambda *a, **k: private
    try:
        yield
    finally:
        _sharding_prop.detect_fake_mode = original


@dataclass
class FakeWorld:
    world_size: int
    mode: FakeTensorMode

    def materialize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Meta-device (possibly FSDP-sharded) model -> fake CPU tensors of the same shapes (this rank's shards)."""
        with self.mode:
            model.to_empty(device="cpu")
        return model

    def fake(self, shape, dtype=torch.float32) -> torch.Tensor:
        with self.mode:
            return torch.empty(shape, dtype=dtype)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """Rank 0 of `world_size` on torch's fake backend (collectives do nothing); the group is destroyed after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner needs its own process group; a process group is already initialised")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[FakeWorld]:
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_process_group(world_size), _dtensor_own_fake_mode():
        yield FakeWorld(world_size, mode)


def fake_tensors(tree):
    """Every real floating tensor in `tree` as a fake one (the tracker counts it, nothing is allocated)."""
    return tree_map_only(torch.Tensor, lambda t: t, tree)
