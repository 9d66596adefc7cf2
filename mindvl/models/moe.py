"""DeepSeek-MoE: the router, the routed experts and the MoE MLP that the decoder (text.py) uses in its MoE layers.

Numerics follow transformers' DeepseekV3ForCausalLM (5.23; shared/reference/model-numerics.md §4):

- Routing (fp32): sigmoid scores; `e_score_correction_bias` is added only to CHOOSE experts; groups are scored by
  the sum of their top-2 biased scores, all but `topk_group` groups are masked with -inf (transformers >= 5.8),
  then top-k; the weights are the UNBIASED scores of the chosen experts, optionally normalised to sum 1, times
  `routed_scaling_factor`. Shared experts are one SwiGLU of width moe_intermediate_size * n_shared_experts.
- Layers [0, first_k_dense_replace) use a dense SwiGLU MLP of width intermediate_size (text.mlp_for).

FSDP2 wraps each decoder layer, so a block's experts are sharded with it. Routed experts are stored as three
[E, ...] tensors (transformers >= 5's in-memory form; conversion to and from the hub's per-expert tensors lives in
mindvl.checkpoint). Because every expert of a layer is a slice of the same parameter, all expert weights get a
gradient (zeros for idle experts) every step, so FSDP's reduce-scatters stay identical across ranks however the
tokens are routed.

Auxiliary-loss-free load balancing (DeepSeek-V3 §2.1.2): in training mode each router counts the tokens it sends
to every expert (`expert_load`, an int64 non-persistent buffer: not a parameter, not in checkpoints). The trainer
calls `update_router_bias(model, rate, all_reduce)` after each optimizer step: the counts are summed over ranks (the
optional `all_reduce` callable, e.g. `torch.distributed.all_reduce`; the model never imports torch.distributed),
then `bias += rate * sign(mean_load - load)` and the counts reset. The update depends only on the SIGN of each
expert's deviation, so counting every token twice (activation checkpointing re-runs the forward in backward)
changes nothing. The correction bias is kept in float32 however the model is cast, as transformers does.

Tracing: `with record_routing(model) as routers:` makes every router keep, per forward, its top-k expert ids and
routing weights in descending weight order (`router.records`); mindvl.moe_analysis.trace reads them.

Experts run as grouped GEMMs (`F.grouped_mm`, or an exact `unbind(0)` fallback where it cannot run); their
`dispatcher` (a no-op here) is where expert parallelism plugs in from outside (mindvl.train.expert_parallel). Not
here: multi-token prediction.

The grouped path never reads the device back to the host (the fallback must: `counts.tolist()` splits its rows):
the permutation of (token, slot) rows, the group sizes and the offsets are device tensors of sizes known from the
shapes alone. Each expert's group starts at a multiple of `GROUP_ALIGN` rows (zero rows pad it; the last group also
takes the slack up to a size fixed by the shapes), as the grouped GEMM's fast kernels want: in the weight-gradient
GEMM the groups split the contraction dimension, whose starts must be 16-byte aligned, and whole row tiles keep the
forward's groups apart. Rows are gathered with `index_select` (its backward is one `index_add`, not the sort that
advanced indexing's `index_put` backward runs on CUDA).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from .config import TextConfig
from .layers import GatedMLP, activation, autocast_dtype, autocast_off

# ------------------------------------------------------------------------------------------------------- MoE


class TopKRouter(nn.Module):
    """Sigmoid router with a selection-only correction bias and group-limited top-k: x [T, H] -> weights, ids [T, k].

    Buffers: `e_score_correction_bias` [E] float32 (persistent: it is part of the model, and of HF checkpoints) and
    `expert_load` [E] int64 (non-persistent: tokens routed to each expert in training forwards since the last
    `update_router_bias`).
    """

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.n_routed_experts, cfg.num_experts_per_tok
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scaling = bool(cfg.norm_topk_prob), float(cfg.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False)
        self.record = False
        self.records: list[tuple[torch.Tensor, torch.Tensor]] = []  # (ids [T, k] int64, weights [T, k] fp32)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) would round the bias (updates of ~1e-3 would vanish): keep it float32, like
        # transformers' _keep_in_fp32_modules_strict. Device moves still apply.
        super()._apply(fn, recurse)
        bias = self.e_score_correction_bias
        if bias.is_floating_point() and bias.dtype != torch.float32:
            self.e_score_correction_bias = bias.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t, e = x.shape[0], self.num_experts
        with autocast_off(x.device.type):  # router in fp32, also under mixed precision
            scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()[None]
        if self.n_group > 1:
            grouped = choice.view(t, self.n_group, e // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            keep = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(t, e)
        ids = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * self.scaling
        self.count_load(ids)
        if self.record:
            with torch.no_grad():
                w, order = weights.detach().sort(dim=-1, descending=True, stable=True)
                self.records.append((ids.gather(1, order), w))
        return weights, ids

    def count_load(self, ids: torch.Tensor) -> None:
        """Tokens routed to each expert during training (the bias balancing and MaxVio read `expert_load`)."""
        if self.training:
            with torch.no_grad():
                flat = ids.reshape(-1)
                self.expert_load.index_add_(0, flat, torch.ones_like(flat))


class SoftmaxTopKRouter(TopKRouter):
    """Qwen3-MoE's router (Qwen3-VL-30B-A3B): softmax over all experts in fp32, top-k, weights renormalised to sum
    1. No groups, no scaling; the correction bias stays zero, unused and out of checkpoints (non-persistent), so
    `update_router_bias` may run on a model of either kind. Load counting is the parent's (`count_load`)."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__(cfg)
        del self.e_score_correction_bias
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.linear(x, self.weight).float().softmax(-1)  # logits in x.dtype, softmax in fp32 (transformers)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        self.count_load(ids)
        if self.record:
            with torch.no_grad():
                self.records.append((ids.detach().clone(), weights.detach().float()))  # already descending
        return weights.to(x.dtype), ids  # transformers weights each expert's output in the activation dtype


def _grouped_mm_runs(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `F.grouped_mm` can run here (else the exact `unbind(0)` fallback is used).

    Its kernels (CPU, and CUDA from sm80 in bf16) need fp32/bf16 operands whose rows are 16-byte aligned (CPU backward
    checks strides), and under FakeTensorMode / torch.compile its meta function accepts bf16 only. Elsewhere (NPU)
    the fallback keeps the cost linear in E.
    """
    if not hasattr(F, "grouped_mm") or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.device.type not in ("cpu", "cuda", "meta"):  # e.g. npu: torch_npu has no grouped_mm kernel registered
        return False
    if any(w.dtype != x.dtype or (w.shape[-1] * w.element_size()) % 16 or (w.shape[-2] * w.element_size()) % 16
           for w in weights):
        return False
    if x.device.type == "cuda" and (x.dtype != torch.bfloat16 or torch.cuda.get_device_capability(x.device)[0] < 8):
        return False
    from torch._subclasses.fake_tensor import is_fake

    if (torch.compiler.is_compiling() or is_fake(x) or x.is_meta) and x.dtype != torch.bfloat16:
        return False
    return True


GROUP_ALIGN = 16  # rows: a group's first row is a multiple of this (16 bytes of bf16 = 8 rows; 16 also fits fp8)


def aligned_groups(counts: torch.Tensor, n_rows: int, align: int = GROUP_ALIGN
                   ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """counts [E] (rows per expert, summing to n_rows) -> (dest [n_rows]: where each row goes in the padded layout,
    offsets [E] int32: the padded groups' end rows, size: the padded layout's rows).

    Group e starts at a multiple of `align`. `size` is a bound fixed by n_rows and E: at most min(E, n_rows) groups
    are not empty, each may need align - 1 pad rows (an empty group needs none), and one more row keeps offsets[-1]
    strictly below it, as grouped_mm's contract asks. So no shape depends on the counts' values on the host, and a
    decode step's few rows over many experts get a layout of a few tiles, not E of them (8 rows over 256 experts:
    144 rows, where a bound of E pad groups made 3,856, each gathered and multiplied through the activation's
    elementwise kernels). The rows from offsets[-1] to `size` belong to no group:
    grouped_mm ignores rows past the last offset (its documented contract), so a batch pays for its own padded
    groups only, not for the bound. (When the last group took that slack, a decode step of a few rows over 256
    experts computed ~3,800 pad rows in one expert.) Their outputs are left unset and never read: the caller keeps
    only `dest` rows."""
    e = counts.shape[0]
    busy = min(e, n_rows)  # groups that can hold a row
    size = -(-(n_rows + busy * (align - 1) + 1) // align) * align  # + 1: offsets[-1] < size, as grouped_mm asks
    padded = (counts + align - 1) // align * align
    pad_ends = padded.cumsum(0)
    ends = counts.cumsum(0)
    rows = torch.arange(n_rows, device=counts.device)
    expert = torch.searchsorted(ends, rows, right=True)  # the expert of each (sorted) row
    dest = rows + (pad_ends - padded - (ends - counts)).index_select(0, expert)
    return dest, pad_ends.to(torch.int32), size


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, counts: list[int] | None,
                   use_grouped_mm: bool) -> torch.Tensor:
    """Rows of x [N, in] grouped by expert (expert e owns rows offsets[e-1]:offsets[e]) times weight [E, out, in]^T.

    -> [N, out]. One grouped GEMM (`F.grouped_mm`, int32 end offsets), or, where it cannot run, one matmul per
    expert over `weight.unbind(0)`: unbinding once gives every expert a view whose gradient lands in ONE [E, ...]
    buffer (indexing `weight[e]` per expert would allocate and zero-fill a full [E, out, in] gradient per expert).
    """
    if use_grouped_mm:
        return F.grouped_mm(x, weight.transpose(1, 2), offs=offsets)
    assert counts is not None
    parts = [F.linear(chunk, w) for chunk, w in zip(x.split(counts), weight.unbind(0), strict=True)]
    return torch.cat(parts) if parts else x.new_zeros(0, weight.shape[1])


class LocalTokenDispatch:
    """Routes (token, slot) rows to the experts held by this process: all of them (the default, no communication).

    Expert parallelism (mindvl.train.expert_parallel) swaps in a dispatcher with the same three methods that sends
    rows to the ranks owning their experts. The model never imports torch.distributed.
    """

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows [N, H] sorted by global expert id, counts [E] int64 -> (rows for the local experts sorted by local
        expert, their per-local-expert counts [E_local])."""
        return rows, counts

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Expert outputs in the order `dispatch` returned -> outputs in the order `dispatch` was given."""
        return out

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """The experts parameter as this process holds it -> a plain [E_local, ...] tensor."""
        return weight


class RoutedExperts(nn.Module):
    """E SwiGLU experts as [E, ...] tensors: gate_proj/up_proj [E, I, H], down_proj [E, H, I].

    forward(x [T, H], ids [T, k], weights [T, k] fp32) -> [T, H] in x.dtype. The T*k (token, slot) rows are sorted by
    expert once (stable: token order within an expert), handed to the dispatcher (a no-op on one process, all-to-all
    under expert parallelism), run through one grouped GEMM per projection and scattered back with one index_add.
    No Python loop over experts and no [T, E, ...] tensor. Accumulation follows transformers 5.x (each row's output is
    weighted in fp32, then cast to x.dtype before it is added).
    """

    def __init__(self, num_experts: int, hidden: int, inner: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts  # global E (under expert parallelism this process holds a slice)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(num_experts, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inner))
        self.act = activation(act)
        self.dispatcher: LocalTokenDispatch = LocalTokenDispatch()
        self.use_grouped_mm = True  # False forces the unbind fallback (benchmarks, tests)

    def experts_forward(self, rows: torch.Tensor, counts: torch.Tensor,
                        tokens: torch.Tensor | None = None) -> torch.Tensor:
        """rows [N, H] grouped by (local) expert with counts [E_local] -> SwiGLU outputs [N, H].

        With `tokens` [N] (one process: no dispatcher in between), `rows` is the layer's input x [T, H] and grouped
        row i is x[tokens[i]]: the grouped path then gathers x straight into its padded layout, with no [N, H] copy
        in between (the planner's per-row bytes, mindvl.plan.skew, are measured on this path)."""
        d = self.dispatcher
        gate, up, down = d.local_weight(self.gate_proj), d.local_weight(self.up_proj), d.local_weight(self.down_proj)
        kind = rows.device.type
        dtype = autocast_dtype(kind)
        if dtype is not None:  # autocast does not cast grouped_mm's operands: the GEMMs' dtype, once
            rows, gate, up, down = (t.to(dtype) for t in (rows, gate, up, down))
        grouped = self.use_grouped_mm and _grouped_mm_runs(rows, gate, up, down)
        if not grouped:
            return self._experts_by_loop(rows, counts, tokens, gate, up, down)
        n = rows.shape[0] if tokens is None else tokens.shape[0]
        dest, offsets, size = aligned_groups(counts, n)
        source = tokens if tokens is not None else torch.arange(n, device=rows.device)
        # padded row -> the input row it reads; pad rows read an appended zero row
        src = torch.full((size,), rows.shape[0], dtype=torch.long, device=rows.device).index_copy(0, dest, source)
        padded = F.pad(rows, (0, 0, 0, 1)).index_select(0, src)
        h = self.act(grouped_linear(padded, gate, offsets, None, True)) * grouped_linear(padded, up, offsets, None,
                                                                                         True)
        return grouped_linear(h, down, offsets, None, True).index_select(0, dest)

    # A compile boundary: the loop splits its rows on the host (a device read), and traced, dynamo would guard on
    # the counts' values (a recompilation per routing); compiled MoE layers (fp32, or grouped_mm absent) run it
    # eagerly between their graphs.
    @torch.compiler.disable
    def _experts_by_loop(self, rows, counts, tokens, gate, up, down) -> torch.Tensor:
        """The per-expert loop: each expert's rows through its SwiGLU (see experts_forward)."""
        rows = rows if tokens is None else rows.index_select(0, tokens)
        split = counts.tolist()
        h = self.act(grouped_linear(rows, gate, counts, split, False)) * grouped_linear(rows, up, counts, split, False)
        return grouped_linear(h, down, counts, split, False)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = flat.argsort(stable=True)  # (token, slot) rows grouped by expert
        # [E] int64; a fixed-size scatter, not bincount (whose output size depends on the data), made from `flat` so
        # that it is a fake tensor exactly when the routing is (the planner's fake tensors)
        counts = flat.new_zeros(self.num_experts).index_add_(0, flat, torch.ones_like(flat))
        tokens, slot_weights = order // k, weights.reshape(-1).index_select(0, order)
        if type(self.dispatcher) is LocalTokenDispatch:  # every expert here: gather inside, once
            y = self.experts_forward(x, counts, tokens)
        else:
            rows, local_counts = self.dispatcher.dispatch(x.index_select(0, tokens), counts)
            y = self.dispatcher.combine(self.experts_forward(rows, local_counts))
        return torch.zeros_like(x).index_add_(0, tokens, (y * slot_weights[:, None]).to(x.dtype))


class MoE(nn.Module):
    """Routed experts + shared experts: x [T, H] -> [T, H]."""

    def __init__(self, cfg: TextConfig) -> None:
        super().__init__()
        softmax = cfg.family in ("qwen3_moe", "qwen3_5_moe")
        self.gate = SoftmaxTopKRouter(cfg) if softmax else TopKRouter(cfg)
        self.experts = RoutedExperts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared, bias=False, act=cfg.hidden_act) if shared else None
        # Qwen3.5-MoE: one shared expert of its own width, scaled per token by sigmoid(shared_expert_gate(x)).
        gated = cfg.shared_expert_intermediate_size or 0
        self.shared_expert = GatedMLP(cfg.hidden_size, gated, bias=False, act=cfg.hidden_act) if gated else None
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if gated else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, ids, weights)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)



# ------------------------------------------------------------------------------------------ balancing, tracing


def routers(model: nn.Module) -> list[TopKRouter]:
    """Every router of `model`, in layer order."""
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


@torch.no_grad()
def update_router_bias(model: nn.Module, rate: float,
                       all_reduce: Callable[[torch.Tensor], object] | None = None) -> float:
    """DeepSeek-V3's auxiliary-loss-free balancing step: bias += rate * sign(mean_load - load), then reset counts.

    `all_reduce(t)` sums a tensor over data-parallel ranks in place (or returns the sum), e.g.
    `torch.distributed.all_reduce`; every rank then applies the same update, so the biases stay identical. All
    layers' counts travel in one call. Returns the largest relative overload max_l (max_e load / mean_load - 1)
    over the MoE layers (DeepSeek's MaxVio, 0.0 without routers or tokens), for logging.
    """
    rs = routers(model)
    if not rs:
        return 0.0
    loads = torch.stack([r.expert_load for r in rs])  # [L, E] int64
    if all_reduce is not None:
        summed = all_reduce(loads)
        loads = summed if isinstance(summed, torch.Tensor) else loads
    loads = loads.float()
    mean = loads.mean(-1, keepdim=True)
    for router, load, m in zip(rs, loads, mean, strict=True):
        router.e_score_correction_bias += rate * torch.sign(m - load).to(router.e_score_correction_bias.device)
        router.expert_load.zero_()
    busy = mean.squeeze(-1) > 0
    if not bool(busy.any()):
        return 0.0
    return float((loads.amax(-1)[busy] / mean.squeeze(-1)[busy] - 1).max())


@contextlib.contextmanager
def record_routing(model: nn.Module) -> Iterator[list[TopKRouter]]:
    """Within the block, every router appends (ids [T, k], weights [T, k]) per forward to `router.records`, in
    descending routing-weight order (ties keep transformers' top-k slot order). Records are cleared on entry."""
    rs = routers(model)
    for r in rs:
        r.record, r.records = True, []
    try:
        yield rs
    finally:
        for r in rs:
            r.record = False
