"""Calibrate the quickstart's estimate (`QUICKSTART_COST` in mindvl/quickstart_plan.py) from a real run.

    python benchmarks/calibrate_quickstart.py OUT [--fast] [--family qwen3-vl]

Runs the quickstart into OUT (a fresh folder: data generation counts) and, on a shared machine whose load changes
within a minute, measures both probes again right before and after every stage, so each stage is priced in the
speed of its own moment rather than the one at start. Per training phase it splits the stage's wall time into its
steps (metrics.jsonl's step_time_s) and the rest (start-up, checkpoint, export), and prints:

    median step / step probe     -> QUICKSTART_COST["step"][phase]
    (first step - median) / probe -> "first_step"
    rest / host probe            -> "phase_fixed" (the first phase's excess over the others: "first_phase")
    merge, search rest / host    -> "merge", "search_fixed" + checkpoint loads; search items / probe -> "eval_item"

The probes add a few seconds per stage, so OUT's own wall time is not the quickstart's; the per-stage figures are.
Writes OUT/calibration.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mindvl.quickstart as qs
from mindvl.config import load_recipe
from mindvl.quickstart_plan import StagePlan, cpu_share, host_probe, step_probe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--fast", action="store_true")
    ap.add_argument("--family", choices=("qwen2.5-vl", "qwen3-vl"), default="qwen2.5-vl")
    args = ap.parse_args()
    recipes = qs.recipe_dir() if args.family == "qwen2.5-vl" else qs.recipe_dir().parent / "tiny-qwen3-vl"
    probe_recipe = load_recipe(recipes / "multitask.yaml",
                               qs.capped_sources(recipes / "multitask.yaml", qs.FAST["synth_cap"]) if args.fast else [])
    probes: dict[str, dict[str, float]] = {}
    begin, end = StagePlan.begin, StagePlan.end

    def probed_begin(self, name):
        probes[name] = {"step_before": step_probe(probe_recipe), "host_before": host_probe(share=cpu_share())}
        begin(self, name)

    def probed_end(self, name):
        end(self, name)
        probes[name].update(step_after=step_probe(probe_recipe), host_after=host_probe(share=cpu_share()),
                            wall=time.time())

    StagePlan.begin, StagePlan.end = probed_begin, probed_end
    fast = {"bench_items": qs.FAST["bench_items"], "grid": qs.FAST["grid"]} if args.fast else {}
    qs.quickstart(args.out, recipes, fast=args.fast, **fast)
    timing = json.loads((Path(args.out) / "quickstart.json").read_text())["timing"]
    rows = {}
    for name, st in timing["stages"].items():
        if name not in probes or st["seconds"] is None:
            continue
        p = probes[name]
        step_s = statistics.mean([p["step_before"], p["step_after"]])
        host_s = statistics.mean([p["host_before"], p["host_after"]])
        row = {"seconds": st["seconds"], "estimate": st["estimate"], "step_s": round(step_s, 4),
               "host_s": round(host_s, 5)}
        if "steps_s" in st:
            rest = st["seconds"] - st["steps_s"]
            row.update(step_units=round(st["median_step_s"] / step_s, 2),
                       first_step_units=round((st["first_step_s"] - st["median_step_s"]) / step_s, 2),
                       fixed_host_units=round(rest / host_s))
        else:
            row.update(host_units=round(st["seconds"] / host_s), step_units_total=round(st["seconds"] / step_s, 1))
        rows[name] = row
        print(name, row)
    (Path(args.out) / "calibration.json").write_text(json.dumps({"probes": probes, "stages": rows}, indent=1))


if __name__ == "__main__":
    main()
