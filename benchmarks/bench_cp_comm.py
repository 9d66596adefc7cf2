"""Context parallelism's all-to-all bytes: counted on the real collectives of a small gloo run against the planner's
estimate (`mindvl.plan.estimate.context_all_to_all_bytes`).

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/bench_cp_comm.py [--ac full|off] [--micro 2]

Each rank builds the tiny test model (4 heads, 2 KV heads, M-RoPE, a ViT) as the trainer does (prepare_model with
`parallel.context_parallel` = the world size), runs one optimizer step of `--micro` packs from the tiny synthetic
recipe, and counts, with a dispatch mode, every functional all-to-all it sends (forward, backward and the
recomputation of activation checkpointing): the bytes that leave the rank (its own split stays). Rank 0 prints the
count, the planner's estimate for the same packs' mean length, and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from mindvl.config import load_recipe
from mindvl.data import DataConfig, build_loader, load_tokenizer
from mindvl.plan.estimate import context_all_to_all_bytes
from mindvl.train.materialize import build_model
from mindvl.train.optim import build_optimizer
from mindvl.train.parallel import destroy, init_distributed, prepare_model
from mindvl.train.step import optimizer_step

TINY = {
    "model": {"arch": {"text": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
                                "mrope_section": [1, 1, 2]},
                       "vision": {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2,
                                  "fullatt_block_indexes": [1]}}},
    "data": {"sources": [{"synth": {"tasks": ["ocr", "chart"], "n": 48, "seed": 5}}], "seq_len": 192,
             "max_pixels": 16 * 28 * 28, "min_pixels": 4 * 28 * 28, "pack_buffer": 8, "default_system": None},
    "phase": {"name": "multitask"},
    "budget": {"max_steps": 1},
    "logging": {"progress": False, "tensorboard": False, "plot": False},
}


class CountAllToAll(TorchDispatchMode):
    """Bytes this rank sends through functional all-to-alls (the split it keeps for itself excluded)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank, self.sent, self.calls = rank, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops._c10d_functional.all_to_all_single.default:
            x, _output_splits, input_splits = args[0], args[1], args[2]
            row = x[0].numel() * x.element_size() if x.shape[0] else 0
            self.sent += (sum(input_splits) - input_splits[self.rank]) * row
            self.calls += 1
        return func(*args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ac", default="full", choices=("full", "off"))
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--cache", default="/tmp/mindvl_bench_cp_cache")
    args = ap.parse_args()
    import os

    world = int(os.environ.get("WORLD_SIZE", 1))
    raw = {**TINY, "output_dir": "/tmp/mindvl_bench_cp", "batch": {"global_batch_size": args.micro},
           "parallel": {"context_parallel": world, "activation_checkpointing": args.ac}}
    raw["data"] = {**TINY["data"], "synth_cache": str(Path(args.cache))}
    recipe = load_recipe(raw=raw)
    env = init_distributed("cpu", recipe.parallel)
    tok = load_tokenizer()
    model = build_model(recipe, tok, env, lambda m: prepare_model(m, recipe, env))
    packs = [p.to_torch() for p in itertools.islice(build_loader(DataConfig.from_dict(recipe.data), tok), args.micro)]
    optimizer = build_optimizer(model, recipe.optim)
    counter = CountAllToAll(env.rank)
    with counter:
        optimizer_step(model, optimizer, list(packs), env, model.config, recipe.trainable_modules)
    sent = torch.tensor([counter.sent], dtype=torch.float64)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)
    mean_tokens = sum(int(p["input_ids"].numel()) for p in packs) / len(packs)
    # this run computes in float32 (CPU): 4 bytes per element where an accelerator's bf16 run sends 2
    planned = context_all_to_all_bytes(model.config, mean_tokens, world, args.micro, args.ac != "off", 4)
    if env.is_main:
        print(f"cp={world} ac={args.ac} micro={args.micro} tokens/pack={[int(p['input_ids'].numel()) for p in packs]}"
              f" all-to-all calls/rank={counter.calls} counted bytes (rank 0)={counter.sent:,} (max over ranks "
              f"{int(sent):,}) planned={planned:,.0f} planned/counted={planned / max(1, counter.sent):.4f}")
    destroy(env)


if __name__ == "__main__":
    main()
