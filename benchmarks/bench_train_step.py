"""Tiny-recipe training speed: real tokens/s packed vs padded, and time per step split into data, forward,
backward and optimizer. Runs short `mindvl train` phases in-process and reads their metrics.jsonl.

    python benchmarks/bench_train_step.py [--steps 12] [--recipe recipes/tiny/multitask.yaml]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from mindvl.config import load_recipe
from mindvl.train.trainer import train


def measure(recipe_path: str, steps: int, out: Path, cache: Path, padded: bool) -> dict:
    overrides = [f"output_dir={out}", f"max_steps={steps}", f"data.synth_cache={cache}", "checkpoint.every=null",
                 "logging.progress=false", "logging.tensorboard=false", "logging.plot=false",
                 f"data.pad_to_seq_len={'true' if padded else 'false'}"]
    if padded:
        # Padded batching: one sample per row, padded to seq_len (what a dense [B, T] trainer does).
        overrides.append("data.pack_buffer=1")
    train(load_recipe(recipe_path, overrides))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][2:]  # skip warm-up steps
    real_tokens = sum(r["tokens"] - p["tokens"] for p, r in zip(recs, recs[1:], strict=False))
    wall = sum(r["step_time_s"] for r in recs[1:])
    return {"real_tokens_per_s": real_tokens / wall,
            **{k: statistics.median(r[k] for r in recs) for k in ("data_s", "forward_s", "backward_s", "optimizer_s",
                                                                    "step_time_s")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--recipe", default="recipes/tiny/multitask.yaml")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        packed = measure(args.recipe, args.steps, tmp / "packed", tmp / "synth", padded=False)
        padded = measure(args.recipe, args.steps, tmp / "padded", tmp / "synth", padded=True)
    print(f"{'':>8} {'tokens/s':>10} {'step s':>8} {'data':>7} {'fwd':>7} {'bwd':>7} {'optim':>7}")
    for name, r in (("packed", packed), ("padded", padded)):
        print(f"{name:>8} {r['real_tokens_per_s']:>10.0f} {r['step_time_s']:>8.3f} {r['data_s']:>7.3f} "
              f"{r['forward_s']:>7.3f} {r['backward_s']:>7.3f} {r['optimizer_s']:>7.3f}")
    print(f"packed/padded real tokens/s: {packed['real_tokens_per_s'] / padded['real_tokens_per_s']:.2f}x")


if __name__ == "__main__":
    main()
