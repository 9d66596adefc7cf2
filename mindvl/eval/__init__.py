"""mindvl.eval: score a model the way lmms-eval and VLMEvalKit do (ARCHITECTURE.md §2).

Modules (imported on demand; this package imports nothing heavy itself):
    scorers      pure scoring functions, lmms-eval's rules by default and VLMEvalKit's with `toolkit="vlmevalkit"`
                 (anls, relaxed_accuracy, ocrbench_hit, mme_yes_no, mme_score, mmbench_extract, mmbench_circular)
    benchmarks   local benchmark files (HF parquet as lmms-eval reads them, VLMEvalKit TSV): `BENCHMARKS[name]`
                 gives `load(path, toolkit)` -> stream of `BenchItem`, `score_item`, `summarise`, `generation`;
                 `parse_bench_args(["ocrbench=/path", ...])`
    synth_bench  `write_synthetic_benchmarks(out_dir, n, seed)`: held-out OCRBench/ChartQA/DocVQA parquet files made
                 from `mindvl.data.synth`'s generators, for the quickstart

The rules are those written down in docs/eval-scoring.md (cited as "§N" and "eval-scoring.md" in docstrings): the
team's reading of the toolkits' scoring code, with the commits read and golden vectors (§9).
"""
