"""The planner's margin from measurement (issue 27 item 3): the numbers behind `mindvl/plan/margin.json`.

    python benchmarks/bench_plan_margin.py allocator [--seq-lens 1024 2048 4096]   # CPU allocator vs planned
    python benchmarks/bench_plan_margin.py skew [--steps 200]                      # a tiny MoE run's routing skew
    python benchmarks/bench_plan_margin.py verdicts                                # before/after, recorded plans

allocator: one process, the small model of bench_plan_vs_real at several sequence lengths; per shape the planned
peak (`mindvl plan --sample-data`, fake tensors), the same step on real tensors (`python -m mindvl.plan.validate
--allocator`): FSDP2's tracker peak, c10's CPU allocator high-water over the build and the steps, and the peak-RSS
increase over the same window. The high-water / planned ratio is margin.json's allocated_over_planned. The RSS
column and its straight-line fit over the high-water are printed for the record only: under the profiler the RSS is
dominated by the profiler's own event buffers (margin.json's reserved/allocated stand-in uses RSS without it).

skew: a DeepSeek-V3-shaped tiny MoE (256 routed experts, top-8 in 8 groups / 4, a shared expert, 3 layers, the
first dense) trained on real text (this repository's own .py and .md files as bytes) with the trainer's
auxiliary-loss-free bias balancing (--rate, the trainer's 1e-3 by default); per step the routers' expert loads give
MaxVio and the capacity factor at EP 8 / 16 (`mindvl.plan.skew.rank_factor`).

verdicts: the recorded 671B plans (recipes/mindvl-671b/plan_*.json) and the 8B SFT-8K plan (a JSON given with
--plan-8b), before (2 GiB + 5% of capacity, balanced routing) and after (margin.json's reserve and skew factor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
MIB, GIB = 2**20, 2**30


def load() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


# ------------------------------------------------------------------------------------------------------ allocator


def allocator(args) -> None:
    """Every shape's plan and real step run side by side (one process each: memory figures do not depend on the
    load; the tracker and the allocator count bytes, not time)."""
    import os

    from bench_plan_vs_real import recipe

    print(f"load: {load()}")
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        procs = {}
        for seq in args.seq_lens:
            path = tmp / f"s{seq}.yaml"
            path.write_text(yaml.safe_dump(recipe(tmp / f"s{seq}", 1, True, seq)))
            plan_cmd = [sys.executable, "-c", "import sys; from mindvl.cli import main; sys.exit(main())", "plan",
                        str(path), "--world-size", "1", "--device", "h100-80g", "--sample-data", "--json"]
            real_cmd = [sys.executable, "-m", "mindvl.plan.validate", "--allocator", str(path)]
            procs[seq] = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                          for c in (plan_cmd, real_cmd)]
        for seq, (plan_p, real_p) in procs.items():
            outs = []
            for proc in (plan_p, real_p):
                out, err = proc.communicate()
                if proc.returncode:
                    raise RuntimeError(err[-3000:])
                outs.append(out)
            p = json.loads(outs[0])["peak_bytes_per_rank"]
            r = json.loads(outs[1].strip().splitlines()[-1])
            rows.append({"seq_len": seq, "planned": p, "tracker": r["peak_bytes"],
                         "allocator": r["allocator_peak_bytes"], "rss": r["rss_window_bytes"]})
            print(json.dumps(rows[-1]), flush=True)
    print(f"load at the end: {load()}")
    print("| seq_len | planned MiB | tracker (real) MiB | c10 allocator high-water MiB | high-water / planned | "
          "peak-RSS increase MiB |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seq_len']} | {r['planned'] / MIB:.1f} | {r['tracker'] / MIB:.1f} | {r['allocator'] / MIB:.1f} | "
              f"{r['allocator'] / r['planned']:.3f} | {r['rss'] / MIB:.1f} |")
    if len(rows) >= 2:
        xs, ys = [r["allocator"] for r in rows], [r["rss"] for r in rows]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
        print(f"fit: peak-RSS increase = {(my - b * mx) / MIB:.1f} MiB + {b:.3f} x allocator high-water")


# ------------------------------------------------------------------------------------------------------ skew


def text_corpus() -> bytes:
    files = sorted([*ROOT.glob("mindvl/**/*.py"), *ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md")])
    return b"\n".join(f.read_bytes() for f in files)


def skew(args) -> None:
    import torch

    from mindvl.models import MindVL, MindVLConfig, TextConfig
    from mindvl.models.moe import routers, update_router_bias
    from mindvl.plan.skew import rank_factor

    torch.manual_seed(0)
    torch.set_num_threads(1)
    text = TextConfig(family="deepseek_v3", vocab_size=512, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=32,
                      n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4,
                      first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=64,
                      kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, head_dim=16)
    model = MindVL(MindVLConfig(text=text, vision=None))
    model.init_weights(seed=0)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    data = torch.frombuffer(bytearray(text_corpus()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    seq, docs = args.tokens, 4
    print(f"load: {load()}; corpus {len(data):,} bytes; {seq} tokens per step; {args.steps} steps; "
          f"bias rate {args.rate}")
    records = []
    for step in range(args.steps):
        starts = torch.randint(0, len(data) - seq, (docs,), generator=gen)
        ids = torch.cat([data[s:s + seq // docs] for s in starts.tolist()])
        cu = torch.arange(0, seq + 1, seq // docs, dtype=torch.int32)
        loss_sum, count = model(input_ids=ids, labels=ids.clone(), cu_seqlens=cu)
        opt.zero_grad()
        (loss_sum / count).backward()
        opt.step()
        loads = torch.stack([r.expert_load for r in routers(model)])
        rec = {"step": step, "loss": float(loss_sum / count), "ep8": rank_factor(loads, 8),
               "ep16": rank_factor(loads, 16), "max_vio": update_router_bias(model, args.rate)}
        records.append(rec)
        if step % 10 == 0 or step == args.steps - 1:
            print(json.dumps(rec), flush=True)
    tail = records[len(records) // 2:]  # after the bias balancing has settled
    for key in ("ep16", "ep8", "max_vio"):
        xs = sorted(r[key] for r in tail)
        print(f"{key} over the last {len(tail)} steps: median {statistics.median(xs):.3f}, "
              f"p95 {xs[int(0.95 * (len(xs) - 1))]:.3f}, max {xs[-1]:.3f}; first 10 steps max "
              f"{max(r[key] for r in records[:10]):.3f}")


# ------------------------------------------------------------------------------------------------------ verdicts


def verdict_rows(d: dict, name: str) -> str:
    from mindvl.models import MindVLConfig  # noqa: F401  (import order: the planner's models first)
    from mindvl.plan import preset_config
    from mindvl.plan.margin import load_margin, stated_reserve_bytes
    from mindvl.plan.skew import SENSITIVITY, routing_skew

    margin = load_margin()
    peak, cap = d["peak_bytes_per_rank"], d["capacity_bytes"]
    moe = "671B" in name
    tokens = max(p["tokens"] for p in d["packs"])
    ep = 16 if moe else 1
    before = stated_reserve_bytes(cap)
    k = routing_skew(preset_config("mindvl-671b" if moe else "mindvl-8b"), tokens, ep, d["activation_checkpointing"],
                     margin.skew_factor)
    after_reserve = margin.reserve_bytes(peak + k.extra_bytes)
    after_total = peak + k.extra_bytes + after_reserve
    head_before = 1 - (peak + before) / cap
    head_after = 1 - after_total / cap
    sens = " / ".join(f"{k.headroom_at(f, peak, margin.reserve_bytes(peak), cap, margin.growth):.0%}"
                      for f in (1.0, *SENSITIVITY[:3])) if k.bytes_per_unit else "dense: no term"
    if k.bytes_per_unit:
        be = k.break_even(peak, margin.reserve_bytes(peak), cap, margin.growth)
        sens += f"; fits up to {be:.2f}" if be >= 1 else "; does not fit even balanced"
    return (f"| {name} | {d['world_size']} x {d['device']['name']} | {peak / GIB:.1f} | "
            f"{before / GIB:.1f}: {'yes' if head_before >= 0 else 'NO'} ({head_before:.0%}) | "
            f"{after_reserve / GIB:.1f} + {k.extra_bytes / GIB:.1f} skew: {'yes' if head_after >= 0 else 'NO'} "
            f"({head_after:.0%}) | {sens} |")


def verdicts(args) -> None:
    from mindvl.plan.margin import load_margin

    m = load_margin()
    print(f"margin.json: reserve = {m.fixed_bytes / GIB:.2f} GiB + {m.growth - 1:.3f} x (peak + skew); "
          f"skew factor {m.skew_factor}")
    print("| recipe | ranks x device | traced peak GiB | before: reserve 2 GiB + 5%, balanced | "
          "after: reserve + skew GiB | after: headroom at skew 1.0 / 1.25 / 1.5 / 2.0; largest factor that fits |")
    print("| --- | --- | --- | --- | --- | --- |")
    from mindvl.plan import get_device

    plans = [(json.loads(p.read_text()), "671B " + p.stem.split("_")[1])
             for p in sorted((ROOT / "recipes/mindvl-671b").glob("plan_*.json"))]
    if args.plan_8b:
        plans.insert(0, (json.loads(Path(args.plan_8b).read_text()), "8B sft-8k"))
    else:  # the recorded trace (RESULTS.md, "Training planner": sft-8k at 8 ranks re-traced after issue 13)
        for name in ("910b2-64g", "h100-80g"):
            dev = get_device(name)
            plans.insert(0, ({"peak_bytes_per_rank": int(26.4 * GIB), "capacity_bytes": dev.memory_bytes,
                              "world_size": 8, "device": {"name": name}, "packs": [{"tokens": 8192}],
                              "activation_checkpointing": "full"}, "8B sft-8k (recorded 26.4)"))
    for d, name in plans:
        print(verdict_rows(d, name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("allocator")
    a.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    s = sub.add_parser("skew")
    s.add_argument("--steps", type=int, default=120)
    s.add_argument("--tokens", type=int, default=2048)
    s.add_argument("--rate", type=float, default=1e-3, help="router bias update rate (the trainer's default 1e-3)")
    v = sub.add_parser("verdicts")
    v.add_argument("--plan-8b", help="a `mindvl plan ... --json` of recipes/mindvl-8b/sft-8k.yaml")
    args = ap.parse_args()
    {"allocator": allocator, "skew": skew, "verdicts": verdicts}[args.what](args)


if __name__ == "__main__":
    main()
