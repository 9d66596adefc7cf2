"""`mindvl quickstart [--out DIR]`: the whole pipeline at toy scale (train three phases, SFT at three lengths, merge,
resolution search, evaluation, report)."""

from __future__ import annotations

from .overrides import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser("quickstart", help="the paper's pipeline end to end at toy scale on synthetic data")
    p.add_argument("--out", default="runs/quickstart", help="output folder (default runs/quickstart)")
    p.add_argument("--recipes", default=None, help="folder with warmup/multitask/sft.yaml (default: the tiny ones)")
    p.add_argument("--bench-items", type=int, default=100, help="items per synthetic benchmark (default 100)")
    p.add_argument("--grid", default="4,16:16,64", help="resolution grid (see mindvl search-resolution --grid)")
    add_overrides(p, "applied to every phase (e.g. max_steps=10)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.quickstart import quickstart

    quickstart(args.out, args.recipes, args.overrides, bench_items=args.bench_items, grid=args.grid)
    return 0
