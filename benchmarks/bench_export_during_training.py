"""`mindvl export RUN` while `RUN` trains with `checkpoint_every=1 checkpoint.keep=1` (the pruner deletes the
previous checkpoint after every step): how many exports succeed, how many print one line (exit 2), how many print
anything longer (a traceback: the bug this guards against).

Each export is a separate `mindvl export` process, as a user would run it. `--no-pin` runs the exports with the
reader pin disabled (`dcp_io.pinned` patched to pin nothing): what remains then is the retry on the next `latest`.

    python benchmarks/bench_export_during_training.py --exports 60
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))
from train_helpers import env, latest_name, mindvl_cmd, raw_recipe, training_in_background, write_recipe  # noqa: E402

NO_PIN = ("import contextlib, sys; import mindvl.checkpoint.training as t; "
          "t.pinned = contextlib.contextmanager(lambda folder: (yield True)); "
          "from mindvl.cli import main; sys.exit(main())")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exports", type=int, default=60)
    ap.add_argument("--no-pin", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        out = tmp / "run"
        raw = raw_recipe(out, tmp / "cache", budget={"max_steps": 100000}, checkpoint={"every": 1, "keep": 1})
        recipe = write_recipe(tmp / "r.yaml", raw)
        with training_in_background(recipe, out) as trainer:
            ok = one_line = longer = 0
            seen, lines = set(), []
            t0 = time.perf_counter()
            for i in range(args.exports):
                seen.add(latest_name(out))
                cmd = mindvl_cmd("export", str(out), "--out", str(tmp / "exp"), "--overwrite")
                if args.no_pin:
                    cmd = [sys.executable, "-c", NO_PIN, *cmd[3:]]
                done = subprocess.run(cmd, env=env(), capture_output=True, text=True)
                err = [line for line in done.stderr.splitlines() if line.strip()]
                if done.returncode == 0:
                    ok += 1
                elif done.returncode == 2 and len(err) == 1:
                    one_line += 1
                    lines.append(err[0])
                else:
                    longer += 1
                    lines.append(f"rc {done.returncode}, {len(err)} lines, last: {err[-1] if err else ''}")
                if trainer.poll() is not None:
                    raise SystemExit(f"training stopped after export {i + 1}: {trainer.stderr.read()[-2000:]}")
            wall = time.perf_counter() - t0
    print(f"{args.exports} exports ({'no pin' if args.no_pin else 'pinned'}) during a checkpoint_every=1 keep=1 run, "
          f"{len(seen)} distinct `latest` seen, {wall:.0f} s: {ok} succeeded, {one_line} one-line errors, "
          f"{longer} longer outputs")
    for line in lines[:5]:
        print("  ", line)
    print("load:", os.getloadavg())


if __name__ == "__main__":
    main()
