"""Device reads per training step (forward + backward) of a small dense Qwen2.5-VL-style model, counted on a CPU.

    PYTHONPATH=$PWD python benchmarks/device_reads.py            # JSON: reads per step, by source line

Every read of data that would live on the accelerator is counted: tensors that come from the batch or the
parameters, and everything computed from them, are "device" tensors (tracked through every dispatched op); a read
is `_local_scalar_dense` (`.item()`, `int()`, `bool()`), a data-dependent shape (nonzero, a boolean mask,
repeat_interleave without output_size, masked_select, unique) or a `.tolist()`/`.numpy()` of a device tensor (which
a CPU tensor does without dispatching; patched here). Tensors the host builds from Python ints are not device
tensors. On CUDA each read is a stream synchronisation. tests/test_no_device_reads.py proves the zero on the meta
device; this script gives the numbers (RESULTS "Accelerator: CPU-side checks") and runs on older trees too (it
passes a `layout` only where the model takes one).
"""

from __future__ import annotations

import collections
import json
import traceback

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from mindvl.models import MindVL, MindVLConfig, TextConfig, VisionConfig

_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
          torch.ops.aten._unique2.default}


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/mindvl/" in f.filename and "benchmarks" not in f.filename]
    return f"{frames[-1].filename.split('/mindvl/')[-1]}:{frames[-1].lineno}" if frames else "?"


class DeviceReadCounter(TorchDispatchMode):
    """Counts reads of device-derived tensors (see the module docstring), by source line."""

    def __init__(self, device_tensors) -> None:
        super().__init__()
        self.device = WeakTensorKeyDictionary()
        for t in device_tensors:
            self.device[t] = True
        self.reads: collections.Counter = collections.Counter()

    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        derived = any(self.is_device(t) for t in flat)
        if derived and self._reads(func, args, kwargs):
            self.reads[f"{func.__name__} {_where()}"] += 1
        out = func(*args, **kwargs)
        if derived:
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.device[t] = True
        return out

    @staticmethod
    def _reads(func, args, kwargs) -> bool:
        if func in _READS:
            return True
        if func in (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func is torch.ops.aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return False

    def __enter__(self):
        counter, self._saved = self, (torch.Tensor.tolist, torch.Tensor.numpy)
        tolist, numpy = self._saved

        def counted(real, name):
            def read(t, *a, **k):
                if counter.is_device(t):
                    counter.reads[f"{name} {_where()}"] += 1
                return real(t, *a, **k)
            return read

        torch.Tensor.tolist, torch.Tensor.numpy = counted(tolist, "tolist"), counted(numpy, "numpy")
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)


def small_model() -> MindVL:
    """2 decoder layers (GQA 4:2, M-RoPE), a 2-block ViT (one windowed, one full), vocabulary 301."""
    text = TextConfig(vocab_size=301, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, mrope_section=[1, 1, 2])
    vision = VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, fullatt_block_indexes=[1])
    model = MindVL(MindVLConfig(text=text, vision=vision, image_token_id=300, video_token_id=299,
                                vision_start_token_id=298, vision_end_token_id=297))
    model.init_weights(seed=0)
    return model


def small_batch(model: MindVL) -> dict:
    """Three samples in one row: two images (8x12 and 12x8 patches: partial windows) and a text-only sample."""
    from mindvl.models import mrope_position_ids

    c = model.config
    gen = torch.Generator().manual_seed(0)
    grids = [[1, 8, 12], [1, 12, 8]]

    def image(g):
        return [c.vision_start_token_id] + [c.image_token_id] * (g[1] * g[2] // 4) + [c.vision_end_token_id]

    def words(n):
        return torch.randint(5, 200, (n,), generator=gen).tolist()

    samples = [words(5) + image(grids[0]) + words(9), words(37), words(3) + image(grids[1]) + words(20)]
    ids = torch.tensor([t for s in samples for t in s])
    cu = F.pad(torch.tensor([len(s) for s in samples]).cumsum(0), (1, 0)).int()
    grid = torch.tensor(grids)
    return {"input_ids": ids, "labels": ids.masked_fill(ids == c.image_token_id, -100), "cu_seqlens": cu,
            "position_ids": mrope_position_ids(ids, cu, grid, c.image_token_id, c.vision.spatial_merge_size),
            "pixel_values": torch.randn(int(grid.prod(-1).sum()), c.vision.patch_dim, generator=gen),
            "image_grid_thw": grid}


def dense_cross_entropy(hidden, weight, targets, chunk_size):
    """A loss with no data-dependent shape: isolates the reads outside loss.py (whose backward reads carry no
    source line: they run in the autograd engine)."""
    loss = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=-100, reduction="sum")
    return loss, (targets != -100).sum()


def count(with_layout: bool, dense_loss: bool = False) -> dict:
    model = small_model()
    if dense_loss:
        model.cross_entropy = dense_cross_entropy
    batch = small_batch(model)
    extra = {}
    if with_layout:
        from mindvl.train.step import batch_layout  # the trainer's stream does this before the copy to the device

        extra["layout"] = batch_layout(model.config)(batch)
    batch = {k: v.clone() for k, v in batch.items()}  # fresh tensors: the "device" copies
    counter = DeviceReadCounter([*batch.values(), *model.parameters()])
    with counter:
        loss_sum, _ = model(**batch, **extra)
        loss_sum.backward()
    return {"reads": sum(counter.reads.values()), "by_line": dict(counter.reads)}


def main() -> None:
    try:
        from mindvl.train.step import batch_layout  # noqa: F401
        has_layout = True
    except ImportError:
        has_layout = False
    out = {"tensors_only": count(False), "tensors_only_dense_loss": count(False, True)}
    if has_layout:
        out["trainer_layout"] = count(True)
        out["trainer_layout_dense_loss"] = count(True, True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
