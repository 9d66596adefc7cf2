"""`mindvl search-resolution CKPT... --bench NAME=PATH ... [--grid paper]`: test-time resolution search."""

from __future__ import annotations

from .eval import add_eval_options, settings_from, system_from_model


def register(subparsers) -> None:
    p = subparsers.add_parser("search-resolution", help="evaluate checkpoints over a (min, max) pixel grid")
    p.add_argument("models", nargs="+", metavar="CKPT", help="model folders; LABEL=DIR names one in tables/plots")
    add_eval_options(p)
    p.add_argument("--grid", default="paper",
                   help="paper (min {4,16,32,64} x max {1280,...,8192}), quick, or MINS:MAXES in units of 28x28 "
                        "pixels, e.g. 4,16:16,64")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.eval.benchmarks import parse_bench_args
    from mindvl.eval.resolution_search import best_lines, parse_grid, search_resolution

    models = {}
    for spec in args.models:
        label, sep, folder = spec.partition("=")
        label, folder = (label, folder) if sep else (spec.rstrip("/").split("/")[-1], spec)
        if label in models:
            raise ValueError(f"two checkpoints are labelled {label!r}; name them LABEL=DIR")
        models[label] = folder
    result = search_resolution(models, parse_bench_args(args.bench), parse_grid(args.grid), args.out,
                               settings_from(args), args.tokenizer, args.device,
                               system_from_model=system_from_model(args))
    for line in best_lines(result["best"]):
        print(line)
    print(f"wrote {args.out}/results.md, best.json and boxplot_*.png")
    return 0
