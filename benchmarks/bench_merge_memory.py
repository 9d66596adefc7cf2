"""Peak memory of `mindvl merge` (streaming, tensor by tensor) against the inputs' size and the largest tensor.

    python benchmarks/bench_merge_memory.py [--inputs 3] [--hidden 1024] [--layers 8] [--vocab 32000] [--dtype bf16]

Writes `--inputs` random checkpoints of a text-only Qwen3-shaped mindvl model (the defaults: ~166M parameters,
~333 MB each in bf16, several shards), then merges them in a fresh subprocess and reports that process's peak RSS
increase: VmHWM after the merge (reset just before it) minus the RSS then, so the torch/mindvl imports are not
counted. For contrast, a second fresh subprocess does the naive merge: load every input fully, average, save. torch
allocations are invisible to tracemalloc, hence RSS in separate processes. Both outputs are compared at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status: VmRSS (resident now) or VmHWM (peak resident)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (this benchmark needs Linux)")


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); the peak then covers only what follows."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------------------ child processes


def child(mode: str, inputs: list[str], out: str) -> None:
    """Run one merge and print {'before', 'peak', 'seconds'} as JSON (runs in a fresh interpreter)."""
    from mindvl.checkpoint.merge import merge_checkpoints

    # VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so it would start at the parent's size.
    reset = reset_peak()
    before, t = status_bytes("VmRSS"), time.perf_counter()
    if mode == "streaming":
        merge_checkpoints(inputs, out)
    else:
        naive_merge(inputs, out)
    print(json.dumps({"before": before, "reset": reset, "peak": status_bytes("VmHWM"),
                      "seconds": time.perf_counter() - t}))


def naive_merge(inputs: list[str], out: str) -> None:
    """The obvious way: every input state dict in memory, then the average (the baseline, not mindvl's method)."""
    from safetensors.torch import save_file

    from mindvl.checkpoint import TensorFolder

    states = [dict(TensorFolder(p).iter_tensors()) for p in inputs]
    merged = {}
    for name, first in states[0].items():
        acc = sum(s[name].float() for s in states) / len(states)
        merged[name] = acc.to(first.dtype)
    Path(out).mkdir()
    save_file(merged, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})


def run_child(mode: str, inputs: list[Path], out: Path) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--out", str(out), *map(str, inputs)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------- setup


def build_inputs(folder: Path, n: int, args) -> tuple[list[Path], int, int]:
    """`n` random checkpoints written tensor by tensor; returns their folders, total bytes, largest tensor bytes."""
    from mindvl.checkpoint.hf import expected_shapes
    from mindvl.checkpoint.safetensors_io import StreamingShardWriter
    from mindvl.models import MindVLConfig, TextConfig

    text = TextConfig(family="qwen3", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                      head_dim=64)
    config = MindVLConfig(text=text)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    plan = [(name, dtype, shape) for name, shape in expected_shapes(config).items()]
    paths, total = [], 0
    for i in range(n):
        path = folder / f"ckpt{i}"
        gen = torch.Generator().manual_seed(i)
        with StreamingShardWriter(path, plan, max_shard_bytes=args.shard_mb * 2**20) as writer:
            for name, _, shape in plan:
                writer.add(name, (torch.randn(shape, generator=gen) * 0.02).to(dtype))
            writer.close()
        (path / "config.json").write_text(json.dumps(config.to_dict()))
        total += writer.total_bytes
        paths.append(path)
    largest = max(torch.Size(shape).numel() for _, _, shape in plan) * dtype.itemsize
    return paths, total, largest


def compare(streaming: Path, naive: Path) -> float:
    from mindvl.checkpoint import TensorFolder

    ref = TensorFolder(naive)
    out = TensorFolder(streaming)
    return max(float((t.float() - ref.get(name).float()).abs().max()) for name, t in out.iter_tensors())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inputs", type=int, default=3)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--shard-mb", type=int, default=128, help="input shard size")
    p.add_argument("--workdir", default=None, help="where to write the checkpoints (default: a temporary folder)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.paths, args.out)
        return

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_merge_"))
    try:
        t = time.perf_counter()
        inputs, total, largest = build_inputs(work, args.inputs, args)
        print(f"{args.inputs} inputs x {total / args.inputs / 1e6:.0f} MB ({args.dtype}) = {total / 1e6:.0f} MB; "
              f"largest tensor {largest / 1e6:.1f} MB; written in {time.perf_counter() - t:.1f} s")
        rows = {}
        for mode in ("streaming", "naive"):
            rows[mode] = run_child(mode, inputs, work / f"out_{mode}")
        print(f"{'merge':<10} {'seconds':>8} {'peak RSS increase':>18} {'/ total inputs':>15} {'/ largest tensor':>17}")
        inc = {mode: r["peak"] - r["before"] for mode, r in rows.items()}
        for mode, r in rows.items():
            if not r["reset"]:
                print(f"note: could not reset the {mode} peak; it includes the imports (an upper bound)")
            print(f"{mode:<10} {r['seconds']:>8.1f} {inc[mode] / 1e6:>15.0f} MB {inc[mode] / total:>15.3f} "
                  f"{inc[mode] / largest:>17.1f}")
        diff = compare(work / "out_streaming", work / "out_naive")
        print(f"streaming / naive peak increase: {inc['streaming'] / inc['naive']:.3f}; "
              f"max |streaming - naive| = {diff:.2e}")
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
