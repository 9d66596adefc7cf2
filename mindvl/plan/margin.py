"""The planner's margin over the traced peak: the reserve and the routing-skew factor, from measurement.

The trace (mindvl.plan.simulate) counts the tensors a step holds, as FSDP2's memory tracker does. What it cannot
see, and the reserve covers, per rank:

    reserve = runtime context + communication buffers + (growth - 1) x (traced peak + routing-skew term)
    growth  = max(1, allocated / planned) x max(1, reserved / allocated)

- runtime context: the CUDA/CANN context and its libraries (memory outside the allocator on one device);
- communication buffers: NCCL/HCCL's per-peer buffers (absent on one device, so a one-GPU run cannot measure them);
- allocated / planned: the allocator's high-water over the planned peak at the same shape (alignment, tensors the
  tracker misses, kernel workspaces); a ratio below 1 (the plan over-counts) earns no credit;
- reserved / allocated: what the caching allocator holds beyond what it handed out at its high-water
  (fragmentation): a GPU's `max_memory_reserved / max_memory_allocated` of the real step.

The numbers live in `margin.json` beside this module, each with where it came from. Until a GPU run records its
own (`python -m mindvl.plan.margin --from-proof OUT/proof.json`, from benchmarks/accelerator_proof.py's output),
the ratios are CPU stand-ins (benchmarks/bench_plan_margin.py: c10's CPU allocator high-water against the plan in
one process, and the C library heap's peak-RSS growth over that high-water) and the fixed parts are the stated
1 GiB + 1 GiB the reserve always had. The stated reserve it replaces: 2 GiB + 5% of the device's capacity.

Routing skew: `routing_skew.factor` is the planner's default capacity factor (mindvl.plan.skew): the busiest EP rank
receives factor x its balanced share of routed rows. Its source is stated in the file: a measured rank-level
factor of a real tiny MoE run (bench_plan_margin.py skew), raised to the capacity factor of Switch Transformer
(Fedus, Zoph, Shazeer 2022, "Switch Transformers", JMLR 23(120), section 2.2: capacity factor 1.25 in training)
when the tiny run measures less: a tiny run on little data is no proof of a 671B router's balance.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from .devices import GIB

MARGIN_FILE = Path(__file__).with_name("margin.json")


def stated_reserve_bytes(capacity_bytes: int) -> int:
    """The reserve before it was measured: 2 GiB + 5% of capacity (kept for before/after comparisons)."""
    return int(2 * GIB + 0.05 * capacity_bytes)


@dataclass(frozen=True)
class Margin:
    runtime_context_bytes: int
    comm_buffers_bytes: int
    allocated_over_planned: float
    reserved_over_allocated: float
    skew_factor: float
    sources: dict[str, str]  # where each number came from

    @property
    def growth(self) -> float:
        """How much the allocator's footprint exceeds the planned bytes (>= 1: over-counting plans earn no credit)."""
        return max(1.0, self.allocated_over_planned) * max(1.0, self.reserved_over_allocated)

    @property
    def fixed_bytes(self) -> int:
        return self.runtime_context_bytes + self.comm_buffers_bytes

    def reserve_bytes(self, planned_bytes: int) -> int:
        """The reserve for a rank whose traced peak (plus routing-skew term) is `planned_bytes`."""
        return int(self.fixed_bytes + (self.growth - 1.0) * planned_bytes)

    def describe(self) -> str:
        where = self.sources.get("measured_on", "?")
        return (f"{self.fixed_bytes / GIB:.1f} GiB runtime + comm buffers + {self.growth - 1:.1%} of the peak "
                f"(allocator growth, {where}; mindvl/plan/margin.json)")


_KEYS = {"runtime_context_gib": float, "comm_buffers_gib": float, "allocated_over_planned": float,
         "reserved_over_allocated": float}


def load_margin(path: Path | str | None = None) -> Margin:
    """margin.json (or `path`), validated: a bad file is a one-line error naming the file and key."""
    path = Path(path) if path else MARGIN_FILE
    try:
        raw = json.loads(path.read_text())
        reserve, skew = raw["reserve"], raw["routing_skew"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a planner margin file ({type(e).__name__}: {e}); restore it from git") from None
    values = {}
    for key in _KEYS:
        v = reserve.get(key)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            raise ValueError(f"{path}: reserve.{key} must be a number >= 0, got {v!r}")
        values[key] = float(v)
    factor = skew.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor < 1:
        raise ValueError(f"{path}: routing_skew.factor must be a number >= 1 (1 = balanced), got {factor!r}")
    sources = {k: str(v) for k, v in reserve.items() if k not in _KEYS}
    sources["routing_skew"] = str(skew.get("source", ""))
    return Margin(int(values["runtime_context_gib"] * GIB), int(values["comm_buffers_gib"] * GIB),
                  values["allocated_over_planned"], values["reserved_over_allocated"], float(factor), sources)


def reserve_from_proof(proof: dict) -> dict:
    """margin.json's `reserve` section from benchmarks/accelerator_proof.py's proof.json: the real step on the
    planner's packs (`mindvl.memory_planner_packs`) against the planner's peak for them (`sections.plan`)."""
    sections = proof.get("sections", {})
    plan = sections.get("plan", {})
    mem = sections.get("mindvl", {}).get("memory_planner_packs") or proof.get("mindvl", {}).get(
        "memory_planner_packs")
    if not plan.get("ok") or not plan.get("peak_bytes_per_rank") or not mem:
        raise ValueError("proof.json: no planner peak and real-step memory of the same packs (sections plan and "
                         "mindvl.memory_planner_packs); run the proof on a GPU with both sections succeeding")
    if proof.get("dry_run"):
        raise ValueError("proof.json: a --dry-run on CPU records no allocator figures; use a GPU run's proof.json")
    device = sections.get("environment", {}).get("gpu") or "a GPU"
    planned, alloc, reserved = plan["peak_bytes_per_rank"], mem["max_allocated_bytes"], mem["max_reserved_bytes"]
    return {
        "runtime_context_gib": round(mem["outside_allocator_bytes"] / GIB, 3),
        "comm_buffers_gib": 1.0,
        "allocated_over_planned": round(alloc / planned, 4),
        "reserved_over_allocated": round(reserved / alloc, 4),
        "measured_on": f"{device} (benchmarks/accelerator_proof.py, the mid-size SFT 8K step on the planner's packs)",
        "runtime_context_source": "measured: device memory in use outside the caching allocator after the step",
        "comm_buffers_source": "stated: NCCL/HCCL per-peer buffers, ~1 GiB; a one-device run has none to measure",
        "allocated_over_planned_source": f"measured: max_memory_allocated {alloc} / planned peak {planned}",
        "reserved_over_allocated_source": f"measured: max_memory_reserved {reserved} / max_memory_allocated {alloc}",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mindvl.plan.margin",
                                description="show the planner's margin, or record a GPU proof's measured reserve")
    p.add_argument("--from-proof", metavar="PROOF_JSON", help="benchmarks/accelerator_proof.py's proof.json")
    p.add_argument("--file", default=str(MARGIN_FILE), help="the margin file to read / update")
    args = p.parse_args(argv)
    try:
        if args.from_proof:
            raw = json.loads(Path(args.file).read_text())
            raw["reserve"] = reserve_from_proof(json.loads(Path(args.from_proof).read_text()))
            Path(args.file).write_text(json.dumps(raw, indent=1) + "\n")
        m = load_margin(args.file)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"reserve = {m.describe()}; routing skew factor {m.skew_factor} ({m.sources['routing_skew']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
