"""torchrun worker for test_expert_parallel: routed experts under expert parallelism (all-to-all dispatch over gloo)
equal the same experts on one process, forward and backward, with hand-made routing in which one rank sends nothing
to another and some experts receive no token at all. Prints OK on success."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mindvl.models.moe import RoutedExperts
from mindvl.train.expert_parallel import apply_expert_parallel
from mindvl.train.parallel import ParallelLayout

E, H, I, K, T = 16, 16, 16, 2, 12


def routing(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], ids [T, K], weights [T, K], upstream gradient [T, H] of `rank` (every rank can rebuild all)."""
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=g)
    per_rank = E // world
    if rank == 0:  # rank 0 only uses its own experts (it sends nothing to the others), never expert 1
        allowed = [e for e in range(per_rank) if e != 1]
    else:  # the others use everything but experts 1 and E - 1 (idle everywhere)
        allowed = [e for e in range(E) if e not in (1, E - 1)]
    allowed_t = torch.tensor(allowed)
    ids = torch.stack([allowed_t[torch.randperm(len(allowed), generator=g)[:K]] for _ in range(T)])
    return x, ids, torch.rand(T, K, generator=g), torch.randn(T, H, generator=g)


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    reference = RoutedExperts(E, H, I, "silu")
    for p in reference.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.2
    model = copy.deepcopy(reference)
    apply_expert_parallel(model, ParallelLayout(world, dist.get_rank(), ep=world).meshes("cpu").expert)
    assert isinstance(model.gate_proj, DTensor) and model.gate_proj.to_local().shape[0] == E // world

    x, ids, w, up = routing(rank, world)
    x.requires_grad_(True)
    out = model(x, ids, w)
    (out * up).sum().backward()

    # one process: every rank's tokens through the full experts (the same loss, summed over ranks)
    ref_x_grad = None
    for r in range(world):
        xr, ir, wr, ur = routing(r, world)
        xr.requires_grad_(True)
        ref_out = reference(xr, ir, wr)
        (ref_out * ur).sum().backward()
        if r == rank:
            torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
            ref_x_grad = xr.grad
    torch.testing.assert_close(x.grad, ref_x_grad, rtol=1e-6, atol=1e-6)
    lo = slice(rank * E // world, (rank + 1) * E // world)
    for name in ("gate_proj", "up_proj", "down_proj"):
        # the dispatcher scales expert gradients by 1/N (FSDP's average over the expert replicas makes it 1/W)
        got = getattr(model, name).grad.to_local() * world
        torch.testing.assert_close(got, getattr(reference, name).grad[lo], rtol=1e-5, atol=1e-6)
    if rank == 0:
        assert float(model.gate_proj.grad.to_local()[1].abs().sum()) == 0  # expert 1: no token anywhere
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
