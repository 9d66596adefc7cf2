"""Routed experts: backward time vs the number of experts E at fixed token work, per-expert indexing (the code before
grouped GEMMs) vs the `unbind(0)` fallback vs `F.grouped_mm`; forward+backward tokens/s of a whole MoE layer; bytes
an expert-parallel step moves through all-to-all.

    OMP_NUM_THREADS=1 python benchmarks/bench_moe_experts.py [--tokens 4096] [--k 8] [--hidden 256] [--inner 128]
                                                            [--experts 8,32,128,256] [--reps 3] [--ep 2,4,8]

The arms run interleaved (rep by rep), so load changes hit all of them alike; medians and min..max spreads are
printed with the old/new ratio. The per-expert arm at E=256 takes several seconds per backward; --old-max-experts
skips it above a size.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from mindvl.models.config import TextConfig
from mindvl.models.moe import MoE, RoutedExperts


def per_expert_indexing(m: RoutedExperts, x, ids, weights):
    """The pre-grouped-GEMM forward: one `weight[e]` index per expert (each one's backward zero-fills [E, ...])."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=m.num_experts).tolist()
    tokens, slot_weights = order // k, weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        sel = tokens[start:start + count]
        h = x[sel]
        y = F.linear(m.act(F.linear(h, m.gate_proj[e])) * F.linear(h, m.up_proj[e]), m.down_proj[e])
        out.index_add_(0, sel, (y * slot_weights[start:start + count, None]).to(out.dtype))
        start += count
    return out


def backward_seconds(m: RoutedExperts, arm: str, x, ids, w, grad) -> float:
    m.use_grouped_mm = arm == "grouped_mm"
    out = per_expert_indexing(m, x, ids, w) if arm == "per-expert" else m(x, ids, w)
    t = time.perf_counter()
    out.backward(grad)
    dt = time.perf_counter() - t
    m.zero_grad(set_to_none=True)
    return dt


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:9.1f} ms ({min(xs) * 1e3:.0f}..{max(xs) * 1e3:.0f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inner", type=int, default=128)
    ap.add_argument("--experts", default="8,32,128,256")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--old-max-experts", type=int, default=256)
    ap.add_argument("--ep", default="2,4,8")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    t, k, h, i = args.tokens, args.k, args.hidden, args.inner
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average {os.getloadavg()} "
          f"on {os.cpu_count()} CPUs; T={t} tokens, top-{k}, H={h}, I={i}, fp32")

    print("\n1. experts backward at fixed token work (T*k rows), median (min..max) over reps")
    for e in (int(v) for v in args.experts.split(",")):
        m = RoutedExperts(e, h, i, "silu")
        for p in m.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.05
        x = torch.randn(t, h, generator=g, requires_grad=True)
        ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
        w = torch.rand(t, k, generator=g)
        grad = torch.randn(t, h, generator=g)
        arms = ["grouped_mm", "unbind"] + (["per-expert"] if e <= args.old_max_experts else [])
        times: dict[str, list[float]] = {a: [] for a in arms}
        for a in arms:  # warm-up (first-call allocations)
            backward_seconds(m, a, x, ids, w, grad)
        for _ in range(args.reps):
            for a in arms:
                times[a].append(backward_seconds(m, a, x, ids, w, grad))
        med = {a: statistics.median(v) for a, v in times.items()}
        old = f"  old/grouped {med['per-expert'] / med['grouped_mm']:6.1f}x" if "per-expert" in med else ""
        print(f"E={e:4d}  " + "  ".join(f"{a} {fmt(v)}" for a, v in times.items()) + old, flush=True)

    print("\n2. MoE layer (router + routed + shared expert) forward+backward, tokens/s")
    for e in (int(v) for v in args.experts.split(",")):
        cfg = TextConfig(family="deepseek_v3", hidden_size=h, moe_intermediate_size=i, n_routed_experts=e,
                         num_experts_per_tok=k, n_group=1, topk_group=1, n_shared_experts=1, kv_lora_rank=16,
                         qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8)
        layer = MoE(cfg)
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.05
        x = torch.randn(t, h, generator=g, requires_grad=True)
        rates: dict[str, list[float]] = {"grouped_mm": [], "unbind": []}
        for rep in range(args.reps + 1):  # rep 0 warms up
            for a in rates:
                layer.experts.use_grouped_mm = a == "grouped_mm"
                t0 = time.perf_counter()
                layer(x).sum().backward()
                if rep:
                    rates[a].append(t / (time.perf_counter() - t0))
                layer.zero_grad(set_to_none=True)
        print(f"E={e:4d}  " + "  ".join(f"{a} {statistics.median(v):10,.0f} tok/s" for a, v in rates.items()),
              flush=True)

    print("\n3. expert-parallel all-to-all bytes per MoE layer per training step, per rank (fp32 / bf16 activations)")
    e = 256
    ids = torch.rand(t, e, generator=g).topk(k, dim=-1).indices
    for ep in (int(v) for v in args.ep.split(",")):
        owner = ids // (e // ep)  # rank owning each chosen expert; this rank is rank 0
        remote = int((owner != 0).sum())
        # dispatch + combine in the forward, their transposes in the backward: 4 transfers of `remote` rows of H
        per = 4 * remote * h
        print(f"EP={ep}: {remote}/{t * k} rows leave the rank; {per * 4 / 2**20:.2f} MiB fp32, "
              f"{per * 2 / 2**20:.2f} MiB bf16 (H={h}); at DeepSeek-V3's H=7168: {4 * remote * 7168 * 2 / 2**20:.1f} "
              f"MiB bf16", flush=True)


if __name__ == "__main__":
    main()
