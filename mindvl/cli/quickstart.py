"""`mindvl quickstart [--out DIR]`: synthetic data -> tiny warm-up -> multitask -> SFT, each phase exported."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("quickstart", help="train the tiny recipe's three phases end to end on synthetic data")
    p.add_argument("--out", default="runs/quickstart", help="output folder (default runs/quickstart)")
    p.add_argument("--recipes", default=None, help="folder with warmup/multitask/sft.yaml (default: the tiny ones)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="applied to every phase (e.g. max_steps=10)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.train.quickstart import quickstart

    quickstart(args.out, args.recipes, args.overrides)
    return 0
