"""A training step reads nothing back from the device, and `auto` attention fits the device (issue 38, items 1-2).

How "no device read" is checked on a CPU: the model, its parameters and the batch's tensors live on the `meta`
device, which stands in for an accelerator whose memory the host cannot read (shapes and dtypes propagate, values
do not exist), while the host values (`PackLayout`: Python ints) and host-side CPU tensors built from them run for
real. Every read of device data then fails: `.item()` / `int()` / `bool()` dispatch `aten._local_scalar_dense`,
`.tolist()` copies out of meta (which raises), and a data-dependent shape (nonzero, a boolean mask,
repeat_interleave without output_size) has no meta kernel. On CUDA each of those is a cudaStreamSynchronize. A
TorchDispatchMode (`DeviceReads`) records each such op on a meta tensor before it fails, and also every *blocking*
host-to-device copy (`_to_copy`/`copy_` from CPU to meta with non_blocking=False: on CUDA each synchronises the
stream), so a failure names the op.

Why not the other checks: counting `_local_scalar_dense` on CPU tensors misses `.tolist()`, which never reaches the
dispatcher for a CPU tensor (test_cpu_tolist_is_invisible_to_dispatch), and cannot tell legitimate host arithmetic
from device reads; FakeTensorMode fakes host tensors too, so the legitimate host arithmetic fails with the rest. The
meta device separates host from device exactly as an accelerator does.

The loss is part of the step: with the layout's host count of targets (`PackLayout.num_targets`, passed as
`n_labelled`) it gathers the labelled rows with `nonzero_static`, a shape known on the host. MoE routing is covered
by tests/test_moe_grouped.py (the models here are dense).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from family_models import build
from tiny_mindvl import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode
from train.train_helpers import CPU_ENV

from mindvl.conventions import IGNORE_INDEX
from mindvl.models import attention
from mindvl.models.host import PackLayout
from mindvl.models.loss import next_token_targets
from mindvl.train.step import MicroBatchStream, accumulate_gradients, batch_layout, labelled_targets

META = torch.device("meta")
_READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
          torch.ops.aten.masked_select.default, torch.ops.aten.unique_consecutive.default,
          torch.ops.aten._unique2.default, torch.ops.aten.item.default}


class DeviceReads(TorchDispatchMode):
    """Records ops that read meta ("device") data back to the host, and blocking host-to-device copies."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []
        self.blocking_copies: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
        on_device = any(t.device.type == "meta" for t in tensors)
        if on_device and self._reads(func, args, kwargs):
            self.reads.append(f"{func} at {_where()}")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if src.device.type == "cpu" and dst is not None and torch.device(dst).type == "meta" \
                    and not kwargs.get("non_blocking", False) and src.numel() > 0:
                self.blocking_copies.append(f"{func} {tuple(src.shape)} at {_where()}")
            if src.device.type == "meta" and dst is not None and torch.device(dst).type == "cpu":
                self.reads.append(f"{func} meta->cpu at {_where()}")
        return func(*args, **kwargs)

    @staticmethod
    def _reads(func, args, kwargs) -> bool:
        if func in _READS:
            return True
        if func is torch.ops.aten.index.Tensor or func in (torch.ops.aten.index_put.default,
                                                            torch.ops.aten.index_put_.default):
            return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None)
        if func is torch.ops.aten.repeat_interleave.Tensor:
            return kwargs.get("output_size") is None
        return False


def _where() -> str:
    """The innermost mindvl source line on the stack (where the read is written)."""
    import traceback

    frames = [f for f in traceback.extract_stack() if "/mindvl/" in f.filename]
    return f"{frames[-1].filename.split('/mindvl/')[-1]}:{frames[-1].lineno}" if frames else "?"


def packed_batch(model) -> dict:
    """Three samples in one row: two images (8x12 and 12x8 patches: windows cut at the edge), a text-only sample,
    lengths that fall in sdpa's padded buckets and an exact one; host tensors, as a loader yields them. The same row
    as benchmarks/device_reads.py counts (that script runs on older trees too, so the row is written there)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "device_reads.py"
    spec = importlib.util.spec_from_file_location("device_reads", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.small_batch(model)


def on_device(batch: dict, config) -> dict:
    """What the trainer's stream yields: the host batch described (`batch_layout`), its tensors on the device."""
    layout = batch_layout(config)(batch)
    return {**{k: v.to(META) for k, v in batch.items()}, "layout": layout}


def step_reads(model, batch: dict) -> DeviceReads:
    """Forward + backward as accumulate_gradients runs them, on the meta device, under DeviceReads."""
    model = model.to(META)
    with DeviceReads() as reads:
        loss_sum, _ = model(**batch)
        loss_sum.backward()
    return reads


def test_qwen25_vl_step_reads_nothing_from_the_device():
    model = tiny_model()
    reads = step_reads(model, on_device(packed_batch(model), model.config))
    assert reads.reads == [] and reads.blocking_copies == []
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_qwen3_vl_step_reads_nothing_from_the_device(tmp_path):
    """Qwen3-VL's tower: learned position table resampled per grid, DeepStack into the first LLM layers."""
    import qwen3vl_tiny as Q
    import vl_alignment as A

    _, model, _ = A.convert_pair(Q.qwen3vl, tmp_path, moe=False)
    model.set_attention_backend("auto")
    c = model.config
    grids = torch.tensor([[1, 6, 10], [1, 4, 4]])
    ids, _ = Q.prompt([("image", [1, 6, 10]), ("image", [1, 4, 4])])
    ids = torch.cat([ids[0], torch.arange(3, 30)])  # and a text-only second sample
    cu = torch.tensor([0, ids.shape[0] - 27, ids.shape[0]], dtype=torch.int32)
    host = {"input_ids": ids, "labels": ids.masked_fill(ids == c.image_token_id, IGNORE_INDEX), "cu_seqlens": cu,
            "position_ids": model.default_position_ids(ids, cu, grids), "pixel_values": Q.patch_rows(grids),
            "image_grid_thw": grids}
    reads = step_reads(model, on_device(host, c))
    assert reads.reads == [] and reads.blocking_copies == []


@pytest.mark.parametrize("name", ["moe_mla", "qwen3_5"])
def test_moe_and_hybrid_steps_read_nothing_from_the_device(name):
    """DeepSeek-V3's MoE with MLA latents (routing and the grouped experts on the device; bf16, the dtype meta runs
    grouped_mm in: the per-expert loop, which splits on the host, is the fallback) and Qwen3.5's hybrid linear
    attention (the delta rule plans its chunks from the layout's host offsets)."""
    model = build(name).train()
    if name == "moe_mla":
        model = model.to(torch.bfloat16)
    reads = step_reads(model, on_device(packed_batch(model), model.config))
    assert reads.reads == [] and reads.blocking_copies == []
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


def test_without_a_layout_the_model_reads_the_tensors_once_at_the_top():
    """Tensor callers still work (they pay the read): the same loss and gradients as with the host layout."""
    model = tiny_model()
    host = packed_batch(model)
    with_layout = model(**host, layout=batch_layout(model.config)(host))
    grads = torch.autograd.grad(with_layout.loss_sum, list(model.parameters()))
    plain = model(**host)
    ref_grads = torch.autograd.grad(plain.loss_sum, list(model.parameters()))
    assert torch.equal(with_layout.loss_sum, plain.loss_sum) and torch.equal(with_layout.num_tokens, plain.num_tokens)
    for g, r in zip(grads, ref_grads, strict=True):
        assert torch.equal(g, r)


def test_cpu_tolist_is_invisible_to_dispatch():
    """Why the check runs on meta: a CPU tensor's .tolist() never reaches a dispatch mode."""
    with DeviceReads() as reads:
        torch.arange(4).tolist()
    assert reads.reads == []
    with pytest.raises(NotImplementedError):
        torch.arange(4, device=META).tolist()


# ------------------------------------------------------------------------------------ the layout in the step


def test_stream_describes_each_pack_and_the_step_counts_from_it():
    model = tiny_model()
    host = packed_batch(model)
    stream = MicroBatchStream(iter([host]).__next__, 1, torch.device("cpu"), layout=batch_layout(model.config))
    (batch,) = list(stream)
    layout = batch["layout"]
    assert layout.cu_seqlens == tuple(host["cu_seqlens"].tolist())
    assert layout.grid_thw == ((1, 8, 12), (1, 12, 8))
    assert layout.vision_pads == int((host["input_ids"] == model.config.image_token_id).sum()) == 24 + 24
    counted = int((next_token_targets(host["labels"], host["cu_seqlens"]) != IGNORE_INDEX).sum())
    assert layout.num_targets == counted == labelled_targets(batch)
    stats = accumulate_gradients(model, [batch], CPU_ENV, model.config)
    assert float(stats.counts[0]) == counted


def test_targets_from_host_offsets_equal_the_tensor_rule():
    gen = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 50, (40,), generator=gen)
    for offsets in [(0, 40), (0, 0, 7, 7, 19, 40), (0, 1, 2, 40)]:
        assert torch.equal(next_token_targets(labels, offsets),
                           next_token_targets(labels, torch.tensor(offsets, dtype=torch.int32)))


@pytest.mark.parametrize("form", ["host", "tensor"])
def test_next_token_targets_read_nothing_from_the_device(form):
    """Both forms of the offsets mark the sample ends without a data-dependent shape or a blocking copy (the rule
    once filtered tensor offsets with a boolean mask: a read on every accelerator)."""
    offsets = (0, 0, 3, 4, 9)
    cu = offsets if form == "host" else torch.tensor(offsets, dtype=torch.int32, device=META)
    labels = torch.arange(9, device=META)
    with DeviceReads() as reads:
        targets = next_token_targets(labels, cu)
    assert (reads.reads, reads.blocking_copies) == ([], [])
    assert targets.shape == (9,) and targets.device == META


def test_layout_rejects_offsets_that_do_not_start_at_zero():
    with pytest.raises(ValueError, match="start at 0"):
        PackLayout((3, 9))


# ---------------------------------------------------------------------------------------- backend choice


def _fake(device: str, dtype=torch.bfloat16) -> torch.Tensor:
    """A [T, H, D] tensor that reports `device` (FakeTensorMode makes CUDA tensors without a GPU)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(16, 2, 8, dtype=dtype, device=device)


@pytest.mark.parametrize("flash", [False, True])
def test_auto_fits_the_device(monkeypatch, flash):
    monkeypatch.delenv("MINDVL_ATTN_BACKEND", raising=False)
    importable = {"flash_attn": flash, "torch_npu": False}
    monkeypatch.setattr(attention, "_importable", lambda m: importable.get(m, False))
    q = _fake("cuda")
    assert attention.resolve_backend("auto", q, packed=True) == ("flash" if flash else "flex")
    # one plain sequence: sdpa's single call, unless flash is there
    assert attention.resolve_backend("auto", q, packed=False) == ("flash" if flash else "sdpa")
    # fp32 on CUDA: flash-attn cannot take it, flex can
    assert attention.resolve_backend("auto", _fake("cuda", torch.float32), packed=True) == "flex"
    assert attention.resolve_backend("auto", torch.empty(16, 2, 8), packed=True) == "sdpa"  # CPU
    importable["torch_npu"] = True  # an Ascend tensor (torch knows no npu device without torch_npu): its fused op
    npu = SimpleNamespace(device=SimpleNamespace(type="npu"), dtype=torch.bfloat16)
    assert attention.resolve_backend("auto", npu, packed=True) == "npu"
    assert attention.resolve_backend("auto", npu, packed=False) == "npu"


def test_auto_packed_rows_on_cuda_reach_flex_through_attend(monkeypatch):
    """attend decides `packed` from the host offsets: two sequences or a window -> flex, one sequence -> sdpa."""
    monkeypatch.delenv("MINDVL_ATTN_BACKEND", raising=False)
    monkeypatch.setattr(attention, "_importable", lambda m: False)
    chosen = []
    for name in ("_sdpa", "_flex"):
        monkeypatch.setattr(attention, name, lambda *a, _n=name: chosen.append(_n) or a[0])
    q = _fake("cuda")
    attention.attend(q, q, q, (0, 6, 16), 10, causal=True)
    attention.attend(q, q, q, (0, 16), 16, causal=True)
    attention.attend(q, q, q, (0, 16), 16, causal=True, window=4)
    assert chosen == ["_flex", "_sdpa", "_flex"]


# ------------------------------------------------------------------------------------------ flex block masks


def test_flex_block_mask_is_built_from_host_offsets_without_reading_the_device(monkeypatch):
    monkeypatch.setattr(attention, "_FLEX_MASK_CACHE", {})
    offsets = (0, 100, 100, 300, 301, 520)
    with DeviceReads() as reads:
        mask = attention._flex_block_mask(offsets, True, None, META)
        again = attention._flex_block_mask(tuple(list(offsets)), True, None, META)  # equal host values: a hit
    assert again is mask and len(attention._FLEX_MASK_CACHE) == 1
    assert reads.reads == [] and reads.blocking_copies == []
    assert mask.kv_num_blocks.device == META


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 150)])
def test_host_block_tables_match_create_block_mask(causal, window):
    """The host's block tables against torch's, which evaluates the mask elementwise: full blocks equal, partial
    blocks equal (a superset with a window: extra blocks are masked elementwise by mask_mod)."""
    from torch.nn.attention.flex_attention import create_block_mask

    for lengths in ([1, 127, 128, 129, 300], [0, 5, 256, 0, 60, 200], [520]):
        offsets = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).tolist()
        seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

        def mask_mod(b, h, q, k, seq=seq):
            keep = seq[q] == seq[k]
            keep = keep & (q >= k) if causal else keep
            return keep & (q - k <= window) if window is not None else keep

        ref = create_block_mask(mask_mod, None, None, offsets[-1], offsets[-1], device="cpu")
        partial, full = attention.document_block_tables(offsets, causal, window)
        ref_partial, ref_full = _dense(ref.kv_num_blocks, ref.kv_indices), _dense(ref.full_kv_num_blocks,
                                                                                    ref.full_kv_indices)
        assert torch.equal(full, ref_full)
        assert torch.equal(partial & ~full, ref_partial) if window is None else bool((ref_partial <= partial).all())


def _dense(num: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    n = num.shape[-1]
    out = torch.zeros(n, idx.shape[-1], dtype=torch.bool)
    for i in range(n):
        out[i, idx[0, 0, i, : int(num[0, 0, i])].long()] = True
    return out


def test_new_offsets_cost_a_compiled_layer_no_recompile():
    """Host offsets stop at `attend` (a compile boundary): a compiled decoder layer given a new pack's offsets (same
    number of samples) builds no new graph; dynamo would otherwise guard on every int of the tuple."""
    from torch._dynamo.utils import counters

    from mindvl.models.config import TextConfig
    from mindvl.models.text import DecoderLayer, GQAttention

    torch._dynamo.reset()
    cfg = TextConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8)
    layer = DecoderLayer(cfg, 0)
    layer.compile(backend="eager")
    x = torch.randn(40, 32)
    cos, sin = GQAttention.rotary(torch.arange(40), cfg)
    for offsets in [(0, 10, 40), (0, 17, 40)]:  # warm-up: the second call makes the changing ints dynamic
        layer(x, cos, sin, offsets, max(offsets[1], 40 - offsets[1]))
    graphs = counters["stats"]["unique_graphs"]
    for offsets in [(0, 5, 40), (0, 39, 40), (0, 22, 40)]:
        longest = max(offsets[1], 40 - offsets[1])
        torch.testing.assert_close(layer(x, cos, sin, offsets, longest), layer.forward(x, cos, sin, offsets, longest))
    assert counters["stats"]["unique_graphs"] == graphs
    torch._dynamo.reset()
