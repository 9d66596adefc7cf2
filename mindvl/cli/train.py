"""`mindvl train RECIPE [key=value ...]` (under torchrun for several processes); `mindvl train --list`.

Exit codes (mindvl.train.stops): 0 finished, 2 bad input, 3 too many bad steps, 75 preempted (checkpoint written;
rerun with resume=auto)."""

from __future__ import annotations

from .overrides import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help="run one training phase from a recipe (warm-up, multitask or SFT)",
                              epilog="exit codes: 0 finished, 2 bad input or configuration, 3 too many consecutive "
                                     "bad steps, 75 preempted (a checkpoint was written: rerun with resume=auto)")
    p.add_argument("recipe", nargs="?", help="a recipe YAML file, or a packaged recipe by name (tiny/warmup); "
                   "relative input paths in the file resolve against its folder")
    add_overrides(p, "override any field by dotted path (optim.lr=1e-4) or alias: output_dir=, max_steps=, "
                     "max_tokens=, checkpoint_every=, resume=auto, lr=, seed=, init_from=, overwrite=true")
    p.add_argument("--list", action="store_true", help="list the packaged recipes and exit")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.config import PACKAGED_RECIPES, load_recipe, packaged_recipes

    if args.list:
        for name in packaged_recipes():
            print(f"{name:24s} {PACKAGED_RECIPES / name}.yaml")
        return 0
    if args.recipe is None:
        raise ValueError("give a recipe file or a packaged recipe name (mindvl train --list shows them)")
    from mindvl.train.trainer import train

    result = train(load_recipe(args.recipe, args.overrides))
    if result.final_dir is not None:
        print(f"final model: {result.final_dir}")
    return 0
