"""Greedy decode rate before and after the static KV cache (issue 39), side by side in one run.

    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py [--new 64] [--reps 3] [--batches 1,8]
                                                          [--before-src DIR] [--compiled]

A random text model (Qwen2 layout: hidden 256, 4 layers, GQA 8/2, vocab 4096), fp32 on CPU, prompts of 40..160
tokens with per-prompt budgets (one in four stops at half its budget: masked rows and compaction happen). Arms:

- `static`: `generate` (the static cache, device-side bookkeeping, one read per 8 steps);
- `eager`: `generate(engine="eager")`, the loop as it was before (reads every step, drops finished rows at once),
  on the static cache;
- `compiled`: with `--compiled`, `generate(compile=True)`: the static cache with the decoder layers compiled by
  inductor (C++ kernels on the CPU; mindvl.infer.decode_compile), its compilation in the warm-up call;
- `before`: with `--before-src DIR` (a checkout of the commit before issue 39, e.g. `git archive 75f3c42 mindvl |
  tar -x -C DIR`), that commit's `generate`, in a child process on the same model and prompts.

Tokens/s counts the generated tokens (after the prefill's, which every arm shares). Arms run interleaved; medians
and min..max over --reps; every arm must produce the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from mindvl.infer import Prompt, generate
from mindvl.models import MindVL, MindVLConfig, TextConfig


def build() -> MindVL:
    text = TextConfig(family="qwen2", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=32)
    model = MindVL(MindVLConfig(text=text, vision=None, image_token_id=4000, video_token_id=4001,
                                vision_start_token_id=4002, vision_end_token_id=4003))
    model.init_weights(seed=0, std=0.05)
    return model.eval()


def workload(batch: int, new: int) -> tuple[list[Prompt], list[int]]:
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(40, 161, (batch,), generator=gen).tolist()
    prompts = [Prompt(torch.randint(0, 3900, (n,), generator=gen)) for n in lengths]
    budgets = [new // 2 if i % 4 == 3 else new for i in range(batch)]
    return prompts, budgets


ARMS = {"static": {}, "eager": {"engine": "eager"}, "compiled": {"compile": True}}  # generate's keywords per arm


def timed(batch: int, new: int, arm: str | None) -> tuple[float, list[list[int]]]:
    model = build()
    prompts, budgets = workload(batch, new)
    kw = {} if arm is None else ARMS[arm]
    generate(model, prompts, 2, **kw)  # warm-up
    t = time.perf_counter()
    out = generate(model, prompts, budgets, **kw)
    return time.perf_counter() - t, out


def prefill_seconds(batch: int) -> float:
    model = build()
    prompts, _ = workload(batch, 1)
    generate(model, prompts, 1)
    t = time.perf_counter()
    generate(model, prompts, 1)
    return time.perf_counter() - t


def child(batch: int, new: int) -> None:
    """Runs in the child with the old source first on sys.path: one timing of that commit's generate."""
    seconds, out = timed(batch, new, None)
    print(json.dumps({"seconds": seconds, "out": out}))


def before(src: str, batch: int, new: int) -> tuple[float, list[list[int]]]:
    env = {**os.environ, "PYTHONPATH": src}
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import bench_generate as b; b.child({batch}, {new})")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    data = json.loads(res.stdout.strip().splitlines()[-1])
    return data["seconds"], data["out"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--before-src", default=None, help="a checkout of the commit before the static cache")
    ap.add_argument("--compiled", action="store_true", help="add the arm with the layers compiled (inductor)")
    args = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); load average "
          f"{tuple(round(x, 1) for x in os.getloadavg())} on {os.cpu_count()} CPUs; {args.new} new tokens, fp32")
    arms = ["static", "eager"] + (["compiled"] if args.compiled else []) + (["before"] if args.before_src else [])
    base = "before" if args.before_src else "eager"
    extra = " compiled / static |" if args.compiled else ""
    print("| batch | " + " | ".join(f"{a} tokens/s" for a in arms) + f" | static / {base} |" + extra)
    print("| --- " * (len(arms) + 2 + bool(extra)) + "|")
    for batch in (int(b) for b in args.batches.split(",")):
        _, budgets = workload(batch, args.new)
        pre = prefill_seconds(batch)
        times: dict[str, list[float]] = {a: [] for a in arms}
        outs: dict[str, list[list[int]]] = {}
        for _ in range(args.reps):
            for arm in arms:
                seconds, outs[arm] = before(args.before_src, batch, args.new) if arm == "before" else timed(
                    batch, args.new, arm)
                times[arm].append(seconds - pre)
        for arm in arms:
            assert outs[arm] == outs["static"], f"{arm} produced other tokens than static"
        made = sum(len(o) for o in outs["static"]) - batch  # the first token comes from the prefill
        rates = {a: [made / t for t in ts] for a, ts in times.items()}
        cells = [f"{statistics.median(r):.0f} ({min(r):.0f}..{max(r):.0f})" for r in rates.values()]
        ratio = statistics.median(rates["static"]) / statistics.median(rates[base])
        if args.compiled:
            cells.append(f"{ratio:.2f}x")
            ratio = statistics.median(rates["compiled"]) / statistics.median(rates["static"])
        print(f"| {batch} | " + " | ".join(cells) + f" | {ratio:.2f}x |")
    del budgets
    print(f"load average after: {tuple(round(x, 1) for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
