"""Tensor-parallel communication: the planner's bytes per rank against the bytes of the real collectives.

One micro-batch (forward + backward) of a small model (the text tower's shapes below; packed multi-sample rows with
images and M-RoPE from the synthetic data) on `--tp` gloo processes at tensor_parallel = world (no data-parallel
ranks, so every collective of more than one rank is a tensor-parallel one). A TorchDispatchMode counts every
collective the rank issues, DTensor's (functional collectives) and the loss's (c10d) alike, by kind and buffer
size; sent bytes per rank are derived as the planner derives them (ring: (n-1)/n of an all-gather's output or a
reduce-scatter's input, twice that for an all-reduce). The planner's `estimate.tensor_parallel_bytes` for the same
config, tokens and labelled targets (micro = 1, no recomputation, fp32 activations as on this CPU run) is printed
beside it.

    python benchmarks/bench_tp_comm.py [--tp 2] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ARCH = {"text": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "mrope_section": [4, 6, 6], "family": "qwen2"},
        "vision": {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2,
                   "fullatt_block_indexes": [1]}}


def recipe_raw(tmp: Path, tp: int, seq_len: int) -> dict:
    return {"output_dir": str(tmp / "out"), "model": {"arch": ARCH},
            "data": {"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 32, "seed": 3}}], "seq_len": seq_len,
                     "max_pixels": 64 * 28 * 28, "min_pixels": 16 * 28 * 28, "pack_buffer": 8,
                     "synth_cache": str(tmp / "cache"), "default_system": None},
            "phase": {"name": "multitask"}, "batch": {"global_batch_size": 1}, "budget": {"max_steps": 1},
            "parallel": {"tensor_parallel": tp}}


def worker(tmp: Path, seq_len: int) -> None:
    import itertools

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    from mindvl.config import load_recipe
    from mindvl.data import DataConfig, build_loader, load_tokenizer
    from mindvl.models.loss import IGNORE_INDEX, next_token_targets
    from mindvl.plan import estimate
    from mindvl.train.materialize import build_model
    from mindvl.train.parallel import ParallelEnv, ParallelLayout, parallelize

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    recipe = load_recipe(raw=recipe_raw(tmp, world, seq_len))
    layout = ParallelLayout.from_config(recipe.parallel, world, rank)
    env = ParallelEnv(rank, world, 0, torch.device("cpu"), "gloo", layout)
    tok = load_tokenizer()
    pack = next(itertools.islice(build_loader(DataConfig.from_dict(recipe.data), tok), 1)).to_torch()
    model = build_model(recipe, tok, env, lambda meta: parallelize(meta, env, recipe.parallel))

    def group_size(args) -> int:
        for a in args:
            if isinstance(a, str):  # functional collectives: (..., group_size | reduce_op, group_name)
                try:
                    return dist.distributed_c10d._resolve_process_group(a).size()
                except (KeyError, RuntimeError, ValueError):
                    continue
            if hasattr(a, "size") and not torch.is_tensor(a) and callable(a.size):  # a c10d ProcessGroup
                return a.size()
        return world

    sent: dict[str, float] = {}
    calls: dict[str, int] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__ if hasattr(func, "__name__") else str(func)
            ns = func.namespace
            if ns in ("_c10d_functional", "c10d"):
                n = group_size([*args, *(kwargs or {}).values()])
                tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a]) if torch.is_tensor(t)]
                size = sum(t.numel() * t.element_size() for t in tensors[:1])
                kind = ("all_gather" if "gather" in name else "reduce_scatter" if "scatter" in name
                        else "all_reduce" if "allreduce" in name or "all_reduce" in name else None)
                if kind is not None and n > 1:
                    ring = (n - 1) / n
                    # buffer: an all-gather's output is n x its input; a reduce-scatter's input is the buffer
                    vol = {"all_gather": size * n * ring, "reduce_scatter": size * ring,
                           "all_reduce": 2 * size * ring}[kind]
                    sent[kind] = sent.get(kind, 0.0) + vol
                    calls[kind] = calls.get(kind, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count():
        loss, _ = model(**pack)
        loss.backward()
    tokens = int(pack["input_ids"].numel())
    labelled = int((next_token_targets(pack["labels"], pack["cu_seqlens"]) != IGNORE_INDEX).sum())
    # activations in fp32 here (CPU, no mixed precision); the planner's default is the accelerators' bf16
    planned = estimate.tensor_parallel_bytes(model.config, tokens, labelled, world, 1, False, activation_bytes=4)
    if rank == 0:
        print(json.dumps({"tp": world, "tokens": tokens, "labelled": labelled, "samples": len(pack["cu_seqlens"]) - 1,
                          "measured": sent, "calls": calls, "planned": planned}))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--worker", default=None)
    args = ap.parse_args()
    if args.worker is not None:
        worker(Path(args.worker), args.seq_len)
        return
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.tp), "--master_port",
               str(port), __file__, "--worker", tmp, "--seq-len", str(args.seq_len)]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if out.returncode:
            raise SystemExit(out.stderr[-3000:])
        r = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"TP={r['tp']}, one micro-batch of {r['tokens']} tokens ({r['samples']} samples, {r['labelled']} labelled)")
    print(f"{'collective':<16}{'calls':>7}{'measured bytes':>16}{'planner bytes':>16}{'ratio':>8}")
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        m, p = r["measured"].get(kind, 0.0), r["planned"].get(f"tp_{kind}", 0.0)
        print(f"{kind:<16}{r['calls'].get(kind, 0):>7}{m:>16,.0f}{p:>16,.0f}{(p / m if m else float('nan')):>8.3f}")


if __name__ == "__main__":
    main()
