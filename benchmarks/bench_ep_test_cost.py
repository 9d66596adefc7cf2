"""Cost of the slow EP end-to-end test (tests/train/test_expert_parallel.py, 11 rank processes over 4 launches):
its ranks with and without the CPU matmul peak probe that `mindvl train` runs for the MFU log line, interleaved.
The arms differ only in MINDVL_PEAK_TFLOPS, which the rank processes inherit: unset, every rank probes; set (as
tests/conftest.py does for the whole suite), none does.

    flock /work/lead/measure.lock env PYTHONPATH=$PWD python benchmarks/bench_ep_test_cost.py --reps 2

Prints per-arm wall seconds and CPU seconds of the child processes (median, min..max) and the ratios.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "train"))

import test_expert_parallel as ep  # noqa: E402

from mindvl.train.metrics import PEAK_ENV  # noqa: E402

ARMS = {"probe (MINDVL_PEAK_TFLOPS unset)": None, "no probe (MINDVL_PEAK_TFLOPS=0.1, as the tests)": "0.1"}


def run_once(peak: str | None) -> tuple[float, float]:
    if peak is None:
        os.environ.pop(PEAK_ENV, None)
    else:
        os.environ[PEAK_ENV] = peak
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ep.test_ep_training_equals_one_process_and_resumes_across_ep_sizes(Path(tmp))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return time.perf_counter() - t0, cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    results: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    for _ in range(args.reps):
        for arm, peak in ARMS.items():
            results[arm].append(run_once(peak))
            print(f"{arm}: wall {results[arm][-1][0]:.1f} s, cpu {results[arm][-1][1]:.1f} s", flush=True)
    med = {}
    for arm, rows in results.items():
        walls, cpus = [r[0] for r in rows], [r[1] for r in rows]
        med[arm] = (statistics.median(walls), statistics.median(cpus))
        print(f"| {arm} | {med[arm][0]:.1f} s ({min(walls):.1f}..{max(walls):.1f}) | "
              f"{med[arm][1]:.1f} CPU-s ({min(cpus):.1f}..{max(cpus):.1f}) |")
    a, b = med.values()
    print(f"ratio probe / no probe: wall {a[0] / b[0]:.2f}x, CPU {a[1] / b[1]:.2f}x")


if __name__ == "__main__":
    main()
