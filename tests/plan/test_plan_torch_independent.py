"""The planner's optimizer memory is the device kernel's, whatever torch's fake kernels and DTensor do around it.

On the H200 proof (tests/plan/data/proof_h200.json) the planner under torch 2.11 counted 24 bytes of AdamW state per
parameter where fused AdamW holds 8 (two fp32 moments): allocations made while the fused kernel ran on fake tensors
(DTensor's sharding propagation builds fake copies of every argument) were counted as optimizer state. These tests
plant such allocations two ways and expect the plan not to move; each also checks, with the guard
(plan.simulate.device_optimizer_memory) switched off, that what it plants does inflate the plan, so the test can
fail.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from test_plan import ARCH

from mindvl.config import load_recipe
from mindvl.plan import fake as fake_module
from mindvl.plan import get_device, plan, simulate


def small_recipe(tmp_path):
    """The reduced model (0.24M parameters) on 64-token packs with one small image: its activations are small enough
    that what a plant allocates in the optimizer step moves the peak there."""
    raw = {"output_dir": str(tmp_path / "out"), "model": {"arch": ARCH},
           "data": {"sources": [{"synth": {"tasks": ["ocr"], "n": 8}}], "seq_len": 64, "max_pixels": 4 * 28 * 28,
                    "min_pixels": 4 * 28 * 28, "synth_cache": str(tmp_path / "cache")},
           "phase": {"name": "multitask"}, "batch": {"global_batch_size": 1}, "budget": {"max_steps": 1},
           "parallel": {"activation_checkpointing": True}}
    return load_recipe(raw=raw)


def _plan(tmp_path):
    r = _plan_result(tmp_path)
    return r.peak_bytes_per_rank, r.breakdown, r.params["trainable"]


def _plan_result(tmp_path):
    # DTensor caches its sharding propagation per op and shapes (in Python and in its C++ fast path), across plans
    # in one process: start from none, so each plan propagates its optimizer step afresh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    for attr in vars(ShardingPropagator).values():
        if hasattr(attr, "cache_clear"):
            attr.cache_clear()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    if hasattr(torch._C, "_clear_DTensor_sharding_propagator_cache"):
        torch._C._clear_DTensor_sharding_propagator_cache()
    return plan(small_recipe(tmp_path), 1, get_device("h100-80g"))


@pytest.fixture(scope="module")
def unplanted(tmp_path_factory):
    """The plan with nothing planted (computed once, before any test plants anything): what every planted plan must
    equal."""
    return _plan_result(tmp_path_factory.mktemp("unplanted"))


@contextlib.contextmanager
def out_of_place_fused_adamw():
    """A kernel of aten::_fused_adamw_ that allocates copies of parameters, gradients and both moments (16 bytes per
    fp32 parameter), as an out-of-place fake kernel does, before running the real in-place one: registered on the
    dispatcher's AutogradCPU key, so every call of the op (plain tensors or FSDP2's DTensors) goes through it."""
    lib = torch.library.Library("aten", "IMPL")

    def kernel(params, grads, exp_avgs, exp_avg_sqs, *rest, **kwargs):
        local = [getattr(t, "_local_tensor", t) for t in (*params, *grads, *exp_avgs, *exp_avg_sqs)]
        copies = [torch.empty_like(t) for t in local]  # noqa: F841  (alive until the kernel returns)
        with torch._C._AutoDispatchBelowAutograd():
            torch.ops.aten._fused_adamw_.default(params, grads, exp_avgs, exp_avg_sqs, *rest, **kwargs)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
        lib.impl("_fused_adamw_", kernel, "AutogradCPU")
    try:
        yield
    finally:
        lib._destroy()  # the original kernel is back


def unguarded(monkeypatch) -> None:
    monkeypatch.setattr(simulate, "device_optimizer_memory", lambda tracker: contextlib.nullcontext())


def test_an_out_of_place_optimizer_kernel_leaves_the_plan_unchanged(tmp_path, monkeypatch, unplanted):
    peak, breakdown, trainable = unplanted.peak_bytes_per_rank, unplanted.breakdown, unplanted.params["trainable"]
    assert breakdown["optimizer_state"] == pytest.approx(8 * trainable, rel=0.01)  # two fp32 moments
    with out_of_place_fused_adamw():
        planted_peak, planted, _ = _plan(tmp_path)
        assert (planted_peak, planted) == (peak, breakdown)
        unguarded(monkeypatch)
        inflated_peak, inflated, _ = _plan(tmp_path)
    # the plant is real: without the guard the tracker counts its copies as optimizer state, 24 bytes per parameter
    assert inflated["optimizer_state"] == pytest.approx(24 * trainable, rel=0.01) and inflated_peak > peak


def test_sharding_propagation_under_the_trace_fake_mode_leaves_the_plan_unchanged(tmp_path, monkeypatch, unplanted):
    """DTensor's sharding propagation run under the trace's own fake mode (the planner's private mode for it not
    taking effect, as the module-level patch cannot where a torch looks the mode up elsewhere): its fake copies of
    every fused-AdamW argument go through the tracker."""
    peak, breakdown = unplanted.peak_bytes_per_rank, unplanted.breakdown
    monkeypatch.setattr(fake_module, "_dtensor_own_fake_mode", contextlib.nullcontext)
    assert _plan(tmp_path)[:2] == (peak, breakdown)
    unguarded(monkeypatch)
    inflated_peak, inflated, _ = _plan(tmp_path)
    assert inflated["optimizer_state"] > 1.5 * breakdown["optimizer_state"] and inflated_peak > peak


def test_the_report_names_its_torch(unplanted):
    from mindvl.plan import format_report

    r = unplanted
    assert r.torch_version == torch.__version__ and r.to_dict()["torch"] == torch.__version__
    assert f"traced with torch {torch.__version__}" in format_report(r)
