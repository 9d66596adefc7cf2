"""Curation throughput on 1 and 2 local workers and on Ray Data with 2 workers, and memory against corpus size.

Wall seconds inside a stage include time a worker waits for a core, so on a shared machine they show contention;
records per CPU-second (process time) show the stage's own cost, independent of the engine.

Corpus: `mindvl.curate.synth.pairs_corpus` (160x160 PNG/JPEG images, 30% planted duplicates) in `--files` JSONL
files, one shard each. Pipeline: image_filter -> text_filter -> phash_dedup -> embed (thumbnail) -> cluster
(k-means, variance-proportional sampling to half the corpus). Arms alternate round by round; the best round of each
is reported. Per stage: records entering it / seconds spent in it summed over workers (per-worker rate); per arm:
wall-clock records/s of the whole run (driver plans included) and the ratio to one worker. Ray is started once before
timing (its start-up is not curation work).

`--memory`: peak RSS of a one-process run on corpora of N and 4N records (fresh process each): flat when streaming.

    python benchmarks/bench_curate_throughput.py --n 2000 --rounds 2
    python benchmarks/bench_curate_throughput.py --memory --n 1000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from mindvl.curate import PipelineConfig, run_pipeline
from mindvl.curate.synth import pairs_corpus

STAGES = [{"image_filter": {"min_side": 16}}, {"text_filter": {"min_words": 3}}, {"phash_dedup": {"max_distance": 8}},
          {"embed": {"thumbnail": 8}}]


def pipeline(files, out, n, engine):
    stages = [*STAGES, {"cluster": {"k": 16, "target": n // 2, "floor": 5}}]
    return PipelineConfig.from_dict({"inputs": files, "output": out, "stages": stages, "engine": engine,
                                     "batch_size": 64})


def one_run(files, out, n, engine) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    run_pipeline(pipeline(files, out, n, engine))
    wall = time.perf_counter() - t0
    report = json.load(open(os.path.join(out, "report.json")))
    return {"wall": wall, "stages": {k: (v["in"], v["seconds"], v["cpu_seconds"]) for k, v in report["stages"].items()}}


def memory_child(n: int, tmp: str) -> None:
    truth = pairs_corpus(os.path.join(tmp, f"in{n}"), n, n_files=4, seed=0)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    one_run(truth.files, os.path.join(tmp, f"out{n}"), n, {"name": "inprocess"})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    size = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(os.path.join(tmp, f"in{n}")) for f in fs)
    print(json.dumps({"n": n, "corpus_mb": size / 2**20, "peak_rss_mb": peak / 1024,
                      "rss_before_run_mb": base / 1024}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--no-ray", action="store_true")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--memory-child", type=int, default=None)
    ap.add_argument("--tmp", default=None)
    args = ap.parse_args()
    if args.memory_child is not None:
        memory_child(args.memory_child, args.tmp)
        return
    tmp = tempfile.mkdtemp(prefix="bench-curate-")
    try:
        if args.memory:
            for n in (args.n, 4 * args.n):
                out = subprocess.run([sys.executable, __file__, "--memory-child", str(n), "--tmp", tmp],
                                     capture_output=True, text=True, check=True).stdout
                print(out.strip().splitlines()[-1])
            return
        truth = pairs_corpus(os.path.join(tmp, "in"), args.n, n_files=args.files, seed=0)
        n_records = len(truth.names)
        arms = {"local x1": {"name": "local", "workers": 1}, "local x2": {"name": "local", "workers": 2}}
        if not args.no_ray:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                     runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}})
            arms["ray x2"] = {"name": "ray", "workers": 2}
            one_run(truth.files, os.path.join(tmp, "warm"), args.n, arms["ray x2"])  # Ray workers start once
        results: dict[str, list[dict]] = {a: [] for a in arms}
        for _ in range(args.rounds):
            for arm, engine in arms.items():
                results[arm].append(one_run(truth.files, os.path.join(tmp, "out"), args.n, engine))
        best = {arm: min(rs, key=lambda r: r["wall"]) for arm, rs in results.items()}
        print(f"corpus: {n_records} records in {args.files} shards; rounds {args.rounds}; best round per arm")
        print("| arm | wall s (rounds) | records/s | vs local x1 |")
        print("|---|---|---|---|")
        for arm, r in best.items():
            walls = ", ".join(f"{x['wall']:.1f}" for x in results[arm])
            print(f"| {arm} | {r['wall']:.1f} ({walls}) | {n_records / r['wall']:.0f} | "
                  f"{best['local x1']['wall'] / r['wall']:.2f}x |")
        labels = list(best["local x1"]["stages"])
        print("\nper stage: records/s per worker (records in / wall seconds in the stage, summed over workers) and "
              "records per CPU-second")
        print("| stage | " + " | ".join(f"{a} wall | {a} CPU" for a in arms) + " |")
        print("|---|" + "---|---|" * len(arms))
        for label in labels:
            cells = []
            for arm in arms:
                n_in, sec, cpu = best[arm]["stages"].get(label, (0, 0.0, 0.0))
                cells += [f"{n_in / sec:.0f}" if sec > 0 else "-", f"{n_in / cpu:.0f}" if cpu > 0 else "-"]
            print(f"| {label} | " + " | ".join(cells) + " |")
        print("load:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
