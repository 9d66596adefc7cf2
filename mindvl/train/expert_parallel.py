"""Expert parallelism (EP), applied to a MindVL model from outside, before FSDP2.

The world of W ranks is laid out as a DeviceMesh ("efsdp", "ep") of shape (W / N, N) for `parallel.expert_parallel:
N`. Each MoE layer's routed experts ([E, ...] parameters) become DTensors sharded on dim 0 over "ep": rank r of an
EP group holds experts [r*E/N, (r+1)*E/N). FSDP2 then shards every expert slice over "efsdp" (the N-th ranks of the
other EP groups, which hold the same experts) along an inner dim (`replica_shard_dim`: every rank holds exactly 1/W
of the experts), and everything else (attention, routers, shared experts, dense MLPs, the vision tower, the
projector, embeddings) over the whole world flattened from both dimensions: the vision tower and projector stay
data-parallel on every rank while the MoE layers use EP.

Tokens: every rank routes its own tokens with its (replicated) router, sorts the (token, slot) rows by expert, and
`AllToAllTokenDispatch` sends each block of rows to the rank owning those experts with one autograd-aware
`all_to_all_single` (uneven splits, zeros included, after exchanging the per-expert counts), runs its local experts
as grouped GEMMs on what it received, and sends the outputs back the same way. The backward runs the transposed
exchanges.

Gradient scale: the step multiplies the loss by the data-parallel size (W: EP borrows its ranks from the data
shards) because FSDP averages over the ranks of its mesh. Expert
slices are reduced over "efsdp" only (W / N ranks), but their gradient already sums the tokens of all N EP ranks
(the all-to-all backward brings them), so the dispatcher scales the experts' local gradient by 1/N (exact for powers
of two) and every parameter's gradient is the same global-token average as on one process. (FSDP's
`set_gradient_divide_factor` would do it with a PREMUL_SUM reduction, which gloo lacks.)

Router-bias balancing and MaxVio: routers are replicated and count the tokens THIS rank routes (before dispatch), so
summing the counts over the whole world (what the trainer does for data parallelism) gives the global per-expert
load, exactly as on one process, whatever N is.

Checkpoints: expert parameters are DTensors with the global [E, ...] shape, so DCP checkpoints are independent of N
and of W (train at EP=2, resume at EP=4 or on one process).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from mindvl.models.moe import LocalTokenDispatch, RoutedExperts

EP_KEY = "parallel.expert_parallel"  # the recipe key named in every expert-parallel error (train.parallel too)


def routed_experts(model: nn.Module) -> list[RoutedExperts]:
    return [m for m in model.modules() if isinstance(m, RoutedExperts)]


def check_expert_parallel(size: int, world_size: int, model: nn.Module) -> None:
    """One-line errors naming the key: EP on a dense model, or a size that does not divide the experts or world."""
    if size == 1:
        return
    experts = routed_experts(model)
    if not experts:
        raise ValueError(f"{EP_KEY}: {size} asks for expert parallelism, but the language model is dense (no routed "
                         "experts); use a deepseek_v3 or qwen3_moe language model or set it to 1")
    if world_size % size:
        raise ValueError(f"{EP_KEY}: {size} must divide the world size {world_size}")
    e = experts[0].num_experts
    if e % size:
        raise ValueError(f"{EP_KEY}: {size} must divide the number of routed experts {e}")


class AllToAllTokenDispatch(LocalTokenDispatch):
    """Sends (token, slot) rows to the EP rank owning their expert and the outputs back (see the module docstring).

    dispatch(rows [N, H] sorted by global expert, counts [E]) -> (rows for the local experts sorted by local expert
    [M, H], counts [E/N]); combine(out [M, H]) -> [N, H] in the order dispatch was given.
    """

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.group = mesh.get_group()
        self.size = mesh.size()
        self.local = num_experts // self.size
        self._pending: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def dispatch(self, rows: torch.Tensor, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, lo = self.size, self.local
        if is_fake(counts):  # the planner (fake tensors): no routing to read, so assume perfectly balanced routing
            return self._balanced_dispatch(rows)
        # received[s * lo + l]: rows rank s sends to my local expert l
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(n, lo).sum(1).tolist()
        recv = received.view(n, lo).sum(1).tolist()
        got = all_to_all_single_autograd(rows.contiguous(), recv, send, self.group)
        # got is ordered by (source rank, local expert): reorder by local expert (stable: source rank, then token)
        local_ids = torch.arange(lo, device=counts.device).repeat(n).repeat_interleave(received)
        order = local_ids.argsort(stable=True)
        self._pending.append((order, send, recv))
        return got[order], received.view(n, lo).sum(0)

    def _balanced_dispatch(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank sends N/ep rows to every rank, every local expert gets the same share (shapes only)."""
        n, lo, total = self.size, self.local, rows.shape[0]
        send = [total // n + (i < total % n) for i in range(n)]
        got = all_to_all_single_autograd(rows.contiguous(), send, send, self.group)
        share = [total // lo + (i < total % lo) for i in range(lo)]
        self._pending.append((None, send, send))
        return got, torch.tensor(share, dtype=torch.long, device=rows.device)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        order, send, recv = self._pending.pop()
        # undo the sort by local expert
        by_source = out if order is None else torch.empty_like(out).index_copy(0, order, out)
        return all_to_all_single_autograd(by_source.contiguous(), send, recv, self.group)

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGrad.apply(local, 1.0 / self.size)  # see "Gradient scale" above


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh) -> list[RoutedExperts]:
    """Shard every routed-experts module's parameters on dim 0 over mesh["ep"] and install the all-to-all
    dispatcher. Works on the meta device (before `to_empty`). Returns the modules (FSDP wraps them separately)."""
    ep = mesh["ep"]
    modules = routed_experts(model)
    for m in modules:
        for name, p in list(m.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(p.data, ep, [Shard(0)], src_data_rank=None),
                                   requires_grad=p.requires_grad)
            m.register_parameter(name, sharded)
        m.dispatcher = AllToAllTokenDispatch(ep, m.num_experts)
    return modules


def shard_experts(model: nn.Module, mesh: DeviceMesh, mp_policy) -> None:
    """`prepare_model`'s expert-parallel step, before FSDP wraps the blocks: shard the experts over `mesh["ep"]`
    (the layout's ("efsdp", "ep") mesh) and FSDP each expert slice over its replicas, `mesh["efsdp"]`."""
    from torch.distributed.fsdp import fully_shard

    replicas = mesh["efsdp"].size()
    for m in apply_expert_parallel(model, mesh):
        fully_shard(m, mesh=mesh["efsdp"], mp_policy=mp_policy,
                    shard_placement_fn=lambda p: Shard(replica_shard_dim(p.to_local().shape, replicas)))


def replica_shard_dim(local_shape: torch.Size, replicas: int) -> int:
    """The dim FSDP splits an EP-local expert slice [E/N, a, b] along over its `replicas` (W/N ranks): the first
    inner dim (I of gate/up [E/N, I, H], H of down [E/N, H, I]) that `replicas` divides, else dim 0.

    Why not dim 0 (FSDP's default): at scale there are fewer local experts than replicas (E = 256 < W), and FSDP
    splits dim 0 in ceil(E/N / replicas)-row chunks padded to the first one: with 16 local experts over 32 replicas
    every rank would hold (and all-gather into) one whole expert, twice its 1/W share, half of it padding. Split
    along an inner dim, every rank holds exactly 1/W of the experts whatever E, N and W are."""
    for dim in range(1, len(local_shape)):
        if local_shape[dim] % replicas == 0:
            return dim
    return 0
