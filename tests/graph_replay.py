"""CUDA-graph capture and replay, emulated on the CPU: the `GraphBackend` the decode-step tests hand `DecodeStep`.

A CUDA graph records the kernels one run launched, with the addresses they read and wrote and every scalar argument
as it was; a replay launches the same kernels again. So after capture, nothing the host does reaches the step: a
Python int read at capture (a length, a width, a branch taken) is frozen, a tensor the host rebinds to a new one is
never seen (the graph keeps the old address), and only in-place writes to the recorded tensors (the inputs' buffers,
the cache) change what a replay computes. A read of device memory, or an op whose output shape depends on the data,
cannot be captured at all.

`EmulatedGraphs` reproduces those rules with a dispatch mode:
- capture runs the step once unrecorded (the warm-up, as `CudaGraphs`), then once recording every aten op with its
  arguments (the same tensor objects: the same memory) and its outputs;
- it fails, as a capture on a GPU fails, on a read (`READS`, `Tensor.tolist`), on a data-shaped op
  (`DATA_SHAPED`, boolean-mask indexing, repeat_interleave without output_size), and on `lift_fresh` (a tensor made
  from host data inside the step: a host-to-device copy on a GPU);
- replay runs the recorded ops in order on the recorded tensors with the recorded scalars, and writes each op's new
  outputs into the tensors that op produced at capture (their "addresses"), so later ops, and the caller holding the
  step's output, read the new values. In-place ops and views write or alias recorded memory themselves.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Ops that return a host value read from the tensor (int/float/bool/item; under inference mode they dispatch as
# `item` / `is_nonzero` rather than `_local_scalar_dense`), and ops whose output shape depends on the data: each a
# device read on an accelerator.
READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.equal", "aten.allclose")
DATA_SHAPED = ("aten.nonzero", "aten.masked_select", "aten._unique", "aten.unique")


def read_or_data_shaped(func, args, kwargs) -> str | None:
    """Why this op reads the device (or sizes its output from the data), or None: the rule a capture enforces and
    the device-read tests count."""
    name = str(func)
    if name.startswith(READS + DATA_SHAPED):
        return name
    if name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None:
        if isinstance(args[1] if len(args) > 1 else args[0], torch.Tensor):  # counts, not an int
            return name
    if name.startswith(("aten.index.", "aten.index_put")) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
        return name + " (bool mask)"
    return None


class CaptureError(RuntimeError):
    """What a GPU capture would have failed on."""


class CaptureRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        why = read_or_data_shaped(func, args, kwargs)
        if why is None and str(func).startswith("aten.lift_fresh"):
            why = f"{func} (a tensor made from host data: a host-to-device copy)"
        if why is not None:
            raise CaptureError(f"not capturable: {why}")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _no_tolist(self):
    raise CaptureError("not capturable: Tensor.tolist (a device read)")


class RecordedGraph:
    def __init__(self, ops: list[tuple], batch: int) -> None:
        self.ops, self.batch = ops, batch  # batch: the captured step's rows
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, recorded in self.ops:
            fresh = func(*args, **kwargs)
            for old, new in zip(tree_flatten(recorded)[0], tree_flatten(fresh)[0], strict=True):
                if not isinstance(old, torch.Tensor):
                    continue
                if old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr():
                    old.copy_(new)  # a new allocation at capture: the replay writes where it was
        self.replays += 1


class EmulatedGraphs:
    """A `GraphBackend` for CPU tensors (see the module docstring); `graphs` keeps every capture made."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []

    def usable(self, device) -> bool:
        return True

    def capture(self, fn):
        fn()  # the warm-up, unrecorded
        recorder = CaptureRecorder()
        tolist = torch.Tensor.tolist
        torch.Tensor.tolist = _no_tolist  # does not dispatch on the CPU
        try:
            with recorder:
                out = fn()
        finally:
            torch.Tensor.tolist = tolist
        graph = RecordedGraph(recorder.ops, out.shape[0])
        self.graphs.append(graph)
        return graph, out
