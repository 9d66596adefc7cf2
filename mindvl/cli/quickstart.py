"""`mindvl quickstart [--out DIR] [--fast | --steps N] [key=value ...]`: the whole pipeline at toy scale (synthetic
data, three training phases, SFT at three lengths, merge, resolution search, evaluation, report). It prints its plan
(stages, work, estimated time) first and the overall progress at every stage."""

from __future__ import annotations

from .overrides import add_overrides

# --family -> the recipe folder beside the tiny recipes (None: the quickstart's own default)
FAMILY_RECIPES = {"qwen2.5-vl": None, "qwen3-vl": "tiny-qwen3-vl"}


def register(subparsers) -> None:
    p = subparsers.add_parser("quickstart", help="the paper's pipeline end to end at toy scale on synthetic data")
    p.add_argument("--out", default=None, help="output folder (default runs/quickstart, with --fast "
                   "runs/quickstart-fast; --family qwen3-vl: runs/quickstart-qwen3-vl[-fast]); a rerun into it reuses "
                   "finished phases and resumes a stopped one")
    p.add_argument("--recipes", default=None, help="folder with warmup/multitask/sft.yaml (default: the tiny ones)")
    p.add_argument("--family", choices=tuple(FAMILY_RECIPES), default="qwen2.5-vl",
                   help="the vision tower's family: qwen2.5-vl (the tiny recipes) or qwen3-vl (recipes/tiny-qwen3-vl: "
                   "a Qwen3-VL-shaped tower, 16-px patches, DeepStack; data, eval and search use its processor)")
    p.add_argument("--fast", action="store_true", help="a smoke run of every stage: 10 steps per phase, synthetic "
                   "sets capped at 200 samples, 10 items per benchmark, a 1 x 2 resolution grid")
    p.add_argument("--steps", type=int, default=None, help="training steps of every phase (max_steps=N)")
    p.add_argument("--bench-items", type=int, default=None, help="items per synthetic benchmark (default 100; "
                   "--fast: 10)")
    p.add_argument("--grid", default=None, help="resolution grid (see mindvl search-resolution --grid; default "
                   "4,16:16,64; --fast: 4:16,64)")
    add_overrides(p, "applied to every phase (e.g. optim.lr=5e-4)")
    p.set_defaults(func=run)


def run(args) -> int:
    import os
    import shlex
    import sys

    from mindvl.quickstart import BENCH_ITEMS, FAST, QUICK_GRID, quickstart, recipe_dir

    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    family = FAMILY_RECIPES[args.family]
    recipes = args.recipes or (str(recipe_dir().parent / family) if family else None)
    out = args.out or ("runs/quickstart" + (f"-{args.family}" if family else "") + ("-fast" if args.fast else ""))
    bench_items = args.bench_items or (FAST["bench_items"] if args.fast else BENCH_ITEMS)
    grid = args.grid or (FAST["grid"] if args.fast else QUICK_GRID)
    # What continues an interrupted run: the command as typed (./quickstart passes its own in MINDVL_RERUN).
    rerun = os.environ.get("MINDVL_RERUN") or shlex.join(["mindvl", *sys.argv[1:]])
    quickstart(out, recipes, args.overrides, bench_items=bench_items, grid=grid, steps=args.steps,
               fast=args.fast, rerun=rerun)
    return 0
