"""Packed rows, attention backends and the chunked loss, each against an independent reference."""

from __future__ import annotations

import hf_tiny as H
import pytest
import torch
import torch.nn.functional as F

from mindvl.checkpoint import convert_from_hf, load_model
from mindvl.models import attend, available_backends
from mindvl.models.loss import chunked_cross_entropy, next_token_targets

BACKENDS = available_backends("cpu")
# torch has no FlexAttention backward on CPU, so there flex is checked forward-only.
TRAINABLE = [b for b in BACKENDS if b != "flex"]


def naive_attention(q, k, v, lengths, causal, window=None, scale=None):
    """Explicit softmax(QK^T)V per sequence in float64: the independent reference."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[start : start + n].double().transpose(0, 1) for t in (q, k, v))
        scores = qs @ ks.transpose(1, 2) * scale
        i = torch.arange(n)
        allowed = torch.ones(n, n, dtype=torch.bool)
        if causal:
            allowed &= i[:, None] >= i[None, :]
        if window is not None:
            allowed &= i[:, None] - i[None, :] <= window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs).to(q.dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("causal,window", [(True, None), (False, None), (True, 3)])
def test_backend_matches_naive_attention(backend, causal, window):
    lengths = [5, 1, 17, 8, 8, 30]  # several length buckets, a length-1 sequence, equal lengths
    gen = torch.Generator().manual_seed(0)
    total = sum(lengths)
    q = torch.randn(total, 4, 16, generator=gen)
    k = torch.randn(total, 2, 16, generator=gen)  # GQA 4:2
    v = torch.randn(total, 2, 12, generator=gen)  # value head size may differ (MLA)
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    out = attend(q, k, v, cu, max(lengths), causal=causal, window=window, backend=backend)
    ref = naive_attention(q, k, v, lengths, causal, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", TRAINABLE)
def test_backend_gradients_match_naive_attention(backend):
    lengths = [7, 12, 3]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lengths), 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).int()
    grads = torch.autograd.grad(attend(q, k, v, cu, 12, causal=True, backend=backend).square().sum(), (q, k, v))
    ref = torch.autograd.grad(naive_attention(q, k, v, lengths, True).square().sum(), (q, k, v))
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_unknown_backend_is_a_clear_error():
    q = torch.zeros(2, 1, 4)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        attend(q, q, q, torch.tensor([0, 2]), 2, causal=True, backend="fast")


# ------------------------------------------------------------------------------------------------- packed model


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack")
    H.qwen25vl(root / "hf", seed=11)
    convert_from_hf(root / "hf", root / "mindvl")
    return load_model(root / "mindvl")


def _samples():
    """Three samples: two with images (one with two images), one text-only. Each: (ids, grids, labels)."""
    specs = [([3, [1, 8, 8], 6], [[1, 8, 8]]), ([9], []), ([2, [1, 4, 8], 1, [1, 12, 4], 5], [[1, 4, 8], [1, 12, 4]])]
    out = []
    for i, (pieces, grids) in enumerate(specs):
        ids = H.multimodal_ids(pieces, seed=20 + i)
        labels = ids.clone()
        labels[ids == H.IMAGE_TOKEN] = -100
        labels[: len(ids) // 3] = -100  # a prompt part without labels
        out.append((ids, grids, labels))
    return out


def _pixels_for(grids, seed):
    return H.random_pixels(grids, seed=seed) if grids else (None, None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_row_equals_separate_forwards(tiny_vl, backend):
    model = tiny_vl
    model.set_attention_backend(backend)
    samples = _samples()
    pixel_parts = [_pixels_for(g, seed=30 + i) for i, (_, g, _) in enumerate(samples)]
    sep_logits, sep_loss, sep_count = [], 0.0, 0
    with torch.no_grad():
        for (ids, _, labels), (pv, grid) in zip(samples, pixel_parts, strict=True):
            logits = model(input_ids=ids[None], pixel_values=pv, image_grid_thw=grid).logits[0]
            sep_logits.append(logits)
            sep_loss += F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
            sep_count += int((labels[1:] != -100).sum())
        ids = torch.cat([s[0] for s in samples])
        labels = torch.cat([s[2] for s in samples])
        cu = F.pad(torch.tensor([len(s[0]) for s in samples]).cumsum(0), (1, 0)).int()
        pv = torch.cat([p for p, _ in pixel_parts if p is not None])
        grid = torch.cat([g for _, g in pixel_parts if g is not None])
        packed = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, cu_seqlens=cu).logits
        loss_sum, count = model(input_ids=ids, pixel_values=pv, image_grid_thw=grid, cu_seqlens=cu, labels=labels)
    model.set_attention_backend("auto")
    torch.testing.assert_close(packed, torch.cat(sep_logits), atol=1e-5, rtol=1e-5)
    assert int(count) == sep_count
    torch.testing.assert_close(loss_sum, torch.as_tensor(sep_loss), atol=1e-4, rtol=1e-5)


def test_packed_positions_restart_per_sample(tiny_vl):
    samples = _samples()
    ids = torch.cat([s[0] for s in samples])
    grid = torch.tensor([g for s in samples for g in s[1]])
    cu = F.pad(torch.tensor([len(s[0]) for s in samples]).cumsum(0), (1, 0)).int()
    pos = tiny_vl.default_position_ids(ids, cu, grid)
    for start in cu[:-1].tolist():
        assert pos[:, start].tolist() == [0, 0, 0]
    # The text-only middle sample has ordinary 1-D positions in all three rows.
    a, b = int(cu[1]), int(cu[2])
    assert torch.equal(pos[:, a:b], torch.arange(b - a).expand(3, -1))


def test_text_only_microbatch_runs_vision_and_gives_zero_grads(tiny_vl):
    model = tiny_vl
    ids = H.multimodal_ids([12], seed=3)
    loss_sum, count = model(input_ids=ids, labels=ids, cu_seqlens=torch.tensor([0, 12], dtype=torch.int32))
    loss_sum.backward()
    vision_grads = [p.grad for p in model.visual.parameters()] + [p.grad for p in model.projector.parameters()]
    try:
        # Every rank must produce a gradient for every parameter (FSDP reduce-scatters them all): zeros, not None.
        assert all(g is not None for g in vision_grads)
        assert all(float(g.abs().max()) == 0.0 for g in vision_grads)
        assert model.language_model.embed_tokens.weight.grad.abs().max() > 0
    finally:
        model.zero_grad(set_to_none=True)


def test_image_pad_count_mismatch_is_a_clear_error(tiny_vl):
    ids = H.multimodal_ids([3, [1, 8, 8], 2])[None]
    pixels, grid = H.random_pixels([[1, 8, 12]])
    with pytest.raises(ValueError, match="16 image-pad tokens .* 24 features"):
        tiny_vl(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)


def test_pixel_rows_must_match_grid(tiny_vl):
    pixels, _ = H.random_pixels([[1, 8, 8]])
    with pytest.raises(ValueError, match="64 patch rows but grid_thw describes 96"):
        tiny_vl.image_features(pixels, torch.tensor([[1, 8, 12]]))


# ---------------------------------------------------------------------------------------------------------- loss


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_chunked_loss_and_grads_match_full_cross_entropy(chunk):
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (40,), generator=gen)
    targets[::3] = -100
    loss_sum, count = chunked_cross_entropy(hidden, weight, targets, chunk_size=chunk)
    (2.5 * loss_sum).backward()
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=-100, reduction="sum")
    ref_gh, ref_gw = torch.autograd.grad(2.5 * ref, (hidden, weight))
    assert int(count) == int((targets != -100).sum())
    torch.testing.assert_close(loss_sum, ref.detach())
    torch.testing.assert_close(hidden.grad, ref_gh)
    torch.testing.assert_close(weight.grad, ref_gw)


def test_chunked_loss_skips_weight_grad_when_frozen():
    hidden = torch.randn(6, 4, requires_grad=True)
    weight = torch.randn(9, 4)  # frozen lm_head (warm-up phase)
    loss_sum, _ = chunked_cross_entropy(hidden, weight, torch.tensor([1, 2, -100, 3, 4, 5]), chunk_size=2)
    loss_sum.backward()
    assert weight.grad is None and hidden.grad is not None


def test_next_token_targets_never_cross_samples():
    labels = torch.tensor([10, 11, 12, 20, 21, -100, 30])
    cu = torch.tensor([0, 3, 6, 7], dtype=torch.int32)
    assert next_token_targets(labels, cu).tolist() == [11, 12, -100, 21, -100, -100, -100]


@pytest.mark.parametrize("form", ["tuple", "list", "int32", "int64"])
def test_next_token_targets_host_and_tensor_offsets_agree_by_hand(form):
    """One rule for both forms of the offsets (host ints from a PackLayout, a tensor from a batch). Samples [0, 3),
    an empty one, a 1-token sample [3, 4), [4, 7) whose second label is ignored, [7, 9): a rule that misses the
    1-token sample, shifts the ends by one or marks the ignored label's neighbour shows."""
    labels = torch.tensor([10, 11, 12, 30, 40, -100, 42, 50, 51])
    offsets = (0, 3, 3, 4, 7, 9)
    cu = {"tuple": offsets, "list": list(offsets), "int32": torch.tensor(offsets, dtype=torch.int32),
          "int64": torch.tensor(offsets)}[form]
    assert next_token_targets(labels, cu).tolist() == [11, 12, -100, -100, -100, 42, -100, 51, -100]
    # offsets that stop short of T: the tail keeps its shifted labels; an offset of 0 (a leading empty sample)
    # marks no token
    cu = (0, 0, 2) if form in ("tuple", "list") else torch.tensor((0, 0, 2), dtype=torch.int32)
    assert next_token_targets(labels[:4], cu).tolist() == [11, -100, 30, -100]
