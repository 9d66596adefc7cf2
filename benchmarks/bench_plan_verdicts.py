"""Every published planner verdict, before and after issue 40 (per-device measured reserve, time only from a measured
efficiency), from the recorded traces: arithmetic only, no re-trace.

    PYTHONPATH=. python benchmarks/bench_plan_verdicts.py            # the markdown table (RESULTS)
    PYTHONPATH=. python benchmarks/bench_plan_verdicts.py --short    # without the time columns (README)

Why no re-trace is needed for the memory: every recorded trace below was made under torch 2.13, whose FSDP2 memory
tracker skips DTensor's sharding propagation, and holds 8 bytes of AdamW state per trainable parameter (checked
here from each JSON that records its breakdown); issue 40's accounting (plan.simulate.device_optimizer_memory)
leaves such a trace unchanged (tests/plan/test_plan_torch_independent.py) and makes other torch versions agree with
it. What changes is the reserve (mindvl/plan/margin.json: measured on the H200 and borrowed by the H100; CPU
stand-ins, now named in the verdict, for the 910B and the 24 GB card; no communication buffers on one rank) and the
time: the old roofline MFU is dropped, and no device kind here has a measured efficiency for these models but the
H200.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def recorded() -> list[dict]:
    """The published verdicts: each with its traced peak (bytes), layout, routing-skew inputs, the published reserve
    and headroom, and where it was published."""
    rows = []
    for path in sorted((ROOT / "recipes/mindvl-671b").glob("plan_*.json")):
        d = json.loads(path.read_text())
        rows.append(dict(name=f"MindVL-671B {path.stem.split('_')[1]}", world=d["world_size"],
                         device=d["device"]["name"], peak=d["peak_bytes_per_rank"], ep=16, preset="mindvl-671b",
                         tokens=max(p["tokens"] for p in d["packs"]), ckpt=d["activation_checkpointing"],
                         old_mfu=d.get("est_mfu"), json=d, source=str(path.relative_to(ROOT))))
    for path in sorted((ROOT / "benchmarks/plan-qwen3-vl").glob("*.json")):
        d = json.loads(path.read_text())
        moe = "30b" in path.name
        rows.append(dict(name=f"Qwen3-VL-{'30B-A3B' if moe else '8B'} sft-8k", world=d["world_size"],
                         device=d["device"]["name"], peak=d["peak_bytes_per_rank"], ep=8 if moe else 1,
                         preset="qwen3-vl-30b-a3b" if moe else "qwen3-vl-8b",
                         tokens=max(p["tokens"] for p in d["packs"]), ckpt=d["activation_checkpointing"],
                         old_mfu=d.get("est_mfu"), json=d, source=str(path.relative_to(ROOT))))
    # traces published as numbers (RESULTS.md), without a kept JSON
    dense = dict(ep=1, tokens=8192, ckpt="full", old_mfu=None, json=None)
    rows += [
        dict(name="MindVL-8B sft-8k", world=8, device="h100-80g", peak=int(26.4 * GIB), preset="mindvl-8b",
             source="RESULTS.md, Training planner (re-traced after issue 13)", **dense),
        dict(name="MindVL-8B sft-8k", world=16, device="910b2-64g", peak=int(19.3 * GIB), preset="mindvl-8b",
             source="RESULTS.md, Does every phase fit? (16-rank trace; before issue 13, ~1.2 GiB high)", **dense),
        dict(name="Qwen2.5-VL-72B sft, TP 8 x 4", world=32, device="h100-80g", peak=int(48.7 * GIB),
             preset="qwen2.5-vl-72b", source="RESULTS.md, Tensor parallelism (shallow traces, extrapolated)",
             **dense),
        dict(name="Qwen2.5-VL-72B sft, FSDP only", world=32, device="h100-80g", peak=int(61.7 * GIB),
             preset="qwen2.5-vl-72b", source="RESULTS.md, Tensor parallelism (shallow traces, extrapolated)",
             **dense),
        dict(name="MindVL-8B sft-8k QLoRA (NF4)", world=1, device="rtx4090-24g", peak=int(16.8 * GIB),
             preset="mindvl-8b", source="RESULTS.md, QLoRA on real NF4 (re-traced)", **dense),
    ]
    return rows


def before_reserve(row: dict) -> int:
    """The reserve each verdict was published with: margin.json's CPU stand-ins (2 GiB + 20.2% of the planned bytes)
    for the 671B, Qwen3-VL and QLoRA plans; 2 GiB + 5% of capacity where RESULTS published that (8B, 72B)."""
    from mindvl.plan import get_device
    from mindvl.plan.margin import stated_reserve_bytes

    if row["json"] is not None and "671B" not in row["name"]:
        return row["json"]["reserve_bytes"]
    if "QLoRA" in row["name"]:
        return int(5.4 * GIB)  # published: 16.8 + 5.4 GiB
    if "671B" in row["name"]:
        return None  # recomputed below with the CPU stand-ins, as RESULTS' "Planner margin from measurement" did
    return stated_reserve_bytes(get_device(row["device"]).memory_bytes)


def verdict_row(row: dict, short: bool = False) -> str:
    from mindvl.plan import get_device, preset_config
    from mindvl.plan.estimate import model_family
    from mindvl.plan.margin import efficiency_for, load_margin
    from mindvl.plan.skew import routing_skew

    dev = get_device(row["device"])
    cap = dev.memory_bytes
    config = preset_config(row["preset"])
    if row["json"] is not None:  # the state per parameter of the trace: what torch 2.11 got wrong
        b, p = row["json"]["breakdown"], row["json"]["params"]
        per_param = b["optimizer_state"] / (p["trainable"] / row["world"])
        if not 7.9 < per_param < 8.1:
            raise SystemExit(f"{row['source']}: {per_param:.1f} B of AdamW state per parameter, not 8: re-trace it")
    old_margin = load_margin()  # the CPU stand-ins every device kind used before
    new_margin = load_margin(device=row["device"])
    skew = routing_skew(config, row["tokens"], row["ep"], row["ckpt"], new_margin.skew_factor)
    planned = row["peak"] + skew.extra_bytes
    old_reserve = before_reserve(row)
    if old_reserve is None:
        old_reserve = old_margin.reserve_bytes(planned)
    old_head = 1 - (planned + old_reserve) / cap
    new_reserve = new_margin.reserve_bytes(planned, peers=row["world"] > 1)
    new_head = 1 - (planned + new_reserve) / cap
    if not new_margin.measured_on:
        where = f"not measured on {row['device']} (CPU stand-ins)"
    elif new_margin.measured_on != row["device"]:
        where = f"{new_margin.measured_on}'s measurement"
    else:
        where = "measured"
    eff = efficiency_for(row["device"], model_family(config))
    old_time = f"roofline MFU <= {row['old_mfu']:.0%}" if row["old_mfu"] else "roofline"
    new_time = eff.describe()[:40] if eff else f"no time (no efficiency measured on {row['device']})"
    fits = lambda h: "fits" if h >= 0 else "**does not fit**"  # noqa: E731
    times = "" if short else f" {old_time} | {new_time} |"
    return (f"| {row['name']} | {row['world']} x {row['device']} | {row['peak'] / GIB:.1f}"
            + (f" + {skew.extra_bytes / GIB:.2f} skew" if skew.extra_bytes else "")
            + f" | {old_reserve / GIB:.1f}: {fits(old_head)} ({old_head:.0%}) | {new_reserve / GIB:.1f}: "
            f"{fits(new_head)} ({new_head:.0%}) | {where} |{times}")


def main() -> int:
    short = "--short" in sys.argv[1:]
    print("| recipe | ranks x device | traced peak GiB | before: reserve GiB, verdict (headroom) | after: reserve GiB, "
          "verdict (headroom) | reserve from |" + ("" if short else " time before | time after |"))
    print("| --- | --- | --- | --- | --- | --- |" + ("" if short else " --- | --- |"))
    for row in recorded():
        print(verdict_row(row, short))
    return 0


if __name__ == "__main__":
    sys.exit(main())
