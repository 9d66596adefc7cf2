"""The Qwen2.5-VL-72B-shaped SFT (recipes/qwen2.5-vl-72b/sft.yaml) on 32 and 64 x H100-80G: TP 8 against FSDP only.

A full-depth trace of the 72B step (112 blocks, 3 micro-batches on fake tensors) takes hours on this shared 2-core
machine (load 30-45), so the model is traced shallow, with the real widths, vocabulary, packs, world and recipe
settings, at three depths (decoder layers L, ViT blocks D) = (2, 2), (4, 2), (2, 4), and every traced part is
extrapolated linearly to (80, 32): under full activation checkpointing what a rank holds per decoder layer (its
FSDP/TP shards, gradients and AdamW state, the checkpointed layer input) and per ViT block (the same; its
checkpointed inputs live until the tower's backward, after the language model's) does not depend on the depth; the
buffers in flight (gathered layers, unsharded gradients) are bounded by FSDP's prefetching and are held at their
largest traced value (see IN_FLIGHT); the peak is the sum of the parts. FLOPs,
communication and time (`--estimates`) are the planner's estimates at full depth, no trace needed. 64 ranks: the
planner's `extrapolate_peak` rule from the 32-rank figure (sharded parts scale as 1/N).

    python benchmarks/bench_plan_72b.py [--tp 8 1] [--world 32] [--out DIR]     # 6 shallow traces in parallel
    python benchmarks/bench_plan_72b.py --estimates                              # FSDP/TP traffic and time only
    python benchmarks/bench_plan_72b.py --report --out recipes/qwen2.5-vl-72b/plan_shallow_traces_32x_h100-80g.jsonl
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "qwen2.5-vl-72b" / "sft.yaml"
LAYERS = 80


def one(tp: int, layers: int, vit_depth: int, world: int) -> dict:
    """Plan the recipe at `layers` decoder layers and `vit_depth` ViT blocks (the last one full attention, the others
    windowed; everything else as in the recipe): the PlanResult as a dict."""
    from mindvl.config import load_recipe
    from mindvl.plan import get_device, plan
    from mindvl.plan.presets import TEXT_PRESETS, VISION_PRESETS

    arch = {"text": {**TEXT_PRESETS["qwen2.5-vl-72b-llm"], "num_hidden_layers": layers},
            "vision": {**VISION_PRESETS["qwen2.5-vl-72b-vit"], "depth": vit_depth,
                       "fullatt_block_indexes": [vit_depth - 1]}}
    # the shipped tokenizer (data.tokenizer=null): only the vision token ids are read from it
    recipe = load_recipe(str(RECIPE), [f"parallel.tensor_parallel={tp}", "data.tokenizer=null", "model.preset=null",
                                       "model.compose=null", f"model.arch={json.dumps(arch)}"])
    r = plan(recipe, world, get_device("h100-80g"), recipe_name=f"{RECIPE.name} @ {layers} layers, {vit_depth} ViT")
    return r.to_dict() | {"layers": layers, "vit_depth": vit_depth, "tp": tp}


def estimates(tp: int, world: int) -> dict:
    """The planner's estimates (no trace) at the full 80 layers: parameter counts from the meta model (a TP split
    where tensor_parallel splits: the LLM's projections and the head), FLOPs of the worst-case packs, FSDP and TP
    collectives, roofline time."""
    import torch

    from mindvl.config import load_recipe
    from mindvl.data import DataConfig
    from mindvl.models import MindVL
    from mindvl.plan import estimate, get_device, model_config
    from mindvl.plan.packs import worst_case_packs
    from mindvl.train.parallel import ParallelLayout

    recipe = load_recipe(str(RECIPE), [f"parallel.tensor_parallel={tp}"])
    config, _ = model_config(recipe)
    with torch.device("meta"):
        model = MindVL(config)
    split = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    names = dict(model.named_parameters())
    llm = {n: p.numel() for n, p in names.items() if n.startswith("language_model.")}
    head = llm["language_model.lm_head.weight"]
    tp_params = sum(v for n, v in llm.items() if any(f".{s}." in n for s in split)) + head
    counts = estimate.param_counts(model)
    counts.tp_params, counts.tp_root_params = tp_params, head
    counts.tp_trainable_params = tp_params
    layout = ParallelLayout(world, tp=tp)
    gb = recipe.batch.global_batch_size
    accum = gb // layout.dp_size
    packs = worst_case_packs(DataConfig.from_dict(recipe.data), config)
    flops = [estimate.pack_flops(config, p, recipe.trainable_modules) for p in packs]
    mean, vit = sum(f for f, _ in flops) / len(flops), sum(v for _, v in flops) / len(flops)
    comm = estimate.comm_bytes(counts, layout, accum, recipe.parallel.grad_accumulation)
    tokens = sum(p.tokens for p in packs) / len(packs)
    comm.update(estimate.tensor_parallel_bytes(config, tokens, sum(estimate.labelled(config, p) for p in packs)
                                               / len(packs), tp, accum, True))
    device = get_device("h100-80g")
    timing = estimate.step_time(device, world, ((mean - vit) * gb + vit * gb * tp) / world, comm,
                                counts.trainable_params / world)
    return {"tp": tp, "world": world, "accum": accum, "comm": comm, "timing": timing,
            "tokens_per_s": tokens * gb / timing["step_s"],
            "mfu": mean * gb / (timing["step_s"] * device.peak_flops * world)}


DEPTHS = ((2, 2), (4, 2), (2, 4))  # (decoder layers, ViT blocks) traced
FULL = (LAYERS, 32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--one", type=int, nargs=3, default=None, metavar=("TP", "LAYERS", "VIT_DEPTH"))
    ap.add_argument("--out", type=Path, default=Path("bench_plan_72b"))
    ap.add_argument("--report", action="store_true", help="only fit and print the traces already in --out")
    ap.add_argument("--estimates", action="store_true", help="only the estimates (no trace) for TP 1/2/4/8")
    args = ap.parse_args()
    if args.estimates:
        print_estimates()
        return
    if args.one is not None:
        print(json.dumps(one(*args.one, args.world)))
        return
    if args.report and args.out.is_file():  # a JSONL of traces (recipes/qwen2.5-vl-72b/plan_shallow_traces_*.jsonl)
        report([json.loads(line) for line in args.out.read_text().splitlines() if line.strip()], args.world)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        procs = []
        for tp in args.tp:
            for layers, depth in DEPTHS:
                path = args.out / f"tp{tp}_L{layers}_D{depth}_w{args.world}.json"
                procs.append(subprocess.Popen([sys.executable, __file__, "--one", str(tp), str(layers), str(depth),
                                               "--world", str(args.world)], stdout=path.open("w")))
        for p in procs:
            p.wait()
    results = [json.loads(f.read_text().strip().splitlines()[-1]) for f in sorted(args.out.glob("tp*.json"))
               if f.read_text().strip()]
    report(results, args.world)


def print_estimates() -> None:
    from mindvl.plan.devices import GIB

    print(f"{'world':>5} {'TP':>3} {'micro/rank':>10} {'FSDP AG GiB':>12} {'FSDP RS GiB':>12} {'TP bytes GiB':>12} "
          f"{'compute s':>10} {'FSDP s':>8} {'TP s':>7} {'step s':>8} {'tokens/s':>9} {'MFU':>5}")
    for world in (32, 64):
        for tp in (1, 2, 4, 8):
            e = estimates(tp, world)
            c, t = e["comm"], e["timing"]
            tpb = sum(v for k, v in c.items() if k.startswith("tp_"))
            print(f"{world:>5} {tp:>3} {e['accum']:>10} {c['all_gather'] / GIB:>12,.0f} "
                  f"{c['reduce_scatter'] / GIB:>12,.0f} {tpb / GIB:>12,.0f} {t['compute_s']:>10.1f} "
                  f"{t['communication_s']:>8.1f} {t['tensor_parallel_s']:>7.1f} {t['step_s']:>8.1f} "
                  f"{e['tokens_per_s']:>9,.0f} {e['mfu']:>5.0%}")


# Buffers in flight (FSDP's gathered layers and unsharded gradients awaiting their reduce-scatter, the loss head's
# blocks, the prefetched packs): bounded by the prefetch depth, not by the number of layers, so held at their largest
# traced value instead of extrapolated (at TP 1 the 2-layer trace peaks with one gathered layer fewer than the
# 4-layer one; a 6-layer trace, when present, checks that the count stops there).
IN_FLIGHT = ("unsharded_parameters", "unsharded_gradients", "loss_temporaries", "data_buffers")
SHARDED = ("parameters", "gradients", "optimizer_state")


def parts_at(results: list[dict], tp: int, depth: tuple[int, int]) -> dict[str, float] | None:
    """Each part at `depth`: per-layer / per-block parts linear in the depths, in-flight parts at their maximum."""
    by = {(r["layers"], r["vit_depth"]): r for r in results if r["tp"] == tp}
    if any(d not in by for d in DEPTHS):
        return None
    base, (l0, d0) = by[DEPTHS[0]], DEPTHS[0]
    out = {}
    for part in base["breakdown"]:
        if part in IN_FLIGHT:
            out[part] = max(r["breakdown"][part] for r in by.values())
            continue
        per_layer = (by[DEPTHS[1]]["breakdown"][part] - base["breakdown"][part]) / (DEPTHS[1][0] - l0)
        per_block = (by[DEPTHS[2]]["breakdown"][part] - base["breakdown"][part]) / (DEPTHS[2][1] - d0)
        out[part] = base["breakdown"][part] + per_layer * (depth[0] - l0) + per_block * (depth[1] - d0)
    return out


def report(results: list[dict], world: int) -> None:
    from mindvl.plan.devices import GIB

    if not results:
        print("no traces")
        return
    cap, reserve = results[0]["capacity_bytes"], results[0]["reserve_bytes"]
    for tp in sorted({r["tp"] for r in results}, reverse=True):
        full = parts_at([r for r in results if (r["layers"], r["vit_depth"]) in DEPTHS], tp, FULL)
        if full is None:
            print(f"TP {tp}: traces missing")
            continue
        print(f"TP {tp} x {world // tp} data shards on {world} x h100-80g (full activation checkpointing), traced at "
              f"(layers, ViT blocks) {DEPTHS}, extrapolated to {FULL}:")
        for part, v in full.items():
            how = "max traced (in flight)" if part in IN_FLIGHT else "linear"
            print(f"  {part:<22}{v / GIB:>8.2f} GiB   ({how})")
        peak = sum(full.values())
        print(f"  {'peak':<22}{peak / GIB:>8.2f} GiB + {reserve / GIB:.1f} reserve of {cap / GIB:.1f}: "
              f"{'fits' if peak + reserve <= cap else 'DOES NOT FIT'} ({1 - (peak + reserve) / cap:.0%} headroom)")
        sharded = sum(full[p] for p in SHARDED)
        at64 = peak - sharded + sharded * world / 64
        print(f"  at 64 ranks (sharded parts x {world}/64): {at64 / GIB:.1f} GiB ({1 - (at64 + reserve) / cap:.0%} "
              "headroom)")
        for r in results:  # depths beyond the fit: the rule's prediction against the trace
            if r["tp"] == tp and (r["layers"], r["vit_depth"]) not in DEPTHS:
                pred = sum(parts_at(results, tp, (r["layers"], r["vit_depth"])).values())
                print(f"  check at ({r['layers']}, {r['vit_depth']}): predicted {pred / GIB:.2f} GiB, traced "
                      f"{r['peak_bytes_per_rank'] / GIB:.2f} GiB")
        walls = [r["trace_s"] for r in results if r["tp"] == tp]
        print(f"  trace wall time: {', '.join(f'{w:.0f}' for w in walls)} s")


if __name__ == "__main__":
    main()
