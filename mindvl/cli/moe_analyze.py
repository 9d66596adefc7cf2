"""`mindvl moe-analyze TRACE`: SRP/SCH routing-consistency analysis and expert-cache simulation of a router trace."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("moe-analyze", help="SRP/SCH routing consistency and expert-cache hit rates of a trace")
    p.add_argument("trace", help="router trace (.npz written by mindvl.moe_analysis.save_trace)")
    p.add_argument("--segments", default="4,16,64,256", help="segment lengths m for SRP and SCH (comma-separated)")
    p.add_argument("--cache-ratios", default="0.5,1,2,4",
                   help="cache sizes as slots / active experts: ρ·k per layer, ρ·L·k pooled (comma-separated)")
    p.add_argument("--policies", default="lru,lfu,belady,static", help="baseline cache policies besides SCH")
    p.add_argument("--out", default=None, help="folder for moe_analysis.json and the plots (tables only if omitted)")
    p.add_argument("--margin", type=float, default=0.01,
                   help="guidance: smallest cache whose hit rate is within this of the best measured one")
    p.add_argument("--lookup", choices=("pre", "seq"), default="pre",
                   help="pre: batched lookups before each token (reference); seq: resident when processed")
    p.add_argument("--pin", action="store_true", help="never evict experts of the current token")
    p.add_argument("--cold-start", action="store_true", help="count first uses as misses (default: free)")
    p.add_argument("--sim-stride", type=int, default=1,
                   help="simulate caches on every n-th sequence (the reference's SCH uses 16)")
    p.add_argument("--no-pooled", action="store_true", help="skip the cache pooled across layers")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of tables")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import json

    from mindvl.moe_analysis.report import analyze, parse_list, print_report, write_report
    from mindvl.moe_analysis.trace_io import load_trace

    report = analyze(
        load_trace(args.trace),
        segments=parse_list(args.segments, int, "--segments"),
        cache_ratios=parse_list(args.cache_ratios, float, "--cache-ratios"),
        policies=parse_list(args.policies, str, "--policies"),
        margin=args.margin, lookup=args.lookup, pin=args.pin, warm_start=not args.cold_start,
        sequence_stride=args.sim_stride, pooled=not args.no_pooled,
    )
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    if args.out:
        for path in write_report(report, args.out):
            print(f"wrote {path}")
    return 0
