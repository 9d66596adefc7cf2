"""torchrun worker for test_context_parallel: the Ulysses all-to-all attention over a CP group of all the ranks
equals the varlen attention of one process on the whole row, forward and backward, for a packed row whose samples
span chunk boundaries (uneven chunks: 37 tokens), with 4 query heads and 2 KV heads (replicated at 4 ranks).
Prints OK on success."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mindvl.models.attention import attend
from mindvl.train.context_parallel import UlyssesAttention, _RowState, chunk_bounds

T, HQ, HKV, D = 37, 4, 2, 8
CU = torch.tensor([0, 5, 19, 20, 37], dtype=torch.int32)  # 4 samples, one of a single token


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(T, HQ, D, generator=g), torch.randn(T, HKV, D, generator=g), torch.randn(T, HKV, D,
                                                                                                 generator=g)
    upstream = torch.randn(T, HQ, D, generator=g)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = attend(*ref, CU, 17, causal=True, backend="sdpa")
    (out_ref * upstream).sum().backward()

    a, b = chunk_bounds(T, world, rank)
    mine = [t[a:b].clone().requires_grad_() for t in (q, k, v)]
    core = UlyssesAttention(dist.group.WORLD, world, rank, _RowState(True))
    out = core(*mine, CU, 17, True, backend="sdpa")
    (out * upstream[a:b]).sum().backward()
    torch.testing.assert_close(out, out_ref[a:b], rtol=0, atol=1e-6)
    for got, want in zip(mine, ref, strict=True):
        torch.testing.assert_close(got.grad, want.grad[a:b], rtol=0, atol=1e-6)
    dist.barrier()
    if rank == 0:
        print("OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
