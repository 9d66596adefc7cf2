"""`python -m mindvl.plan RECIPE --world-size N --device NAME`: one plan as JSON on stdout.

What the trainer's headline (train.plan_headline) runs in a child process: a child process runs a module, never the
CLI (ARCHITECTURE.md §2). People use `mindvl plan`, which prints the same JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys

from mindvl.config import load_recipe

from .devices import get_device
from .planner import plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindvl.plan")
    p.add_argument("recipe")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--device", required=True)
    args = p.parse_args(argv)
    device = get_device(args.device)  # an unknown device fails before any work
    result = plan(load_recipe(args.recipe), args.world_size, device, recipe_name=args.recipe)
    print(json.dumps(result.to_dict(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
