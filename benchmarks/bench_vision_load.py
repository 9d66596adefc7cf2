"""Vision load per rank: ViT FLOPs per rank per step (max / mean over ranks and steps) for a recipe's data, with
and without a vision budget per pack (`data.max_patches_per_pack`), as `mindvl plan` reports it.

    python benchmarks/bench_vision_load.py [--recipe recipes/tiny/multitask.yaml] [--world 8] [--accum 4]

Pack shapes come from the recipe's own data pipeline; FLOPs are counted for MindVL-8B's vision tower (the
`mindvl-8b` preset) by `train.metrics`, as the planner does.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile

from mindvl.config import load_recipe
from mindvl.data import DataConfig, load_tokenizer
from mindvl.plan import preset_config
from mindvl.plan.estimate import vision_load
from mindvl.plan.packs import sampled_packs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="recipes/tiny/multitask.yaml")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--sources", default="[{synth: {tasks: [chart, doc, ocr], n: 400, seed: 1}}]",
                    help="data.sources override (YAML); the default mixes small and large images")
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 512, 256])
    args = ap.parse_args()
    config = preset_config("mindvl-8b")
    tok = load_tokenizer()
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("| data.max_patches_per_pack | packs | mean patches/pack | ViT GFLOPs/rank/step max | mean | max/mean | "
          "worst step max/mean |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for budget in args.budgets:
            over = [f"data.synth_cache={tmp}", f"data.sources={args.sources}"]
            over += [f"data.max_patches_per_pack={budget}"] if budget else []
            recipe = load_recipe(args.recipe, over)
            n = args.world * args.accum * args.steps
            packs = sampled_packs(DataConfig.from_dict(recipe.data), tok, count=n)
            v = vision_load(config, packs, args.world, args.accum, recipe.trainable_modules, steps=args.steps)
            mean_patches = sum(p.patches for p in packs) / len(packs)
            print(f"| {budget or 'none'} | {len(packs)} | {mean_patches:.0f} | {v['vit_flops_max'] / 1e9:.1f} | "
                  f"{v['vit_flops_mean'] / 1e9:.1f} | {v['max_over_mean']:.2f} | {v['worst_step_max_over_mean']:.2f} |",
                  flush=True)


if __name__ == "__main__":
    main()
