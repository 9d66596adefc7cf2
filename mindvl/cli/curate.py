"""`mindvl curate PIPELINE.yaml`: filter, deduplicate, cluster, sample and OCR-annotate a corpus (mindvl.curate)."""

from __future__ import annotations

import logging


def register(subparsers) -> None:
    p = subparsers.add_parser("curate", help="run a data-curation pipeline (filters, dedup, clustering + "
                                             "variance sampling, OCR) into trainable shards and a report")
    p.add_argument("pipeline", metavar="PIPELINE.yaml", help="the pipeline file (see recipes/curation/)")
    p.add_argument("--inputs", nargs="+", default=None, metavar="PATH",
                   help="input files or globs (override the file's `inputs`)")
    p.add_argument("--output", default=None, help="output folder (overrides the file's `output`)")
    p.add_argument("--engine", choices=("inprocess", "local", "ray"), default=None,
                   help="where shards run (default: the file's engine; `local` when --workers > 1)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (local) or Ray workers")
    p.add_argument("--address", default=None, help="Ray: address of an existing cluster (default: start one)")
    p.add_argument("--seed", type=int, default=None, help="override the file's seed")
    p.set_defaults(func=run)


def run(args) -> int:
    from mindvl.curate import PipelineConfig, run_pipeline

    overrides = {"inputs": args.inputs, "output": args.output, "seed": args.seed}
    cfg = PipelineConfig.load(args.pipeline, overrides)
    engine = cfg.engine
    if args.workers is not None:
        engine.workers = args.workers
        if args.engine is None and engine.name == "inprocess" and args.workers > 1:
            engine.name = "local"
    if args.engine is not None:
        engine.name = args.engine
    if args.address is not None:
        engine.address = args.address
    from mindvl.curate.pipeline import check_engine

    check_engine(engine, "--engine/--workers")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        result = run_pipeline(cfg)
    except ImportError as exc:  # an optional extra is missing: say which, in one line
        raise ValueError(str(exc)) from exc
    ran = (f"{result.shards_run} shard-passes run" if result.shards_run
           else "nothing left to do (resumed a finished run)")
    print(f"curated {cfg.output}: {sum(d['written'] for d in result.done[-1])} records in "
          f"{len(result.done[-1])} shards; {ran}; {result.seconds:.1f} s; report: {result.out}/report.md")
    return 0
