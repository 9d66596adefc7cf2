"""sdpa backend: equal-length sequences that follow each other are attended on views of the row (no gather); checked
against the float64 per-sequence reference, with gradients, next to buckets that still gather."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_model_packing import naive_attention

from mindvl.models import attention
from mindvl.models.attention import attend

# Long sequences (> _SHORT) bucket by exact length: two runs of 140 around a 150, a lone 300, and short ones that
# share a padded power-of-two bucket.
LENGTHS = [140, 140, 150, 140, 9, 300, 140, 5, 150]


def test_consecutive_runs():
    starts = [0, 140, 280, 430, 570]
    assert attention._consecutive_runs([0, 1, 3], starts, 140) == [(0, 2), (430, 1)]


@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 7)])
def test_runs_match_naive_attention_with_gradients(causal, window):
    gen = torch.Generator().manual_seed(0)
    total = sum(LENGTHS)
    q = torch.randn(total, 4, 16, generator=gen, requires_grad=True)
    k = torch.randn(total, 2, 16, generator=gen, requires_grad=True)  # GQA 4:2
    v = torch.randn(total, 2, 12, generator=gen, requires_grad=True)
    cu = F.pad(torch.tensor(LENGTHS).cumsum(0), (1, 0)).int()
    out = attend(q, k, v, cu, max(LENGTHS), causal=causal, window=window, backend="sdpa")
    ref = naive_attention(q, k, v, LENGTHS, causal, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-4, rtol=1e-5)


def test_many_runs_fall_back_to_one_gathered_call(monkeypatch):
    calls = []
    real = attention._sdpa_call
    monkeypatch.setattr(attention, "_sdpa_call", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    lengths = [130, 131] * (attention._MAX_RUNS + 1)  # 130s never touch: one run each
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen) for _ in range(3))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    out = attend(q, k, v, cu, 131, causal=True, backend="sdpa")
    assert sorted(calls) == [attention._MAX_RUNS + 1] * 2  # each length gathered into one batched call
    torch.testing.assert_close(out, naive_attention(q, k, v, lengths, True), atol=2e-5, rtol=1e-5)
