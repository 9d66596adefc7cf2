"""Throughput of mindvl.moe_analysis on a synthetic DeepSeek-V3-like router trace.

    python benchmarks/bench_moe_analysis.py [--tokens 1048576] [--layers 26] [--experts 256] [--k 8]
                                            [--seq-len 512] [--pooled-stride 16] [--skip-scaling]

The trace (synthetic_trace: every top-k slot keeps the previous token's expert with probability --keep, else draws
from a Zipf-like popularity) has --tokens tokens in sequences of --seq-len, each token routed at every layer.
Reported per step: CPU seconds of this process (numpy runs on one core, so tokens per CPU second is the throughput
per core), wall seconds, and tokens/s per core, where a token counts all its layers. Sections:
1. SRP at all segments together (one sort per layer shared), then each segment alone (scaling with m);
2. per-layer caches, every policy at all cache ratios in one lock-step simulation (SCH at each segment: scaling
   with the look-ahead m);
3. the pooled cache (one cache for all layers) on every --pooled-stride-th sequence (the reference's SCH uses 16);
4. per-layer LRU at each cache ratio alone (scaling with the cache size).
"""

from __future__ import annotations

import argparse
import os
import time

from mindvl.moe_analysis import hit_rate, srp_curve
from mindvl.moe_analysis.synthetic import synthetic_trace


def timed(label: str, tokens: int, fn, *args, **kwargs):
    cpu, wall = time.process_time(), time.perf_counter()
    out = fn(*args, **kwargs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"{label:44s} cpu {cpu:8.2f} s  wall {wall:8.2f} s  {tokens / max(cpu, 1e-9):12,.0f} tokens/s/core",
          flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--keep", type=float, default=0.6, help="probability a top-k slot keeps its expert")
    ap.add_argument("--skew", type=float, default=0.8, help="Zipf exponent of expert popularity")
    ap.add_argument("--segments", default="4,16,64,256")
    ap.add_argument("--cache-ratios", default="0.5,1,2,4")
    ap.add_argument("--pooled-stride", type=int, default=16)
    ap.add_argument("--skip-scaling", action="store_true", help="skip section 4")
    ap.add_argument("--table-only", action="store_true",
                    help="time only the full per-layer table (SRP + SCH at every segment + LRU/LFU/Belady/static)")
    args = ap.parse_args()
    segments = tuple(int(x) for x in args.segments.split(","))
    ratios = tuple(float(x) for x in args.cache_ratios.split(","))
    num_seqs = max(1, args.tokens // args.seq_len)
    tokens = num_seqs * args.seq_len
    print(f"trace: {tokens:,} tokens ({num_seqs} x {args.seq_len}) x {args.layers} layers x top-{args.k} of "
          f"{args.experts}; keep={args.keep} skew={args.skew}; load average {os.getloadavg()[0]:.1f} "
          f"on {os.cpu_count()} CPUs")
    trace = timed("generate synthetic trace", tokens, synthetic_trace, args.layers, args.experts, args.k,
                  [args.seq_len] * num_seqs, keep=args.keep, skew=args.skew, seed=0)

    from mindvl.moe_analysis import _compiled
    from mindvl.moe_analysis.report import analyze

    kernels = "numba kernels" if _compiled.available() else "numpy fallback"
    rep = timed(f"0. full table, per-layer caches ({kernels})", tokens, analyze, trace, segments, ratios, pooled=False)
    print("   SRP " + "  ".join(f"m={r['segment']}: {r['srp']:.4f}" for r in rep["srp"]))
    for name, r in rep["hit_rates"].items():
        print(f"   {name:8s} hit rate " + "  ".join(f"{v:.4f}" for v in r["layer_mean"]))
    if args.table_only:
        return

    print("\n1. SRP (model level, all layers)")
    res = timed(f"SRP, segments {args.segments} together", tokens, srp_curve, trace, segments=segments)
    print("   " + "  ".join(f"m={r.segment}: SRP {r.srp:.4f} rho {r.rho:.3f}" for r in res))
    for m in segments:
        timed(f"SRP, m={m} alone", tokens, srp_curve, trace, segments=(m,))

    print(f"\n2. per-layer caches, ratios {args.cache_ratios} in one pass (hit rate = mean over layers)")
    for policy, seg in [*(("fsf", m) for m in segments), ("lru", None), ("lfu", None), ("belady", None),
                        ("static", None)]:
        name = f"SCH m={seg}" if policy == "fsf" else policy
        r = timed(name, tokens, hit_rate, trace, policy=policy, segment=seg, cache_sizes=ratios, pooled=False)
        print("   hit rate " + "  ".join(f"rho={x:g}: {v:.4f}" for x, v in zip(ratios, r.layer_mean, strict=True)))

    stride = args.pooled_stride
    pooled_tokens = len(range(0, num_seqs, stride)) * args.seq_len
    print(f"\n3. pooled cache over all layers (every {stride}th sequence: {pooled_tokens:,} tokens)")
    for policy, seg in [("fsf", 16), ("lru", None), ("belady", None)]:
        name = f"SCH m={seg}" if policy == "fsf" else policy
        r = timed(name, pooled_tokens, hit_rate, trace, policy=policy, segment=seg, cache_sizes=ratios,
                  per_layer=False, sequence_stride=stride)
        print("   hit rate " + "  ".join(f"rho={x:g}: {v:.4f}" for x, v in zip(ratios, r.pooled, strict=True)))

    if not args.skip_scaling:
        print("\n4. per-layer LRU, one cache ratio at a time (scaling with cache size)")
        for x in ratios:
            timed(f"LRU rho={x:g} ({int(round(x * args.k))} slots)", tokens, hit_rate, trace, policy="lru",
                  cache_sizes=[x], pooled=False)


if __name__ == "__main__":
    main()
