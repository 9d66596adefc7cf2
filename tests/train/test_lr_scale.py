"""`optim.lr_scale`: a module's parameters follow the LR schedule times its scale, at every step, against a
hand-built reference (torch's AdamW with per-group LRs and the schedule computed by `lr_at`); bad keys are one-line
errors naming the key."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mindvl.config import OptimSection, ScheduleSection, load_recipe
from mindvl.train.optim import build_optimizer, build_scheduler, lr_at


class Towers(nn.Module):
    """The three top-level modules the recipe names, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.visual = nn.Linear(6, 8)
        self.projector = nn.Linear(8, 8)
        self.language_model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))


def test_each_module_follows_the_schedule_times_its_scale():
    cfg = OptimSection(lr=1e-2, min_lr=1e-3, weight_decay=0.1, lr_scale={"language_model": 0.1, "visual": 2.0})
    sched = ScheduleSection(warmup_ratio=0.25, decay="cosine")
    ours, ref = Towers(), Towers()
    opt = build_optimizer(ours, cfg)
    scheduler = build_scheduler(opt, 8, cfg, sched)
    scale = {"visual": 2.0, "projector": 1.0, "language_model": 0.1}
    # Reference: one torch AdamW group per parameter, its LR set by hand from lr_at each step.
    named = list(ref.named_parameters())
    ref_opt = torch.optim.AdamW([{"params": [p], "weight_decay": 0.1 if p.dim() >= 2 else 0.0} for _, p in named],
                                lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False, fused=False)
    for step in range(8):
        for model in (ours, ref):
            gen = torch.Generator().manual_seed(step)
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=gen)
        lr = lr_at(step, 8, cfg.lr, cfg.min_lr, sched.warmup_ratio, sched.decay)
        for group, (name, _) in zip(ref_opt.param_groups, named, strict=True):
            group["lr"] = lr * scale[name.split(".")[0]]
        for group in opt.param_groups:  # every parameter's group carries its module's LR
            for p in group["params"]:
                name = next(n for n, q in ours.named_parameters() if q is p)
                assert group["lr"] == pytest.approx(lr * scale[name.split(".")[0]], rel=1e-12), (step, name)
        opt.step()
        ref_opt.step()
        scheduler.step()
    for (name, p), (_, q) in zip(ours.named_parameters(), named, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_no_scale_keeps_one_lr_and_the_old_groups():
    opt = build_optimizer(Towers(), OptimSection(lr=1e-3, weight_decay=0.1))
    assert [g["lr"] for g in opt.param_groups] == [1e-3, 1e-3]  # decayed matrices, then vectors: as before


def test_resume_keeps_the_scales_and_refuses_a_changed_one(tmp_path):
    from mindvl.train.trainer import resume_schedule

    def recipe(*extra):
        return load_recipe("tiny/multitask", ["output_dir=/tmp/x", "optim.lr_scale={language_model: 0.1}", *extra])

    saved = recipe()
    opt = build_optimizer(Towers(), saved.optim)
    scheduler = build_scheduler(opt, 100, saved.optim, saved.schedule)
    for _ in range(30):
        opt.step()
        scheduler.step()
    state = {"scheduler": scheduler.state_dict(),
             "recipe": {"optim": {"lr": saved.optim.lr, "min_lr": saved.optim.min_lr,
                                  "lr_scale": {"language_model": 0.1}},
                        "schedule": {"warmup_ratio": saved.schedule.warmup_ratio, "decay": saved.schedule.decay}}}
    for extra in ([], ["schedule.allow_change=true"]):  # a group's scale cannot follow a new recipe: refused either way
        with pytest.raises(ValueError, match=r"^optim.lr_scale: the checkpoint step_30 was trained with"):
            resume_schedule(scheduler, opt, state, recipe("optim.lr_scale={language_model: 0.5}", *extra),
                            tmp_path / "step_30")
    # With allow_change a new optim.lr keeps each group's scale (times the schedule's factor at step 30).
    new = recipe("lr=2e-3", "schedule.allow_change=true")
    resume_schedule(scheduler, opt, state, new, tmp_path / "step_30")
    factor = lr_at(30, 100, 1.0, saved.optim.min_lr / saved.optim.lr, saved.schedule.warmup_ratio,
                   saved.schedule.decay)
    assert sorted(g["lr"] for g in opt.param_groups) == pytest.approx(sorted(
        2e-3 * factor * g["lr_scale"] for g in opt.param_groups))
    assert {g["lr_scale"] for g in opt.param_groups} == {0.1, 1.0}


def test_a_frozen_or_unknown_module_is_one_line():
    model = Towers()
    for p in model.visual.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match=r"optim.lr_scale.visual: the model has no trainable 'visual'"):
        build_optimizer(model, OptimSection(lr=1e-3, lr_scale={"visual": 0.5}))
    for bad, message in (("{vision: 0.1}", "unknown module 'vision'"), ("{language_model: 0}", "must be a number > 0")):
        with pytest.raises(ValueError, match="optim.lr_scale") as err:
            load_recipe("tiny/multitask", ["output_dir=/tmp/x", f"optim.lr_scale={bad}"])
        assert message in str(err.value) and "\n" not in str(err.value)
