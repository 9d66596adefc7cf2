"""The Qwen2.5-VL-72B-shaped SFT (recipes/qwen2.5-vl-72b/sft.yaml) on 32 and 64 x H100-80G: TP 8 against FSDP only.

A full-depth trace of the 72B step (112 blocks, 3 micro-batches on fake tensors) takes over an hour on this shared
2-core machine, so the language model is traced at two shallow depths (`--layers`, default 4 and 8, the real ViT,
the real widths, vocabulary, packs and world) and every traced part is extrapolated linearly to the 80 layers: under
full activation checkpointing what a rank holds per decoder layer (its FSDP/TP shards, gradients and AdamW state,
and the checkpointed layer input) is the same for every layer, and the peak falls at the same point of the step
(each part's per-layer slope is printed; a part that is not linear shows as a slope that differs between the
depths' pairs, when three depths are given). FLOPs, communication and time are the planner's estimates for the full
depth. 64 ranks: the planner's `extrapolate_peak` from the 32-rank figure (sharded parts scale as 1/N).

    python benchmarks/bench_plan_72b.py [--layers 4 8] [--tp 8 1] [--world 32] [--jobs 4]
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


def one(tp: int, layers: int, world: int) -> dict:
    """Plan the recipe at `layers` decoder layers (everything else as in the recipe): the PlanResult as a dict."""
    from mindvl.config import load_recipe
    from mindvl.plan import get_device, plan
    from mindvl.plan.presets import TEXT_PRESETS, VISION_PRESETS

    arch = {"text": {**TEXT_PRESETS["qwen2.5-vl-72b-llm"], "num_hidden_layers": layers},
            "vision": VISION_PRESETS["qwen2.5-vl-72b-vit"]}
    # the shipped tokenizer (data.tokenizer=null): only the vision token ids are read from it
    recipe = load_recipe(str(RECIPE), [f"parallel.tensor_parallel={tp}", "data.tokenizer=null", "model.preset=null",
                                       "model.compose=null", f"model.arch={json.dumps(arch)}"])
    r = plan(recipe, world, get_device("h100-80g"), recipe_name=f"{RECIPE.name} @ {layers} layers")
    return r.to_dict() | {"layers": layers, "tp": tp}


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--tp", type=int, nargs="+", default=[8, 1])
    ap.add_argument("--world", type=int, default=32)
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--one", type=int, nargs=2, default=None, metavar=("TP", "LAYERS"))
    ap.add_argument("--out", type=Path, default=Path("bench_plan_72b.jsonl"))
    ap.add_argument("--estimates", action="store_true", help="only the estimates (no trace) for TP 1/2/4/8")
    args = ap.parse_args()
    if args.estimates:
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
        return
    if args.one is not None:
        print(json.dumps(one(args.one[0], args.one[1], args.world)))
        return
    todo = [(tp, n) for tp in args.tp for n in args.layers]
    results: list[dict] = []
    for i in range(0, len(todo), args.jobs):
        procs = [subprocess.Popen([sys.executable, __file__, "--one", str(tp), str(n), "--world", str(args.world)],
                                  stdout=subprocess.PIPE, text=True) for tp, n in todo[i:i + args.jobs]]
        for p in procs:
            out, _ = p.communicate()
            if p.returncode:
                raise SystemExit(f"a trace failed (exit {p.returncode})")
            results.append(json.loads(out.strip().splitlines()[-1]))
    args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    report(results, args.world)


def report(results: list[dict], world: int) -> None:
    from mindvl.plan.devices import GIB

    cap = results[0]["capacity_bytes"]
    reserve = results[0]["reserve_bytes"]
    for tp in sorted({r["tp"] for r in results}, reverse=True):
        rows = sorted((r for r in results if r["tp"] == tp), key=lambda r: r["layers"])
        a, b = rows[0], rows[-1]
        span = b["layers"] - a["layers"]

        def at80(x: float, y: float, span: int = span, last: int = b["layers"]) -> float:
            return y + (y - x) / span * (LAYERS - last)

        peak = at80(a["peak_bytes_per_rank"], b["peak_bytes_per_rank"])
        sharded = at80(a["sharded_bytes_at_peak"], b["sharded_bytes_at_peak"])
        print(f"TP {tp} x {world // tp} data shards on {world} x h100-80g, traced at {a['layers']} and {b['layers']} "
              f"layers, extrapolated to {LAYERS}:")
        for part in a["breakdown"]:
            x, y = a["breakdown"][part], b["breakdown"][part]
            print(f"  {part:<22}{at80(x, y) / GIB:>8.1f} GiB   (per layer {(y - x) / span / GIB:.3f} GiB)")
        fits = peak + reserve <= cap
        print(f"  {'peak':<22}{peak / GIB:>8.1f} GiB + {reserve / GIB:.1f} reserve of {cap / GIB:.1f}: "
              f"{'fits' if fits else 'DOES NOT FIT'} ({1 - (peak + reserve) / cap:.0%} headroom)")
        at64 = peak - sharded + sharded * world / 64
        print(f"  at 64 ranks (sharded parts x {world}/64): {at64 / GIB:.1f} GiB "
              f"({1 - (at64 + reserve) / cap:.0%} headroom)")
        t = {k: at80(a["est_timing"][k], b["est_timing"][k]) for k in a["est_timing"] if k != "step_s"}
        step = max(t["compute_s"], t["communication_s"]) + t.get("tensor_parallel_s", 0.0) + t["optimizer_s"]
        flops = at80(a["flops_per_step"], b["flops_per_step"])
        comm = {k: at80(a["comm_bytes_per_step"][k], b["comm_bytes_per_step"][k]) for k in a["comm_bytes_per_step"]}
        tokens = b["est_tokens_per_s"] * b["est_step_time_s"]
        print("  collectives per rank per step: " + ", ".join(f"{k} {v / GIB:,.0f} GiB" for k, v in comm.items()
                                                              if v > GIB))
        print(f"  estimate: step {step:.0f} s (compute {t['compute_s']:.0f} s, FSDP collectives "
              f"{t['communication_s']:.0f} s overlapped, TP collectives {t.get('tensor_parallel_s', 0.0):.1f} s "
              f"exposed, optimizer {t['optimizer_s']:.2f} s), {tokens / step:,.0f} tokens/s, MFU <= "
              f"{flops / (step * 989e12 * world):.0%}")
        print(f"  trace wall time: {a['trace_s']:.0f} s and {b['trace_s']:.0f} s")


if __name__ == "__main__":
    main()
