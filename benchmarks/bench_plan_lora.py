"""MindVL-8B SFT-8K with LoRA / QLoRA on ONE accelerator: the planner's traces (issue 25).

    python benchmarks/bench_plan_lora.py [--recipes sft-8k-lora-80g sft-8k-qlora-24g] [--one-micro-batch]

Each recipe is one `mindvl.plan.plan` trace at world size 1 (the real model at full size, `prepare_model` with its
`lora` step, the trainer's step on fake tensors); the verdicts for every device below come from that trace (devices
differ in capacity and reserve, not in what is resident). Under QLoRA the adapted base weights stay outside FSDP
(mindvl.train.qlora), so its trace differs from LoRA's (no bf16 base sharded or all-gathered for them); their NF4
bytes (whole on the rank) and the transient of dequantizing the largest are added by the planner. Full
fine-tuning's smallest world size is in RESULTS.md (training planner).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mindvl.config import load_recipe
from mindvl.plan import DEVICES, plan
from mindvl.plan.devices import GIB
from mindvl.plan.planner import reserve_bytes

ROOT = Path(__file__).resolve().parent.parent
SHOW = ("rtx4090-24g", "h100-80g")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["sft-8k-lora-80g", "sft-8k-qlora-24g"])
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--one-micro-batch", action="store_true",
                    help="trace steps of one micro-batch (2 forward/backward passes instead of 3; a third less trace "
                         "time on a loaded machine): no gradient accumulation across micro-batches, whose extra "
                         "resident set is the trainable parameters' sharded fp32 gradients (the adapters', small)")
    args = ap.parse_args()
    rows = []
    for name in args.recipes:
        recipe = load_recipe(ROOT / "recipes" / "mindvl-8b" / f"{name}.yaml")
        if args.one_micro_batch:
            recipe.batch.global_batch_size = 1
        r = plan(recipe, 1, DEVICES["h100-80g"], recipe_name=name)
        verdicts = {}
        for dev in SHOW:
            d = DEVICES[dev]
            total = r.peak_bytes_per_rank + reserve_bytes(d, r.peak_bytes_per_rank)
            verdicts[dev] = {"fits": total <= d.memory_bytes, "headroom": 1 - total / d.memory_bytes}
        row = {"recipe": name, "peak_gib": r.peak_bytes_per_rank / GIB,
               "breakdown_gib": {k: v / GIB for k, v in r.breakdown.items()},
               "params": r.params, "verdicts": verdicts, "trace_s": r.trace_s, "notes": r.notes,
               "est_step_s_h100": r.timing["step_s"] if r.timing else None, "tokens_per_step": r.tokens_per_step}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("| recipe | peak GiB | params | owned grads | AdamW | activations | trainable | "
          + " | ".join(f"{d} (headroom)" for d in SHOW) + " | trace s |")
    for row in rows:
        b = row["breakdown_gib"]
        cells = [f"{'fits' if v['fits'] else 'NO'} ({v['headroom']:.0%})" for v in row["verdicts"].values()]
        print(f"| {row['recipe']} | {row['peak_gib']:.1f} | {b['parameters']:.1f} | {b['gradients']:.2f} | "
              f"{b['optimizer_state']:.2f} | {b['activations']:.1f} | {row['params']['trainable'] / 1e6:.0f}M | "
              + " | ".join(cells) + f" | {row['trace_s']:.0f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
