"""The chunked vocabulary loss at GEMM speed (mindvl.models.loss): aligned vocabulary slices, one compute dtype cast
once per call (not per slice), no host syncs with a host-known label count; forward and gradients still equal a plain
F.cross_entropy over the whole logits."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mindvl.models.loss import SLICE_ALIGN, _vocab_slices, chunked_cross_entropy

V, H, T = 1003, 24, 64  # an odd vocabulary: the last slice is ragged


class OpLog(TorchDispatchMode):
    """Every aten op dispatched inside the block, with its first argument's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args and torch.is_tensor(args[0]) else None
        self.ops.append((str(func.overloadpacket.__name__), tuple(first.shape) if first is not None else ()))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return Counter(op for op, _ in self.ops)[name]


def data(seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(T, H, generator=g) * 2).to(dtype).requires_grad_()
    weight = torch.randn(V, H, generator=g).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (T,), generator=g)
    targets[::3] = -100
    targets[1] = V - 1  # a target in the ragged last slice
    return hidden, weight, targets


def reference(hidden, weight, targets, scale: float):
    ref = F.cross_entropy(hidden.float() @ weight.float().T, targets, ignore_index=-100, reduction="sum")
    return (ref.detach(), *torch.autograd.grad(scale * ref, (hidden, weight)))


def test_slices_are_aligned_and_cover_the_vocabulary():
    for n_rows, vocab, chunk in [(40, 1003, 7), (8000, 151936, 2048), (5, 300, 1), (10, 100, 1)]:
        starts = _vocab_slices(n_rows, vocab, chunk)
        assert starts.step % SLICE_ALIGN == 0 or starts.step == vocab
        assert starts[0] == 0 and starts[-1] < vocab <= starts[-1] + starts.step
    assert len(_vocab_slices(40, 1003, 7)) == 4  # several slices at these test shapes: the walk is exercised


@pytest.mark.parametrize("chunk, n_labelled", [(7, None), (7, "host"), (4096, None)])
def test_loss_and_gradients_equal_full_cross_entropy(chunk, n_labelled):
    hidden, weight, targets = data(1)
    n = int((targets != -100).sum()) if n_labelled == "host" else None
    loss_sum, count = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk, n_labelled=n)
    (2.5 * loss_sum).backward()
    ref, ref_gh, ref_gw = reference(hidden, weight, targets, 2.5)
    assert int(count) == int((targets != -100).sum())
    torch.testing.assert_close(loss_sum, ref)  # fp32 defaults (rtol 1.3e-6, atol 1e-5), as the original loss's test
    torch.testing.assert_close(hidden.grad, ref_gh)
    torch.testing.assert_close(weight.grad, ref_gw)
    assert weight.grad[(targets[targets != -100]).unique()].abs().sum() > 0


def test_no_host_sync_with_a_host_count():
    hidden, weight, targets = data(2)
    n = int((targets != -100).sum())
    with OpLog() as log:
        loss_sum, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=7, n_labelled=n)
        loss_sum.backward()
    assert log.count("_local_scalar_dense") == 0 and log.count("nonzero") == 0, Counter(o for o, _ in log.ops)
    with OpLog() as log:  # without the host count the mask's size is read once (and the test can see it)
        chunked_cross_entropy(hidden, weight, targets, chunk_size=7)[0].backward()
    assert log.count("nonzero") == 1


def test_autocast_casts_once_per_call_not_per_slice():
    """Under bf16 autocast (one-rank mixed precision): the GEMMs run in bf16 on operands cast ONCE (no per-slice cast
    of a weight slice), and the result equals the loss of the bf16-rounded operands computed in fp32."""
    hidden, weight, targets = data(3)
    with OpLog() as log, torch.autocast("cpu", dtype=torch.bfloat16):
        loss_sum, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=7)
    loss_sum.backward()
    starts = _vocab_slices(int((targets != -100).sum()), V, 7)
    slice_shapes = {(min(starts.step, V - s), H) for s in starts}
    casts = [shape for op, shape in log.ops if op == "_to_copy"]
    assert casts.count((V, H)) == 1 and not slice_shapes & set(casts), casts  # the weight once, never a slice
    mms = [shape for op, shape in log.ops if op == "mm"]
    assert len(mms) == len(starts)
    hb, wb = hidden.detach().bfloat16().float(), weight.detach().bfloat16().float()
    ref = F.cross_entropy(hb @ wb.T, targets, ignore_index=-100, reduction="sum")
    torch.testing.assert_close(loss_sum.detach(), ref, rtol=1e-2, atol=0.0)  # bf16 logits, as transformers
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32


def test_bf16_operands_write_the_weight_gradient_in_place():
    hidden, weight, targets = data(4, torch.bfloat16)
    loss_sum, _ = chunked_cross_entropy(hidden, weight, targets, chunk_size=7)
    loss_sum.backward()
    # reference: the same bf16 operands and bf16-rounded logits (as the loss's GEMMs give them), the rest in fp32
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    logits = (hf @ wf.T).bfloat16().float()
    ref = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    ref_gh, ref_gw = torch.autograd.grad(ref, (hf, wf))
    assert weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(loss_sum.detach(), ref.detach(), rtol=1e-5, atol=0.0)
    for got, want in ((weight.grad, ref_gw), (hidden.grad, ref_gh)):  # bf16 results: 2^-8 of the largest
        torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=float(want.abs().max()) / 256)
