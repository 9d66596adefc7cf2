"""Trace one rank's memory through the trainer's real optimizer step on a simulated cluster.

    traced = trace_step(recipe, config, world_size, packs)

What runs is what training runs: `MindVL` built on the meta device, `parallel.prepare_model` (the phase, activation
checkpointing, expert parallelism, FSDP2 over the layout's meshes of `world_size` ranks on torch's fake backend),
AdamW from `optim.build_optimizer`, and `step.optimizer_step` (streamed micro-batches, loss normalisation,
clipping, AdamW) on fake packs. Parameters and activations are fake CPU tensors in the accelerator's dtypes (fp32
master weights and optimizer state, bf16 compute under FSDP's policy, fp32 gradient reductions); attention is
torch's SDPA with V padded to Q's head size when they differ (`fused_attention_memory`), whose memory (outputs +
logsumexp) is that of the flash kernels used on accelerators. FSDP2's memory tracker
(torch.distributed._tools.fsdp2_mem_tracker) records the rank's peak and what was alive at that moment.

Two optimizer steps run: the first with one micro-batch (it allocates AdamW's state), the second with two (so
accumulation across micro-batches is part of the trace); the peak is the maximum over both.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

from mindvl.config import Recipe
from mindvl.models import MindVL, MindVLConfig
from mindvl.models import loss as loss_module
from mindvl.progress import Progress
from mindvl.train.optim import build_optimizer
from mindvl.train.parallel import ParallelEnv, ParallelLayout, Prepared, prepare_model
from mindvl.train.step import MicroBatchStream, optimizer_step

from .estimate import Counts, param_counts
from .fake import MetadataGateway, fake_world
from .packs import PackShape, fake_pack

# Tracker categories -> the planner's breakdown (loss/logits temporaries are split out of activations, below).
# What a rank owns (its fp32 shards: they scale as 1/W) is kept apart from what FSDP materialises for the blocks in
# flight (bf16 all-gathered weights and their all-gather buffers; unsharded gradients and reduce-scatter buffers):
# the latter depend on the largest blocks and on prefetching, not on W.
_PARTS = {
    _FSDPRefType.SHARDED_PARAM: "parameters", _FSDPRefType.BUFFER: "parameters",
    _FSDPRefType.UNSHARDED_PARAM: "unsharded_parameters", _FSDPRefType.ALL_GATHER: "unsharded_parameters",
    _FSDPRefType.SHARDED_GRAD: "gradients",
    _FSDPRefType.UNSHARDED_GRAD: "unsharded_gradients", _FSDPRefType.REDUCE_SCATTER: "unsharded_gradients",
    _FSDPRefType.OPT: "optimizer_state",
    _FSDPRefType.ACT: "activations", _FSDPRefType.TEMP: "activations",
    _FSDPRefType.INP: "data_buffers",
}
PARTS = ("parameters", "unsharded_parameters", "gradients", "unsharded_gradients", "optimizer_state", "activations",
         "loss_temporaries", "data_buffers")


@dataclass
class Traced:
    peak_bytes: int
    breakdown: dict[str, int]
    wall_s: float
    micro_batches_traced: int
    sharded_bytes: int = 0  # of the peak: sharded parameters, gradients and optimizer state (they scale as 1/N)
    notes: list[str] = field(default_factory=list)
    counts: Counts | None = None  # parameters of the prepared model (global shapes: what the estimates count)
    prepared: Prepared | None = None  # what prepare_model did (the phase's trainable counts, checkpointing mode)


class PlanTracker(FSDPMemTracker):
    """FSDPMemTracker that also notes whether its peak fell inside the loss head, and how much the head added, and
    that counts nothing allocated inside an `untracked()` region (device_optimizer_memory)."""

    def __init__(self, mod, optm=None):
        super().__init__(mod, optm)
        self.in_loss = False
        self.loss_base = 0
        self.peak_loss_bytes = 0
        self.untracked_depth = 0
        self.fused_kernel_calls = 0

    @contextlib.contextmanager
    def untracked(self) -> Iterator[None]:
        self.untracked_depth += 1
        try:
            yield
        finally:
            self.untracked_depth -= 1

    def _track(self, reftype, t) -> None:
        # every op's outputs come through here (torch's __torch_dispatch__); parameters, gradients, optimizer
        # state and inputs are registered through _update_and_maybe_create_winfos, which this does not skip
        if not self.untracked_depth:
            super()._track(reftype, t)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing=False):
        # Under tensor parallelism FSDP's post-backward may hold a gradient the tracker never saw allocated (made
        # inside a DTensor collective, outside its dispatch mode); torch raises KeyError there: track it from here.
        try:
            return super()._update_and_maybe_create_winfos(t, reftype, update_existing)
        except KeyError:
            return super()._update_and_maybe_create_winfos(t, reftype, False)

    def track_plain_params(self) -> None:
        """Parameters FSDP does not manage (QLoRA's base weights, `ignored_params`: plain tensors, not DTensors) are
        tracked as the rank's parameters: the tracker would otherwise first meet them through a view in a forward
        (F.linear's transpose) and count their storage as activations."""
        from torch.distributed.tensor import DTensor

        for p in self._root_mod.parameters():
            if not isinstance(p, DTensor):
                self._update_and_maybe_create_winfos(p, _FSDPRefType.SHARDED_PARAM)

    def current_total(self) -> int:
        return sum(snap["Total"] for snap in self.get_tracker_snapshot("current").values())

    def _update_peak_stats(self, peak_state) -> None:
        before = dict(self._peak_mem)
        super()._update_peak_stats(peak_state)
        if self._peak_mem != before:
            now = sum(self._peak_mem.values())
            self.peak_loss_bytes = max(0, now - self.loss_base) if self.in_loss else 0


@contextlib.contextmanager
def loss_region(tracker: PlanTracker) -> Iterator[None]:
    """Mark the chunked loss head's forward and backward so its temporaries are reported as their own part."""
    from mindvl.train.tensor_parallel import _VocabParallelCE

    fns = (loss_module.ChunkedLinearCrossEntropy, _VocabParallelCE)  # one process / the vocabulary-parallel loss
    saved = [(fn.forward, fn.backward) for fn in fns]

    def wrap(inner):
        def run(ctx, *args):
            tracker.in_loss, tracker.loss_base = True, tracker.current_total()
            try:
                return inner(ctx, *args)
            finally:
                tracker.in_loss = False
        return staticmethod(run)

    for fn, (fwd, bwd) in zip(fns, saved, strict=True):
        fn.forward, fn.backward = wrap(fwd), wrap(bwd)
    try:
        yield
    finally:
        for fn, (fwd, bwd) in zip(fns, saved, strict=True):
            fn.forward, fn.backward = staticmethod(fwd), staticmethod(bwd)


# The optimizer kernels the trainer's AdamW calls on an accelerator (optim.build_optimizer: fused where the device
# has it; CUDA's and the NPU's are in place): torch.optim looks them up on `torch` at every step.
FUSED_OPTIMIZER_KERNELS = ("_fused_adamw_", "_fused_adam_")


@contextlib.contextmanager
def device_optimizer_memory(tracker: PlanTracker) -> Iterator[None]:
    """The optimizer step with the memory of the device's fused kernel, whatever torch's fake kernels do.

    On the device, fused AdamW updates parameters and its two fp32 moments in place: its step holds the state AdamW
    creates (exp_avg, exp_avg_sq: zeros_like of each parameter shard, and a step counter), allocated before the
    kernel and tracked as optimizer state, and nothing more. Under fake tensors the kernel's call can allocate what no
    device allocates: DTensor's sharding propagation builds fake copies of every argument (parameters, gradients,
    both moments) at their global shape, and a torch whose fake or decomposed kernel works out of place allocates
    copies too. Torch 2.11's planner counted those as optimizer state: 24 bytes per parameter instead of 8 (the H200
    proof, ../shared/measurements/2026-11-28-h200; tests/plan/test_plan_torch_independent.py plants both). So
    nothing allocated inside a fused optimizer kernel's call, nor inside DTensor's sharding propagation anywhere in
    the step (it derives shapes; the local op on the shards is what runs), is counted."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    kernels = {name: getattr(torch, name) for name in FUSED_OPTIMIZER_KERNELS if hasattr(torch, name)}

    def guarded(kernel):
        def run(*args, **kwargs):
            tracker.fused_kernel_calls += 1
            with tracker.untracked():
                return kernel(*args, **kwargs)
        return run

    # torch >= 2.6 splits the cached and uncached propagation; the uncached one is what runs under fake tensors
    name = next(n for n in ("_propagate_tensor_meta_non_cached", "_propagate_tensor_meta")
                if hasattr(ShardingPropagator, n))
    propagate = getattr(ShardingPropagator, name)

    def propagate_untracked(self, *args, **kwargs):
        with tracker.untracked():
            return propagate(self, *args, **kwargs)

    for kernel_name, kernel in kernels.items():
        setattr(torch, kernel_name, guarded(kernel))
    setattr(ShardingPropagator, name, propagate_untracked)
    try:
        yield
    finally:
        setattr(ShardingPropagator, name, propagate)
        for kernel_name, kernel in kernels.items():
            setattr(torch, kernel_name, kernel)


@contextlib.contextmanager
def fused_attention_memory() -> Iterator[None]:
    """Attention traced with the memory of the accelerator kernels the trainer runs (flash on CUDA, the fused NPU
    kernel on Ascend), which take one head size: when V's head size differs from Q/K's (MLA: 128 vs 192), pad V
    with zeros and slice the output, as `models.attention`'s flash and npu backends do. Without it torch's CPU sdpa
    falls back to its math path for MLA and materialises fp32 [heads, L, L] scores (4 GiB per 4096-token sequence
    at DeepSeek-V3's 128 heads), which no accelerator run holds."""
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def padded(q, k, v, *args, **kwargs):
        dv = v.shape[-1]
        if dv == q.shape[-1]:
            return sdpa(q, k, v, *args, **kwargs)
        return sdpa(q, k, F.pad(v, (0, q.shape[-1] - dv)), *args, **kwargs)[..., :dv]

    F.scaled_dot_product_attention = padded
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


class TrackedStream(MicroBatchStream):
    """The trainer's stream; the tracker's module stats are reset before each micro-batch (they hold one
    forward/backward at a time; the peak is kept across resets)."""

    def __init__(self, fetch, count, device, window, tracker: PlanTracker, on_batch=None):
        super().__init__(fetch, count, device, window)
        self.tracker, self.on_batch = tracker, on_batch

    def __iter__(self):
        for batch in super().__iter__():
            self.tracker.reset_mod_stats()
            if self.on_batch is not None:
                self.on_batch()
            yield batch


def plan_parallel(recipe: Recipe):
    """The recipe's parallel section as it runs on an accelerator: bf16 compute when `auto`, no compile (the
    planner traces eager memory; compile changes speed, not what is resident between ops), FSDP on (its memory
    tracker follows FSDP modules: a single process, which the trainer runs as plain tensors under bf16 autocast,
    is traced as FSDP over one rank, the layout it ran before; the two hold the same fp32 weights, gradients and
    optimizer state)."""
    cfg = copy.deepcopy(recipe.parallel)
    if cfg.mixed_precision == "auto":
        cfg.mixed_precision = "bf16"
    if cfg.fsdp == "auto" or cfg.mixed_precision == "bf16":
        cfg.fsdp = "on"
    cfg.compile = False
    cfg.device = "cpu"
    return cfg


def trace_step(recipe: Recipe, config: MindVLConfig, world_size: int, packs: list[PackShape],
               micro_batches: tuple[int, ...] = (1, 2), window: int = 2) -> Traced:
    """Peak memory of rank 0 of `world_size` over optimizer steps of `micro_batches` micro-batches each."""
    t0 = time.perf_counter()
    pcfg = plan_parallel(recipe)
    env = ParallelEnv(0, world_size, 0, torch.device("cpu"), "fake", ParallelLayout.from_config(pcfg, world_size))
    prepared = Prepared()
    # Minutes at 8B on a CPU: progress in micro-batches, each advanced by the forward through its blocks.
    bar = TraceProgress(sum(micro_batches), f"plan: building the model on a fake {world_size}-rank world")
    with fake_world(world_size) as world:
        with torch.device("meta"):
            model = MindVL(config)
        model.set_attention_backend("sdpa")
        model = prepare_model(model, dataclasses.replace(recipe, parallel=pcfg), env, prepared)
        counts = param_counts(model)  # DTensor parameters count their global shapes
        world.materialize(model)
        model.train()
        optimizer = build_optimizer(model, recipe.optim)
        tracker = PlanTracker(model, optimizer)
        hooks = bar.hook_blocks(model)
        order = iter(range(10**9))

        def fetch() -> dict:
            batch = fake_pack(packs[next(order) % len(packs)], config, world.fake)
            tracker.track_inputs((batch["pixel_values"],))
            return batch

        with world.mode, tracker, loss_region(tracker), fused_attention_memory(), device_optimizer_memory(tracker), \
                MetadataGateway():
            tracker.track_plain_params()
            for step, n in enumerate(micro_batches, start=1):
                bar.step = f"plan: step {step}/{len(micro_batches)}"
                stream = TrackedStream(fetch, n, torch.device("cpu"), window, tracker, bar.micro_batch)
                optimizer_step(model, optimizer, stream, env, config, recipe.trainable_modules,
                               recipe.optim.grad_clip, pcfg.grad_accumulation)
                bar.update(bar.started, desc=f"{bar.step} traced")
        for h in hooks:
            h.remove()
    bar.close()
    peak, breakdown = peak_breakdown(tracker)
    notes = []
    if any(g.get("fused") for g in optimizer.param_groups) and not tracker.fused_kernel_calls:
        notes.append(f"optimizer state as torch {torch.__version__}'s fake kernels allocate it: its fused AdamW never "
                     f"called torch.{'/'.join(FUSED_OPTIMIZER_KERNELS)} (the device kernel's accounting, "
                     f"plan.simulate.device_optimizer_memory, does not know this torch)")
    sharded = sum(v for snap in tracker.get_tracker_snapshot("peak").values() for k, v in snap.items()
                  if k in (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT))
    return Traced(peak, breakdown, time.perf_counter() - t0, sum(micro_batches), sharded, notes, counts=counts,
                  prepared=prepared)


class TraceProgress(Progress):
    """The trace's progress in micro-batches: each one moves through half a unit over the forward of its blocks
    (vision blocks, decoder layers; a recomputation under activation checkpointing never moves it back), the
    backward is the other half."""

    def __init__(self, total: int, desc: str):
        super().__init__(desc, total=total, unit="micro-batches traced")
        self.step, self.started = "plan", 0
        self.start()

    def micro_batch(self) -> None:
        self.started += 1
        self.update(self.started - 1, desc=f"{self.step}, micro-batch {self.started}")

    def hook_blocks(self, model: torch.nn.Module) -> list:
        blocks = [b for m in model.modules() if isinstance(m, torch.nn.ModuleList) for b in m
                  if not isinstance(b, torch.nn.ModuleList) and any(True for _ in b.parameters())]

        def hook(index: int):
            def pre(module, args):
                done = max(self.done, self.started - 1 + 0.5 * (index + 1) / len(blocks))
                self.update(done, desc=f"{self.step}, micro-batch {self.started}: forward block "
                                       f"{index + 1}/{len(blocks)}")
            return pre

        return [b.register_forward_pre_hook(hook(i)) for i, b in enumerate(blocks)]


def peak_breakdown(tracker: PlanTracker) -> tuple[int, dict[str, int]]:
    """(peak bytes, the planner's parts at that moment) from a tracker that has run."""
    breakdown = dict.fromkeys(PARTS, 0)
    peak = 0
    for dev_snap in tracker.get_tracker_snapshot("peak").values():
        for key, value in dev_snap.items():
            if key == "Total":
                peak += value
            else:
                breakdown[_PARTS[key]] += value
    loss = min(tracker.peak_loss_bytes, breakdown["activations"])
    breakdown["activations"] -= loss
    breakdown["loss_temporaries"] = loss
    return peak, breakdown
