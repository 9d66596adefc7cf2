"""Routed experts at decode sizes (a few rows over many experts): the grouped layout's rows and the bytes a forward
allocates, with the layout bounded by E pad groups (before session 18) against min(E, rows) of them (now), side by
side in one run; outputs compared bit for bit.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_decode_layout.py [--experts 128] [--hidden 2048] [--inner 768]
                                                                  [--k 8] [--tokens 1,4,32] [--reps 20]

Defaults: Qwen3-30B-A3B's expert shapes (Qwen3-VL-30B-A3B's LLM). Bytes are the sizes of the tensors the forward
allocates (torch.profiler's memory events, outermost ops), which on an accelerator are written and read again by
the gather and the SwiGLU product; the CPU's time is mostly its grouped GEMM and is printed for completeness.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from mindvl.models import moe
from mindvl.models.moe import RoutedExperts

CURRENT = moe.aligned_groups


def bound_by_every_expert(counts: torch.Tensor, n_rows: int, align: int = moe.GROUP_ALIGN):
    """The layout as before: the same groups, the size bounded by align - 1 pad rows for each of the E experts."""
    dest, offsets, _ = CURRENT(counts, n_rows, align)
    return dest, offsets, -(-(n_rows + counts.shape[0] * (align - 1) + 1) // align) * align


def allocated_bytes(m: RoutedExperts, x, ids, w) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        m(x, ids, w)
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0 and e.cpu_parent is None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inner", type=int, default=768)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--tokens", default="1,4,32")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    m = RoutedExperts(args.experts, args.hidden, args.inner, "silu").to(torch.bfloat16)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    arms = {"before": bound_by_every_expert, "now": CURRENT}
    print(f"experts {args.experts}, hidden {args.hidden}, inner {args.inner}, top-{args.k}, bf16")
    for t in (int(v) for v in args.tokens.split(",")):
        x = torch.randn(t, args.hidden, dtype=torch.bfloat16)
        ids = torch.stack([torch.randperm(args.experts)[:args.k] for _ in range(t)])
        w = torch.rand(t, args.k)
        rows = t * args.k
        counts = torch.bincount(ids.reshape(-1), minlength=args.experts)
        got, times = {}, {name: [] for name in arms}
        with torch.inference_mode():
            for name, fn in arms.items():
                moe.aligned_groups = fn
                got[name] = (m(x, ids, w), allocated_bytes(m, x, ids, w), fn(counts, rows)[2])
            for _ in range(args.reps):  # interleaved, so load changes hit both arms alike
                for name, fn in arms.items():
                    moe.aligned_groups = fn
                    start = time.perf_counter()
                    m(x, ids, w)
                    times[name].append(time.perf_counter() - start)
        moe.aligned_groups = CURRENT
        (y0, b0, s0), (y1, b1, s1) = got["before"], got["now"]
        ms = {name: 1000 * statistics.median(v) for name, v in times.items()}
        print(f"tokens {t:3d} rows {rows:4d}: layout {s0} -> {s1} rows; allocated {b0 / 2**20:.2f} -> "
              f"{b1 / 2**20:.2f} MiB ({b0 / max(b1, 1):.1f}x); CPU {ms['before']:.1f} -> {ms['now']:.1f} ms; "
              f"outputs equal: {torch.equal(y0, y1)}")


if __name__ == "__main__":
    main()
