"""`mindvl eval CKPT --bench NAME=PATH ...`: benchmark a model folder with the toolkits' scoring rules."""

from __future__ import annotations


def add_eval_options(p) -> None:
    """Options shared by `eval` and `search-resolution`."""
    p.add_argument("--bench", action="append", required=True, metavar="NAME=PATH",
                   help="a benchmark and its local files (parquet or TSV); repeat. Names: ocrbench, docvqa, infovqa, "
                        "chartqa, mme, mmbench")
    p.add_argument("--out", required=True, help="output folder (predictions, summaries); reruns resume")
    p.add_argument("--toolkit", default="lmms-eval", choices=["lmms-eval", "vlmevalkit"],
                   help="whose prompts and scoring rules (default: lmms-eval)")
    p.add_argument("--batch-size", type=int, default=8, help="prompts generated together")
    p.add_argument("--limit", type=int, help="only the first N items of each benchmark")
    p.add_argument("--max-new-tokens", type=int, help="default: the benchmark's own")
    p.add_argument("--system", help="system prompt (default: the one the model was trained with: its run's "
                   "data.default_system, else its chat template's; printed)")
    p.add_argument("--no-system", action="store_true", help="no system turn (recipes with default_system: null)")
    p.add_argument("--tokenizer", metavar="DIR", help="tokenizer folder (default: the model folder's)")
    p.add_argument("--device", help="cuda, cpu, ... (default: cuda when available)")


def settings_from(args, **pixels):
    from mindvl.data.template import DEFAULT_SYSTEM
    from mindvl.eval.runner import EvalSettings

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size)):
        if value is not None and value < 1:  # before any model loads
            raise ValueError(f"{flag} must be >= 1, got {value}")
    system = None if args.no_system else (DEFAULT_SYSTEM if args.system is None else args.system)
    return EvalSettings(toolkit=args.toolkit, system=system, batch_size=args.batch_size, limit=args.limit,
                        max_new_tokens=args.max_new_tokens, **pixels)


def system_from_model(args) -> bool:
    """Neither --system nor --no-system: the system turn the model was trained with."""
    return args.system is None and not args.no_system


def register(subparsers) -> None:
    p = subparsers.add_parser("eval", help="evaluate a model folder on local benchmark files")
    p.add_argument("model", help="a mindvl model folder")
    add_eval_options(p)
    p.add_argument("--min-pixels", type=int, help="default: the folder's preprocessor_config.json, else 3136")
    p.add_argument("--max-pixels", type=int, help="default: the folder's preprocessor_config.json, else 1003520")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.eval.benchmarks import parse_bench_args
    from mindvl.eval.runner import evaluate

    settings = settings_from(args, min_pixels=args.min_pixels, max_pixels=args.max_pixels)
    evaluate(args.model, parse_bench_args(args.bench), args.out, settings, args.tokenizer, args.device,
             system_from_model=system_from_model(args))
    print(f"wrote {args.out}/summary.json and summary.md")
    return 0
