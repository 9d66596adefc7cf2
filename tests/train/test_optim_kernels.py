"""The fast optimizer step (fused AdamW kernels, grouped by dtype/device; multi-tensor clipping) against torch's
per-parameter AdamW and per-tensor clipping over several steps."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mindvl.config import OptimSection
from mindvl.train.optim import build_optimizer, clip_grad_norm


def mixed_model(seed: int) -> nn.Module:
    """Matrices, vectors and one bf16 sub-module: three kernel groups, two of them decayed."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(50, 16), nn.LayerNorm(16), nn.Linear(16, 24), nn.Linear(24, 8, bias=False))
    model[3].to(torch.bfloat16)
    return model


def reference_optimizer(model: nn.Module, cfg: OptimSection) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False, fused=False)


def fill_grads(model: nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for name, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen) * (1 + step)
        p.grad = (g.bfloat16() if name.startswith("3.") else g).to(p.dtype)  # the bf16 layer's grads are bf16


def test_groups_use_fused_kernels_per_dtype():
    cfg = OptimSection(lr=1e-2, weight_decay=0.1)
    model = mixed_model(0)
    opt = build_optimizer(model, cfg)
    assert all(g["fused"] for g in opt.param_groups)  # CPU has fused AdamW for fp32 and bf16
    kinds = [({p.dtype for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]
    assert kinds == [({torch.float32}, 0.1), ({torch.bfloat16}, 0.1), ({torch.float32}, 0.0)]
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


@pytest.mark.parametrize("grad_clip", [1.0, 1e4])  # clipping every step / never (the gradient norms are ~20-200)
def test_fused_step_matches_per_parameter_adamw_over_steps(grad_clip):
    cfg = OptimSection(lr=1e-2, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, grad_clip=grad_clip)
    ours, ref = mixed_model(0), mixed_model(0)
    exact = mixed_model(0).double()  # fp64 arithmetic from the same start: judges the bf16 layer
    opt, ref_opt = build_optimizer(ours, cfg), reference_optimizer(ref, cfg)
    exact_opt = reference_optimizer(exact, cfg)
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    for step in range(6):
        fill_grads(ours, step)
        fill_grads(ref, step)
        norm = clip_grad_norm(list(ours.parameters()), cfg.grad_clip)
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), cfg.grad_clip, foreach=False)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
        assert (float(norm) > grad_clip) == (grad_clip == 1.0)
        for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad)  # clipped (or left alone) exactly as torch does
        for p, q in zip(exact.parameters(), ref.parameters(), strict=True):
            p.grad = q.grad.double()
        opt.step()
        ref_opt.step()
        exact_opt.step()
    for (name, p), q, e in zip(ours.named_parameters(), ref.parameters(), exact.parameters(), strict=True):
        assert not torch.equal(q, start[name]), name  # the steps moved every parameter
        if p.dtype == torch.float32:  # the fused kernel's rounding differs from the per-parameter ops' by a few ulps
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=name)
        else:  # bf16: the fused kernel computes in fp32 between bf16 loads/stores, torch's per-parameter path in bf16
            err, ref_err = (p.double() - e).abs().mean(), (q.double() - e).abs().mean()
            assert err <= ref_err, (name, float(err), float(ref_err))
            torch.testing.assert_close(p, e.to(p.dtype), rtol=0.02, atol=2e-3, msg=name)


def test_state_dict_round_trip_resumes_exactly():
    cfg = OptimSection(lr=1e-2, weight_decay=0.1)
    a = mixed_model(1)
    opt_a = build_optimizer(a, cfg)
    for step in range(2):
        fill_grads(a, step)
        opt_a.step()
    b = mixed_model(2)
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b, cfg)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # as read from disk: no tensor shared with opt_a
    for step in range(2, 4):
        for m, o in ((a, opt_a), (b, opt_b)):
            fill_grads(m, step)
            o.step()
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_frozen_model_is_rejected():
    model = mixed_model(0).requires_grad_(False)
    with pytest.raises(ValueError, match="nothing to train"):
        build_optimizer(model, OptimSection())
