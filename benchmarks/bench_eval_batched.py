"""`mindvl eval`'s wall time on a synthetic set, before and after length-sorted batching and the static cache (issue
39), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_eval_batched.py [--n 500] [--batch-size 16] [--bench docvqa]
                                                              [--before-src DIR]

A tiny random MindVL folder (tests/tiny_mindvl.py's: hidden 64, 2 layers, 2-block tower) on mindvl's tokenizer and
one synthetic benchmark of --n items (mindvl.eval.synth_bench), evaluated with `evaluate_benchmark` at the runner's
settings (batch_size --batch-size, 32 new tokens at most, the items' own stop tokens). `after` is this checkout;
`before` (with --before-src DIR, e.g. `git archive 75f3c42 mindvl | tar -x -C DIR`) that commit's runner, in a
child process on the same folder and files. Both must write the same predictions, in the same order.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(folder: Path, bench: str, path: Path, out: Path, batch_size: int) -> float:
    from mindvl.eval.runner import EvalSettings, evaluate_benchmark
    from mindvl.infer import load_for_chat

    model, tok = load_for_chat(folder, device="cpu")
    settings = EvalSettings(min_pixels=4 * 784, max_pixels=64 * 784, system=None, batch_size=batch_size,
                            max_new_tokens=32)
    t = time.perf_counter()
    evaluate_benchmark(model, tok, bench, path, settings, out)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--bench", default="docvqa")
    ap.add_argument("--before-src", default=None)
    ap.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        folder, path, out, bench = args.child
        print(json.dumps({"seconds": run(Path(folder), bench, Path(path), Path(out), args.batch_size)}))
        return
    sys.path.insert(0, str(HERE.parent / "tests"))
    from tiny_mindvl import tiny_model_folder

    from mindvl.eval.runner import read_predictions
    from mindvl.eval.synth_bench import write_synthetic_benchmarks

    root = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    folder = tiny_model_folder(root / "model", 1)
    path = write_synthetic_benchmarks(root / "bench", n=args.n, seed=1, ocr_task="digits")[args.bench]
    print(f"load average {tuple(round(x, 1) for x in os.getloadavg())} on {os.cpu_count()} CPUs; {args.bench}, "
          f"{args.n} items, batch_size {args.batch_size}, <= 32 new tokens, 1 thread")
    seconds = {}
    if args.before_src:
        env = {**os.environ, "PYTHONPATH": args.before_src}
        res = subprocess.run([sys.executable, __file__, "--batch-size", str(args.batch_size), "--child",
                              str(folder), str(path), str(root / "before.jsonl"), args.bench], env=env,
                             capture_output=True, text=True, check=True)
        seconds["before"] = json.loads(res.stdout.strip().splitlines()[-1])["seconds"]
    seconds["after"] = run(folder, args.bench, path, root / "after.jsonl", args.batch_size)
    after = read_predictions(root / "after.jsonl")
    if args.before_src:
        before = read_predictions(root / "before.jsonl")
        same = [r["prediction"] for r in before] == [r["prediction"] for r in after]
        print(f"predictions identical, same order: {same and [r['id'] for r in before] == [r['id'] for r in after]}")
    for arm, s in seconds.items():
        print(f"{arm}: {s:.1f} s ({args.n / s:.1f} items/s)")
    print(f"load average after: {tuple(round(x, 1) for x in os.getloadavg())}; files in {root}")


if __name__ == "__main__":
    main()
