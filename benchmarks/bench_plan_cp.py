"""MindVL-8B at long packs on 8 x H100-80G with and without context parallelism: the planner's trace at reduced
depth, extrapolated to the full depth block by block (a full 8B trace takes an hour of this shared CPU).

    python benchmarks/bench_plan_cp.py [--seq-len 32768] [--cp 1 2 4] [--depth 4] [--check-8k]

Each row is one `mindvl.plan.plan` trace of MindVL-8B's shapes (every width, the vocabulary, the pack of
`--seq-len` tokens with the planner's worst-case images) with `--depth` decoder layers and `--depth` ViT blocks
(the last one full-attention), the recipe's settings (`recipes/mindvl-8b/sft-long-video-32k.yaml`: full activation
checkpointing, bf16, sharded accumulation) and one micro-batch per step (global batch = data shards). The missing
blocks are added by hand, exactly what each one adds to the peak under full activation checkpointing: its fp32
parameter, gradient and AdamW shards (16 bytes per parameter / FSDP ranks) and its saved bf16 input (a decoder
layer [T/cp, hidden], a ViT block [patches, 1280]; the peak falls in the backward, when every block's saved input
is alive). `--check-8k` runs the same method on `recipes/mindvl-8b/sft-8k.yaml` (8K, no CP), whose full-depth
trace is in RESULTS.md (26.4 GiB), to measure the extrapolation's error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from mindvl.config import load_recipe
from mindvl.plan import get_device, plan
from mindvl.plan import planner as planner_module
from mindvl.plan.devices import GIB
from mindvl.plan.packs import worst_case_packs
from mindvl.plan.presets import preset_config

ROOT = Path(__file__).resolve().parent.parent


def reduced(config, depth: int):
    text = dataclasses.replace(config.text, num_hidden_layers=depth)
    vision = dataclasses.replace(config.vision, depth=depth, fullatt_block_indexes=[depth - 1])
    return dataclasses.replace(config, text=text, vision=vision)


def block_params(config) -> tuple[int, int]:
    """Parameters of one decoder layer and of one ViT block of `config`."""
    from mindvl.models import MindVL

    with torch.device("meta"):
        m = MindVL(reduced(config, 1))
    return (sum(p.numel() for p in m.language_model.layers[0].parameters()),
            sum(p.numel() for p in m.visual.blocks[0].parameters()))


def run(recipe_path: Path, seq_len: int, cp: int, depth: int, world: int, device_name: str,
        max_patches: int | None = None) -> dict:
    recipe = load_recipe(str(recipe_path))
    recipe.parallel.context_parallel = cp
    recipe.data.seq_len = seq_len
    if max_patches:
        recipe.data.max_patches_per_pack = max_patches
    dp = world // cp
    recipe.batch.global_batch_size = dp
    full = preset_config("mindvl-8b")
    small = reduced(full, depth)
    original = planner_module.model_config
    planner_module.model_config = lambda recipe, preset=None: (small, f"preset mindvl-8b at depth {depth}")
    try:
        device = get_device(device_name)
        r = plan(recipe, world, device)
    finally:
        planner_module.model_config = original
    from mindvl.data import DataConfig

    packs = worst_case_packs(DataConfig.from_dict(recipe.data), full)
    tokens = max(p.tokens for p in packs)
    patches = max(p.patches for p in packs)
    p_layer, p_block = block_params(full)
    missing_l = full.text.num_hidden_layers - depth
    missing_v = full.vision.depth - depth
    shards = 16 * (missing_l * p_layer + missing_v * p_block) / world  # fp32 param + grad + AdamW (2) per rank
    saved = 2 * (missing_l * tokens / cp * full.text.hidden_size + missing_v * patches * full.vision.hidden_size)
    peak = r.peak_bytes_per_rank + shards + saved
    capacity, reserve = r.capacity_bytes, r.reserve_bytes
    return {"recipe": recipe_path.name, "seq_len": seq_len, "max_patches_per_pack": max_patches, "cp": cp,
            "world": world, "depth_traced": depth,
            "tokens": tokens, "patches": patches, "traced_peak_gib": r.peak_bytes_per_rank / GIB,
            "traced_breakdown_gib": {k: v / GIB for k, v in r.breakdown.items()},
            "added_shards_gib": shards / GIB, "added_saved_inputs_gib": saved / GIB, "peak_gib": peak / GIB,
            "reserve_gib": reserve / GIB, "capacity_gib": capacity / GIB, "fits": peak + reserve <= capacity,
            "headroom": 1 - (peak + reserve) / capacity, "comm_bytes_per_micro_batch_gib": {
                k: v / GIB / r.accumulation for k, v in r.comm_bytes_per_step.items()},
            "trace_s": r.trace_s}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--cp", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--device", default="h100-80g")
    ap.add_argument("--check-8k", action="store_true")
    ap.add_argument("--max-patches", type=int, help="data.max_patches_per_pack (the vision budget of a pack)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    if args.check_8k:
        rows.append(run(ROOT / "recipes/mindvl-8b/sft-8k.yaml", 8192, 1, args.depth, args.world, args.device))
    for cp in args.cp:
        rows.append(run(ROOT / "recipes/mindvl-8b/sft-long-video-32k.yaml", args.seq_len, cp, args.depth,
                        args.world, args.device, args.max_patches))
    print("| recipe | seq_len | patches | cp | traced depth | traced peak GiB | + shards | + saved inputs | peak GiB "
          "| fits (headroom) | all-to-all GiB / micro-batch | trace s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in rows:
        a2a = w["comm_bytes_per_micro_batch_gib"].get("context_all_to_all", 0.0)
        print(f"| {w['recipe']} | {w['seq_len']} | {w['patches']} | {w['cp']} | {w['depth_traced']} | "
              f"{w['traced_peak_gib']:.1f} | "
              f"{w['added_shards_gib']:.1f} | {w['added_saved_inputs_gib']:.1f} | {w['peak_gib']:.1f} | "
              f"{'yes' if w['fits'] else 'NO'} ({w['headroom']:.0%}) | {a2a:.2f} | {w['trace_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
