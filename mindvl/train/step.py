"""One optimizer step: stream this rank's micro-batches, accumulate gradients, normalise, clip, step.

    micro = MicroBatchStream(batches.next, accum, device)            # holds at most `window` packs at a time
    result = optimizer_step(model, optimizer, micro, env, config, trainable, grad_clip, accumulation)

The trainer and the planner (mindvl.plan) both run exactly this function; the planner on fake tensors.

No device reads in forward and backward: the stream builds each pack's `PackLayout` (offsets, grids, vision-pad
and loss-target counts, as host ints; `batch_layout`) from the host copy before it moves, and the batch carries it
as `batch["layout"]`; the model takes every shape from it, and the labelled count and FLOPs come from it too. Only
the loss sum and gradient norm come back, once per optimizer step. Batches without a layout (tests, the planner)
are read as before.

Streaming: a pack is fetched (and, on accelerators, copied from pinned host memory with a non-blocking copy that
overlaps the previous micro-batch's compute) only `window - 1` micro-batches ahead, so a step of 128 micro-batches
keeps 2 packs resident, not 128.

Loss normalisation (paper: the mean over every labelled token of the global batch) without holding the step's packs:
each micro-batch backpropagates `loss_sum * fsdp_size` (the layout's data shards x context ranks: FSDP averages
over them; the factor turns that average back into a sum), the labelled-target counts of the packs
(their metadata, counted once as each pack arrives) are all-reduced once after the last forward, and the
accumulated gradients are multiplied by 1 / N_global before clipping. By linearity this is exactly d(sum of every
loss_sum)/N_global, whatever the split of tokens between micro-batches and ranks (the reference test compares it
with one joined batch). Under context parallelism the ranks of a group share each pack: `shard_labels` keeps on
each only the labels its chunk predicts, so loss sums and labelled counts add up over the group to the pack's own;
real tokens and FLOPs (counted per pack) are divided by the group size.

Gradient accumulation under FSDP (`parallel.grad_accumulation`):
- `sharded` (default): every micro-batch's backward reduce-scatters its gradients into the sharded float32
  gradients. Per-rank gradient memory is 1/N of the model; communication is one reduce-scatter per micro-batch.
- `unsharded`: gradient sync is switched off until the last micro-batch, so every rank keeps unsharded float32
  gradients of the whole model between micro-batches (8.9B trainable parameters: 36 GB per device) and
  reduce-scatters once per step. Less communication, far more memory; the planner prints both.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from mindvl.models.config import MindVLConfig
from mindvl.models.host import PackLayout
from mindvl.models.loss import IGNORE_INDEX, next_token_targets
from mindvl.models.mllm import pack_layout

from .context_parallel import shard_labels
from .metrics import MODULE_ORDER, pack_training_flops
from .optim import clip_grad_norm
from .parallel import ParallelEnv, all_reduce_sum

ACCUMULATION_MODES = ("sharded", "unsharded")


def labelled_targets(batch: dict) -> int:
    """How many tokens of this packed row the loss counts (targets after the per-sample shift): the layout's host
    count when the batch carries one, else counted from its tensors."""
    layout = batch.get("layout")
    if layout is not None and layout.num_targets is not None:
        return layout.num_targets
    return int((next_token_targets(batch["labels"], batch["cu_seqlens"]) != IGNORE_INDEX).sum())


def batch_layout(config: MindVLConfig) -> Callable[[dict], PackLayout]:
    """For `MicroBatchStream(layout=...)`: a host batch -> its `PackLayout` under this model's config."""
    return lambda b: pack_layout(config, b["input_ids"], b["cu_seqlens"], b.get("image_grid_thw"), b.get("labels"))


def to_device(batch: dict, device: torch.device, pin: bool = False) -> dict:
    """The pack's tensors on `device`; `pin` copies through page-locked host memory so the copy is asynchronous."""
    if device.type == "cpu":
        return batch
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v):
            v = v.pin_memory() if pin and not v.is_pinned() else v
            v = v.to(device, non_blocking=True)
        out[k] = v
    return out


class MicroBatchStream:
    """`count` micro-batches (model input dicts on `device`) fetched lazily, at most `window` packs resident.

    `fetch()` returns a `mindvl.data.Pack` (or an input dict). Counters (`real_tokens`, `data_s`) accumulate as the
    stream is consumed; iterate it once. `layout` (`batch_layout(config)`) describes each host batch before its
    copy; the batch then carries the description as `batch["layout"]` (see the module docstring)."""

    def __init__(self, fetch: Callable[[], object], count: int, device: torch.device, window: int = 2,
                 agree: Callable[[str | None], str | None] | None = None,
                 layout: Callable[[dict], PackLayout] | None = None):
        if window < 1:
            raise ValueError(f"prefetch window must be >= 1, got {window}")
        self.fetch, self.count, self.device, self.window = fetch, count, device, window
        # `agree` (a collective, e.g. train.agree.agreed_error): a data error on one rank becomes the same error on
        # every rank at the same fetch, instead of one rank raising while the others wait in the next collective.
        # Every rank fetches at the same points (same count and window), so the calls line up.
        self.agree = agree
        self.layout = layout
        self.real_tokens = 0
        self.data_s = 0.0

    def _next(self) -> dict:
        t0 = time.perf_counter()
        if self.agree is None:
            pack = self.fetch()
        else:
            problem = None
            try:
                pack = self.fetch()
            except (ValueError, OSError) as exc:
                problem = f"data error: {exc}"
            problem = self.agree(problem)
            if problem is not None:
                raise ValueError(problem)
        if isinstance(pack, dict):
            batch, real = pack, int(pack["input_ids"].numel())
        else:
            batch, real = pack.to_torch(), pack.num_real_tokens
        self.real_tokens += real
        described = self.layout(batch) if self.layout is not None and "layout" not in batch else None
        batch = to_device(batch, self.device, pin=self.device.type != "cpu")
        if described is not None:
            batch = {**batch, "layout": described}
        self.data_s += time.perf_counter() - t0
        return batch

    def __iter__(self) -> Iterator[dict]:
        ahead: deque[dict] = deque()
        fetched = 0
        while fetched < self.count or ahead:
            # Refill before yielding: the next pack's host->device copy overlaps this micro-batch's compute.
            while fetched < self.count and len(ahead) < self.window:
                ahead.append(self._next())
                fetched += 1
            yield ahead.popleft()

    def __len__(self) -> int:
        return self.count


@dataclass
class StepStats:
    counts: torch.Tensor  # float64 [3]: labelled targets, real tokens, training FLOPs; summed over ranks
    loss_sum_t: torch.Tensor  # summed loss over every labelled token of the global batch (0-d tensor)
    forward_s: float
    backward_s: float
    data_s: float = 0.0
    grad_norm_t: torch.Tensor | None = None  # total gradient norm before clipping
    optimizer_s: float = 0.0
    updated: bool = True  # False: the step was skipped (StepHooks.allow_update)

    @property
    def loss_sum(self) -> float:
        return float(self.loss_sum_t.cpu())

    @property
    def grad_norm(self) -> float | None:
        if self.grad_norm_t is None:
            return None
        gn = self.grad_norm_t
        return float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)


def accumulate_gradients(model, micro: Iterable[dict], env: ParallelEnv, config: MindVLConfig,
                         real_tokens: int | None = None, trainable: Sequence[str] = MODULE_ORDER,
                         accumulation: str = "sharded") -> StepStats:
    """Forward/backward over this rank's micro-batches (a list or a `MicroBatchStream`); leaves
    grad = d(global loss sum)/N_global in `.grad` (see the module docstring)."""
    if accumulation not in ACCUMULATION_MODES:
        raise ValueError(f"parallel.grad_accumulation: {accumulation!r} is not one of {ACCUMULATION_MODES}")
    n_micro = len(micro) if hasattr(micro, "__len__") else None
    labelled = flops = 0.0
    counted_tokens = 0
    loss_total = torch.zeros((), dtype=torch.float64, device=env.device)
    t_fwd = t_bwd = 0.0
    sync_each = accumulation == "sharded"
    cp = env.layout.cp  # ranks sharing each pack (context parallelism): per-pack counts are split over them
    for i, batch in enumerate(micro):
        n = labelled_targets(batch)  # labels are metadata: counted as the pack arrives, before its forward
        flops += pack_training_flops(config, batch, n, trainable) / cp
        if cp > 1:
            batch = shard_labels(batch, cp, env.layout.cp_rank)
            if batch.get("layout") is not None:  # it counts the whole pack's targets; this rank keeps its share
                batch = {**batch, "layout": dataclasses.replace(batch["layout"], num_targets=None)}
            n = labelled_targets(batch)  # this rank's share, counted on its labels (the layout no longer counts)
        labelled += n
        counted_tokens += int(batch["input_ids"].numel())
        if env.distributed and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(sync_each or (n_micro is not None and i == n_micro - 1))
        ta = time.perf_counter()
        loss_sum, _ = model(**batch)
        tb = time.perf_counter()
        (loss_sum * env.layout.fsdp_size).backward()
        t_fwd += tb - ta
        t_bwd += time.perf_counter() - tb
        loss_total += loss_sum.detach().double()
    if real_tokens is None:  # padding (data.pad_to_seq_len) is not throughput; a stream counts real tokens itself
        real_tokens = getattr(micro, "real_tokens", counted_tokens) / cp
    counts = torch.tensor([labelled, real_tokens, flops], dtype=torch.float64)
    # The ranks of a tensor-parallel group hold the same packs (and the same loss): counted once.
    if env.distributed:  # host counts of every rank summed on the device; one process keeps them on the host
        counts = all_reduce_sum(counts.to(env.device), env).cpu()
    counts = counts / env.layout.tp
    scale = 1.0 / max(1.0, float(counts[0]))
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(scale)
    loss_total = all_reduce_sum(loss_total, env) / env.layout.tp
    return StepStats(counts, loss_total, t_fwd, t_bwd, data_s=getattr(micro, "data_s", 0.0))


@dataclass
class StepHooks:
    """What the trainer adds around the update (the planner runs the step without them)."""

    agree: Callable[[str | None], str | None] | None = None  # for the MicroBatchStream: agreed data errors
    after_backward: Callable[[list[torch.Tensor]], None] | None = None  # gradients complete (e.g. fault injection)
    allow_update: Callable[[StepStats], bool] | None = None  # after the norm; False skips the update (bad step)


def optimizer_step(model, optimizer: torch.optim.Optimizer, micro: Iterable[dict], env: ParallelEnv,
                   config: MindVLConfig, trainable: Sequence[str] = MODULE_ORDER, grad_clip: float | None = None,
                   accumulation: str = "sharded", hooks: StepHooks | None = None) -> StepStats:
    """accumulate_gradients, then the global gradient norm (clipped to `grad_clip` when given), AdamW step unless
    `hooks.allow_update` says no, zero the gradients. `stats.updated` says whether the weights changed."""
    hooks = hooks or StepHooks()
    stats = accumulate_gradients(model, micro, env, config, None, trainable, accumulation)
    tc = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    if hooks.after_backward is not None:
        hooks.after_backward(params)
    stats.grad_norm_t = clip_grad_norm(params, grad_clip)
    stats.updated = hooks.allow_update(stats) if hooks.allow_update is not None else True
    if stats.updated:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    stats.optimizer_s = time.perf_counter() - tc
    return stats
