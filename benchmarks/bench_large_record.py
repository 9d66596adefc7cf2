"""Peak memory and time with one huge record in the corpus (issue 21: bounded records).

Before the record byte limit, one 50 MB JSONL line was parsed whole and tokenized whole before being cut to seq_len:
325 s and 14 GB RSS. Now a line over `data.max_record_bytes` (default: 256 bytes per token of seq_len, at least
1 MiB) is skipped unparsed (`record_too_large`, counted in the data report), and a record under it has its text
tokenized only as far as seq_len needs.

Arms, each in its own subprocess (peak RSS: the child's own ru_maxrss; wall time around the child), side by side:
  clean   the corpus: short chat records
  huge    the same corpus with one 50 MB line as line 3
  raised  (loader mode only) the huge corpus with max_record_bytes raised above the line: the line is parsed whole
          (50 MB of JSON), but still tokenized only as far as seq_len needs
Modes: `loader` iterates the data loader alone (60 packs at seq_len 1024, most of one epoch); `train` runs
`mindvl train` on the tiny text recipe for 3 steps (model, optimizer, one rank).

    python benchmarks/bench_large_record.py                      # both modes, 50 MB
    python benchmarks/bench_large_record.py --mode loader --mb 50 --repeats 3
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

import yaml

REPO = Path(__file__).resolve().parents[1]
CLI = "import sys; from mindvl.cli import main; sys.exit(main())"


def write_corpus(path: Path, n: int, huge_mb: float) -> None:
    with open(path, "w") as f:
        for i in range(n):
            rec = {"messages": [{"role": "user", "content": f"Reverse the number {i:05d}."},
                                {"role": "assistant", "content": f"{i:05d}"[::-1]}]}
            f.write(json.dumps(rec) + "\n")
            if i == 1 and huge_mb:
                size = int(huge_mb * 2**20)
                text = ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]
                huge = {"messages": [{"role": "user", "content": "Tell me everything."},
                                     {"role": "assistant", "content": text}]}
                f.write(json.dumps(huge) + "\n")


def child_loader(corpus: str, limit: int | None) -> None:
    from mindvl.data import DataConfig, build_loader

    d = {"sources": [corpus], "seq_len": 1024, "pack_buffer": 64, "default_system": None}
    if limit:
        d["max_record_bytes"] = limit
    loader = build_loader(DataConfig.from_dict(d))
    for k, _ in enumerate(loader):
        if k + 1 == 60:
            break
    print(json.dumps(loader.report()["skipped"]))


def recipe_for(corpus: str, out: Path) -> Path:
    raw = yaml.safe_load((REPO / "recipes" / "tiny" / "text.yaml").read_text())
    raw["output_dir"] = str(out)
    raw["data"]["sources"] = [{"path": corpus}]
    raw["budget"] = {"max_steps": 3}
    raw["checkpoint"] = {"every": None}
    raw["logging"] = {"progress": False, "tensorboard": False, "plot": False}
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def run_arm(cmd: list[str]) -> tuple[float, float, str]:
    """(peak RSS in MiB, wall seconds, stdout) of one child process."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault("MINDVL_PEAK_TFLOPS", "0.1")  # no matmul probe for the MFU line
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"arm failed ({' '.join(cmd[-3:])}): {err[-2000:]}")
    rss_line = [line for line in err.splitlines() if line.startswith("MAXRSS_KB ")][-1]
    return int(rss_line.split()[1]) / 1024, wall, out


def wrapped(args: list[str]) -> list[str]:
    """Run `args` (python arguments) in a child whose last stderr line is its own peak RSS (ru_maxrss, KiB)."""
    code = ("import resource, runpy, sys, atexit\n"
            "atexit.register(lambda: print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
            "file=sys.stderr))\n"
            f"sys.argv = {args!r}\n"
            "runpy.run_path(sys.argv[0], run_name='__main__') if sys.argv[0].endswith('.py') else "
            "exec(sys.argv.pop(1))\n")
    return [sys.executable, "-c", code]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=float, default=50.0, help="size of the huge line (MiB)")
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--mode", choices=["loader", "train", "both"], default="both")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--child", choices=["loader"], help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "loader":
        child_loader(args.corpus, args.limit or None)
        return

    tmp = Path(tempfile.mkdtemp(prefix="mindvl_bench_large_"))
    clean, huge = tmp / "clean.jsonl", tmp / "huge.jsonl"
    write_corpus(clean, args.records, 0)
    write_corpus(huge, args.records, args.mb)
    print(f"corpus: {args.records} short chats ({clean.stat().st_size / 2**20:.2f} MiB); huge: the same plus one "
          f"{args.mb:g} MiB line ({huge.stat().st_size / 2**20:.1f} MiB); load: {os.getloadavg()[0]:.1f}")
    modes = ["loader", "train"] if args.mode == "both" else [args.mode]
    script = str(Path(__file__).resolve())
    for mode in modes:
        arms = {"clean": clean, "huge": huge}
        if mode == "loader":
            arms["raised"] = huge
        results: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
        skipped = {}
        for rep in range(args.repeats):
            for arm, corpus in arms.items():  # interleaved, so load changes hit every arm alike
                if mode == "loader":
                    limit = int(args.mb * 2**20) + 2**20 if arm == "raised" else 0
                    cmd = wrapped([script, "--child", "loader", "--corpus", str(corpus), "--limit", str(limit)])
                    rss, wall, out = run_arm(cmd)
                    skipped[arm] = json.loads(out.strip().splitlines()[-1])
                else:
                    run_dir = tmp / f"run_{arm}_{rep}"
                    rss, wall, _ = run_arm(wrapped(["-c", CLI, "train", str(recipe_for(str(corpus), run_dir))]))
                    skipped[arm] = json.loads((run_dir / "data_report.json").read_text())[0]["skipped"]
                results[arm].append((rss, wall))
        print(f"\nmode {mode} (load now {os.getloadavg()[0]:.1f})")
        print(f"{'arm':8} {'peak RSS MiB':>13} {'wall s':>8}  skipped")
        for arm, rows in results.items():
            rss = max(r for r, _ in rows)
            wall = min(w for _, w in rows)
            print(f"{arm:8} {rss:13.0f} {wall:8.2f}  {skipped[arm]}")
        base_rss = max(r for r, _ in results["clean"])
        base_wall = min(w for _, w in results["clean"])
        for arm in list(arms)[1:]:
            rss = max(r for r, _ in results[arm])
            wall = min(w for _, w in results[arm])
            print(f"{arm} / clean: RSS {rss / base_rss:.2f}x (+{rss - base_rss:.0f} MiB), time {wall / base_wall:.2f}x")
    for p in sorted(tmp.rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    tmp.rmdir()


if __name__ == "__main__":
    main()
