"""`mindvl train RECIPE.yaml [key=value ...]` (under torchrun for several processes).

Exit codes (mindvl.train.stops): 0 finished, 2 bad input, 3 too many bad steps, 75 preempted (checkpoint written;
rerun with resume=auto)."""

from __future__ import annotations


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="run one training phase from a recipe (warm-up, multitask or SFT)",
                              epilog="exit codes: 0 finished, 2 bad input or configuration, 3 too many consecutive "
                                     "bad steps, 75 preempted (a checkpoint was written: rerun with resume=auto)")
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/tiny/warmup.yaml")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="override any field by dotted path (optim.lr=1e-4) or alias: output_dir=, max_steps=, "
                        "max_tokens=, checkpoint_every=, resume=auto, lr=, seed=, init_from=, overwrite=true")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.config import load_recipe
    from mindvl.train.trainer import train

    result = train(load_recipe(args.recipe, args.overrides))
    if result.final_dir is not None:
        print(f"final model: {result.final_dir}")
    return 0
