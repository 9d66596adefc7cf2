"""`mindvl data synth|stats|plan`: generate synthetic data; inspect sources (counts, histograms, packing
efficiency); plan a recipe's mixture over its token budget against the paper's tables."""

from __future__ import annotations

import argparse
import json

from .overrides import add_overrides


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("data", help="synthetic data and dataset statistics")
    sub = parser.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

    synth = sub.add_parser("synth", help="write synthetic OCR/chart/grounding/doc samples (JSONL + PNG)")
    synth.add_argument("--out", required=True, help="output folder (data.jsonl and images/ are written there)")
    synth.add_argument("--n", type=int, required=True, help="number of samples")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synth.add_argument("--tasks", default="ocr,chart,grounding,doc",
                       help="comma-separated tasks: ocr, chart, grounding, doc, digits, digits_sized, minichart, "
                       "minidoc, minichart_sized, minidoc_sized, reverse, sort (text only)")
    synth.set_defaults(func=_synth)

    stats = sub.add_parser("stats", help="sample/token/patch counts, histograms, packing efficiency, skipped samples")
    stats.add_argument(
        "sources", nargs="+", metavar="SOURCE", help="JSONL files, tar shards or globs (one source each)",
    )
    stats.add_argument("--seq-len", type=int, required=True, help="pack length in tokens (e.g. 4096)")
    stats.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: mindvl's small tokenizer)")
    stats.add_argument("--min-pixels", type=int, default=None, help="image resize floor in pixels (default 3136)")
    stats.add_argument("--max-pixels", type=int, default=None, help="image resize ceiling in pixels (default 1003520)")
    stats.add_argument("--pack-buffer", type=int, default=256, help="samples the packer looks ahead over (default 256)")
    stats.add_argument("--max-patches-per-pack", type=int, default=None,
                       help="vision-patch budget per pack (default: none)")
    stats.add_argument("--processor", default=None,
                       help="the vision processor that cuts the patches: qwen2_vl (default), qwen3_vl, or a model "
                       "folder (its preprocessor_config.json)")
    stats.add_argument("--json", action="store_true", help="print one JSON object")
    stats.set_defaults(func=_stats)

    plan = sub.add_parser("plan", help="tokens, vision share and epochs per source and category over a recipe's "
                          "budget, and the differences from the paper's data tables")
    plan.add_argument("recipe", help="a recipe YAML file (its data: section, phase.name and budget.max_tokens)")
    add_overrides(plan, "recipe overrides, as for `mindvl train` (e.g. budget.max_tokens=1e9)")
    plan.add_argument("--probe", type=int, default=200,
                      help="records read per local source to measure tokens per sample (default 200)")
    plan.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the recipe's, else mindvl's)")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=_plan)


def _synth(args: argparse.Namespace) -> int:
    from mindvl.data.synth import generate

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    path = generate(args.out, args.n, args.seed, tasks)
    print(f"wrote {args.n} samples to {path}")
    return 0


def _stats(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mindvl.data.image import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
    from mindvl.data.processors import as_processing, processing_from_folder
    from mindvl.data.stats import dataset_stats, format_stats

    if args.seq_len <= 0:
        raise ValueError(f"--seq-len must be > 0, got {args.seq_len}")
    processor = args.processor
    if processor is not None:
        processor = processing_from_folder(processor) if Path(processor).is_dir() else \
            as_processing(processor, "--processor")
    result = dataset_stats(
        args.sources,
        args.seq_len,
        tokenizer=args.tokenizer,
        min_pixels=args.min_pixels or DEFAULT_MIN_PIXELS,
        max_pixels=args.max_pixels or DEFAULT_MAX_PIXELS,
        pack_buffer=args.pack_buffer,
        max_patches_per_pack=args.max_patches_per_pack,
        processor=processor,
    )
    print(json.dumps(result) if args.json else format_stats(result))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pathlib import Path

    import yaml

    from mindvl.config import apply_override, yaml_problem
    from mindvl.data.plan import format_plan, plan_json, plan_recipe

    path = Path(args.recipe)
    if not path.is_file():
        raise FileNotFoundError(f"recipe not found: {path}")
    if args.probe <= 0:
        raise ValueError(f"--probe must be > 0, got {args.probe}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"recipe {path}: invalid YAML ({yaml_problem(exc)})") from None
    for item in args.overrides:
        apply_override(raw, item)
    plan = plan_recipe(raw, str(path), args.probe, args.tokenizer)
    print(plan_json(plan) if args.json else format_plan(plan), end="" if not args.json else "\n")
    return 0
