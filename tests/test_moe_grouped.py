"""Routed experts as grouped GEMMs: forward and backward equal a per-expert reference loop (the pre-grouped code),
through F.grouped_mm and through the unbind fallback, with idle experts and unaligned widths; the grouped path's
aligned layout and its freedom from host reads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from graph_replay import CaptureRecorder
from torch.utils._python_dispatch import TorchDispatchMode

from mindvl.models.moe import RoutedExperts, _grouped_mm_runs, aligned_groups


def per_expert_reference(m: RoutedExperts, x, ids, weights):
    """The original implementation: index each expert's weights, gather its rows, weight in fp32, index_add."""
    k = ids.shape[1]
    out = torch.zeros_like(x)
    for e in range(m.num_experts):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # token order within an expert, like the stable sort
        if tok.numel() == 0:
            continue
        h = x[tok]
        y = F.linear(F.silu(F.linear(h, m.gate_proj[e])) * F.linear(h, m.up_proj[e]), m.down_proj[e])
        out.index_add_(0, tok, (y * weights[tok, slot][:, None]).to(x.dtype))
    assert k == ids.shape[1]
    return out


def make(num_experts, hidden, inner, tokens, k, seed, idle=()):
    g = torch.Generator().manual_seed(seed)
    m = RoutedExperts(num_experts, hidden, inner, "silu")
    for p in m.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    x = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    allowed = torch.tensor([e for e in range(num_experts) if e not in idle])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=g)[:k]] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=g)
    return m, x, ids, weights


@pytest.mark.parametrize("inner, grouped", [(16, True), (16, False), (10, False)])
def test_grouped_experts_equal_per_expert_loop(inner, grouped):
    m, x, ids, w = make(16, 32, inner, tokens=40, k=3, seed=inner, idle=(0, 5, 15))
    m.use_grouped_mm = grouped
    assert _grouped_mm_runs(x, m.gate_proj, m.up_proj, m.down_proj) == (inner == 16)  # 10 * 4 bytes: unaligned rows
    out = m(x, ids, w)
    out.sum().backward()  # a stride-0 upstream gradient must not reach grouped_mm's CPU backward
    got = [out.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad(set_to_none=True)
    ref_out = per_expert_reference(m, x, ids, w)
    ref_out.sum().backward()
    want = [ref_out.detach(), x.grad] + [p.grad for p in m.parameters()]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert m.gate_proj.grad[[0, 5, 15]].abs().sum() == 0  # idle experts: zero gradient, not None


def test_grouped_experts_bf16_and_no_tokens():
    m, x, ids, w = make(8, 32, 16, tokens=24, k=2, seed=1)
    m = m.to(torch.bfloat16)
    xb = x.detach().to(torch.bfloat16)
    torch.testing.assert_close(m(xb, ids, w), per_expert_reference(m, xb, ids, w), rtol=2e-2, atol=2e-2)
    empty = m(xb[:0], ids[:0], w[:0])
    assert empty.shape == (0, 32)


class ScalarReads(TorchDispatchMode):
    """Counts `aten._local_scalar_dense`: every read of a device value back to the host (.item(), .tolist(), int(t),
    boolean indexing's size) goes through it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def skewed(num_experts, tokens, k, seed):
    """Routing where most rows go to two experts and the first, a middle and the LAST expert get none."""
    m, x, ids, w = make(num_experts, 32, 16, tokens=tokens, k=k, seed=seed)
    g = torch.Generator().manual_seed(seed)
    busy = torch.tensor([1, 2] * 3 + list(range(3, num_experts - 1)))
    busy = busy[(busy != num_experts // 2)]
    ids = torch.stack([busy[torch.randperm(len(busy), generator=g)[:k]] for _ in range(tokens)])
    ids[: tokens // 2, 0], ids[: tokens // 2, 1] = 1, 2
    return m, x, ids, w


def test_aligned_groups_layout():
    counts = torch.tensor([0, 37, 1, 16, 0, 5])
    dest, offsets, size = aligned_groups(counts, int(counts.sum()), align=16)
    assert size % 16 == 0 and size > int(counts.sum()) + 6 * 15
    # the groups end at their own padded end (48 + 16 + 16 + 16 rows), not at the bound: no work on the slack
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, 48, 64, 80, 80, 96] and size == 160
    starts = [0, *offsets.tolist()[:-1]]
    assert all(s % 16 == 0 for s in starts) and starts == sorted(starts)
    ends = counts.cumsum(0).tolist()
    for e, c in enumerate(counts.tolist()):  # expert e's rows land, in order, at the start of its padded group
        first = ends[e] - c
        assert dest[first:ends[e]].tolist() == list(range(starts[e], starts[e] + c))
        assert c <= (offsets[e] - starts[e])
    assert dest.unique().numel() == dest.numel()
    # every expert's count one past a multiple of 16: the padded groups fill the bound, and still end below it
    counts = torch.tensor([17, 1, 33])
    _, offsets, size = aligned_groups(counts, 51, align=16)
    assert offsets.tolist() == [32, 48, 96] and size == 112


def test_a_few_rows_over_many_experts_get_a_layout_of_a_few_tiles():
    """A decode step's rows (tokens x k, fewer than the experts): at most that many groups are not empty, so the
    padded layout is bounded by the rows, not by E pad groups (8 rows over 256 experts: 144 rows, not 3,856), and
    the last group still ends below the bound for every routing, the worst one (every row its own expert) too."""
    assert aligned_groups(torch.zeros(256, dtype=torch.long).index_fill_(0, torch.arange(8) * 31, 1), 8)[2] == 144
    g = torch.Generator().manual_seed(3)
    for n in (1, 3, 8, 40, 63, 64, 65, 200):
        bound = -(-(n + min(64, n) * 15 + 1) // 16) * 16
        worst = torch.zeros(64, dtype=torch.long)
        worst[:min(n, 64)] = 1
        worst[0] += n - min(n, 64)
        routings = [worst, torch.zeros(64, dtype=torch.long).index_fill_(0, torch.tensor([5]), n)]
        routings += [torch.zeros(64, dtype=torch.long).index_add_(0, torch.randint(0, 64, (n,), generator=g),
                                                                  torch.ones(n, dtype=torch.long))
                     for _ in range(20)]
        for counts in routings:
            dest, offsets, size = aligned_groups(counts, n)
            assert size == bound and int(offsets[-1]) < size and int(dest.max()) < int(offsets[-1])
        if n <= 64:  # every row its own expert: n whole tiles, the most n rows can need
            assert int(aligned_groups(worst, n)[1][-1]) == 16 * n


@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_sized_batches_through_grouped_experts_equal_the_loop(tokens, dtype):
    """1 and 3 tokens x 4 slots over 64 experts (the decode layout above): the per-expert reference's outputs."""
    m, x, ids, w = make(64, 32, 16, tokens=tokens, k=4, seed=tokens)
    m = m.to(dtype)
    xd = x.detach().to(dtype)
    assert _grouped_mm_runs(xd, m.gate_proj, m.up_proj, m.down_proj)
    with torch.no_grad():
        got, want = m(xd, ids, w), per_expert_reference(m, xd, ids, w)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_equals_loop_with_skewed_and_empty_experts(dtype):
    m, x, ids, w = skewed(12, tokens=45, k=3, seed=7)
    m = m.to(dtype)
    x = x.detach().to(dtype).requires_grad_()
    results = {}
    for grouped in (True, False):
        m.use_grouped_mm = grouped
        assert not grouped or _grouped_mm_runs(x, m.gate_proj, m.up_proj, m.down_proj)
        out = m(x, ids, w)
        (out.float() * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()  # a non-uniform gradient
        results[grouped] = [out.detach(), x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
        x.grad = None
        m.zero_grad(set_to_none=True)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(a, b, **tol)
    assert results[True][2][[0, 6, 11]].abs().sum() == 0  # the empty experts' gradients: zero


def test_grouped_path_never_reads_the_device():
    """Zero host reads in the grouped forward + backward, counted on real tensors (`_local_scalar_dense`) and proven
    on fake ones: under FakeTensorMode any read of a value (.item(), .tolist(), a data-dependent size) raises, and
    the per-expert loop, which reads its split sizes, does raise (CPU `.tolist()` bypasses the dispatcher, so the
    counter alone could not see it)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    m, x, ids, w = skewed(12, tokens=45, k=3, seed=8)
    m.use_grouped_mm = True
    with ScalarReads() as mode:
        m(x, ids, w).sum().backward()
    assert mode.reads == 0
    # Nor a tensor made from host data inside the step (`t[i] = python_int` is one): on CUDA its pageable
    # host-to-device copy synchronises the stream, and a graph capture fails on it (graph_replay's capture rules).
    with CaptureRecorder():
        m(x, ids, w).sum().backward()
    m = m.to(torch.bfloat16)  # fake tensors take grouped_mm in bf16 (its meta function's rule)
    for grouped in (True, False):
        m.use_grouped_mm = grouped
        with FakeTensorMode(allow_non_fake_inputs=True) as fake:
            fx = fake.from_tensor(x.detach().bfloat16()).requires_grad_()
            fids, fw = fake.from_tensor(ids), fake.from_tensor(w)
            if grouped:
                m(fx, fids, fw).sum().backward()
            else:
                with pytest.raises(DataDependentOutputException, match="_local_scalar_dense"):
                    m(fx, fids, fw).sum().backward()
