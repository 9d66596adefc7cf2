"""The planner against reality: per-rank peak predicted on a fake cluster vs measured on real gloo processes.

For 1, 2 and 4 CPU processes, activation checkpointing on and off, 2 micro-batches per rank (global batch
2 x world), bf16 compute with FSDP's policy: `mindvl plan --sample-data` (fake tensors, same packs as rank 0 reads)
against `python -m mindvl.plan.validate` (real tensors, the same tracker; and the process's peak-RSS increase).

    python benchmarks/bench_plan_vs_real.py [--worlds 1 2 4] [--seq-len 2048]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ARCH = {"text": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 64, "mrope_section": [8, 12, 12]},
        "vision": {"depth": 4, "hidden_size": 128, "intermediate_size": 256, "num_heads": 2,
                   "fullatt_block_indexes": [3]}}


def recipe(tmp: Path, world: int, ac: bool, seq_len: int) -> dict:
    return {"output_dir": str(tmp / "out"), "model": {"arch": ARCH},
            "data": {"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 64, "seed": 3}}], "seq_len": seq_len,
                     "max_pixels": 256 * 28 * 28, "min_pixels": 64 * 28 * 28, "pack_buffer": 16,
                     "synth_cache": str(tmp / "cache"), "default_system": None},
            "phase": {"name": "multitask"}, "batch": {"global_batch_size": 2 * world}, "budget": {"max_steps": 1},
            "parallel": {"mixed_precision": "bf16", "activation_checkpointing": ac}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real(path: Path, world: int) -> dict:
    mod = ["-m", "mindvl.plan.validate", str(path)]
    cmd = [sys.executable, *mod] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
        str(free_port()), *mod]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def planned(path: Path, world: int) -> dict:
    cmd = [sys.executable, "-c", "import sys; from mindvl.cli import main; sys.exit(main())", "plan", str(path),
           "--world-size", str(world), "--device", "h100-80g", "--sample-data", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--seq-len", type=int, default=2048)
    args = ap.parse_args()
    mib = 2**20
    print(f"load: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}")
    print("| ranks | AC | planned peak MiB | real peak MiB (tracker) | planned / real | real RSS increase MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for world in args.worlds:
            for ac in (True, False):
                path = tmp / f"w{world}_{ac}.yaml"
                path.write_text(yaml.safe_dump(recipe(tmp, world, ac, args.seq_len)))
                t0 = time.perf_counter()
                p = planned(path, world)
                r = real(path, world)
                ratio = p["peak_bytes_per_rank"] / r["peak_bytes"]
                print(f"| {world} | {'on' if ac else 'off'} | {p['peak_bytes_per_rank'] / mib:.1f} | "
                      f"{r['peak_bytes'] / mib:.1f} | {ratio:.3f} | {r['rss_increase_bytes'] / mib:.1f} |", flush=True)
                print(f"<!-- planned {json.dumps({k: round(v / mib, 1) for k, v in p['breakdown'].items()})} real "
                      f"{json.dumps({k: round(v / mib, 1) for k, v in r['breakdown'].items()})} "
                      f"{time.perf_counter() - t0:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
