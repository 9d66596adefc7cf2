"""Routed experts as grouped GEMMs: forward and backward equal a per-expert reference loop (the pre-grouped code),
through F.grouped_mm and through the unbind fallback, with idle experts and unaligned widths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mindvl.models.moe import RoutedExperts, _grouped_mm_runs


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
