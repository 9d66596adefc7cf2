"""`mindvl plan RECIPE [key=value ...] --world-size N --device NAME [--preset P] [--json] [--sample-data]`."""

from __future__ import annotations

from .overrides import add_overrides


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="will a recipe fit? trace its real training step on a simulated cluster")
    p.add_argument("recipe", help="recipe YAML, e.g. recipes/mindvl-8b/sft-8k.yaml")
    add_overrides(p, "recipe overrides, as for `mindvl train`")
    p.add_argument("--world-size", type=int, required=True, help="number of accelerators (FSDP ranks)")
    p.add_argument("--device", required=True, help="h100-80g, h200, a100-80g, 910b1, 910b2-64g or custom:...")
    p.add_argument("--preset", help="model shape preset (default: the recipe's model folders or model.preset)")
    p.add_argument("--sample-data", action="store_true", help="pack shapes from the recipe's own sources")
    p.add_argument("--routing-skew", type=float, default=None, metavar="F",
                   help="MoE under expert parallelism: the busiest rank receives F x its balanced share of routed "
                        "rows (1 = balanced; a run's MaxVio bounds it: F <= 1 + MaxVio; default: the measured "
                        "factor in mindvl/plan/margin.json); the report also prints the headroom at 1.25-3 and the "
                        "largest F that fits")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    import json

    from mindvl.config import load_recipe
    from mindvl.plan import format_report, get_device, plan

    device = get_device(args.device)  # an unknown device fails before any work
    result = plan(load_recipe(args.recipe, args.overrides), args.world_size, device, preset=args.preset,
                  sample_data=args.sample_data, recipe_name=args.recipe, routing_skew_factor=args.routing_skew)
    print(json.dumps(result.to_dict(), indent=1) if args.json else format_report(result))
    return 0
